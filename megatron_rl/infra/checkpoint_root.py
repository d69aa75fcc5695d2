"""The checkpoint ROOT (``--save`` / ``--load``): which iteration dirs exist, which is newest.

Layout of a root::

    root/
      iter_0000003/                  complete checkpoint (has COMPLETE.json)
      iter_0000006/
      .iter_0000009.tmp/             a save in progress or interrupted: never loaded
      latest_checkpointed_iteration.txt
      resume_state.json              the RL loop's own small state (rollout id, ...)

Why both a tracker file and a scan: ``latest_checkpointed_iteration.txt`` is what
megatron's tools read, but it is written *after* the checkpoint is published, so
a crash in between leaves it one behind; :func:`find_latest_complete` scans for
the newest dir that has its completion marker and is what resume trusts. A dir
without the marker (copied by hand, or published by an older writer) is skipped.

Everything here is plain file-system work (no torch.distributed): the caller runs
it on one rank (rank 0) and broadcasts what it needs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Optional

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_json, atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

MARKER_NAME = "COMPLETE.json"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
RESUME_STATE_NAME = "resume_state.json"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def iter_dir(root: str, step: int) -> str:
    """``root/iter_{step:07d}`` (megatron's naming, so its tools find it)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint iteration must be a non-negative int, got {step!r}")
    return os.path.join(root, f"iter_{step:07d}")


def temp_dir_for(final_dir: str) -> str:
    """The hidden sibling a checkpoint is written to before it is published."""
    final_dir = os.path.abspath(final_dir)
    return os.path.join(os.path.dirname(final_dir), f".{os.path.basename(final_dir)}.tmp")


def is_temp_dir(path: str) -> bool:
    """A hidden dir that is never loaded: a save in progress (``.NAME.tmp``) or a checkpoint
    a prune is deleting (``.NAME.deleting``; it may still hold its marker, not its shards)."""
    name = os.path.basename(os.path.normpath(path))
    return name.startswith(".") and name.endswith((".tmp", ".deleting"))


def is_complete(path: str) -> bool:
    return (not is_temp_dir(path)) and os.path.isfile(os.path.join(path, MARKER_NAME))


def list_iterations(root: str) -> list[int]:
    """Iterations with a published ``iter_N`` dir (complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def find_latest_complete(root: str) -> Optional[int]:
    """Newest iteration whose dir holds the completion marker; None when there is none.

    Temp dirs (``.iter_N.tmp``) never match the name pattern; published dirs
    without the marker are logged and skipped.
    """
    for step in reversed(list_iterations(root)):
        path = iter_dir(root, step)
        if is_complete(path):
            return step
        log.warning("checkpoint %s has no %s (incomplete or foreign); skipping it", path, MARKER_NAME)
    return None


def write_latest(root: str, step: int) -> None:
    """Atomically record ``step`` in ``latest_checkpointed_iteration.txt`` (megatron's tracker)."""
    iter_dir(root, step)  # validates step
    atomic_write_text(os.path.join(root, TRACKER_NAME), f"{step}\n")


def read_latest(root: str) -> Optional[int]:
    """The tracker's iteration, or None if the file is absent. A malformed file is an error."""
    path = os.path.join(root, TRACKER_NAME)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; delete it (resume then "
                              f"uses the newest complete iter_* dir) or write the right number into it")
    return int(text)


def prune(root: str, keep: Optional[int]) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints (``--save-max-to-keep``).

    Returns the deleted iterations. Incomplete published dirs older than the
    newest complete one are deleted too (they can never be resumed from); temp
    dirs are left alone (a save may be in progress). ``keep`` None or <= 0 keeps all.
    """
    if keep is None or keep <= 0:
        return []
    for name in os.listdir(root):  # trash of a prune that was killed half-way
        if name.startswith(".iter_") and name.endswith(".deleting"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    steps = list_iterations(root)
    complete = [s for s in steps if is_complete(iter_dir(root, s))]
    kept = set(complete[-keep:])
    newest = complete[-1] if complete else None
    deleted = []
    for s in steps:
        if s in kept:
            continue
        if s not in complete and (newest is None or s > newest):
            continue  # an incomplete dir newer than every complete one: leave it for a human to look at
        _remove_atomically(iter_dir(root, s))
        deleted.append(s)
    if deleted:
        log.info("pruned checkpoints %s under %s (--save-max-to-keep %d)", deleted, root, keep)
    return deleted


def _remove_atomically(path: str) -> None:
    """Take a checkpoint out of sight in one rename, then delete it.

    ``rmtree`` removes files one by one: killed half-way it would leave an
    ``iter_N`` dir that still holds its completion marker but lacks shards, i.e. a
    checkpoint that claims to be complete and is not. Renaming to a hidden name
    first makes the dir vanish from ``list_iterations`` atomically.
    """
    trash = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.deleting")
    shutil.rmtree(trash, ignore_errors=True)  # left by an earlier interrupted prune
    os.replace(path, trash)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(trash, ignore_errors=True)


def write_resume_state(root: str, state: dict) -> None:
    """Atomically write ``resume_state.json`` (must be JSON-serialisable)."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"resume state for {root} is not JSON-serialisable: {e}") from e
    os.makedirs(root, exist_ok=True)
    atomic_write_json(os.path.join(root, RESUME_STATE_NAME), state)


def read_resume_state(root: str) -> Optional[dict]:
    """The resume state dict, or None if absent. Corrupt JSON is an error naming the file."""
    path = os.path.join(root, RESUME_STATE_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); it is written atomically, so this is outside "
                              f"damage: delete it to resume from the checkpoint alone") from e


def file_list(root: str) -> list[dict]:
    """Every file under ``root`` with its size, for a completion marker's ``files``
    (checked back by :func:`listed_file_problems`)."""
    out = []
    for d, _, files in os.walk(root):
        for name in sorted(files):
            full = os.path.join(d, name)
            out.append({"path": os.path.relpath(full, root), "bytes": os.path.getsize(full)})
    return sorted(out, key=lambda e: e["path"])


def listed_file_problems(path: str, meta: dict) -> list[str]:
    """Files a completion marker lists (``meta["files"]``: path + bytes) that are missing or of another size."""
    bad = []
    for entry in meta.get("files", []):
        full = os.path.join(path, entry["path"])
        if not os.path.isfile(full):
            bad.append(f"{entry['path']} missing")
        elif os.path.getsize(full) != entry["bytes"]:
            bad.append(f"{entry['path']} has {os.path.getsize(full)} bytes, {MARKER_NAME} says {entry['bytes']}")
    return bad


def read_complete_marker(path: str, formats: tuple[str, ...], kind: str, fixes: dict[str, str]) -> dict:
    """Validate ``path`` as a published dir and return its ``COMPLETE.json``.

    The one check both the training loader and the converter run, in the same order:
    the dir exists, is not an unpublished temp dir, is not a checkpoint root, holds the
    marker, the marker parses, its ``format`` is one of ``formats``, and every file it
    lists exists with its size. ``kind`` names the thing in messages ("checkpoint",
    "torch_dist checkpoint"); ``fixes`` holds the caller's advice per failure
    (keys: missing, temp, root, unmarked, json, format, files).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{kind} {path} does not exist{fixes.get('missing', '')}")
    if is_temp_dir(path):
        raise CheckpointError(f"{path} is an unpublished temp dir of an interrupted write or prune; "
                              f"{fixes['temp']}")
    marker = os.path.join(path, MARKER_NAME)
    if not os.path.isfile(marker):
        if list_iterations(path):
            raise CheckpointError(f"{path} is a checkpoint root, not an iteration dir; {fixes['root']}")
        raise CheckpointError(f"{kind} {path} has no {MARKER_NAME}: it is incomplete (an interrupted write) or "
                              f"not written by megatron_rl. {fixes['unmarked']}")
    try:
        with open(marker) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{marker} is corrupt ({e}); {fixes['json']}") from e
    if meta.get("format") not in formats:
        raise CheckpointError(f"{path} has format {meta.get('format')!r}; {fixes['format']}")
    bad = listed_file_problems(path, meta)
    if bad:
        raise CheckpointError(f"{kind} {path} is corrupt: {'; '.join(bad[:10])}. {fixes['files']}")
    return meta
