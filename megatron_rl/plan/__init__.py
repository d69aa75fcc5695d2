"""Placement planner: allocation strings, GPU demand, and validation.

Three ways to state placement resolve into one frozen :class:`Allocation`:

    parse_allocation("sglang:d2t4+megatron:d2p2t2")                # AReaL string
    plan_from_slime_flags(actor_num_nodes=1, actor_num_gpus_per_node=8,
                          rollout_num_gpus=8, rollout_num_gpus_per_engine=2,
                          tensor_model_parallel_size=2)            # slime flags
    plan, cluster = plan_from_areal_args(["rollout.backend=sglang:d2t4",
                                          "actor.backend=fsdp:d8",
                                          "cluster.n_nodes=2"])   # AReaL key=value

then ``validate_plan(plan, cluster, model, seq_length, vpp) -> PlanReport``
checks it against a :class:`Cluster` and a :class:`ModelShape`. Malformed input
raises :class:`~megatron_rl.errors.PlanError`; a well-formed plan that does not
fit is reported, not raised (``report.raise_for_errors()`` raises).

``plan.memory`` estimates what each training rank holds (parameters, gradient
buffers, optimizer state) from config.json and the flags; ``plan.sync_estimate``
how long a weight sync takes and what share of an RL step it is.

This package imports only the standard library (no torch, no megatron), so
``tools/check_plan.py`` answers instantly. See docs/planner.md.
"""

from megatron_rl.plan.allocation import (
    BACKENDS, INFERENCE_BACKENDS, TRAINING_BACKENDS, WEIGHT_UPDATE_MODES, Allocation, Component,
    Dims, Group,
)
from megatron_rl.plan.grammar import parse_allocation
from megatron_rl.plan.model_shape import ModelShape
from megatron_rl.plan.render import format_table, report_dict
from megatron_rl.plan.sources import plan_from_areal_args, plan_from_slime_flags
from megatron_rl.plan.validate import Cluster, PlanReport, validate_plan

__all__ = [
    "Allocation", "Component", "Dims", "Group", "Cluster", "ModelShape", "PlanReport",
    "parse_allocation", "plan_from_slime_flags", "plan_from_areal_args", "validate_plan",
    "format_table", "report_dict",
    "BACKENDS", "INFERENCE_BACKENDS", "TRAINING_BACKENDS", "WEIGHT_UPDATE_MODES",
]
