"""The training half of one RL step, role by role (``backends/roles.py``): the actor's old log-probs, the reference's
and the teacher's, the critic's values, advantages, then the actor's and the critic's optimizer steps."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from megatron_rl.algorithms.spec import Spec
from megatron_rl.backends.base import TrainBackend, TrainBatch
from megatron_rl.backends.reward_model import RewardModel, score_batch
from megatron_rl.backends.rollout_shards import AnySample, distribute_rollout
from megatron_rl.config import Config
from megatron_rl.data.types import Sample, SampleStub
from megatron_rl.rollout.batch_builder import reward_stats
from megatron_rl.rollout.rewards import METRICS_KEY as REWARD_METRICS_KEY
from megatron_rl.runner.step_metrics import aggregate_step_metrics


def rollout_old_logprobs(samples: Sequence[AnySample]) -> list[Optional[torch.Tensor]]:
    """--use-rollout-logprobs: the engine's token log-probs as the old log-probs (float32, response-aligned);
    None for the samples another data-parallel rank holds (``SampleStub``)."""
    return [None if isinstance(s, SampleStub) else torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            for s in samples]


def value_metrics(samples: Sequence[AnySample], values, returns) -> dict[str, float]:
    """``critic/vf_explained_var`` (verl's): ``1 - Var(R - V) / Var(R)`` over the batch's loss tokens, the
    critic's values ``V`` before the step against the returns ``R``; 1 is a perfect critic, 0 no better than a
    constant, and ``critic/returns_mean``. Every rank holds the whole batch (ppo needs it for its advantages)."""
    if values is None or returns is None or any(v is None for v in values):
        return {}
    mask = torch.tensor([m for s in samples for m in s.effective_loss_mask()], dtype=torch.float64) > 0
    v = torch.cat([t.double() for t in values])[mask]
    r = torch.cat([t.double() for t in returns])[mask]
    if r.numel() < 2:
        return {}
    var_r = float(r.var())
    out = {"critic/returns_mean": float(r.mean())}
    if var_r > 0:
        out["critic/vf_explained_var"] = 1.0 - float((r - v).var()) / var_r
    return out


def apply_reward_model(rm: RewardModel, samples: Optional[list[Sample]], metrics: dict) -> None:
    """The reward-model role (``backends/reward_model.py``): every sample of the driver's batch scored on the trainer's
    ranks (collective; ``samples`` None on the other ranks), its reward set to ``--reward-model-weight`` x score plus
    the rule reward when the run has one (kept as ``reward/rule``; the score as ``reward/rm_score``), and the
    rollout's reward metrics computed again from the new rewards."""
    t = time.perf_counter()
    scores = score_batch(rm, samples)
    if samples is not None and scores is not None:
        for sample, score in zip(samples, scores):
            extra = sample.metadata.setdefault(REWARD_METRICS_KEY, {})
            extra["rm_score"] = score
            if rm.has_rule:
                extra["rule"] = float(sample.reward)
            sample.reward = (float(sample.reward) if rm.has_rule else 0.0) + rm.weight * score
        metrics.update(reward_stats(samples))
    metrics["perf/reward_model_s"] = time.perf_counter() - t


def train_on_rollout(backend: TrainBackend, spec: Spec, samples: Optional[list[Sample]], cfg: Config,
                     perf: Optional[dict] = None, *, train_actor: bool = True) -> dict[str, float]:
    """Old/ref/teacher log-probs (and the critic's values), advantages, then the optimizer steps; each phase's
    ``perf/*_s`` goes to ``perf``. ``train_actor=False`` (--num-critic-only-steps): only a critic trains.

    ``samples``: the driver's rollout batch (None on the other ranks). Each data-parallel rank
    receives the samples it trains on (``rollout_shards.distribute_rollout``), computes their
    old/ref/teacher log-probs and keeps them; only an estimator that folds log-probs into the
    advantages (computed on the whole batch) needs every sample, and then every log-prob, on
    every rank.
    """
    perf = {} if perf is None else perf
    gbs = cfg.batching.effective_global_batch_size
    t = time.perf_counter()
    whole = spec.needs_whole_batch()
    batch, distributed_plan = distribute_rollout(samples, backend, gbs, whole=whole)
    perf["perf/broadcast_s"], t = time.perf_counter() - t, time.perf_counter()
    needs = spec.prepare_batch(batch)
    plan = distributed_plan or backend.plan_rollout(batch, gbs)
    owned_only = not whole
    old: Optional[list[Optional[torch.Tensor]]]
    # the actor (the policy before this step's updates), or the engine's own log-probs (--use-rollout-logprobs)
    if needs.old_logprobs:
        old = backend.forward_only(batch, plan=plan.forward, owned_only=owned_only)
    else:
        old = rollout_old_logprobs(batch) if needs.old_from_rollout else None
    perf["perf/old_logprob_s"], t = time.perf_counter() - t, time.perf_counter()
    # frozen roles: the reference (KL) and the on-policy-distillation teacher, tags or models of their own
    ref = backend.maybe_compute_ref_log_probs(batch, needs.ref_logprobs, plan=plan.forward, owned_only=owned_only)
    perf["perf/ref_logprob_s"], t = time.perf_counter() - t, time.perf_counter()
    teacher = backend.maybe_compute_teacher_log_probs(batch, needs.teacher_logprobs, plan=plan.forward,
                                                      owned_only=owned_only)
    if needs.teacher_logprobs:
        perf["perf/teacher_logprob_s"] = time.perf_counter() - t
    t = time.perf_counter()
    values = returns = None
    if needs.values:  # the critic (ppo): its values over the same micro-batches, before the advantages (GAE)
        values = backend.compute_values(batch, plan=plan.forward, owned_only=owned_only)
        perf["perf/values_s"], t = time.perf_counter() - t, time.perf_counter()
        advantages, returns = spec.compute_advantages_and_returns(batch, old_logprobs=old, ref_logprobs=ref,
                                                                  values=values)
        perf.update(value_metrics(batch, values, returns))
    else:
        advantages = spec.compute_advantages(batch, old_logprobs=old, ref_logprobs=ref)
    steps: list[dict[str, float]] = []  # the actor's optimizer steps, each with the critic's when it has returns
    for _ in range(cfg.algorithm.num_steps_per_rollout_updates):
        ends = [start for start, _ in plan.steps[1:]] + [len(batch)]  # a step holds its trajectories' branches
        for (start, step_plan), end in zip(plan.steps, ends):
            sl = slice(start, end)
            pick = (lambda xs: None if xs is None else xs[sl])
            steps.append(backend.train_step(TrainBatch(batch[sl], advantages[sl], pick(old), pick(ref),
                                                       pick(teacher), plan=step_plan, old_values=pick(values),
                                                       returns=pick(returns), train_actor=train_actor)))
    perf["perf/train_s"] = time.perf_counter() - t
    metrics = aggregate_step_metrics(steps)  # every optimizer step of the rollout, not the last one
    metrics.update({f"train/{k}": v for k, v in spec.advantage_metrics().items()})  # e.g. the reward KL
    return metrics
