"""``RunContext``: the run's state that is not the model, and the collaborators the loop calls.

The tracker (driver only), the wall clock, the checkpoint cursor, and one object
per job (see ``megatron_rl.runner``). ``create`` builds them from the ``Config``
in the order a start needs: the driver takes the lock on ``--save`` (one run per root,
``infra.save_lock``) before anything writes there, a ``--existing-save`` choice is carried out before
anything reads the save root, the wall clock continues the elapsed time of the
job it resumes, and W&B continues the resumed run's id.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_rl.backends.base import TrainBackend
from megatron_rl.config import Config
from megatron_rl.infra.checkpoint_root import read_resume_state
from megatron_rl.infra.plot import DEFAULT_KEYS, plot_metrics
from megatron_rl.infra.save_lock import SaveLock
from megatron_rl.infra.save_lock import acquire as acquire_save_lock
from megatron_rl.infra.tracking import Tracker, final_lineage, read_jsonl
from megatron_rl.infra.wall_time import WallClock, write_run_status
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.runner.checkpoints import CheckpointCursor, CheckpointSaver
from megatron_rl.runner.colocation import Colocation, expected_release_fraction
from megatron_rl.runner.evaluation import EvalSchedule
from megatron_rl.runner.fresh_start import clear_save_root
from megatron_rl.runner.resume import Resumer
from megatron_rl.runner.rollout_source import RolloutSource
from megatron_rl.runner.stop import StopPolicy

log = logging.getLogger("megatron_rl")

CONSOLE_KEYS = ["rollout/reward_mean", "eval/reward_mean", "train/pg_loss", "train/kl", "train/entropy",
                "train/grad_norm", "train/mismatch_abs_logprob", "rollout/response_len_mean", "perf/step_time_s"]


@dataclass
class RunContext:
    cfg: Config
    tracker: Tracker
    clock: WallClock
    is_driver: bool
    colocation: Colocation
    resume: Resumer
    checkpoints: CheckpointSaver
    evaluation: EvalSchedule
    stop: StopPolicy
    rollouts: RolloutSource
    resume_state: dict  # resume_state.json of the job this one continues ({} on a fresh start)
    save_lock: Optional[SaveLock] = None  # the driver's lock on --save (released at exit or by finish)

    @classmethod
    def create(cls, cfg: Config) -> "RunContext":
        rank = int(os.environ.get("RANK", "0"))
        rt, ck = cfg.runtime, cfg.checkpoint
        # one run per --save: taken before anything below writes into the root or opens the run's files, by a
        # run that writes there (it trains: checkpoints, stored rollouts; or it clears an earlier run's); a
        # rollout-only run only reads the root and neither creates nor locks it
        written_root = ck.save if cfg.has_training or (ck.existing_save and ck.no_auto_resume) else None
        save_lock = acquire_save_lock(written_root) if rank == 0 and written_root else None
        if rank == 0 and ck.existing_save and ck.no_auto_resume:
            assert ck.save is not None, "validation refuses --existing-save without --save"
            clear_save_root(ck.save, ck.existing_save)  # validation allowed this start
        resume_root = ck.save if not ck.no_auto_resume else None
        state = (read_resume_state(resume_root) or {}) if resume_root else {}
        clock = WallClock(rt.wall_time_limit, rt.wall_time_reserve, elapsed_before_s=state.get("elapsed_s", 0.0))
        clock.install_signal_handlers()
        tracker = Tracker(rt.output_dir, enabled=rank == 0, tensorboard_dir=rt.tensorboard_dir,
                          wandb_project=rt.wandb_project, wandb_group=rt.wandb_group, wandb_mode=rt.wandb_mode,
                          wandb_resume_id=rt.wandb_resume_id or state.get("wandb_run_id"),
                          config=cfg.to_dict(), console_keys=CONSOLE_KEYS,
                          wandb_entity=rt.wandb_team, wandb_host=rt.wandb_host, wandb_key=rt.wandb_key)
        is_driver, cursor, m = rank == 0, CheckpointCursor(), cfg.memory
        return cls(cfg, tracker, clock, is_driver,
                   colocation=Colocation(m.effective_offload_train, m.effective_offload_rollout,
                                         expected_release_fraction=expected_release_fraction(cfg)),
                   resume=Resumer(cfg, cursor),
                   checkpoints=CheckpointSaver(cfg, cursor, clock, tracker, is_driver),
                   evaluation=EvalSchedule(cfg, clock),
                   stop=StopPolicy(cfg, clock, tracker, is_driver),
                   rollouts=RolloutSource(cfg, cursor, is_driver), resume_state=state, save_lock=save_lock)

    def begin_attempt(self, start: int) -> None:
        """This launch continues the run at step ``start``: the earlier launches' records past it are marked
        superseded in metrics.jsonl, their TensorBoard events hidden (infra/tracking.py)."""
        self.tracker.begin_attempt(start)

    def log(self, step: int, metrics: dict, *, attempt_start: bool = False) -> None:
        self.tracker.log(step, metrics, attempt_start=attempt_start)

    def finish(self, backend: Optional[TrainBackend], rollout: Optional[RolloutManager],
               prepare: Optional[Callable[[], Optional[dict]]] = None) -> None:
        """After the last rollout: final save (``prepare``: an async driver's extra state, as for its saves),
        ``finished`` for the launcher, the curves as a PNG."""
        self.checkpoints.save_final(backend, rollout, prepare)
        self.tracker.close()
        if self.is_driver:
            write_run_status(self.cfg.runtime.output_dir, "finished", rollout_id=self.cfg.rollout.num_rollout)
            out = os.path.join(self.cfg.runtime.output_dir, "curves.png")
            plot_metrics(final_lineage(read_jsonl(self.tracker.jsonl_path)), DEFAULT_KEYS, out, title=self.cfg.runtime.output_dir)
            log.info("wrote %s", out)
        if self.save_lock is not None:
            self.save_lock.release()
