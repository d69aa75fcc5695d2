"""The placement plan as data: who runs where, with which parallel layout.

An allocation is a sequence of *groups* joined by ``+`` (separate GPUs); a group
is one or more *components* joined by ``|`` (the members share the same GPUs,
i.e. they are colocated and time-slice the memory). A component is one engine:
an inference backend (``sglang``/``vllm``) or a training backend
(``megatron``/``fsdp``) with its parallel degrees.

Invariants (checked in ``__post_init__``, so no invalid plan object can exist):

* every degree is a positive int; inference components have ``c == e == 1``;
* ``fsdp`` is FSDP2 on a 1-D data-parallel mesh here, so only ``d`` may exceed 1;
* a flat ``megatron`` layout with ``e > 1`` uses expert-TP 1 (AReaL's
  convention), so the EP ranks come from the DP x TP x CP ranks of a pipeline
  stage: ``(d*t*c) % e == 0``;
* a hybrid MoE layout (``ffn`` set, megatron only) has ``ffn.p == attn.p`` and the
  same world size on both sides (``attn d*t*p*c == ffn d*t*p*e``);
* names are unique; roles are resolved once, by :func:`assign_roles`.

Derived values (world size, GPUs, DP) are properties, never stored, so they
cannot disagree with the degrees they come from. Nothing here imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_rl.errors import PlanError

INFERENCE_BACKENDS = ("sglang", "vllm")
TRAINING_BACKENDS = ("megatron", "fsdp")
BACKENDS = INFERENCE_BACKENDS + TRAINING_BACKENDS

#: Degrees each kind of component may state (the grammar enforces the same sets).
INFERENCE_DIMS = "dtp"
TRAINING_DIMS = "dtpce"
ATTN_DIMS = "dtpc"
FFN_DIMS = "dtpe"

DIM_NAMES = {
    "d": "data parallel",
    "t": "tensor parallel",
    "p": "pipeline parallel",
    "c": "context parallel",
    "e": "expert parallel",
}

#: Roles the runtime knows. Inference components may be rollout engines or serve a
#: reward/teacher model; training components anything but rollout.
ROLES = ("rollout", "actor", "critic", "ref", "teacher", "reward")
INFERENCE_ROLES = ("rollout", "reward", "teacher")

#: Names that select a role. A full role name is binding (``sglang[actor]`` is an
#: error); a short alias that does not fit the backend kind is just a custom name
#: (``sglang[a]`` is a rollout engine called ``a``).
ROLE_ALIASES = {
    "rollout": "rollout", "gen": "rollout", "r": "rollout",
    "actor": "actor", "policy": "actor", "a": "actor",
    "critic": "critic", "c": "critic", "value": "critic",
    "ref": "ref", "reference": "ref",
    "teacher": "teacher",
    "reward": "reward", "rm": "reward",
}

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Largest degree, node count, GPUs per node and GPU demand the planner accepts
#: (2**20, about a million). Far beyond any real cluster, and small enough that
#: every message can print the number (Python refuses str() of >4300 digits).
MAX_SIZE = 2 ** 20


def show_number(value) -> str:
    """``repr(value)``, except a huge int is described by its length, so a message
    about a 5001-digit number never fails to print it."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 12:
        return f"a number of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    return repr(value)


