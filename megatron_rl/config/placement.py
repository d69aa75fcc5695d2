"""The placement implied by the flags, as the planner's ``Allocation``.

Two ways to state placement resolve to one validated plan: an allocation
string (``--allocation``) or slime-style GPU-count flags with the Megatron
parallel sizes.

Rule for ``--allocation`` (docs/planner.md, "The allocation and the flags"): the
string states the actor's backend, parallel sizes and rank count, and the rollout
engines' GPU counts. Flags left
unset take those values (:func:`apply_allocation`, at parse time); a flag that
is set and disagrees is refused by name (:func:`allocation_errors`, in
validation). The ranks torchrun really launched (``WORLD_SIZE`` /
``LOCAL_WORLD_SIZE``) must equal the ranks the config is sized for
(:func:`world_errors`). Nothing is silently ignored.
"""

from __future__ import annotations

import os
import re

from megatron_rl.errors import ConfigError, PlanError
from megatron_rl.plan import (Allocation, Component, Dims, Group, ModelShape, parse_allocation,
                              plan_from_slime_flags, validate_plan)
from megatron_rl.plan.allocation import DIM_NAMES

from .architecture import dry_run_without_checkpoint, shape_from_flags

#: (group, field, flag) of each size an allocation's actor states, and how to read it off.
_ACTOR_FIELDS = (
    ("precision", "train_backend", "--train-backend", lambda a: a.backend),
    ("parallel", "tensor_model_parallel_size", "--tensor-model-parallel-size", lambda a: a.tp),
    ("parallel", "pipeline_model_parallel_size", "--pipeline-model-parallel-size", lambda a: a.pp),
    ("parallel", "context_parallel_size", "--context-parallel-size", lambda a: a.cp),
    ("parallel", "expert_model_parallel_size", "--expert-model-parallel-size", lambda a: a.ep),
)


def _single_policy_plan(text: str | None):
    """The plan of allocation ``text``, or None when there is nothing to apply (no string, a
    malformed one, several policies: validation reports those)."""
    if not text:
        return None

    try:
        plan = parse_allocation(text)
    except PlanError:
        return None
    return None if plan.is_multi_policy else plan


def implied_sizes(actor) -> dict[tuple[str, str], object]:
    """``{(group, field): value}`` the actor component states, e.g. TP from ``t``.

    Expert-TP is stated only with EP > 1: the flat form means expert-TP 1 (AReaL),
    the hybrid form ``ffn.t``; with EP 1 it changes nothing.
    """
    out = {(g, f): get(actor) for g, f, _, get in _ACTOR_FIELDS}
    if actor.ep > 1:
        out[("parallel", "expert_tensor_parallel_size")] = actor.etp
    return out


def implied_rollout_sizes(plan) -> dict[tuple[str, str], int]:
    """``--rollout-num-gpus`` (all rollout engines' GPUs) and, when every engine has the same
    size, ``--rollout-num-gpus-per-engine`` (t*p), as slime's flags would state the plan."""
    engines = plan.rollout
    if not engines:
        return {}
    out = {("rollout", "rollout_num_gpus"): sum(r.world_size for r in engines)}
    if len({r.engine_size for r in engines}) == 1:
        out[("rollout", "rollout_num_gpus_per_engine")] = engines[0].engine_size
    return out


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw is not None and re.fullmatch(r"[0-9]{1,7}", raw) else None


