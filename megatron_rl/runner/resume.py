"""Start-up state: the frozen weight tags, then continue from the newest complete checkpoint if any."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from megatron_rl.backends.base import TrainBackend
from megatron_rl.config import Config
from megatron_rl.errors import CheckpointError, ConfigError
from megatron_rl.infra import checkpoint_root as ckpt
from megatron_rl.infra.checkpoint_root import is_model_dir
from megatron_rl.infra.collective_watch import RESUME, watched
from megatron_rl.infra.dist import rank0_do
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.rollout_ckpt import rollout_ckpt_path
from megatron_rl.runner.buffer_file import buffer_path
from megatron_rl.runner.checkpoints import CheckpointCursor

log = logging.getLogger("megatron_rl")


@dataclass
class Resumer:
    cfg: Config
    cursor: CheckpointCursor

    def resume_or_init(self, backend: TrainBackend, rollout: Optional[RolloutManager]) -> int:
        """Collective: :meth:`_resume_or_init`, a rank that does not answer it named (``infra.collective_watch``)."""
        with watched(RESUME):
            return self._resume_or_init(backend, rollout)

    def _resume_or_init(self, backend: TrainBackend, rollout: Optional[RolloutManager]) -> int:
        """Snapshot the reference policy, then continue from the newest complete checkpoint if any;
        returns the rollout id to start at."""
        cfg = self.cfg
        if cfg.checkpoint.ref_load:
            backend.load_frozen_weights("ref", cfg.checkpoint.ref_load)
        elif cfg.algorithm.use_kl_loss or cfg.algorithm.kl_coef > 0:  # KL in the loss or (--kl-coef) the reward
            backend.snapshot_weights("ref")  # the initial policy, before any resumed weights are loaded
        if cfg.checkpoint.opd_teacher_load:
            backend.load_frozen_weights("teacher", cfg.checkpoint.opd_teacher_load)
        # a model-only --load gave the initial weights (backend.initialize); resuming is from --save
        load_root = None if is_model_dir(cfg.checkpoint.load) else cfg.checkpoint.load
        root = load_root or cfg.checkpoint.save
        if not root or cfg.checkpoint.no_auto_resume:
            return 0
        if load_root and (named_iteration := ckpt.iteration_of(load_root)) is not None:
            if cfg.checkpoint.allow_resume_older and cfg.checkpoint.save:
                self._supersede_newer(cfg.checkpoint.save, named_iteration)
            path, extra = load_root, self._load_named(backend, load_root)
        else:
            found = self._load_newest_good(backend, root, named=bool(load_root))
            if found is None:
                return 0
            path, extra = found
        untrained = extra.get("async_buffer") or {}
        if (untrained.get("groups") or untrained.get("pending")) and cfg.rollout.async_mode != "full":
            raise ConfigError(f"{path} was saved by --async-mode full with {untrained.get('groups')} finished and "
                              f"{untrained.get('pending')} unfinished prompt group(s) in its rollout buffer "
                              f"({untrained.get('file')}), which --async-mode {cfg.rollout.async_mode} does not read: "
                              "resuming would skip those prompts. Relaunch with --async-mode full (it trains them "
                              "first), or start afresh (--no-auto-resume --existing-save archive)")
        if rollout is not None and extra.get("dataset_state"):
            rollout.prompts.load_state_dict(extra["dataset_state"])
        step = int(extra["rollout_id"])
        self._restore_updated_reference(backend, step, path)
        log.info("resumed from %s at rollout %d", path, step)
        self.cursor.step, self.cursor.path, self.cursor.resumed_at = step, path, step
        self.cursor.extra = extra
        return step

    def _restore_updated_reference(self, backend: TrainBackend, step: int, path: str) -> None:
        """``--ref-update-interval N``: the reference is the actor as it was after the last rollout count that is
        a multiple of N (slime replaces it then). A checkpoint at such a count holds exactly those weights, so
        the reference is snapshotted from them once loaded; any other count would need weights no checkpoint
        holds, so the resume is refused naming the flag."""
        n = self.cfg.algorithm.ref_update_interval
        if n is None or step < n:  # before the first update the reference is still the initial one
            return
        if step % n:
            raise ConfigError(f"--ref-update-interval {n}: {path} is at rollout {step}, but the reference was last "
                              f"replaced by the actor at rollout {step - step % n}, whose weights no checkpoint "
                              f"holds. Resume from a checkpoint at a multiple of {n} (--load that iter_ dir, with "
                              f"--allow-resume-older), or save at multiples of {n} (--save-interval)")
        backend.snapshot_weights("ref")

    @staticmethod
    def _supersede_newer(save_root: str, step: int) -> None:
        """``--allow-resume-older``: the iterations above ``step`` under ``--save`` (which this run's saves
        would overwrite) move into ``superseded/`` on rank 0, before anything is loaded or saved."""
        def move() -> list[str]:
            newer = ckpt.newer_iterations(save_root, step)
            moved = ckpt.move_aside(save_root, newer, companions=lambda s: [rollout_ckpt_path(save_root, s),
                                                                             buffer_path(save_root, s)])
            if moved:
                log.warning("--allow-resume-older: resuming iteration %d; moved the newer %s aside: %s", step,
                            ", ".join(f"iter_{s:07d}" for s in newer), ", ".join(moved))
            return moved

        rank0_do(move, f"moving the iterations above {step} under {save_root} aside")

    @staticmethod
    def _load_named(backend: TrainBackend, path: str) -> dict:
        """``--load ROOT/iter_NNNNNNN``: exactly that checkpoint, or an error naming it (no fallback:
        the user chose it)."""
        try:
            return backend.load(path)
        except CheckpointError as e:
            raise CheckpointError(f"--load {path} (named, so never swapped for another checkpoint): {e}") from e

    @staticmethod
    def _load_newest_good(backend: TrainBackend, root: str, named: bool) -> Optional[tuple[str, dict]]:
        """Auto-resume: the first of ``checkpoint_root.resume_candidates`` that passes the loader's
        checks, as (path, extra_state); None when the root holds no complete checkpoint.

        One rule for every failed check (missing or corrupt marker, missing, resized or
        checksum-failing file, torn or non-finite data: ``CorruptCheckpoint``): warn naming the
        reason and try the previous one. The loader raises those before touching the model, so a
        skipped checkpoint leaves nothing behind. Other refusals (another model, another
        optimizer kind) hold for every checkpoint and stop the run.
        """
        candidates = ckpt.resume_candidates(root)  # the same files on every rank: the same order
        skipped = []
        for step in candidates:
            path = ckpt.iter_dir(root, step)
            try:
                return path, backend.load(path)
            except ckpt.CorruptCheckpoint as e:
                skipped.append(f"{path}: {e}")
                log.warning("not resuming from %s: %s; trying the previous complete checkpoint", path, e)
        if skipped:
            raise CheckpointError(f"no checkpoint under {root} passes its checks ({'; '.join(skipped)}); restore "
                                  "one, or move the root away to start from --hf-checkpoint")
        if named:
            raise ConfigError(f"--load {root}: no complete checkpoint there (iter_NNNNNNN dirs with a "
                              "COMPLETE marker); drop --load to start from --hf-checkpoint")
        return None