def size_problem(value, what: str, fix: str) -> str | None:
    """Why ``value`` is not a usable size (positive int <= MAX_SIZE), or None."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return f"{what}={show_number(value)} is invalid: it must be a positive integer ({fix})"
    if value > MAX_SIZE:
        return (f"{what}={show_number(value)} is too large: the planner accepts at most "
                f"{MAX_SIZE} (2**20); {fix}")
    return None

# Canonical rendering order, as AReaL prints it.
_RENDER_ORDER = "dptce"


@dataclass(frozen=True)
class Dims:
    """Parallel degrees of one layout. Missing degrees are 1."""

    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1

    def __post_init__(self):
        for letter in "dtpce":
            value = getattr(self, letter)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(
                    f"{DIM_NAMES[letter]} degree {letter}={show_number(value)} is invalid: every "
                    f"degree must be a positive integer (write {letter}1 or leave it out)"
                )
            if value > MAX_SIZE:
                raise PlanError(size_problem(value, f"{DIM_NAMES[letter]} degree {letter}",
                                             "use a real cluster's size"))

    def __str__(self) -> str:
        parts = [f"{k}{getattr(self, k)}" for k in _RENDER_ORDER if k == "d" or getattr(self, k) != 1]
        return "".join(parts)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in "dtpce"}


@dataclass(frozen=True)
class Component:
    """One engine in the plan.

    ``dims`` is the dense/attention layout; ``ffn`` is the expert layout of a
    hybrid MoE megatron component (``ffn.t`` = expert-TP, ``ffn.d`` = expert-DP,
    ``ffn.e`` = EP). ``role`` is set by :func:`assign_roles`; ``span`` is the
    (start, end) of the component in the source text, for error carets only.
    """

    backend: str
    dims: Dims = Dims()
    name: str | None = None
    ffn: Dims | None = None
    role: str | None = None
    span: tuple[int, int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        problem = structural_problem(self)
        if problem:
            raise PlanError(problem)

    # -- kind ---------------------------------------------------------------------
    @property
    def is_inference(self) -> bool:
        return self.backend in INFERENCE_BACKENDS

    @property
    def is_training(self) -> bool:
        return self.backend in TRAINING_BACKENDS

    @property
    def is_hybrid(self) -> bool:
        return self.ffn is not None

    @property
    def label(self) -> str:
        """How messages refer to this component: its name, else its role, else backend."""
        return self.name or self.role or self.backend

    # -- degrees ------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dims.d

    @property
    def tp(self) -> int:
        return self.dims.t

    @property
    def pp(self) -> int:
        return self.dims.p

    @property
    def cp(self) -> int:
        return self.dims.c

    @property
    def ep(self) -> int:
        return self.ffn.e if self.ffn else self.dims.e

    @property
    def etp(self) -> int:
        """Expert tensor parallel: ``ffn.t`` in hybrid form, 1 in the flat form."""
        return self.ffn.t if self.ffn else 1

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks left after EP x ETP x PP."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def world_size(self) -> int:
        """Ranks this component runs: training d*t*p*c, inference d*t*p."""
        return self.dims.d * self.dims.t * self.dims.p * self.dims.c

    @property
    def engine_size(self) -> int:
        """GPUs of one inference engine (t*p); for training, one model replica (t*p*c)."""
        return self.dims.t * self.dims.p * self.dims.c

    @property
    def num_engines(self) -> int:
        """Inference: independent engines (d). Training: DP replicas."""
        return self.dims.d

    def spec(self) -> str:
        """This component in allocation-string form (round-trips through the parser)."""
        head = self.backend + (f"[{self.name}]" if self.name else "")
        if self.ffn is not None:
            return f"{head}:(attn:{self.dims}|ffn:{self.ffn})"
        return f"{head}:{self.dims}"


def structural_problem(comp: Component) -> str | None:
    """Why ``comp`` cannot exist, or None. Shared by the parser and flag resolvers."""
    b = comp.backend
    if b not in BACKENDS:
        return f"unknown backend {b!r}; choose one of {', '.join(BACKENDS)}"
    if comp.name is not None and not NAME_RE.match(comp.name):
        return (f"component name {comp.name!r} is invalid: use letters, digits and '_' "
                f"and start with a letter, e.g. {b}[actor]")
    d = comp.dims
    where = comp.spec() if _renderable(comp) else b
    if _renderable(comp) and d.d * d.t * d.p * d.c > MAX_SIZE:
        return (f"{where}: world d*t*p*c = {d.d * d.t * d.p * d.c} GPUs is more than the planner's "
                f"limit of {MAX_SIZE} (2**20); shrink the degrees")
    if b in INFERENCE_BACKENDS:
        if comp.ffn is not None:
            return f"{where}: the attn/ffn hybrid layout is training-only; write {b}:d<N>t<N>p<N>"
        if d.c != 1 or d.e != 1:
            bad = "c" if d.c != 1 else "e"
            return (f"{where}: inference backend {b} takes only d, t, p; {bad} ({DIM_NAMES[bad]}) "
                    f"is a training dimension. Drop it or move it to the megatron component")
        return None
    if b == "fsdp":
        if comp.ffn is not None:
            return f"{where}: the attn/ffn hybrid MoE layout needs megatron; write megatron:(attn:...|ffn:...)"
        if d.e != 1:
            return (f"{where}: fsdp does not support expert parallel (e{d.e}); "
                    f"use megatron:...e{d.e} for expert parallelism or drop e")
        for letter in "tpc":
            if getattr(d, letter) != 1:
                return (f"{where}: fsdp here is FSDP2 on a 1-D data-parallel mesh, so "
                        f"{letter}{getattr(d, letter)} ({DIM_NAMES[letter]}) is refused; write "
                        f"fsdp:d{d.d * d.t * d.p * d.c} (pure DP on the same GPUs) or use "
                        f"megatron:{d} for model parallelism")
        return None
    # megatron
    if comp.ffn is None:
        if d.e > 1 and (d.d * d.t * d.c) % d.e:
            return (f"{where}: expert parallel e{d.e} must divide d*t*c = {d.d * d.t * d.c} "
                    f"(in the flat form expert-TP is 1, so each pipeline stage's "
                    f"{d.d * d.t * d.c} ranks are split into EP groups of {d.e}); change e or d, "
                    f"or state expert layers separately: megatron:(attn:...|ffn:...)")
        return None
    f = comp.ffn
    if d.e != 1:
        return f"{where}: in the hybrid form EP belongs to the ffn section; move e{d.e} to ffn:"
    if f.c != 1:
        return f"{where}: in the hybrid form CP belongs to the attn section; move c{f.c} to attn:"
    if f.p != d.p:
        return (f"{where}: ffn p{f.p} must equal attn p{d.p} (attention and expert layers "
                f"share the pipeline stages); set both to p{d.p}")
    attn_world = d.d * d.t * d.p * d.c
    ffn_world = f.d * f.t * f.p * f.e
    if attn_world != ffn_world:
        unit = f.t * f.p * f.e
        fix = (f"set ffn d{attn_world // unit}" if attn_world % unit == 0
               else f"make ffn t*p*e (= {unit}) divide {attn_world}")
        return (f"{where}: attn world d*t*p*c = {attn_world} must equal ffn world d*t*p*e = "
                f"{ffn_world} (both sides run on the same ranks); {fix}")
    return None


def _renderable(comp: Component) -> bool:
    return isinstance(comp.dims, Dims) and (comp.ffn is None or isinstance(comp.ffn, Dims))


@dataclass(frozen=True)
class Group:
    """Components that share one set of GPUs (``a|b``). A lone component is a group of one."""

    members: tuple[Component, ...]

    def __post_init__(self):
        if not self.members:
            raise PlanError("a colocation group needs at least one component")

    @property
    def gpus(self) -> int:
        """GPUs this group occupies: the largest member world (the others fit inside it)."""
        return max(m.world_size for m in self.members)

    @property
    def owner(self) -> Component:
        """The member credited with the group's GPUs (largest world, first on ties)."""
        return max(self.members, key=lambda m: m.world_size)

    @property
    def worlds_differ(self) -> bool:
        return len({m.world_size for m in self.members}) > 1

    def spec(self) -> str:
        return "|".join(m.spec() for m in self.members)


