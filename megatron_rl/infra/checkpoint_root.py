"""The checkpoint ROOT (``--save`` / ``--load``): which iteration dirs exist, which is newest.

Layout of a root::

    root/
      iter_0000003/                  complete checkpoint (has COMPLETE.json)
      iter_0000006/
      .iter_0000009.tmp/             a save in progress or interrupted: never loaded
      latest_checkpointed_iteration.txt
      resume_state.json              the RL loop's own small state (rollout id, ...)
      .megatron_rl.lock              the run that holds the root (infra.save_lock)
      superseded/iter_0000012.<time> newer iterations moved aside by --allow-resume-older (move_aside)

Why both a tracker file and a scan: ``latest_checkpointed_iteration.txt`` is what
megatron's tools read, but it is written *after* the checkpoint is published, so
a crash in between leaves it one behind; :func:`find_latest_complete` scans for
the newest dir that has its completion marker and is what resume trusts. A dir
without the marker (copied by hand, or published by an older writer) is skipped.

Which checkpoint auto-resume loads (:func:`resume_candidates`): the one
``resume_state.json`` names (the pointer every save writes last), not merely the
newest ``iter_*`` dir, because a root can hold newer dirs of an earlier run. Dirs
whose marker was written after the pointer (a crash between publishing a
checkpoint and updating the pointer) come first. Every candidate must pass the
same checks (:class:`CorruptCheckpoint`: marker missing or corrupt, a listed file
missing, resized or failing its checksum, non-finite weights); a failing one is
skipped with a warning naming why and the next older one is tried. A dir the user
names with ``--load ROOT/iter_NNNNNNN`` is loaded exactly or refused, never swapped.

Checksums: ``COMPLETE.json`` lists every file with its size and CRC-32
(:func:`file_list`); the loaders check both (:func:`listed_file_problems`), so
same-size garbage inside a shard is refused by name. CRC-32 (zlib's; computed with
ISA-L when installed, :mod:`megatron_rl.infra.crc32`: ~11 GB/s here, zlib ~2 GB/s, against
~1-1.5 GB/s for a copy + fsync; blake2b ~0.45 GB/s) because it is fast and detects random damage; it is not a defence against
deliberate tampering. Markers written before checksums existed still load, with a
warning (sizes only).

Everything here is plain file-system work (no torch.distributed): the caller runs
it on one rank (rank 0) and broadcasts what it needs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from typing import Any, Callable, Optional

from megatron_rl.errors import CheckpointError
from megatron_rl.infra import checksum
from megatron_rl.infra.crc32 import crc32
from megatron_rl.infra.atomic import atomic_write_text, fsync_dir
from megatron_rl.infra.pause_points import pause_point

log = logging.getLogger(__name__)

MARKER_NAME = "COMPLETE.json"
MODEL_DIR_FORMAT = "megatron_rl.torch_dist_model.v1"  # the marker format of a model-only torch_dist dir (hf-to-dist)


def is_model_dir(path: Optional[str]) -> bool:
    """``path`` is a model-only torch_dist dir (written by ``convert_ckpt.py hf-to-dist``) rather than a training
    checkpoint root; ``--load`` then means the initial weights. A question of the checkpoint format alone (its
    marker), asked by the driver's resume as well as by the model loaders (``models/model_dir.py``)."""
    if not path:
        return False
    try:
        with open(os.path.join(path, MARKER_NAME)) as f:
            return json.load(f).get("format") == MODEL_DIR_FORMAT
    except (OSError, ValueError, AttributeError):
        return False
TRACKER_NAME = "latest_checkpointed_iteration.txt"
RESUME_STATE_NAME = "resume_state.json"
SUPERSEDED_DIR = "superseded"  # newer iterations moved aside by a resume of an older one
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
CHECKSUM_KEY = "crc32"
_READ_CHUNK = 8 << 20


class CorruptCheckpoint(CheckpointError):
    """A published dir that fails a check of its own files (marker missing or corrupt, a file
    missing, resized or with another checksum, torn or non-finite data). Auto-resume skips such a
    checkpoint to the previous one; a caller that named the dir gets the error."""


def crc32_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def file_crc32(path: str) -> str:
    """CRC-32 of a file, read in 8 MiB chunks (constant memory)."""
    crc = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = crc32(view[:n], crc)
    return crc32_hex(crc)


