"""Rollout samples as one flat byte buffer: what ``broadcast_samples`` sends.

Why: pickling 256 ``Sample`` dataclasses (each with a few short int lists) to
every rank costs far more in Python than moving the same numbers as tensors.
The numeric bulk (token ids, loss masks, rollout log-probs, rewards and the
per-sample counts) travels as one int64 and one float64 block; everything else
(finish reason, label, texts, metadata) goes in a small pickled header.

Invariant: ``decode(encode(samples)) == samples`` exactly, field by field and
type by type. A field that does not fit the flat layout exactly (an id that is
not a plain ``int``, a log-prob that is not a plain ``float``, a tensor where a
list is expected) is carried in the header for that sample instead, so the
round trip never changes a value or its type.

Layout of the buffer (``uint8``): ``[ints (int64) | floats (float64) | header]``,
their byte sizes in the 3-entry ``int64`` tensor returned alongside. ``ints`` =
the sample count, then per sample ``group_index, weight_version`` and the
lengths of ``prompt_ids, response_ids, loss_mask, rollout_logprobs`` (-1 = in
the header), then the id/mask values of all samples back to back. ``floats`` =
every sample's ``reward``, then the rollout log-probs back to back.
"""

from __future__ import annotations

import pickle
from dataclasses import fields
from typing import Sequence

import torch

from megatron_rl.data.types import Sample

_INT_LISTS = ("prompt_ids", "response_ids", "loss_mask")
_FLOAT_LISTS = ("rollout_logprobs",)
_FLAT = {"group_index", "weight_version", "reward", *_INT_LISTS, *_FLOAT_LISTS}
_HEADER_FIELDS = tuple(f.name for f in fields(Sample) if f.name not in _FLAT)
_PER_SAMPLE = 2 + len(_INT_LISTS) + len(_FLOAT_LISTS)  # ints in the per-sample block
_ABSENT = -1  # a length of -1: the field is in this sample's header entry


def _all_of(values, kind: type) -> bool:
    return isinstance(values, list) and all(type(v) is kind for v in values)


def encode(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sizes, buffer)``: ``sizes`` = byte counts of the int, float and header blocks."""
    counts: list[int] = []
    values: list[int] = []
    rewards: list[float] = []
    floats: list[float] = []
    header: list[dict] = []
    for s in samples:
        extra = {name: getattr(s, name) for name in _HEADER_FIELDS}
        gi, wv = s.group_index, s.weight_version
        if type(gi) is int and type(wv) is int:
            counts += [gi, wv]
        else:
            counts += [0, 0]
            extra.update(group_index=gi, weight_version=wv)
        if type(s.reward) is float:
            rewards.append(s.reward)
        else:
            rewards.append(0.0)
            extra["reward"] = s.reward
        for name in _INT_LISTS:
            v = getattr(s, name)
            if _all_of(v, int):
                counts.append(len(v))
                values += v
            else:
                counts.append(_ABSENT)
                extra[name] = v
        for name in _FLOAT_LISTS:
            v = getattr(s, name)
            if _all_of(v, float):
                counts.append(len(v))
                floats += v
            else:
                counts.append(_ABSENT)
                extra[name] = v
        header.append(extra)
    ints = torch.tensor([len(samples), *counts, *values], dtype=torch.int64)
    flt = torch.tensor(rewards + floats, dtype=torch.float64)
    head = torch.frombuffer(bytearray(pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    blocks = [ints.view(torch.uint8), flt.view(torch.uint8), head]
    sizes = torch.tensor([b.numel() for b in blocks], dtype=torch.int64)
    return sizes, torch.cat(blocks)


def decode(sizes: torch.Tensor, buffer: torch.Tensor) -> list[Sample]:
    """Inverse of ``encode`` (``sizes``/``buffer`` as it returned them, possibly received over a wire)."""
    n_int, n_float, _ = sizes.tolist()
    ints = buffer[:n_int].view(torch.int64).tolist()
    floats = buffer[n_int:n_int + n_float].view(torch.float64).tolist()
    header = pickle.loads(buffer[n_int + n_float:].numpy().tobytes())
    n = ints[0]
    counts = ints[1:1 + n * _PER_SAMPLE]
    vpos = 1 + n * _PER_SAMPLE  # next unread id/mask value
    fpos = n  # the first n floats are the rewards
    out: list[Sample] = []
    for i in range(n):
        c = counts[i * _PER_SAMPLE:(i + 1) * _PER_SAMPLE]
        kw = {"group_index": c[0], "weight_version": c[1], "reward": floats[i]}
        for name, length in zip(_INT_LISTS, c[2:2 + len(_INT_LISTS)]):
            if length != _ABSENT:
                kw[name] = ints[vpos:vpos + length]
                vpos += length
        for name, length in zip(_FLOAT_LISTS, c[2 + len(_INT_LISTS):]):
            if length != _ABSENT:
                kw[name] = floats[fpos:fpos + length]
                fpos += length
        kw.update(header[i])  # header entries override the placeholders above
        out.append(Sample(**kw))
    return out
