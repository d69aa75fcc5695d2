"""Context-parallel (CP) layout helpers for packed (THD) and padded (SBHD) batches.

Conventions (the same as megatron-core + transformer-engine, so one batch feeds
TE on GPUs and :class:`~megatron_rl.models.attention.PackedCoreAttention` on CPU):

* **Load-balanced chunking.** Every sequence of (padded) length ``L`` is cut into
  ``2 * cp_size`` equal chunks of ``c = L / (2 * cp_size)`` tokens. CP rank ``r``
  holds chunks ``r`` and ``2 * cp_size - 1 - r``, in that order, so every rank
  gets the same amount of causal-attention work. Hence every padded length must
  be a multiple of ``2 * cp_size`` (:func:`cp_pad_multiple`, :func:`pad_packed`).
* **Local THD layout.** A rank's packed tensor is, for each sequence in order,
  ``[chunk r | chunk 2cp-1-r]``; each sequence contributes ``L / cp_size`` tokens.
* **cu_seqlens stay GLOBAL.** ``PackedSeqParams`` under CP carries the cumulative
  lengths of the full (all-rank) padded sequences, exactly as megatron's THD RoPE
  (``(cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size``) and TE expect. If real
  lengths differ from padded ones, ``cu_seqlens_q`` holds the real lengths and
  ``cu_seqlens_q_padded`` the padded layout (TE's convention); if only
  ``cu_seqlens_q`` is set it is the padded layout and padding tokens are treated
  as ordinary tokens at the tail of their sequence (slime's convention; harmless
  under causal masking because padding comes last).
* **Gathered order.** An all-gather over the CP group concatenates rank-local
  tensors rank-major; :func:`cp_gather_permutation` maps that order back to the
  global packed order.

``cu_seqlens`` are 1-D integer tensors ``[num_seqs + 1]`` starting at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.errors import ConfigError

__all__ = [
    "CPShard",
    "cp_pad_multiple",
    "pad_packed",
    "cp_local_index",
    "cp_gather_permutation",
    "shard_packed_for_cp",
    "unshard_packed_from_cp",
    "gather_packed_from_cp",
    "shard_sbhd_for_cp",
    "all_gather_cp",
    "make_packed_seq_params",
]


def _check_cu_seqlens(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> list[int]:
    """Validate and return ``cu_seqlens`` as a Python list (one host sync)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ConfigError(f"{name} must be a 1-D integer tensor [num_seqs + 1], got "
                          f"{getattr(cu_seqlens, 'shape', type(cu_seqlens))}")
    if cu_seqlens.is_floating_point():
        raise ConfigError(f"{name} must be an integer tensor (int32/int64), got {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ConfigError(f"{name} must start at 0, got {cu[:4]}...")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ConfigError(f"{name} must be non-decreasing, got {cu}")
    return cu


def _check_cp(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ConfigError(f"need 0 <= cp_rank < cp_size (--context-parallel-size), got "
                          f"cp_rank={cp_rank}, cp_size={cp_size}")


def _check_divisible(cu: list[int], cp_size: int, name: str) -> None:
    bad = [(i, b - a) for i, (a, b) in enumerate(zip(cu, cu[1:])) if (b - a) % (2 * cp_size)]
    if bad:
        i, length = bad[0]
        raise ConfigError(
            f"{name}: sequence {i} has length {length}, not a multiple of 2*cp_size="
            f"{2 * cp_size} (--context-parallel-size {cp_size}); pad each sequence with "
            f"megatron_rl.models.cp_utils.pad_packed(..., multiple=cp_pad_multiple(...)) first")


def cp_pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """The multiple every sequence's length must be padded to.

    ``2 * cp_size`` for load-balanced CP chunking, times ``tp_size`` under
    sequence parallelism so every rank's local token count (``L / cp_size`` per
    sequence) also splits evenly over TP ranks.
    """
    if cp_size < 1 or tp_size < 1:
        raise ConfigError(f"cp_size and tp_size must be >= 1, got cp_size={cp_size}, tp_size={tp_size}")
    return (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1)


def pad_packed(tensor: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int, pad_value=0,
               dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every sequence of a packed tensor at its tail to a multiple of ``multiple``.

    Returns ``(padded_tensor, cu_seqlens_padded)``; ``cu_seqlens`` (real lengths)
    is unchanged and is what a loss mask or ``PackedSeqParams.cu_seqlens_q``
    should use. Zero-length sequences stay zero-length.
    """
    cu = _check_cu_seqlens(cu_seqlens)
    if multiple < 1:
        raise ConfigError(f"pad multiple must be >= 1, got {multiple}")
    if tensor.size(dim) != cu[-1]:
        raise ConfigError(f"packed tensor has {tensor.size(dim)} tokens on dim {dim} but "
                          f"cu_seqlens[-1]={cu[-1]}")
    pieces, cu_pad = [], [0]
    for a, b in zip(cu, cu[1:]):
        length = b - a
        padded = -(-length // multiple) * multiple
        pieces.append(tensor.narrow(dim, a, length))
        if padded > length:
            shape = list(tensor.shape)
            shape[dim] = padded - length
            pieces.append(torch.full(shape, pad_value, dtype=tensor.dtype, device=tensor.device))
        cu_pad.append(cu_pad[-1] + padded)
    out = torch.cat(pieces, dim=dim) if pieces else tensor
    return out, torch.tensor(cu_pad, dtype=cu_seqlens.dtype, device=cu_seqlens.device)


def cp_local_index(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global packed-token indices held by ``cp_rank``, in its local order (int64).

    For each sequence: chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``
    (with ``cp_size == 1``: every token, lengths unconstrained).
    """
    _check_cp(cp_rank, cp_size)
    cu = _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    device = cu_seqlens_padded.device
    if cp_size == 1:  # no chunking: any lengths, identity order
        return torch.arange(cu[-1], device=device)
    _check_divisible(cu, cp_size, "cu_seqlens_padded")
    cu_t = torch.tensor(cu, dtype=torch.int64, device=device)
    lengths = cu_t[1:] - cu_t[:-1]
    chunk = lengths // (2 * cp_size)
    local_len = 2 * chunk
    seq_of = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), local_len)
    local_start = torch.cumsum(local_len, 0) - local_len
    j = torch.arange(int(local_len.sum()), device=device) - local_start[seq_of]
    c = chunk[seq_of]
    second = j >= c
    chunk_id = torch.where(second, 2 * cp_size - 1 - cp_rank, cp_rank)
    return cu_t[:-1][seq_of] + chunk_id * c + (j - second.long() * c)


def cp_gather_permutation(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Index ``perm`` with ``gathered[perm] == global`` for a rank-major CP all-gather.

    ``gathered`` is ``cat([local_0, ..., local_{cp-1}])`` along the token dim.
    """
    held = torch.cat([cp_local_index(cu_seqlens_padded, r, cp_size) for r in range(cp_size)])
    return torch.argsort(held)


@dataclass(frozen=True)
class CPShard:
    """One CP rank's share of a packed batch.

    ``tensor``: the rank's tokens (``L_i / cp_size`` per sequence, local THD
    order). ``cu_seqlens_local``: cumulative local lengths (for per-rank
    bookkeeping only; PackedSeqParams keeps the GLOBAL cu_seqlens).
    ``position_ids``: each local token's position inside its full sequence
    (what RoPE must use). ``global_index``: each local token's index in the
    global packed tensor.
    """

    tensor: torch.Tensor
    cu_seqlens_local: torch.Tensor
    position_ids: torch.Tensor
    global_index: torch.Tensor


def shard_packed_for_cp(tensor: torch.Tensor, cu_seqlens: torch.Tensor, cp_rank: int, cp_size: int,
                        dim: int = 0) -> CPShard:
    """This rank's tokens of a packed tensor whose sequences are padded to ``2*cp_size``.

    ``cu_seqlens`` is the GLOBAL padded layout; ``tensor.size(dim) == cu_seqlens[-1]``.
    With ``cp_size == 1`` the shard is the whole tensor.
    """
    cu = _check_cu_seqlens(cu_seqlens)
    if tensor.size(dim) != cu[-1]:
        raise ConfigError(f"packed tensor has {tensor.size(dim)} tokens on dim {dim} but "
                          f"cu_seqlens[-1]={cu[-1]}; pass the global padded cu_seqlens")
    index = cp_local_index(cu_seqlens, cp_rank, cp_size)
    cu_t = cu_seqlens.to(torch.int64)
    cu_local = (cu_t // cp_size).to(cu_seqlens.dtype)
    seq_of = torch.searchsorted(cu_t[1:].to(index.device), index, right=True)
    position_ids = index - cu_t.to(index.device)[seq_of]
    local = tensor.index_select(dim, index.to(tensor.device))
    return CPShard(local, cu_local, position_ids, index)


def unshard_packed_from_cp(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor,
                           dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_packed_for_cp` given every rank's local tensor (rank order)."""
    cp_size = len(shards)
    perm = cp_gather_permutation(cu_seqlens, cp_size)
    gathered = torch.cat(list(shards), dim=dim)
    if gathered.size(dim) != perm.numel():
        raise ConfigError(f"CP shards hold {gathered.size(dim)} tokens in total but cu_seqlens[-1]="
                          f"{perm.numel()}")
    return gathered.index_select(dim, perm.to(gathered.device))


class _AllGatherCP(torch.autograd.Function):
    """All-gather along ``dim`` (rank-major); backward is a reduce-scatter.

    Every rank's output depends on every rank's input, so the gradient of a
    rank's input is the SUM over ranks of the gradient slices for its tokens.
    gloo has no reduce_scatter, so there we all-reduce and keep our slice (same
    values, twice the traffic).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, dim: int):
        ctx.group, ctx.dim = group, dim
        world = dist.get_world_size(group)
        ctx.world, ctx.rank = world, dist.get_rank(group)
        ctx.local = tensor.size(dim)
        if world == 1:
            return tensor.clone()
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.world == 1:
            return grad, None, None
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "gloo":
            dist.all_reduce(grad, group=ctx.group)
            out = grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous()
        else:
            moved = grad.movedim(ctx.dim, 0).contiguous()
            out = torch.empty((ctx.local,) + moved.shape[1:], dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, moved, group=ctx.group)
            out = out.movedim(0, ctx.dim)
        return out, None, None


def all_gather_cp(tensor: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Differentiable rank-major all-gather over ``group`` along ``dim``."""
    return _AllGatherCP.apply(tensor, group, dim)


def gather_packed_from_cp(local: torch.Tensor, cu_seqlens: torch.Tensor, cp_group=None,
                          dim: int = 0) -> torch.Tensor:
    """Reassemble full packed sequences (e.g. per-token log-probs) on every CP rank.

    Collective over ``cp_group`` (default: megatron's context-parallel group).
    Differentiable: if every rank then uses the full tensor, each rank's local
    gradient is the sum of all ranks' gradients for its tokens.
    """
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    cp_size = dist.get_world_size(cp_group)
    perm = cp_gather_permutation(cu_seqlens, cp_size)
    if local.size(dim) * cp_size != perm.numel():
        raise ConfigError(f"local tensor has {local.size(dim)} tokens on dim {dim}; expected "
                          f"cu_seqlens[-1] / cp_size = {perm.numel()} / {cp_size}")
    gathered = all_gather_cp(local, cp_group, dim)
    return gathered.index_select(dim, perm.to(gathered.device))


def shard_sbhd_for_cp(tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Padded-batch twin of :func:`shard_packed_for_cp` (megatron's ``get_batch_on_this_cp_rank``).

    The sequence dim (length divisible by ``2*cp_size``) keeps chunks
    ``cp_rank`` and ``2*cp_size-1-cp_rank``.
    """
    _check_cp(cp_rank, cp_size)
    s = tensor.size(seq_dim)
    if s % (2 * cp_size):
        raise ConfigError(f"sequence length {s} (dim {seq_dim}) is not a multiple of 2*cp_size="
                          f"{2 * cp_size}; pad the batch to a multiple of {2 * cp_size}")
    c = s // (2 * cp_size)
    return torch.cat([tensor.narrow(seq_dim, cp_rank * c, c),
                      tensor.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * c, c)], dim=seq_dim)


def make_packed_seq_params(cu_seqlens_padded: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None):
    """PackedSeqParams for a THD batch in megatron/TE's convention (GLOBAL cu_seqlens).

    ``cu_seqlens`` (real lengths) is optional; when given and different from the
    padded layout it goes to ``cu_seqlens_q/kv`` with the padded layout in
    ``cu_seqlens_*_padded``, otherwise the padded layout is used for both.
    ``max_seqlen_*`` is the longest PADDED (global) sequence, as TE expects.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_pad = cu_seqlens_padded.to(torch.int32)
    pad_list = _check_cu_seqlens(cu_pad, "cu_seqlens_padded")
    max_pad = max((b - a for a, b in zip(pad_list, pad_list[1:])), default=0)
    if cu_seqlens is None or torch.equal(cu_seqlens.to(torch.int32), cu_pad):
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_pad, cu_seqlens_kv=cu_pad,
                               max_seqlen_q=max_pad, max_seqlen_kv=max_pad)
    real = cu_seqlens.to(torch.int32)
    real_list = _check_cu_seqlens(real)
    if len(real_list) != len(pad_list):
        raise ConfigError(f"cu_seqlens has {len(real_list) - 1} sequences but cu_seqlens_padded has "
                          f"{len(pad_list) - 1}")
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                           cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                           max_seqlen_q=max_pad, max_seqlen_kv=max_pad)
