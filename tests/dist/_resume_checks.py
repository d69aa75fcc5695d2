"""What both bitwise-resume tests check, on the records of tests/dist/scripts/ckpt_worker.py.

``straight`` = 4 steps, ``save`` = 2 steps + save, ``resume`` = load + 2 steps in a fresh
process group. ``assert_resume_bitwise`` checks metrics, LR/scheduler, log-probs, RNG,
exported weights and every rank's optimizer state bit for bit; the tests add their own
layout-specific checks on what it returns.
"""

from __future__ import annotations

import json

import torch

JOB = "ckpt"  # tests/dist/scripts/ckpt_worker.py through tests/dist/harness.py
SKIP = {"train/step_time_s"}  # wall time: the only metric allowed to differ


def job(**kw) -> str:
    return json.dumps(kw)


def rec(out, tag) -> dict:
    with open(out / f"{tag}.json") as f:
        return json.load(f)


def untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in SKIP}


STATE_KEYS = frozenset({"param", "exp_avg", "exp_avg_sq", "step"})


def assert_resume_bitwise(out, layout: str, nproc: int, state_keys=STATE_KEYS):
    """Returns (straight, saved, resumed) records, the straight run's weights and each rank's
    optimizer-state element count. ``state_keys``: what each parameter's optimizer state
    holds (megatron's hybrid CPU-offload optimizer adds ``master_param``)."""
    straight, saved, resumed = (rec(out, f"{p}_{layout}") for p in ("straight", "save", "resume"))
    assert resumed["extra_state"] == {"next_step": 2, "rollout_id": 1, "data": {"epoch": 0, "offset": 12}}
    assert (saved["end_step"], resumed["start_step"], resumed["end_step"], straight["end_step"]) == (2, 2, 4, 4)
    # the saving run is the first half of the straight one; the resumed run is its second half, exactly
    assert [s["metrics"] for s in saved["steps"]] == [s["metrics"] for s in straight["steps"][:2]]
    for s0, s1 in zip(straight["steps"][2:], resumed["steps"], strict=True):
        assert s0["global_step"] == s1["global_step"]
        m0, m1 = untimed(s0["metrics"]), untimed(s1["metrics"])
        assert m0 == m1, (layout, s0["global_step"], {k: (m0[k], m1.get(k)) for k in m0 if m0[k] != m1.get(k)})
    assert straight["lr"] == resumed["lr"] and straight["scheduler"] == resumed["scheduler"]
    assert straight["logprobs_end"] == resumed["logprobs_end"]
    # RNG streams continue exactly on every rank (the worker draws from all of them each step)
    assert straight["rng_probes"] == resumed["rng_probes"]
    assert straight["rng_probes"][0] != saved["rng_probes"][0]  # and the probe does move with the steps

    w0 = torch.load(out / f"straight_{layout}_weights.pt")
    w1 = torch.load(out / f"resume_{layout}_weights.pt")
    assert set(w0) == set(w1)
    for name in w0:
        assert torch.equal(w0[name], w1[name]), (layout, name)
    first = torch.load(out / f"save_{layout}_weights.pt")
    assert max((first[n] - w0[n]).abs().max().item() for n in w0) > 1e-4  # steps 3-4 changed the weights

    sizes = []
    for rank in range(nproc):
        o0 = torch.load(out / f"straight_{layout}_opt_rank{rank}.pt")
        o1 = torch.load(out / f"resume_{layout}_opt_rank{rank}.pt")
        assert len(o0["tensors"]) == len(o1["tensors"]) > 0
        sizes.append(sum(e["param"].numel() for e in o0["tensors"]))
        for i, (a, b) in enumerate(zip(o0["tensors"], o1["tensors"])):
            assert set(a) == set(b) == set(state_keys), (layout, rank, i, set(b))
            for k in a:
                assert torch.equal(a[k], b[k]), (layout, rank, i, k)
            assert float(b["step"]) == 4.0
        # the step fix: one private step tensor per parameter after the load
        assert o1["distinct_step_tensors"] == o1["num_states"] == len(o1["tensors"])
    return (straight, saved, resumed), w0, sizes
