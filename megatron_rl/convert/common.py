"""Pieces only the converters use: ``--dtype`` (and its cast's range check), dtype checks, the
``--output`` guard, telling checkpoint kinds apart (:func:`refuse_other_kind`).

What a model dir is (markers, formats, fingerprints, aux files) lives in
:mod:`megatron_rl.models.model_dir`, the megatron model <-> torch_dist I/O in
:mod:`megatron_rl.models.dist_io`: training reads the same dirs.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import MARKER_NAME, temp_dir_for
from megatron_rl.models.hf_checkpoint import check_finite
from megatron_rl.models.hf_module import DCP_FORMAT
from megatron_rl.models.model_dir import FORMAT, HF_FORMAT, TRAINING_FORMAT, is_model_dir

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """``--dtype``: None / "keep" keeps the source dtype; otherwise float32 / bfloat16 / float16."""
    if name is None or name == "keep":
        return None
    if name not in _DTYPES:
        raise CheckpointError(f"--dtype {name!r} is not supported; use keep, float32, bfloat16 or float16")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def uniform_dtype(dtypes: dict[str, torch.dtype], where: str) -> torch.dtype:
    """The one dtype of all tensors, or a refusal naming an example tensor per dtype."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, dt in sorted(dtypes.items()):
        by_dtype.setdefault(dt, []).append(name)
    if len(by_dtype) != 1:
        found = "; ".join(f"{dtype_name(dt)}: {len(ns)} tensor(s), e.g. {ns[:3]}" for dt, ns in by_dtype.items())
        raise CheckpointError(f"{where} mixes dtypes ({found}); pass --dtype float32|bfloat16|float16 to "
                              "convert everything to one")
    return next(iter(by_dtype))


def safetensors_dtypes(ckpt) -> dict[str, torch.dtype]:
    """Dtype of every tensor of an :class:`HFCheckpoint`, from the headers only."""
    out = {}
    for name in ckpt.names():
        code = ckpt._handle(name).get_slice(name).get_dtype()
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {ckpt.hf_dir} has dtype {code}; only F32/BF16/F16 "
                                  "checkpoints are converted")
        out[name] = _ST_DTYPES[code]
    return out


def cast_checked(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as ``dtype`` (itself when it already is), refusing finite values the cast turns into
    inf (``--dtype float16`` of weights beyond its range). The source was checked when it was read."""
    if tensor.dtype == dtype:
        return tensor
    out = tensor.to(dtype)
    check_finite(name, out, f"the output cast to --dtype {dtype_name(dtype)}",
                 fix=f"its values exceed the range of {dtype_name(dtype)}: use --dtype bfloat16 or float32")
    return out


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def check_output_dir(out_dir: str, inputs: dict[str, Optional[str]], overwrite: bool, kind: str) -> None:
    """Refuse, before anything is written or deleted, an ``--output`` whose replacement would lose data.

    ``inputs`` maps a flag (``--input``, ``--hf-config``) to the path it names. Paths are
    compared resolved (symlinks followed): the output may not equal, contain or lie inside
    an input, nor may its hidden temp sibling, which a run clears first. ``--overwrite``
    replaces only a previous conversion output of the same ``kind`` ("torch_dist": a
    converted dir with our marker; "hf": config.json plus safetensors) or an empty dir,
    never an unrelated directory or a file.
    """
    out = os.path.realpath(out_dir)
    tmp = os.path.realpath(temp_dir_for(out))
    for flag, given in inputs.items():
        if not given:
            continue
        src = os.path.realpath(given)
        if _within(src, out) or _within(out, src) or _within(src, tmp):
            how = ("is" if src == out else "contains" if _within(src, out) else
                   "lies inside" if _within(out, src) else "has a temp dir (cleared first) holding")
            raise CheckpointError(f"--output {out_dir} {how} {flag} {given} (resolved: output {out}, {flag} {src}); "
                                  "writing there would replace or change the input: choose an --output outside "
                                  f"{flag} and not above it")
    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise CheckpointError(f"output {out} exists; pass --overwrite to replace it or choose another --output")
    if not os.path.isdir(out):
        raise CheckpointError(f"--output {out_dir} exists and is not a directory; --overwrite replaces only a "
                              "previous conversion output: remove the file yourself or choose another --output")
    entries = sorted(os.listdir(out))
    if not entries:
        return
    if kind == "torch_dist":
        ours = is_model_dir(out)
        what = f"a torch_dist dir written by hf-to-dist ({MARKER_NAME} with format {FORMAT!r})"
    elif kind == "peft":
        ours = os.path.isfile(os.path.join(out, "adapter_config.json"))
        what = "a PEFT adapter dir (adapter_config.json)"
    else:
        ours = os.path.isfile(os.path.join(out, "config.json")) and (
            os.path.isfile(os.path.join(out, "model.safetensors")) or
            os.path.isfile(os.path.join(out, "model.safetensors.index.json")))
        what = "an HF model dir (config.json and model.safetensors[.index.json])"
    if not ours:
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise CheckpointError(f"--overwrite refuses to replace {out}: it is not a previous conversion output "
                              f"(expected {what}; it holds {shown}); remove or rename it yourself if it is "
                              "disposable, or choose another --output")


# COMPLETE.json format -> (what the dir is, the direction that reads it)
_KINDS = {FORMAT: ("a megatron torch_dist model dir written by hf-to-dist", "dist-to-hf"),
          TRAINING_FORMAT: ("a megatron torch_dist training checkpoint written by --train-backend megatron",
                            "dist-to-hf"),
          DCP_FORMAT: ("an fsdp training checkpoint (torch.distributed.checkpoint) written by --train-backend fsdp",
                       "fsdp-to-hf"),
          HF_FORMAT: ("an HF model dir written by dist-to-hf or fsdp-to-hf", "hf-to-dist")}


def marker_format(path: str) -> Optional[str]:
    """The ``format`` of ``path/COMPLETE.json`` without any other check; None if there is none."""
    try:
        with open(os.path.join(path, MARKER_NAME)) as f:
            fmt = json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        return None
    return fmt if isinstance(fmt, str) else None


def _is_plain_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        n.endswith(".safetensors") for n in os.listdir(path))


def refuse_other_kind(path: str, given: str, direction: str) -> None:
    """Refuse, naming the right direction, an ``--input`` that is another kind of checkpoint than
    ``direction`` reads. A megatron torch_dist and an fsdp checkpoint share the root layout and
    the marker's file name; only the marker's ``format`` tells them apart."""
    fmt = marker_format(path)
    if fmt in _KINDS:
        what, right = _KINDS[fmt]
        where = f"{MARKER_NAME} format {fmt!r}"
    elif fmt is None and direction != "hf-to-dist" and _is_plain_hf_dir(path):
        what, right, where = "an HF model dir", "hf-to-dist", "config.json and *.safetensors"
    else:
        return
    if right == direction:
        return
    if right == "hf-to-dist":
        raise CheckpointError(f"--input {given} is {what} ({where}): it is HF already, {direction} has nothing to "
                              f"convert (hf-to-dist converts it to torch_dist; --hf-checkpoint loads it as is)")
    raise CheckpointError(f"--input {given} is {what} ({where}), which {direction} does not read; convert it "
                          f"with: tools/convert_ckpt.py {right} --input {given} --output OUT")
