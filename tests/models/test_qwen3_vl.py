"""Qwen3-VL in one process: interleaved M-RoPE equal to transformers' bit for bit, positions as HF's
get_rope_index, DeepStack (vision features added after the first decoder layers), logits and gradients (the tower
and its DeepStack mergers included) against HF transformers' own model, HF -> torch_dist -> HF bit for bit (the MoE
variant's stacked experts too), and the pipeline layouts DeepStack cannot take refused by name. DP2 / TP2 + SP / PP2 /
CP2, and the MoE variant at EP2: tests/dist/test_vlm_layouts.py."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.errors import BridgeError
from megatron_rl.models import get_bridge, vlm_parity
from megatron_rl.models.mrope import mrope_position_ids
from megatron_rl.models.parallel import ParallelLayout

SAMPLES = [(9, [(1, 4, 8)]), (5, [(1, 4, 4), (1, 8, 4)]), (12, [])]
VISION_TENSORS = 57  # patch embed (2), position grid, 3 blocks (12 each), the merger and 2 DeepStack mergers (6 each)


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


@pytest.fixture(scope="module")
def vl(tiny_hf_models):
    path = tiny_hf_models("qwen3_vl")
    return path, get_bridge(path), vlm_parity.load_hf_model(path)


@pytest.fixture(scope="module")
def model(single_rank, vl):
    path, bridge, _ = vl
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, path)
    return chunks


def test_positions_are_hf_get_rope_index_and_interleaved_mrope_is_hf_bit_for_bit(vl, model):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    _, bridge, hf = vl
    assert bridge.mrope_interleaved and bridge.deepstack_layers == 2
    for sample in vlm_parity.random_samples(bridge, SAMPLES[:2] + [(3, [(2, 4, 6)])], seed=3):
        ids = sample.input_ids[None]
        want, _ = hf.model.get_rope_index(ids, (ids == bridge.image_token_id).int(), sample.image_grid_thw)
        got = mrope_position_ids(sample.input_ids, sample.image_grid_thw, bridge.image_token_id, 2)
        assert torch.equal(got, want[:, 0])
    pos = got[:, None, :] * 37
    freqs = model[0].rotary_pos_emb(pos, bridge.mrope_section)[:, 0, 0]  # [s, head_dim]
    cos, sin = Qwen3VLTextRotaryEmbedding(hf.config.text_config)(torch.zeros(1), pos)
    assert torch.equal(torch.cos(freqs), cos[0]) and torch.equal(torch.sin(freqs), sin[0])


def test_one_process_logits_and_gradients_equal_hf_with_deepstack_and_export_is_bit_exact(vl, model):
    path, bridge, hf = vl
    chunks = model
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
    assert sum(n.startswith("model.visual.") for n in got) == VISION_TENSORS
    assert all(got[f"model.visual.deepstack_merger_list.{k}.linear_fc2.weight"].abs().max() > 0 for k in range(2))
    assert vlm_parity.max_diff(got, want) <= 1e-5 * max(g.abs().max().item() for g in want.values())
    with torch.no_grad():  # without the DeepStack residuals the logits move: the hooks are what matches HF
        handles = chunks[0].decoder.layers[0]._forward_hooks, chunks[0].decoder.layers[1]._forward_hooks
        saved = [dict(h) for h in handles]
        for h in handles:
            h.clear()
        try:
            plain = vlm_parity.megatron_run(chunks, [[samples[0]]], bridge.vocab_size)
        finally:
            for h, kept in zip(handles, saved):
                h.update(kept)
    assert (plain[0] - ref[-1]).abs().max().item() > 1e-3
    exported = dict(bridge.export_hf_weights(chunks))
    original = load_file(os.path.join(path, "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[n], t) for n, t in original.items())


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_hf_to_torch_dist_to_hf_is_bit_exact_vision_included(single_rank, tiny_hf_models, tmp_path, family):
    """Qwen3-VL-MoE too: its stacked experts ([E, hidden, 2f] gate_up_proj, [E, f, hidden] down_proj, as the hub's)
    become megatron's per-expert linear_fc1 / linear_fc2 and come back bit for bit."""
    from megatron_rl.convert.dist_to_hf import convert_dist_to_hf
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist

    path = tiny_hf_models(family)
    convert_hf_to_dist(path, str(tmp_path / "dist"), show_progress=False)
    convert_dist_to_hf(str(tmp_path / "dist"), str(tmp_path / "back"), show_progress=False)
    original = load_file(os.path.join(path, "model.safetensors"))
    back = {n: t for f in glob.glob(str(tmp_path / "back" / "*.safetensors")) for n, t in load_file(f).items()}
    assert set(back) == set(original) and sum(n.startswith("model.visual.") for n in back) == VISION_TENSORS
    assert all(torch.equal(back[n], t) for n, t in original.items())
    if family == "qwen3_vl_moe":
        assert back["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 48)
    with open(tmp_path / "back" / "config.json") as fh:
        assert json.load(fh)["model_type"] == family


def test_pipeline_stages_that_split_the_deepstack_layers_are_refused_by_name(vl):
    _, bridge, _ = vl
    with pytest.raises(BridgeError, match=r"--pipeline-model-parallel-size 4: the first stage holds 1 decoder "
                                          r"layer\(s\) but the vision tower's DeepStack features go into the first 2"):
        bridge.transformer_config(ParallelLayout(pp=4))


def test_qwen3_vl_moe_runs_are_refused_by_name_until_the_engine_sync_is_built(tiny_hf_models):
    from megatron_rl.config.flags import parse_config
    from megatron_rl.errors import ConfigError

    path = tiny_hf_models("qwen3_vl_moe")
    with pytest.raises(ConfigError, match=r"model_type 'qwen3_vl_moe' runs are not built: the embedded engine's "
                                          r"weight sync of its stacked experts"):
        parse_config(["--hf-checkpoint", path, "--rollout-backend", "embedded"])
