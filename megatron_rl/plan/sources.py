"""Resolve the other two ways users state placement into the same :class:`Allocation`.

* slime / Megatron flags (``--actor-num-nodes --actor-num-gpus-per-node
  --rollout-num-gpus --rollout-num-gpus-per-engine --colocate`` plus
  ``--tensor/pipeline/context/expert-model-parallel-size``), with slime's
  semantics: actor world = nodes x GPUs per node, DP is derived; each rollout
  engine is one TP group of ``rollout_num_gpus_per_engine`` GPUs.
* AReaL ``key=value`` arguments (``allocation_mode=...`` or per-role
  ``rollout.backend=... actor.backend=...``, ``cluster.*``,
  ``actor.weight_update_mode=...``).

A plan with no rollout part is a valid training-only plan (never "Invalid
backend: None"): the absence of ``rollout.backend`` means "no engine".
"""

from __future__ import annotations

import re
from typing import Sequence

from megatron_rl.errors import PlanError
from megatron_rl.plan.allocation import (
    INFERENCE_BACKENDS, MAX_SIZE, TRAINING_BACKENDS, Allocation, Component, Dims, assign_roles,
    canonical_weight_update, size_problem,
)
from megatron_rl.plan.grammar import parse_allocation
from megatron_rl.plan.validate import Cluster


#: A plain decimal integer: ASCII digits only (str.isdigit and int() also accept e.g. '１６').
ASCII_INT = re.compile(r"[0-9]+")


def _positive(value, flag: str) -> int:
    problem = size_problem(value, flag, f"check {flag}")
    if problem:
        raise PlanError(problem)
    return value