WEIGHT_UPDATE_MODES = ("disk", "tensor", "distributed")
#: Spellings accepted from AReaL (xccl = NCCL/HCCL broadcast) and slime.
WEIGHT_UPDATE_ALIASES = {"disk": "disk", "tensor": "tensor", "distributed": "distributed",
                         "xccl": "distributed", "nccl": "distributed"}


def canonical_weight_update(value: str | None, flag: str = "weight update mode") -> str | None:
    if value is None:
        return None
    key = str(value).strip().lower()
    if key not in WEIGHT_UPDATE_ALIASES:
        raise PlanError(
            f"{flag}={value!r} is unknown; choose disk, tensor (CUDA IPC, colocated only) or "
            f"distributed (alias xccl: NCCL broadcast, separate GPUs)"
        )
    return WEIGHT_UPDATE_ALIASES[key]


@dataclass(frozen=True)
class Allocation:
    """The whole placement plan: groups on separate GPUs, plus the weight-update transport.

    ``weight_update`` is ``disk``/``tensor``/``distributed`` or None (not stated).
    ``source`` is the text the plan was parsed from (messages only; not compared).
    """

    groups: tuple[Group, ...]
    weight_update: str | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if not self.groups:
            raise PlanError("the allocation is empty: state at least one component, e.g. sglang:d2t4")
        object.__setattr__(self, "weight_update", canonical_weight_update(self.weight_update))
        if self.total_gpus > MAX_SIZE:
            raise PlanError(f"the plan needs {self.total_gpus} GPUs, more than the planner's limit "
                            f"of {MAX_SIZE} (2**20); shrink the degrees")
        seen: dict[str, Component] = {}
        for comp in self.components:
            if comp.name is None:
                continue
            if comp.name in seen:
                raise PlanError(f"component name {comp.name!r} is used twice; names must be unique "
                                f"(rename one, e.g. {comp.backend}[{comp.name}2])")
            seen[comp.name] = comp

    @property
    def components(self) -> tuple[Component, ...]:
        return tuple(m for g in self.groups for m in g.members)

    @property
    def total_gpus(self) -> int:
        """GPU demand: ``+`` parts add up; inside a ``|`` group the largest world counts."""
        return sum(g.gpus for g in self.groups)

    @property
    def rollout(self) -> tuple[Component, ...]:
        """Inference engines that generate rollouts (role ``rollout``; not reward/teacher servers)."""
        return tuple(c for c in self.components if c.is_inference and c.role == "rollout")

    @property
    def training(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.is_training)

    @property
    def has_rollout(self) -> bool:
        return bool(self.rollout)

    @property
    def has_training(self) -> bool:
        return bool(self.training)

    @property
    def actors(self) -> tuple[Component, ...]:
        """Every training component with role ``actor``: one per policy."""
        return tuple(c for c in self.training if c.role == "actor")

    @property
    def actor(self) -> Component | None:
        """The training component whose weights feed the rollout engines (role ``actor``);
        the first one in a multi-policy plan (see :attr:`is_multi_policy`)."""
        return next(iter(self.actors), None)

    @property
    def is_multi_policy(self) -> bool:
        """Several actors (``fsdp[actor1]:d4+fsdp[actor2]:d4``): several policies trained at
        once, as in AReaL's multi-agent plans. megatron_rl.train trains one per run."""
        return len(self.actors) > 1

    def group_of(self, comp: Component) -> Group:
        return next(g for g in self.groups if any(m is comp for m in g.members))

    def colocated_with(self, comp: Component) -> tuple[Component, ...]:
        return tuple(m for m in self.group_of(comp).members if m is not comp)

    def __getitem__(self, key: str) -> Component:
        """Look a component up by name, else by role (e.g. ``plan['actor']``)."""
        for c in self.components:
            if c.name == key:
                return c
        for c in self.components:
            if c.role == key:
                return c
        raise KeyError(f"no component named or with role {key!r}; have "
                       f"{', '.join(c.label for c in self.components)}")

    def to_string(self) -> str:
        """The canonical allocation string; ``parse_allocation(p.to_string()) == p``
        up to ``weight_update``, which strings do not carry."""
        return "+".join(g.spec() for g in self.groups)

    def __str__(self) -> str:
        return self.to_string()


