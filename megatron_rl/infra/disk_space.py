"""A full filesystem, named: which write failed, where, how much it needed, how much is free, the fix.

Why a module of its own: a full disk (``ENOSPC``, or a quota's ``EDQUOT``) surfaces as whatever
the writer that hit it says. Python raises ``OSError(28)``; safetensors says
``IoError(Os { code: 28, kind: StorageFull, ... })``; torch's zip writer says ``unexpected pos
704 vs 598`` or ``file write failed`` and keeps no errno at all; torch DCP wraps every rank's
error in a ``CheckpointException``. Before this module a save on a full disk ended with the
zip writer's line and a traceback, with no word of space. :func:`disk_full_problem` reads all of
them (the exception chain, DCP's per-rank failures, the errno-less messages) and, for a write
failure whose text says nothing, asks the filesystem itself (:func:`free_bytes`): a failed write
into a filesystem with less than :data:`FULL_BELOW_BYTES` left was a full disk.

:func:`check_free_space` is the check before a write whose size is known (a checkpoint is the
size of the previous one): it refuses before anything is written.

The errors (:class:`CheckpointDiskFull`, :class:`SyncDiskFull`) carry ``exit_code``: 2 by default
(a refusal); the caller that knows a complete checkpoint is there to resume from sets 3 (the
launcher's "stopped, relaunch to resume" code; ``train.main`` exits with it).
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Iterator, Optional

from megatron_rl.errors import CheckpointError, SyncError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# what writers that keep no errno say (safetensors' Rust io::Error, torch's zip writer, C stdio)
_FULL_TEXT = ("no space left on device", "storagefull", "os error 28", "code: 28,")
_QUOTA_TEXT = ("disk quota exceeded", "filesystemquotaexceeded", "os error 122", "code: 122,")
# what torch's PyTorchStreamWriter says when its fwrite came up short: a failed write, cause unnamed
_WRITE_FAILED_TEXT = ("unexpected pos", "file write failed", "failed writing file", "error while serializing")
FULL_BELOW_BYTES = 1 << 20  # a filesystem with under 1 MiB left after a failed write was full


class DiskFull:
    """Marker of the disk-full errors below (``isinstance(e, DiskFull)``); ``exit_code``: see the module."""

    exit_code = 2


class CheckpointDiskFull(DiskFull, CheckpointError):
    """A checkpoint (or a converter's output dir) could not be written: its filesystem is full."""


class SyncDiskFull(DiskFull, SyncError):
    """A disk weight update (``--update-weight-disk-dir``) could not be written: its filesystem is full."""


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def free_bytes(path: str) -> Optional[int]:
    """Bytes this user can still write on the filesystem holding ``path`` (its nearest existing
    ancestor); None where ``statvfs`` cannot tell. Quotas are not seen here (``EDQUOT`` is)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank errors a DCP ``CheckpointException`` holds."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value[0] if isinstance(value, tuple) and value else value)
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]


def disk_full_errno(exc: BaseException) -> Optional[int]:
    """ENOSPC / EDQUOT when ``exc`` (or anything it wraps) says the disk or the quota is full, else None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e.errno
        text = str(e).lower()
        if any(t in text for t in _QUOTA_TEXT):
            return errno.EDQUOT
        if any(t in text for t in _FULL_TEXT):
            return errno.ENOSPC
    return None


def _looks_like_failed_write(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) or any(t in str(e).lower() for t in _WRITE_FAILED_TEXT) for e in _chain(exc))


def disk_full_problem(exc: BaseException, path: str, needed: Optional[int] = None,
                      free: Optional[Callable[[str], Optional[int]]] = None) -> Optional[str]:
    """A sentence naming the full filesystem when ``exc`` (raised writing under ``path``) was a full
    disk or quota; None for any other failure. ``needed``: the bytes the write needed, where known."""
    code = disk_full_errno(exc)
    left = (free or free_bytes)(path)
    if code is None and not (_looks_like_failed_write(exc) and left is not None and left < FULL_BELOW_BYTES):
        return None
    what = "the disk quota of this user is exhausted" if code == errno.EDQUOT else "its filesystem is full"
    need = f"; it needs about {human_bytes(needed)}" if needed else ""
    cause = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"writing {path} failed: {what} ({human_bytes(left)} free{need}; {type(exc).__name__}: {cause})")


def check_free_space(path: str, needed: Optional[int], what: str,
                     free: Optional[Callable[[str], Optional[int]]] = None) -> Optional[str]:
    """A sentence when the filesystem of ``path`` has less than ``needed`` bytes free for ``what``;
    None when it has enough or either number is unknown."""
    left = (free or free_bytes)(path)
    if needed is None or left is None or left >= needed:
        return None
    return (f"not writing {path}: its filesystem has {human_bytes(left)} free and {what} needs about "
            f"{human_bytes(needed)}")
