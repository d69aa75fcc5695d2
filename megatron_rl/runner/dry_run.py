"""``--dry-run``: every check has passed; show the placement and exit without starting work."""

from __future__ import annotations

import dataclasses

from megatron_rl.config import Config
from megatron_rl.config.placement import is_external_sglang, plan_for_config
from megatron_rl.plan import format_table, validate_plan


def print_plan(cfg: Config) -> int:
    plan = plan_for_config(cfg)
    report = validate_plan(plan)
    external = is_external_sglang(cfg)
    if external and cfg.has_training:
        # the plan holds only the actor (the servers are not ours to place): its "no rollout engine"
        # notes describe a train-only run, which this is not
        report = dataclasses.replace(report, info=tuple(
            i for i in report.info if "no rollout engine" not in i and "is unused" not in i))
    print(format_table(plan, report))
    if external:
        print(f"rollout: external SGLang servers, not started or placed by this run: "
              f"{' '.join(cfg.rollout.rollout_engine_urls)}; weights reach them through "
              f"--update-weight-disk-dir {cfg.sync.update_weight_disk_dir}")
    print(f"dry run: configuration valid; training world {cfg.actor_world_size} rank(s), "
          f"data-parallel {cfg.data_parallel_size}; nothing was started")
    return 0
