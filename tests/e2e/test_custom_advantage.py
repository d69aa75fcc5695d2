"""--custom-advantage-function-path through the CPU demo (torchrun, 2 gloo ranks, real megatron-core): slime's
fn(args, rollout_data) runs on every rank on the whole rollout batch, with the old log-probs computed before it,
and its advantages train."""

import json

import pytest

from test_demo import metrics, run_demo

pytestmark = pytest.mark.e2e

ADV = '''
import json
import os

import torch


def grpo_from_slime_rewards(args, rollout_data):
    """slime's GRPO: its rewards arrive group-normalised, broadcast to the response tokens."""
    with open(os.environ["ADV_RECORD"], "a") as fh:
        fh.write(json.dumps({
            "rank": int(os.environ.get("RANK", 0)), "n": len(rollout_data["rewards"]),
            "n_samples_per_prompt": args.n_samples_per_prompt,
            "logprob_lengths_ok": [len(t) for t in rollout_data["log_probs"]] == rollout_data["response_lengths"],
            "logprobs_finite": all(bool(torch.isfinite(t).all()) for t in rollout_data["log_probs"]),
        }) + "\\n")
    rollout_data["advantages"] = [torch.ones_like(m) * r for r, m in zip(rollout_data["rewards"],
                                                                         rollout_data["loss_masks"])]
    rollout_data["returns"] = rollout_data["advantages"]


def monte_carlo_with_critic(args, rollout_data):
    """PPO with slime's contract: the critic's values arrive, the function sets advantages and returns."""
    values = rollout_data["values"]
    with open(os.environ["ADV_RECORD"], "a") as fh:
        fh.write(json.dumps({
            "rank": int(os.environ.get("RANK", 0)), "n": len(values),
            "value_lengths_ok": [len(v) for v in values] == rollout_data["response_lengths"],
            "values_finite": all(bool(torch.isfinite(v).all()) for v in values),
            "old_are_rollout": all(torch.equal(a, b) for a, b in zip(rollout_data["log_probs"],
                                                                      rollout_data["rollout_log_probs"])),
        }) + "\\n")
    rollout_data["returns"] = [torch.ones_like(v) * r for v, r in zip(values, rollout_data["raw_reward"])]
    rollout_data["advantages"] = [ret - v for ret, v in zip(rollout_data["returns"], values)]
'''


def test_custom_advantage_function_trains_the_demo(tmp_path, monkeypatch):
    module = tmp_path / "my_adv.py"
    module.write_text(ADV)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("ADV_RECORD", str(record))
    out = tmp_path / "demo"
    run_demo(out, 2, "--custom-advantage-function-path", f"{module}:grpo_from_slime_rewards")
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(c["rank"] for c in calls) == [0, 0, 1, 1]  # one call per rollout on each rank
    assert all(c["n"] == 32 * 8 and c["n_samples_per_prompt"] == 8 for c in calls)  # the whole batch, everywhere
    assert all(c["logprob_lengths_ok"] and c["logprobs_finite"] for c in calls)
    train = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(abs(r["train/pg_loss"]) < 10 and r["train/clip_frac"] >= 0 for r in train)


def test_custom_advantage_function_with_a_critic_and_rollout_logprobs(tmp_path, monkeypatch):
    """--advantage-estimator ppo with slime's custom function (it reads the critic's values and sets the returns
    the critic trains on) and --use-rollout-logprobs (the old log-probs it sees are the engine's; no old pass)."""
    module = tmp_path / "my_adv.py"
    module.write_text(ADV)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("ADV_RECORD", str(record))
    out = tmp_path / "demo"
    run_demo(out, 2, "--advantage-estimator", "ppo", "--use-rollout-logprobs",
             "--custom-advantage-function-path", f"{module}:monte_carlo_with_critic")
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(c["rank"] for c in calls) == [0, 0, 1, 1] and all(c["n"] == 32 * 8 for c in calls)
    assert all(c["value_lengths_ok"] and c["values_finite"] and c["old_are_rollout"] for c in calls)
    train = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["critic/grad_norm"] > 0 and r["critic/value_loss"] > 0 for r in train)


def test_ref_update_interval_and_the_adaptive_kl_coefficient_survive_a_resume(tmp_path):
    """slime's --ref-update-interval 2 on the demo (one optimizer step per rollout): the reference is the initial
    policy for rollouts 1-2 and the actor after rollout 2 from then on, so train/kl (the k3 KL of the training
    forward to the reference, before the rollout's update) is 0 at steps 1 and 3 and positive at step 2. The run
    stops after rollout 2 and a second launch resumes it: the reference comes back from the step-2 checkpoint.

    REINFORCE++ with verl's adaptive KL controller in the same run: the coefficient starts at --kl-coef, moves by
    beta *= 1 + clip(kl / target - 1, +-0.2) * 256 / horizon after each rollout (256 responses), and the resumed
    step 3 uses the value step 2 left (saved in the checkpoint), not --kl-coef again."""
    out = tmp_path / "demo"
    flags = ("--ref-update-interval", "2", "--global-batch-size", "256", "--save-interval", "2",
             "--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.01", "--kl-ctrl-type", "adaptive",
             "--kl-target", "0.001", "--kl-horizon", "1000")
    run_demo(out, 2, *flags)
    run_demo(out, 3, *flags)  # resumes from iter_0000002
    train = {r["step"]: r for r in metrics(out) if "rollout/reward_mean" in r}
    assert sorted(train) == [1, 2, 3]
    assert [train[s].get("train/ref_updated") for s in (1, 2, 3)] == [None, 1.0, None]
    assert abs(train[1]["train/kl"]) < 1e-9 and abs(train[3]["train/kl"]) < 1e-9, (train[1], train[3])
    assert train[2]["train/kl"] > 1e-7, train[2]

    def step(beta, kl):
        return beta * (1.0 + min(max(kl / 0.001 - 1.0, -0.2), 0.2) * 256 / 1000)

    coef = {s: train[s]["train/reward_kl_coef"] for s in (1, 2, 3)}
    assert train[1]["train/reward_kl"] == 0.0 and coef[1] == 0.01  # old == reference before the first update
    assert train[2]["train/reward_kl"] > 0 and coef[2] == step(0.01, 0.0)
    assert coef[3] == step(coef[2], train[2]["train/reward_kl"]) != 0.01, coef
