"""Pieces only the HF <-> torch_dist converters use: ``--dtype``, dtype checks, the ``--output`` guard.

What a model dir is (markers, formats, fingerprints, aux files) lives in
:mod:`megatron_rl.models.model_dir`, the megatron model <-> torch_dist I/O in
:mod:`megatron_rl.models.dist_io`: training reads the same dirs.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import MARKER_NAME, temp_dir_for
from megatron_rl.models.model_dir import FORMAT, is_model_dir

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