#: A role alias with a number: ``actor1``, ``actor_2``, ``rollout1``, ``critic2``. AReaL's
#: multi-agent plans name one actor and one rollout engine per policy this way
#: (``vllm[rollout1]:d2t2+fsdp[actor1]:d4+vllm[rollout2]:d4+fsdp[actor2]:d4``).
INDEXED_NAME_RE = re.compile(r"(?P<stem>[A-Za-z]+?)_?(?P<index>[0-9]+)\Z")


def name_stem(name: str) -> tuple[str, str | None]:
    """``("actor", "1")`` for ``actor1`` when the stem is a role alias, else ``(name, None)``."""
    m = INDEXED_NAME_RE.match(name)
    if m and m.group("stem").lower() in ROLE_ALIASES:
        return m.group("stem"), m.group("index")
    return name, None


def _named_role(comp: Component) -> str:
    name = comp.name
    assert name is not None, "assign_roles asks only for named components"
    key = name_stem(name)[0].lower()
    role = ROLE_ALIASES.get(key)
    if role is not None and (role in INFERENCE_ROLES if comp.is_inference else role != "rollout"):
        return role
    if role is not None and key in ROLES:
        if comp.is_inference:
            raise PlanError(f"{comp.spec()}: an inference backend cannot be the {role}; use "
                            f"megatron/fsdp for it, or name this engine rollout")
        raise PlanError(f"{comp.spec()}: a training backend cannot be the rollout engine; use "
                        f"sglang/vllm for rollout or name this component actor")
    return "rollout" if comp.is_inference else name


