"""Core attention for megatron-core's local spec with packed (THD) sequences and CP.

megatron-core's local ``DotProductAttention`` refuses packed sequences and context
parallelism (both are TE-only). :class:`PackedCoreAttention` is a drop-in
``core_attention`` submodule (same constructor and forward signature) that does
both with ``torch.nn.functional.scaled_dot_product_attention``, so CPU runs and
GPUs without transformer-engine can train on packed RL batches.

Layouts (those ``Attention.forward`` hands to ``core_attention``):

* SBHD: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.
* THD (``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``,
  key/value ``[t, ng, hn]`` -> ``[t, np*hn]`` (``Attention`` reshapes to ``[t, 1, h]``).
* Multi-latent attention passes ``k_channels`` (query/key head size) and ``v_channels``
  (value head size, hence output ``hn``) when they differ.

Invariants:

* A token never attends across a sequence boundary of ``cu_seqlens``; under a
  causal mask it attends to positions ``<=`` its own position in its sequence.
* Under CP (``config.context_parallel_size > 1``) inputs follow megatron's
  load-balanced chunking and GLOBAL cu_seqlens (see :mod:`.cp_utils`); K/V are
  all-gathered over the CP group (backward: reduce-scatter) and each local query
  chunk is masked with its true global positions, so outputs and gradients equal
  the single-process result up to fp32 summation order.
* Padding rows (positions ``>= real length`` when ``cu_seqlens_q_padded`` is set)
  output exactly 0 and are never attended to.
* Sliding window (``config.window_size = (left, 0)`` on the layers ``window_attn_skip_freq`` marks):
  a query at position ``i`` attends to keys ``i - left .. i`` of its sequence only, in every layout
  (SBHD, THD, CP; positions are the true ones under CP). HF's ``sliding_window = W`` is ``left = W - 1``.
* Attention sinks (``config.softmax_type``): ``"learnable"`` holds one logit per head
  (``softmax_offset``, sharded over TP with the heads) that joins every row's softmax denominator and
  attends to nothing (gpt-oss ``sinks``); ``"off-by-one"`` is the same with a fixed logit 0. Such a
  layer runs an explicit fp32 softmax instead of SDPA (SDPA has no denominator term). Under CP each
  rank's queries see all keys, so the sink term needs nothing extra; a row with every key masked
  outputs 0 (all its weight is on the sink).
* Softmax in fp32 or better (SDPA accumulates in fp32 for bf16/fp16 on CPU);
  ``apply_query_key_layer_scaling`` is a numerical no-op here (megatron divides
  the scale by the layer number and multiplies it back inside the softmax).

Mask semantics for SBHD follow megatron: ``attention_mask`` is boolean with
``True`` = masked out, broadcastable to ``[b, np, sq, sk]``. For causal mask types
a given mask is combined with the causal mask (both apply). Causal with ``sq <
sk`` aligns queries to the last ``sq`` keys (KV-cache decode). Rows with every key
masked output 0 (megatron's ``-10000`` fill would give a uniform average).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_rl.errors import ConfigError
from megatron_rl.compat.memo import IdentityMemo
from megatron_rl.models import cp_utils

__all__ = ["PackedCoreAttention"]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class PackedCoreAttention(MegatronModule):
    """SDPA core attention with THD packing, GQA and context parallelism.

    Built by ``SelfAttention`` from a ``ModuleSpec`` exactly like
    ``DotProductAttention``; holds no parameters.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        # K/V are all-gathered whatever cp_comm_type names (p2p, a2a, ...): the
        # maths is identical, only the communication schedule differs on GPUs.
        self.cp_comm_type = cp_comm_type

        if config.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ConfigError(f"PackedCoreAttention: unknown softmax_type {config.softmax_type!r} "
                              "(vanilla, off-by-one or learnable)")
        # keys a query may see behind itself (None: all); layer_number is the global, 1-based one
        self.window_left: Optional[int] = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise ConfigError(f"PackedCoreAttention implements causal sliding windows only: window_size="
                                  f"{config.window_size} must be (left >= 0, 0)")
            self.window_left = int(left)

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        elif not hasattr(pg_collection, "tp"):
            raise ConfigError("PackedCoreAttention pg_collection must have a 'tp' process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None and config.context_parallel_size > 1:
            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        self.cp_size = cp_group.size() if cp_group is not None else 1
        if self.cp_size != config.context_parallel_size:
            raise ConfigError(f"context_parallel_size={config.context_parallel_size} "
                              f"(--context-parallel-size) but the CP process group has "
                              f"{self.cp_size} ranks; initialise parallel_state with the same value")

        tp_size = self.tp_group.size()
        # MLA: query/key heads of k_channels (no-RoPE + RoPE dims), value heads of v_channels
        k_channels = config.kv_channels if k_channels is None else k_channels
        v_channels = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp_size)
        self.hidden_size_per_attention_head = k_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        self.softmax_scale = (1.0 / math.sqrt(self.hidden_size_per_attention_head)
                              if softmax_scale is None else softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        # attention sinks: one softmax-denominator logit per local head (TP shards the heads)
        self.softmax_offset: Optional[Tensor]
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "learnable":
            offset = torch.nn.Parameter(torch.zeros(self.num_attention_heads_per_partition,
                                                    dtype=config.params_dtype))
            tensor_parallel.set_tensor_model_parallel_attributes(offset, is_parallel=True, dim=0, stride=1)
            self.register_parameter("softmax_offset", offset)
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.num_attention_heads_per_partition,
                                                               dtype=config.params_dtype), persistent=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The learnable sink logits, sharded over TP along the heads (as megatron's DotProductAttention)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def _window_keep(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[..., Mq, Mk] True where key position ``k_pos`` lies inside the window of ``q_pos``."""
        assert self.window_left is not None  # only called for a sliding-window layer
        return (q_pos[..., :, None] - k_pos[..., None, :]) <= self.window_left

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attention over SBHD or THD inputs; see the module docstring for layouts."""
        if attention_bias is not None:
            raise ConfigError("PackedCoreAttention does not support attention_bias; use the TE spec")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in _CAUSAL_TYPES
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self._forward(query, key, value, attention_mask, causal, dropout_p,
                                     packed_seq_params)
        return self._forward(query, key, value, attention_mask, causal, dropout_p, packed_seq_params)

    def _forward(self, query, key, value, attention_mask, causal, dropout_p, packed_seq_params):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_thd(query, key, value, causal, dropout_p, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format not in (None, "sbhd"):
            raise ConfigError(f"PackedSeqParams.qkv_format={packed_seq_params.qkv_format!r} is not "
                              f"supported; use 'thd' (packed) or 'sbhd'")
        if self.cp_size > 1:
            return self._forward_sbhd_cp(query, key, value, attention_mask, causal, dropout_p)
        return self._forward_sbhd(query, key, value, attention_mask, causal, dropout_p)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], is_causal: bool,
              dropout_p: float) -> Tensor:
        """SDPA on ``[..., heads, seq, dim]`` with GQA; ``keep`` is True where attention is allowed."""
        if self.softmax_offset is not None:
            return self._attend_with_sinks(q, k, v, keep, is_causal, dropout_p)
        enable_gqa = q.size(-3) != k.size(-3)
        if keep is not None:
            # Rows with no allowed key must give 0, not NaN, in value and gradient: let them
            # see key 0 and zero their output afterwards.
            empty = ~keep.any(dim=-1, keepdim=True)
            if bool(empty.any()):
                first = torch.zeros_like(keep)
                first[..., 0] = True
                keep = keep | (empty & first)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                                     scale=self.softmax_scale, enable_gqa=enable_gqa)
                return out.masked_fill(empty, 0.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=self.softmax_scale,
                                              enable_gqa=enable_gqa)

    def _attend_with_sinks(self, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], is_causal: bool,
                           dropout_p: float) -> Tensor:
        """Softmax over [scores, sink logit] in fp32, the sink column dropped before ``@ v`` (as HF gpt-oss)."""
        assert self.softmax_offset is not None  # only called for a layer with sinks
        hq, hk = q.size(-3), k.size(-3)
        if hq != hk:  # GQA: query head h reads KV head h // (hq / hk), as SDPA's enable_gqa and HF's repeat_kv
            k, v = k.repeat_interleave(hq // hk, dim=-3), v.repeat_interleave(hq // hk, dim=-3)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
        if is_causal:
            keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        sink = self.softmax_offset.float().view(hq, 1, 1).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values.detach()
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs.to(v.dtype), v)

    def _forward_sbhd(self, query, key, value, attention_mask, causal, dropout_p):
        sq, sk = query.size(0), key.size(0)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        keep = None
        is_causal = causal and attention_mask is None and sq == sk and self.window_left is None
        q_pos, k_pos = torch.arange(sk - sq, sk, device=q.device), torch.arange(sk, device=q.device)
        if causal and not is_causal:
            keep = k_pos[None, :] <= q_pos[:, None]
        if self.window_left is not None:
            window = self._window_keep(q_pos, k_pos)
            keep = window if keep is None else (keep & window)
        if attention_mask is not None:
            allowed = ~attention_mask.to(torch.bool)
            keep = allowed if keep is None else (keep & allowed)
        out = self._sdpa(q, k, v, keep, is_causal, dropout_p)  # [b, np, sq, hn]
        return out.permute(2, 0, 1, 3).reshape(sq, query.size(1), self.hidden_size_per_partition)

    def _gather_kv(self, key: Tensor, value: Tensor, dim: int) -> tuple[Tensor, Tensor]:
        """One differentiable all-gather of K and V over the CP group (rank-major)."""
        kv = torch.cat([key, value], dim=-1)
        kv = cp_utils.all_gather_cp(kv, self.cp_group, dim)
        return kv.split([key.size(-1), value.size(-1)], dim=-1)

    def _forward_sbhd_cp(self, query, key, value, attention_mask, causal, dropout_p):
        if attention_mask is not None:
            raise ConfigError("PackedCoreAttention with context parallelism takes no attention_mask "
                              "for SBHD inputs (pass attention_mask=None with a causal/no_mask type, "
                              "or use packed THD sequences)")
        s_local, b = query.size(0), query.size(1)
        seq = s_local * self.cp_size
        if s_local % 2:
            raise ConfigError(f"local sequence length {s_local} under CP must be even (two chunks per "
                              f"rank); pad sequences to a multiple of 2*cp_size={2 * self.cp_size}")
        cu = torch.tensor([0, seq], dtype=torch.int64)
        key, value = self._gather_kv(key, value, dim=0)
        perm = cp_utils.cp_gather_permutation(cu, self.cp_size).to(key.device)
        key, value = key.index_select(0, perm), value.index_select(0, perm)
        q_pos = cp_utils.cp_local_index(cu, self.cp_group.rank(), self.cp_size).to(query.device)
        keep = None
        k_pos = torch.arange(seq, device=query.device)
        if causal:
            keep = k_pos[None, :] <= q_pos[:, None]
        if self.window_left is not None:
            window = self._window_keep(q_pos, k_pos)
            keep = window if keep is None else (keep & window)
        out = self._sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                         keep, False, dropout_p)
        return out.permute(2, 0, 1, 3).reshape(s_local, b, self.hidden_size_per_partition)

    def _forward_thd(self, query, key, value, causal, dropout_p, params: PackedSeqParams):
        cp_rank = self.cp_group.rank() if self.cp_group is not None and self.cp_size > 1 else 0
        # every layer (and the recompute of the backward) sees the same PackedSeqParams: its buckets and
        # index tensors are derived once per micro-batch
        # one memo per window: layers alternating sliding / full attention each reuse their plan
        memo = _THD_PLANS if self.window_left is None else _THD_PLANS_WINDOWED.setdefault(self.window_left,
                                                                                         IdentityMemo())
        plan = memo.get(
            (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded),
            (causal, self.cp_size, cp_rank, query.size(0), query.device, query.dtype),
            lambda: _plan_thd(params, causal, self.cp_size, cp_rank, query.size(0), query.device,
                              _key_block(query.device, query.dtype), self.window_left))
        if self.cp_size > 1:
            key, value = self._gather_kv(key, value, dim=0)
            key, value = key.index_select(0, plan.kv_perm), value.index_select(0, plan.kv_perm)
        if not plan.groups:
            return query.new_zeros(query.size(0), self.hidden_size_per_partition)
        # every local row picks its output from the groups' padded outputs in one gather (rows no
        # query attends from, e.g. CP padding, pick an appended zero row): one op per layer where
        # select-valid + cat + zeros + index_copy took four, the same values (copies of the same rows)
        padded = [self._attend_group(query, key, value, group, dropout_p) for group in plan.groups]
        if plan.zero_row:
            padded.append(query.new_zeros(1, self.hidden_size_per_partition))
        return (padded[0] if len(padded) == 1 else torch.cat(padded)).index_select(0, plan.src)

    def _attend_group(self, query, key, value, group: "_Group", dropout_p):
        """One SDPA call for a bucket of sequences, right-padded to the bucket's longest.

        Padded query rows are computed (and never picked); padded key slots repeat a
        real row and are masked out (causal masking alone excludes them when query and
        key positions coincide, i.e. without CP). Returns all ``[G * max_q, np*hn]``
        rows, sequence-major (``_THDPlan.src`` says which row each local row takes).
        """
        G, max_q, max_k = group.size, group.max_q, group.max_k

        def take(x, idx, m):  # [t, h, d] -> [G, h, m, d]
            return x.index_select(0, idx).view(G, m, x.size(1), x.size(2)).transpose(1, 2)

        q, k, v = take(query, group.q_idx, max_q), take(key, group.k_idx, max_k), take(value, group.k_idx, max_k)
        out = self._sdpa(q, k, v, group.keep, group.is_causal, dropout_p)  # [G, np, Mq, hn]
        return out.transpose(1, 2).reshape(G * max_q, self.hidden_size_per_partition)


class _Group(NamedTuple):
    """One SDPA call of a THD forward: which rows it reads and writes (see ``_plan_thd``)."""

    size: int  # sequences in the call
    max_q: int
    max_k: int
    q_idx: Tensor  # [size * max_q] local query rows, padded slots -> row 0
    k_idx: Tensor  # [size * max_k] key rows (after the CP gather), padded slots -> row 0
    keep: Optional[Tensor]  # [size, 1, max_q, max_k] allowed attention, or None (is_causal / no mask)
    is_causal: bool
    flat_valid: Tensor  # which of the size * max_q output rows are real queries (host: planning only)
    dest: Tensor  # their local row indices (host: planning only)


class _THDPlan(NamedTuple):
    groups: list
    src: Tensor  # [t_local]: the row of the groups' concatenated padded outputs each local row takes
    zero_row: bool  # some local rows attend from nothing (CP padding): they take a zero row appended last
    kv_perm: Optional[Tensor]  # CP: gathered K/V rows -> packed order


_THD_PLANS = IdentityMemo()
_THD_PLANS_WINDOWED: dict[int, IdentityMemo] = {}


def _plan_thd(params: PackedSeqParams, causal: bool, cp: int, cp_rank: int, t_local: int,
              device: torch.device, key_block: int = 1, window_left: Optional[int] = None) -> _THDPlan:
    """What a THD attention forward derives from ``cu_seqlens`` alone, checked and built once per micro-batch.

    ``key_block``: see :func:`_key_block` (1 = never pad keys beyond the longest sequence).
    ``window_left``: a sliding window (keys ``pos - window_left .. pos``); None: none.
    """
    cu_q = params.cu_seqlens_q
    if cu_q is None:
        raise ConfigError("PackedSeqParams(qkv_format='thd') needs cu_seqlens_q")
    cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv is not None else cu_q
    layout = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else cu_q
    layout_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else cu_kv
    if not ((cu_kv is cu_q or torch.equal(cu_q.cpu(), cu_kv.cpu()))
            and (layout_kv is layout or torch.equal(layout.cpu(), layout_kv.cpu()))):
        raise ConfigError("PackedCoreAttention implements self-attention only: cu_seqlens_q and "
                          "cu_seqlens_kv (and their _padded twins) must be equal")
    pad = layout.tolist()
    real = cu_q.tolist()
    if len(real) != len(pad):
        raise ConfigError(f"cu_seqlens_q has {len(real) - 1} sequences but cu_seqlens_q_padded has "
                          f"{len(pad) - 1}")
    lengths = [b - a for a, b in zip(pad, pad[1:])]
    valid = [b - a for a, b in zip(real, real[1:])]
    if any(v > p for v, p in zip(valid, lengths)):
        raise ConfigError(f"a real sequence length exceeds its padded length: real={valid}, "
                          f"padded={lengths} (cu_seqlens_q vs cu_seqlens_q_padded)")
    if t_local * cp != pad[-1]:
        raise ConfigError(
            f"THD query has {t_local} tokens on this rank but the GLOBAL padded cu_seqlens end at "
            f"{pad[-1]} with cp_size={cp}; expected {pad[-1]} / {cp} tokens (pass global "
            f"cu_seqlens and shard with megatron_rl.models.cp_utils.shard_packed_for_cp)")

    # (local q row start, n_q, key row start, n_k, first position of each chunk)
    if cp == 1:  # every real row is a query and, causal or not, sees the n_valid keys of its sequence at most
        segments = [(start - pad[0], n_valid, start, n_valid, None)
                    for start, n_valid in zip(pad, valid) if n_valid > 0]
    else:
        segments = _cp_segments(pad, lengths, valid, causal, cp, cp_rank)

    groups = [_plan_group(g, causal, cp, device, key_block, window_left) for g in _bucket(segments)]
    padded_rows = sum(g.size * g.max_q for g in groups)
    src = torch.full((t_local,), padded_rows, dtype=torch.long)  # default: the zero row after the groups
    offset = 0
    for g in groups:
        src[g.dest] = g.flat_valid + offset
        offset += g.size * g.max_q
    zero_row = bool((src == padded_rows).any())
    kv_perm = cp_utils.cp_gather_permutation(layout, cp).to(device) if cp > 1 else None
    return _THDPlan(groups, src.to(device), zero_row, kv_perm)


def _cp_segments(pad: list, lengths: list, valid: list, causal: bool, cp: int, cp_rank: int) -> list:
    """Segments of a CP rank: two chunks of each sequence (megatron's load-balanced layout), valid prefix only."""
    segments = []
    q_start = 0
    for i, (length, n_valid) in enumerate(zip(lengths, valid)):
        n_local = length // cp
        c = length // (2 * cp)
        chunks = (c, c * cp_rank, c * (2 * cp - 1 - cp_rank))
        # positions ascend over the local rows, so the valid rows are a prefix
        n_q = min(c, max(0, n_valid - chunks[1])) + min(c, max(0, n_valid - chunks[2]))
        if n_q > 0:
            last_pos = chunks[1] + n_q - 1 if n_q <= chunks[0] else chunks[2] + n_q - 1 - chunks[0]
            n_k = min(n_valid, last_pos + 1) if causal else n_valid
            segments.append((q_start, n_q, pad[i], n_k, chunks))
        q_start += n_local
    return segments


def _plan_group(group, causal: bool, cp: int, device: torch.device, key_block: int = 1,
                window_left: Optional[int] = None) -> _Group:
    n_q = torch.tensor([g[1] for g in group])
    n_k = torch.tensor([g[3] for g in group])
    max_q, max_k = int(n_q.max()), int(n_k.max())
    if cp == 1 and causal and max_q > 1:  # is_causal: a query never sees a key slot past its own position
        max_k = _padded_keys(max_k, key_block)
    ar_q, ar_k = torch.arange(max_q), torch.arange(max_k)
    q_valid = ar_q[None, :] < n_q[:, None]  # [G, Mq]
    k_valid = ar_k[None, :] < n_k[:, None]
    q_idx = torch.where(q_valid, torch.tensor([g[0] for g in group])[:, None] + ar_q, 0)
    k_idx = torch.where(k_valid, torch.tensor([g[2] for g in group])[:, None] + ar_k, 0)
    keep, is_causal = None, False
    uniform_k = bool((n_k == max_k).all())
    if cp == 1 and window_left is not None:  # queries and keys of a sequence share positions 0, 1, ...
        keep = k_valid[:, None, :] & ((ar_q[:, None] - ar_k[None, :]) <= window_left)[None]
        if causal:
            keep = keep & (ar_k[None, :] <= ar_q[:, None])[None]
        keep = keep[:, None]  # [G, 1, Mq, Mk]
    elif cp == 1:
        if causal:
            is_causal = max_q > 1
        elif not uniform_k:
            keep = k_valid[:, None, None, :]
    else:
        q_pos = torch.zeros(len(group), max_q, dtype=torch.long)
        for j, (_, nq, _, _, (c, first, second)) in enumerate(group):
            pos = torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])
            q_pos[j, :nq] = pos[:nq]
        keep = k_valid[:, None, :]
        if causal:
            keep = keep & (ar_k[None, None, :] <= q_pos[:, :, None])
        if window_left is not None:
            keep = keep & ((q_pos[:, :, None] - ar_k[None, None, :]) <= window_left)
        keep = keep[:, None]  # [G, 1, Mq, Mk]
    flat_valid = q_valid.flatten().nonzero().squeeze(1)
    return _Group(size=len(group), max_q=max_q, max_k=max_k, q_idx=q_idx.flatten().to(device),
                  k_idx=k_idx.flatten().to(device), keep=None if keep is None else keep.to(device),
                  is_causal=is_causal, flat_valid=flat_valid, dest=q_idx.flatten()[flat_valid])


