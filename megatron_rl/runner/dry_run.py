"""``--dry-run``: every check has passed; show the placement and exit without starting work."""

from __future__ import annotations

from megatron_rl.config import Config
from megatron_rl.config.placement import plan_for_config
from megatron_rl.plan import format_table, validate_plan


def print_plan(cfg: Config) -> int:
    plan = plan_for_config(cfg)
    print(format_table(plan, validate_plan(plan)))
    print(f"dry run: configuration valid; training world {cfg.actor_world_size} rank(s), "
          f"data-parallel {cfg.data_parallel_size}; nothing was started")
    return 0
