"""Qwen2.5-VL in one process: M-RoPE positions as HF's get_rope_index, image features scattered at the pad tokens
(a mismatch refused by name), logits and gradients (vision tower included) against HF transformers' own model,
HF -> torch_dist -> HF bit for bit, and the layouts / runs not built yet refused by name. DP2 / TP2:
tests/dist/test_vlm_layouts.py."""

import glob
import re
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.errors import BridgeError, ConfigError
from megatron_rl.models import get_bridge, vlm_parity
from megatron_rl.models.mrope import check_image_tokens, mrope_position_ids, scatter_image_features
from megatron_rl.models.parallel import ParallelLayout

SAMPLES = [(9, [(1, 4, 8)]), (5, [(1, 4, 4), (1, 8, 4)]), (12, [])]


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


@pytest.fixture(scope="module")
def vl(tiny_hf_models):
    path = tiny_hf_models("qwen2_5_vl")
    return path, get_bridge(path), vlm_parity.load_hf_model(path)


def test_mrope_positions_are_hf_get_rope_index(vl):
    _, bridge, hf = vl
    for sample in vlm_parity.random_samples(bridge, SAMPLES[:2] + [(3, [(2, 4, 6)])], seed=3):
        ids = sample.input_ids[None]
        want, _ = hf.model.get_rope_index(ids, (ids == bridge.image_token_id).int(), sample.image_grid_thw)
        got = mrope_position_ids(sample.input_ids, sample.image_grid_thw, bridge.image_token_id, 2)
        assert torch.equal(got, want[:, 0])
    text = torch.arange(7)
    assert torch.equal(mrope_position_ids(text, None, 240, 2), torch.arange(7).expand(3, 7))


