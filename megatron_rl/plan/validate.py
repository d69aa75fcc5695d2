"""Check a parsed plan against a cluster and a model, before anything is launched.

:func:`validate_plan` never raises for a bad plan: it returns a
:class:`PlanReport` of errors (the run cannot work), warnings (it works but is
probably not what you want) and info (derived facts worth seeing). Callers that
want an exception call ``report.raise_for_errors()``.

Placement rule: groups are laid out on consecutive global GPU indices (node-major),
largest model-parallel unit first, each group starting at a multiple of its unit.
The unit is what must stay inside one node (NVLink): a training component's TP
group (``t``, and expert-TP in the hybrid form) and an inference engine (``t*p``).
Megatron orders ranks TP-innermost, so contiguous, aligned placement keeps every
TP group on one node exactly when the unit divides ``gpus_per_node``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.errors import PlanError
from megatron_rl.plan.allocation import MAX_SIZE, Allocation, Component, Group, show_number, size_problem
from megatron_rl.plan.model_shape import ModelShape


@dataclass(frozen=True)
class Cluster:
    """``n_nodes`` machines with ``gpus_per_node`` GPUs each."""

    n_nodes: int
    gpus_per_node: int

    def __post_init__(self):
        for key, flag in (("n_nodes", "--n-nodes / cluster.n_nodes"),
                          ("gpus_per_node", "--n-gpus-per-node / cluster.n_gpus_per_node")):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"cluster {key}={show_number(value)} is invalid ({flag}); it must be a "
                                f"positive integer")
            if value > MAX_SIZE:
                raise PlanError(size_problem(value, f"cluster {key}", f"check {flag}"))
        if self.n_nodes * self.gpus_per_node > MAX_SIZE:
            raise PlanError(f"cluster of {self.n_nodes} node(s) x {self.gpus_per_node} GPUs = "
                            f"{self.n_nodes * self.gpus_per_node} GPUs is more than the planner's limit "
                            f"of {MAX_SIZE} (2**20); check --n-nodes / --n-gpus-per-node")

    @property
    def total_gpus(self) -> int:
        return self.n_nodes * self.gpus_per_node


@dataclass(frozen=True)
class PlanReport:
    """Outcome of :func:`validate_plan`. ``placement[i]`` is the ``[start, end)`` GPU
    range of ``plan.groups[i]`` when a cluster was given and the plan fits, else empty."""

    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    info: tuple[str, ...] = ()
    placement: tuple[tuple[int, int], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_for_errors(self) -> None:
        if self.errors:
            raise PlanError("the placement plan is invalid:\n  - " + "\n  - ".join(self.errors))


def node_unit(comp: Component) -> int:
    """GPUs of ``comp`` that must sit on one node: TP group (x expert-TP) or one engine."""
    if comp.is_inference:
        return comp.tp * comp.pp
    return math.lcm(comp.tp, comp.etp)


def validate_plan(plan: Allocation, cluster: Cluster | None = None, model: ModelShape | None = None,
                  seq_length: int | None = None, vpp: int | None = None, *,
                  last_stage_layers: int | None = None, first_stage_layers: int | None = None) -> PlanReport:
    """Validate ``plan``; cluster/model/seq_length/vpp checks run only when given.

    ``vpp`` is megatron's virtual pipeline size (``--virtual-pipeline-model-parallel-size``);
    ``last_stage_layers`` / ``first_stage_layers`` the layers of an uneven last / first stage
    (``--decoder-last-pipeline-num-layers`` / ``--decoder-first-pipeline-num-layers``).
    """
    errors: list[str] = []
    warnings: list[str] = []
    info: list[str] = []
    _check_roles(plan, errors, warnings, info)
    _check_weight_update(plan, errors, warnings, info)
    if vpp is not None:
        _check_vpp(plan, vpp, errors, warnings)
    if seq_length is not None:
        _check_seq_length(plan, seq_length, model, errors, warnings)
    if model is not None:
        _check_model(plan, model, vpp, errors, info, (first_stage_layers, last_stage_layers))
    placement: tuple[tuple[int, int], ...] = ()
    if cluster is not None:
        placement = _check_cluster(plan, cluster, errors, info)
    return PlanReport(tuple(errors), tuple(warnings), tuple(info), placement)


def _check_roles(plan: Allocation, errors, warnings, info):
    if not plan.has_rollout:
        info.append("training only: no rollout engine will be started (rollouts come from "
                    "--load-debug-rollout-data)")
    if not plan.has_training:
        info.append("rollout only: no training backend; the engines serve the weights they load")
    if plan.has_rollout and plan.has_training and plan.actor is None:
        errors.append("the rollout engines take their weights from the actor, but no training "
                      "component is the actor; name one actor, e.g. megatron[actor]:d4")
    if plan.is_multi_policy:
        names = ", ".join(a.label for a in plan.actors)
        info.append(f"multi-policy plan: {len(plan.actors)} actors ({names}) each train their own "
                    f"policy on {plan.total_gpus} GPUs in all (as in AReaL's multi-agent plans); "
                    f"python -m megatron_rl.train trains one policy per run and refuses it")
    for group in plan.groups:
        if group.worlds_differ:
            sizes = ", ".join(f"{m.label}={m.world_size}" for m in group.members)
            warnings.append(f"colocated components {group.spec()} have different world sizes "
                            f"({sizes}); the group takes {group.gpus} GPUs and the smaller ones "
                            f"leave GPUs idle while they run")


def _shares_gpus_with_an_actor(plan: Allocation, engine: Component) -> bool:
    return any(m is engine for a in plan.actors for m in plan.group_of(a).members)


def _check_weight_update(plan: Allocation, errors, warnings, info):
    mode = plan.weight_update
    if not (plan.has_rollout and plan.has_training):
        if mode is not None:
            info.append(f"weight update mode {mode!r} is unused: there is no "
                        f"{'rollout engine' if plan.has_training else 'training backend'}")
        return
    if plan.actor is None:
        return
    # every actor feeds its engines: one mode must suit all pairs (a multi-policy plan has several)
    colocated = any(_shares_gpus_with_an_actor(plan, r) for r in plan.rollout)
    separate = any(not _shares_gpus_with_an_actor(plan, r) for r in plan.rollout)
    if mode is None:
        default = "tensor" if colocated and not separate else "distributed"
        info.append(f"weight update mode not stated; the default for this placement is {default!r}")
        return
    if mode == "tensor" and separate:
        errors.append("weight update mode 'tensor' shares CUDA IPC handles, which only works when "
                      "the rollout engines are colocated with the actor (actor|sglang); use "
                      "'distributed' (xccl) for separate GPUs, or colocate them")
    if mode == "distributed" and colocated:
        errors.append("weight update mode 'distributed' (xccl) builds an NCCL group between the "
                      "actor and the engines, and NCCL cannot put two ranks on one GPU; colocated "
                      "engines must use 'tensor' (CUDA IPC)")
    if mode == "disk":
        warnings.append("weight update mode 'disk' writes and re-reads a full HF checkpoint every "
                        "step, which is slow; prefer 'tensor' (colocated) or 'distributed' (separate)")


def _check_vpp(plan: Allocation, vpp: int, errors, warnings):
    if not isinstance(vpp, int) or vpp < 1:
        errors.append(f"--virtual-pipeline-model-parallel-size={vpp!r} must be a positive integer")
        return
    megatron = [c for c in plan.training if c.backend == "megatron"]
    if not megatron:
        warnings.append(f"virtual pipeline size {vpp} is ignored: no megatron component in the plan")
        return
    for c in megatron:
        if vpp > 1 and c.pp == 1:
            errors.append(f"{c.label} ({c.spec()}): virtual pipeline size {vpp} needs pipeline "
                          f"parallel p>1; add p2 or drop --virtual-pipeline-model-parallel-size")


def _check_seq_length(plan: Allocation, seq_length: int, model, errors, warnings):
    if not isinstance(seq_length, int) or seq_length < 1:
        errors.append(f"--seq-length={seq_length!r} must be a positive integer")
        return
    for c in plan.training:
        if c.cp > 1 and seq_length % (2 * c.cp):
            errors.append(f"{c.label} ({c.spec()}): sequence length {seq_length} must be divisible "
                          f"by 2*c = {2 * c.cp} (context parallel splits each sequence into 2*c "
                          f"load-balanced chunks); pad to {-(-seq_length // (2 * c.cp)) * 2 * c.cp}")
    if model is not None and model.max_position_embeddings and seq_length > model.max_position_embeddings:
        warnings.append(f"sequence length {seq_length} exceeds the model's max_position_embeddings="
                        f"{model.max_position_embeddings}")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def _check_pipeline_split(who: str, layers: int, pp: int, vpp, edges: tuple[int | None, int | None],
                          errors) -> None:
    """Even stages (layers divisible by p*vpp), or megatron-core's uneven split: ``edges`` = the layers of the
    first and of the last stage where given, the rest spread evenly over the other stages (each divisible by
    vpp; megatron-core's TransformerConfig checks the same)."""
    chunks = vpp if isinstance(vpp, int) and vpp > 1 else 1
    first, last = edges
    if first is None and last is None:
        if layers % (pp * chunks):
            what = f"p*vpp = {pp}*{vpp}" if chunks != 1 else f"p={pp}"
            errors.append(f"{who}: num_hidden_layers={layers} is not divisible by {what}; "
                          f"each pipeline (virtual) stage needs the same number of layers")
        return
    given = [(f"--decoder-{name}-pipeline-num-layers", n) for name, n in (("first", first), ("last", last))
             if n is not None]
    rest = layers - sum(n for _, n in given)
    middle = pp - len(given)
    flags = " and ".join(f"{flag} {n}" for flag, n in given)
    if middle < 1:
        if rest != 0 and pp >= 2:
            errors.append(f"{who}: {flags} place {layers - rest} layers on the {pp} pipeline stages, but "
                          f"num_hidden_layers={layers}; with no other stage they must add up to {layers}")
        return
    if rest < middle or rest % (middle * chunks):
        errors.append(f"{who}: {flags} leave{'s' if len(given) == 1 else ''} {rest} of num_hidden_layers="
                      f"{layers} for the other {middle} pipeline stage(s), which must split them evenly"
                      + (f" in {chunks} virtual chunks each" if chunks > 1 else "")
                      + f"; choose sizes that leave a multiple of {middle * chunks} (at least {middle})")



def _check_model(plan: Allocation, model: ModelShape, vpp, errors, info,
                 edge_stages: tuple[int | None, int | None] = (None, None)):
    heads, groups, layers = model.num_attention_heads, model.num_query_groups, model.num_layers
    for c in plan.components:
        who = f"{c.label} ({c.spec()})"
        if heads % c.tp:
            errors.append(f"{who}: num_attention_heads={heads} is not divisible by tensor parallel "
                          f"t={c.tp}; choose t from {_divisors(heads)}")
        if c.is_training:
            if groups % c.tp:
                errors.append(f"{who}: num_key_value_heads={groups} (megatron num_query_groups) is "
                              f"not divisible by t={c.tp}; choose t from {_divisors(groups)}")
            _check_pipeline_split(who, layers, c.pp, vpp if c.backend == "megatron" else None,
                                  edge_stages if c.backend == "megatron" else (None, None), errors)
            linear = model.linear_num_key_heads
            if linear and linear % c.tp:
                errors.append(f"{who}: linear_num_key_heads={linear} (the gated delta-net layers) is not divisible "
                              f"by t={c.tp}: each TP rank holds whole key-head groups; choose t from "
                              f"{_divisors(math.gcd(linear, heads))}")
            if linear and c.cp > 1:
                errors.append(f"{who}: context parallel c={c.cp} with gated delta-net layers (linear_num_key_heads="
                              f"{linear}): their recurrent state and convolution window would pass from one CP "
                              "rank to the next, which is not built; drop c")
            if c.ep > 1 and not model.is_moe:
                errors.append(f"{who}: expert parallel e={c.ep} needs an MoE model, but "
                              f"{model.source or 'the model'} has no experts; drop e")
            elif c.ep > 1 and model.num_experts % c.ep:
                errors.append(f"{who}: num_experts={model.num_experts} is not divisible by expert "
                              f"parallel e={c.ep}; choose e from {_divisors(model.num_experts)}")
            if c.backend == "megatron":
                padded = model.padded_vocab_size(c.tp)
                if padded != model.vocab_size:
                    info.append(f"{c.label}: vocab {model.vocab_size} is padded to {padded} "
                                f"(multiple of 128*t = {128 * c.tp}) in megatron")
        else:
            if groups % c.tp and c.tp % groups:
                errors.append(f"{who}: num_key_value_heads={groups} and t={c.tp}: one must divide the "
                              f"other (the engine shards or replicates KV heads); choose t from "
                              f"{_divisors(heads)}")
            if c.pp > layers:
                errors.append(f"{who}: p={c.pp} exceeds num_hidden_layers={layers}")


def _group_unit(group: Group) -> int:
    return math.lcm(*(node_unit(m) for m in group.members))


def _check_cluster(plan: Allocation, cluster: Cluster, errors, info) -> tuple[tuple[int, int], ...]:
    gpn = cluster.gpus_per_node
    demand, have = plan.total_gpus, cluster.total_gpus
    parts = " + ".join(str(g.gpus) for g in plan.groups)
    shape = f"{cluster.n_nodes} node(s) x {gpn} GPUs"
    if demand > have:
        errors.append(f"the plan needs {demand} GPUs ({parts}) but the cluster has {have} "
                      f"({shape}); shrink d or add nodes")
    spans = False
    for c in plan.components:
        unit = node_unit(c)
        if gpn % unit:
            what = ("one inference engine (t*p)" if c.is_inference
                    else "a tensor-parallel group" + (" (lcm of t and expert t)" if c.etp > 1 else ""))
            errors.append(f"{c.label} ({c.spec()}): {what} has {unit} GPUs, which does not divide "
                          f"{gpn} GPUs per node, so it would span nodes; use a size that divides {gpn}")
            spans = True
    if demand > have or spans:
        return ()
    order = sorted(range(len(plan.groups)), key=lambda i: -_group_unit(plan.groups[i]))
    ranges: dict[int, tuple[int, int]] = {}
    cursor = 0
    for i in order:
        unit = _group_unit(plan.groups[i])
        start = -(-cursor // unit) * unit
        ranges[i] = (start, start + plan.groups[i].gpus)
        cursor = start + plan.groups[i].gpus
    if cursor > have:
        errors.append(f"the plan needs {demand} GPUs and the cluster has {have}, but keeping every "
                      f"TP group / engine inside one node needs {cursor} GPU slots ({shape}); "
                      f"make the group sizes multiples of their TP size or add a node")
        return ()
    if demand < have:
        info.append(f"{have - demand} of {have} GPUs stay idle")
    return tuple(ranges[i] for i in range(len(plan.groups)))
