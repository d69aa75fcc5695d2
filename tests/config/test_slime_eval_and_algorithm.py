"""slime's eval and algorithm flags: named eval sets with per-set metrics,
evaluation sampling, --kl-coef (KL in the reward), --balance-data.

Evaluation runs the real embedded engine on the CPU demo's tiny model (megatron_rl.data.synthetic)
and the real reward; nothing is replaced.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from megatron_rl.data.synthetic import prepare

    root = tmp_path_factory.mktemp("demo")
    prepare(str(root), num_prompts=16, num_eval=6)
    lines = (root / "eval.jsonl").read_text().splitlines()
    (root / "eval_a.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (root / "eval_b.jsonl").write_text("\n".join(lines[2:6]) + "\n")
    return root


def base(demo, *extra):
    return ["--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "prompts.jsonl"),
            "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward", "--rollout-max-response-len", "6", *extra]


def test_named_eval_sets_have_their_own_metrics_and_sampling(demo):
    """slime's ``--eval-prompt-data NAME PATH NAME PATH`` with --eval-max-response-len / --eval-top-k:
    one set per name, metrics eval/NAME/..., responses capped at the eval length."""
    from megatron_rl.rollout.build import build_rollout
    from megatron_rl.rollout.manager import eval_sampling_params

    cfg = parse_config(base(demo, "--eval-prompt-data", "a", str(demo / "eval_a.jsonl"), "b",
                            str(demo / "eval_b.jsonl"), "--eval-max-response-len", "2", "--eval-top-k", "1",
                            "--eval-top-p", "1", "--n-samples-per-eval-prompt", "2"))
    assert cfg.data.eval_sets == (("a", str(demo / "eval_a.jsonl")), ("b", str(demo / "eval_b.jsonl")))
    sampling = eval_sampling_params(cfg)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.max_new_tokens, sampling.n) == (
        0.0, 1, 1.0, 2, 2)
    manager = build_rollout(cfg)
    assert {k: len(v) for k, v in manager.eval_datasets.items()} == {"a": 2, "b": 4}
    metrics = manager.evaluate(0)
    assert set(metrics) == {"eval/a/reward_mean", "eval/a/response_len_mean", "eval/b/reward_mean",
                            "eval/b/response_len_mean"}
    assert 0 < metrics["eval/a/response_len_mean"] <= 2 and 0 < metrics["eval/b/response_len_mean"] <= 2
    assert all(0.0 <= metrics[f"eval/{n}/reward_mean"] <= 1.0 for n in "ab")


def test_one_unnamed_eval_set_keeps_its_metric_names(demo):
    from megatron_rl.rollout.build import build_rollout

    cfg = parse_config(base(demo, "--eval-prompt-data", str(demo / "eval_a.jsonl")))
    assert cfg.data.eval_sets == ((None, str(demo / "eval_a.jsonl")),)
    metrics = build_rollout(cfg).evaluate(0)
    assert set(metrics) == {"eval/reward_mean", "eval/response_len_mean"}
    assert 0 < metrics["eval/response_len_mean"] <= 6  # --rollout-max-response-len when no eval length


@pytest.mark.parametrize("extra, match", [
    (["--eval-prompt-data", "a", "x.jsonl", "b"], "give one PATH, or NAME PATH pairs"),
    (["--eval-prompt-data", "a", "{a}", "a", "{a}"], "names a more than once"),
    (["--eval-prompt-data", "a", "/nonexistent/aime.jsonl"], "--eval-prompt-data a /nonexistent/aime.jsonl: "
                                                             "no such file"),
    (["--eval-top-p", "0.9"], "--eval-top-p 0.9 sets evaluation sampling, but there is no evaluation"),
    (["--eval-prompt-data", "{a}", "--eval-top-p", "0.9"], "--eval-top-p 0.9 filters sampling, but evaluation "
                                                           "is greedy"),
    (["--eval-prompt-data", "{a}", "--eval-top-k", "5"], "--eval-top-k 5 filters sampling"),
    (["--eval-prompt-data", "{a}", "--eval-max-response-len", "0"], "--eval-max-response-len 0 must be >= 1"),
    (["--eval-prompt-data", "{a}", "--eval-temperature", "-1"], r"--eval-temperature -1 is out of range: it must lie in \[0, inf\)"),
])
def test_eval_flags_that_would_do_nothing_or_break_are_refused(demo, extra, match):
    extra = [x.replace("{a}", str(demo / "eval_a.jsonl")) for x in extra]
    with pytest.raises(ConfigError, match=match):
        parse_config(base(demo, *extra))


def test_sampled_eval_takes_top_p_and_top_k(demo):
    from megatron_rl.rollout.manager import eval_sampling_params

    cfg = parse_config(base(demo, "--eval-prompt-data", str(demo / "eval_a.jsonl"), "--eval-temperature", "0.7",
                            "--eval-top-p", "0.9", "--eval-top-k", "5", "--rollout-top-p", "0.5"))
    s = eval_sampling_params(cfg)
    assert (s.temperature, s.top_p, s.top_k) == (0.7, 0.9, 5)


def test_yaml_eval_prompt_data_string_is_one_set(demo, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"eval_prompt_data": str(demo / "eval_a.jsonl")}))  # JSON is YAML
    cfg = parse_config(base(demo, "--config", str(path)))
    assert cfg.data.eval_sets == ((None, str(demo / "eval_a.jsonl")),)


def test_kl_coef_reaches_the_reinforce_plus_plus_reward(demo):
    """--kl-coef: slime's KL in the reward, REINFORCE++'s token reward -kl_coef * kl (algorithms/advantages,
    checked against reference vectors there); the step then needs reference log-probs."""
    from megatron_rl.algorithms import spec_from_config

    cfg = parse_config(base(demo, "--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.05"))
    spec = spec_from_config(cfg)
    assert spec.cfg.kl_coef == 0.05
    assert spec.prepare_batch([]).ref_logprobs and spec.prepare_batch([]).advantages_need_logprobs
    assert parse_config(base(demo, "--kl-coef", "0")).algorithm.kl_coef == 0.0  # slime's GRPO scripts: off
    with pytest.raises(ConfigError, match="--kl-coef 0.05 folds KL into the rewards, which only "
                                          "--advantage-estimator reinforce_plus_plus does"):
        parse_config(base(demo, "--kl-coef", "0.05"))
    with pytest.raises(ConfigError, match=r"--kl-coef -1 is out of range: it must lie in \[0, inf\)"):
        parse_config(base(demo, "--kl-coef", "-1"))


def test_kl_coef_snapshots_the_reference_policy():
    """Without --use-kl-loss or --ref-load the reference is the initial policy, snapshotted at start."""
    from megatron_rl.runner.resume import Resumer

    class Recorder:  # the two TrainBackend calls resume_or_init makes before resuming, recorded
        def __init__(self):
            self.tags = []

        def snapshot_weights(self, tag):
            self.tags.append(tag)

    cfg = parse_config(["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.05"], validate=False)
    backend = Recorder()
    assert Resumer(cfg, None).resume_or_init(backend, None) == 0
    assert backend.tags == ["ref"]


def test_balance_data_restates_the_dynamic_packer(demo):
    from megatron_rl.data.packing import plan_dynamic_micro_batches

    cfg = parse_config(base(demo, "--balance-data", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"))
    assert cfg.batching.balance_data
    lengths = [30, 2, 2, 2, 28, 3, 1, 4]
    plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=64)
    per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in plan.micro_batches]
    assert abs(per_rank[0] - per_rank[1]) <= 4  # the 30 and the 28 land on different ranks
    with pytest.raises(ConfigError, match="--balance-data balances token counts .* add --use-dynamic-batch-size"):
        parse_config(base(demo, "--balance-data"))


def test_kl_loss_with_coef_zero_is_logged_not_added(demo):
    """slime's --use-kl-loss --kl-loss-coef 0: reference log-probs are computed, train/kl is logged,
    and the loss (value and gradient) is exactly the one without any KL."""
    import torch

    from megatron_rl.algorithms import LossInputs, compute_policy_loss, spec_from_config
    from megatron_rl.data.packing import LossDenominators

    logged = spec_from_config(parse_config(base(demo, "--use-kl-loss", "--kl-loss-coef", "0")))
    plain = spec_from_config(parse_config(base(demo)))
    assert logged.prepare_batch([]).ref_logprobs and not plain.prepare_batch([]).ref_logprobs
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(6, generator=g, dtype=torch.float64)).requires_grad_(True)
    x = dict(advantages=torch.randn(6, generator=g, dtype=torch.float64), loss_mask=torch.ones(6, dtype=torch.float64),
             response_lengths=[2, 4], old_logprobs=lp.detach() + 0.1)
    ref = lp.detach() + 0.3 * torch.randn(6, generator=g, dtype=torch.float64)
    denoms = LossDenominators(6, 2, 6, 2)
    loss_logged, m_logged = compute_policy_loss(LossInputs(lp, ref_logprobs=ref, **x), denoms, logged.cfg)
    (grad_logged,) = torch.autograd.grad(loss_logged, lp)
    loss_plain, m_plain = compute_policy_loss(LossInputs(lp, **x), denoms, plain.cfg)
    (grad_plain,) = torch.autograd.grad(loss_plain, lp)
    assert torch.equal(loss_logged, loss_plain) and torch.equal(grad_logged, grad_plain)
    assert "kl" in m_logged and "kl" not in m_plain and float(m_logged["kl"][0]) > 0


REWARD_KEYS_MODULE = '''
from megatron_rl.data.synthetic import digit_reward


def scored(sample):
    return {"acc": digit_reward(sample), "eval_score": 0.25, "format": 1.0}
'''


def test_reward_key_trains_and_eval_reward_key_evaluates(demo, tmp_path):
    """slime's --reward-key / --eval-reward-key through the real embedded engine: training rewards come from
    the dict's --reward-key, eval/reward_mean from --eval-reward-key; the other keys are metrics."""
    from megatron_rl.rollout.build import build_rollout

    path = tmp_path / "keyed_reward.py"
    path.write_text(REWARD_KEYS_MODULE)
    argv = [a if a != "megatron_rl.data.synthetic:digit_reward" else f"{path}:scored" for a in base(demo)]
    cfg = parse_config([*argv, "--eval-prompt-data", str(demo / "eval_a.jsonl"), "--reward-key", "acc",
                        "--eval-reward-key", "eval_score", "--rollout-batch-size", "2", "--n-samples-per-prompt",
                        "2", "--global-batch-size", "4"])
    manager = build_rollout(cfg)
    metrics = manager.evaluate(0)
    assert metrics["eval/reward_mean"] == 0.25 and metrics["eval/reward/acc"] >= 0.0
    samples, _ = manager.generate(0)
    from megatron_rl.data.synthetic import digit_reward

    assert samples and all(s.reward == digit_reward(s) for s in samples)  # the "acc" key trains
    assert all(s.metadata["reward_metrics"] == {"eval_score": 0.25, "format": 1.0} for s in samples)
    with pytest.raises(ConfigError, match="--eval-reward-key x picks the reward evaluation reports.*evaluates "
                                          "nothing"):
        parse_config([*argv, "--eval-reward-key", "x"])


