"""megatron-core's CPU-offloaded distributed optimizer (HybridDeviceOptimizer) on CPU: same steps, exact resume.

``--use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer``
(offload fraction 1.0) runs megatron-core's own hybrid path: every DP shard gets a host
copy, a torch AdamW steps the copies, parameters are copied back (the compat layer's
``hybrid_optimizer_devices`` patch lets it see the shards as device tensors on CPU).

Three launches (tests/dist/scripts/offload_worker.py = ckpt_worker.py's jobs + where the
optimizer state lives), fp32:

1. 2 ranks (DP2): 4 steps with the plain distributed optimizer; 4 steps offloaded; 2
   steps offloaded + save.
2. 1 rank (DP1): load the DP2 checkpoint + 2 steps; load it + save again (DP1 layout).
3. 2 ranks, fresh processes: load the DP2 checkpoint + 2 steps; load the DP1 re-save + 2 steps.

Checks: offloaded steps equal the plain optimizer's to float32 rounding (fused vs
for-loop AdamW); resume at DP2 is bitwise (metrics, weights, every rank's optimizer
state, RNG); the DP1 load gives the saved model bitwise and the next steps follow the
DP2 run; DP2 -> DP1 -> DP2 round trip loses nothing (bitwise equal to the uninterrupted run).
"""


import pytest
import torch

from _resume_checks import assert_resume_bitwise, untimed
from _resume_checks import job as _job
from _resume_checks import rec as _rec

pytestmark = pytest.mark.dist

JOB = "offload"  # tests/dist/scripts/offload_worker.py: ckpt_worker.py's jobs + where the optimizer state lives
DO = ["--use-distributed-optimizer"]
OFFLOAD = DO + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
HYBRID_STATE = {"param", "exp_avg", "exp_avg_sq", "step", "master_param"}


def shared_launch(ctx):
    """Two phases of the group's launches (tests/_launches.py): the 2-rank runs and save, then (the phase's
    1-rank launch, after its 2-rank one) the DP1 load and resave of that save; the 2-rank resumes of both
    saves in phase 2. The output dir."""
    hf = ctx.tiny_hf_models("qwen2")
    out = ctx.tmp_path_factory.mktemp("offload")
    save = str(out / "root_off" / "iter_0000002")
    resave = str(out / "root_dp1" / "iter_0000002")
    yield {2: [(JOB, [hf, out, _job(tag="plain", flags=DO, steps=4), _job(tag="straight_off", flags=OFFLOAD, steps=4),
                      _job(tag="save_off", flags=OFFLOAD, steps=2, save=save)])],
           1: [(JOB, [hf, out, _job(tag="dp1", flags=OFFLOAD, steps=2, load=save),
                      _job(tag="dp1_resave", flags=OFFLOAD, steps=0, load=save, save=resave)])]}
    yield {2: [(JOB, [hf, out, _job(tag="resume_off", flags=OFFLOAD, steps=2, load=save),
                      _job(tag="via_dp1", flags=OFFLOAD, steps=2, load=resave)])]}
    return out


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


def _opt(out, tag, rank):
    return torch.load(out / f"{tag}_opt_rank{rank}.pt")


