"""Crash-safe file publication: a reader sees the old content or the new, never half.

Pattern: write to a temporary sibling, flush + fsync it, ``os.replace`` it over
the target, then fsync the directory so the rename itself survives a power cut.
Checkpoint directories follow the same rule (``publish_dir``): they are written
under a hidden temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (before publishing it)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the call or the filesystem does not support it (the
    caller then falls back to two renames).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: not supported here
        return False
    raise OSError(err, os.strerror(err), a)


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """Atomically move a fully written directory into place (replacing an old one).

    Replacing swaps the two dirs in one ``renameat2(RENAME_EXCHANGE)``, so there is
    no moment without ``final_dir``; the old content is then under the temp name
    (never loaded) and deleted. Without that call: rename the old dir to
    ``<final>.old`` first, which leaves a short window where ``final_dir`` is absent.
    """
    fsync_tree(tmp_dir)
    if os.path.exists(final_dir):
        if exchange_paths(tmp_dir, final_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)  # the old content, under the temp name
        else:
            trash = final_dir + ".old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final_dir, trash)
            os.replace(tmp_dir, final_dir)
            shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))
