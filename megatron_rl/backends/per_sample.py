"""Per-sample per-token results (log-probs) from their holder ranks to every rank, as flat tensors.

Why not ``all_gather_object`` of a ``{sample: tensor}`` dict: pickling a few
hundred small tensors costs tens of milliseconds per call, even at world size 1.
Here the sample -> holder assignment and every sample's length are known on all
ranks (from the micro-batch plan and the samples), so only the values move:
each holder concatenates its samples' tensors in plan order and broadcasts that
one flat tensor (one ``broadcast`` per holder, i.e. per data-parallel rank;
world size 1: no collective, the local tensors are returned as they are). On
gloo CPU the broadcasts alone cost less than one ``all_gather`` of
equal-length padded rows (0.35 vs 0.40 ms at DP2, 0.33 vs 0.53 ms at TP2: only
real values move, no padding, no rows from non-holders;
benchmarks/data_movement.py). The values are copied, never recomputed or cast,
so results are bitwise those of the holders.

Which global rank holds which slot is fixed by the parallel layout: callers
find it once with ``find_holder_ranks`` and keep it. Each broadcast tensor is
``[flag, values...]`` (float32): ``flag`` is ``-2`` when the holder is missing
a sample or holds one of the wrong length; every rank then raises the same
``BackendError`` after the exchange rather than one rank raising and the
others waiting in the collective.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_rl.errors import BackendError

_SENT, _BROKEN_HOLDER = 0.0, -2.0


def _holder_values(local: dict[int, torch.Tensor], held: Sequence[int], sizes: list[int],
                   dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``[flag, values...]`` that one holder sends, or None when a sample is missing or of the wrong length."""
    if any(i not in local for i in held):
        return None
    pieces = [local[i] for i in held]
    if [p.numel() for p in pieces] != sizes:
        return None
    if any(p.dim() != 1 or p.dtype != dtype for p in pieces):
        pieces = [p.reshape(-1).to(dtype) for p in pieces]
    return torch.cat([torch.full((1,), _SENT, dtype=dtype), *pieces])


def _complain(local: dict[int, torch.Tensor], holdings: Sequence[Sequence[int]], slot: int,
              lengths: Sequence[int]) -> str:
    held = holdings[slot]
    missing = [i for i in held if i not in local]
    wrong = [i for i in held if i in local and local[i].numel() != lengths[i]]
    return (f"forward produced no log-probs for samples {missing[:8]}" if missing else
            f"forward produced log-probs of the wrong length for samples {wrong[:8]} "
            f"(expected their response lengths {[lengths[i] for i in wrong[:8]]})")


def find_holder_ranks(slot: Optional[int], num_holders: int, group=None) -> list[int]:
    """Global rank of each holder slot: one tiny all_gather (every rank of ``group`` calls it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [0] * num_holders
    world = dist.get_world_size(group)
    every = torch.empty(world, dtype=torch.int64)
    mine = torch.tensor([-1 if slot is None else slot], dtype=torch.int64)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine, group=group)
    ranks: dict[int, int] = {}
    for r, s in enumerate(every.tolist()):
        if s >= 0:
            ranks.setdefault(s, r if group is None else dist.get_global_rank(group, r))
    missing = [d for d in range(num_holders) if d not in ranks]
    if missing:
        raise BackendError(f"no rank holds per-sample results for data-parallel rank(s) {missing}; "
                           f"holders found: {ranks}")
    return [ranks[d] for d in range(num_holders)]


def gather_per_sample(local: dict[int, torch.Tensor], holdings: Sequence[Sequence[int]], holder_ranks: Sequence[int],
                      lengths: Sequence[int], group=None, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank gets ``[tensor of sample i for i in range(len(lengths))]`` (1-D, ``lengths[i]`` long).

    ``holdings[d]``: the samples holder ``d`` holds, in the order it sends them;
    every sample in exactly one holder. ``holder_ranks[d]``: holder ``d``'s global
    rank (``find_holder_ranks``). Every rank of ``group`` calls this with the
    same ``holdings``, ``holder_ranks`` and ``lengths``.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        if len(holdings) != 1:
            raise BackendError(f"a single rank must be the one holder of every sample ({len(holdings)} holders)")
        for i in holdings[0]:
            if i not in local or local[i].numel() != lengths[i]:
                raise BackendError(_complain(local, holdings, 0, lengths))
        return [local[i] for i in range(len(lengths))]
    me = dist.get_rank()
    out: list[tuple[int, torch.Tensor]] = []
    broken: list[int] = []
    for held, src in zip(holdings, holder_ranks):
        sizes = [lengths[i] for i in held]
        buf = _holder_values(local, held, sizes, dtype) if me == src else None
        if buf is None:  # a receiver, or a holder that lacks a sample: flag it, send the right size
            buf = torch.empty(1 + sum(sizes), dtype=dtype)
            if me == src:
                buf[0] = _BROKEN_HOLDER
        dist.broadcast(buf, src=src, group=group)
        if buf[0].item() == _BROKEN_HOLDER:
            broken.append(src)
            continue
        out.extend(zip(held, torch.split(buf[1:], sizes)))
    if broken:
        mine = me in broken and [d for d, r in enumerate(holder_ranks) if r == me]
        detail = _complain(local, holdings, mine[0], lengths) if mine else ""
        raise BackendError(f"per-sample results: holder rank(s) {broken} lack samples "
                           f"of their micro-batches{': ' + detail if detail else ''}")
    result: list[Optional[torch.Tensor]] = [None] * len(lengths)
    for i, t in out:
        result[i] = t
    present = [t for t in result if t is not None]
    if len(present) != len(result):
        missing = [i for i, t in enumerate(result) if t is None]
        raise BackendError(f"forward produced no log-probs for samples {missing[:8]} (no holder holds them)")
    return present


def share_with_peers(local: dict[int, torch.Tensor], held: Sequence[int], holder_rank: int, lengths: Sequence[int],
                     group=None, dtype: torch.dtype = torch.float32) -> list[Optional[torch.Tensor]]:
    """This data-parallel rank's samples from its holder to its model-parallel peers; None elsewhere.

    ``group``: the ranks sharing this DP index (None: this rank alone, no collective). One
    broadcast of ``[flag, values...]`` from ``holder_rank`` (global), as in ``gather_per_sample``,
    so a holder missing a sample makes every peer raise together. Used when each DP rank keeps
    the log-probs of exactly the samples it trains on (an owner-aligned forward): nothing
    crosses data-parallel ranks.
    """
    import torch.distributed as dist

    result: list[Optional[torch.Tensor]] = [None] * len(lengths)
    if group is None:
        for i in held:
            if i not in local or local[i].numel() != lengths[i]:
                raise BackendError(_complain(local, [held], 0, lengths))
            result[i] = local[i]
        return result
    sizes = [lengths[i] for i in held]
    me = dist.get_rank()
    buf = _holder_values(local, held, sizes, dtype) if me == holder_rank else None
    if buf is None:
        buf = torch.empty(1 + sum(sizes), dtype=dtype)
        if me == holder_rank:
            buf[0] = _BROKEN_HOLDER
    dist.broadcast(buf, src=holder_rank, group=group)
    if buf[0].item() == _BROKEN_HOLDER:
        detail = _complain(local, [held], 0, lengths) if me == holder_rank else ""
        raise BackendError(f"per-sample results: holder rank {holder_rank} lacks samples of its micro-batches"
                           f"{': ' + detail if detail else ''}")
    for i, t in zip(held, torch.split(buf[1:], sizes)):
        result[i] = t
    return result
