"""Number partitioning for batching: balanced k-way splits and bin packing.

Two primitives the packer composes:

* ``karmarkar_karp(weights, k)`` splits items into ``k`` parts with near-equal
  weight sums (the largest-differencing method generalised to k parts). Used to
  balance token counts across data-parallel ranks and to split an over-full
  micro-batch in two.
* ``first_fit_decreasing(weights, capacity)`` packs items into few bins that
  each hold at most ``capacity`` (11/9 OPT + 6/9 bins worst case). Used to cut
  one rank's samples into micro-batches under the token budget.

Both are pure, deterministic functions of their inputs (ties broken by item
index), so every rank that runs them on the same lengths gets the same plan
without communicating.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def karmarkar_karp(weights: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split item indices ``0..len(weights)-1`` into ``k`` parts with balanced weight sums.

    Each state is a k-tuple of partial partitions; the two states with the largest
    spread (max sum - min sum) are merged by pairing the heaviest part of one with
    the lightest of the other, which cancels their differences. With
    ``equal_size`` the initial states take ``k`` consecutive items of the sorted
    list, one per part, so part sizes differ by at most one (zero-weight phantom
    items fill the last state and are dropped).

    Returns ``k`` lists of indices, each sorted ascending; lists may be empty
    when there are fewer than ``k`` items. Order of the parts is deterministic
    (heaviest first, ties by smallest index).
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp needs k >= 1 parts, got k={k}")
    n = len(weights)
    if k == 1:
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (weights[i], i))
    # A state: list of k parts, each (sum, items). Phantom items have index -1.
    states: list[list[tuple[int, list[int]]]] = []
    if equal_size:
        phantoms = (-n) % k
        padded = [-1] * phantoms + order
        for start in range(0, len(padded), k):
            chunk = padded[start:start + k]
            states.append([(weights[i] if i >= 0 else 0, [i]) for i in chunk])
    else:
        for i in order:
            states.append([(weights[i], [i])] + [(0, []) for _ in range(k - 1)])

    def sort_parts(parts):
        # heaviest first; ties by items so the merge is deterministic
        return sorted(parts, key=lambda p: (-p[0], sorted(x for x in p[1] if x >= 0) or [n]))

    heap: list[tuple[int, int, list]] = []
    counter = 0
    for st in states:
        st = sort_parts(st)
        heapq.heappush(heap, (-(st[0][0] - st[-1][0]), counter, st))
        counter += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted heaviest-first: pair a's heaviest with b's lightest.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged = sort_parts(merged)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    final = heap[0][2] if heap else [(0, []) for _ in range(k)]
    parts = [sorted(i for i in items if i >= 0) for _, items in final]
    return parts


def first_fit_decreasing(weights: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack item indices into bins of total weight <= ``capacity``.

    Items are placed heaviest first (ties by index) into the first bin with room.
    Every weight must be <= capacity (the caller reports over-long items with
    the flag that sets the capacity). Returns bins as ascending index lists, in
    order of creation (so the first bin holds the heaviest item).
    """
    if capacity < 1:
        raise ValueError(f"first_fit_decreasing needs capacity >= 1, got {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        w = weights[i]
        if w > capacity:
            raise ValueError(f"item {i} has weight {w} > bin capacity {capacity}")
        for b, free in enumerate(room):
            if w <= free:
                bins[b].append(i)
                room[b] -= w
                break
        else:
            bins.append([i])
            room.append(capacity - w)
    return [sorted(b) for b in bins]


def refine_by_swaps(parts: list[list[int]], weights: Sequence[int], max_rounds: int = 64) -> list[list[int]]:
    """Improve a k-way split by swapping one item between the heaviest and lightest part.

    Each round swaps the pair (a from heaviest, b from lightest) whose weight
    difference is closest to half the gap, if that strictly shrinks the gap;
    part sizes are unchanged (so an equal-size split stays equal-size). Stops
    when no swap helps or after ``max_rounds``. Deterministic.
    """
    import bisect

    parts = [sorted(p) for p in parts]
    if len(parts) < 2:
        return parts
    for _ in range(max_rounds):
        sums = [sum(weights[i] for i in p) for p in parts]
        hi = max(range(len(parts)), key=lambda j: (sums[j], -j))
        lo = min(range(len(parts)), key=lambda j: (sums[j], j))
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        b_sorted = sorted(parts[lo], key=lambda i: (weights[i], i))
        b_w = [weights[i] for i in b_sorted]
        best = None  # (new_gap_between_the_two, a, b)
        for a in parts[hi]:
            want = weights[a] - gap / 2  # ideal weight of b
            pos = bisect.bisect_left(b_w, want)
            for q in (pos - 1, pos):
                if 0 <= q < len(b_sorted):
                    delta = weights[a] - b_w[q]
                    if 0 < delta < gap:
                        cand = (abs(gap - 2 * delta), a, b_sorted[q])
                        if best is None or cand < best:
                            best = cand
        if best is None:
            break
        _, a, b = best
        parts[hi].remove(a)
        parts[lo].remove(b)
        parts[hi] = sorted(parts[hi] + [b])
        parts[lo] = sorted(parts[lo] + [a])
    return parts
