"""Tensors over mapped file ranges, and which file bytes a buffer still is.

Why: most of what a converter writes is bytes it read unchanged (an HF tensor into a torch_dist
chunk, a torch_dist chunk into an HF shard). :func:`map_range` maps such a range (private,
copy-on-write pages: an in-place op never reaches the file) and remembers where the pages came
from; :func:`file_range_of` then tells the output writer (:mod:`megatron_rl.convert.file_writer`)
that a buffer it is asked to write is ``nbytes`` at ``offset`` of ``path``, so it moves them with
``copy_file_range`` (one copy inside the kernel, what ``cp`` does) instead of from user memory.

A mapping is known only while it is alive (weak reference): its pages cannot be unmapped while the
tensor viewing them lives, so an address found here is still the file's bytes. The converters never
write into these tensors (values that change are new tensors), and the output's CRC-32 is computed
from the mapped pages themselves: a page changed in memory would show as a checksum mismatch of the
output, never as a silent difference.

An HF tensor that regroups rows of mapped pages (megatron's fused q/k/v split into HF's q, k and v,
a row block per query group) is not one range, but its rows are several: the export hands it on as a
:class:`FileRows` (those ranges, their CRC-32s, its shape and dtype) instead of copying the rows into a
new tensor, and the writer copies the ranges from the file; ``build()`` makes the tensor where its
values are needed.
"""

from __future__ import annotations

import bisect
import math
import mmap
import threading
import weakref
from typing import Callable, NamedTuple, Optional

import torch


class FileRange(NamedTuple):
    path: str
    offset: int
    nbytes: int


_lock = threading.Lock()
_starts: list[int] = []  # sorted base addresses of live mappings
_maps: dict[int, tuple[weakref.ref, str, int, int]] = {}  # base address -> (mmap, path, file offset, length)


class FileRows:
    """An HF tensor whose bytes are ranges of input files one after another (rows of a mapped parameter: q, k or
    v of a fused QKV), held as those ranges and their CRC-32s instead of a copy of the rows.

    Why: the copy was made only to be checked and hashed, and the writer then copied the same bytes from
    the file anyway; the input check covers the values (:meth:`InputDigest.finite
    <megatron_rl.convert.input_digest.InputDigest.finite>`) and the CRC-32s are taken from the mapped rows.
    ``shape``/``dtype``/``numel()``/``element_size()`` as a tensor's; :meth:`build` makes the tensor (a
    ``--dtype`` cast, a LoRA merge or an inf/NaN check need its values)."""

    __slots__ = ("shape", "dtype", "ranges", "crcs", "_build")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, ranges: list[FileRange], crcs: list[int],
                 build: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self.ranges, self.crcs, self._build = tuple(shape), dtype, list(ranges), list(crcs), \
            build

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def build(self) -> torch.Tensor:
        return self._build()


def _forget(start: int) -> None:
    with _lock:
        if start in _maps:
            del _maps[start]
            del _starts[bisect.bisect_left(_starts, start)]


def map_range(path: str, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` at ``offset`` of ``path`` as a uint8 tensor over a private mapping of that range (its storage is
    exactly those bytes, so ``torch.save`` of a view of it saves just them)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), offset - aligned + nbytes, access=mmap.ACCESS_COPY, offset=aligned)
    raw = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes, offset=offset - aligned)
    start = raw.data_ptr() - (offset - aligned)
    with _lock:
        _maps[start] = (weakref.ref(pages), path, aligned, len(pages))
        bisect.insort(_starts, start)
    weakref.finalize(pages, _forget, start)
    return raw


def map_tensor(path: str, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``path``, over a private mapping of just that range."""
    item = torch.empty((), dtype=dtype).element_size()
    return map_range(path, offset, count * item).view(dtype) if count else torch.empty(0, dtype=dtype)


def file_range_of(address: int, nbytes: int) -> Optional[FileRange]:
    """The file range the ``nbytes`` at ``address`` map, when they lie in one live mapping of :func:`map_range`."""
    if nbytes <= 0:
        return None
    with _lock:
        i = bisect.bisect_right(_starts, address) - 1
        if i < 0:
            return None
        start = _starts[i]
        ref, path, file_offset, length = _maps[start]
        if ref() is None or address + nbytes > start + length:
            return None
        return FileRange(path, file_offset + address - start, nbytes)


def tensor_file_range(t: torch.Tensor) -> Optional[FileRange]:
    """Where a contiguous CPU tensor's bytes are in a mapped file, or None (computed, copied, strided)."""
    if t.device.type != "cpu" or not t.is_contiguous() or not t.numel():
        return None
    return file_range_of(t.data_ptr(), t.numel() * t.element_size())


def tensor_file_ranges(t: "torch.Tensor | FileRows") -> Optional[list[FileRange]]:
    """The file ranges whose bytes, one after another, ``t`` holds: a :class:`FileRows`' ranges, a contiguous CPU
    tensor's mapped range (:func:`tensor_file_range`); None when neither."""
    if isinstance(t, FileRows):
        return list(t.ranges)
    one = tensor_file_range(t)
    return [one] if one is not None else None


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only ones too)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]) if view.nbytes else 0