def test_offloaded_steps_equal_the_plain_distributed_optimizer(runs):
    out = runs
    plain, off = _rec(out, "plain"), _rec(out, "straight_off")
    assert len(plain["steps"]) == len(off["steps"]) == 4
    for s0, s1 in zip(plain["steps"], off["steps"], strict=True):
        m0, m1 = untimed(s0["metrics"]), untimed(s1["metrics"])
        assert set(m0) == set(m1)
        for k in m0:
            assert m1[k] == pytest.approx(m0[k], rel=2e-6, abs=1e-7), (s0["global_step"], k, m0[k], m1[k])  # seen 3e-7
    w0, w1 = torch.load(out / "plain_weights.pt"), torch.load(out / "straight_off_weights.pt")
    assert set(w0) == set(w1)
    assert max((w0[n] - w1[n]).abs().max().item() for n in w0) < 2e-6  # seen 3.4e-7
    first = torch.load(out / "save_off_weights.pt")
    assert max((first[n] - w1[n]).abs().max().item() for n in w1) > 1e-4  # the steps did move the weights
    for rank in range(2):
        p, o = _opt(out, "plain", rank), _opt(out, "straight_off", rank)
        assert p["offload"] == [None]  # the plain run is the plain optimizer
        [layout] = o["offload"]
        # megatron's offload path really ran: every shard has its own host copy, one CPU
        # optimizer owns the copies and all of the state, no device optimizer, and the
        # step's result was copied back to the shards
        assert layout["params"] == layout["offloaded"] == len(o["tensors"]) > 0, layout
        assert layout["cpu_optimizers"] >= 1 and not layout["device_optimizer"], layout
        assert layout["separate_storage"] and layout["host_equals_device"], layout
        assert layout["cpu_optimizer_owns_host_copies"] and layout["state_on_host_copies"], layout
        assert len(p["tensors"]) == len(o["tensors"])
        for a, b in zip(p["tensors"], o["tensors"], strict=True):
            assert set(b) == HYBRID_STATE and torch.equal(b["master_param"], b["param"])
            assert float(a["step"]) == float(b["step"]) == 4.0
            # the moments to float32 rounding; the master params are the weights, held to the weights'
            # bound above (two AdamW implementations' last bits, amplified by Adam's 1/sqrt(v) where
            # gradients are near zero: up to 4.4e-7 = 1.4e-5 relative seen after 4 steps)
            torch.testing.assert_close(b["param"], a["param"], rtol=0, atol=2e-6)
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-7)


def test_offloaded_resume_is_bitwise_exact_at_the_same_dp(runs):
    _, w0, sizes = assert_resume_bitwise(runs, "off", nproc=2, state_keys=HYBRID_STATE)
    assert all(0 < s < sum(t.numel() for t in w0.values()) for s in sizes)  # state sharded over DP


def test_offloaded_checkpoint_resumes_at_another_dp_size(runs):
    out = runs
    saved, straight, dp1 = _rec(out, "save_off"), _rec(out, "straight_off"), _rec(out, "dp1")
    assert dp1["start_step"] == 2 and dp1["extra_state"]["next_step"] == 2
    assert dp1["logprobs_start"] == saved["logprobs_end"]  # the model loads bitwise at DP1
    # DP1 holds the whole optimizer state (one rank); the next steps follow the DP2 run up to
    # the order of the DP reduction
    [layout] = _opt(out, "dp1", 0)["offload"]
    assert layout["params"] == layout["offloaded"] > 0 and layout["host_equals_device"]
    for s0, s1 in zip(straight["steps"][2:], dp1["steps"], strict=True):
        m0, m1 = untimed(s0["metrics"]), untimed(s1["metrics"])
        assert m1.pop("train/micro_batches") == 2 * m0.pop("train/micro_batches")  # per rank: DP1 does all
        for k in m0:
            assert m1[k] == pytest.approx(m0[k], rel=1e-5, abs=1e-6), (s0["global_step"], k)  # seen: 2e-7
    w0, w1 = torch.load(out / "straight_off_weights.pt"), torch.load(out / "dp1_weights.pt")
    assert max((w0[n] - w1[n]).abs().max().item() for n in w0) < 2e-6  # seen 1.2e-7


def test_dp2_to_dp1_to_dp2_round_trip_is_bitwise(runs):
    """What the DP1 load restored and re-saved is every bit of the DP2 state: resuming that
    re-save at DP2 gives the uninterrupted DP2 run exactly (RNG aside: not restored across layouts)."""
    out = runs
    straight, via = _rec(out, "straight_off"), _rec(out, "via_dp1")
    assert via["start_step"] == 2 and via["end_step"] == 4
    for s0, s1 in zip(straight["steps"][2:], via["steps"], strict=True):
        assert untimed(s0["metrics"]) == untimed(s1["metrics"]), s0["global_step"]
    assert straight["logprobs_end"] == via["logprobs_end"] and straight["lr"] == via["lr"]
    w0, w1 = torch.load(out / "straight_off_weights.pt"), torch.load(out / "via_dp1_weights.pt")
    assert all(torch.equal(w0[n], w1[n]) for n in w0)
    for rank in range(2):
        a, b = _opt(out, "straight_off", rank), _opt(out, "via_dp1", rank)
        assert len(a["tensors"]) == len(b["tensors"]) > 0
        for x, y in zip(a["tensors"], b["tensors"], strict=True):
            assert set(x) == set(y) == HYBRID_STATE
            assert all(torch.equal(x[k], y[k]) for k in x), rank