def apply_allocation(values: dict[str, dict]) -> None:
    """Fill the flags ``--allocation`` states into ``values`` (parser dests that were given:
    command line or YAML), leaving every given flag alone so validation can compare it.

    The actor's rank count becomes ``--actor-num-nodes`` x ``--actor-num-gpus-per-node``:
    with neither given, the node size is torchrun's ``LOCAL_WORLD_SIZE`` when it divides
    the rank count, else all ranks on one node.
    """
    plan = _single_policy_plan(values["placement"].get("allocation"))
    if plan is None:
        return
    for (group, field), value in implied_rollout_sizes(plan).items():
        values[group].setdefault(field, value)
    engines = {r.backend for r in plan.rollout}
    if len(engines) == 1:  # the engine the string names (refused in validation if not available)
        values["rollout"].setdefault("rollout_backend", engines.pop())
    actor = plan.actor
    if actor is None:
        return
    for (group, field), size in implied_sizes(actor).items():
        values[group].setdefault(field, size)
    critics = [c for c in plan.components if c.role == "critic"]
    if len(critics) == 1 and values["algorithm"].get("advantage_estimator") == "ppo":
        # PPO's critic: its own layout on the actor's GPUs (checked in allocation_errors)
        values["parallel"].setdefault("critic_tensor_model_parallel_size", critics[0].tp)
        values["parallel"].setdefault("critic_pipeline_model_parallel_size", critics[0].pp)
    placement, world = values["placement"], actor.world_size
    nodes, gpn = placement.get("actor_num_nodes"), placement.get("actor_num_gpus_per_node")
    if nodes is None and gpn is None:
        local = _env_int("LOCAL_WORLD_SIZE")
        gpn = local if local and world % local == 0 else world
        placement["actor_num_gpus_per_node"], placement["actor_num_nodes"] = gpn, world // gpn
    elif nodes is None and isinstance(gpn, int) and gpn > 0 and world % gpn == 0:
        placement["actor_num_nodes"] = world // gpn
    elif gpn is None and isinstance(nodes, int) and nodes > 0 and world % nodes == 0:
        placement["actor_num_gpus_per_node"] = world // nodes


def allocation_errors(cfg) -> list[str]:
    """Where ``--allocation`` and the other flags disagree, and plans this engine cannot run."""

    text = cfg.placement.allocation
    if not text:
        return []
    try:
        plan = parse_allocation(text)
    except PlanError as exc:  # reported here, with the others, not only once every flag is right
        return [f"--allocation: {exc}"]
    head = f"--allocation {text!r}"
    if plan.is_multi_policy:
        names = ", ".join(a.label for a in plan.actors)
        return [f"{head} trains {len(plan.actors)} policies ({names}); this engine trains one policy "
                f"per run. Launch one run per policy, each with its own --allocation (its actor and "
                f"rollout engines), or use AReaL for multi-agent training; tools/check_plan.py "
                f"reports the whole plan"]
    errors = _rollout_flag_errors(plan, cfg, head)
    if not plan.has_training:
        if cfg.has_training:
            errors.append(f"{head} has no training component (megatron or fsdp) but this run trains; "
                          f"add one (e.g. +megatron:d1) or pass --debug-rollout-only")
        return errors
    if not cfg.has_training:
        return errors + [f"{head} states a trainer ({plan.training[0].spec()}) but "
                         f"--debug-rollout-only starts none; drop one of them"]
    actor = plan.actor
    if actor is None:
        return errors  # validate_plan reports "no training component is the actor"
    letters = {"tensor_model_parallel_size": "t", "pipeline_model_parallel_size": "p",
               "context_parallel_size": "c", "expert_model_parallel_size": "e"}
    for group, field, flag, _ in _ACTOR_FIELDS:
        want, have = implied_sizes(actor)[(group, field)], getattr(getattr(cfg, group), field)
        if want == have:
            continue
        if field == "train_backend":
            errors.append(f"{head} trains the actor with {want} but --train-backend is {have}; drop "
                          f"--train-backend (the allocation sets it) or make the two agree")
        else:
            k = letters[field]
            errors.append(f"{head} gives the actor {k}{want} ({DIM_NAMES[k]}) but {flag} is {have}; "
                          f"drop {flag} (the allocation sets it) or make the two agree")
    if actor.ep > 1:
        p = cfg.parallel
        have = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        if have != actor.etp:
            how = "ffn t" if actor.is_hybrid else "the flat form's expert-TP 1"
            errors.append(f"{head} gives the actor expert tensor parallel {actor.etp} ({how}) but "
                          f"--expert-tensor-parallel-size is {have} (unset means "
                          f"--tensor-model-parallel-size); set --expert-tensor-parallel-size "
                          f"{actor.etp} or drop it")
    if actor.world_size != cfg.actor_world_size:
        errors.append(f"{head} gives the actor d*t*p*c = {actor.world_size} ranks but --actor-num-nodes "
                      f"{cfg.placement.actor_num_nodes} x --actor-num-gpus-per-node "
                      f"{cfg.placement.actor_num_gpus_per_node} = {cfg.actor_world_size}; drop those "
                      f"flags (the allocation sets them) or make the two agree")
    return errors + _critic_errors(plan, actor, cfg, head)


