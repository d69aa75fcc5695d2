"""Streaming HF weight load into, and export out of, megatron-core model chunks.

``load_hf_weights(bridge, model_chunks, hf_dir)``
    Every rank reads only the rows/columns its parameters own (TP shard, PP stage,
    virtual stage, EP experts) with ``safe_open(...).get_slice``; no rank holds a
    full-model copy. Refuses, with the names: checkpoint tensors the bridge does
    not map, mapped tensors the checkpoint lacks, HF shapes that differ from the
    config, model parameters no HF tensor fills, and inf/NaN in the values a rank
    reads (named with the shard file, checked as they are read:
    :class:`~megatron_rl.models.hf_checkpoint.NonFiniteWeights`) or that the cast to
    the model's dtype produces. Not collective (no communication); call it on every rank.

``export_hf_weights(bridge, model_chunks, bucket_bytes=None)``
    Inverse. COLLECTIVE: every rank of the job must iterate the generator to the
    end. TP shards are all-gathered in the TP (expert-TP) group, experts in the EP
    group, and each pipeline stage's tensors are broadcast to the whole PP group,
    so **every rank yields the same full HF-layout tensors in the same order**
    (DP / CP replicas do the same work independently). ``bucket_bytes`` groups
    consecutive tensors of one dtype into one PP broadcast; ``None`` means one
    broadcast per tensor. Tied output layers are not exported twice.

Round trip: load -> export gives back the checkpoint's tensors bit-exactly.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from megatron_rl.errors import BridgeError, CheckpointError
from megatron_rl.models import weight_maps
from megatron_rl.models.hf_checkpoint import HFCheckpoint, check_finite
from megatron_rl.models.wrappers import unwrap

LORA_ATTR = "lora"  # the attribute of a model chunk that holds its LoRA adapters (models/lora.py)


def is_adapter_name(name: str) -> bool:
    """Whether a model chunk's parameter/state name belongs to its adapters (not base model state): here, not in
    ``models/lora.py``, so that the canonical parameter walk needs nothing of the adapters' module."""
    return name == LORA_ATTR or name.startswith(LORA_ATTR + ".")


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_RE = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.(.*)$")
_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")


@dataclass
class ParamSlot:
    """One local megatron parameter and where it sits in the full model."""

    canonical_name: str  # global layer / expert indices
    param: torch.Tensor  # a Parameter, or a persistent buffer (named_state_tensors)
    is_expert: bool
    local_expert: Optional[int]  # index within this EP rank
    layer: Optional[int]

    @property
    def tp_partition_dim(self) -> Optional[int]:
        if getattr(self.param, "tensor_model_parallel", False):
            return int(self.param.partition_dim)  # type: ignore[attr-defined]  # megatron's own attribute, set at runtime
        return None


