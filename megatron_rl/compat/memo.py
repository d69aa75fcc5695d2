"""A one-entry memo keyed by object identity: derive once per micro-batch, reuse in every layer.

A packed (THD) forward hands every transformer layer the same ``PackedSeqParams``
and the same rotary ``freqs`` tensors; what the layers derive from them (RoPE rows
and their cos/sin, the attention's per-sequence buckets and index tensors) is the
same for q and k of all layers and for the backward's recompute. Deriving it once
instead of per layer is bitwise the same result and saves a few ms of small
ops and Python per forward on CPU.

Keys are compared with ``is`` for objects (tensors: the memo holds a reference,
so an id cannot be reused while the entry lives) and ``==`` for plain values.
One entry: a new micro-batch replaces the previous one, so nothing accumulates.
A key object must not be changed in place while it is a key (cu_seqlens and
rotary freqs never are: megatron builds them per micro-batch / caches them read-only).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence


class IdentityMemo:
    """``memo.get(objects, values, build)``: ``build()`` once per distinct (objects by identity, values)."""

    def __init__(self):
        self._objects: tuple = ()
        self._values: tuple = ()
        self._result: Any = None
        self.builds = 0  # how many times build() ran (tests check reuse)

    def get(self, objects: Sequence[Any], values: Sequence[Hashable], build: Callable[[], Any]) -> Any:
        objects, values = tuple(objects), tuple(values)
        if (len(objects) == len(self._objects) and all(a is b for a, b in zip(objects, self._objects))
                and values == self._values):
            return self._result
        result = build()  # a raising build leaves the previous entry as it was
        self._objects, self._values, self._result = objects, values, result
        self.builds += 1
        return result

    def clear(self) -> None:
        self._objects, self._values, self._result = (), (), None