def _critic_errors(plan, actor, cfg, head: str) -> list[str]:
    """A ``critic`` component of ``--allocation``: PPO's critic, which runs on the actor's GPUs (in its ``|``
    group, the same rank count and backend) with a layout of its own (t, p; no c; the actor's e), which
    becomes --critic-tensor-model-parallel-size / --critic-pipeline-model-parallel-size."""
    critics = [c for c in plan.components if c.role == "critic"]
    if not critics:
        return []
    if cfg.algorithm.advantage_estimator != "ppo":
        return [f"{head} places a critic ({critics[0].spec()}), which only --advantage-estimator ppo trains; add "
                "that or drop the critic"]
    if len(critics) > 1:
        return [f"{head} places {len(critics)} critics; PPO trains one"]
    critic, errors = critics[0], []
    if critic.backend != actor.backend:
        errors.append(f"{head}: the critic ({critic.spec()}) trains on {critic.backend} but the actor on "
                      f"{actor.backend}; the critic runs inside the actor's backend: use {actor.backend}")
    if actor not in plan.colocated_with(critic) or critic.world_size != actor.world_size:
        errors.append(f"{head}: the critic ({critic.spec()}) runs on the actor's GPUs, as slime's does; put it in "
                      f"the actor's '|' group with the same rank count ({actor.world_size}), e.g. "
                      f"{actor.backend}[actor]:{actor.dims}|{actor.backend}[critic]:d{actor.world_size}")
    if critic.cp != 1 or critic.ep != actor.ep:
        errors.append(f"{head}: the critic ({critic.spec()}) has no context parallelism and the actor's expert "
                      f"parallelism (e{actor.ep}); drop its c and give e as the actor's")
    p = cfg.parallel
    for flag, want, have in (("--critic-tensor-model-parallel-size", critic.tp, p.critic_tensor_model_parallel_size),
                             ("--critic-pipeline-model-parallel-size", critic.pp,
                              p.critic_pipeline_model_parallel_size)):
        if have is not None and have != want:
            errors.append(f"{head} gives the critic {want} for {flag} but the flag is {have}; drop the flag (the "
                          "allocation sets it) or make the two agree")
    return errors


def _rollout_flag_errors(plan, cfg, head: str) -> list[str]:
    """The rollout flags against the allocation's rollout engines (sizes and --colocate)."""
    errors = []
    named = sorted({r.backend for r in plan.rollout} - {cfg.rollout.rollout_backend})
    if named and cfg.has_rollout_engine:
        # The string names the engine the user expects; running another one in its place would
        # be the silent substitution validation exists to prevent.
        errors.append(f"{head} places {'/'.join(named)} rollout engines but --rollout-backend is "
                      f"{cfg.rollout.rollout_backend}; the embedded engine runs inside the driver "
                      f"rank and needs no rollout component: state only the trainer (e.g. "
                      f"megatron:d2), or make --rollout-backend name the allocation's engine")
    flags = {"rollout_num_gpus": ("--rollout-num-gpus", "all rollout engines' GPUs"),
             "rollout_num_gpus_per_engine": ("--rollout-num-gpus-per-engine", "one engine's t*p")}
    for (_, field), want in implied_rollout_sizes(plan).items():
        have = getattr(cfg.rollout, field)
        if have != want:
            flag, what = flags[field]
            errors.append(f"{head} gives {what} = {want} but {flag} is {have}; drop {flag} (the "
                          f"allocation sets it) or make the two agree")
    if not plan.rollout and cfg.rollout.rollout_num_gpus is not None:
        errors.append(f"{head} has no rollout engine but --rollout-num-gpus is "
                      f"{cfg.rollout.rollout_num_gpus}; drop it or add the engines (e.g. sglang:d2+...)")
    shared = any(m is r for a in plan.actors for m in plan.group_of(a).members for r in plan.rollout)
    if cfg.memory.colocate and plan.rollout and plan.actors and not shared:
        errors.append(f"--colocate puts the rollout engines on the actor's GPUs but {head} places them "
                      f"on separate GPUs ('+'); join them with '|' (e.g. sglang:d2|megatron:d2) or "
                      f"drop --colocate")
    return errors


