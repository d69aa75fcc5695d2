"""A planned stop (wall time, SIGTERM/SIGINT after start-up): every rank agrees, then the launcher is told."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.infra.tracking import Tracker
from megatron_rl.infra.wall_time import EXIT_WALL_TIME, WallClock, write_run_status

log = logging.getLogger("megatron_rl")


@dataclass
class StopPolicy:
    cfg: Config
    clock: WallClock
    tracker: Tracker
    is_driver: bool

    def should_stop(self) -> bool:
        """Collective: stop when any rank was asked to (a signal may reach one rank only)."""
        flag = torch.tensor([1.0 if self.clock.should_stop() else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop_early(self, step: int) -> int:
        """Say why, record ``stopped_early`` for the launcher (exit 3), return EXIT_WALL_TIME."""
        reason = self.clock.stop_reason() or "stop requested"
        log.warning("stopping early: %s; relaunch the same command to resume", reason)
        self.tracker.close()
        if self.is_driver:
            write_run_status(self.cfg.runtime.output_dir, "stopped_early", reason=reason, rollout_id=step)
        return EXIT_WALL_TIME