@pytest.mark.parametrize("extra, match", [
    (["--overlong-buffer-len", "6"], r"--overlong-buffer-len 6 must be in \[1, --rollout-max-response-len 6\)"),
    (["--overlong-penalty-factor", "2"], "--overlong-penalty-factor 2.0 sizes DAPO's overlong penalty, which only "
                                         "--overlong-buffer-len N turns on"),
    (["--overlong-buffer-len", "2", "--overlong-penalty-factor", "-1"], r"--overlong-penalty-factor -1 is out of "
                                                                        r"range: it must lie in \[0, inf\)"),
    (["--reward-clip-range", "1", "-1"], "--reward-clip-range 1.0 -1.0 needs two numbers LOW HIGH with LOW < HIGH"),
])
def test_reward_shaping_flags_out_of_their_range_are_refused(demo, extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(base(demo, *extra))


def test_straight_through_kl_is_accepted_but_not_with_the_unbiased_weighting(demo):
    cfg = parse_config(base(demo, "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k3+"))
    assert cfg.algorithm.kl_loss_type == "k3+"
    with pytest.raises(ConfigError, match=r"--use-unbiased-kl with --kl-loss-type k3\+: .* use --kl-loss-type k3 "
                                          "or drop --use-unbiased-kl"):
        parse_config(base(demo, "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k3+",
                          "--use-unbiased-kl"))


@pytest.mark.parametrize("extra, match", [
    (["--kl-ctrl-type", "adaptive"], "--kl-ctrl-type adaptive adapts the KL coefficient folded into the rewards: it "
                                     "needs --advantage-estimator reinforce_plus_plus with --kl-coef > 0"),
    (["--kl-target", "0.02"], "--kl-target 0.02 tune the adaptive KL controller, which only --kl-ctrl-type "
                              "adaptive turns on"),
    (["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1", "--kl-ctrl-type", "adaptive",
      "--kl-horizon", "0"], r"--kl-horizon 0 is out of range: it must lie in \(0, inf\)"),
])
def test_adaptive_kl_flags_without_what_they_steer_are_refused(demo, extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(base(demo, *extra))


@pytest.mark.parametrize("extra, match", [
    (["--grpo-std-level", "batch", "--advantage-estimator", "rloo"],
     "--grpo-std-level batch picks the std of a GRPO/GSPO advantage; --advantage-estimator rloo has none"),
    (["--grpo-std-level", "batch", "--disable-grpo-std-normalization"],
     "but --disable-grpo-std-normalization divides by none"),
    (["--grpo-std-level", "batch", "--disable-rewards-normalization"],
     "but --disable-rewards-normalization divides by none"),
])
def test_grpo_std_level_without_a_std_to_pick_is_refused(demo, extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(base(demo, *extra))


def test_grpo_std_level_batch_reaches_the_advantages(demo):
    from megatron_rl.algorithms.from_config import spec_from_config

    spec = spec_from_config(parse_config(base(demo, "--grpo-std-level", "batch", "--advantage-estimator", "gspo")))
    assert spec.cfg.grpo_std_level == "batch" and spec.cfg.use_gspo


def test_gae_is_verls_name_for_ppo_with_a_critic(demo):
    cfg = parse_config(base(demo, "--advantage-estimator", "gae"), validate=False)
    assert cfg.algorithm.advantage_estimator == "ppo"  # the same run as --advantage-estimator ppo from here on
    assert cfg == parse_config(base(demo, "--advantage-estimator", "ppo"), validate=False)
