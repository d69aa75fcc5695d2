"""Qwen2.5-VL and Qwen3-VL in megatron-core against HF transformers' own model at DP2, TP2, TP2 + sequence
parallelism, PP2 (the vision tower on the first stage) and CP2 (features written before the split), packed THD
micro-batches (real torchrun, gloo, fp32): logits and gradients (vision tower included) through megatron's DDP, in the
layouts group's 2-rank launch; the megatron backend with images at DP2, CP2, PP2 and TP2 + SP (Qwen2.5-VL)."""

import pytest

from _util import read_json
from _vlm_samples import LOGPROB_TOL, ONE_PROCESS_GRAD_NORM

pytestmark = pytest.mark.dist

LOGIT_TOL = 1e-5
GRAD_RTOL = 1e-5


# the tower's tensors the export carries (its gradients compared with HF's): Qwen2.5-VL's 2 blocks and merger;
# Qwen3-VL's 3 blocks, position grid, merger and 2 DeepStack mergers
VISION_TENSORS = {"vlm": 30, "q3vl": 57, "q3moe": 57}


def shared_launch(ctx):
    out = ctx.tmp_path_factory.mktemp("vlm")
    yield {2: [("vlm", [out / "r2.json", ctx.tiny_hf_models("qwen2_5_vl"), "vlm_dp2:1,1,0,1", "vlm_tp2:2,1,0,1",
                        "vlm_tp2_sp:2,1,1,1", "vlm_pp2:1,2,0,1", "vlm_cp2:1,1,0,2",
                        "vlm_backend_dp2:1,1,0,1", "vlm_backend_cp2:1,1,0,2", "vlm_backend_pp2:1,2,0,1",
                        "vlm_backend_tp2_sp:2,1,1,1"]),
               ("vlm", [out / "q3.json", ctx.tiny_hf_models("qwen3_vl"), "q3vl_dp2:1,1,0,1", "q3vl_tp2:2,1,0,1",
                        "q3vl_tp2_sp:2,1,1,1", "q3vl_pp2:1,2,0,1", "q3vl_cp2:1,1,0,2",
                        "q3vl_backend_cp2:1,1,0,2", "q3vl_backend_pp2:1,2,0,1"]),
               ("vlm", [out / "q3moe.json", ctx.tiny_hf_models("qwen3_vl_moe"), "q3moe_ep2:1,1,0,1,2"])]}
    return {**read_json(out / "r2.json"), **read_json(out / "q3.json"), **read_json(out / "q3moe.json")}


@pytest.mark.parametrize("family", ["vlm", "q3vl"])
def test_qwen2_5_vl_and_qwen3_vl_dp2_tp2_sp_pp2_cp2_match_hf_with_gradients(shared_launch_state, family):
    """Qwen2.5-VL (``vlm_*``) and Qwen3-VL (``q3vl_*``: interleaved M-RoPE, DeepStack residuals split as the
    hidden states are, PP2 with both DeepStack layers on the first stage)."""
    results = {k[len(family) + 1:]: v for k, v in shared_launch_state.items() if k.startswith(family + "_")
               and "_backend_" not in k}
    assert set(results) == {"dp2", "tp2", "tp2_sp", "pp2", "cp2"}
    assert results["cp2"]["cp"] == 2
    assert (results["dp2"]["dp"], results["tp2"]["tp"], results["pp2"]["pp"]) == (2, 2, 2)
    assert results["tp2_sp"]["sp"]
    for name, r in results.items():
        print(family, name, r)
        assert r["vs_hf"] <= LOGIT_TOL, (name, r)
        assert r["grad_max_abs_diff"] <= GRAD_RTOL * max(1.0, r["grad_max_abs"]), (name, r)
        assert r["vision_grads_equal_across_tp"] and r["vision_tensors"] == VISION_TENSORS[family], (name, r)


def test_backend_with_images_at_dp2_cp2_pp2_tp2_matches_hf_and_trains_alike(shared_launch_state):
    """The megatron backend's own packing and passes (rollout samples with images, dynamic batch sizes) at DP2, CP2,
    PP2 (the tower on the first stage, the M-RoPE rows handed to both stages) and TP2 + sequence parallelism: log-probs
    equal HF's (as one process's do: tests/backends/test_vlm_backend.py), and one GRPO step on the same packed
    micro-batches gives the one-process grad norm and the same log-probs after it in every layout. Qwen3-VL at CP2
    and PP2 likewise (equal to each other), and the embedded engine, given the trained weights (its 57 vision
    tensors included), generates with the images the log-probs the trainer gives the same tokens."""
    runs = {k[len("vlm_backend_"):]: v for k, v in shared_launch_state.items() if k.startswith("vlm_backend_")}
    q3 = {k[len("q3vl_backend_"):]: v for k, v in shared_launch_state.items() if k.startswith("q3vl_backend_")}
    for name, r in q3.items():
        print("qwen3_vl", name, r["vs_hf"], r["grad_norm"], r.get("engine_vs_trainer"), r["seconds"])
    for name, r in runs.items():
        print(name, r["vs_hf"], r["grad_norm"], r["micro_batches"], r["seconds"])
    assert sorted(runs) == ["cp2", "dp2", "pp2", "tp2_sp"]
    assert [(runs[k]["dp"], runs[k]["cp"], runs[k]["pp"], runs[k]["tp"]) for k in ("dp2", "cp2", "pp2", "tp2_sp")] == [
        (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)]
    for name, r in runs.items():
        assert r["vs_hf"] <= LOGPROB_TOL, (name, r["vs_hf"])
        assert abs(r["grad_norm"] - ONE_PROCESS_GRAD_NORM) <= 1e-5 * ONE_PROCESS_GRAD_NORM, (name, r["grad_norm"])
        diff = max(abs(a - b) for x, y in zip(runs["dp2"]["after_step"], r["after_step"]) for a, b in zip(x, y))
        assert diff <= LOGPROB_TOL, (name, diff)
    # Qwen3-VL (DeepStack, interleaved M-RoPE) through the same backend at CP2 and PP2, and the embedded engine
    assert sorted(q3) == ["cp2", "pp2"] and q3["pp2"]["pp"] == 2 and q3["cp2"]["cp"] == 2
    for name, r in q3.items():
        assert r["vs_hf"] <= LOGPROB_TOL, (name, r["vs_hf"])
    assert abs(q3["cp2"]["grad_norm"] - q3["pp2"]["grad_norm"]) <= 1e-5 * q3["pp2"]["grad_norm"]
    diff = max(abs(a - b) for x, y in zip(q3["cp2"]["after_step"], q3["pp2"]["after_step"]) for a, b in zip(x, y))
    assert diff <= LOGPROB_TOL, diff
    assert q3["cp2"]["engine_vs_trainer"] <= LOGPROB_TOL and q3["cp2"]["synced_vision_tensors"] == 57


def test_qwen3_vl_moe_ep2_matches_hf_with_gradients(shared_launch_state):
    """Qwen3-VL-MoE (4 experts, top-2, the checkpoint's stacked ``[E, hidden, 2f]`` / ``[E, f, hidden]`` experts)
    at EP2 (each rank 2 experts, DP2 for the rest, DeepStack on both ranks' own samples) vs HF with gradients."""
    r = shared_launch_state["q3moe_ep2"]
    print("q3moe ep2", r)
    assert (r["ep"], r["dp"]) == (2, 2)
    assert r["vs_hf"] <= LOGIT_TOL, r
    assert r["grad_max_abs_diff"] <= GRAD_RTOL * max(1.0, r["grad_max_abs"]), r
    assert r["vision_tensors"] == VISION_TENSORS["q3moe"], r
