"""Pure tensor transforms between HF layouts and megatron-core parameter layouts.

Every function here works on whole tensors and knows nothing about process
groups, so ``tools/convert_ckpt.py`` can reuse them for a single-process
streaming conversion. The loaders apply the *same* functions to one TP rank's
slices with that rank's local counts: megatron's shard of a fused tensor is
exactly ``fuse(local slices)`` because each TP rank owns whole query groups and
contiguous halves of gate/up.

Layouts (rows = dim 0):

* fused QKV (``linear_qkv``): for each query group g, the rows of its
  ``heads_per_group`` query heads, then its key head, then its value head:
  ``[q_g0 (hpg*d), k_g0 (d), v_g0 (d), q_g1, ...]``. HF keeps q, k, v separate.
* fused gate/up (``linear_fc1`` with a gated linear unit): ``[gate; up]``.
* vocab padding: megatron's embedding / output layer have
  ``padded_vocab_size >= vocab_size`` rows; extra rows are zero on load and
  dropped on export.

Names: :data:`LAYER_SPEC_NAMES` says where each layer spec (local / transformer-engine)
keeps the per-layer norms; TE ``_extra_state`` entries map to nothing (:func:`is_extra_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF q/k/v (weights ``[rows, hidden]`` or biases ``[rows]``) -> megatron fused QKV.

    ``num_query_groups`` is the number of KV heads present in ``k`` / ``v``
    (the local count when fusing one TP rank's slice).
    """
    if q.shape[0] % num_query_groups or k.shape[0] % num_query_groups or k.shape != v.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not split into "
                         f"{num_query_groups} query groups")
    tail = q.shape[1:]
    qg = q.reshape(num_query_groups, -1, *tail)
    kg = k.reshape(num_query_groups, -1, *tail)
    vg = v.reshape(num_query_groups, -1, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int, head_dim: int):
    """Inverse of :func:`fuse_qkv`: megatron fused QKV -> (q, k, v) in HF row order."""
    tail = qkv.shape[1:]
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *tail)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def fuse_groups(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Row blocks of several HF tensors, each laid out group after group, -> one tensor with every
    group's blocks together: ``[p0_g0, p1_g0, ..., p0_g1, p1_g1, ...]`` (rows = dim 0)."""
    if any(p.shape[0] % groups for p in parts):
        raise ValueError(f"row counts {[p.shape[0] for p in parts]} do not split into {groups} groups")
    tail = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *tail) for p in parts], dim=1).reshape(-1, *tail)


def split_groups(fused: torch.Tensor, groups: int, rows_per_group: list[int]) -> list[torch.Tensor]:
    """Inverse of :func:`fuse_groups`: ``rows_per_group`` are each part's rows within one group."""
    tail = fused.shape[1:]
    pieces = torch.split(fused.reshape(groups, sum(rows_per_group), *tail), rows_per_group, dim=1)
    return [p.reshape(-1, *tail).contiguous() for p in pieces]


#: gated delta-net rule kinds: megatron holds every part per key-head group (see :func:`gdn_rows`)
GDN_KINDS = ("gdn_conv", "gdn_qkvz", "gdn_ba")


def gdn_rows(kind: str, gdn_dims) -> list[list[int]]:
    """Rows per key-head group of each part of a gated delta-net tensor, one list per HF tensor of the rule
    (each HF tensor holds its parts one after the other, each part head after head): ``gdn_conv``: ``conv1d``
    [q, k, v]; ``gdn_qkvz``: Qwen3.5's ``in_proj_qkv`` [q, k, v] and ``in_proj_z`` [z]; ``gdn_ba``: Qwen3.5's
    ``in_proj_b`` [b] and ``in_proj_a`` [a]. ``gdn_dims``: (key heads, value heads, key dim, value dim, ...)."""
    nk, nv, dk, dv = gdn_dims[:4]
    r = nv // nk
    return {"gdn_conv": [[dk, dk, r * dv]], "gdn_qkvz": [[dk, dk, r * dv], [r * dv]], "gdn_ba": [[r], [r]]}[kind]