def crc32_of_files(paths: list[str]) -> list[str]:
    """:func:`file_crc32` of many files, on up to 8 threads (the CRC and file reads release the GIL,
    so a checkpoint's shards hash in parallel on a multi-core host)."""
    workers = min(8, os.cpu_count() or 1, len(paths))
    if workers <= 1:
        return [file_crc32(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(file_crc32, paths))


class Crc32Writer:
    """Wraps a binary file object: every ``write`` also updates the CRC-32, so a writer that
    streams its bytes (the safetensors writer) gets the checksum without reading the file back."""

    def __init__(self, f):
        self._f = f
        self.crc = 0

    def write(self, data) -> int:
        self.crc = crc32(data, self.crc)
        return self._f.write(data)

    @property
    def hexdigest(self) -> str:
        return crc32_hex(self.crc)


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


def newest_checkpoint_bytes(root: str) -> Optional[int]:
    """Bytes of the newest complete checkpoint under ``root`` (the files its ``COMPLETE.json`` lists):
    what the next save of the same run will need on disk. None without one (or an unreadable marker)."""
    step = find_latest_complete(root)
    if step is None:
        return None
    try:
        with open(os.path.join(iter_dir(root, step), MARKER_NAME)) as f:
            files = json.load(f).get("files") or []
        return sum(int(e["bytes"]) for e in files) or None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def newer_iterations(root: Optional[str], step: int) -> list[int]:
    """Published ``iter_*`` dirs under ``root`` above ``step``: what a run resumed at ``step`` into
    ``root`` would overwrite as it saves (``--allow-resume-older``)."""
    return [s for s in list_iterations(root) if s > step] if root else []


def move_aside(root: str, steps: list[int], companions: Callable[[int], list[str]] = lambda step: [],
               now: Optional[float] = None) -> list[str]:
    """Move ``iter_N`` dirs (and ``companions(N)``: the rollout stored after each) into
    ``root/superseded/`` as ``<name>.<UTC time>``: renames within the root's filesystem, nothing copied
    or deleted. Returns the new paths. Why aside and not deleted: they are another branch of the
    run's history that someone chose to leave (``--load`` of an older iteration); a human decides."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest_root = os.path.join(root, SUPERSEDED_DIR)
    os.makedirs(dest_root, exist_ok=True)
    moved = []
    for s in steps:
        sources = [iter_dir(root, s), *companions(s)]
        for src in sources:
            if not os.path.lexists(src):
                continue
            dest, n = os.path.join(dest_root, f"{os.path.basename(src)}.{stamp}"), 1
            while os.path.lexists(dest):
                n += 1
                dest = os.path.join(dest_root, f"{os.path.basename(src)}.{stamp}_{n}")
            os.rename(src, dest)
            moved.append(dest)
    fsync_dir(dest_root)
    fsync_dir(root)
    return moved


def iteration_of(path: str) -> Optional[int]:
    """The step of a path named ``.../iter_NNNNNNN`` (one iteration dir, not a root); else None."""
    m = _ITER_RE.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def _pointed_step(root: str, state: Optional[dict]) -> Optional[int]:
    """The iteration ``resume_state.json`` names (by its dir's name, so a moved root still works)."""
    if not state:
        return None
    step = iteration_of(str(state.get("checkpoint") or ""))
    if step is None and isinstance(state.get("rollout_id"), int) and not isinstance(state["rollout_id"], bool):
        step = state["rollout_id"]
    return step if step is not None and step >= 0 else None


def resume_candidates(root: str) -> list[int]:
    """The iterations auto-resume tries, in order; the loader's checks decide which one loads.

    Without ``resume_state.json``: every dir with a marker, newest first. With it (the
    pointer each save writes after publishing): first dirs newer than the one it names
    whose marker was written after the pointer (a crash between publish and pointer
    update: they are this run's), then the named one, then older ones, newest first.
    Newer dirs whose marker predates the pointer are an earlier run's leftovers in this
    root: they are logged and never resumed from (judged by file mtimes, so a root copied
    without preserving them falls back to the pointer's order).
    """
    complete = [s for s in list_iterations(root) if is_complete(iter_dir(root, s))]
    for s in list_iterations(root):
        if s not in complete:
            log.warning("checkpoint %s has no %s (incomplete or foreign); skipping it", iter_dir(root, s),
                        MARKER_NAME)
    state_path = os.path.join(root, RESUME_STATE_NAME)
    pointer = _pointed_step(root, read_resume_state(root))
    if pointer is None:
        return list(reversed(complete))
    pointer_mtime = os.path.getmtime(state_path)
    newer: list[int] = []
    stale: list[int] = []
    for s in complete:
        if s > pointer:
            marker_mtime = os.path.getmtime(os.path.join(iter_dir(root, s), MARKER_NAME))
            (newer if marker_mtime >= pointer_mtime else stale).append(s)
    for s in stale:
        log.warning("checkpoint %s is newer than %s, which %s names, but was written before that file: it is "
                    "left from an earlier run in %s and is not resumed from (move or delete it, or --load it "
                    "by name)", iter_dir(root, s), iter_dir(root, pointer), state_path, root)
    if pointer not in complete:
        log.warning("%s names %s, which is missing or has no %s; falling back to the previous complete "
                    "checkpoint", state_path, iter_dir(root, pointer), MARKER_NAME)
    older = [s for s in complete if s <= pointer]
    return list(reversed(newer)) + list(reversed(older))


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
    The checkpoint ``resume_state.json`` names is never deleted: after ``--load ROOT/iter_N``
    of an older one, the newest numbers may be an abandoned branch, not the run's latest save.
    """
    if keep is None or keep <= 0:
        return []
    for name in os.listdir(root):  # trash of a prune that was killed half-way
        if name.startswith(".iter_") and name.endswith(".deleting"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    steps = list_iterations(root)
    complete = [s for s in steps if is_complete(iter_dir(root, s))]
    kept = set(complete[-keep:])
    try:
        pointer = _pointed_step(root, read_resume_state(root))
    except CheckpointError:
        pointer = None  # an unreadable pointer protects nothing; resume refuses it by name
    if pointer is not None:
        kept.add(pointer)
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
    pause_point("prune_renamed", os.path.basename(path))  # tests: SIGKILL with the trash still there
    shutil.rmtree(trash, ignore_errors=True)


def write_resume_state(root: str, state: dict) -> None:
    """Atomically write ``resume_state.json`` (must be JSON-serialisable) with its SHA-256
    (:mod:`megatron_rl.infra.checksum`)."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"resume state for {root} is not JSON-serialisable: {e}") from e
    os.makedirs(root, exist_ok=True)
    checksum.write_json(os.path.join(root, RESUME_STATE_NAME), state)


def _resume_state_fix(path: str, root: str) -> str:
    return (f"Restore {path} from a copy, or delete it to resume from the newest complete checkpoint under {root} "
            "alone: the wall time used so far then counts from 0 and a new W&B run starts (--wandb-resume-id ID "
            "continues the old one)")


def read_resume_state(root: str) -> Optional[dict]:
    """The resume state dict, or None if absent.

    Refused (a :class:`CheckpointError` naming the file and the fix), never skipped: corrupt JSON,
    or content that fails its checksum (:class:`~megatron_rl.infra.checksum.ChecksumMismatch`).
    Why not fall back to the newest checkpoint: the file is the only record of the wall time used
    and the W&B run id, and the pointer is what tells this run's checkpoints from an earlier run's
    newer leftovers; dropping it silently would resume the wrong branch or overrun the wall time.
    A file written before checksums existed loads with one log line.
    """
    path = os.path.join(root, RESUME_STATE_NAME)
    if not os.path.exists(path):
        return None
    try:
        state = checksum.read_json(path, _resume_state_fix(path, root))
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise CheckpointError(f"{path} is not valid JSON ({e}); it is written atomically, so this is outside "
                              f"damage. {_resume_state_fix(path, root)}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a JSON {type(state).__name__}, not an object. "
                              f"{_resume_state_fix(path, root)}")
    return state


def file_list(root: str, known_checksums: Optional[dict[str, str]] = None) -> list[dict]:
    """Every file under ``root`` with its size and CRC-32, for a completion marker's ``files``
    (checked back by :func:`listed_file_problems`).

    ``known_checksums`` (relative path -> hex) are checksums a writer computed as it wrote
    the bytes; every other file is read back once here. Why a read-back at all: the torch_dist
    shards are written by megatron's / torch's writer threads and processes, which give no
    clean hook on the bytes; they are hashed after the collective write (the training save
    spreads that over the ranks and passes the results here; cost in docs/benchmarks.md).
    """
    known = known_checksums or {}
    out: list[dict[str, Any]] = []
    for d, _, files in os.walk(root):
        for name in sorted(files):
            full = os.path.join(d, name)
            rel = os.path.relpath(full, root)
            out.append({"path": rel, "bytes": os.path.getsize(full), CHECKSUM_KEY: known.get(rel)})
    todo = [e for e in out if e[CHECKSUM_KEY] is None]
    for e, crc in zip(todo, crc32_of_files([os.path.join(root, e["path"]) for e in todo])):
        e[CHECKSUM_KEY] = crc
    return sorted(out, key=lambda e: e["path"])


def has_checksums(meta: dict) -> bool:
    files = meta.get("files") or []
    return bool(files) and all(CHECKSUM_KEY in e for e in files)


def listed_file_problems(path: str, meta: dict, checksums: bool = True,
                         crc_of: Optional[Callable[[list[str]], list[str]]] = None) -> list[str]:
    """Files a completion marker lists (``meta["files"]``: path, bytes, crc32) that are missing,
    of another size or (``checksums``) of another CRC-32; each names the file. ``crc_of`` computes the
    CRC-32s (hex) of a list of files instead of :func:`crc32_of_files` (a reader that learns more of the
    bytes in the same pass: ``megatron_rl.convert.input_digest``); it must give the same values."""
    bad, to_hash = [], []
    for entry in meta.get("files", []):
        full = os.path.join(path, entry["path"])
        if not os.path.isfile(full):
            bad.append(f"{entry['path']} missing")
        elif os.path.getsize(full) != entry["bytes"]:
            bad.append(f"{entry['path']} has {os.path.getsize(full)} bytes, {MARKER_NAME} says {entry['bytes']}")
        elif checksums and CHECKSUM_KEY in entry:
            to_hash.append(entry)
    for entry, got in zip(to_hash, (crc_of or crc32_of_files)([os.path.join(path, e["path"]) for e in to_hash])):
        if got != entry[CHECKSUM_KEY]:
            bad.append(f"{entry['path']} has CRC-32 {got}, {MARKER_NAME} says {entry[CHECKSUM_KEY]} "
                       f"(same size, different bytes: damaged after it was written)")
    return bad


def read_complete_marker(path: str, formats: tuple[str, ...], kind: str, fixes: dict[str, str],
                         checksums: bool = True, crc_of: Optional[Callable[[list[str]], list[str]]] = None) -> dict:
    """Validate ``path`` as a published dir and return its ``COMPLETE.json``.

    The one check both the training loader and the converter run, in the same order:
    the dir exists, is not an unpublished temp dir, is not a checkpoint root, holds the
    marker, the marker parses, its ``format`` is one of ``formats``, and every file it
    lists exists with its size and checksum. ``kind`` names the thing in messages ("checkpoint",
    "torch_dist checkpoint"); ``fixes`` holds the caller's advice per failure
    (keys: missing, temp, root, unmarked, json, format, files). Failures of the dir's own
    files raise :class:`CorruptCheckpoint`; a marker without checksums (written before
    they were recorded) is accepted with a warning. ``checksums=False`` leaves the CRC-32
    comparison to the caller (the training loader spreads it over the ranks); ``crc_of``: as for
    :func:`listed_file_problems`.
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
        raise CorruptCheckpoint(f"{kind} {path} has no {MARKER_NAME}: it is incomplete (an interrupted write) "
                                f"or not written by megatron_rl. {fixes['unmarked']}")
    try:
        with open(marker) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("files", []), list):
            raise ValueError("not a JSON object with a files list")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{marker} is corrupt ({e}); {fixes['json']}") from e
    if meta.get("format") not in formats:
        raise CorruptCheckpoint(f"{path} has format {meta.get('format')!r}; {fixes['format']}")
    try:
        bad = listed_file_problems(path, meta, checksums=checksums, crc_of=crc_of)
    except (KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{marker} is corrupt (a files entry lacks {e}); {fixes['json']}") from e
    if bad:
        raise CorruptCheckpoint(f"{kind} {path} is corrupt: {'; '.join(bad[:10])}. {fixes['files']}")
    if not has_checksums(meta):
        log.warning("%s %s was written without checksums (by an older megatron_rl): its files are checked by size "
                    "only; damage inside a file is not detected", kind, path)
    return meta
