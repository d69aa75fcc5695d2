"""PPO's critic on the FSDP backend (tests/dist/scripts/fsdp_critic_worker.py), two launches:

1. 1 rank: the reference (3 steps of 2 epochs each: critic only, then actor + critic twice), the megatron
   backend's critic on the same model, batch and flags, 2 steps + save and then load + the third step, and the
   resumes that mismatch the critic, and a critic from --critic-hf-checkpoint.
2. 2 ranks: the same 3 steps at DP2, at DP2 with --optimizer-cpu-offload (FSDP2's CPUOffloadPolicy) and at DP2
   with --fp16 (the critic's own loss scaler).

Checks: at DP2 the critic's values, value loss, clip fraction and gradient norm, and the values after the
updates, equal the one-process run's (float32, atol 2e-5 / rtol 1e-4: only the reduction order differs); the
FSDP critic's value head is bitwise the megatron critic's and its values equal the megatron critic's, at step 0
and through the 6 updates (measured max |FSDP - megatron| 3e-8 at step 0, 2.7e-7 after); in the critic-only step
the actor's parameters and step count are unchanged and no train/* metric is reported; resume from the checkpoint
(critic model, optimizer, schedule, step count inside the actor's DCP checkpoint) continues bitwise; a checkpoint
without a critic does not resume into a ppo run, nor a critic's into a run without one (both named); a critic from
--critic-hf-checkpoint of other weights equals a critic started from an actor with those weights.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.dist


STEPS = [False, True, True]
TOL = dict(atol=2e-5, rtol=1e-4)
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]  # PEFT's adapters in the actor and, of its own, in the critic
METRICS = ("critic/value_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr")


def _job(**kw) -> str:
    return json.dumps(kw)


def _rec(out, tag) -> dict:
    with open(out / f"{tag}.json") as f:
        return json.load(f)


def shared_launch(ctx):
    """One 1-rank and one 2-rank launch of fsdp critic jobs (tests/_launches.py); the output dir."""
    tmp_path_factory, tiny_hf_models = ctx.tmp_path_factory, ctx.tiny_hf_models
    hf = tiny_hf_models("qwen2")
    out = tmp_path_factory.mktemp("fsdp_critic_out")
    save, plain = str(out / "root" / "iter_0000002"), str(out / "plain" / "iter_0000000")
    other = tiny_hf_models("qwen2", seed=1)  # other weights of the same architecture
    one = [("fsdp_critic", [hf, out, _job(tag="ref", steps=STEPS), _job(tag="megatron", backend="megatron", steps=STEPS),
                         _job(tag="save", steps=STEPS[:2], save=save), _job(tag="resume", steps=STEPS[2:], load=save),
                         _job(tag="refuse", refuse=[plain, save]),
                         # the critic's trunk from --critic-hf-checkpoint (other weights than the actor's) equals a
                         # critic built from an actor that starts from those weights
                         _job(tag="other_actor", hf=other), _job(tag="crit_hf", flags=["--critic-hf-checkpoint", other]),
                         _job(tag="lora", steps=STEPS, flags=LORA)])]
    two = [("fsdp_critic", [hf, out, _job(tag="dp", steps=STEPS),
                         _job(tag="dp_offload", steps=STEPS, flags=["--optimizer-cpu-offload"]),
                         _job(tag="dp_fp16", steps=STEPS, flags=["--fp16", "--initial-loss-scale", "1024"]),
                         _job(tag="dp_lora", steps=STEPS, flags=LORA)])]
    yield {1: one, 2: two}
    return out


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


def _close(got, want) -> None:
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), **TOL)


def _same_run(ref: dict, got: dict, tag: str) -> None:
    for name in ("values_start", "values_end"):
        _close(got[name], ref[name])
    for s0, s1 in zip(ref["steps"], got["steps"], strict=True):
        _close(s1["values"], s0["values"])
        for m0, m1 in zip(s0["metrics"], s1["metrics"], strict=True):
            for k in METRICS:
                assert m1[k] == pytest.approx(m0[k], rel=TOL["rtol"], abs=TOL["atol"]), (tag, k)


@pytest.mark.parametrize("tag", ["dp", "dp_offload"])
def test_fsdp_critic_at_dp2_equals_one_process(runs, tag):
    ref, got = _rec(runs, "ref"), _rec(runs, tag)
    assert got["values_start"] != got["values_end"]  # the critic trained
    _same_run(ref, got, tag)
    # the clip engaged in the second epochs (values moved past --value-clip), so its branch is compared too
    assert any(m["critic/vf_clipfrac"] > 0 for s in ref["steps"] for m in s["metrics"])
    assert got["critic_steps"] == ref["critic_steps"] == 6 and got["critic_lr"] == ref["critic_lr"]


def test_fsdp_critic_with_fp16_loss_scaling_tracks_fp32(runs):
    """--fp16 --initial-loss-scale 1024: the critic's own loss scaler; no step overflows or is skipped, its
    gradients unscaled to fp32's within fp16 rounding."""
    ref, half = _rec(runs, "ref"), _rec(runs, "dp_fp16")
    for s0, s1 in zip(ref["steps"], half["steps"], strict=True):
        for m0, m1 in zip(s0["metrics"], s1["metrics"], strict=True):
            assert m1["critic/update_skipped"] == 0.0
            assert m1["critic/grad_norm"] == pytest.approx(m0["critic/grad_norm"], rel=0.01)  # measured 0.0023
    diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
               for a, b in zip(ref["values_end"], half["values_end"], strict=True))
    assert diff < 0.005, diff  # measured 0.0014


