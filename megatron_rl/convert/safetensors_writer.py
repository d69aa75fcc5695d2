"""Write HF safetensors shards while tensors stream in.

Why streaming: an export yields full HF tensors one (bucket) at a time; holding
them all before writing would make the peak memory the whole model again. The
writer keeps at most one shard (``max_shard_bytes``, HF's ``max_shard_size``
semantics: a shard is closed when the next tensor would overflow it; a tensor
bigger than the limit gets a shard of its own) and writes it as soon as it is
full. Shard file names need the total count (``model-00001-of-00003``), which is
only known at the end, so shards are written under ``.part`` names and renamed by
:meth:`finish`, which then writes ``model.safetensors.index.json``. Callers write
into a temporary directory and publish it (:func:`~megatron_rl.infra.atomic.publish_dir`),
so a half-written output never appears under the final name.

Shards are serialised by :func:`save_safetensors`, which writes each tensor's
bytes straight from its storage: ``safetensors.torch.save_file`` first copies
every tensor into a ``bytes`` object, doubling the shard in memory at flush.
It hashes the bytes as it writes them (CRC-32, :attr:`ShardedSafetensorsWriter.checksums`) and moves
them into the file through a pipe (:class:`~megatron_rl.convert.file_writer.FileWriter`),
so the output's ``COMPLETE.json`` gets every shard's checksum without reading the
shards back.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable, Optional

import torch

from megatron_rl.convert import file_views
from megatron_rl.convert.file_writer import FileWriter, fsync_later, wait_synced
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_json
from megatron_rl.infra.crc32 import crc32

INDEX_FILE = "model.safetensors.index.json"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, flag: str = "--max-shard-size") -> int:
    """``"5GB"`` / ``"500MiB"`` / ``"1000"`` -> bytes (HF's decimal units for ``GB``); errors name ``flag``."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise CheckpointError(f"{flag} {text!r} is not a size; use e.g. 5GB, 500MB, 2GiB or bytes")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise CheckpointError(f"{flag} must be positive, got {text!r}")
    return value


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor :func:`save_safetensors` writes from, holding little memory beyond its bytes.

    A contiguous view that covers at least half of its storage (one half of a fused gate/up, a
    slice of a parameter) is kept as it is: writing from it copies nothing, and what it keeps
    alive while its shard is pending is at most twice its bytes. A smaller view (e.g. of one
    broadcast bucket) is copied, so a pending shard never holds whole buckets."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or 2 * t.numel() * t.element_size() < t.untyped_storage().nbytes():
        t = t.contiguous().clone()
    return t


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class _FileBytes:
    """A tensor whose bytes are ranges of input files (:mod:`~megatron_rl.convert.file_views`: a mapped range, or
    the rows of a :class:`~megatron_rl.convert.file_views.FileRows`), held as those ranges and their CRC-32s
    instead of the tensor: the shard copies them from the files inside the kernel, and the pending shard keeps
    none of the tensor's memory."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], sources: list[file_views.FileRange],
                 crcs: list[int]):
        self.dtype, self.shape, self.sources, self.crcs = dtype, tuple(shape), sources, crcs

    @classmethod
    def of(cls, t: torch.Tensor, sources: list[file_views.FileRange],
           known_crc: Optional[Callable[[file_views.FileRange], Optional[int]]] = None) -> "_FileBytes":
        """``t``, whose bytes are ``sources``; each source's CRC-32 from ``known_crc`` where it knows it (the
        input check hashed that range), else hashed from ``t``'s bytes now."""
        raw = t.reshape(-1).view(torch.uint8).numpy().data
        crcs, at = [], 0
        for src in sources:
            crc = known_crc(src) if known_crc is not None else None
            crcs.append(crc if crc is not None else crc32(raw[at:at + src.nbytes]))
            at += src.nbytes
        return cls(t.dtype, tuple(t.shape), sources, crcs)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def save_safetensors(tensors: dict, path: str, metadata: Optional[dict] = None,
                     synced: Optional[list] = None) -> str:
    """Write a safetensors file (the documented format: u64-LE header length, JSON
    header with dtype / shape / data_offsets per tensor and ``__metadata__``, padded
    with spaces to 8 bytes, then the data) without copying the tensors; fsynced.
    Tensors must be contiguous CPU tensors (``_own_storage``), written from their own bytes, or
    :class:`_FileBytes`, copied from their file. ``synced``: a list the file's background fsync is added to
    (:func:`~megatron_rl.convert.file_writer.fsync_later`; the caller waits before publishing) instead of
    syncing before returning.
    Returns the file's CRC-32 (hex), computed from the bytes as they were written."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with FileWriter(path) as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for t in tensors.values():
            if isinstance(t, _FileBytes):
                for src, crc in zip(t.sources, t.crcs):
                    out.copy_range(src, crc)
            elif t.numel():
                out.write(t.reshape(-1).view(torch.uint8).numpy().data)  # the array's own memoryview
        if synced is None:
            os.fsync(out.fileno())
    if synced is not None:  # the caller waits for it (file_writer.wait_synced) before anything is published
        synced.append(fsync_later(path))
    return out.hexdigest


class ShardedSafetensorsWriter:
    """``add(name, tensor)`` until done, then ``finish()`` -> the index dict."""

    def __init__(self, out_dir: str, max_shard_bytes: int, metadata: Optional[dict] = None,
                 range_crc: Optional[Callable[[file_views.FileRange], Optional[int]]] = None):
        """``range_crc``: the CRC-32 of an input file range when known without reading it (None otherwise:
        :meth:`~megatron_rl.convert.input_digest.InputDigest.crc`), for tensors written from their files."""
        self.out_dir = out_dir
        self._range_crc = range_crc
        self.max_shard_bytes = int(max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._pending: dict[str, "torch.Tensor | _FileBytes"] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[str, list[str]]] = []  # (part file, names)
        self.total_bytes = 0
        self.peak_pending_bytes = 0
        self.checksums: dict[str, str] = {}  # file name (final after finish) -> CRC-32 hex
        self._synced: list = []  # each written shard's background fsync, waited for in finish()
        os.makedirs(out_dir, exist_ok=True)

    def add(self, name: str, tensor: "torch.Tensor | file_views.FileRows") -> None:
        if name in self._pending or any(name in names for _, names in self._parts):
            raise CheckpointError(f"tensor {name!r} was written twice; the export is inconsistent")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if isinstance(tensor, file_views.FileRows):
            self._pending[name] = _FileBytes(tensor.dtype, tensor.shape, tensor.ranges, tensor.crcs)
        else:
            source = file_views.tensor_file_range(tensor)
            self._pending[name] = _FileBytes.of(tensor, [source], self._range_crc) if source is not None \
                else _own_storage(tensor)
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)

    def _flush(self) -> None:
        if not self._pending:
            return
        part = f"model-{len(self._parts) + 1:05d}.safetensors.part"
        self.checksums[part] = save_safetensors(self._pending, os.path.join(self.out_dir, part),
                                                metadata=self.metadata, synced=self._synced)
        self._parts.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> dict:
        """Write the last shard, wait for every shard's fsync, give shards their final names, write the index."""
        self._flush()
        wait_synced(self._synced)
        if not self._parts:
            raise CheckpointError("no tensors were exported; nothing to write")
        n = len(self._parts)
        weight_map = {}
        for i, (part, names) in enumerate(self._parts, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, part), os.path.join(self.out_dir, final))
            self.checksums[final] = self.checksums.pop(part)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_json(os.path.join(self.out_dir, INDEX_FILE), index)
        return index
