"""What a model directory on disk is, and how to check one before reading it.

Used alike by training (``--load`` of a model-only dir, ``--ref-load``,
``--hf-checkpoint`` written by ``dist-to-hf``, the ``hf_config/`` of a checkpoint) and
by the HF <-> torch_dist converters (``tools/convert_ckpt.py``).

The converted torch_dist dir (``convert_hf_to_dist``)::

    out/
      __0_0.distcp ... .metadata metadata.json common.pt   megatron-core torch_dist, key "model"
      hf_config/      config.json, tokenizer and generation files of the source
      COMPLETE.json   written last; format FORMAT, model fingerprint, dtype, files

``COMPLETE.json`` follows the training checkpoints' marker convention
(the training save, ``backends/megatron/checkpoint.py``, format ``TRAINING_FORMAT``: same file
name, same ``model`` fingerprint fields, same ``files`` list with sizes and CRC-32) with
its own ``format`` value, because a converted dir holds a model and nothing else (no
optimizer, RNG or scheduler): a loader must treat it as "weights only".

An HF dir written by ``dist-to-hf`` gets a ``COMPLETE.json`` too (format
``HF_FORMAT``: source and every file with size and CRC-32, the shards' hashed as
they were written); readers check it when a dir has one. HF tools ignore the extra file.

The checks are plain file-system work; :func:`read_marker` and :func:`check_hf_marker_once`
run them on rank 0 and hand the verdict to every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import (MARKER_NAME, MODEL_DIR_FORMAT, is_model_dir, iter_dir,
                                             list_iterations, read_complete_marker, resume_candidates)
from megatron_rl.infra.dist import rank0_do

FORMAT = MODEL_DIR_FORMAT  # a model-only torch_dist dir (hf-to-dist)
TRAINING_FORMAT = "megatron_rl.torch_dist.v1"  # a training checkpoint's iter_NNNNNNN dir
HF_FORMAT = "megatron_rl.hf_safetensors.v1"  # the marker of a dist-to-hf output
HF_CONFIG_SUBDIR = "hf_config"
FINGERPRINT_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                      "ffn_hidden_size", "vocab_size")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt", ".part")

__all__ = ["FORMAT", "TRAINING_FORMAT", "HF_FORMAT", "MARKER_NAME", "HF_CONFIG_SUBDIR", "FINGERPRINT_FIELDS",
           "fingerprint", "check_fingerprint", "aux_files", "copy_aux_files", "is_model_dir", "read_marker",
           "check_hf_marker", "check_hf_marker_once", "resolve_dist_dir"]


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


def read_marker(path: str, crc_of: Optional[Callable[[list[str]], list[str]]] = None) -> dict:
    """``COMPLETE.json`` of a torch_dist dir; refuses incomplete / temp / corrupt dirs by name.

    Collective when ``torch.distributed`` is initialised: rank 0 checks (it reads every file
    for the checksums: once, not once per rank) and every rank gets its verdict. ``crc_of``
    (rank 0's): computes the files' CRC-32s (:func:`~megatron_rl.infra.checkpoint_root.listed_file_problems`)."""
    return rank0_do(lambda: _read_marker(path, crc_of), f"reading {path}")


def _read_marker(path: str, crc_of: Optional[Callable[[list[str]], list[str]]] = None) -> dict:
    return read_complete_marker(path, (FORMAT, TRAINING_FORMAT), "torch_dist checkpoint", crc_of=crc_of, fixes={
        "temp": "convert a published dir",
        "root": "pass the root itself (its newest complete iter_* is used) or one iter_NNNNNNN dir",
        "unmarked": f"Re-run the conversion/save, or write {MARKER_NAME} by hand if you know the dir is complete",
        "json": "re-run the conversion",
        "format": f"this converter reads {FORMAT!r} and {TRAINING_FORMAT!r}",
        "files": "Re-run the conversion or restore the files"})


def check_hf_marker(hf_dir: str) -> Optional[dict]:
    """An HF input written by ``dist-to-hf`` (our ``COMPLETE.json`` with ``HF_FORMAT``): check every
    listed file's size and CRC-32, refusing damage by file name. Other HF dirs: None (nothing to check)."""
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


def check_hf_marker_once(hf_dir: str, what: str) -> Optional[dict]:
    """Collective :func:`check_hf_marker`: rank 0 reads the files, every rank gets the verdict
    (``what`` names the check in an unexpected error, e.g. "checking --hf-checkpoint DIR")."""
    return rank0_do(lambda: check_hf_marker(hf_dir), what)


def resolve_dist_dir(path: str) -> str:
    """A checkpoint ROOT (with ``iter_*`` dirs) -> the checkpoint auto-resume would take first
    (``resume_state.json``'s, else the newest complete one); any other dir as is."""
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MARKER_NAME)) and list_iterations(path):
        candidates = resume_candidates(path)
        step = candidates[0] if candidates else None
        if step is None:
            raise CheckpointError(f"checkpoint root {path} has iter_* dirs but none is complete "
                                  f"(no {MARKER_NAME}); nothing to convert")
        return iter_dir(path, step)
    return path
