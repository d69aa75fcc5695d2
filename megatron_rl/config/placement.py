"""The placement implied by the flags, as the planner's ``Allocation``.

Two ways to state placement resolve to one validated plan: an allocation
string (``--allocation``) or slime-style GPU-count flags with the Megatron
parallel sizes.
"""

from __future__ import annotations


def plan_for_config(cfg):
    from megatron_rl.plan import parse_allocation, plan_from_slime_flags

    if cfg.placement.allocation:
        return parse_allocation(cfg.placement.allocation, weight_update=cfg.sync.update_weight_transport)
    p = cfg.parallel
    return plan_from_slime_flags(
        actor_num_nodes=cfg.placement.actor_num_nodes, actor_num_gpus_per_node=cfg.placement.actor_num_gpus_per_node,
        rollout_num_gpus=cfg.rollout.rollout_num_gpus or (
            cfg.actor_world_size if cfg.mode.debug_rollout_only and cfg.rollout.rollout_backend == "embedded" else None),
        rollout_num_gpus_per_engine=cfg.rollout.rollout_num_gpus_per_engine,
        # the embedded engine runs inside the driver process, on the trainer's devices
        colocate=cfg.memory.colocate or (cfg.rollout.rollout_backend == "embedded" and not cfg.mode.debug_rollout_only),
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size, context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        train_backend=cfg.precision.train_backend,
        rollout_backend="sglang",  # the planner plans GPUs; the embedded engine sits on the driver
        debug_train_only=cfg.mode.train_only, debug_rollout_only=cfg.mode.debug_rollout_only,
        update_weight_transport=cfg.sync.update_weight_transport)


def plan_errors(cfg) -> list[str]:
    """Planner findings for this config: placement, and model shape vs parallel sizes."""
    from megatron_rl.errors import PlanError
    from megatron_rl.plan import ModelShape, validate_plan

    try:
        plan = plan_for_config(cfg)
    except PlanError as exc:
        flag = "--allocation" if cfg.placement.allocation else "the placement flags"
        return [f"{flag}: {exc}"]
    model = None
    if cfg.model.hf_checkpoint:
        try:
            model = ModelShape.from_hf_config(cfg.model.hf_checkpoint)
        except Exception as exc:  # unreadable config.json is reported, not raised deep inside
            return [f"--hf-checkpoint {cfg.model.hf_checkpoint}: cannot read config.json ({exc})"]
    report = validate_plan(plan, None, model, cfg.model.seq_length,
                           cfg.parallel.virtual_pipeline_model_parallel_size)
    return list(report.errors)
