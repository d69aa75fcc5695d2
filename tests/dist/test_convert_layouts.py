"""torch_dist written at one layout exports bit-exactly at others (one 2-rank launch).

HF -> torch_dist at TP1 (x DP2) and at TP2 (with --verify), then torch_dist -> HF
at TP2 / TP1 / PP2 and, for the MoE families qwen3_moe, glm4_moe and qwen3_next, EP2 and
TP2xEP2(ETP1); a glm4_moe checkpoint with its MTP layer written at PP2 and exported at
TP2 / TP1. Every exported tensor must equal the HF source bit for bit (stronger
than equal logits). The
streaming HF -> torch_dist writer's output at TP2, PP2 (llama) and EP2 (MoE)
must equal ``dist_checkpointing.save`` of the loaded model byte for byte.
"""

from __future__ import annotations

import os

import pytest
import torch

from _util import read_json

pytestmark = pytest.mark.dist

# glm4_moe adds shared experts and the router's expert_bias buffer; mixtral only renames qwen3_moe's
# tensors (tests/convert round-trips it in one process, tests/dist/test_parity_layouts exports it at EP2);
# qwen3_next's gated delta-net shards its own parameters (conv_weight, A_log, dt_bias) over TP
MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "qwen3_next")


def shared_launch(ctx):
    """One 2-rank job in the group's launch (tests/_launches.py): every family converted at TP1/TP2 (EP2,
    PP2) and exported back at the other layouts; its output dir."""
    out = ctx.tmp_path_factory.mktemp("convert_layouts")
    yield {2: [("convert", ["--mode", "layouts", "--out", out, "--family", "llama", *MOE_FAMILIES, "--mtp"])]}
    return out


def test_torch_dist_reshards_across_layouts(shared_launch_state):
    tmp_path = shared_launch_state
    res = read_json(tmp_path / "results.json")
    assert set(res) == {"llama", *MOE_FAMILIES, "glm4_moe_mtp"}
    # a checkpoint's MTP layer (--mtp-num-layers): written at PP2 (MTP block on the last stage), exported at TP2/TP1
    assert set(res["glm4_moe_mtp"]["exports"]) == {"pp2_to_tp2", "pp2_to_tp1"}
    assert set(res["llama"]["exports"]) == {"tp1_to_tp2", "tp2_to_pp2", "tp2_to_tp1"}
    assert set(res["llama"]["vs_megatron_save"]) == {"tp2", "pp2", "pp2_tied"}
    for fam in MOE_FAMILIES:  # glm4_moe: its router's expert_bias buffer travels like a parameter
        assert set(res[fam]["exports"]) >= {"tp2_to_ep2", "tp1_to_tp2ep2"}
        assert set(res[fam]["vs_megatron_save"]) == {"tp2", "ep2"}
    for fam, r in res.items():
        for lay, diffs in r["vs_megatron_save"].items():
            assert diffs == [], (fam, lay, diffs)  # streaming writer == dist_checkpointing.save, per rank shard
        for name, out in r["exports"].items():
            assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")), (fam, name)
            assert_same_tensors(r["hf"], out)


def assert_same_tensors(a_dir, b_dir):
    """Same names, dtypes, shapes and bytes (compared as raw bytes, so -0.0/NaN count too)."""
    from megatron_rl.models.hf_checkpoint import HFCheckpoint

    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    try:
        assert a.names() == b.names(), sorted(a.names() ^ b.names())
        for n in sorted(a.names()):
            x, y = a.read(n), b.read(n)
            assert x.dtype == y.dtype and x.shape == y.shape, n
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{n} differs in {b_dir}"
    finally:
        a.close()
        b.close()
