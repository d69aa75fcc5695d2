"""Images in prompt data (--multimodal-keys, verl's parquet images column): read in every form, processed once by
the tiny VL checkpoint's own image processor, pad tokens expanded as the model checks them, bad images refused by
name, and the vision inputs carried exactly through requests, samples, the sample codec and pickled dumps."""

import base64
import dataclasses
import io
import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_rl.config.multimodal import parse_multimodal_keys
from megatron_rl.data import images as images_mod
from megatron_rl.data import sample_codec
from megatron_rl.data.images import ImageProcessor, VisionInputs
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import HeldElsewhereError, Sample, SampleStub, mark_prompt
from megatron_rl.errors import ConfigError
from megatron_rl.models.hf_tiny import VL_TOKENS, build_tiny_vl_processor_dir
from megatron_rl.models.mrope import check_image_tokens

IMAGE = VL_TOKENS["qwen2_5_vl"]["image_token_id"]
START, END = VL_TOKENS["qwen2_5_vl"]["vision_start_token_id"], VL_TOKENS["qwen2_5_vl"]["vision_end_token_id"]
KEYS = {"image": "images"}


def png(width, height, color=(200, 30, 60)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """config.json and preprocessor_config.json as build_tiny_hf_model writes them (no weights: never loaded)."""
    return build_tiny_vl_processor_dir("qwen2_5_vl", tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def processor(vl_dir):
    return ImageProcessor(vl_dir)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def dataset(path, processor, **kw):
    return PromptDataset(path, multimodal_keys=KEYS, image_processor=processor, label_key=None, **kw)


def test_multimodal_keys_are_parsed_or_refused_by_name():
    assert parse_multimodal_keys('{"image": "images"}') == KEYS and parse_multimodal_keys(None) == {}
    for bad, says in (("{image: x}", "not JSON"), ('["images"]', "expected a non-empty JSON object"),
                      ('{"video": "videos"}', "video inputs are not built here"),
                      ('{"sound": "x"}', "unknown modality 'sound'"), ('{"image": ""}', "give the name of the")):
        with pytest.raises(ConfigError, match=rf"^--multimodal-keys .*{says}"):
            parse_multimodal_keys(bad)


def test_every_image_form_gives_the_processors_pixels_and_expanded_pad_tokens(tmp_path, vl_dir, processor):
    from PIL import Image
    from transformers import AutoImageProcessor

    red, blue = png(10, 7), png(20, 12, (0, 0, 255))
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(red)
    (tmp_path / "img" / "red").write_bytes(red)  # no extension: found as a file, not read as base64
    b64 = base64.b64encode(red).decode()
    forms = [str(tmp_path / "img" / "red.png"), "img/red.png", "img/red", "file://" + str(tmp_path / "img" / "red.png"), b64,
             "data:image/png;base64," + b64, {"bytes": b64, "path": None}, {"path": "img/red.png"}]
    records = [{"prompt": [1, START, IMAGE, END, 5], "images": form} for form in forms]
    records.append({"prompt": [1, START, IMAGE, END, 7, START, IMAGE, END], "images": [b64, base64.b64encode(
        blue).decode()]})
    records.append({"prompt": [3, 4]})  # text only: no images, no pad tokens
    ds = dataset(write_jsonl(tmp_path / "p.jsonl", records), processor)
    # the checkpoint's own processor (its preprocessor_config.json), on the decoded images
    hf = AutoImageProcessor.from_pretrained(vl_dir, local_files_only=True)
    ref = hf(images=[Image.open(io.BytesIO(red)).convert("RGB")], return_tensors="np")
    one = VisionInputs(ref["pixel_values"].astype(np.float32), ref["image_grid_thw"].astype(np.int64))
    n = one.tokens_per_image(2)[0]
    for k in range(len(forms)):
        assert ds[k].multimodal_inputs == one, forms[k]
        assert ds[k].prompt_ids == [1, START] + [IMAGE] * n + [END, 5]
    two = ds[len(forms)].multimodal_inputs
    assert two.num_images == 2 and two.image_grid_thw.tolist()[0] == one.image_grid_thw.tolist()[0]
    assert ds[len(forms) + 1].multimodal_inputs is None and ds[len(forms) + 1].prompt_ids == [3, 4]
    # what the model's own check accepts: runs of each image's features, pixel rows = the grids' patches
    for prompt in (ds[0], ds[len(forms)]):
        v = prompt.multimodal_inputs
        check_image_tokens(torch.tensor(prompt.prompt_ids), torch.from_numpy(v.image_grid_thw), IMAGE, 2,
                           pixel_rows=v.pixel_values.shape[0])
    # the expanded prompt is what --rollout-max-prompt-len counts
    with pytest.raises(ConfigError, match=rf"line 1: prompt has {n + 4} tokens, more than --rollout-max-prompt-len"):
        dataset(write_jsonl(tmp_path / "q.jsonl", records[:1]), processor, max_prompt_len=n + 3)


def test_a_jpegs_base64_is_not_taken_for_a_path(tmp_path, processor):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (9, 9), (10, 200, 10)).save(buf, format="JPEG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    assert b64.startswith("/9j/")
    ds = dataset(write_jsonl(tmp_path / "j.jsonl", [{"prompt": [1, IMAGE], "images": b64}]), processor)
    assert ds[0].multimodal_inputs.num_images == 1


@pytest.mark.parametrize("record, says", [
    ({"prompt": [1, IMAGE], "images": "missing.png"}, r" image 0: no image file missing.png or .*missing.png; give"),
    ({"prompt": [1, IMAGE], "images": [base64.b64encode(b"not an image").decode()]},
     r" image 0: not an image PIL can read \(12 bytes"),
    ({"prompt": [1, IMAGE], "images": ["%%%"]}, r" image 0: '%%%' is neither an image file nor base64"),
    ({"prompt": [1, IMAGE], "images": [{"url": "x"}]}, r" image 0: an image dict needs 'bytes' or 'path'"),
    ({"prompt": [1, IMAGE], "images": [base64.b64encode(png(40, 40)[:60]).decode()]},
     r" image 0: the image's pixels cannot be decoded .* truncated or damaged"),
    ({"prompt": [1, IMAGE], "images": [base64.b64encode(png(65, 64)).decode()]},
     r" image 0: image is 65 x 64 = 4160 pixels, more than the 4096 decoded here"),
    ({"prompt": [1, IMAGE, IMAGE], "images": [base64.b64encode(png(8, 8)).decode()]},
     r": the prompt has 2 image placeholder\(s\) \(image-pad token id 240\) and the record 1 image\(s\)"),
    ({"prompt": [1, IMAGE]}, r": the prompt has 1 image placeholder\(s\) .* and the record 0 image\(s\)"),
])
def test_a_bad_image_is_refused_naming_line_column_and_image(tmp_path, processor, monkeypatch, record, says):
    monkeypatch.setattr(images_mod, "MAX_DECODED_PIXELS", 64 * 64)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [2, 3]}, record])
    with pytest.raises(ConfigError, match=rf"^--prompt-data {path} line 2 column 'images' \(--multimodal-keys\){says}"):
        dataset(path, processor)


