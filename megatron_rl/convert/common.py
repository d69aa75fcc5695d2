"""Shared pieces of the HF <-> torch_dist converters: dtypes, markers, rank-0 work, files.

The converted torch_dist dir (``convert_hf_to_dist``)::

    out/
      __0_0.distcp ... .metadata metadata.json common.pt   megatron-core torch_dist, key "model"
      hf_config/      config.json, tokenizer and generation files of the source
      COMPLETE.json   written last; format FORMAT, model fingerprint, dtype, files

``COMPLETE.json`` follows the training checkpoints' marker convention
(:mod:`megatron_rl.backends.megatron.checkpoint`: same file name, same
``model`` fingerprint fields, same ``files`` list with sizes and CRC-32) with its
own ``format`` value, because a converted dir holds a model and nothing else (no
optimizer, RNG or scheduler): a loader must treat it as "weights only".

An HF dir written by ``dist-to-hf`` gets a ``COMPLETE.json`` too (format
``HF_FORMAT``: source and every file with size and CRC-32, the shards' hashed as
they were written); ``hf-to-dist`` checks it when its input has one. HF tools
ignore the extra file.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.errors import CheckpointError

FORMAT = "megatron_rl.torch_dist_model.v1"
TRAINING_FORMAT = "megatron_rl.torch_dist.v1"  # backends.megatron.checkpoint.FORMAT
HF_FORMAT = "megatron_rl.hf_safetensors.v1"  # the marker of a dist-to-hf output
MARKER_NAME = "COMPLETE.json"
HF_CONFIG_SUBDIR = "hf_config"
FINGERPRINT_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                      "ffn_hidden_size", "vocab_size")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".part")
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


def fingerprint(bridge) -> dict:
    """The model-shape facts the training checkpoints record (``checkpoint.model_fingerprint``)."""
    return {"hidden_size": bridge.hidden_size, "num_layers": bridge.num_layers,
            "num_attention_heads": bridge.num_heads, "num_query_groups": bridge.num_query_groups,
            "ffn_hidden_size": int(bridge.cfg("intermediate_size")), "vocab_size": bridge.vocab_size}


def check_fingerprint(path: str, meta: dict, bridge, config_dir: str) -> None:
    saved = meta.get("model") or {}
    current = fingerprint(bridge)
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs config {current[k]!r}" for k in FINGERPRINT_FIELDS
            if k in saved and saved.get(k) != current[k]]
    if diff:
        raise CheckpointError(f"torch_dist checkpoint {path} is of a different model than {config_dir}/config.json "
                              f"({'; '.join(diff)}); pass --hf-config with the config it was converted/trained from")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank0_do(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0; if it fails there every rank raises (no rank waits forever in a barrier)."""
    err, result = None, None
    if rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank
            err = e if isinstance(e, CheckpointError) else CheckpointError(f"{what} failed: {type(e).__name__}: {e}")
    box = [None if err is None else str(err)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])
    return result


def all_ranks_ok(error: Optional[Exception]) -> None:
    """Collective: raise on every rank if any rank hit ``error`` (first message wins)."""
    msgs = [None if error is None else str(error)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, msgs[0])
        msgs = [m for m in gathered if m is not None] or [None]
    if msgs[0] is not None:
        raise CheckpointError(msgs[0])


def dist_checkpointing():
    """``megatron.core.dist_checkpointing`` with the CPU shim applied to its lazily imported strategies.

    Why: the compat shim rebinds ``torch.cuda`` calls only in megatron modules already
    imported; the torch_dist writer imports ``filesystem_async`` on first use.
    """
    import importlib
    import pkgutil

    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import strategies

    from megatron_rl.compat import apply_cpu_compat

    for info in pkgutil.iter_modules(strategies.__path__):
        try:
            importlib.import_module(f"{strategies.__name__}.{info.name}")
        except ImportError:  # optional backends (zarr, msc)
            pass
    apply_cpu_compat()
    return dc


def aux_files(hf_dir: str) -> list[str]:
    """Top-level non-weight files of an HF dir: config, tokenizer, generation config, templates."""
    out = []
    for name in sorted(os.listdir(hf_dir)):
        full = os.path.join(hf_dir, name)
        if not os.path.isfile(full) or name.startswith("."):
            continue
        if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json") or name == MARKER_NAME:
            continue
        out.append(name)
    return out


