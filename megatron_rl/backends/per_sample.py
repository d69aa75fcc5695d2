"""Per-sample per-token results (log-probs) from their holder ranks to every rank, as flat tensors.

Why not ``all_gather_object`` of a ``{sample: tensor}`` dict: pickling a few
hundred small tensors costs tens of milliseconds per call, even at world size 1.
Here the sample -> holder assignment and every sample's length are known on all
ranks (from the micro-batch plan and the samples), so only the values move:
each holder concatenates its samples' tensors in plan order into one row, rows
are padded to equal length and exchanged in ONE ``all_gather`` (world size 1:
no collective, the local tensors are returned as they are). The values are
copied, never recomputed or cast, so results are bitwise those of the holders.

Row layout (float32): ``[slot, values..., padding]``; ``slot`` is the holder's
index into ``holdings`` (a data-parallel rank), ``-1`` on ranks that hold
nothing, ``-2`` on a holder that is missing a sample or holds one of the wrong
length -- then every rank raises the same ``BackendError`` after the exchange
rather than one rank raising and the others waiting in the collective.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_rl.errors import BackendError

_NOT_A_HOLDER, _BROKEN_HOLDER = -1.0, -2.0


def _holder_row(local: dict[int, torch.Tensor], held: Sequence[int], lengths: Sequence[int],
                width: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    row = torch.zeros(width, dtype=dtype)
    pieces = [local.get(i) for i in held]
    if any(p is None or p.numel() != lengths[i] for i, p in zip(held, pieces)):
        return row, False
    if pieces:
        torch.cat([p.reshape(-1).to(dtype) for p in pieces], out=row[1:1 + sum(lengths[i] for i in held)])
    return row, True


def _complain(local: dict[int, torch.Tensor], holdings: Sequence[Sequence[int]], slot: int,
              lengths: Sequence[int]) -> str:
    held = holdings[slot]
    missing = [i for i in held if i not in local]
    wrong = [i for i in held if i in local and local[i].numel() != lengths[i]]
    return (f"forward produced no log-probs for samples {missing[:8]}" if missing else
            f"forward produced log-probs of the wrong length for samples {wrong[:8]} "
            f"(expected their response lengths {[lengths[i] for i in wrong[:8]]})")


def _all_gather_flat(output: torch.Tensor, row: torch.Tensor, group) -> None:
    import torch.distributed as dist

    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there); same collective
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, row, group=group)


def gather_per_sample(local: dict[int, torch.Tensor], holdings: Sequence[Sequence[int]], slot: Optional[int],
                      lengths: Sequence[int], group=None, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Every rank gets ``[tensor of sample i for i in range(len(lengths))]`` (1-D, ``lengths[i]`` long).

    ``holdings[d]``: the samples holder ``d`` holds, in the order it sends them;
    every sample in exactly one holder. ``slot``: this rank's holder index, or
    None if its ``local`` results are not the ones to send (e.g. a TP rank > 0).
    Every rank of ``group`` calls this with the same ``holdings`` and ``lengths``.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        if slot is None or len(holdings) != 1:
            raise BackendError(f"a single rank must be the one holder of every sample (holder {slot} of "
                               f"{len(holdings)})")
        for i in holdings[0]:
            if i not in local or local[i].numel() != lengths[i]:
                raise BackendError(_complain(local, holdings, 0, lengths))
        out = [local[i] for i in range(len(lengths))]
        return out
    width = 1 + max((sum(lengths[i] for i in held) for held in holdings), default=0)
    if slot is None:
        row, ok = torch.zeros(width, dtype=dtype), True
    else:
        row, ok = _holder_row(local, holdings[slot], lengths, width, dtype)
    row[0] = _NOT_A_HOLDER if slot is None else (slot if ok else _BROKEN_HOLDER)
    rows = torch.empty(world * width, dtype=dtype)  # gloo wants the output flat
    _all_gather_flat(rows, row, group)
    rows = rows.view(world, width)
    slots = rows[:, 0].tolist()
    broken = [r for r, s in enumerate(slots) if s == _BROKEN_HOLDER]
    if broken:
        detail = _complain(local, holdings, slot, lengths) if slot is not None and row[0] == _BROKEN_HOLDER else ""
        raise BackendError(f"per-sample results: holder rank(s) {broken} of the group lack samples "
                           f"of their micro-batches{': ' + detail if detail else ''}")
    out: list[Optional[torch.Tensor]] = [None] * len(lengths)
    seen: set[int] = set()
    for r, s in enumerate(slots):
        d = int(s)
        if d < 0 or d in seen:
            continue
        seen.add(d)
        held = holdings[d]
        pieces = torch.split(rows[r, 1:1 + sum(lengths[i] for i in held)], [lengths[i] for i in held])
        for i, piece in zip(held, pieces):
            out[i] = piece
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:
        raise BackendError(f"forward produced no log-probs for samples {missing[:8]} "
                           f"(no holder rank sent holder slot(s) {sorted(set(range(len(holdings))) - seen)})")
    return out  # type: ignore[return-value]
