"""Rollout samples as one flat byte buffer: what ``broadcast_samples`` and ``distribute_rollout`` send.

Why: ``broadcast_object_list`` pickles every ``Sample`` dataclass with its
short int lists; the numeric bulk (token ids, loss masks, rollout log-probs,
rewards, group indices, weight versions and per-token weight versions) is
better moved as raw arrays, a column per field. Everything else (finish reason,
label, texts, metadata) goes in a small pickled header, also column by column.

``SampleStub`` headers (``encode_headers``) carry no per-token versions: a rank
that does not train on a sample never reads them (``types._HELD_ELSEWHERE``).

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
from typing import Any, Sequence

import numpy as np
import torch

from megatron_rl.data.types import Sample, SampleStub

_FIELDS = tuple(f.name for f in fields(Sample))
_INT_SCALARS = ("group_index", "weight_version", "branch")
_FLOAT_SCALARS = ("reward",)
_INT_LISTS = ("prompt_ids", "response_ids", "loss_mask", "token_versions")
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


def _encode_columns(columns: dict[str, list], n: int, kinds: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat blocks for the columns whose values fit their kind (``kinds[name]``: int, float,
    int_list, float_list; others and misfits are pickled in the header as they are)."""
    blocks: list[np.ndarray] = []
    schema: list[tuple[str, str, int]] = []  # (field, dtype, count) of each block, in buffer order
    pickled: dict = {}

    def add(name: str, arr: np.ndarray) -> None:
        blocks.append(arr)
        schema.append((name, arr.dtype.str, arr.size))

    for name, col in columns.items():
        arr = None
        kind = kinds.get(name)
        if kind == "int" and _only(col, int):
            arr = _int_array(col)
        elif kind == "float" and _only(col, float):
            arr = np.array(col, np.float64)
        elif kind in ("int_list", "float_list") and _only(col, list):
            values = list(chain.from_iterable(col))
            if kind == "int_list" and _only(values, int):
                arr = _int_array(values)
            elif kind == "float_list" and _only(values, float):
                arr = np.array(values, np.float64)
            if arr is not None:
                add(name + "#len", np.fromiter(map(len, col), np.int32, len(col)))
        if arr is None:
            pickled[name] = col
        else:
            add(name, arr)
    header = pickle.dumps((n, schema, pickled), protocol=pickle.HIGHEST_PROTOCOL)
    payload = b"".join(a.tobytes() for a in blocks)
    sizes = torch.tensor([len(payload), len(header)], dtype=torch.int64)
    return sizes, torch.frombuffer(bytearray(payload + header), dtype=torch.uint8)


def _decode_columns(sizes: torch.Tensor, buffer: torch.Tensor) -> tuple[int, dict[str, list]]:
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
    return n, columns


_SAMPLE_KINDS = {**{f: "int" for f in _INT_SCALARS}, **{f: "float" for f in _FLOAT_SCALARS},
                 **{f: "int_list" for f in _INT_LISTS}, **{f: "float_list" for f in _FLOAT_LISTS}}


def encode(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sizes, buffer)``: ``sizes`` = byte counts of the flat blocks and of the header."""
    rows = list(map(attrgetter(*_FIELDS), samples))
    columns = dict(zip(_FIELDS, map(list, zip(*rows)))) if rows else {name: [] for name in _FIELDS}
    return _encode_columns(columns, len(samples), _SAMPLE_KINDS)


def decode(sizes: torch.Tensor, buffer: torch.Tensor) -> list[Sample]:
    """Inverse of ``encode`` (``sizes``/``buffer`` as it returned them, possibly received over a wire)."""
    n, columns = _decode_columns(sizes, buffer)
    if n == 0:
        return []
    return [Sample(*row) for row in zip(*(columns[name] for name in _FIELDS))]


# What every training rank needs of every sample (data.types.SampleStub, less the owner)
_HEADER_KINDS = {"group_index": "int", "prompt_length": "int", "response_length": "int",
                 "num_rollout_logprobs": "int", "reward": "float", "loss_mask": "int_list",
                 "reward_baseline": "float", "branch": "int"}


def encode_headers(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``SampleStub`` fields of every sample, in the same flat layout (about a tenth of the batch)."""
    columns: dict[str, list[Any]] = {"group_index": [s.group_index for s in samples],
               "prompt_length": [len(s.prompt_ids) for s in samples],
               "response_length": [len(s.response_ids) for s in samples],
               "num_rollout_logprobs": [len(s.rollout_logprobs) for s in samples],
               "reward": [s.reward for s in samples],
               "loss_mask": [s.loss_mask for s in samples],  # as stored: empty means all ones
               "reward_baseline": [s.reward_baseline for s in samples],  # None (pickled) unless ReMax
               "branch": [s.branch for s in samples]}
    return _encode_columns(columns, len(samples), _HEADER_KINDS)


def decode_headers(sizes: torch.Tensor, buffer: torch.Tensor, owners: Sequence[int] | None = None) -> list[SampleStub]:
    """``SampleStub``s from ``encode_headers``; ``owners[i]`` is sample i's DP rank (-1 until planned)."""
    n, columns = _decode_columns(sizes, buffer)
    owners = [-1] * n if owners is None else owners
    names = list(_HEADER_KINDS)
    rows = zip(*(columns[name] for name in names))
    return [SampleStub(**dict(zip(names, row)), owner=owner) for row, owner in zip(rows, owners)]
