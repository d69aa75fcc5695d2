"""Rollout with images through SGLang's ``/generate`` protocol: the client sends each row's images in
``image_data`` (``data:`` URLs of the prompt data's own bytes), and the embedded engine server
(``--embedded-engine-ranks process``) and the SGLang stand-in run them through the checkpoint's image processor;
the tokens and log-probs equal the driver-side embedded engine's for the same prompts and seed."""

import dataclasses
import io
import pickle

import pytest

from megatron_rl.data.images import ImageProcessor, VisionInputs
from megatron_rl.data.types import GenerateRequest, SamplingParams
from megatron_rl.errors import EngineError
from megatron_rl.rollout.embedded import EmbeddedEngine, EngineRow, row_seed
from megatron_rl.rollout.embedded_server import EmbeddedServer, image_data_rows
from megatron_rl.rollout.sglang import protocol
from megatron_rl.rollout.sglang.client import SGLangClient
from megatron_rl.rollout.sglang.engine import SGLangEngine, one_pad_per_image
from sglang_standin import SGLangStandIn

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5, seed=7, n=2, ignore_eos=True)
START, PAD, END = 242, 240, 243  # the tiny Qwen2.5-VL's vision start, image pad, vision end (models/hf_tiny.py)
LOGPROB_TOL = 2e-5  # one row per prefill (served) vs a prompt's prefill shared by its rows (driver): float32 noise


def png(width: int, height: int, color: tuple) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    image = Image.new("RGB", (width, height), color)
    image.putpixel((1, 1), (255 - color[0], 7, 99))
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl(tiny_hf_models):
    path = tiny_hf_models("qwen2_5_vl")
    processor = ImageProcessor(path)
    # a prompt with one image, one with two images of different sizes, a text-only one
    layouts = [([5, 6], [png(16, 16, (200, 10, 10))]), ([7], [png(8, 8, (10, 200, 10)), png(16, 8, (9, 9, 250))]),
               ([8, 9, 10], [])]
    requests = []
    for k, (text, images) in enumerate(layouts):
        vision = processor.process(images, f"prompt {k}")
        prompt = list(text) + [t for _ in images for t in (START, PAD, END, 11)]
        requests.append(GenerateRequest(processor.expand(prompt, vision, f"prompt {k}"), k,
                                        multimodal_inputs=vision))
    engine = EmbeddedEngine(path)
    return path, engine, requests, engine.generate(requests, SAMPLING)


def same_rollout(got, want):
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.rollout_logprobs, w.rollout_logprobs)) \
        <= LOGPROB_TOL
    assert [s.multimodal_inputs for s in got] == [s.multimodal_inputs for s in want]  # carried to the trainer


def test_the_served_engine_takes_image_data_and_equals_the_driver_side_engine(vl):
    path, engine, requests, want = vl
    assert requests[0].multimodal_inputs.sources is not None and want[0].multimodal_inputs is requests[0].\
        multimodal_inputs
    server = EmbeddedServer(engine, model_path=path).start()
    client = SGLangEngine([server.url], releases_memory=False, health_interval_s=0, hf_checkpoint=path)
    try:
        same_rollout(client.generate(requests, SAMPLING), want)
        raw = SGLangClient(server.url)
        # SGLang's forms: one pad token per image (the server expands it, as SGLang's processor does) gives the
        # expanded prompt's tokens; one request's image_data a plain list of its images
        one_pad = [5, 6, START, PAD, END, 11]
        sp = protocol.sampling_params_dict(SAMPLING, seed=protocol.row_seed(7, 0, 0))
        got = raw.generate_one(one_pad, sp, rid="a", image_data=requests[0].multimodal_inputs.data_urls())
        assert got["output_ids"] == want[0].response_ids
        assert got["meta_info"]["prompt_tokens"] == len(requests[0].prompt_ids)
        # refused by name: pad tokens without images, a placeholder count that is not the images'
        with pytest.raises(EngineError, match="hold image-pad tokens .* no image_data"):
            raw.generate_one(one_pad, sp, rid="b")
        with pytest.raises(EngineError, match="1 image placeholder.* 2 image"):
            raw.generate_one(one_pad, sp, rid="c", image_data=requests[1].multimodal_inputs.data_urls())
    finally:
        client.close()
        server.stop()


