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

import pytest
import torch

from _resume_checks import JOB, assert_resume_bitwise, untimed
from _resume_checks import job as _job
from _resume_checks import rec as _rec

pytestmark = pytest.mark.dist

LAYOUTS = {  # name: (ranks, flags)
    "tp2dp2_do": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def shared_launch(ctx):
    """Two phases of the group's launches (tests/_launches.py): straight + saving runs, then the resumes in
    fresh processes; the output dir."""
    hf = ctx.tiny_hf_models("qwen2")
    out = ctx.tmp_path_factory.mktemp("ckpt_layouts")
    saves = {name: str(out / f"root_{name}" / "iter_0000002") for name in LAYOUTS}
    yield {nproc: [(JOB, [hf, out, _job(tag=f"straight_{name}", flags=flags, steps=4),
                          _job(tag=f"save_{name}", flags=flags, steps=2, save=saves[name])])]
           for name, (nproc, flags) in LAYOUTS.items()}
    resumes = {}
    for name, (nproc, flags) in LAYOUTS.items():
        jobs = [_job(tag=f"resume_{name}", flags=flags, steps=2, load=saves[name])]
        if name == "pp2":
            jobs.append(_job(tag="pp2_longer", flags=flags + ["--num-rollout", "20"], steps=1, load=saves[name]))
        resumes[nproc] = [(JOB, [hf, out, *jobs])]
    yield resumes
    return out


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_exact(runs, layout):
    out = runs
    nproc, _ = LAYOUTS[layout]
    meta = json.load(open(out / f"root_{layout}" / "iter_0000002" / "COMPLETE.json"))
    want = {"tp": 2, "pp": 1, "dp": 2, "use_distributed_optimizer": True} if layout == "tp2dp2_do" else \
        {"tp": 1, "pp": 2, "dp": 1, "use_distributed_optimizer": False}
    assert {k: meta["layout"][k] for k in want} == want and meta["layout"]["world_size"] == nproc
    assert meta["optimizer_steps"] == 2
    (straight, saved, resumed), w0, sizes = assert_resume_bitwise(out, layout, nproc)
    assert saved["logprobs_end"] == resumed["logprobs_start"]  # the loaded model computes what was saved
    for s0 in straight["steps"][2:]:
        m0 = untimed(s0["metrics"])
        assert "train/grad_norm" in m0 and "train/pg_loss" in m0
    assert len(straight["rng_probes"]) == nproc
    assert "model.embed_tokens.weight" in w0 and "lm_head.weight" in w0
    # the state really is sharded: no rank holds everything (DP shards / pipeline stages)
    total = sum(t.numel() for t in w0.values())
    assert all(s < total for s in sizes), (sizes, total)


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
