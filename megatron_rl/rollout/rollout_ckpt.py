"""``<save>/rollout_ckpts/rollout_{N}.pt``: the rollout generated right after checkpoint N, so a resume skips it.

A job resumes from checkpoint ``iter_N`` (written after rollout N-1 was trained)
and its first act is to generate rollout N. When that rollout was already
generated before the job died (the usual case: a crash or kill during training),
generating it again costs a full rollout for nothing. So the driver writes the
rollout that directly follows a checkpoint, and a job resumed from that
checkpoint loads it instead of calling the engine.

Only that rollout is ever loadable (a resume always starts right after a
checkpoint), so it is the only one written, and a file is kept exactly as long
as its checkpoint: ``prune`` drops ``rollout_K.pt`` once ``iter_K`` is gone
(``--save-max-to-keep``). At most one file per kept checkpoint.

Exactness: the file holds what generating rollout N advanced on the rollout side
(the prompt iterator's position and the driver's python / numpy / torch RNG
after generation and rewards) and loading restores it, so the run continues as
an uninterrupted one would, bit for bit. The embedded engine keeps no sampling
state between calls (each row's generator is seeded from ``--rollout-seed`` +
rollout id), so nothing of the engine itself is stored.

A file is only used for the checkpoint it followed: it records a hash of that
checkpoint's ``COMPLETE.json`` and the rollout-side flags; a mismatch (the
checkpoint was rewritten, the prompt data or sampling flags changed, the prompt
position differs) is logged and the rollout is generated again (always correct,
only slower). Files are written atomically (temp + fsync + rename).

Integrity: the file carries the SHA-256 of its payload (:mod:`megatron_rl.infra.checksum`, a header
line before the ``torch.save`` bytes), checked before anything is unpickled. A file damaged after
it was written (one flipped bit can turn a reward 0.25 into 1.0 and still unpickle) is not trained
on: a warning names the file and both hashes and the rollout is generated again, the same answer as
for any other unusable file (regenerating is always correct). Files written before the checksum
existed load unchecked, logged once.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
from dataclasses import asdict
from typing import AbstractSet, Optional

import torch

from megatron_rl.data.types import Sample
from megatron_rl.infra import checksum
from megatron_rl.infra.atomic import fsync_dir
from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
from megatron_rl.infra.pause_points import pause_point

log = logging.getLogger("megatron_rl")

DIR_NAME = "rollout_ckpts"
FORMAT = 1
_NAME_RE = re.compile(r"^rollout_(\d+)\.pt$")


def rollout_ckpt_path(root: str, rollout_id: int) -> str:
    return os.path.join(root, DIR_NAME, f"rollout_{rollout_id}.pt")


def list_rollout_ckpts(root: str) -> list[int]:
    """Rollout ids with a file under ``root/rollout_ckpts``, ascending (temp files excluded)."""
    directory = os.path.join(root, DIR_NAME)
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(_NAME_RE.match, os.listdir(directory)) if m)


def checkpoint_identity(checkpoint_dir: str) -> Optional[str]:
    """SHA-256 of the checkpoint's ``COMPLETE.json`` (its file list, sizes, checksums); None if absent."""
    try:
        with open(os.path.join(checkpoint_dir, MARKER_NAME), "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def capture_rng_state() -> dict:
    """The driver process's global RNG streams (what a reward function or sampler could draw from)."""
    import numpy as np

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_rollout_ckpt(root: str, rollout_id: int, *, checkpoint: str, samples: list[Sample],
                      metrics: dict[str, float], fingerprint: dict, state_before: dict,
                      state_after: dict) -> Optional[str]:
    """Write ``rollout_{rollout_id}.pt`` atomically and prune files whose checkpoint is gone; return its path.

    Nothing is written (None) when ``checkpoint`` has no completion marker: no resume can start there.
    """
    identity = checkpoint_identity(checkpoint)
    if identity is None:
        log.warning("rollout %d: %s has no completion marker, so the rollout is not stored (no resume can start "
                    "from that checkpoint)", rollout_id, checkpoint)
        return None
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "rollout_id": rollout_id, "checkpoint": os.path.basename(checkpoint),
                "checkpoint_identity": identity, "fingerprint": fingerprint, "state_before": state_before,
                "state_after": state_after, "metrics": dict(metrics), "samples": [asdict(s) for s in samples]}, buf)
    path = rollout_ckpt_path(root, rollout_id)
    checksum.write_bytes(path, buf.getvalue())
    pause_point("rollout_stored", f"rollout_{rollout_id}")  # tests: SIGKILL once stored, before training on it
    prune(root, keep={rollout_id})
    return path