def fuse_gdn(kind: str, tensors: list[torch.Tensor], gdn_dims) -> torch.Tensor:
    """Whole HF tensors of a gated delta-net rule -> the whole megatron tensor (every part per key-head group)."""
    nk, parts = gdn_dims[0], list[torch.Tensor]()
    for tensor, rows in zip(tensors, gdn_rows(kind, gdn_dims)):
        parts.extend(torch.split(tensor, [nk * r for r in rows]))
    return fuse_groups(parts, nk)


def split_gdn(kind: str, shard: torch.Tensor, groups: int, gdn_dims) -> list[torch.Tensor]:
    """A megatron shard of ``groups`` key-head groups -> its parts (each part's rows of every group)."""
    return split_groups(shard, groups, [r for rows in gdn_rows(kind, gdn_dims) for r in rows])


def join_gdn(kind: str, parts: list[torch.Tensor], gdn_dims) -> list[torch.Tensor]:
    """Whole parts (:func:`split_gdn` gathered over TP) -> the rule's HF tensors."""
    out, i = [], 0
    for rows in gdn_rows(kind, gdn_dims):
        out.append(torch.cat(parts[i:i + len(rows)]) if len(rows) > 1 else parts[i])
        i += len(rows)
    return out


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int,
                   head_dim: int) -> torch.Tensor:
    """HF gated attention (Qwen3-Next ``q_proj`` rows: per head ``[query (d); gate (d)]``), k, v -> megatron
    ``linear_qkv`` with ``attention_output_gate``: per query group ``[q heads, gate heads, k, v]``."""
    tail = q_gate.shape[1:]
    pairs = q_gate.reshape(num_query_groups, -1, 2, head_dim, *tail)  # [group, head, (query, gate), d]
    q, gate = pairs[:, :, 0].reshape(-1, *tail), pairs[:, :, 1].reshape(-1, *tail)
    return fuse_groups([q, gate, k, v], num_query_groups)


def split_gated_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int, head_dim: int):
    """Inverse of :func:`fuse_gated_qkv`: (q_proj with its gates, k, v) in HF row order."""
    hd = heads_per_group * head_dim
    q, gate, k, v = split_groups(qkv, num_query_groups, [hd, hd, head_dim, head_dim])
    tail = qkv.shape[1:]
    pairs = torch.stack([q.reshape(num_query_groups, heads_per_group, head_dim, *tail),
                         gate.reshape(num_query_groups, heads_per_group, head_dim, *tail)], dim=2)
    return pairs.reshape(-1, *tail).contiguous(), k, v


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj / up_proj -> megatron ``linear_fc1`` ([gate; up])."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor):
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def interleave_gate_up(fc1: torch.Tensor) -> torch.Tensor:
    """megatron ``[gate; up]`` rows (weight ``[2f, h]`` or bias ``[2f]``) -> HF gpt-oss's interleaved
    ``gate_up_proj`` layout transposed: row ``2j`` gate ``j``, row ``2j + 1`` up ``j``."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(fc1.shape)


def deinterleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


EXPERT_KINDS = ("expert_gate_up", "expert_gate_up_cat", "expert_row", "expert_down")
#: the kinds whose megatron parameter is a gated ``linear_fc1`` ``[gate; up]`` (each TP rank owns row blocks of both)
EXPERT_GATE_UP_KINDS = ("expert_gate_up", "expert_gate_up_cat")


def expert_to_megatron(kind: str, expert_slice: torch.Tensor) -> torch.Tensor:
    """One expert's slice of a stacked HF tensor (gpt-oss) -> the full megatron parameter.

    ``expert_gate_up``: ``gate_up_proj[e]`` ``[h, 2f]`` (or its bias ``[2f]``), gate / up interleaved
    -> ``linear_fc1`` ``[gate; up]`` ``[2f, h]``; ``expert_down``: ``down_proj[e]`` ``[f, h]`` ->
    ``linear_fc2`` ``[h, f]``; ``expert_row``: as is (a bias). ``expert_gate_up_cat`` (Qwen3-VL-MoE):
    ``gate_up_proj[e]`` ``[h, 2f]`` with gate in columns ``[:f]`` and up in ``[f:]`` -> its transpose."""
    if kind == "expert_gate_up":
        return deinterleave_gate_up(expert_slice.t() if expert_slice.dim() == 2 else expert_slice)
    if kind == "expert_gate_up_cat":
        return expert_slice.t()
    if kind == "expert_down":
        return expert_slice.t()
    return expert_slice


def megatron_to_expert(kind: str, full: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`expert_to_megatron` (contiguous)."""
    if kind == "expert_gate_up":
        rows = interleave_gate_up(full)
        return rows.t().contiguous() if rows.dim() == 2 else rows
    if kind in ("expert_down", "expert_gate_up_cat"):
        return full.t().contiguous()
    return full


