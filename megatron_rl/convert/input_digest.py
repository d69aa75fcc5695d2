"""The input check of ``dist-to-hf`` as the one pass over the input's bytes the conversion needs.

Why: ``dist-to-hf`` used to read every input byte three times in user space: the input check
(each listed file's CRC-32 against ``COMPLETE.json``, before anything is converted), the inf/NaN
check of each exported tensor, and the CRC-32 of each output shard's bytes (for the output's
``COMPLETE.json``). The bytes themselves move from the ``.distcp`` files into the HF shards with
``copy_file_range`` (:mod:`megatron_rl.convert.file_writer`), so those passes were most of what
the conversion did besides the copy, and the inf/NaN check faulted every chunk's mapped pages
into the process (the largest tensor's among them: the peak memory).

:class:`InputDigest` computes the input check's CRC-32s itself (the same values, the same
refusals: :func:`~megatron_rl.infra.checkpoint_root.listed_file_problems` calls it) and hashes a
``.distcp`` file in pieces: the bytes between model tensors' data plainly, and the data of every
model tensor chunk (its byte range inside the chunk's ``torch.save`` record, located by torch's own
zip reader as :mod:`~megatron_rl.convert.distcp_reader` does) on its own, with its values'
``aminmax`` (inf/NaN) taken block by block in the same pass, while the block is in the CPU cache.
The pieces' CRC-32s are combined into the file's (:func:`~megatron_rl.infra.crc32.crc32_combine`).
The conversion then asks :meth:`InputDigest.crc` for an output range that is a chunk's data (the
shard's CRC-32 without reading it) and :meth:`InputDigest.finite` whether a tensor's bytes lie in
chunks found finite (the inf/NaN check is then done). Anything not known here (a record torch's
reader cannot parse, a chunk with inf/NaN, bytes that are no chunk's) is checked and hashed by the
conversion as before; a chunk with inf/NaN is refused there, naming the HF tensor.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Optional

import torch

from megatron_rl.convert import file_views
from megatron_rl.convert.distcp_reader import record_reader
from megatron_rl.infra.checkpoint_root import crc32_hex
from megatron_rl.infra.crc32 import crc32, crc32_combine

WINDOW = 16 << 20  # bytes of a file mapped at a time (a multiple of the mapping granularity): the pass's memory
BLOCK = 1 << 20  # bytes hashed and then range-checked together (they are still in the CPU's L2 for the second)
_SMALL = 1 << 16  # spans below this are read with pread rather than mapped
_CHECKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Chunk(NamedTuple):
    """A model tensor chunk's data in a ``.distcp`` file: ``nbytes`` at ``start``, values of ``dtype``."""
    start: int
    nbytes: int
    dtype: torch.dtype


class ChunkDigest(NamedTuple):
    start: int
    nbytes: int
    dtype: torch.dtype
    crc: int
    finite: Optional[bool]  # None: not checked (a dtype aminmax does not cover)


def _key(path: str) -> str:
    return os.path.normpath(path)


class InputDigest:
    """The CRC-32s of a torch_dist dir's files for its input check, and what the pass learnt of each model chunk.

    ``file_crcs`` is the ``crc_of`` of :func:`~megatron_rl.infra.checkpoint_root.listed_file_problems`."""

    def __init__(self, dist_dir: str, model_key_roots: tuple[str, ...]):
        self.dist_dir = dist_dir
        self._roots = model_key_roots
        self._chunks: dict[str, list[ChunkDigest]] = {}  # file -> its chunks' digests, by start
        self._starts: dict[str, list[int]] = {}

    # -- the input check --
    def file_crcs(self, paths: list[str]) -> list[str]:
        """CRC-32 (hex) of each file, the model chunks of ``.distcp`` files digested on the way (on up to 8
        threads: the CRC-32, the page faults and ``aminmax`` release the GIL)."""
        plan = _plan(self.dist_dir, self._roots)
        jobs = [(p, plan.get(_key(p), [])) for p in paths]
        workers = min(8, os.cpu_count() or 1, len(jobs))
        if workers <= 1:
            results = [_digest_file(p, chunks) for p, chunks in jobs]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="input-digest") as pool:
                results = list(pool.map(lambda job: _digest_file(*job), jobs))
        for p, (_, digests) in zip(paths, results):
            if digests:
                self._chunks[_key(p)] = digests
                self._starts[_key(p)] = [d.start for d in digests]
        return [crc32_hex(crc) for crc, _ in results]

    # -- what the conversion asks --
    def _chunk_of(self, r: file_views.FileRange) -> Optional[ChunkDigest]:
        key = _key(r.path)
        starts = self._starts.get(key)
        if not starts:
            return None
        i = bisect.bisect_right(starts, r.offset) - 1
        if i < 0:
            return None
        d = self._chunks[key][i]
        return d if r.offset + r.nbytes <= d.start + d.nbytes else None

    def crc(self, r: file_views.FileRange) -> Optional[int]:
        """The CRC-32 of ``r`` when it is exactly one chunk's data, else None."""
        d = self._chunk_of(r)
        return d.crc if d is not None and (d.start, d.nbytes) == (r.offset, r.nbytes) else None

    def finite(self, t: torch.Tensor) -> bool:
        """True when ``t``'s bytes are (rows of) chunks this pass found free of inf/NaN, read as the same dtype;
        False when that is not known (the caller checks the values)."""
        ranges = file_views.tensor_file_ranges(t)
        if not ranges:
            return False
        item = t.element_size()
        for r in ranges:
            d = self._chunk_of(r)
            if d is None or d.finite is not True or d.dtype != t.dtype or (r.offset - d.start) % item:
                return False
        return True


