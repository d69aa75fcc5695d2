"""A rollout's logged train/* metrics combine all its optimizer steps (they used to be the last step's).

The backend is a test double whose ``train_step`` reports, like the real one, per-step
token means, the step's ``train/loss_tokens``, a grad norm and an LR; the per-token
values come from the samples, so the expected rollout value (one mean over every
token trained on) is computed independently of the aggregation code.
"""

from types import SimpleNamespace

import pytest

from megatron_rl.backends.base import RolloutPlan
from megatron_rl.runner.step import train_on_rollout


class FakeSpec:
    def needs_whole_batch(self):
        return False

    def prepare_batch(self, samples):
        return SimpleNamespace(old_logprobs=False, ref_logprobs=False, teacher_logprobs=False, old_from_rollout=False,
                               advantages_need_logprobs=False, values=False)

    def compute_advantages(self, samples, old_logprobs=None, ref_logprobs=None):
        return [s.adv for s in samples]

    def advantage_metrics(self):
        return {}


class FakeBackend:
    """Per step: token means of each sample's constant per-token loss / kl, its token count, a grad norm, an LR."""

    def __init__(self):
        self.steps = []

    def plan_rollout(self, samples, gbs):
        return RolloutPlan(None, [(start, None) for start in range(0, len(samples), gbs)])

    def forward_only(self, samples, plan=None, owned_only=False):
        raise AssertionError("not needed")

    def maybe_compute_ref_log_probs(self, samples, needed, plan=None, owned_only=False):
        return None

    def maybe_compute_teacher_log_probs(self, samples, needed, plan=None, owned_only=False):
        return None

    def train_step(self, batch):
        i = len(self.steps)
        tokens = sum(s.tokens for s in batch.samples)
        m = {"train/loss_tokens": float(tokens),
             "train/pg_loss": sum(s.tokens * s.loss for s in batch.samples) / tokens,
             "train/kl": sum(s.tokens * s.kl for s in batch.samples) / tokens,
             "train/grad_norm": [2.0, 5.0, 3.5, 1.0][i], "train/lr": [1e-3, 2e-3, 4e-3, 8e-3][i],
             "train/update_skipped": float(i == 1), "train/micro_batches": 2.0, "train/step_time_s": 0.25}
        self.steps.append(m)
        return m


SAMPLES = [SimpleNamespace(tokens=t, loss=loss, kl=k, adv=0.0)
           for t, loss, k in [(3, 1.0, 0.5), (9, -2.0, 0.1), (1, 4.0, 0.0), (2, 0.5, 0.3)]]


def _cfg(gbs, epochs):
    return SimpleNamespace(batching=SimpleNamespace(effective_global_batch_size=gbs),
                           algorithm=SimpleNamespace(num_steps_per_rollout_updates=epochs))


def _token_mean(samples, key):
    return sum(s.tokens * getattr(s, key) for s in samples) / sum(s.tokens for s in samples)


def test_two_step_rollout_logs_the_aggregate_of_both_steps():
    backend = FakeBackend()
    got = train_on_rollout(backend, FakeSpec(), SAMPLES, _cfg(gbs=2, epochs=1))
    a, b = backend.steps
    assert len(backend.steps) == 2 and a["train/pg_loss"] != b["train/pg_loss"]
    assert got["train/num_optimizer_steps"] == 2.0
    assert got["train/loss_tokens"] == 15.0  # every token of the rollout, not the last step's 3
    for key in ("loss", "kl"):  # token-weighted: one mean over all 15 tokens
        assert got[f"train/{'pg_loss' if key == 'loss' else key}"] == pytest.approx(_token_mean(SAMPLES, key),
                                                                                    rel=1e-12)
    assert got["train/grad_norm"] == pytest.approx((2.0 + 5.0) / 2, rel=1e-12)  # mean over steps
    assert got["train/lr"] == pytest.approx((1e-3 + 2e-3) / 2, rel=1e-12)
    assert got["train/update_skipped"] == 1.0 and got["train/micro_batches"] == 4.0
    assert got["train/step_time_s"] == 0.5
    from megatron_rl.runner.step_metrics import aggregate_step_metrics

    assert got == aggregate_step_metrics([a, b])


def test_epochs_times_batches_steps_all_count():
    backend = FakeBackend()
    got = train_on_rollout(backend, FakeSpec(), SAMPLES, _cfg(gbs=2, epochs=2))
    assert len(backend.steps) == 4 and got["train/num_optimizer_steps"] == 4.0
    assert got["train/loss_tokens"] == 30.0
    assert got["train/pg_loss"] == pytest.approx(_token_mean(SAMPLES, "loss"), rel=1e-12)
    assert got["train/grad_norm"] == pytest.approx((2.0 + 5.0 + 3.5 + 1.0) / 4, rel=1e-12)


def test_steps_must_report_the_same_metrics():
    from megatron_rl.runner.step_metrics import aggregate_step_metrics

    with pytest.raises(ValueError, match="optimizer step 1 reported metrics"):
        aggregate_step_metrics([{"train/kl": 1.0}, {"train/kl": 1.0, "train/entropy": 2.0}])
    assert aggregate_step_metrics([]) == {}


def test_maxima_take_the_largest_step():
    from megatron_rl.runner.step_metrics import aggregate_step_metrics

    got = aggregate_step_metrics([{"train/loss_tokens": 9.0, "train/tis_ratio_max": 3.5},
                                  {"train/loss_tokens": 1.0, "train/tis_ratio_max": 40.0}])
    assert got["train/tis_ratio_max"] == 40.0  # a token-weighted mean would say 7.15