def test_megatron_multimodal_rotary_embedding_is_hf_mrope_bit_for_bit(single_rank, vl):
    """megatron-core 0.16.1's MultimodalRotaryEmbedding (sections doubled over [freqs, freqs]) gives the cos/sin
    transformers' Qwen2.5-VL rotary embedding recomposes (sections over freqs, then doubled), bitwise."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    _, bridge, hf = vl
    sample = vlm_parity.random_samples(bridge, SAMPLES[1:2], seed=5)[0]
    pos = mrope_position_ids(sample.input_ids, sample.image_grid_thw, bridge.image_token_id, 2)[:, None, :] * 37
    ours = MultimodalRotaryEmbedding(kv_channels=bridge.head_dim, rotary_percent=1.0, rotary_base=bridge.rope_theta)
    freqs = ours(pos, bridge.mrope_section)[:, 0, 0]  # [s, head_dim]
    cos, sin = Qwen2_5_VLRotaryEmbedding(hf.config.text_config)(torch.zeros(1), pos)
    assert torch.equal(torch.cos(freqs), cos[0]) and torch.equal(torch.sin(freqs), sin[0])


def test_features_go_to_the_pad_tokens_in_batch_order_as_hf_masked_scatter():
    ids = torch.tensor([[1, 9, 9, 2, 9], [9, 3, 9, 9, 4]])
    emb = torch.randn(5, 2, 3)  # megatron's [s, b, h]
    feats = torch.randn(int((ids == 9).sum()), 3)
    got = scatter_image_features(emb, ids, feats, 9)
    want = emb.transpose(0, 1).masked_scatter((ids == 9)[..., None], feats).transpose(0, 1)
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def model(single_rank, vl):
    """The tiny checkpoint loaded into megatron-core at one process."""
    path, bridge, _ = vl
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, path)
    return chunks


def test_a_sample_whose_pad_tokens_disagree_with_its_images_is_refused_by_name(vl, model):
    _, bridge, _ = vl
    sample = vlm_parity.random_samples(bridge, SAMPLES[:1], seed=0)[0]
    short = sample.input_ids[sample.input_ids != bridge.image_token_id][:4]
    with pytest.raises(ConfigError, match=r"prompt 7: its image-pad tokens \(id 240\) come in runs of \[\] but its 1 "
                                          r"image\(s\) \(image_grid_thw \[\[1, 4, 8\]\]"):
        check_image_tokens(short, sample.image_grid_thw, bridge.image_token_id, 2, "prompt 7")
    with pytest.raises(ConfigError, match="pixel_values has 31 patch rows but image_grid_thw"):
        check_image_tokens(sample.input_ids, sample.image_grid_thw, bridge.image_token_id, 2, "x", pixel_rows=31)
    with pytest.raises(ConfigError, match=r"image_grid_thw \[\[1, 3, 8\]\] are not positive grids"):
        check_image_tokens(sample.input_ids, torch.tensor([[1, 3, 8]]), bridge.image_token_id, 2, "x")
    chunks = model
    with torch.no_grad(), pytest.raises(ConfigError, match=r"pixel_values has shape \[32, 12\], the vision tower "
                                                           r"takes \[patches, 24\]"):
        chunks[0](sample.input_ids[None], torch.arange(len(sample.input_ids))[None], None,
                  pixel_values=sample.pixel_values[:, :12], image_grid_thw=sample.image_grid_thw)
    two = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    wrong = torch.tensor([[1, 240, 240, 4]])  # 2 pad tokens, the image gives 8 features
    with torch.no_grad(), pytest.raises(ConfigError, match=r"micro-batch: its image-pad tokens.*runs of \[2\]"):
        chunks[0](wrong, torch.arange(4)[None], None, pixel_values=sample.pixel_values,
                  image_grid_thw=sample.image_grid_thw)
    with torch.no_grad(), pytest.raises(ConfigError, match="2 image-pad tokens .* but no pixel_values"):
        chunks[0](wrong, torch.arange(4)[None], None)
    with torch.no_grad():  # text only: no images, no pad tokens
        assert chunks[0](two, torch.arange(4).expand(2, 4), None).shape[:2] == (2, 4)


def test_one_process_logits_and_gradients_equal_hf_and_export_is_bit_exact(vl, model):
    path, bridge, hf = vl
    chunks = model
    built = {s.canonical_name: tuple(s.param.shape) for s in _slots(chunks)}
    assert built == bridge.megatron_param_shapes()
    samples = vlm_parity.random_samples(bridge, SAMPLES, seed=1)
    microbatches = [samples[1:], samples[:1]]  # packed: two images + text only in one THD batch, then one image
    for c in chunks:
        c.zero_grad()
    logits = vlm_parity.megatron_run(chunks, microbatches, bridge.vocab_size, forward_only=False)
    hf.zero_grad()
    ref: list = []
    vlm_parity.hf_loss(hf, [microbatches], bridge.image_token_id, logits_out=ref).backward()
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref)) <= 1e-5
    want = vlm_parity.hf_grads(hf)
    got = vlm_parity.exported_grads(bridge, chunks)
    assert sum(n.startswith("visual.") for n in got) == 30
    assert vlm_parity.max_diff(got, want) <= 1e-5 * max(g.abs().max().item() for g in want.values())
    with torch.no_grad():  # one unpacked [1, s] sample per micro-batch: the same logits
        unpacked = vlm_parity.megatron_run(chunks, [[samples[1]]], bridge.vocab_size, packed=False)
    assert (unpacked[0] - ref[0]).abs().max().item() <= 1e-5
    exported = dict(bridge.export_hf_weights(chunks))
    original = load_file(os.path.join(path, "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[n], t) for n, t in original.items())


def _slots(chunks):
    from megatron_rl.models.weights import canonical_parameters

    return [s for c in chunks for s in canonical_parameters(c)]


def test_hf_to_torch_dist_to_hf_is_bit_exact_vision_included(single_rank, vl, tmp_path):
    from megatron_rl.convert.dist_to_hf import convert_dist_to_hf
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist

    path, _, _ = vl
    convert_hf_to_dist(path, str(tmp_path / "dist"), show_progress=False)
    convert_dist_to_hf(str(tmp_path / "dist"), str(tmp_path / "back"), show_progress=False)
    original = load_file(os.path.join(path, "model.safetensors"))
    back = {n: t for f in glob.glob(str(tmp_path / "back" / "*.safetensors")) for n, t in load_file(f).items()}
    assert set(back) == set(original) and any(n.startswith("visual.") for n in back)
    assert all(torch.equal(back[n], t) for n, t in original.items())
    with open(tmp_path / "back" / "config.json") as fh:
        assert json.load(fh)["model_type"] == "qwen2_5_vl"


@pytest.mark.parametrize("layout, needle", [
    (ParallelLayout(pp=2, vpp=2), "virtual pipeline parallelism 2 with a vision-language model")])
def test_layouts_not_built_yet_are_refused_by_name(vl, layout, needle):
    _, bridge, _ = vl
    with pytest.raises(BridgeError, match=needle):
        bridge.transformer_config(layout)


def test_a_config_without_mrope_sections_is_refused(vl):
    _, bridge, _ = vl
    config = dict(bridge.vl_config, text_config=dict(bridge.vl_config["text_config"],
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    with pytest.raises(BridgeError, match="rope_parameters without mrope_section"):
        get_bridge(config)


def test_what_a_vision_language_run_may_combine_is_decided_at_validation(vl):
    """A VL checkpoint validates with the megatron backend and the embedded engine (images, --freeze-vision-tower);
    the combinations not built are refused by name before any worker starts (config/vlm_rules.py)."""
    from megatron_rl.config.flags import parse_config

    path, _, _ = vl
    base = ["--hf-checkpoint", path, "--rollout-backend", "embedded", "--multimodal-keys", '{"image": "images"}']
    cfg = parse_config(base + ["--freeze-vision-tower"])
    assert cfg.model.freeze_vision_tower and cfg.data.multimodal_keys
    # the served engine (the asynchronous modes' default) takes the images in /generate's image_data
    assert parse_config(base + ["--async-mode", "one-step"]).embedded_placement == "process"
    for flags, refusal in [
            (["--train-backend", "fsdp"], "--train-backend fsdp with --hf-checkpoint"),
            (["--advantage-estimator", "ppo"], "--advantage-estimator ppo with"),
            (["--lora-rank", "4"], "--lora-rank 4 with"),
            (["--freeze-vision-tower", "--offload-rollout"], "--freeze-vision-tower with --offload-rollout")]:
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            parse_config(base + flags)
    sglang = ["--hf-checkpoint", path, "--rollout-backend", "sglang", "--rollout-engine-urls", "http://127.0.0.1:1"]
    with pytest.raises(ConfigError, match=r"--rollout-backend sglang with --update-weight-transport distributed "
                                          r"with .*checked with the disk weight transport only"):
        parse_config(sglang)
    disk = ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/w"]
    with pytest.raises(ConfigError, match=r"--rollout-engine-urls \(servers started elsewhere\) without "
                                          r"--freeze-vision-tower with .*SGLANG_VLM_CACHE_SIZE_MB=0"):
        parse_config(sglang + disk)
    assert parse_config(sglang + disk + ["--freeze-vision-tower"]).rollout.rollout_backend == "sglang"