def refuse_single_process_world(cfg) -> None:
    """Before a run starts work outside torchrun (no ``WORLD_SIZE``): it is one process, so a
    config sized for more ranks (flags or ``--allocation``) would train on a world it did not
    plan for. Not in validation: a config is also validated where it will not run (a test, a
    check on a laptop). Raises ConfigError naming the flags and the launch that fits."""

    if "WORLD_SIZE" in os.environ or cfg.actor_world_size == 1:
        return
    source = f" (from --allocation {cfg.placement.allocation!r})" if cfg.placement.allocation else ""
    raise ConfigError(
        f"this is a single process (not launched by torchrun: WORLD_SIZE is unset) but the run is sized "
        f"for --actor-num-nodes {cfg.placement.actor_num_nodes} x --actor-num-gpus-per-node "
        f"{cfg.placement.actor_num_gpus_per_node} = {cfg.actor_world_size} ranks{source}; launch it with "
        f"torchrun --nproc-per-node {cfg.placement.actor_num_gpus_per_node} (as scripts/run_demo_cpu.sh "
        f"does), or size it for 1 rank")


def world_errors(cfg) -> list[str]:
    """The ranks torchrun launched (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) against the ranks the
    flags size the run for. Without those variables (no torchrun: a check, a dry run on a
    laptop) there is nothing real to compare with."""
    world, local = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
    nodes, gpn = cfg.placement.actor_num_nodes, cfg.placement.actor_num_gpus_per_node
    sized = (f"--actor-num-nodes {nodes} x --actor-num-gpus-per-node {gpn} = {cfg.actor_world_size} "
             f"rank(s)")
    if world is not None and world != cfg.actor_world_size:
        fix = (f"pass --actor-num-nodes {world // local} --actor-num-gpus-per-node {local}"
               if local and world % local == 0 else f"size the run for {world} ranks")
        return [f"torchrun launched WORLD_SIZE={world} rank(s) but the run is sized for {sized}; "
                f"{fix}, or launch {cfg.actor_world_size} rank(s)"]
    if local is not None and local != gpn:
        return [f"torchrun launched LOCAL_WORLD_SIZE={local} rank(s) per node but "
                f"--actor-num-gpus-per-node is {gpn}; pass --actor-num-gpus-per-node {local} (and "
                f"--actor-num-nodes to match), or launch {gpn} rank(s) per node"]
    return []



def plan_for_config(cfg):

    if cfg.placement.allocation:
        plan = parse_allocation(cfg.placement.allocation, weight_update=cfg.sync.update_weight_transport)
        return _with_embedded_engine(plan, cfg)
    p = cfg.parallel
    # external SGLang servers (--rollout-engine-urls) take none of our GPUs: a training run plans only
    # the actor; a rollout-only run plans the driver process that talks to them, as for the embedded engine
    external = is_external_sglang(cfg)
    in_driver = cfg.rollout.rollout_backend == "embedded" or (external and cfg.mode.debug_rollout_only)
    return plan_from_slime_flags(
        actor_num_nodes=cfg.placement.actor_num_nodes, actor_num_gpus_per_node=cfg.placement.actor_num_gpus_per_node,
        rollout_num_gpus=cfg.rollout.rollout_num_gpus or (
            cfg.actor_world_size if cfg.mode.debug_rollout_only and in_driver else None),
        rollout_num_gpus_per_engine=cfg.rollout.rollout_num_gpus_per_engine,
        # the embedded engine runs inside the driver process, on the trainer's devices
        colocate=cfg.memory.colocate or (in_driver and not cfg.mode.debug_rollout_only),
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size, context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        train_backend=cfg.precision.train_backend,
        rollout_backend="sglang",  # the planner plans GPUs; the embedded engine sits on the driver
        debug_train_only=cfg.mode.train_only or (external and not cfg.mode.debug_rollout_only),
        debug_rollout_only=cfg.mode.debug_rollout_only, update_weight_transport=cfg.sync.update_weight_transport,
        critic=_critic_dims(cfg))


