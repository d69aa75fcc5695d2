"""LoRA adapters on megatron-core's tensor-parallel linears, equal to HF PEFT's on the HF modules.

Why our own: megatron-bridge (whose LoRA design this follows: A replicated and B sharded on a
column-parallel linear, the mirror on a row-parallel one) does not install beside megatron-core 0.16.1
and transformers 5 on Python 3.11 (docs/lora.md). The test of this module is PEFT itself: a
``peft.LoraConfig`` adapter on the HF model and ours on the megatron model, loaded from the same
``adapter_model`` tensors, give the same logits and the same adapter gradients at every layout
(tests/models/test_lora.py, tests/dist/test_lora_layouts.py).

PEFT adapts HF modules one by one (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``, ...);
megatron fuses them (``linear_qkv`` holds q, k and v per query group, ``linear_fc1`` holds [gate; up]).
So an adapted fused linear holds one PEFT adapter per HF module it fuses (a *part*): each part's A
``[r, in]`` and B ``[out_part, r]`` are PEFT's tensors, and the part outputs are placed into the fused
output rows by the same fuse function the weight loader uses (:mod:`megatron_rl.models.weight_maps`),
applied to row indices. The delta ``scaling * B (A dropout(x))`` is added to the linear's output by a
forward hook, so the base model's parameter names, checkpoints and weight maps do not change.

Tensor parallelism (TP size T, rank t; the TP group is the adapted linear's own ``tp_group``, so a role built at
a layout of its own gets adapters on its groups):

* column-parallel (``linear_qkv``, ``linear_fc1``): the input is whole (or sequence-sharded under SP,
  gathered here as the linear gathers it); A is replicated, each rank holds its rows of every part's B
  (the rows of the query groups / gate-up halves it owns). Each rank's dA and dx are partial sums
  over the output rows it holds: dA is all-reduced over TP (``copy_to_tensor_model_parallel_region``
  on the weight), dx is reduced by the input mapping's backward, as the linear's own dx is.
* row-parallel (``linear_proj``, ``linear_fc2``): the input is sharded on its features; each rank holds
  its columns of A, ``A x`` is all-reduced (reduce-scattered over the sequence under SP) and B is
  replicated (its gradient all-reduced under SP, where each rank sees only its tokens).

Adapters live in one module per model chunk, ``chunk.lora`` (:data:`LORA_ATTR`), so megatron's DDP and
optimizer see them as the chunk's parameters while the weight loader, exporter and converters skip
them (:func:`is_adapter_name`); the base parameters are frozen (``requires_grad`` False: no gradient
buffer, no optimizer state, no master copy). ``adapters_disabled(chunks)`` gives the base model, the
reference policy of a LoRA run.

Not built (refused by :func:`attach_lora` with the reason): transformer-engine layer specs (the fused
norm + linear hands the adapter its pre-norm input), multi-latent attention projections, and MoE
expert linears (routed or shared).
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_rl.errors import BridgeError
from megatron_rl.models import weight_maps
from megatron_rl.models.peft_adapter import SAVED_PREFIX, peft_key
from megatron_rl.models.weights import LORA_ATTR, canonical_parameters, export_items, export_slot, is_adapter_name
from megatron_rl.models.wrappers import unwrap

ALL_LINEAR = "all-linear"  # PEFT's name for every linear but the output layer

# megatron layer-relative linear -> its tensor-parallel kind; every other linear is not adapted
SITES = {
    "self_attention.linear_qkv": "column",
    "self_attention.linear_proj": "row",
    "mlp.linear_fc1": "column",
    "mlp.linear_fc2": "row",
}
# HF module names the sites fuse, for the messages (the bridge's rules say which exactly)
HF_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_EXPERT_MODULES = re.compile(r"(^|\.)(experts|shared_experts?)\.")


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how (PEFT's ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    init_seed: int = 0  # A's initialisation (B starts at zero, as PEFT's): the same at every layout
    modules_to_save: tuple[str, ...] = ()  # PEFT's modules_to_save: HF modules trained in full beside the adapters

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise BridgeError(f"LoRA rank {self.rank}: must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise BridgeError(f"LoRA dropout {self.dropout}: must be in [0, 1)")
        if not self.target_modules:
            raise BridgeError("LoRA target modules: none given (names like q_proj,v_proj, or all-linear)")

    @property
    def scaling(self) -> float:
        """PEFT's ``lora_alpha / r`` (no rsLoRA)."""
        return self.alpha / self.rank

    def saves(self, hf_module: str) -> bool:
        """Whether HF module ``hf_module`` is trained in full (PEFT's ``modules_to_save`` rule: its name ends
        with one of the names, so ``norm`` picks every norm and ``embed_tokens`` the embedding)."""
        return any(hf_module.endswith(t) for t in self.modules_to_save)

    def targets(self, hf_module: str) -> bool:
        """Whether HF module ``hf_module`` (e.g. ``model.layers.0.self_attn.q_proj``) is adapted: PEFT's
        rule for a list of names (the module's name or its last component), or every linear."""
        if ALL_LINEAR in self.target_modules:
            return True
        return any(hf_module == t or hf_module.endswith("." + t) for t in self.target_modules)


