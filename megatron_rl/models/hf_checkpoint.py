"""Read-only view of an HF safetensors checkpoint that serves slices.

Handles a sharded checkpoint (``model.safetensors.index.json``) or a single
``model.safetensors``. Only headers are read up front; :meth:`read` pulls exactly
the requested rows/columns through ``safe_open(...).get_slice``, so a rank never
materialises tensors it does not own.

Every floating tensor read is checked for inf/NaN as it is read (``models.finite.is_non_finite``, one
``aminmax`` pass over the values the read produced: no second pass over the files, no bool tensor
the size of the values), and refused naming the tensor and
its file (:class:`NonFiniteWeights`). Why here: this reader is the one place the trainer's
``--hf-checkpoint`` / ``--ref-load`` load and both converters take HF values from, and a NaN that
gets through surfaces only after step 0 as "NaN logits" far from its cause. A model loaded by
transformers instead (the embedded engine) is checked after its load with
:meth:`HFCheckpoint.refuse_non_finite_parameters`, by the same rule.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch
from safetensors import safe_open

from megatron_rl.errors import CheckpointError
from megatron_rl.models.finite import is_non_finite

log = logging.getLogger("megatron_rl")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NON_FINITE_FIX = ("the checkpoint is corrupt or was saved from a run whose weights diverged: re-download it, or "
                  "re-export it from an earlier training checkpoint (tools/convert_ckpt.py dist-to-hf / fsdp-to-hf)")


class NonFiniteWeights(CheckpointError):
    """A weight tensor holds inf or NaN: no model to train from, serve or convert."""


def check_finite(name: str, tensor: torch.Tensor, where: str, fix: str = NON_FINITE_FIX) -> None:
    """Refuse ``tensor`` (named ``name``, read from ``where``) if it is floating and holds inf/NaN.

    One ``aminmax`` pass over values already in memory (``isfinite(t).all()`` took the conversion's
    measured peak RSS to 111 MB, over its bound of the largest tensor + one bucket + 40 MB:
    tests/convert/test_streaming_save.py); the counts are computed only on failure."""
    if not is_non_finite(tensor):
        return
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    raise NonFiniteWeights(f"tensor {name!r} in {where} holds non-finite values ({nan} NaN, {inf} inf among "
                           f"{tensor.numel()} values read): {fix}")


class HFCheckpoint:
    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = os.fspath(hf_dir)
        index_path = os.path.join(self.hf_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f).get("weight_map")
            except (ValueError, AttributeError) as exc:
                raise CheckpointError(f"{index_path} is not a JSON object ({exc}): it is truncated or corrupt; "
                                      "re-download or re-save the checkpoint") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} has no 'weight_map'; re-save the checkpoint")
            self.file_of = dict(weight_map)
        elif os.path.isfile(os.path.join(self.hf_dir, SINGLE_FILE)):
            self.file_of = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {self.hf_dir}; pass an HF checkpoint "
                                  "directory saved with safe_serialization=True")
        for fname in sorted(set(self.file_of.values())):
            if not os.path.isfile(os.path.join(self.hf_dir, fname)):
                raise CheckpointError(f"{INDEX_FILE} in {self.hf_dir} names missing shard {fname}")
            self._open(fname)  # every shard's header now: a truncated file is named at start-up, not mid-load
        self._handles: dict[str, object] = {}

    def _open(self, fname: str):
        """``safe_open`` of one shard; a truncated or corrupt file (safetensors checks that the header
        parses and that the file covers every tensor it lists) is a CheckpointError naming it."""
        path = os.path.join(self.hf_dir, fname)
        try:
            return safe_open(path, framework="pt")
        except Exception as exc:  # noqa: BLE001 - SafetensorError is not importable by a stable name
            raise CheckpointError(f"{path} ({os.path.getsize(path)} bytes) is not a readable safetensors file "
                                  f"({type(exc).__name__}: {exc}): it is truncated or corrupt; re-download or "
                                  "re-save the checkpoint") from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def _handle(self, name: str):
        if name not in self.file_of:
            raise CheckpointError(f"tensor {name!r} is not in the HF checkpoint {self.hf_dir}")
        fname = self.file_of[name]
        if fname not in self._handles:
            self._handles[fname] = self._open(fname)
        return self._handles[fname]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """The whole tensor, or ``[start:stop]`` along ``dim`` (0 or 1); inf/NaN in what was read is
        refused (:class:`NonFiniteWeights` naming the tensor and its file)."""
        sl = self._handle(name).get_slice(name)
        if dim is None:
            value = sl[:]
        elif dim == 0:
            value = sl[start:stop]
        elif dim == 1:
            value = sl[:, start:stop]
        else:
            raise ValueError(f"slicing along dim {dim} is not supported")
        check_finite(name, value, os.path.join(self.hf_dir, self.file_of[name]))
        return value

    def float_dtypes(self) -> dict[str, list[str]]:
        """safetensors dtype code (``F32``, ``BF16``, ...) -> the floating tensors stored in it (headers only)."""
        out: dict[str, list[str]] = {}
        for name in sorted(self.file_of):
            code = self._handle(name).get_slice(name).get_dtype()
            if code.startswith(("F", "BF")):
                out.setdefault(code, []).append(name)
        return out

    def warn_mixed_dtypes(self, reader: str) -> None:
        """Warn (once per process and checkpoint) when its floating tensors are stored in more than one dtype,
        naming each minority dtype's tensors: ``reader`` casts each to its parameter dtype without a word
        (a float16 tensor in a float32 checkpoint trains at float16's precision and range), while
        tools/convert_ckpt.py refuses the same dir unless --dtype says which one. Some checkpoints mean it
        (a float32 router bias in a bfloat16 model): a warning, not a refusal."""
        key = os.path.realpath(self.hf_dir)
        if key in _MIXED_WARNED:
            return
        _MIXED_WARNED.add(key)
        groups = self.float_dtypes()
        if len(groups) < 2:
            return
        main = max(groups, key=lambda code: len(groups[code]))
        others = "; ".join(f"{len(names)} {code}: {names[:4]}{' ...' if len(names) > 4 else ''}"
                           for code, names in sorted(groups.items()) if code != main)
        log.warning("HF checkpoint %s mixes dtypes: %d tensor(s) are %s, but %s. %s casts each to its parameter "
                    "dtype (a tensor keeps only the precision and range it was stored with); tools/convert_ckpt.py "
                    "refuses this dir without --dtype. If this is not intended, re-save the checkpoint in one "
                    "dtype", self.hf_dir, len(groups[main]), main, others, reader)

    def refuse_non_finite_parameters(self, module: torch.nn.Module) -> None:
        """Refuse a model loaded from this checkpoint by another reader (transformers' ``from_pretrained``)
        whose parameters hold inf/NaN, naming the parameter and, where the name matches, its file; a
        checkpoint of mixed dtypes is warned (:meth:`warn_mixed_dtypes`)."""
        self.warn_mixed_dtypes("transformers' from_pretrained")
        for name, param in module.named_parameters():
            fname = self.file_of.get(name)
            check_finite(name, param.detach(), os.path.join(self.hf_dir, fname) if fname else
                         f"the model loaded from {self.hf_dir}")

    def close(self) -> None:
        self._handles.clear()


_MIXED_WARNED: set[str] = set()  # checkpoints warned about in this process (trainer and engine read one dir)

DIGEST_SAMPLES = 16  # evenly spaced 64 KiB reads of each file's data, beside its whole header
_SAMPLE_BYTES = 1 << 16


def weights_digest(hf_dir: str) -> str:
    """A fingerprint of an HF checkpoint's weights: sha256 over each safetensors file's name, size, whole header
    (every tensor's name, dtype, shape and offsets) and ``DIGEST_SAMPLES`` reads of 64 KiB spread over its data.

    Why not a hash of every byte: a LoRA run's adapter-only checkpoint records the base it was trained on
    (``--hf-checkpoint``) and a resume checks it, which must cost seconds for a 100 GB base, not minutes. Two
    different weights of one architecture (another fine-tune) differ in essentially every sampled read; a copy
    of the same files gives the same digest wherever it lies."""
    import hashlib

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors") and f != "adapter_model.safetensors")
    if not files:
        raise CheckpointError(f"{hf_dir} holds no *.safetensors weights to fingerprint")
    h = hashlib.sha256()
    for fname in files:
        path = os.path.join(hf_dir, fname)
        size = os.path.getsize(path)
        h.update(f"{fname}\0{size}\0".encode())
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(header_len))
            start = 8 + header_len
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(DIGEST_SAMPLES):
                fh.seek(start + span * i // max(DIGEST_SAMPLES - 1, 1))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()
