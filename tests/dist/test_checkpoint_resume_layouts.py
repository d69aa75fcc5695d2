"""Bitwise resume of the MegatronBackend at the two layouts test_checkpoint_resume.py does not cover.

* TP2 x DP2 with --use-distributed-optimizer (4 ranks): the optimizer state is
  sharded over DP inside each TP group;
* PP2 (2 ranks): each rank holds one pipeline stage, its own optimizer and RNG.

For each: 4 straight steps vs 2 steps + save, then a FRESH process group (a new
torchrun) + load + 2 steps -> identical metrics at every step (loss, kl, grad
norm, lr, ...), identical log-probs, RNG streams, exported weights and every
rank's optimizer state (param, exp_avg, exp_avg_sq, step), bit for bit.

The worker (scripts/ckpt_worker.py) trains with warm-up + cosine decay, weight
decay, grad clipping, a KL reference and per-step RNG draws, so every piece of
saved state matters. One more PP2 job resumes with --num-rollout 20 (twice the
decay length): the LR schedule must follow the new flags from the saved step on
(checkpoint.load_scheduler_state), not the checkpoint's shorter decay.

Launches: 2 per layout (4 ranks ~60 s, 2 ranks ~35 s on this machine).
"""

import json
import os

import pytest
import torch

from _util import torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ckpt_worker.py")
LAYOUTS = {  # name: (ranks, flags)
    "tp2dp2_do": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}
SKIP = {"train/step_time_s"}


def _job(**kw):
    return json.dumps(kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    out = tmp_path_factory.mktemp("ckpt_layouts")
    for name, (nproc, flags) in LAYOUTS.items():
        save = str(out / f"root_{name}" / "iter_0000002")
        torchrun(SCRIPT, nproc, [hf, str(out), _job(tag=f"straight_{name}", flags=flags, steps=4),
                                 _job(tag=f"save_{name}", flags=flags, steps=2, save=save)], timeout=400)
        jobs = [_job(tag=f"resume_{name}", flags=flags, steps=2, load=save)]
        if name == "pp2":
            jobs.append(_job(tag="pp2_longer", flags=flags + ["--num-rollout", "20"], steps=1, load=save))
        torchrun(SCRIPT, nproc, [hf, str(out), *jobs], timeout=400)
    return out


def _rec(out, tag):
    with open(out / f"{tag}.json") as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_exact(runs, layout):
    out = runs
    nproc, _ = LAYOUTS[layout]
    straight, saved, resumed = (_rec(out, f"{p}_{layout}") for p in ("straight", "save", "resume"))
    meta = json.load(open(out / f"root_{layout}" / "iter_0000002" / "COMPLETE.json"))
    want = {"tp": 2, "pp": 1, "dp": 2, "use_distributed_optimizer": True} if layout == "tp2dp2_do" else \
        {"tp": 1, "pp": 2, "dp": 1, "use_distributed_optimizer": False}
    assert {k: meta["layout"][k] for k in want} == want and meta["layout"]["world_size"] == nproc
    assert meta["optimizer_steps"] == 2
    assert resumed["extra_state"] == {"next_step": 2, "rollout_id": 1, "data": {"epoch": 0, "offset": 12}}
    assert (saved["end_step"], resumed["start_step"], resumed["end_step"], straight["end_step"]) == (2, 2, 4, 4)
    # the saving run is the first half of the straight one; the resumed run is its second half, exactly
    assert [s["metrics"] for s in saved["steps"]] == [s["metrics"] for s in straight["steps"][:2]]
    assert saved["logprobs_end"] == resumed["logprobs_start"]  # the loaded model computes what was saved
    for s0, s1 in zip(straight["steps"][2:], resumed["steps"], strict=True):
        assert s0["global_step"] == s1["global_step"]
        m0 = {k: v for k, v in s0["metrics"].items() if k not in SKIP}
        m1 = {k: v for k, v in s1["metrics"].items() if k not in SKIP}
        assert "train/grad_norm" in m0 and "train/pg_loss" in m0
        assert m0 == m1, (layout, s0["global_step"], {k: (m0[k], m1.get(k)) for k in m0 if m0[k] != m1.get(k)})
    assert straight["lr"] == resumed["lr"] and straight["scheduler"] == resumed["scheduler"]
    assert straight["logprobs_end"] == resumed["logprobs_end"]
    assert len(straight["rng_probes"]) == nproc and straight["rng_probes"] == resumed["rng_probes"]
    assert straight["rng_probes"][0] != saved["rng_probes"][0]

    w0 = torch.load(out / f"straight_{layout}_weights.pt")
    w1 = torch.load(out / f"resume_{layout}_weights.pt")
    assert set(w0) == set(w1) and "model.embed_tokens.weight" in w0 and "lm_head.weight" in w0
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
            assert set(a) == set(b) == {"param", "exp_avg", "exp_avg_sq", "step"}, (layout, rank, i, set(b))
            for k in a:
                assert torch.equal(a[k], b[k]), (layout, rank, i, k)
            assert float(b["step"]) == 4.0
        assert o1["distinct_step_tensors"] == o1["num_states"] == len(o1["tensors"])
    # the state really is sharded: no rank holds everything (DP shards / pipeline stages)
    total = sum(t.numel() for t in w0.values())
    assert all(s < total for s in sizes), (sizes, total)


@pytest.mark.slow
def test_resume_with_longer_run_follows_the_new_schedule(runs):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    out = runs
    saved, longer = _rec(out, "save_pp2"), _rec(out, "pp2_longer")
    old, new = saved["scheduler"], longer["scheduler"]
    assert longer["start_step"] == 2 and new["num_steps"] == 3
    assert new["lr_decay_steps"] == 2 * old["lr_decay_steps"]  # --num-rollout 20 instead of 10
    assert {k: v for k, v in new.items() if k not in ("lr_decay_steps", "num_steps")} == \
        {k: v for k, v in old.items() if k not in ("lr_decay_steps", "num_steps")}

    def lr_at(sched: dict, steps: int) -> float:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        s = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=sched["max_lr"], min_lr=sched["min_lr"],
                                    lr_warmup_steps=sched["lr_warmup_steps"], lr_decay_steps=sched["lr_decay_steps"],
                                    lr_decay_style=sched["lr_decay_style"], start_wd=sched["start_wd"],
                                    end_wd=sched["end_wd"], wd_incr_steps=sched["wd_incr_steps"],
                                    wd_incr_style=sched["wd_incr_style"])
        s.step(steps)
        return opt.param_groups[0]["lr"]

    assert longer["lr"] == lr_at(new, 3)  # what a fresh 20-rollout run has after 3 optimizer steps
    assert longer["lr"] != lr_at({**new, "lr_decay_steps": old["lr_decay_steps"]}, 3)  # not the old decay
