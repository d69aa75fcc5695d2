"""Rollout N by id: from the engine, from a debug file, or from ``rollout_ckpts/`` after a resume."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from megatron_rl.config import Config
from megatron_rl.data.types import Sample
from megatron_rl.rollout import rollout_ckpt
from megatron_rl.rollout.manager import RolloutManager, load_rollout, save_rollout
from megatron_rl.rollout.replicas import ReplicaWorker
from megatron_rl.runner.checkpoints import CheckpointCursor

log = logging.getLogger("megatron_rl")


@dataclass
class RolloutSource:
    cfg: Config
    cursor: CheckpointCursor
    is_driver: bool

    def get(self, rollout_id: int, rollout: Optional[RolloutManager],
            replica: Optional[ReplicaWorker] = None) -> tuple[Optional[list[Sample]], dict]:
        """The driver's samples + rollout metrics; (None, {}) on the other ranks, whose engine replica
        (``replica``, --embedded-engine-ranks) generates its parts of the rollout meanwhile."""
        mode = self.cfg.mode
        if not self.is_driver:
            if replica is not None:
                replica.serve()
            return None, {}
        if mode.load_debug_rollout_data:
            samples = load_rollout(mode.load_debug_rollout_data.format(rollout_id=rollout_id))
            metrics = {"rollout/reward_mean": sum(s.reward for s in samples) / len(samples)}
        else:
            assert rollout is not None, "the driver builds its rollout manager unless --load-debug-rollout-data"
            with rollout.engine.serving():  # replicas on the other ranks generate until this ends
                samples, metrics = self._generate_or_reload(rollout_id, rollout)
        if mode.save_debug_rollout_data:
            save_rollout(mode.save_debug_rollout_data.format(rollout_id=rollout_id), rollout_id, samples)
        return samples, metrics

    def _generate_or_reload(self, rollout_id: int, rollout: RolloutManager) -> tuple[list[Sample], dict]:
        """Rollout N from the engine, or from ``rollout_ckpts/rollout_N.pt`` when this job resumed from
        checkpoint N and the job before it had generated N already; a rollout that directly follows a
        checkpoint under --save is written there (rollout/rollout_ckpt.py says why only that one)."""
        root = self.cfg.checkpoint.save
        step, path = self.cursor.step, self.cursor.path
        follows = None  # the checkpoint under --save that this rollout directly follows
        if root and step == rollout_id and self.cfg.has_training:
            assert path is not None, "the cursor's path is set together with its step"
            if os.path.abspath(os.path.dirname(path)) == os.path.abspath(root):
                follows = path
        if follows and self.cursor.resumed_at == rollout_id:
            assert root is not None, "a rollout follows a checkpoint only under a given --save"
            stored = rollout_ckpt.load_rollout_ckpt(root, rollout_id, checkpoint=follows,
                                                    fingerprint=rollout.fingerprint(), state_before=rollout.position(),
                                                    weight_version=rollout.engine.weight_version)
            if stored is not None:
                rollout.load_state_dict(stored["state_after"])
                log.info("rollout %d: loaded from %s, not regenerated", rollout_id,
                         rollout_ckpt.rollout_ckpt_path(root, rollout_id))
                return stored["samples"], stored["metrics"]
        before = rollout.position()
        samples, metrics = rollout.generate(rollout_id)
        if follows:
            assert root is not None, "a rollout follows a checkpoint only under a given --save"
            rollout_ckpt.save_rollout_ckpt(root, rollout_id, checkpoint=follows, samples=samples, metrics=metrics,
                                           fingerprint=rollout.fingerprint(), state_before=before,
                                           state_after=rollout.state_dict())
        return samples, metrics
