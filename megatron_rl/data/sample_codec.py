"""Rollout samples as one flat byte buffer: what ``broadcast_samples`` sends.

Why: ``broadcast_object_list`` pickles every ``Sample`` dataclass with its
short int lists; the numeric bulk (token ids, loss masks, rollout log-probs,
rewards, group indices, weight versions) is better moved as raw arrays, a
column per field. Everything else (finish reason, label, texts, metadata) goes
in a small pickled header, also column by column.

Invariant: ``decode(*encode(samples)) == samples`` exactly, field by field and
type by type. A column that does not fit the flat layout exactly (an id that
is not a plain ``int``, a log-prob that is not a plain ``float``, a tensor
where a list is expected, an id beyond int64) is pickled in the header as it
is, so the round trip never changes a value or its type.

Buffer (``uint8``): ``[flat blocks | pickled header]``, the two byte counts in
the ``int64`` tensor returned alongside. The header lists the flat blocks in
order (field, dtype, count); a list field is two blocks, its per-sample lengths
(int32) then the values of all samples back to back. Ids use int32 when they
fit (they nearly always do), else int64; floats are float64 (Python floats).
"""

from __future__ import annotations

import pickle
from dataclasses import fields
from itertools import accumulate, chain
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from megatron_rl.data.types import Sample

_FIELDS = tuple(f.name for f in fields(Sample))
_INT_SCALARS = ("group_index", "weight_version")
_FLOAT_SCALARS = ("reward",)
_INT_LISTS = ("prompt_ids", "response_ids", "loss_mask")
_FLOAT_LISTS = ("rollout_logprobs",)
_I32, _I64 = np.iinfo(np.int32), np.iinfo(np.int64)


def _only(values, kind: type) -> bool:
    return set(map(type, values)) <= {kind}  # C-level type scan; bool and numpy scalars do not pass


def _int_array(values: list) -> np.ndarray | None:
    if not values:
        return np.zeros(0, np.int32)
    lo, hi = min(values), max(values)
    if lo < _I64.min or hi > _I64.max:
        return None
    return np.array(values, np.int32 if _I32.min <= lo and hi <= _I32.max else np.int64)


def encode(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sizes, buffer)``: ``sizes`` = byte counts of the flat blocks and of the header."""
    rows = list(map(attrgetter(*_FIELDS), samples))
    columns = dict(zip(_FIELDS, map(list, zip(*rows)))) if rows else {name: [] for name in _FIELDS}
    blocks: list[np.ndarray] = []
    schema: list[tuple[str, str, int]] = []  # (field, dtype, count) of each block, in buffer order
    pickled: dict = {}

    def add(name: str, arr: np.ndarray) -> None:
        blocks.append(arr)
        schema.append((name, arr.dtype.str, arr.size))

    for name, col in columns.items():
        arr = None
        if name in _INT_SCALARS and _only(col, int):
            arr = _int_array(col)
        elif name in _FLOAT_SCALARS and _only(col, float):
            arr = np.array(col, np.float64)
        elif name in _INT_LISTS + _FLOAT_LISTS and _only(col, list):
            values = list(chain.from_iterable(col))
            if name in _INT_LISTS and _only(values, int):
                arr = _int_array(values)
            elif name in _FLOAT_LISTS and _only(values, float):
                arr = np.array(values, np.float64)
            if arr is not None:
                add(name + "#len", np.fromiter(map(len, col), np.int32, len(col)))
        if arr is None:
            pickled[name] = col
        else:
            add(name, arr)
    header = pickle.dumps((len(samples), schema, pickled), protocol=pickle.HIGHEST_PROTOCOL)
    payload = b"".join(a.tobytes() for a in blocks)
    sizes = torch.tensor([len(payload), len(header)], dtype=torch.int64)
    return sizes, torch.frombuffer(bytearray(payload + header), dtype=torch.uint8)


def decode(sizes: torch.Tensor, buffer: torch.Tensor) -> list[Sample]:
    """Inverse of ``encode`` (``sizes``/``buffer`` as it returned them, possibly received over a wire)."""
    n_payload, _ = sizes.tolist()
    raw = buffer.numpy()
    n, schema, columns = pickle.loads(raw[n_payload:].tobytes())
    pos, lengths = 0, {}
    for name, dtype, count in schema:
        arr = np.frombuffer(raw, np.dtype(dtype), count, pos)
        pos += arr.nbytes
        if name.endswith("#len"):
            lengths[name[:-4]] = arr.tolist()
            continue
        values = arr.tolist()
        if name in lengths:
            ends = list(accumulate(lengths[name]))
            values = [values[e - k:e] for e, k in zip(ends, lengths[name])]
        columns[name] = values
    if n == 0:
        return []
    return [Sample(*row) for row in zip(*(columns[name] for name in _FIELDS))]