def _critic_dims(cfg) -> tuple[int, int] | None:
    """PPO's critic as the planner sees it: ``(tp, pp)`` on the actor's GPUs (its own layout, else the actor's;
    no CP, no VPP: backends/megatron/critic.py); None without one."""
    if cfg.algorithm.advantage_estimator != "ppo" or not cfg.has_training:
        return None
    p = cfg.parallel
    return (p.critic_tensor_model_parallel_size or p.tensor_model_parallel_size,
            p.critic_pipeline_model_parallel_size or p.pipeline_model_parallel_size)


def launches_sglang_engines(cfg) -> bool:
    """``--rollout-backend sglang`` without ``--rollout-engine-urls``: this run starts the SGLang engines."""
    return cfg.rollout.rollout_backend == "sglang" and not cfg.rollout.rollout_engine_urls and cfg.has_rollout_engine


def is_external_sglang(cfg) -> bool:
    """``--rollout-backend sglang --rollout-engine-urls ...``: servers someone else started and placed."""
    return cfg.rollout.rollout_backend == "sglang" and bool(cfg.rollout.rollout_engine_urls)


def _with_embedded_engine(plan, cfg):
    """An allocation with no rollout part, for a run whose embedded engine generates: the engine
    runs in the driver process on the trainer's devices, so it is planned as a rollout engine
    colocated with the actor (as the flags path plans it), not reported as "no rollout engine"."""

    actor = plan.actor
    if plan.has_rollout or actor is None or not cfg.has_rollout_engine or cfg.rollout.rollout_backend != "embedded":
        # (external SGLang servers are not ours to plan: an allocation that places them is refused in validation)
        return plan
    engine = Component("sglang", Dims(d=actor.world_size), "rollout", role="rollout")
    groups = tuple(Group((engine, *g.members)) if any(m is actor for m in g.members) else g for g in plan.groups)
    return Allocation(groups, weight_update=plan.weight_update, source=plan.source)


def plan_errors(cfg) -> list[str]:
    """Planner findings for this config: placement, and model shape vs parallel sizes."""

    try:
        plan = plan_for_config(cfg)
    except PlanError as exc:
        flag = "--allocation" if cfg.placement.allocation else "the placement flags"
        return [f"{flag}: {exc}"]
    try:
        model = model_shape_for_config(cfg)
    except Exception as exc:  # unreadable config.json is reported, not raised deep inside
        return [f"--hf-checkpoint {cfg.model.hf_checkpoint}: cannot read config.json ({exc})"]
    report = validate_plan(plan, None, model, cfg.model.seq_length,
                           cfg.parallel.virtual_pipeline_model_parallel_size,
                           last_stage_layers=cfg.parallel.decoder_last_pipeline_num_layers,
                           first_stage_layers=cfg.parallel.decoder_first_pipeline_num_layers)
    return list(report.errors)


def model_shape_for_config(cfg):
    """The model shape the planner checks the layout against: --hf-checkpoint's config.json, or,
    for a dry run whose checkpoint is not on this machine, the architecture flags (None when
    neither is there). Raises what ``ModelShape.from_hf_config`` raises for a bad config.json."""
    if dry_run_without_checkpoint(cfg):
        return shape_from_flags(cfg)
    if cfg.model.hf_checkpoint:
        return ModelShape.from_hf_config(cfg.model.hf_checkpoint)
    return shape_from_flags(cfg)
