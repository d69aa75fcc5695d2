"""The pieces of one RL step that every driver loop shares (``train.py``'s and ``one_step``'s).

Why a class: the synchronous loop and the asynchronous ones order the same acts (train on a
rollout, sync the weights, evaluate, log, save, stop) around a different generation; written
once here, each loop stays a screen and a step's bookkeeping cannot drift between them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.algorithms.spec import Spec
from megatron_rl.backends.base import TrainBackend
from megatron_rl.data.types import Sample
from megatron_rl.infra.collective_watch import TRAIN_STEP, WEIGHT_SYNC, watched
from megatron_rl.infra.pause_points import pause_point
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.replicas import ReplicaWorker
from megatron_rl.runner.context import RunContext
from megatron_rl.runner.engine_faults import EngineRecovery
from megatron_rl.runner.step import apply_reward_model, train_on_rollout


@dataclass
class StepParts:
    ctx: RunContext
    spec: Spec
    backend: Optional[TrainBackend]
    rollout: Optional[RolloutManager]  # the driver's manager (None on the other ranks)
    replica: Optional[ReplicaWorker]  # another rank's embedded engine replica (--embedded-engine-ranks)
    engine: Any  # this rank's engine (what the weight sync and the colocation act on), or None
    recovery: EngineRecovery
    sync: Any  # the weight synchronizer
    resync: Any  # (version) -> metrics: a complete sync of the trainer's weights after an engine restart
    synced_version: int = 0  # the version the engines hold: the last sync's
    prepare_final: Optional[Callable[[], Optional[dict]]] = None  # an async driver's extra state for the final save
    reward_model: Any = None  # --reward-model-path: the RM role on the trainer's ranks (backends/reward_model.py)

    @property
    def here(self):
        """This rank's rollout side: the driver's manager, or its engine replica."""
        return self.rollout or self.replica

    def generate(self, rollout_id: int) -> tuple[Optional[list[Sample]], dict]:
        """Rollout ``rollout_id``, now (the synchronous way), with ``--use-fault-tolerance``'s retries."""
        t0 = time.perf_counter()
        self.ctx.colocation.before_generate(self.backend)
        samples, metrics = self.recovery.generate(
            lambda: self.ctx.rollouts.get(rollout_id, self.rollout, self.replica), self.rollout,
            resync=lambda: self.resync(self.synced_version))
        metrics["perf/generate_s"] = time.perf_counter() - t0  # with rewards (also perf/reward_s)
        return samples, metrics

    def train(self, samples: Optional[list[Sample]], metrics: dict, *, rollout_id: int) -> None:
        """The training half of a step (and the colocated hand-overs around it), into ``metrics``.

        ``--ref-update-interval N``: once rollout ``rollout_id`` trained and ``rollout_id + 1`` is a multiple of N,
        the reference becomes the actor's current weights (slime's actors do it at the same point)."""
        with watched(TRAIN_STEP):  # a rank that does not answer a collective of it is named (with the hand-overs)
            self._train(samples, metrics, rollout_id)

    def _train(self, samples: Optional[list[Sample]], metrics: dict, rollout_id: int) -> None:
        backend, ctx = self.backend, self.ctx
        assert backend is not None, "a run that trains built its backend"
        metrics.update(ctx.colocation.before_train(backend, self.here))
        if self.reward_model is not None:  # the RM role scores the batch before any advantage is computed
            apply_reward_model(self.reward_model, samples, metrics)
        swapped = backend.swap_seconds
        train_actor = rollout_id >= ctx.cfg.algorithm.num_critic_only_steps  # ppo: the critic warms up first
        metrics.update(train_on_rollout(backend, self.spec, samples, ctx.cfg, perf=metrics, train_actor=train_actor))
        every = ctx.cfg.algorithm.ref_update_interval
        if every is not None and (rollout_id + 1) % every == 0:
            backend.snapshot_weights("ref")
            metrics["train/ref_updated"] = 1.0
        metrics["perf/weight_swap_s"] = backend.swap_seconds - swapped  # ref/teacher copy in + out
        ctx.colocation.before_rollout(backend, self.here)

    def push_weights(self, version: int, metrics: dict) -> None:
        """The weight sync to ``version`` (the step's count of updates), timed as ``perf/sync_s``."""
        t = time.perf_counter()
        pause_point("sync_started", str(version))  # tests: SIGKILL as a sync begins (async: the producer quiesced)
        with watched(WEIGHT_SYNC):  # with the colocated hand-over after it
            metrics.update(self.sync.sync(self.backend, self.engine, version=version))
            self.synced_version = version
            metrics["perf/sync_s"] = time.perf_counter() - t
            self.ctx.colocation.after_sync(self.here)

    def evaluate_and_log(self, rollout_id: int, metrics: dict, t0: float) -> None:
        """Evaluation when due, the step time since ``t0``, the step's metrics record."""
        ctx = self.ctx
        if self.rollout and ctx.evaluation.due(rollout_id):
            t = time.perf_counter()
            metrics.update(self.rollout.evaluate(rollout_id))
            metrics["perf/eval_s"] = time.perf_counter() - t
        metrics["perf/step_time_s"] = time.perf_counter() - t0
        ctx.log(rollout_id + 1, metrics)
        pause_point("step_logged", str(rollout_id + 1))  # tests: a signal once this step is in metrics.jsonl

    def save_or_stop(self, rollout_id: int,
                     prepare: Optional[Callable[[], Optional[dict]]] = None) -> tuple[bool, Optional[int]]:
        """The scheduled save, then a planned stop (saving first if the schedule did not): ``(saved, exit code
        or None)``. ``prepare``: called on every rank right before a save; what it returns (the driver's) goes
        into the checkpoint's extra state (an async driver's prompt position, its buffer's file)."""
        ctx, backend = self.ctx, self.backend

        def save() -> None:
            assert backend is not None, "only a run with a backend saves"
            ctx.checkpoints.save(backend, self.rollout, rollout_id + 1, extra_state=prepare() if prepare else None)

        saved = backend is not None and ctx.checkpoints.due(rollout_id)
        if saved:
            save()
        if ctx.stop.should_stop():
            if backend and not saved:
                save()
                saved = True
            return saved, ctx.stop.stop_early(rollout_id + 1)
        return saved, None