#: separates a stacked HF tensor's name from the expert index of one slice of it during export
EXPERT_PIECE_SEP = "@expert"


def expert_piece_name(hf_name: str, expert: int) -> str:
    return f"{hf_name}{EXPERT_PIECE_SEP}{expert}"


def split_expert_piece_name(name: str) -> tuple[str, int] | None:
    """(stacked HF name, expert) of a piece name, None for an ordinary HF name."""
    if EXPERT_PIECE_SEP not in name:
        return None
    hf_name, expert = name.rsplit(EXPERT_PIECE_SEP, 1)
    return hf_name, int(expert)


def pad_vocab(weight: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows so ``weight`` has ``padded_vocab_size`` rows."""
    extra = padded_vocab_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocab {weight.shape[0]} is larger than the padded size {padded_vocab_size}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop megatron's padding rows."""
    return weight[:vocab_size].contiguous()


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round up to a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


# ------------------------------------------------------------ layer-spec names
@dataclass(frozen=True)
class LayerSpecNames:
    """Where one megatron layer spec keeps the per-layer norms (names relative to
    ``decoder.layers.{i}.``); every other parameter name is the same in all specs.

    Why a table: megatron's local spec has separate norm modules, while the
    transformer-engine spec fuses the input norm into ``linear_qkv``
    (``TELayerNormColumnParallelLinear``) and, on dense layers, the pre-MLP norm into
    ``linear_fc1``; MoE layers keep a separate ``TENorm`` because the experts' fc1
    cannot absorb it. A new spec is a new row here, not a branch in the bridge.
    The LayerNorm ``layer_norm_bias`` twins are absent on purpose: every family
    here is RMSNorm, so such a name is refused by the bridge as unmapped.
    """

    input_norm: str
    dense_pre_mlp_norm: str
    moe_pre_mlp_norm: str
    # multi-latent attention (MLA): its q down-projection cannot absorb the input norm, so TE keeps
    # a separate ``input_layernorm`` and fuses the q / kv latent norms into the up-projections
    mla_input_norm: str
    mla_q_norm: str
    mla_kv_norm: str


LAYER_SPEC_NAMES: dict[str, LayerSpecNames] = {
    "local": LayerSpecNames(input_norm="input_layernorm.weight",
                            dense_pre_mlp_norm="pre_mlp_layernorm.weight",
                            moe_pre_mlp_norm="pre_mlp_layernorm.weight",
                            mla_input_norm="input_layernorm.weight",
                            mla_q_norm="self_attention.q_layernorm.weight",
                            mla_kv_norm="self_attention.kv_layernorm.weight"),
    "transformer_engine": LayerSpecNames(input_norm="self_attention.linear_qkv.layer_norm_weight",
                                         dense_pre_mlp_norm="mlp.linear_fc1.layer_norm_weight",
                                         moe_pre_mlp_norm="pre_mlp_layernorm.weight",
                                         mla_input_norm="input_layernorm.weight",
                                         mla_q_norm="self_attention.linear_q_up_proj.layer_norm_weight",
                                         mla_kv_norm="self_attention.linear_kv_up_proj.layer_norm_weight"),
}

# TE modules keep FP8 scaling metadata in ``<module>._extra_state`` state-dict entries
# (e.g. ``self_attention.linear_qkv._extra_state``); no HF tensor corresponds to them.
EXTRA_STATE_SUFFIX = "._extra_state"


def is_extra_state(name: str) -> bool:
    """True for a TE ``_extra_state`` entry: skipped by every name map, both directions."""
    return name.endswith(EXTRA_STATE_SUFFIX)
