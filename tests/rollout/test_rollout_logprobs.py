"""--use-rollout-logprobs: the engine's log-probs are the old log-probs, and no forward runs for them.

The loop (``train_on_rollout``) runs with the real policy-gradient Spec and a backend test
double that counts its forward passes and records the batches it trains on; per-phase
``perf/*_s`` timings come out of the same call.
"""

import pytest
import torch

from megatron_rl.algorithms import PolicyGradientConfig, get_spec
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.backends.base import RolloutPlan
from megatron_rl.runner.step import train_on_rollout


def _samples():
    return [Sample(group_index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=1.0,
                   rollout_logprobs=[-1.0, -2.0, -0.5]),
            Sample(group_index=0, prompt_ids=[1, 2], response_ids=[6, 7], reward=0.0, rollout_logprobs=[-0.3, -0.1])]


class CountingBackend:
    """Forward passes return a constant per token (distinct from any rollout log-prob)."""

    def __init__(self):
        self.forwards, self.batches = 0, []

    def plan_rollout(self, samples, gbs):
        return RolloutPlan(None, [(start, None) for start in range(0, len(samples), gbs)])

    def forward_only(self, samples, plan=None, owned_only=False):
        self.forwards += 1
        return [torch.full((len(s.response_ids),), -7.0) for s in samples]

    def maybe_compute_ref_log_probs(self, samples, needed, plan=None, owned_only=False):
        return self.forward_only(samples) if needed else None

    def maybe_compute_teacher_log_probs(self, samples, needed, plan=None, owned_only=False):
        return None

    def train_step(self, batch):
        self.batches.append(batch)
        return {"train/loss_tokens": 5.0}


class _Cfg:
    class batching:
        effective_global_batch_size = 2

    class algorithm:
        num_steps_per_rollout_updates = 1


def _run(**algo):
    backend, perf = CountingBackend(), {}
    train_on_rollout(backend, get_spec("policy_gradient", PolicyGradientConfig(**algo)), _samples(), _Cfg, perf=perf)
    return backend, perf


def test_rollout_logprobs_are_the_old_logprobs_without_a_forward():
    backend, perf = _run(use_rollout_logprobs=True)
    assert backend.forwards == 0
    (batch,) = backend.batches
    for got, s in zip(batch.old_logprobs, _samples()):  # float32 like the forward's (and packing's) log-probs
        assert got.dtype == torch.float32 and torch.equal(got, torch.tensor(s.rollout_logprobs, dtype=torch.float32))
    assert perf["perf/old_logprob_s"] >= 0 and perf["perf/train_s"] > 0 and "perf/ref_logprob_s" in perf
    # the default still runs the old-log-prob forward (and the ref forward with a KL term)
    backend, _ = _run(kl_loss_coef=0.1)
    assert backend.forwards == 2 and backend.batches[0].old_logprobs[0].tolist() == [-7.0] * 3
    backend, _ = _run(use_rollout_logprobs=True, kl_loss_coef=0.1)
    assert backend.forwards == 1  # the reference forward only


def test_rollout_logprobs_refused_without_engine_logprobs_or_with_tis():
    spec = get_spec("policy_gradient", PolicyGradientConfig(use_rollout_logprobs=True))
    req = spec.prepare_batch(_samples())
    assert not req.old_logprobs and req.old_from_rollout and req.rollout_logprobs
    bad = _samples()
    bad[1].rollout_logprobs = []
    with pytest.raises(ConfigError, match="--use-rollout-logprobs needs rollout log-probs .* sample 1"):
        spec.prepare_batch(bad)
    with pytest.raises(ConfigError, match="--use-rollout-logprobs"):
        PolicyGradientConfig(use_rollout_logprobs=True, use_tis=True)


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def test_rollout_logprobs_flag_validation_and_wiring(hf_dir):
    from megatron_rl.config import parse_config
    from megatron_rl.algorithms import spec_from_config

    assert spec_from_config(parse_config(["--hf-checkpoint", hf_dir, "--use-rollout-logprobs"])).cfg.use_rollout_logprobs
    with pytest.raises(ConfigError, match="--use-rollout-logprobs with --use-tis: TIS weights .* drop one"):
        parse_config(["--hf-checkpoint", hf_dir, "--use-rollout-logprobs", "--use-tis"])
    with pytest.raises(ConfigError, match="--debug-rollout-only does not train"):
        parse_config(["--hf-checkpoint", hf_dir, "--use-rollout-logprobs", "--debug-rollout-only"])


def test_mismatch_metric_stays_meaningful_with_rollout_logprobs():
    """old == rollout would make train/mismatch_abs_logprob 0; it compares the training forward instead."""
    from megatron_rl.algorithms import LossInputs
    from megatron_rl.algorithms.losses import compute_policy_loss
    from megatron_rl.data.packing import compute_loss_denominators

    rollout = torch.tensor([-1.0, -2.0, -0.5])
    logprobs = torch.tensor([-1.25, -2.0, -0.25], requires_grad=True)
    mask = torch.ones(3)
    inputs = LossInputs(logprobs, torch.ones(3), mask, [3], old_logprobs=rollout, rollout_logprobs=rollout)
    _, metrics = compute_policy_loss(inputs, compute_loss_denominators([mask]),
                                     PolicyGradientConfig(use_rollout_logprobs=True))
    total, count = metrics["mismatch_abs_logprob"]
    assert float(total) / float(count) == pytest.approx(0.5 / 3)