def plan_from_slime_flags(
    *,
    actor_num_nodes: int = 1,
    actor_num_gpus_per_node: int = 8,
    rollout_num_gpus: int | None = None,
    rollout_num_gpus_per_engine: int = 1,
    colocate: bool = False,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    train_backend: str = "megatron",
    rollout_backend: str = "sglang",
    debug_train_only: bool = False,
    debug_rollout_only: bool = False,
    update_weight_transport: str | None = None,
    critic: tuple[int, int] | None = None,
) -> Allocation:
    """Build the plan slime's flags describe (keyword names = flag names with ``_``).

    * actor: world = ``actor_num_nodes * actor_num_gpus_per_node``; DP = world / (t*p*c).
      With EP > 1 and expert-TP != 1 (megatron defaults expert-TP to t) the actor is
      stated in hybrid form ``(attn:d..t..p..c..|ffn:d<edp>t<etp>p..e..)``.
    * rollout: ``rollout_num_gpus / rollout_num_gpus_per_engine`` engines of TP =
      GPUs per engine. ``colocate`` puts them on the actor's GPUs (one ``|`` group)
      and defaults ``rollout_num_gpus`` to the actor world.
    * ``debug_train_only`` drops the rollout part; ``debug_rollout_only`` the actor.
    * ``update_weight_transport`` defaults like slime: tensor when colocated,
      distributed otherwise (None when either side is absent).
    * ``critic`` (PPO's, as ``(tp, pp)``): a second training component on the actor's GPUs
      (slime's critic always takes the actor's GPU count), in its own layout or the actor's.
    """
    if debug_train_only and debug_rollout_only:
        raise PlanError("--debug-train-only and --debug-rollout-only exclude each other; pass one")
    if train_backend not in TRAINING_BACKENDS:
        raise PlanError(f"--train-backend={train_backend!r} is unknown; choose megatron or fsdp")
    if rollout_backend not in INFERENCE_BACKENDS:
        raise PlanError(f"rollout backend {rollout_backend!r} is unknown; choose sglang or vllm")
    nodes = _positive(actor_num_nodes, "--actor-num-nodes")
    gpn = _positive(actor_num_gpus_per_node, "--actor-num-gpus-per-node")
    t = _positive(tensor_model_parallel_size, "--tensor-model-parallel-size")
    p = _positive(pipeline_model_parallel_size, "--pipeline-model-parallel-size")
    c = _positive(context_parallel_size, "--context-parallel-size")
    e = _positive(expert_model_parallel_size, "--expert-model-parallel-size")
    etp = t if expert_tensor_parallel_size is None else _positive(
        expert_tensor_parallel_size, "--expert-tensor-parallel-size")
    world = nodes * gpn

    actor = None
    if not debug_rollout_only:
        if world % (t * p * c):
            raise PlanError(
                f"actor world {world} (--actor-num-nodes {nodes} x --actor-num-gpus-per-node {gpn}) "
                f"is not divisible by t*p*c = {t}*{p}*{c} = {t * p * c} (--tensor-, --pipeline-, "
                f"--context-parallel-size); data parallel would not be whole")
        dp = world // (t * p * c)
        attn = Dims(d=dp, t=t, p=p, c=c)
        if train_backend == "fsdp" and (t, p, c, e) != (1, 1, 1, 1):
            raise PlanError(
                f"--train-backend fsdp is FSDP2 on a 1-D data-parallel mesh; it cannot use "
                f"tensor/pipeline/context/expert parallel sizes {t}/{p}/{c}/{e}. Set them to 1 "
                f"or use --train-backend megatron")
        if e > 1 and etp != 1:
            if world % (etp * e * p):
                raise PlanError(
                    f"actor world {world} is not divisible by expert-TP x EP x PP = {etp}*{e}*{p} "
                    f"(--expert-tensor-parallel-size defaults to --tensor-model-parallel-size); "
                    f"change --expert-model-parallel-size or set --expert-tensor-parallel-size 1")
            ffn = Dims(d=world // (etp * e * p), t=etp, p=p, e=e)
            actor = Component(train_backend, attn, "actor", ffn)
        else:
            actor = Component(train_backend, Dims(d=dp, t=t, p=p, c=c, e=e), "actor")

    rollout = None
    if not debug_train_only:
        per_engine = _positive(rollout_num_gpus_per_engine, "--rollout-num-gpus-per-engine")
        if rollout_num_gpus is None:
            if not colocate or actor is None:
                raise PlanError("--rollout-num-gpus is required unless --colocate (rollout on the "
                                "actor's GPUs) or --debug-train-only (no rollout engine)")
            rollout_num_gpus = world
        total = _positive(rollout_num_gpus, "--rollout-num-gpus")
        if total % per_engine:
            raise PlanError(f"--rollout-num-gpus {total} is not a multiple of "
                            f"--rollout-num-gpus-per-engine {per_engine}; engines would not be whole")
        rollout = Component(rollout_backend, Dims(d=total // per_engine, t=per_engine), "rollout")

    trainers = [actor] if actor is not None else []
    if critic is not None and actor is not None:
        ct, cp_ = _positive(critic[0], "--critic-tensor-model-parallel-size"), _positive(
            critic[1], "--critic-pipeline-model-parallel-size")
        if world % (ct * cp_):
            raise PlanError(f"the critic's layout t*p = {ct}*{cp_} does not divide the actor's {world} GPUs it runs "
                            "on (--critic-tensor-model-parallel-size, --critic-pipeline-model-parallel-size)")
        trainers.append(Component(train_backend, Dims(d=world // (ct * cp_), t=ct, p=cp_), "critic"))
    if colocate and actor is not None and rollout is not None:
        groups = [[rollout, *trainers]]
    else:
        groups = [x for x in ([rollout] if rollout is not None else [], trainers) if x]
    if update_weight_transport is None and actor is not None and rollout is not None:
        update_weight_transport = "tensor" if colocate else "distributed"
    return Allocation(assign_roles(groups), weight_update=update_weight_transport)


#: AReaL roles that may carry a ``<role>.backend=...`` key, in the order they are laid out.
AREAL_ROLES = ("rollout", "actor", "critic", "ref", "teacher")


def plan_from_areal_args(args: Sequence[str]) -> tuple[Allocation, Cluster | None]:
    """Resolve AReaL ``key=value`` arguments into ``(plan, cluster or None)``.

    Read keys: ``allocation_mode``, ``<role>.backend`` for roles in ``AREAL_ROLES``,
    ``<role>.scheduling_strategy.type=colocation`` + ``.target=<role>`` (colocate
    a role onto another's GPUs), ``cluster.n_nodes``, ``cluster.n_gpus_per_node``,
    ``actor.weight_update_mode`` (xccl|disk|tensor). Every other key (a full
    training command line) is ignored, as are Hydra ``+key=value`` additions.
    A missing ``rollout.backend`` means training only, never an error.
    """
    values: dict[str, str] = {}
    for arg in args:
        if arg.startswith("+"):
            continue
        if "=" not in arg:
            raise PlanError(f"argument {arg!r} is not key=value; AReaL-style arguments look like "
                            f"rollout.backend=sglang:d2t4 or cluster.n_nodes=2")
        key, value = arg.split("=", 1)
        key = key.strip()
        if key in values and values[key] != value:
            raise PlanError(f"{key} is given twice ({values[key]!r} and {value!r}); keep one")
        values[key] = value.strip()

    cluster = None
    if "cluster.n_nodes" in values or "cluster.n_gpus_per_node" in values:
        cluster = Cluster(_int_arg(values, "cluster.n_nodes", 1),
                          _int_arg(values, "cluster.n_gpus_per_node", 8))
    mode = canonical_weight_update(values.get("actor.weight_update_mode"), "actor.weight_update_mode")

    per_role = {r: values[f"{r}.backend"] for r in AREAL_ROLES if values.get(f"{r}.backend")}
    if "allocation_mode" in values:
        if per_role:
            keys = ", ".join(f"{r}.backend" for r in per_role)
            raise PlanError(f"allocation_mode and {keys} both state placement; give one of them "
                            f"(per-role backends are AReaL's current form)")
        return parse_allocation(values["allocation_mode"], weight_update=mode), cluster
    if not per_role:
        raise PlanError("no placement given: pass allocation_mode=... or per-role backends such as "
                        "rollout.backend=sglang:d2t4 actor.backend=fsdp:d8")

    comps: dict[str, Component] = {}
    for role, spec in per_role.items():
        try:
            parsed = parse_allocation(spec)
        except PlanError as exc:
            raise PlanError(f"{role}.backend: {exc}") from None
        if len(parsed.components) != 1:
            raise PlanError(f"{role}.backend={spec!r} must be one component; put other roles in "
                            f"their own <role>.backend key")
        (comp,) = parsed.components
        if (role == "rollout") != comp.is_inference:
            want = "sglang or vllm" if role == "rollout" else "megatron or fsdp"
            raise PlanError(f"{role}.backend={spec!r}: the {role} needs a {want} backend")
        comps[role] = Component(comp.backend, comp.dims, comp.name or role, comp.ffn, role)

    groups: list[list[Component]] = []
    where: dict[str, int] = {}
    pending: dict[str, str] = {}
    for role in AREAL_ROLES:
        if role not in comps:
            continue
        kind = values.get(f"{role}.scheduling_strategy.type", "separation")
        if kind not in ("separation", "colocation"):
            raise PlanError(f"{role}.scheduling_strategy.type={kind!r} is unknown; use separation "
                            f"or colocation")
        if kind == "colocation":
            pending[role] = values.get(f"{role}.scheduling_strategy.target", "")
        else:
            where[role] = len(groups)
            groups.append([comps[role]])
    while pending:  # a role may colocate onto one that itself colocates: resolve in rounds
        ready = [r for r, target in pending.items() if target in where]
        if not ready:
            role, target = next(iter(pending.items()))
            raise PlanError(f"{role}.scheduling_strategy.target={target!r} must name another role "
                            f"that has a backend and is placed ({', '.join(where) or 'none'})")
        for role in ready:
            where[role] = where[pending.pop(role)]
            groups[where[role]].append(comps[role])
    return Allocation(assign_roles(groups), weight_update=mode), cluster


def _int_arg(values: dict[str, str], key: str, default: int) -> int:
    raw = values.get(key)
    if raw is None:
        return default
    if not ASCII_INT.fullmatch(raw):  # int() would also take '１６', '+4', '1_0' and raise on 5000 digits
        raise PlanError(f"{key}={raw!r} is not an integer: write it with the ASCII digits 0-9 only")
    if len(raw.lstrip("0")) > len(str(MAX_SIZE)):  # never int() a 5000-digit string
        raise PlanError(f"{key}={raw[:12]}... ({len(raw)} digits) is too large: the planner accepts at "
                        f"most {MAX_SIZE} (2**20)")
    return int(raw)


__all__ = ["plan_from_slime_flags", "plan_from_areal_args", "AREAL_ROLES"]
