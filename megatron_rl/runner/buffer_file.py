"""``<save>/async_buffer/buffer_N.pt``: the producer's snapshot a full-mode checkpoint N resumes from.

Kept apart from ``full_async`` so the resume and the save root's housekeeping (``resume``,
``--allow-resume-older``) can name the files without importing the async driver. Written before
checkpoint N (checksummed, atomic); the checkpoint's extra state records its name and SHA-256;
a file lives as long as its checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import os
import re

import torch

from megatron_rl.errors import ConfigError
from megatron_rl.infra import checksum
from megatron_rl.infra.checkpoint_root import iter_dir

DIR_NAME = "async_buffer"
FORMAT = 1
_NAME_RE = re.compile(r"^buffer_(\d+)\.pt$")


def buffer_path(root: str, step: int) -> str:
    return os.path.join(root, DIR_NAME, f"buffer_{step}.pt")


def write_buffer(root: str, step: int, snapshot: dict) -> dict:
    """The snapshot as ``buffer_<step>.pt`` (checksummed, atomic); what the checkpoint's extra state records."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "step": step, **snapshot}, buf)
    payload = buf.getvalue()
    path = buffer_path(root, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    checksum.write_bytes(path, payload)
    return {"file": os.path.basename(path), "sha256": hashlib.sha256(payload).hexdigest(),
            "groups": len(snapshot["buffer"]), "pending": len(snapshot["pending"])}


def prune_buffers(root: str, keep: int) -> None:
    """Drop ``buffer_K.pt`` whose checkpoint ``iter_K`` is gone (never ``keep``'s)."""
    directory = os.path.join(root, DIR_NAME)
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != keep and not os.path.isdir(iter_dir(root, int(m.group(1)))):
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def read_buffer(root: str, step: int, record: dict) -> dict:
    """The snapshot checkpoint ``step`` names in its extra state, checked; ``ConfigError`` naming the file when it
    is missing, damaged or not the one the checkpoint recorded (its prompts would be lost otherwise)."""
    path = buffer_path(root, step)
    fix = ("its buffered and in-flight prompt groups would never be trained; restore the file, or start afresh "
           "(--no-auto-resume --existing-save archive)")
    if not os.path.isfile(path):
        raise ConfigError(f"--async-mode full: checkpoint {iter_dir(root, step)} was saved with the rollout buffer "
                          f"{path} ({record.get('groups')} finished group(s), {record.get('pending')} unfinished), "
                          f"which is missing: {fix}")
    try:
        payload = checksum.read_bytes(path, fix)
    except checksum.ChecksumMismatch as exc:
        raise ConfigError(f"--async-mode full: the rollout buffer {path} is damaged ({exc}): {fix}") from exc
    if hashlib.sha256(payload).hexdigest() != record.get("sha256"):
        raise ConfigError(f"--async-mode full: the rollout buffer {path} is not the one checkpoint "
                          f"{iter_dir(root, step)} was saved with (SHA-256 differs): {fix}")
    data = torch.load(io.BytesIO(payload), weights_only=False)
    if data.get("format") != FORMAT or data.get("step") != step:
        raise ConfigError(f"--async-mode full: {path} holds format {data.get('format')} step {data.get('step')}, "
                          f"expected format {FORMAT} step {step}: {fix}")
    return data