def named_state_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_parameters()``, then the persistent buffers: every tensor of the model's state dict.

    Why buffers: some model state is not trained by the optimizer yet comes from the HF
    checkpoint (a sigmoid router's selection bias, megatron ``mlp.router.expert_bias``); it
    is loaded, exported and checkpointed like a parameter. Non-persistent buffers (token
    counters, rotary caches) are not model state and are skipped."""
    for name, param in model.named_parameters():
        if not is_adapter_name(name):  # LoRA adapters are not base model state (models/lora.py)
            yield name, param
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buf


def canonical_parameters(model_chunk) -> list[ParamSlot]:
    """This chunk's parameters and persistent buffers (:func:`named_state_tensors`), renamed to
    global layer and expert indices."""
    model = unwrap(model_chunk)
    slots = []
    for name, param in named_state_tensors(model):
        layer = None
        local_expert = None
        m = _LAYER_RE.match(name)
        mtp = _MTP_RE.match(name)
        if m:
            local_layer = int(m.group(1))
            module = model.decoder.layers[local_layer]
            layer = module.layer_number - 1
            rest = m.group(2)
            e = _EXPERT_RE.match(rest)
            if e:
                local_expert = int(e.group(2))
                rest = f"{e.group(1)}{module.mlp.local_expert_indices[local_expert]}{e.group(3)}"
            name = f"decoder.layers.{layer}.{rest}"
        elif mtp:  # an MTP layer's decoder layer: megatron numbers it after the decoder's (layer_number)
            depth, rest = int(mtp.group(1)), mtp.group(2)
            module = model.mtp.layers[depth].transformer_layer
            layer = module.layer_number - 1
            e = _EXPERT_RE.match(rest)
            if e:
                local_expert = int(e.group(2))
                rest = f"{e.group(1)}{module.mlp.local_expert_indices[local_expert]}{e.group(3)}"
            name = f"mtp.layers.{depth}.transformer_layer.{rest}"
        slots.append(ParamSlot(name, param, local_expert is not None, local_expert, layer))
    return slots


def _tp_group(slot: ParamSlot):
    from megatron.core import parallel_state as ps

    if slot.is_expert:
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def _group_rank_size(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


# ----------------------------------------------------------------------- load
def _read_local(bridge, rule, slot: ParamSlot, ckpt: HFCheckpoint) -> torch.Tensor:
    dim = slot.tp_partition_dim
    rank, size = _group_rank_size(_tp_group(slot)) if dim is not None else (0, 1)
    local_shape = tuple(slot.param.shape)
    if rule.kind == "vocab":
        (src,) = rule.hf_names
        rows = local_shape[0]
        start = rank * rows
        stop = min(start + rows, bridge.vocab_size)
        part = ckpt.read(src, 0, start, stop) if start < stop else ckpt.read(src, 0, 0, 0)
        return weight_maps.pad_vocab(part, rows)
    if rule.kind == "copy":
        (src,) = rule.hf_names
        if dim is None or size == 1:
            return ckpt.read(src)
        n = local_shape[dim]
        return ckpt.read(src, dim, rank * n, (rank + 1) * n)
    if rule.kind == "qkv":
        groups = bridge.num_query_groups // size
        hpg = bridge.num_heads // bridge.num_query_groups
        q_rows, kv_rows = groups * hpg * bridge.head_dim, groups * bridge.head_dim
        q = ckpt.read(rule.hf_names[0], 0, rank * q_rows, (rank + 1) * q_rows)
        k = ckpt.read(rule.hf_names[1], 0, rank * kv_rows, (rank + 1) * kv_rows)
        v = ckpt.read(rule.hf_names[2], 0, rank * kv_rows, (rank + 1) * kv_rows)
        return weight_maps.fuse_qkv(q, k, v, groups)
    if rule.kind == "qkv_gated":  # q_proj holds each head's query and output gate rows
        groups = bridge.num_query_groups // size
        hpg = bridge.num_heads // bridge.num_query_groups
        q_rows, kv_rows = groups * hpg * 2 * bridge.head_dim, groups * bridge.head_dim
        q = ckpt.read(rule.hf_names[0], 0, rank * q_rows, (rank + 1) * q_rows)
        k = ckpt.read(rule.hf_names[1], 0, rank * kv_rows, (rank + 1) * kv_rows)
        v = ckpt.read(rule.hf_names[2], 0, rank * kv_rows, (rank + 1) * kv_rows)
        return weight_maps.fuse_gated_qkv(q, k, v, groups, bridge.head_dim)
    if rule.kind in weight_maps.GDN_KINDS:  # HF: each part head after head; megatron: per key-head group
        nk = bridge.gdn_dims[0]
        groups, parts = nk // size, []
        for src, part_rows in zip(rule.hf_names, weight_maps.gdn_rows(rule.kind, bridge.gdn_dims)):
            offset = 0
            for per_group in part_rows:
                n = groups * per_group
                parts.append(ckpt.read(src, 0, offset + rank * n, offset + (rank + 1) * n))
                offset += nk * per_group
        return weight_maps.fuse_groups(parts, groups)
    if rule.kind == "gate_up":
        return weight_maps.fuse_gate_up(*_gate_up_local(rule, slot, ckpt, rank))
    if rule.kind in weight_maps.EXPERT_KINDS:  # one expert's slice of a stacked HF tensor, then this rank's TP shard
        (src,) = rule.hf_names
        full = weight_maps.expert_to_megatron(rule.kind, ckpt.read(src, 0, rule.expert, rule.expert + 1)[0])
        if rule.kind in weight_maps.EXPERT_GATE_UP_KINDS:
            if size > 1:  # each TP rank owns matching row blocks of gate and up
                n = local_shape[0] // 2
                gate, up = torch.chunk(full, 2, dim=0)
                full = weight_maps.fuse_gate_up(gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n])
            return full.contiguous()
        if dim is not None and size > 1:
            n = local_shape[dim]
            full = full.narrow(dim, rank * n, n)
        return full.contiguous()
    raise BridgeError(f"unknown rule kind {rule.kind!r} for {slot.canonical_name}")



def _gate_up_local(rule, slot: ParamSlot, ckpt: HFCheckpoint, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of gate_proj and of up_proj: a gated ``linear_fc1`` is [gate; up] of them."""
    n = slot.param.shape[0] // 2
    return (ckpt.read(rule.hf_names[0], 0, rank * n, (rank + 1) * n),
            ckpt.read(rule.hf_names[1], 0, rank * n, (rank + 1) * n))


def local_row_blocks(bridge, slot: ParamSlot, ckpt: HFCheckpoint) -> Optional[list[torch.Tensor]]:
    """:func:`local_value` as the row blocks (dim 0) it concatenates, where it is such a concatenation: a
    gated ``linear_fc1`` is [gate; up], and megatron saves its halves as two chunks, so a writer can store each
    block as read without building the fused tensor. None for every other parameter (use ``local_value``)."""
    rule = bridge.rule_for(slot.canonical_name)
    if rule.kind != "gate_up":
        return None
    rank = _group_rank_size(_tp_group(slot))[0] if slot.tp_partition_dim is not None else 0
    return list(_gate_up_local(rule, slot, ckpt, rank))


def local_value(bridge, slot: ParamSlot, ckpt: HFCheckpoint) -> torch.Tensor:
    """This rank's value of ``slot`` read from ``ckpt`` (in the checkpoint's dtype).

    What :func:`load_hf_weights` copies into the parameter; the streaming
    converter (``hf-to-dist`` of ``tools/convert_ckpt.py``) writes it without a model.
    Raises ``BridgeError`` for a parameter no HF tensor maps to.
    """
    rule = bridge.rule_for(slot.canonical_name)
    value = _read_local(bridge, rule, slot, ckpt)
    if rule.kind == "vocab":
        _check_mtp_copies(bridge, rule, slot, ckpt, value)
    return value


def _check_mtp_copies(bridge, rule, slot: ParamSlot, ckpt: HFCheckpoint, value: torch.Tensor) -> None:
    """Refuse an MTP layer's copy of the embedding / output head that differs from the main tensor in the rows
    this rank read: megatron's MTP block shares the main one, so a different copy could not be kept."""
    present = ckpt.names()
    for alias, main in bridge.mtp_aliases().items():
        if main != rule.hf_names[0] or alias not in present:
            continue
        copy = _read_local(bridge, dataclasses.replace(rule, hf_names=(alias,)), slot, ckpt)
        if not torch.equal(copy, value):
            raise CheckpointError(f"HF checkpoint {ckpt.hf_dir}: {alias} differs from {main}; megatron's MTP block "
                                  "shares the model's embedding and output head (as DeepSeek-V3 trains it), so an "
                                  "MTP layer with its own cannot be loaded. Run without --mtp-num-layers (the MTP "
                                  "layers are then skipped) or use a checkpoint whose MTP copies equal the main "
                                  "tensors")


def check_checkpoint_names(bridge, ckpt: HFCheckpoint) -> None:
    """Refuse a checkpoint whose tensor set or shapes differ from the bridge's config."""
    expected = bridge.hf_param_shapes()
    present = ckpt.names()
    extra = sorted(n for n in present - set(expected) if not bridge.is_ignorable_hf_name(n))
    missing = sorted(set(expected) - present - set(bridge.mtp_aliases()))  # MTP copies of embed/head: optional
    problems = []
    if extra:
        problems.append(f"{len(extra)} tensor(s) in the checkpoint map to no megatron parameter: {extra}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the {bridge.family} config needs are missing: {missing}")
    bad = [f"{n}: checkpoint {ckpt.shape(n)} vs config {expected[n]}"
           for n in sorted(set(expected) & present) if ckpt.shape(n) != tuple(expected[n])]
    if bad:
        problems.append(f"shape mismatch: {bad}")
    if problems:
        raise CheckpointError(f"HF checkpoint {ckpt.hf_dir} does not match its config.json: "
                              + "; ".join(problems) + ". Fix the checkpoint or its config.json.")


@torch.no_grad()
def load_hf_weights(bridge, model_chunks, hf_dir: str | os.PathLike) -> None:
    ckpt = HFCheckpoint(hf_dir)
    try:
        check_checkpoint_names(bridge, ckpt)
        if os.environ.get("RANK", "0") == "0":  # the same files on every rank: said once
            ckpt.warn_mixed_dtypes("the trainer")
        unfilled, mismatched = [], []
        for chunk in model_chunks:
            for slot in canonical_parameters(chunk):
                try:
                    rule = bridge.rule_for(slot.canonical_name)
                except BridgeError:
                    unfilled.append(slot.canonical_name)
                    continue
                value = local_value(bridge, slot, ckpt)
                if tuple(value.shape) != tuple(slot.param.shape):
                    mismatched.append(f"{slot.canonical_name}: built {tuple(value.shape)} from {rule.hf_names}, "
                                      f"parameter is {tuple(slot.param.shape)}")
                    continue
                cast = value.to(dtype=slot.param.dtype)
                if cast.dtype != value.dtype:  # the read was checked: non-finite now means out of range
                    check_finite(slot.canonical_name, cast, f"{ckpt.hf_dir} cast to {cast.dtype}",
                                 fix=f"its values exceed the range of {cast.dtype}; train with --bf16 (or in "
                                     "float32) instead")
                slot.param.data.copy_(cast)
        if unfilled or mismatched:
            raise CheckpointError(
                f"loading {ckpt.hf_dir}: model parameters left unfilled (no HF mapping): {unfilled}; "
                f"shape mismatches: {mismatched}. The model was built for another config than this checkpoint.")
    finally:
        ckpt.close()


# --------------------------------------------------------------------- export
def _split_shard(bridge, kind: str, shard: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """One TP shard of a megatron parameter -> its pieces, one per HF tensor."""
    if kind == "qkv":
        groups = bridge.num_query_groups // tp_size
        hpg = bridge.num_heads // bridge.num_query_groups
        return list(weight_maps.split_qkv(shard, groups, hpg, bridge.head_dim))
    if kind == "qkv_gated":
        groups = bridge.num_query_groups // tp_size
        hpg = bridge.num_heads // bridge.num_query_groups
        return list(weight_maps.split_gated_qkv(shard, groups, hpg, bridge.head_dim))
    if kind in weight_maps.GDN_KINDS:
        return weight_maps.split_gdn(kind, shard, bridge.gdn_dims[0] // tp_size, bridge.gdn_dims)
    if kind in ("gate_up", *weight_maps.EXPERT_GATE_UP_KINDS):
        return list(weight_maps.split_gate_up(shard))
    return [shard]


ROW_SPLIT_KINDS = ("qkv", "qkv_gated", "gate_up")


def export_rows(bridge, canonical_name: str, rows: int) -> Optional[list[torch.Tensor]]:
    """Which rows of a TP1 parameter (``rows`` of them) each of its HF tensors holds, in order (one index
    tensor per HF tensor), for the kinds whose export only regroups rows (fused q/k/v, gated ``linear_fc1``);
    None for any other kind. Why: a caller that knows where each row's bytes are (the one-process
    ``dist-to-hf``, rows of a ``.distcp`` file) can then write an HF tensor from those bytes."""
    kind = bridge.rule_for(canonical_name).kind
    if kind not in ROW_SPLIT_KINDS:
        return None
    return _split_shard(bridge, kind, torch.arange(rows), 1)


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    size = torch.distributed.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out


def _full_tensors(bridge, slot: ParamSlot, copy: bool = True) -> list[torch.Tensor]:
    """Gather ``slot`` over TP and return its full HF tensors (rule order). ``copy=False``
    lets a TP1 piece be a view of the parameter (for a caller that never modifies it)."""
    rule = bridge.rule_for(slot.canonical_name)
    data = slot.param.detach()
    dim = slot.tp_partition_dim
    group = _tp_group(slot) if dim is not None else None
    _, tp_size = _group_rank_size(group) if dim is not None else (0, 1)
    shards = _all_gather(data, group) if tp_size > 1 else [data]
    pieces = [_split_shard(bridge, rule.kind, s, tp_size) for s in shards]
    cat_dim = dim if dim is not None else 0
    full = [torch.cat([p[i] for p in pieces], dim=cat_dim) if len(pieces) > 1
            else (pieces[0][i].clone() if copy else pieces[0][i]) for i in range(len(pieces[0]))]
    if rule.kind in weight_maps.EXPERT_KINDS:  # (expert_gate_up: full gate, full up) -> this expert's HF slice
        full = [weight_maps.megatron_to_expert(rule.kind, torch.cat(full, dim=0))]
    if rule.kind in weight_maps.GDN_KINDS:  # whole parts -> HF's tensors (conv1d: all q, all k, all v in one)
        full = weight_maps.join_gdn(rule.kind, full, bridge.gdn_dims)
    if rule.kind == "vocab":
        full = [weight_maps.unpad_vocab(t, bridge.vocab_size) for t in full]
    return full


def _ep_layout():
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(), \
        ps.get_expert_model_parallel_group()


def _stage_items(bridge, model_chunks, include_mtp: bool = True, include_vision: bool = True):
    """[(slot, [hf names in yield order])] for this rank's pipeline stage (without the MTP block's unless
    ``include_mtp``, without a vision-language model's tower unless ``include_vision``)."""
    ep_rank, ep_size, _ = _ep_layout()
    items = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for slot in canonical_parameters(chunk):
            if slot.canonical_name == "embedding.word_embeddings.weight" and not model.pre_process:
                continue  # the MTP stage's copy of the first stage's embedding (megatron keeps them equal)
            mtp = slot.canonical_name.startswith("mtp.")
            if (mtp and not include_mtp) or (not include_vision and slot.canonical_name.startswith("vision.")):
                continue
            if slot.is_expert:
                layers = model.mtp.layers if mtp else model.decoder.layers
                module = next(m.transformer_layer if mtp else m for m in layers
                              if (m.transformer_layer if mtp else m).layer_number - 1 == slot.layer)
                num_local = module.mlp.num_local_experts
                local = slot.local_expert
                names = []
                for r in range(ep_size):
                    canonical = re.sub(r"local_experts\.\d+\.", f"local_experts.{r * num_local + local}.",
                                       slot.canonical_name)
                    names.extend(bridge.exported_names(canonical))
            else:
                names = list(bridge.exported_names(slot.canonical_name))
            if names:
                items.append((slot, names))
    return items


def _produce(bridge, items, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of this stage, in ``items`` order (collective in TP/EP groups)."""
    _, ep_size, ep_group = _ep_layout()
    for slot, names in items:
        tensors = _full_tensors(bridge, slot, copy)
        if slot.is_expert and ep_size > 1:
            gathered = [_all_gather(t, ep_group) for t in tensors]  # [hf piece][ep rank]
            tensors = [gathered[i][r] for r in range(ep_size) for i in range(len(tensors))]
        if len(tensors) != len(names):
            raise BridgeError(f"export of {slot.canonical_name}: {len(tensors)} tensors for names {names}")
        yield from zip(names, tensors)


def _buckets(meta, bucket_bytes: Optional[int]):
    """Split ``meta`` [(name, shape, dtype)] into consecutive same-dtype buckets."""
    buckets: list[list[tuple]] = []
    current: list[tuple] = []
    size = 0
    for entry in meta:
        nbytes = _numel(entry[1]) * getattr(torch, entry[2]).itemsize
        if current and (bucket_bytes is None or size + nbytes > bucket_bytes or current[-1][2] != entry[2]):
            buckets.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def export_items(bridge, model_chunks) -> list[tuple[ParamSlot, list[str]]]:
    """[(slot, HF names it exports to)] of this rank's chunks, in export order."""
    return _stage_items(bridge, model_chunks)


def with_mtp_copies(bridge, stream: Iterator[tuple[str, torch.Tensor]],
                    include_mtp: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream``, each MTP layer's copy of the embedding / output head (:meth:`Bridge.mtp_aliases`) yielded
    right after the main tensor it equals (nothing added without ``include_mtp``)."""
    copies: dict[str, list[str]] = {}
    for alias, main in (bridge.mtp_aliases() if include_mtp else {}).items():
        copies.setdefault(main, []).append(alias)
    for name, tensor in stream:
        yield name, tensor
        for alias in copies.get(name, ()):
            yield alias, tensor
        del tensor  # not held while the stream reads the next one (a streaming export's bucket: mapped pages)


def export_slot(bridge, slot: ParamSlot, names: list[str], copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The full HF tensors of one slot (collective in its TP/EP groups; local at TP1/EP1).

    ``slot.param`` may be any tensor holding the parameter's local value: the
    streaming ``dist-to-hf`` passes a loaded copy of a meta model's parameter
    (and ``copy=False``: that copy is never modified, so views of it are safe).
    """
    return _produce(bridge, [(slot, names)], copy)


def stack_expert_pieces(bridge, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Join the per-expert slices of stacked HF tensors (names ``weight_maps.expert_piece_name``) into
    the tensors themselves, each yielded once all its experts arrived (an export sends every expert of
    a layer before the next layer's, so at most one layer's experts are held); other tensors pass."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in stream:
        piece = weight_maps.split_expert_piece_name(name)
        if piece is None:
            yield name, tensor
            del tensor  # not held while the stream reads the next one
            continue
        hf_name, expert = piece
        slices = pending.setdefault(hf_name, {})
        slices[expert] = tensor.clone()  # the stream may reuse its buffer (a PP broadcast bucket, a param view)
        if len(slices) == bridge.num_experts:
            del pending[hf_name]
            yield hf_name, torch.stack([slices[e] for e in range(bridge.num_experts)])
    if pending:
        raise BridgeError(f"export ended with stacked expert tensors incomplete: "
                          f"{ {k: sorted(v) for k, v in pending.items()} }")


def export_shape(bridge, shapes: dict, name: str) -> tuple[int, ...]:
    """Shape of an exported tensor or of one expert's slice of a stacked one."""
    piece = weight_maps.split_expert_piece_name(name)
    return tuple(shapes[name]) if piece is None else tuple(shapes[piece[0]][1:])


def export_hf_weights(bridge, model_chunks, bucket_bytes: Optional[int] = None, stage_only: bool = False,
                      include_mtp: bool = True, include_vision: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """See :func:`_export_hf_weights`; per-expert slices of stacked HF tensors (gpt-oss) leave joined, MTP
    layers' copies of the embedding / head are added (:func:`with_mtp_copies`). ``include_mtp=False``: the
    MTP block's tensors are left out (the weight sync of frozen MTP layers); ``include_vision=False``: a
    vision-language model's tower (``visual.*``) is (--freeze-vision-tower's sync)."""
    return with_mtp_copies(bridge, stack_expert_pieces(
        bridge, _export_hf_weights(bridge, model_chunks, bucket_bytes, stage_only, include_mtp, include_vision)),
        include_mtp)


def _export_hf_weights(bridge, model_chunks, bucket_bytes: Optional[int] = None, stage_only: bool = False,
                       include_mtp: bool = True, include_vision: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, on every rank (collective: TP/EP gathers, PP broadcasts); with
    ``stage_only``, the tensors of this rank's pipeline stage only (TP/EP gathers, no broadcast).

    Order: the non-expert tensors of every stage (stage by stage), then the experts of every
    stage. The dense part is what every engine rank loads whole; the experts, gathered over
    the EP group here, are EP-sharded on the engine side too, and a receiver that updates
    them separately (as slime's distributed route does) gets them as one contiguous tail.
    """
    from megatron.core import parallel_state as ps

    items = _stage_items(bridge, model_chunks, include_mtp, include_vision)
    phases = ([it for it in items if not it[0].is_expert], [it for it in items if it[0].is_expert])
    pp_size = ps.get_pipeline_model_parallel_world_size()
    if pp_size == 1 or stage_only:
        for phase in phases:
            yield from _produce(bridge, phase)
        return
    shapes = bridge.hf_param_shapes()
    my_meta = [[(name, export_shape(bridge, shapes, name), str(slot.param.dtype).replace("torch.", ""))
                for slot, names in phase for name in names] for phase in phases]
    pp_group = ps.get_pipeline_model_parallel_group()
    all_meta: list[Any] = [None] * pp_size  # every stage's metadata, filled by the all-gather
    torch.distributed.all_gather_object(all_meta, my_meta, group=pp_group)
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    my_stage = ps.get_pipeline_model_parallel_rank()
    device = items[0][0].param.device if items else torch.device("cpu")
    for phase_index, phase in enumerate(phases):
        for stage in range(pp_size):
            producer = _produce(bridge, phase) if stage == my_stage else None
            for bucket in _buckets(all_meta[stage][phase_index], bucket_bytes):
                dtype = getattr(torch, bucket[0][2])
                if producer is not None:
                    parts = []
                    for name, shape, _ in bucket:
                        got_name, tensor = next(producer)
                        if got_name != name or tuple(tensor.shape) != tuple(shape):
                            raise BridgeError(f"export order mismatch on stage {stage}: expected {name} {shape}, "
                                              f"produced {got_name} {tuple(tensor.shape)}")
                        parts.append(tensor.reshape(-1))
                    flat = torch.cat(parts)
                else:
                    flat = torch.empty(sum(_numel(s) for _, s, _ in bucket), dtype=dtype, device=device)
                torch.distributed.broadcast(flat, src=pp_ranks[stage], group=pp_group)
                offset = 0
                for name, shape, _ in bucket:
                    n = _numel(shape)
                    yield name, flat[offset:offset + n].view(shape)
                    offset += n
            if producer is not None:
                for leftover in producer:
                    raise BridgeError(f"export produced unexpected tensor {leftover[0]} on stage {stage}")