def prune(root: str, keep: AbstractSet[int] = frozenset()) -> list[int]:
    """Delete ``rollout_K.pt`` whose ``iter_K`` no longer exists under ``root`` (never those in ``keep``),
    and temp files left by a killed write."""
    directory = os.path.join(root, DIR_NAME)
    if os.path.isdir(directory):  # temp files of a write that was killed (the driver is the only writer)
        for name in os.listdir(directory):
            if name.startswith(".rollout_") and name.endswith(".tmp"):
                try:
                    os.remove(os.path.join(directory, name))
                except FileNotFoundError:
                    pass
    removed = []
    for rollout_id in list_rollout_ckpts(root):
        if rollout_id not in keep and not os.path.isdir(iter_dir(root, rollout_id)):
            try:
                os.remove(rollout_ckpt_path(root, rollout_id))
                removed.append(rollout_id)
            except FileNotFoundError:
                pass
    if removed:
        fsync_dir(directory)
    return removed


def read_rollout_file(path: str) -> dict:
    """What a rollout file holds, its checksum checked first (``ChecksumMismatch`` on damage; a file
    without one is read as is). For tools and tests that inspect a file; a resume uses
    :func:`load_rollout_ckpt`, which also checks that the file belongs to it."""
    payload = checksum.read_bytes(path, "A resume generates this rollout again; the new file replaces it.")
    return torch.load(io.BytesIO(payload), weights_only=False)


def load_rollout_ckpt(root: str, rollout_id: int, *, checkpoint: str, fingerprint: dict,
                      state_before: dict, weight_version: Optional[int]) -> Optional[dict]:
    """The stored rollout if it belongs to this resume, else None (the reason logged; the caller regenerates).

    Returns the stored dict with ``samples`` as ``Sample`` objects. Samples are stored as field dicts,
    so a file written before a ``Sample`` field existed (``token_versions``) loads with its default.
    """
    path = rollout_ckpt_path(root, rollout_id)
    if not os.path.isfile(path):
        return None
    try:
        data = read_rollout_file(path)
    except checksum.ChecksumMismatch as exc:  # damaged after the write: never trained on
        log.warning("rollout %d: %s is damaged: its content hashes to sha256 %s, the file records %s; "
                    "generating it again", rollout_id, path, exc.actual, exc.recorded)
        return None
    except Exception as exc:  # a foreign or damaged file: never fatal, the rollout is generated again
        log.warning("rollout %d: %s is unreadable (%s: %s); generating it again", rollout_id, path,
                    type(exc).__name__, exc)
        return None
    why = _mismatch(data, rollout_id, checkpoint, fingerprint, state_before, weight_version)
    if why:
        log.warning("rollout %d: not using %s: %s; generating it again", rollout_id, path, why)
        return None
    data["samples"] = [Sample(**s) for s in data["samples"]]
    return data


def _mismatch(data, rollout_id, checkpoint, fingerprint, state_before, weight_version) -> Optional[str]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return f"format {data.get('format') if isinstance(data, dict) else None!r}, expected {FORMAT}"
    if data.get("rollout_id") != rollout_id:
        return f"it holds rollout {data.get('rollout_id')}"
    if data.get("checkpoint_identity") != checkpoint_identity(checkpoint):
        return f"it followed another {data.get('checkpoint')} than {checkpoint} (COMPLETE.json differs)"
    if data.get("fingerprint") != fingerprint:
        changed = sorted(k for k in set(fingerprint) | set(data.get("fingerprint", {}))
                         if fingerprint.get(k) != data.get("fingerprint", {}).get(k))
        return f"rollout settings changed since it was written: {', '.join(changed)}"
    if data.get("state_before") != state_before:
        return "the prompt position restored from the checkpoint differs from the one it was generated at"
    versions = {s.get("weight_version") for s in data.get("samples", [])}
    if weight_version is not None and versions and versions != {weight_version}:
        return f"its samples have weight_version {sorted(versions)}, the engine holds {weight_version}"
    return None
