"""The training half of one RL step: old/ref/teacher log-probs, advantages, the optimizer steps."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from megatron_rl.algorithms.spec import Spec
from megatron_rl.backends.base import TrainBackend, TrainBatch
from megatron_rl.config import Config
from megatron_rl.data.types import Sample
from megatron_rl.runner.step_metrics import aggregate_step_metrics


def rollout_old_logprobs(samples: Sequence[Sample]) -> list[torch.Tensor]:
    """--use-rollout-logprobs: the engine's token log-probs as the old log-probs (float32, response-aligned)."""
    return [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]


def train_on_rollout(backend: TrainBackend, spec: Spec, samples: list[Sample], cfg: Config,
                     perf: Optional[dict] = None) -> dict[str, float]:
    """Old/ref/teacher log-probs, advantages, then the optimizer steps; each phase's ``perf/*_s`` goes to ``perf``."""
    perf = {} if perf is None else perf
    t = time.perf_counter()
    needs = spec.prepare_batch(samples)
    if needs.old_logprobs:
        old = backend.forward_only(samples)
    else:
        old = rollout_old_logprobs(samples) if needs.old_from_rollout else None
    perf["perf/old_logprob_s"], t = time.perf_counter() - t, time.perf_counter()
    ref = backend.maybe_compute_ref_log_probs(samples, needs.ref_logprobs)
    perf["perf/ref_logprob_s"], t = time.perf_counter() - t, time.perf_counter()
    teacher = backend.maybe_compute_teacher_log_probs(samples, needs.teacher_logprobs)
    if needs.teacher_logprobs:
        perf["perf/teacher_logprob_s"] = time.perf_counter() - t
    t = time.perf_counter()
    advantages = spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=ref)
    gbs = cfg.batching.effective_global_batch_size
    steps: list[dict[str, float]] = []
    for _ in range(cfg.algorithm.num_steps_per_rollout_updates):
        for start in range(0, len(samples), gbs):
            sl = slice(start, start + gbs)
            pick = (lambda xs: None if xs is None else xs[sl])
            steps.append(backend.train_step(TrainBatch(samples[sl], advantages[sl], pick(old), pick(ref),
                                                       pick(teacher))))
    perf["perf/train_s"] = time.perf_counter() - t
    return aggregate_step_metrics(steps)  # every optimizer step of the rollout, not the last one