def test_the_sglang_client_sends_image_data_as_sglang_reads_it(vl):
    """The stand-in (SGLang 0.5.23's protocol) records each row's ``image_data``: its prompt's images as ``data:``
    URLs of their own bytes, ``[]`` for the text-only row; each row's tokens are the engine's for that prompt with
    its images (the stand-in seeds a row's generator from its ``sampling_seed`` as a one-row call's first row)."""
    path, engine, requests, _ = vl
    requests = requests[1:]  # two images of different sizes, and a text-only row
    with SGLangStandIn(path) as standin:
        client = SGLangEngine([standin.url], releases_memory=False, health_interval_s=0, hf_checkpoint=path)
        try:
            got = client.generate(requests, dataclasses.replace(SAMPLING, n=1))
        finally:
            client.close()
        sent = [standin.generated[rid] for rid in standin.rids_served]
    which = (0, 1)
    assert [row["image_data"] for row in sent] == [requests[i].multimodal_inputs.data_urls() if i < 1 else []
                                                   for i in which]
    assert sent[0]["image_data"][0].startswith("data:image/png;base64,")
    for i, sample, row in zip(which, got, sent):
        req = requests[i]
        seed = row_seed(row["sampling_params"]["sampling_seed"], 0, 0)
        alone = engine.generate_rows([EngineRow(req.prompt_ids, seed, 5, images=req.multimodal_inputs)], SAMPLING)[0]
        assert sample.response_ids == alone.response_ids and sample.multimodal_inputs is req.multimodal_inputs


def test_image_data_is_read_as_sglangs_generate_req_input_reads_it():
    assert image_data_rows(None, 2, True) == ([[], []], None)
    assert image_data_rows("x", 2, True) == ([["x"], ["x"]], None)  # one image for every row
    assert image_data_rows(["x", "y"], 2, True) == ([["x"], ["y"]], None)  # one image per row
    assert image_data_rows([["x", "y"], []], 2, True) == ([["x", "y"], []], None)
    assert image_data_rows(["x", "y"], 1, False) == ([["x", "y"]], None)  # one request's images
    assert image_data_rows(["x"], 2, True)[1] == "The length of image_data (1) should be equal to the batch size (2)."
    payload = protocol.generate_payload([[1], [2]], [{}, {}], image_data=[["u"], []])
    assert payload["image_data"] == [["u"], []]
    assert "image_data" not in protocol.generate_payload([[1]], [{}], image_data=[[]])


def test_images_without_their_bytes_cannot_go_over_http(vl):
    _, _, requests, _ = vl
    kept = pickle.loads(pickle.dumps(requests[0].multimodal_inputs))  # rollout checkpoints, async buffers, dumps
    assert kept.sources == requests[0].multimodal_inputs.sources and kept == requests[0].multimodal_inputs
    bare = VisionInputs(requests[0].multimodal_inputs.pixel_values, requests[0].multimodal_inputs.image_grid_thw)
    with pytest.raises(ValueError, match="carry no encoded bytes"):
        bare.data_urls()
    from megatron_rl.rollout.sglang.engine import request_images

    with pytest.raises(EngineError, match="prompt of group_index 0: these images carry no encoded bytes"):
        request_images([GenerateRequest(requests[0].prompt_ids, 0, multimodal_inputs=bare)])


def test_a_server_that_ran_the_prompt_without_its_images_is_named(vl):
    """SGLang given images it finds no slot for warns and generates without them; its ``meta_info.prompt_tokens``
    (the collapsed prompt's count, not the expanded one) gives it away, and the rollout stops naming it."""
    path, _, requests, _ = vl
    engine = SGLangEngine(["http://127.0.0.1:9"], releases_memory=False, health_interval_s=0, hf_checkpoint=path)
    try:
        sent = one_pad_per_image(requests[0].prompt_ids, PAD)
        assert sent == [5, 6, START, PAD, END, 11]
        out = protocol.GenerateOutput(output_ids=[3], logprobs=[-1.0], finish_reason="length", weight_version=0,
                                      text="", prompt_tokens=len(sent))
        with pytest.raises(EngineError, match="ran a prompt of 6 tokens, but with its 1 image.* has 21"):
            engine._samples(requests[:1], dataclasses.replace(SAMPLING, n=1), {(0, 0): out})
    finally:
        engine.close()