def _plan(dist_dir: str, roots: tuple[str, ...]) -> dict[str, list[Chunk]]:
    """Each ``.distcp`` file's model tensor chunks (data range, dtype) from the dir's ``.metadata`` and the
    records' zip directories; {} when the ``.metadata`` cannot be read (the files are then hashed plainly and
    the conversion reports the problem). A record the zip reader refuses is left out (hashed plainly)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(dist_dir).read_metadata()
    except Exception:  # noqa: BLE001 - damage is named by the CRC-32 check or by the conversion's own read
        return {}
    sizes = {(key, tuple(c.offsets)): tuple(c.sizes)
             for key, md in metadata.state_dict_metadata.items() for c in getattr(md, "chunks", ())}
    per_file: dict[str, list[tuple[int, int, torch.dtype, int]]] = {}
    for index, info in metadata.storage_data.items():
        if index.offset is None or getattr(info, "transform_descriptors", None) or not index.fqn.startswith(roots):
            continue
        shape = sizes.get((index.fqn, tuple(index.offset)))
        dtype = getattr(getattr(metadata.state_dict_metadata.get(index.fqn), "properties", None), "dtype", None)
        if shape is None or not isinstance(dtype, torch.dtype):
            continue
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        per_file.setdefault(_key(os.path.join(dist_dir, info.relative_path)), []).append(
            (info.offset, info.length, dtype, nbytes))
    plan: dict[str, list[Chunk]] = {}
    for path, records in per_file.items():
        try:
            with open(path, "rb") as f:
                chunks = [c for c in (_locate(f, *r) for r in records) if c is not None]
        except OSError:
            continue
        chunks.sort()
        kept: list[Chunk] = []
        for c in chunks:  # records never overlap; if they seem to, the later one is hashed plainly
            if not kept or c.start >= kept[-1].start + kept[-1].nbytes:
                kept.append(c)
        plan[path] = kept
    return plan


def _locate(file, offset: int, length: int, dtype: torch.dtype, nbytes: int) -> Optional[Chunk]:
    """Where the tensor data of the ``torch.save`` record at ``[offset, offset + length)`` is (its one storage
    record, of ``nbytes``); None when the record is not that (or torch's zip reader refuses it)."""
    try:
        reader = record_reader(file, offset, length)
        data = [n for n in reader.get_all_records() if n.startswith("data/")]
        if len(data) != 1 or reader.get_record_size(data[0]) != nbytes:
            return None
        at = reader.get_record_offset(data[0])
    except Exception:  # noqa: BLE001 - a torn record: hashed plainly, the CRC-32 check names the file
        return None
    if at < 0 or at + nbytes > length or not nbytes:
        return None
    return Chunk(offset + at, nbytes, dtype)


def _digest_file(path: str, chunks: list[Chunk]) -> tuple[int, list[ChunkDigest]]:
    """(the file's CRC-32, a digest per chunk), reading the file once."""
    digests: list[ChunkDigest] = []
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        crc, pos = 0, 0
        for c in chunks:
            if c.start + c.nbytes > size:
                break  # a truncated file: the size check names it; the rest is hashed plainly
            crc = _hash_span(fd, pos, c.start, crc)
            value, finite = _hash_values(fd, c)
            crc = crc32_combine(crc, value, c.nbytes)
            digests.append(ChunkDigest(c.start, c.nbytes, c.dtype, value, finite))
            pos = c.start + c.nbytes
        crc = _hash_span(fd, pos, size, crc)
    return crc, digests


def _windows(fd: int, start: int, end: int):
    """``(mapping, offset of start in it, bytes)`` covering ``[start, end)`` of ``fd`` a ``WINDOW`` at a time."""
    at = start
    while at < end:
        base = at - at % mmap.ALLOCATIONGRANULARITY
        n = min(end - at, WINDOW)
        pages = mmap.mmap(fd, at - base + n, access=mmap.ACCESS_COPY, offset=base)  # ACCESS_COPY: frombuffer writable
        try:
            yield pages, at - base, n
        finally:
            pages.close()
        at += n


def _hash_span(fd: int, start: int, end: int, crc: int) -> int:
    if end - start < _SMALL:
        return crc32(os.pread(fd, end - start, start), crc) if end > start else crc
    for pages, at, n in _windows(fd, start, end):
        with memoryview(pages) as view:
            crc = crc32(view[at:at + n], crc)
    return crc


def _hash_values(fd: int, c: Chunk) -> tuple[int, Optional[bool]]:
    """CRC-32 of the chunk's data (from 0) and whether its values are all finite (None: dtype not checked)."""
    check = c.dtype in _CHECKED_DTYPES
    item = torch.empty((), dtype=c.dtype).element_size()
    crc, finite = 0, True
    for pages, at, n in _windows(fd, c.start, c.start + c.nbytes):
        values = torch.frombuffer(pages, dtype=c.dtype, count=n // item, offset=at) if check and n % item == 0 \
            else None
        with memoryview(pages) as view:
            for b in range(0, n, BLOCK):
                m = min(BLOCK, n - b)
                crc = crc32(view[at + b:at + b + m], crc)
                if values is not None and finite:
                    lo, hi = torch.aminmax(values[b // item:(b + m) // item])
                    finite = math.isfinite(lo.item()) and math.isfinite(hi.item())
        del values  # before the mapping closes
    return crc, (finite if check else None)
