"""Does the plan fit the GPU? The per-rank peak (static memory + the activation peak), the engine GPUs, the colocated
phases, a verdict with the headroom, and, when something does not fit, the flags that would make it fit, ranked,
each with the figure a re-run of the whole estimate gives (stdlib only).

The peak of a training rank: its static memory (``plan/memory.py``: every role's parameters, gradient buffers,
optimizer state, weight tags) plus the largest activation peak of one role (``plan/activations.py``: roles train
one after the other, so their activations never coexist), less nothing: the allocator's fragmentation, NCCL's
buffers and the CUDA context are not counted (the headroom has to hold them).

Fixes are candidates (:func:`candidate_fixes`) that the caller re-estimates through its own ``estimate``: a fix
is listed only when the re-run gives a plan whose every GPU fits, ranked by the new heaviest peak (lowest first,
i.e. the most headroom). Nothing is guessed: each figure printed is the re-run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from megatron_rl.plan.activations import ActivationFlags, StageActivations, describe_flags, stage_activations
from megatron_rl.plan.engine_memory import (DEFAULT_MEM_FRACTION, ENGINE_RESERVE_GIB, EngineSpec, Phase,
                                            colocated_phases, engine_rows)
from megatron_rl.plan.memory import (GIB, MegatronLayout, MemoryReport, ModelArch, RoleModelSpec, TrainingFlags,
                                     estimate_for_component)


@dataclass(frozen=True)
class Knobs:
    """The flags a fix may change; the caller maps them onto its own inputs (a ``Config``, check_plan's flags)."""

    tp: int
    pp: int
    ep: int
    tokens: int
    recompute: Optional[str] = None
    cpu_offload: bool = False
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    engine_tp: int = 0  # 0: no engine
    engine_ep: int = 1
    mem_fraction: Optional[float] = None


@dataclass(frozen=True)
class Shortfall:
    """One GPU that does not fit: which component and rank, in which phase, by how much."""

    component: str
    rank: int
    phase: str
    need: float
    gpu: float
    budget: str = "the GPU has"

    @property
    def short(self) -> float:
        return self.need - self.gpu

    def describe(self) -> str:
        return (f"{self.component} on rank {self.rank}'s GPU ({self.phase}) needs {_gib(self.need)}, {self.budget} "
                f"{_gib(self.gpu)}: {_gib(self.short)} short")


@dataclass
class FitReport:
    """The static report with the activations attached, the engines, and the shortfalls."""

    memory: MemoryReport
    knobs: Knobs
    activations: dict[str, list[StageActivations]] = field(default_factory=dict)
    activation_desc: str = ""
    engine: Optional[EngineSpec] = None
    colocated: bool = False
    bucket_bytes: float = 0.0
    response_share: float = 1.0  # response tokens / sample tokens of the longest sample (the flags' bound)

    @property
    def gpu(self) -> float:
        return self.memory.gpu_gib * GIB

    def rank_peak(self, rank: int) -> tuple[float, float, float]:
        """``(static device bytes, activation peak, total)`` of training ``rank``."""
        static = self.memory.rank_totals(rank)[0]
        act = max([acts[comp.stage_of_rank(rank)].peak  # type: ignore[operator]
                   for comp in self.memory.components for name, acts in self.activations.items()
                   if comp.name == name] or [0.0])
        return static, act, static + act

    def heaviest(self) -> tuple[int, float, float, float]:
        seen: dict[tuple, int] = {}
        for r in range(self.memory.world):
            seen.setdefault(tuple(c.stage_of_rank(r) for c in self.memory.components), r)  # type: ignore[operator]
        best = max(seen.values(), key=lambda r: (self.rank_peak(r)[2], -r))
        return (best, *self.rank_peak(best))

    def sleeping_bytes(self) -> float:
        """What the heaviest trainer rank keeps on a colocated GPU while it sleeps (the ``offload`` tier): its
        parameters, fp32 router buffers and device weight tags; 0 when nothing is colocated."""
        if not (self.colocated and self.engine):
            return 0.0
        rank = self.heaviest()[0]
        return sum(r.device for c in self.memory.components for r in c.for_rank(rank).rows
                   if r.kind.startswith(("parameters", "router expert-bias", "weight tags")))

    def phases(self) -> list[Phase]:
        """A colocated GPU's phases, for the heaviest trainer rank."""
        if not (self.colocated and self.engine):
            return []
        _, static, act, _ = self.heaviest()
        return colocated_phases(static, act, self.sleeping_bytes(), self.engine, self.gpu, self.bucket_bytes)[0]

    def shortfalls(self) -> list[Shortfall]:
        """Every GPU that does not fit: a training rank (its peak), a colocated GPU in each phase, an engine GPU
        (its fraction leaves no KV cache, or the fraction plus the reserve exceed the card)."""
        out = []
        rank, static, act, total = self.heaviest()
        if self.engine and self.colocated:
            out += [Shortfall("trainer + engine", rank, p.name, p.total, self.gpu) for p in self.phases()
                    if p.total > self.gpu]
        elif total > self.gpu:
            out.append(Shortfall("trainer", rank, "train: static + activation peak", total, self.gpu))
        if self.engine:
            e = self.engine
            held = self.sleeping_bytes()
            _, pool = engine_rows(e, self.gpu, held)
            what = "engine weights + trainer residual" if self.colocated else "rollout engine weights"
            if pool <= 0:
                out.append(Shortfall(what, rank if self.colocated else 0, "generate: no room for a KV cache",
                                     e.fraction * self.gpu - pool, e.fraction * self.gpu,
                                     f"--sglang-mem-fraction-static {e.fraction:g} gives"))
            elif not self.colocated and e.fraction * self.gpu + ENGINE_RESERVE_GIB * GIB > self.gpu:
                out.append(Shortfall("rollout engine (fraction + reserve)", 0, "generate",
                                     e.fraction * self.gpu + ENGINE_RESERVE_GIB * GIB, self.gpu))
        return out

    def headroom(self) -> float:
        """The smallest headroom over every GPU (negative: the largest shortfall)."""
        heads = [self.gpu - self.heaviest()[3]]
        if self.engine and self.colocated:
            heads += [self.gpu - p.total for p in self.phases()]
        if self.engine:
            held = self.sleeping_bytes()
            heads.append(engine_rows(self.engine, self.gpu, held)[1])
            if not self.colocated:
                heads.append(self.gpu * (1 - self.engine.fraction) - ENGINE_RESERVE_GIB * GIB)
        return min(heads)


def attach_activations(fit: FitReport, role: RoleModelSpec, fl: ActivationFlags) -> None:
    """The activations of a trainable (or frozen: forward-only, no peak kept) role, per pipeline stage."""
    if not role.trainable:
        return
    fit.activations[role.name] = [stage_activations(role.arch, role.layout, fl, s, mtp_layers=role.mtp_layers,
                                                    head=role.head) for s in range(role.layout.pp)]
    fit.activation_desc = fit.activation_desc or describe_flags(fl, role.layout)


def candidate_fixes(k: Knobs, *, layers: int, heads: int, groups: int, experts: int, world: int,
                    gpus_per_node: int = 8) -> list[tuple[str, Knobs]]:
    """The flags that may make a plan fit, as knob changes (the caller re-estimates each)."""
    out: list[tuple[str, Knobs]] = []
    pp2 = k.pp * 2
    if layers % pp2 == 0 and world % (k.tp * pp2) == 0:
        out.append((f"--pipeline-model-parallel-size {pp2}", replace(k, pp=pp2)))
    tp2 = k.tp * 2
    if heads % tp2 == 0 and (groups % tp2 == 0 or tp2 % groups == 0) and tp2 <= gpus_per_node and \
            world % (tp2 * k.pp) == 0:
        out.append((f"--tensor-model-parallel-size {tp2}", replace(k, tp=tp2)))
    ep2 = k.ep * 2
    if experts and experts % ep2 == 0 and world % ep2 == 0:
        out.append((f"--expert-model-parallel-size {ep2}", replace(k, ep=ep2)))
    if not k.distributed_optimizer and world // (k.tp * k.pp) > 1:
        out.append(("--use-distributed-optimizer", replace(k, distributed_optimizer=True)))
    if not k.cpu_offload:
        out.append(("--optimizer-cpu-offload --use-precision-aware-optimizer",
                    replace(k, cpu_offload=True, distributed_optimizer=True)))
    if k.recompute != "full":
        out.append(("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                    replace(k, recompute="full")))
    if k.tp > 1 and not k.sequence_parallel:
        out.append(("--sequence-parallel", replace(k, sequence_parallel=True)))
    if k.tokens >= 2:
        out.append((f"--max-tokens-per-gpu {k.tokens // 2}", replace(k, tokens=k.tokens // 2)))
    if k.engine_tp:
        etp2 = k.engine_tp * 2
        if world % etp2 == 0:
            out.append((f"--rollout-num-gpus-per-engine {etp2}", replace(k, engine_tp=etp2)))
        if experts and k.engine_ep < k.engine_tp and experts % k.engine_tp == 0:
            out.append((f"--sglang-ep-size {k.engine_tp}", replace(k, engine_ep=k.engine_tp)))
        frac = k.mem_fraction if k.mem_fraction is not None else DEFAULT_MEM_FRACTION
        if frac < 0.9:
            out.append((f"--sglang-mem-fraction-static {min(frac + 0.1, 0.9):g}",
                        replace(k, mem_fraction=round(min(frac + 0.1, 0.9), 2))))
    return out


def ranked_fixes(fit: FitReport, estimate: Callable[[Knobs], Optional[FitReport]],
                 candidates: list[tuple[str, Knobs]]) -> list[tuple[str, FitReport]]:
    """Each candidate re-estimated; those whose plan fits, most headroom first (to the MiB; a tie keeps the order
    of ``candidates``)."""
    fits = []
    for flag, knobs in candidates:
        try:
            new = estimate(knobs)
        except Exception:  # noqa: BLE001 - a layout the estimate refuses (e.g. MTP / LoRA limits) is no fix
            continue
        if new is not None and not new.shortfalls():
            fits.append((flag, new))
    return sorted(fits, key=lambda f: -round(f[1].headroom() / 2 ** 20))


# ---------------------------------------------------------------------------------------------------- rendering


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_fit(fit: FitReport, fixes: Optional[list[tuple[str, FitReport]]] = None) -> list[str]:
    """The activation rows per component and stage, the engine GPU, the colocated phases and the verdict."""
    lines = []
    if fit.activations:
        lines.append(f"activations per training rank (estimate: {fit.activation_desc}; docs/planner.md)")
    for name, stages in fit.activations.items():
        labels = [f"stage {s}" if len(stages) > 1 else "all ranks" for s in range(len(stages))]
        body = [["kind"] + labels]
        body.append(["activations, one micro-batch"] + [_gib(s.per_microbatch) for s in stages])
        body.append(["micro-batches in flight (1F1B)"] + [f"{s.in_flight:g}" for s in stages])
        if any(s.recompute_working for s in stages):
            body.append(["recompute unit, re-materialised"] + [_gib(s.recompute_working) for s in stages])
        body.append(["logits peak (log-prob/entropy)"] + [_gib(s.logits) if s.logits else "-" for s in stages])
        body.append(["activation peak (in flight + larger transient)"] + [_gib(s.peak) for s in stages])
        widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
        lines.append(f"  {name}:")
        lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
        last = stages[-1]
        if last.logits_response and last.logits_response < last.logits:
            lines.append(f"    response-only log-probs: the output layer runs on the loss rows only; at the flags' "
                         f"response share {fit.response_share:.0%} (--rollout-max-response-len / the sequence length) "
                         f"the logits peak is {_gib(last.logits_response)} (the verdict keeps {_gib(last.logits)}: a "
                         "micro-batch of short prompts is nearly all response)")
    if fit.engine:
        e = fit.engine
        held = fit.sleeping_bytes()
        rows, _ = engine_rows(e, fit.gpu, held)
        lines.append(f"rollout engine GPU ({e.count} engine(s) of TP {e.tp}"
                     + (", colocated: the pool is what the fraction leaves after the trainer's residual" if fit.colocated
                        else "") + ")")
        lines += [f"    {r.kind:<42}{_gib(r.device):>12}  {r.note}".rstrip() for r in rows]
    for p in fit.phases():
        lines.append(f"colocated GPU, phase {p.name}: {_gib(p.total)} ("
                     + ", ".join(f"{r.kind} {_gib(r.device)}" for r in p.rows if r.device) + ")")
    rank, static, act, total = fit.heaviest()
    lines.append(f"peak per training rank (rank {rank}, the heaviest): {_gib(static)} static + {_gib(act)} "
                 f"activation peak = {_gib(total)}; not counted: allocator fragmentation, NCCL buffers, CUDA context")
    short = fit.shortfalls()
    source = fit.memory.gpu_source
    if not short:
        lines.append(f"verdict: fits {source}, headroom {_gib(fit.headroom())} on the tightest GPU")
        return lines
    lines.append(f"verdict: does NOT fit {source}:")
    lines += [f"  - {s.describe()}" for s in short]
    if fixes is None:
        return lines
    if fixes:
        lines.append("fixes that make it fit (each re-estimated; most headroom first):")
        for i, (flag, new) in enumerate(fixes, 1):
            r2, s2, a2, t2 = new.heaviest()
            lines.append(f"  {i}. {flag}: peak {_gib(t2)} (static {_gib(s2)} + activations {_gib(a2)}), "
                         f"headroom {_gib(new.headroom())}")
    else:
        lines.append("fixes: no single flag change makes it fit (more GPUs, a smaller model, or several changes)")
    return lines


def fit_for_component(plan, comp, arch: ModelArch, flags: TrainingFlags, knobs: Knobs, *,
                      vpp: Optional[int] = None, recompute_method: Optional[str] = None,
                      recompute_num_layers: Optional[int] = None, engine_tokens: int = 0,
                      gpu_type: Optional[str] = None, gpu_memory: Optional[float] = None) -> FitReport:
    """``tools/check_plan.py``'s fit of an allocation's actor ``comp`` at ``knobs`` (its TP / PP / EP, tokens,
    recompute, optimizer placement), with the SGLang engines of the plan (``knobs.engine_tp``: their TP)."""
    lay = {"tp": knobs.tp, "pp": knobs.pp, "ep": knobs.ep} if (knobs.tp, knobs.pp, knobs.ep) != (
        comp.tp, comp.pp, comp.ep) else None
    flags = replace(flags, cpu_offload=knobs.cpu_offload, precision_aware=knobs.cpu_offload,
                    distributed_optimizer=knobs.distributed_optimizer or knobs.cpu_offload)
    report = estimate_for_component(plan, comp, arch, flags, vpp=vpp if not lay else None, gpu_type=gpu_type,
                                    gpu_memory=gpu_memory, layout=lay)
    actor_layout = report_layout(comp, lay, vpp)
    fit = FitReport(report, knobs, colocated=any(c.is_inference for c in plan.colocated_with(comp)))
    full = knobs.recompute == "full"
    fl = ActivationFlags(tokens=knobs.tokens * actor_layout.cp, dtype_bytes=flags.param_bytes,
                         sequence_parallel=knobs.sequence_parallel, recompute_granularity=knobs.recompute,
                         recompute_method=(recompute_method or "uniform") if full else None,
                         recompute_num_layers=(recompute_num_layers or 1) if full else None)
    if comp.backend == "megatron":
        attach_activations(fit, RoleModelSpec("actor", arch, actor_layout), fl)
        for c in plan.colocated_with(comp):
            if c.role == "critic" and c.is_training:
                attach_activations(fit, RoleModelSpec("critic", arch, report_layout(c, None, None), head="value"),
                                   replace(fl, tokens=knobs.tokens * c.cp))
    engines = [c for c in plan.rollout if c.backend == "sglang"]
    if engines and knobs.engine_tp:
        e = engines[0]
        fit.engine = EngineSpec(arch, tp=knobs.engine_tp, count=max(e.world_size // knobs.engine_tp, 1),
                                ep=knobs.engine_ep if arch.experts else 1, mem_fraction=knobs.mem_fraction,
                                sequence_tokens=engine_tokens)
    return fit


def report_layout(comp, changes: Optional[dict], vpp: Optional[int]) -> MegatronLayout:
    lay = MegatronLayout(world=comp.world_size, tp=comp.tp, pp=comp.pp, cp=comp.cp, ep=comp.ep,
                         etp=comp.etp if comp.ep > 1 else None, vpp=vpp)
    return replace(lay, vpp=None, **changes) if changes else lay


def check_plan_fit(plan, comp, arch: ModelArch, flags: TrainingFlags, *, tokens: int, sequence_parallel: bool,
                   recompute: Optional[str], mem_fraction: Optional[float], gpus_per_node: int,
                   **kw) -> tuple[FitReport, list[tuple[str, FitReport]]]:
    """The fit of ``comp`` as ``tools/check_plan.py`` states it, and the ranked fixes when it does not fit."""
    engines = [c for c in plan.rollout if c.backend == "sglang"]
    knobs = Knobs(tp=comp.tp, pp=comp.pp, ep=comp.ep, tokens=tokens, recompute=recompute,
                  cpu_offload=flags.cpu_offload, distributed_optimizer=flags.distributed_optimizer,
                  sequence_parallel=sequence_parallel, engine_tp=engines[0].engine_size if engines else 0,
                  mem_fraction=mem_fraction)

    def estimate(k: Knobs) -> FitReport:
        return fit_for_component(plan, comp, arch, flags, k, **kw)

    fit = estimate(knobs)
    if not fit.shortfalls():
        return fit, []
    cands = candidate_fixes(knobs, layers=arch.layers, heads=arch.heads, groups=arch.groups, experts=arch.experts,
                            world=comp.world_size, gpus_per_node=gpus_per_node)
    return fit, ranked_fixes(fit, estimate, cands)


def fit_json(fit: FitReport, fixes: list[tuple[str, FitReport]]) -> dict:
    """The machine view of the fit (``check_plan --json``'s ``memory`` entries gain these keys)."""
    rank, static, act, total = fit.heaviest()
    return {"activations": {name: [{"per_microbatch_bytes": s.per_microbatch, "in_flight": s.in_flight,
                                    "recompute_working_bytes": s.recompute_working, "logits_bytes": s.logits,
                                    "peak_bytes": s.peak, "terms": [{"name": t.name, "bytes": t.bytes}
                                                                    for t in s.terms]} for s in stages]
                            for name, stages in fit.activations.items()},
            "peak": {"rank": rank, "static_bytes": static, "activation_bytes": act, "total_bytes": total},
            "fits": not fit.shortfalls(), "headroom_bytes": fit.headroom(),
            "shortfalls": [s.describe() for s in fit.shortfalls()],
            "fixes": [{"flag": flag, "peak_bytes": new.heaviest()[3], "headroom_bytes": new.headroom()}
                      for flag, new in fixes]}