def assign_roles(groups: list[list[Component]]) -> tuple[Group, ...]:
    """Resolve each component's role and freeze the groups.

    A name picks its role through ``ROLE_ALIASES``, also with a number
    (``actor1``, ``rollout_2``); other names are custom roles for training
    components and rollout engines for inference components. Several actors are
    a multi-policy plan only when numbered: ``actor``/``policy``/``a`` are one name.
    Unnamed inference components are ``rollout``. The first unnamed training
    component is ``actor`` unless a named one already is; a second unnamed
    training component is ambiguous and refused (which one gets the gradients?).
    """
    flat = [c for g in groups for c in g]
    roles: dict[int, str] = {}
    for i, c in enumerate(flat):
        if c.role is not None:
            roles[i] = c.role
        elif c.name is not None:
            roles[i] = _named_role(c)
    have_actor = "actor" in roles.values()
    for i, c in enumerate(flat):
        if i in roles:
            continue
        if c.is_inference:
            roles[i] = "rollout"
        elif not have_actor:
            roles[i] = "actor"
            have_actor = True
        else:
            raise PlanError(
                f"{c.spec()}: more than one training component and this one has no name, so its "
                f"role is ambiguous; name it, e.g. {c.backend}[critic]:{c.dims} or {c.backend}[ref]:{c.dims}"
            )
    actors = [flat[i] for i, r in roles.items() if r == "actor"]
    plain = [a for a in actors if a.name is None or name_stem(a.name)[1] is None]
    if len(plain) > 1:  # actor/policy/a are spellings of one name; more policies are numbered
        raise PlanError(
            "two components resolve to role 'actor' (" + ", ".join(a.spec() for a in plain)
            + "); give the others distinct names such as critic, ref or teacher, or number the "
            "policies of a multi-policy plan (actor1, actor2)")
    out, k = [], 0
    for g in groups:
        members = []
        for c in g:
            members.append(Component(c.backend, c.dims, c.name, c.ffn, roles[k], c.span))
            k += 1
        out.append(Group(tuple(members)))
    return tuple(out)