def copy_aux_files(src_dir: str, dst_dir: str, config_update: Optional[dict] = None) -> list[str]:
    """Copy :func:`aux_files` byte for byte; ``config_update`` rewrites keys of config.json."""
    os.makedirs(dst_dir, exist_ok=True)
    names = aux_files(src_dir)
    if "config.json" not in names:
        raise CheckpointError(f"no config.json in {src_dir}; pass an HF checkpoint dir (or --hf-config DIR)")
    for name in names:
        if name == "config.json" and config_update:
            with open(os.path.join(src_dir, name)) as f:
                cfg = json.load(f)
            cfg.update(config_update)
            with open(os.path.join(dst_dir, name), "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
                f.write("\n")
        else:
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    return names


def is_model_dir(path: Optional[str]) -> bool:
    """``path`` is a model-only torch_dist dir (written by ``convert_ckpt.py hf-to-dist``)
    rather than a training checkpoint root; ``--load`` then means the initial weights."""
    if not path:
        return False
    try:
        with open(os.path.join(path, MARKER_NAME)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_marker(path: str) -> dict:
    """``COMPLETE.json`` of a torch_dist dir; refuses incomplete / temp / corrupt dirs by name.

    Collective when ``torch.distributed`` is initialised: rank 0 checks (it reads every file
    for the checksums: once, not once per rank) and every rank gets its verdict."""
    return once_on_rank0(lambda: _read_marker(path), f"reading {path}")


def once_on_rank0(fn: Callable[[], Any], what: str) -> Any:
    """``fn()`` on rank 0, its result or its error (the same class when it is a CheckpointError)
    on every rank."""
    from megatron_rl.infra.checkpoint_root import CorruptCheckpoint

    box: list = [None, None, None]
    if rank() == 0:
        try:
            box[0] = fn()
        except CheckpointError as e:
            box[1], box[2] = isinstance(e, CorruptCheckpoint), str(e)
        except Exception as e:  # noqa: BLE001 - every rank must raise, not wait in a collective
            box[1], box[2] = False, f"{what} failed: {type(e).__name__}: {e}"
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[2] is not None:
        raise (CorruptCheckpoint if box[1] else CheckpointError)(box[2])
    return box[0]


def _read_marker(path: str) -> dict:
    from megatron_rl.infra.checkpoint_root import read_complete_marker

    return read_complete_marker(path, (FORMAT, TRAINING_FORMAT), "torch_dist checkpoint", {
        "temp": "convert a published dir",
        "root": "pass the root itself (its newest complete iter_* is used) or one iter_NNNNNNN dir",
        "unmarked": f"Re-run the conversion/save, or write {MARKER_NAME} by hand if you know the dir is complete",
        "json": "re-run the conversion",
        "format": f"this converter reads {FORMAT!r} and {TRAINING_FORMAT!r}",
        "files": "Re-run the conversion or restore the files"})


def check_hf_marker(hf_dir: str) -> Optional[dict]:
    """An HF input written by ``dist-to-hf`` (our ``COMPLETE.json`` with ``HF_FORMAT``): check every
    listed file's size and CRC-32, refusing damage by file name. Other HF dirs: None (nothing to check)."""
    from megatron_rl.infra.checkpoint_root import read_complete_marker

    try:
        with open(os.path.join(hf_dir, MARKER_NAME)) as f:
            fmt = json.load(f).get("format")
    except (OSError, ValueError, AttributeError):
        return None
    if fmt != HF_FORMAT:
        return None
    return read_complete_marker(hf_dir, (HF_FORMAT,), "HF checkpoint", {
        "temp": "convert a published dir", "root": "pass an HF dir", "unmarked": "",
        "json": "re-run dist-to-hf", "format": "", "files": "Re-run dist-to-hf or restore the files"})


def resolve_dist_dir(path: str) -> str:
    """A checkpoint ROOT (with ``iter_*`` dirs) -> the checkpoint auto-resume would take first
    (``resume_state.json``'s, else the newest complete one); any other dir as is."""
    from megatron_rl.infra.checkpoint_root import iter_dir, list_iterations, resume_candidates

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MARKER_NAME)) and list_iterations(path):
        candidates = resume_candidates(path)
        step = candidates[0] if candidates else None
        if step is None:
            raise CheckpointError(f"checkpoint root {path} has iter_* dirs but none is complete "
                                  f"(no {MARKER_NAME}); nothing to convert")
        return iter_dir(path, step)
    return path


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
    from megatron_rl.infra.checkpoint_root import temp_dir_for

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


def progress(total: Optional[int], desc: str, enabled: bool, unit: str = "tensor"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled or rank() != 0, dynamic_ncols=True,
                leave=False)
