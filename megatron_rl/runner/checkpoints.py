"""The save schedule and the collective save: checkpoint dir, pointers, pruning.

``CheckpointCursor`` is the one piece of state the resume, save and rollout-cache
jobs share: which checkpoint this process last resumed from or saved, because the
rollout generated right after checkpoint N is stored with it (``rollout_ckpts/``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_rl.backends.base import TrainBackend
from megatron_rl.config import Config
from megatron_rl.infra import checkpoint_root as ckpt
from megatron_rl.infra.disk_space import CheckpointDiskFull
from megatron_rl.infra.collective_watch import CHECKPOINT_SAVE, watched
from megatron_rl.infra.dist import rank0_do
from megatron_rl.infra.publish import named_disk_full
from megatron_rl.infra.tracking import Tracker
from megatron_rl.infra.wall_time import EXIT_WALL_TIME, WallClock
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.rollout_ckpt import prune as prune_rollout_ckpts


@dataclass
class CheckpointCursor:
    step: Optional[int] = None  # the checkpoint last resumed from or saved (its rollout id)
    path: Optional[str] = None
    resumed_at: Optional[int] = None  # the step this job resumed at (None: fresh start)
    extra: Optional[dict] = None  # the extra state of the checkpoint resumed from


@dataclass
class CheckpointSaver:
    cfg: Config
    cursor: CheckpointCursor
    clock: WallClock
    tracker: Tracker
    is_driver: bool
    #: the algorithm's evolving state (``Spec.state_dict``: the adaptive KL coefficient), in every checkpoint
    algorithm_state: Optional[Callable[[], dict]] = None

    def due(self, rollout_id: int) -> bool:
        every = self.cfg.checkpoint.save_interval
        return bool(self.cfg.checkpoint.save) and every is not None and (rollout_id + 1) % every == 0

    def save(self, backend: TrainBackend, rollout: Optional[RolloutManager], step: int,
             extra_state: Optional[dict] = None) -> None:
        """Collective: :meth:`_save`, a rank that does not answer it named (``infra.collective_watch``)."""
        with watched(CHECKPOINT_SAVE):
            self._save(backend, rollout, step, extra_state)

    def _save(self, backend: TrainBackend, rollout: Optional[RolloutManager], step: int,
              extra_state: Optional[dict]) -> None:
        """Collective: the backend writes ``iter_<step>``; the driver then moves the pointers and prunes.

        A failure raises on every rank at the same point (the backend's publish and the driver's
        step are agreed), so no rank is left in a collective. A full disk is a
        :class:`CheckpointDiskFull` naming the path, the room needed and the checkpoint a relaunch
        resumes from; its ``exit_code`` is 3 when there is one (``train.main`` exits with it).
        """
        root = self.cfg.checkpoint.save
        if not root:
            return
        extra: dict[str, Any] = {"rollout_id": step}
        if rollout is not None:
            extra["dataset_state"] = rollout.prompts.state_dict()
        # an async driver's own state (the driver's): one-step the prompt position before the rollout generated
        # ahead, full the rollout buffer's file; read back from CheckpointCursor.extra on resume
        extra.update(extra_state or {})
        if self.algorithm_state is not None and (state := self.algorithm_state()):
            extra["algorithm_state"] = state
        box = [extra]  # the driver's dataset state must reach every rank's copy of extra_state
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        path = ckpt.iter_dir(root, step)
        try:
            backend.save(path, box[0])
            self.cursor.step, self.cursor.path = step, path
            rank0_do(lambda: self._after_publish(root, step, path), f"recording {path} in {root}")
        except CheckpointDiskFull as e:  # agreed: every rank is here with the same message
            raise self._disk_full(e, root, path) from e

    def _after_publish(self, root: str, step: int, path: str) -> None:
        """The driver's part once ``path`` is published: pointers, then pruning."""
        try:
            ckpt.write_latest(root, step)
            ckpt.write_resume_state(root, {"rollout_id": step, "checkpoint": path, "elapsed_s": self.clock.elapsed_s,
                                           "wandb_run_id": self.tracker.wandb_run_id})
            if self.cfg.checkpoint.save_max_to_keep:
                ckpt.prune(root, self.cfg.checkpoint.save_max_to_keep)
                prune_rollout_ckpts(root)  # a stored rollout lives as long as the checkpoint it follows
        except Exception as e:
            named = named_disk_full(e, root)
            if named is e:
                raise
            raise named from e

    @staticmethod
    def _disk_full(error: CheckpointDiskFull, root: str, path: str) -> CheckpointDiskFull:
        """The save's full disk, with what a relaunch resumes from and the exit code that says so:
        3 (relaunch to resume, as a stop) where a complete checkpoint is under ``root``, else 2."""
        newest = ckpt.find_latest_complete(root)
        if newest is None:
            out = CheckpointDiskFull(f"{error}. Nothing was saved under --save {root} yet: a relaunch starts over")
        else:
            kept = ckpt.iter_dir(root, newest)
            done = "was published; its pointers were not written" if kept == path else "was not saved"
            out = CheckpointDiskFull(f"{error}. {path} {done}; {kept} is complete: relaunch the same command once "
                                     "there is room and it resumes from there")
            out.exit_code = EXIT_WALL_TIME
        return out

    def save_final(self, backend: Optional[TrainBackend], rollout: Optional[RolloutManager],
                   prepare: Optional[Callable[[], Optional[dict]]] = None) -> None:
        """After the last rollout: save unless the schedule just did (``prepare``: as for the loop's saves)."""
        n = self.cfg.rollout.num_rollout
        if backend is not None and self.cfg.checkpoint.save and not self.due(n - 1):
            self.save(backend, rollout, n, extra_state=prepare() if prepare else None)
