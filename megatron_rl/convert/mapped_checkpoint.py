"""An HF checkpoint whose tensors are read as views of the shard files' pages, not copies.

Why: ``hf-to-dist`` writes most parameters unchanged (embedding, output head, norms, the
row-parallel projections) and only re-arranges the others (fused QKV, gate/up). Reading a tensor
with ``safetensors`` copies it into new memory first; here :meth:`MappedHFCheckpoint.read` maps
just the tensor's byte range of its file (private copy-on-write: an in-place op could never reach
the file) and returns a tensor over those pages. The inf/NaN check and the writer read the page
cache directly, so an unchanged tensor costs no memory of its own and no copy before it is written.

Each read maps its own range and the mapping lives as long as the tensor that views it (torch
keeps the buffer alive), so what the process holds is what the caller holds: one parameter at a
time in the streaming writer, as with copies.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

import torch

from megatron_rl.convert import file_views
from megatron_rl.errors import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint, check_finite

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class MappedHFCheckpoint(HFCheckpoint):
    """:class:`HFCheckpoint` (same checks, same refusals) whose :meth:`read` returns views of the file's pages."""

    def __init__(self, hf_dir: str | os.PathLike):
        super().__init__(hf_dir)
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, byte

    def _entry(self, name: str) -> tuple[str, torch.dtype, tuple[int, ...], int]:
        if name not in self._entries:
            self._handle(name)  # a name the checkpoint lacks is refused as HFCheckpoint refuses it
            self._read_header(self.file_of[name])
        return self._entries[name]

    def _read_header(self, fname: str) -> None:
        path = os.path.join(self.hf_dir, fname)
        with open(path, "rb") as f:  # safe_open checked the header at __init__: it parses and fits the file
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if e["dtype"] not in _DTYPES:
                raise CheckpointError(f"tensor {name!r} in {path} has dtype {e['dtype']}, which the converter does "
                                      "not read")
            self._entries[name] = (path, _DTYPES[e["dtype"]], tuple(e["shape"]), 8 + length + e["data_offsets"][0])

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """As :meth:`HFCheckpoint.read` (the whole tensor or ``[start:stop]`` along ``dim``, inf/NaN refused),
        as a view of the file's pages when the part is contiguous (whole, or rows along dim 0)."""
        path, dtype, shape, begin = self._entry(name)
        if dim not in (None, 0, 1):
            raise ValueError(f"slicing along dim {dim} is not supported")
        rows = range(shape[0])[start:stop] if dim == 0 and shape else range(shape[0] if shape else 1)
        row_numel = 1
        for s in shape[1:]:
            row_numel *= s
        out_shape = (len(rows), *shape[1:]) if shape else ()
        count = len(rows) * row_numel
        if count == 0:
            value = torch.empty(out_shape, dtype=dtype)
        else:
            item = torch.empty((), dtype=dtype).element_size()
            value = _map(path, begin + rows.start * row_numel * item, count, dtype).view(out_shape)
        if dim == 1:
            value = value[:, start:stop].contiguous()
        check_finite(name, value, path)
        return value


def _map(path: str, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset`` of ``path``, over a private mapping of just that range
    (known to the output writer, which copies such bytes from the file: :mod:`megatron_rl.convert.file_views`)."""
    return file_views.map_tensor(path, offset, count, dtype)
