"""When the loop evaluates: every ``--eval-interval`` rollouts and after the last one, wall clock permitting."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import Config
from megatron_rl.infra.wall_time import WallClock


@dataclass
class EvalSchedule:
    cfg: Config
    clock: WallClock

    def due(self, rollout_id: int) -> bool:
        every = self.cfg.data.eval_interval
        last = rollout_id + 1 == self.cfg.rollout.num_rollout
        return every is not None and ((rollout_id + 1) % every == 0 or last) and self.clock.can_eval()
