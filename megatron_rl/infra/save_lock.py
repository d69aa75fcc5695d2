"""One run per checkpoint root: an exclusive lock on ``--save``, held by the driver (rank 0).

Why: the same command launched twice on one ``--save`` wrote iterations over each other and
interleaved ``metrics.jsonl``; nothing told either run. Now the driver takes the lock before
anything writes into the root (before ``--existing-save`` clears it, before the tracker opens
its files) and the second launch is refused, naming the holder (exit 2, one ``error:`` line).

How: ``fcntl.flock`` on ``ROOT/.megatron_rl.lock``, whose content is the holder's record (JSON:
host, pid, the process's start time, command, time taken). The kernel drops a flock when its
process dies, however it dies (SIGKILL, the OOM killer, the default action of SIGTERM during
start-up), so a dead holder never blocks a relaunch; on an ordinary exit (a return, an
exception, a stop on a signal once the loop runs) the record is emptied too (``release``, also
at interpreter exit). The record outlives only a holder that died:

* its host is this one and its pid is gone (or now belongs to another process: the start time
  differs) -> taken over, with a warning naming the dead holder;
* its host is another one -> refused, naming host, pid and how to remove the file: flock is
  not shared between hosts on every filesystem (NFS without lockd, Lustre's ``localflock``), so
  this host cannot tell a live run over there from a dead one.

The lock file itself is never deleted (a path that is unlinked and created again while another
process waits on the old inode would let two processes hold "the" lock); an empty file is a free
lock. A forked child (the checkpoint writer's processes) shares the flock but never releases it:
only the process that took it does.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

from megatron_rl.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK_NAME = ".megatron_rl.lock"


class SaveRootLocked(CheckpointError):
    """Another run holds (or may hold) the ``--save`` root."""


def process_start_time(pid: int) -> Optional[str]:
    """The kernel's start time of ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22), or
    None when there is no such process (or no /proc). With the pid it names one process: a pid
    reused by another process has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, start: Optional[str]) -> bool:
    now = process_start_time(pid)
    if now is not None:
        return start is None or now == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not os.path.isdir("/proc")  # /proc exists but not this pid: gone


def _describe(record: dict) -> str:
    if "unreadable" in record:  # was: "pid ? on host ?"
        return f"a run whose record is unreadable ({record['unreadable']})"
    started = record.get("taken_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"pid {record.get('pid')} on host {record.get('host')} (since {when}; command: "
            f"{record.get('command') or '?'})")


@dataclass
class SaveLock:
    """A held lock on ``root``; :meth:`release` empties the record and drops the flock (idempotent)."""

    root: str
    path: str
    fd: Optional[int]
    owner_pid: int

    def release(self) -> None:
        if self.fd is None or os.getpid() != self.owner_pid:  # a forked child never releases its parent's lock
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
            os.fsync(fd)
        except OSError:
            pass  # the flock still goes with the close; an unreadable record names a dead pid at worst
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            _HELD.pop(self.root, None)


_HELD: dict[str, SaveLock] = {}  # root -> this process's lock (taking it again in-process reuses it)


def _read_record(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 1 << 16):
        raw += chunk
    if not raw.strip():
        return None
    text = raw[:200].decode(errors="replace")
    try:
        record = json.loads(raw)
    except ValueError:
        return {"unreadable": f"not JSON: {text!r}"}
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int) or not record.get("host"):
        return {"unreadable": f"no host and pid: {text!r}"}
    return record


def acquire(root: str, command: Optional[str] = None, host: Optional[str] = None) -> SaveLock:
    """Take the lock on ``root`` (created if absent) for this process, or raise :class:`SaveRootLocked`
    naming the holder and what to do. Held until :meth:`SaveLock.release` or the process ends."""
    root = os.path.abspath(root)
    if root in _HELD and _HELD[root].fd is not None:
        return _HELD[root]
    host = host or socket.gethostname()
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SaveRootLocked(f"--save {root}: its lock file {path} cannot be opened for writing "
                             f"({type(exc).__name__}: {exc.strerror}); give this user read and write access to it "
                             "(and to the root), or give this run another --save") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd) or {}
            raise SaveRootLocked(f"--save {root} is in use by another run: {_describe(holder)} holds {path}. "
                                 "Two runs must not write one checkpoint root: wait for it to end, stop it, or give "
                                 "this run another --save") from None
        previous = _read_record(fd)
        if previous is not None and "unreadable" in previous:
            # the flock is ours, so no process on this host holds the root; a run elsewhere writes its record
            # whole (one write after truncating): an unreadable one is a crash's leftover, not a holder's
            log.warning("--save %s: taking over %s, whose record is unreadable (%s): no process on this host holds "
                        "it; its last checkpoint is what this run resumes from", root, path, previous["unreadable"])
        elif previous is not None:
            if previous.get("host") != host:
                raise SaveRootLocked(
                    f"--save {root} is marked in use by {_describe(previous)} in {path}; this host ({host}) cannot "
                    "tell whether that run still runs (file locks are not shared between hosts on every "
                    f"filesystem). If it has ended, delete {path} and relaunch; if it runs, give this run "
                    "another --save")
            pid = previous.get("pid")
            if isinstance(pid, int) and pid != os.getpid() and _alive(pid, previous.get("start")):
                raise SaveRootLocked(
                    f"--save {root} is marked in use by {_describe(previous)} in {path}, which still runs but "
                    "holds no lock on it (a filesystem without flock?); stop it, or delete the file once it has "
                    "ended, or give this run another --save")
            log.warning("--save %s: taking over the lock of %s, which ended without releasing it (killed or "
                        "crashed); its last checkpoint is what this run resumes from", root, _describe(previous))
        record = {"host": host, "pid": os.getpid(), "start": process_start_time(os.getpid()),
                  "taken_at": time.time(), "command": command if command is not None else " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)  # drops the flock if it was taken
        raise
    lock = SaveLock(root, path, fd, os.getpid())
    _HELD[root] = lock
    atexit.register(lock.release)
    return lock


def release_all() -> None:
    """Release every lock this process holds (``train.main`` on its way out, whatever ended the run:
    in one process, as tests run it, the next start on the same root must find it free)."""
    for lock in list(_HELD.values()):
        lock.release()