def test_a_text_checkpoint_is_refused_as_image_processor(tiny_hf_models):
    path = tiny_hf_models("qwen2")
    with pytest.raises(ConfigError, match=rf"--multimodal-keys needs a vision-language --hf-checkpoint: {path}'s"):
        ImageProcessor(path)


def test_verl_parquet_images_column(tmp_path, processor):
    row = {"data_source": "geo3k", "prompt": [{"role": "user", "content": "how many?"}],
           "reward_model": {"style": "rule", "ground_truth": "2"},
           "images": [{"bytes": png(8, 8), "path": None}]}
    path = str(tmp_path / "geo.parquet")
    pq.write_table(pa.Table.from_pylist([row]), path)
    from megatron_rl.data.verl_parquet import read_verl_records

    [(_, record)] = list(read_verl_records(path, image_column="images"))
    assert record["images"] == [{"bytes": png(8, 8), "path": None}] and record["label"] == "2"
    assert processor.process(record["images"], "row 1").num_images == 1
    with pytest.raises(ConfigError, match=r"column 'images': images .*pass --multimodal-keys"):
        list(read_verl_records(path))


def slot_tokenizer(path):
    """A real HF fast tokenizer (one token per character, as tests/_tokenizer.py's) that also knows Qwen2.5-VL's
    vision-start / image-pad / vision-end tokens at the tiny VL model's ids."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests._tokenizer import CHAT_TEMPLATE, SPECIAL

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    slots = {"<|vision_start|>": START, "<|image_pad|>": IMAGE, "<|vision_end|>": END}
    tok = Tokenizer(models.WordLevel({**vocab, **slots}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=SPECIAL[3:] + list(slots))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def test_verl_geo3k_rows_with_image_markers_become_image_slots(tmp_path, processor):
    tok = slot_tokenizer(tmp_path / "tok")
    row = {"data_source": "hiyouga/geometry3k", "ability": "math",
           "prompt": [{"role": "user", "content": "<image>Find x."}],
           "reward_model": {"style": "rule", "ground_truth": "3"},
           "images": [{"bytes": png(8, 8), "path": None}]}
    path = str(tmp_path / "geo.parquet")
    pq.write_table(pa.Table.from_pylist([row, dict(row, images=[])]), path)
    with pytest.raises(ConfigError, match=r"row 2 column 'images' \(--multimodal-keys\): the prompt has 1 image "
                                          r"placeholder\(s\) .* and the record 0 image\(s\)"):
        PromptDataset(path, tokenizer=tok, apply_chat_template=True, multimodal_keys=KEYS, image_processor=processor)
    pq.write_table(pa.Table.from_pylist([row]), path)
    ds = PromptDataset(path, tokenizer=tok, apply_chat_template=True, multimodal_keys=KEYS, image_processor=processor)
    n = ds[0].multimodal_inputs.tokens_per_image(2)[0]
    assert "<|vision_start|><|image_pad|><|vision_end|>Find x." in ds[0].prompt_text
    at = ds[0].prompt_ids.index(START)
    assert ds[0].prompt_ids[at:at + n + 2] == [START] + [IMAGE] * n + [END]
    assert ds[0].prompt_ids.count(IMAGE) == n and (ds[0].label, ds[0].metadata["data_source"]) == ("3", row[
        "data_source"])


def test_vision_inputs_ride_requests_samples_codec_and_pickles_exactly(tmp_path, processor):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, IMAGE, 5], "images": base64.b64encode(
        png(12, 9)).decode()}, {"prompt": [4]}])
    batch = PromptIterator(dataset(path, processor), rollout_batch_size=2).take(2)
    vision = batch.requests[0].multimodal_inputs
    assert vision is not None and batch.requests[1].multimodal_inputs is None
    samples = []
    for req in batch.requests:
        s = Sample(group_index=req.group_index, prompt_ids=list(req.prompt_ids), response_ids=[9, 8])
        mark_prompt(s, req)
        samples.append(s)
    assert samples[0].multimodal_inputs is vision and samples[1].multimodal_inputs is None
    sizes, buf = sample_codec.encode(samples)
    back = sample_codec.decode(sizes.clone(), buf.clone())
    assert back == samples and back[0].multimodal_inputs is not vision
    got = back[0].multimodal_inputs
    assert got.pixel_values.dtype == np.float32 and got.image_grid_thw.dtype == np.int64
    # rollout checkpoints / async buffers (asdict then Sample(**)) and debug dumps (torch.save of vars)
    assert [Sample(**dataclasses.asdict(s)) for s in samples] == samples
    blob = io.BytesIO()
    torch.save({"samples": [vars(s) for s in samples]}, blob)
    assert [Sample(**d) for d in torch.load(io.BytesIO(blob.getvalue()), weights_only=False)["samples"]] == samples
    assert pickle.loads(pickle.dumps(samples)) == samples
    other = VisionInputs(got.pixel_values.astype(np.float64), got.image_grid_thw)
    assert other != got  # exact: dtype counts
    stub = SampleStub(group_index=0, prompt_length=3, response_length=2, num_rollout_logprobs=0, reward=0.0,
                      loss_mask=[], owner=1)
    with pytest.raises(HeldElsewhereError, match="its multimodal_inputs never reached this rank"):
        stub.multimodal_inputs  # noqa: B018


def test_multimodal_keys_with_a_text_checkpoint_is_refused_at_validation(tiny_hf_models):
    from megatron_rl.config.flags import parse_config

    hf = tiny_hf_models("qwen2")
    with pytest.raises(ConfigError, match=r"--multimodal-keys: --hf-checkpoint .* is not a vision-language checkpoint"):
        parse_config(["--hf-checkpoint", hf, "--multimodal-keys", '{"image": "images"}'])
    with pytest.raises(ConfigError, match=r"--multimodal-keys '\{\"video\": \"v\"\}': modality 'video'"):
        parse_config(["--hf-checkpoint", hf, "--multimodal-keys", '{"video": "v"}'])


def test_verls_image_key_maps_to_multimodal_keys():
    from megatron_rl.config.verl_keys import parse_overrides, translate

    [row] = translate(parse_overrides(["data.image_key=pics"]))
    assert row.tokens == ("--multimodal-keys", '{"image": "pics"}')


def test_pils_own_decompression_bomb_refusal_is_one_error_line(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL refuses above twice this, when it opens the header
    with pytest.raises(ConfigError, match=r"^row 1 image 0: image too large to decode .*downscale it in the data"):
        images_mod.decode_image(png(20, 20), "row 1 image 0")