def _padded_keys(n: int, block: int) -> int:
    """``n`` rounded up to a multiple of ``block`` when the tail fills at least half a block."""
    tail = n % block
    return n + block - tail if tail and 2 * tail >= block else n


@functools.lru_cache(maxsize=None)
def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _key_block(device: torch.device, dtype: torch.dtype) -> int:
    """How many key slots the SDPA kernel of ``device`` handles at full speed in one block.

    torch's CPU flash-attention kernel runs the key dimension in vector blocks and the rest
    of it one element at a time; with AVX-512 (16 floats) a float32 causal call over 11 keys
    takes 1.7x one over 16 (forward, 256 sequences, 4/2 heads of 16; forward + backward
    1.2x), and a tail of half a block or more is cheaper padded than run alone (measured
    from 1 to 130 keys; a tail under a quarter is dearer padded). Padded key slots repeat
    a real row and lie past every real query's position, so the causal mask drops them;
    only the summation order inside the kernel changes (results equal to ~1 ulp).
    Measured for float32 on AVX-512 only: elsewhere 1 (no padding).
    """
    if device.type == "cpu" and dtype == torch.float32 and _cpu_capability() == "AVX512":
        return 16
    return 1


def _bucket(segments, slack: float = 1.25, call_cost: int = 2048):
    """Group sequences into SDPA calls: padding waste for fewer kernel launches.

    Sorted by key length; a sequence joins the current bucket while the padded
    score area stays within ``slack`` x the real area plus ``call_cost`` score
    entries per sequence merged (the rough price of one extra SDPA call on CPU).
    Only speed depends on this, and values only to the kernel's rounding (a longer padded
    row sums its zero-weighted slots in another order: ~1 ulp).
    """
    order = sorted(segments, key=lambda g: (g[3], g[1]), reverse=True)
    buckets: list[list[tuple]] = []
    current: list[tuple] = []
    real_area, max_q = 0, 0
    for seg in order:
        if current:
            area = real_area + seg[1] * seg[3]
            grown_q = max(max_q, seg[1])
            if (len(current) + 1) * grown_q * current[0][3] <= slack * area + call_cost * len(current):
                current.append(seg)
                real_area, max_q = area, grown_q
                continue
            buckets.append(current)
        current, real_area, max_q = [seg], seg[1] * seg[3], seg[1]
    if current:
        buckets.append(current)
    return buckets