def test_fsdp_critic_equals_the_megatron_critic(runs):
    from megatron_rl.backends.fsdp.critic import MEGATRON_INIT_METHOD_STD

    fsdp, meg = _rec(runs, "ref"), _rec(runs, "megatron")
    assert meg["init_method_std"] == MEGATRON_INIT_METHOD_STD
    assert fsdp["head_weight"] == meg["head_weight"]  # bitwise: the same seeded draw
    start = max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
                for a, b in zip(fsdp["values_start"], meg["values_start"], strict=True))
    assert start < 1e-6, start  # HF's SDPA trunk vs megatron's: float rounding only (measured 3e-8)
    _same_run(meg, fsdp, "fsdp vs megatron")
    assert [sorted(m) for s in fsdp["steps"] for m in s["metrics"]] == \
        [sorted(m) for s in meg["steps"] for m in s["metrics"]]  # the same metric keys, train/* and critic/*


def test_critic_only_step_leaves_the_actor_and_reports_no_train_metrics(runs):
    for tag in ("ref", "dp", "dp_offload"):
        steps = _rec(runs, tag)["steps"]
        assert [s["actor_unchanged"] for s in steps] == [True, False, False], tag
        assert not [k for m in steps[0]["metrics"] for k in m if k.startswith("train/")], (tag, steps[0])
        assert all("train/pg_loss" in m for s in steps[1:] for m in s["metrics"])
        for m in (m for s in steps for m in s["metrics"]):
            assert {*METRICS, "critic/update_skipped"} <= set(m) and m["critic/update_skipped"] == 0
            assert m["critic/grad_norm"] > 0


def test_fsdp_critic_resumes_bitwise(runs):
    ref, saved, resumed = (_rec(runs, t) for t in ("ref", "save", "resume"))
    assert [s["metrics"] for s in saved["steps"]] == [s["metrics"] for s in ref["steps"][:2]]
    assert resumed["steps"][0]["global_step"] == 2 and resumed["steps"][0]["metrics"] == ref["steps"][2]["metrics"]
    assert resumed["steps"][0]["values"] == ref["steps"][2]["values"]
    assert resumed["critic_steps"] == ref["critic_steps"] == 6 and resumed["critic_lr"] == ref["critic_lr"]
    assert resumed["values_end"] == ref["values_end"] and resumed["logprobs_end"] == ref["logprobs_end"]
    a, b = torch.load(runs / "ref_critic_opt_rank0.pt"), torch.load(runs / "resume_critic_opt_rank0.pt")
    assert a["num_states"] == b["num_states"] > 0
    for x, y in zip(a["tensors"], b["tensors"], strict=True):
        assert set(x) == set(y)
        for k in x:
            assert torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])), k


def test_critic_trunk_from_critic_hf_checkpoint(runs):
    ref, want, got = _rec(runs, "ref"), _rec(runs, "other_actor"), _rec(runs, "crit_hf")
    assert want["values_start"] != ref["values_start"]  # other weights: other values
    assert got["values_start"] == want["values_start"]  # bitwise: the same trunk, the same seeded head
    assert got["logprobs_start"] == ref["logprobs_start"]  # the actor is still --hf-checkpoint's


def test_a_resume_that_mismatches_the_critic_is_refused_by_name(runs):
    errors = _rec(runs, "refuse")["refusals"]
    assert "holds no critic" in errors["ppo_from_no_critic"] and "trains one" in errors["ppo_from_no_critic"]
    assert "holds a critic" in errors["plain_from_critic"] and "does not" in errors["plain_from_critic"]
    assert all("--advantage-estimator" in e for e in errors.values()), errors


def test_fsdp_critic_with_lora_trains_adapters_and_head_on_a_frozen_trunk(runs):
    """--lora-rank: the critic's HF trunk carries PEFT adapters of its own and stays bitwise frozen while its values
    move; DP2 equals one process."""
    ref, dp = _rec(runs, "lora"), _rec(runs, "dp_lora")
    for rec in (ref, dp):
        assert all(s["critic_frozen_params"] > 0 and s["critic_frozen_unchanged"] for s in rec["steps"])
        assert rec["values_start"] != rec["values_end"]
    assert _rec(runs, "ref")["steps"][0]["critic_frozen_params"] == 0
    _same_run(ref, dp, "dp_lora")