def _tp_rank_size(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _init_a(spec: LoraSpec, hf_module: str, in_features: int) -> torch.Tensor:
    """PEFT's default A (kaiming-uniform with a = sqrt(5)) from a generator seeded by the module's name:
    the full tensor is the same on every rank and at every layout; each rank keeps its slice."""
    gen = torch.Generator().manual_seed(spec.init_seed * 1_000_003 + zlib.crc32(hf_module.encode()))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3) * sqrt(3/in)
    return (torch.rand(spec.rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LoraLinear(torch.nn.Module):
    """The PEFT adapters of one megatron linear (one per HF module it fuses) and their TP mapping."""

    def __init__(self, spec: LoraSpec, kind: str, parts: list[str], part_rows: list[int], order: torch.Tensor,
                 in_features: int, out_features: int, dtype: torch.dtype, tp_group, sequence_parallel: bool):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes  # lazy: megatron

        self.kind, self.parts, self.part_rows = kind, parts, part_rows
        self.targeted = [spec.targets(p) for p in parts]
        self.scaling, self.tp_group, self.sequence_parallel = spec.scaling, tp_group, sequence_parallel
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        self.register_buffer("order", order, persistent=False)
        self.lora_A = torch.nn.ParameterList()
        self.lora_B = torch.nn.ParameterList()
        rank, size = _tp_rank_size(tp_group)
        self.in_features, self.out_features = in_features, out_features  # local (this rank's) sizes
        for part, rows, on in zip(parts, part_rows, self.targeted):
            if not on:
                continue
            if kind == "column":
                a = _init_a(spec, part, in_features).to(dtype)
                b = torch.zeros(rows, spec.rank, dtype=dtype)
            else:
                a = _init_a(spec, part, in_features * size).chunk(size, dim=1)[rank].contiguous().to(dtype)
                b = torch.zeros(rows, spec.rank, dtype=dtype)
            pa, pb = torch.nn.Parameter(a), torch.nn.Parameter(b)
            # megatron's attributes: sharded tensors count once per TP rank in the grad norm, replicated
            # ones only on TP rank 0 (param_is_not_tensor_parallel_duplicate)
            set_tensor_model_parallel_attributes(pa, kind == "row", 1, 1)
            set_tensor_model_parallel_attributes(pb, kind == "column", 0, 1)
            self.lora_A.append(pa)
            self.lora_B.append(pb)

    def targeted_parts(self) -> list[str]:
        return [p for p, on in zip(self.parts, self.targeted) if on]

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A dropout(x))`` in the layout of the linear's output for input ``x`` (the
        linear's own input: sequence-sharded under SP for a column-parallel linear)."""
        from megatron.core.tensor_parallel import mappings  # lazy: megatron

        group = self.tp_group
        if self.kind == "column":
            x = (mappings.gather_from_sequence_parallel_region(x, group=group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(x, group=group))
            if self.dropout is not None:  # the whole input, the same draw on every TP rank (default RNG)
                x = self.dropout(x)
            outs, i = [], 0
            for rows, on in zip(self.part_rows, self.targeted):
                if not on:
                    outs.append(x.new_zeros(*x.shape[:-1], rows))
                    continue
                a = mappings.copy_to_tensor_model_parallel_region(self.lora_A[i], group=group)
                outs.append(torch.nn.functional.linear(torch.nn.functional.linear(x, a), self.lora_B[i]))
                i += 1
            fused = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
            order: torch.Tensor = self.order  # type: ignore[assignment]  # a registered buffer
            return (fused if len(outs) == 1 else fused.index_select(-1, order)) * self.scaling
        if self.dropout is not None:  # this rank's features: its own draw, as megatron's TP-sharded dropout
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # lazy: megatron

            with get_cuda_rng_tracker().fork():
                x = self.dropout(x)
        h = torch.nn.functional.linear(x, self.lora_A[0])
        b: torch.Tensor = self.lora_B[0]
        if self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
            b = mappings.copy_to_tensor_model_parallel_region(b, group=group)  # each rank saw its tokens
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        return torch.nn.functional.linear(h, b) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` in the layout of this rank's shard of the linear's weight (the merged adapter)."""
        if self.kind == "row":
            return (self.lora_B[0] @ self.lora_A[0]) * self.scaling
        rows, i = [], 0
        for n, on in zip(self.part_rows, self.targeted):
            if on:
                rows.append(self.lora_B[i] @ self.lora_A[i])
                i += 1
            else:
                rows.append(torch.zeros(n, self.in_features, dtype=self.lora_A[0].dtype, device=self.lora_A[0].device))
        fused = torch.cat(rows, dim=0)
        order: torch.Tensor = self.order  # type: ignore[assignment]  # a registered buffer
        return (fused if len(rows) == 1 else fused.index_select(0, order)) * self.scaling

    def local_slices(self) -> Iterator[tuple[str, torch.Tensor, int, int, int]]:
        """``(peft key, local tensor, dim, tp rank, tp size)`` of every adapter tensor: the local tensor is
        the slice ``chunk(full, size, dim)[rank]`` of PEFT's tensor (dim -1: not sharded)."""
        rank, size = _tp_rank_size(self.tp_group)
        for i, part in enumerate(self.targeted_parts()):
            yield peft_key(part, "A"), self.lora_A[i], (1 if self.kind == "row" else -1), rank, size
            yield peft_key(part, "B"), self.lora_B[i], (0 if self.kind == "column" else -1), rank, size


class LoraAdapters(torch.nn.Module):
    """One model chunk's adapters (``chunk.lora``), keyed by the canonical name of the adapted linear."""

    def __init__(self, spec: LoraSpec):
        super().__init__()
        self.spec = spec
        self.enabled = True
        self.adapters = torch.nn.ModuleDict()  # key: canonical linear name with '.' -> '/'
        self._hooks: list = []
        self._linears: dict[str, torch.nn.Module] = {}  # not submodules: the base model owns them

    def add(self, canonical: str, module: torch.nn.Module, adapter: LoraLinear) -> None:
        self.adapters[canonical.replace(".", "/")] = adapter
        self._linears[canonical] = module

        def hook(_mod, args, kwargs, output):
            if not self.enabled:
                return output
            out, bias = output
            x = args[0] if args else kwargs["input_"]
            return out + adapter.delta(x).to(out.dtype), bias

        self._hooks.append(module.register_forward_hook(hook, with_kwargs=True))

    def items(self) -> Iterator[tuple[str, LoraLinear]]:
        for key, adapter in self.adapters.items():
            assert isinstance(adapter, LoraLinear)
            yield key.replace("/", "."), adapter

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's distributed checkpoint entries: the sharded tensors (column B, row A) with their TP axis,
        the rest replicated. Keys carry the global layer index, so pipeline stages never collide."""
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,  # lazy: megatron
                                                     make_sharded_tensors_for_checkpoint)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out: dict = {}
        for key, adapter in self.adapters.items():
            assert isinstance(adapter, LoraLinear)
            sd = adapter.state_dict(prefix="", keep_vars=True)
            sharded, axis = ("lora_B.", 0) if adapter.kind == "column" else ("lora_A.", 1)
            out.update(make_sharded_tensors_for_checkpoint(
                sd, f"{prefix}adapters.{key}.", {k: axis for k in sd if k.startswith(sharded)}, sharded_offsets,
                tp_group=adapter.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return out

    @contextlib.contextmanager
    def merged(self):
        """The adapters folded into the base weights inside the block (what an engine without LoRA serves),
        then the base weights put back exactly (copied back, not subtracted: W + d - d is not W in floats);
        the hooks are off meanwhile, so a forward inside sees the merged weights once."""
        saved = []
        with torch.no_grad():
            for canonical, adapter in self.items():
                weight = self._linears[canonical].weight
                saved.append((weight, weight.detach().clone()))
                weight.add_(adapter.delta_weight().to(weight.dtype))
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled
            with torch.no_grad():
                for weight, original in saved:
                    weight.copy_(original)


def _fused_parts(bridge, rule, weight: torch.Tensor, tp_size: int):
    """(HF module per part, this rank's rows per part, local row order) of one megatron linear."""
    modules = [n[: -len(".weight")] for n in rule.hf_names]
    if rule.kind == "copy":
        rows = weight.shape[0]
        return modules, [rows], torch.arange(rows)
    if rule.kind == "gate_up":
        half = weight.shape[0] // 2
        return modules, [half, half], torch.arange(2 * half)
    if rule.kind == "qkv":
        groups = bridge.num_query_groups // tp_size
        hpg = bridge.num_heads // bridge.num_query_groups
        q_rows, kv_rows = groups * hpg * bridge.head_dim, groups * bridge.head_dim
        idx = torch.arange(q_rows + 2 * kv_rows)
        order = weight_maps.fuse_qkv(idx[:q_rows], idx[q_rows:q_rows + kv_rows], idx[q_rows + kv_rows:], groups)
        return modules, [q_rows, kv_rows, kv_rows], order
    raise BridgeError(f"LoRA: no adapter layout for a {rule.kind!r} linear")


def attach_lora(bridge, model_chunks, spec: LoraSpec) -> list[LoraAdapters]:
    """Adapt every targeted linear of ``model_chunks`` (this rank's chunks, before DDP wraps them) and
    freeze everything else. Returns each chunk's :class:`LoraAdapters` (also ``chunk.lora``).
    Refuses, naming the module: a layer spec or attention adapters are not built for, targeted MoE expert
    linears, and target names that match no module of the model."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # lazy: megatron

    from megatron_rl.models.spec import layer_spec_flavour  # lazy: imports the megatron layer specs

    if layer_spec_flavour() != "local":
        raise BridgeError("LoRA is built on megatron's local layer spec; with transformer-engine the input norm is "
                          "fused into linear_qkv/linear_fc1 and the adapter would see the un-normed input")
    if getattr(bridge, "mla", False):
        raise BridgeError(f"LoRA on {bridge.family}'s multi-latent attention projections is not built")
    matched: set[str] = set()
    out = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for p in model.parameters():
            p.requires_grad_(False)
        adapters = LoraAdapters(spec)
        for layer_module in model.decoder.layers:
            g = layer_module.layer_number - 1
            for site, kind in SITES.items():
                linear = layer_module.get_submodule(site) if _has(layer_module, site) else None
                if linear is None:
                    continue
                want = ColumnParallelLinear if kind == "column" else RowParallelLinear
                if not isinstance(linear, want):
                    raise BridgeError(f"LoRA: decoder.layers.{g}.{site} is a {type(linear).__name__}, not megatron's "
                                      f"{want.__name__}")
                canonical = f"decoder.layers.{g}.{site}"
                rule = bridge.rule_for(canonical + ".weight")
                tp_group = linear.tp_group  # the model's own TP group (its layout's, whatever parallel_state holds)
                _, tp_size = _tp_rank_size(tp_group)
                parts, rows, order = _fused_parts(bridge, rule, linear.weight, tp_size)
                hit = [spec.targets(p) for p in parts]
                matched.update(p.rsplit(".", 1)[-1] for p, h in zip(parts, hit) if h)
                if not any(hit):
                    continue
                in_f, out_f = linear.weight.shape[1], linear.weight.shape[0]
                adapter = LoraLinear(spec, kind, parts, rows, order, in_f, out_f, linear.weight.dtype, tp_group,
                                     bool(linear.config.sequence_parallel))
                adapters.add(canonical, linear, adapter)
            _refuse_targeted_experts(bridge, spec, layer_module, g)
        setattr(model, LORA_ATTR, adapters)
        out.append(adapters)
    _unfreeze_modules_to_save(bridge, model_chunks, spec)
    unmatched = [t for t in spec.target_modules if t != ALL_LINEAR and t.rsplit(".", 1)[-1] not in matched
                 and not any(m.endswith("." + t) or m == t for m in matched)]
    if unmatched:
        raise BridgeError(f"LoRA target modules {unmatched} match no linear of this {bridge.family} model "
                          f"(adaptable: {', '.join(HF_LINEAR_NAMES)} or all-linear)")
    return out


def _unfreeze_modules_to_save(bridge, model_chunks, spec: LoraSpec) -> None:
    """PEFT's ``modules_to_save``: the base parameters whose HF modules the names pick train in full (gradient,
    optimizer state, checkpoint entries, weight tags) beside the adapters. A tied output layer is the embedding's
    copy on the last pipeline stage (``model.embed_tokens`` both): megatron keeps the two equal as in full
    fine-tuning. Refused by name: a megatron parameter that fuses picked and unpicked HF modules (a linear:
    target it instead). A name that picks no module of the model is refused in validation (the checkpoint's
    weight names), where every pipeline stage's modules are known."""
    if not spec.modules_to_save:
        return
    for chunk in model_chunks:
        for slot in canonical_parameters(chunk):
            if not isinstance(slot.param, torch.nn.Parameter) or slot.is_expert:
                continue
            modules = [n.rsplit(".", 1)[0] for n in bridge.rule_for(slot.canonical_name).hf_names]
            hit = [spec.saves(m) for m in modules]
            if not any(hit):
                continue
            if not all(hit):
                raise BridgeError(f"LoRA modules to save {list(spec.modules_to_save)}: megatron's {slot.canonical_name} "
                                  f"fuses {', '.join(modules)}, of which only some are picked; a linear is adapted "
                                  "(--lora-target-modules), not saved")
            slot.param.requires_grad_(True)


def saved_parameter_count(model_chunks) -> int:
    """Base parameters trained in full beside the adapters (``modules_to_save``) on this rank."""
    return sum(p.numel() for c in model_chunks for n, p in unwrap(c).named_parameters()
               if p.requires_grad and not is_adapter_name(n))


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _refuse_targeted_experts(bridge, spec: LoraSpec, layer_module, g: int) -> None:
    """An MoE layer's experts are not adapted: a target naming them (or all-linear) is refused."""
    if not bridge.is_moe_layer(g):
        return
    if ALL_LINEAR in spec.target_modules or any(t in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
                                                 or _EXPERT_MODULES.search(t + ".") for t in spec.target_modules):
        raise BridgeError(f"LoRA on MoE expert linears (layer {g} of this {bridge.family} model) is not built: "
                          "target the attention projections only (q_proj,k_proj,v_proj,o_proj)")


@contextlib.contextmanager
def adapters_disabled(adapters: list[LoraAdapters]):
    """The base model inside the block (the reference policy of a LoRA run), the adapters after it."""
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was


@torch.no_grad()
def load_peft_tensors(adapters: list[LoraAdapters], tensors: dict[str, torch.Tensor]) -> None:
    """Set every adapter from PEFT ``adapter_model`` tensors (full tensors; each rank keeps its slice).
    Refuses a missing key or a shape that is not the adapter's, naming it."""
    for chunk in adapters:
        for _, adapter in chunk.items():
            for key, param, dim, rank, size in adapter.local_slices():
                if key not in tensors:
                    raise BridgeError(f"LoRA adapter tensors have no {key!r}")
                full = tensors[key]
                local = full if dim < 0 else full.chunk(size, dim=dim)[rank]
                if tuple(local.shape) != tuple(param.shape):
                    raise BridgeError(f"LoRA adapter tensor {key!r} has shape {tuple(full.shape)}, which does not "
                                      f"give this model's adapter its {tuple(param.shape)} on TP rank {rank} of {size}")
                param.copy_(local)


def local_adapter_tensors(adapters: list[LoraAdapters], source=None) -> Iterator[tuple[str, torch.Tensor, int, int,
                                                                                         int]]:
    """``(peft key, local tensor, dim, tp rank, tp size)`` of every adapter parameter of this rank;
    ``source(param)`` picks what to yield (default: the parameter; e.g. ``lambda p: p.main_grad``)."""
    for chunk in adapters:
        for _, adapter in chunk.items():
            for key, param, dim, rank, size in adapter.local_slices():
                yield key, (param if source is None else source(param)), dim, rank, size


@torch.no_grad()
def saved_module_tensors(bridge, model_chunks) -> dict[str, torch.Tensor]:
    """This pipeline stage's weights of the modules to save (the base parameters trained beside the adapters),
    whole (gathered over TP: collective in each TP group), under PEFT's saved keys
    (``base_model.model.model.embed_tokens.weight``)."""
    out: dict[str, torch.Tensor] = {}
    for slot, names in export_items(bridge, model_chunks):
        if isinstance(slot.param, torch.nn.Parameter) and slot.param.requires_grad:
            for name, tensor in export_slot(bridge, slot, names):
                out[SAVED_PREFIX + name] = tensor.detach().clone()
    return out


@torch.no_grad()
def full_adapter_tensors(adapters: list[LoraAdapters], *, stage_only: bool = False,
                         saved: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model, whole, under its PEFT key (``--lora-sync adapter``). Collective: each
    sharded tensor (column B, row A) is all-gathered over its TP group and concatenated along the axis it is
    sharded on (``chunk(full, size, dim)[rank]`` reversed); ``saved``: this stage's weights of the modules to save
    (:func:`saved_module_tensors`), sent along; with pipeline parallelism each stage's tensors are then
    all-gathered over the PP group, unless ``stage_only`` (this rank's stage only, as ``export_weights``)."""
    from megatron.core import parallel_state as ps  # lazy: megatron

    out: dict[str, torch.Tensor] = {}
    for chunk in adapters:
        for _, adapter in chunk.items():
            for key, param, dim, _, size in adapter.local_slices():
                local = param.detach().contiguous()
                if dim >= 0 and size > 1:
                    parts = [torch.empty_like(local) for _ in range(size)]
                    torch.distributed.all_gather(parts, local, group=adapter.tp_group)
                    out[key] = torch.cat(parts, dim=dim)
                else:
                    out[key] = local.clone()
    out.update(saved or {})  # --lora-modules-to-save: this stage's weights of them, whole (saved_module_tensors)
    pp_size = ps.get_pipeline_model_parallel_world_size() if torch.distributed.is_initialized() else 1
    if pp_size > 1 and not stage_only:
        stages: list = [None] * pp_size  # each stage's tensors (small: the adapters), on the host for the gather
        torch.distributed.all_gather_object(stages, {k: v.cpu() for k, v in out.items()},
                                            group=ps.get_pipeline_model_parallel_group())
        device = next(iter(out.values())).device if out else torch.device("cpu")
        out = {k: v.to(device) for stage in stages for k, v in stage.items()}
    return out


def adapter_parameter_count(adapters: list[LoraAdapters]) -> int:
    return sum(p.numel() for a in adapters for p in a.parameters())


def describe(adapters: list[LoraAdapters]) -> str:
    """One line for the log: how many linears and parameters are adapted on this rank."""
    n = sum(1 for a in adapters for _ in a.items())
    return f"LoRA: {n} linears adapted, {adapter_parameter_count(adapters)} trainable parameters on this rank"
