"""One run per ``--save``: the driver's lock (``infra.save_lock``).

The issue: the same command launched twice on one ``--save`` wrote iterations over each other and
interleaved metrics.jsonl. Contention is tested with real processes: a holder that prints a line
once the lock is held (the test reads it: decided by state, never by a sleep), then a real
``python -m megatron_rl.train`` start that must be refused naming it; a holder killed by SIGKILL
(the kernel drops its flock, its record stays) is taken over with a warning; a record of another
host is refused with the file to delete.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.infra import save_lock
from megatron_rl.infra.save_lock import LOCK_NAME, SaveRootLocked, acquire

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD_TIMEOUT_S = 120  # one python start-up + the lock; a failure names the holder's output

HOLDER = textwrap.dedent("""
    import sys
    from megatron_rl.infra.save_lock import acquire
    lock = acquire(sys.argv[1], command="holder for the test")
    print("held", flush=True)
    how = sys.stdin.readline().strip()  # the test says how this holder ends
    if how == "raise":
        raise RuntimeError("the holder failed")
""")


class Holder:
    """A process that takes the lock on ``root`` and holds it until told how to end."""

    def __init__(self, root):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], cwd=REPO, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # blocks until the lock is held (or the holder died)
        if line.strip() != "held":
            self.proc.kill()
            raise AssertionError(f"the holder did not take the lock: {line!r} {self.proc.stderr.read()}")

    def end(self, how: str) -> int:
        if how == "SIGKILL":
            self.proc.kill()
        else:
            self.proc.stdin.write(how + "\n")
            self.proc.stdin.flush()
        return self.proc.wait(timeout=HOLD_TIMEOUT_S)


def _record(root) -> str:
    with open(os.path.join(root, LOCK_NAME)) as f:
        return f.read()


def test_acquire_writes_the_holder_and_release_frees_it(tmp_path):
    lock = acquire(str(tmp_path / "save"), command="train --save x")
    record = json.loads(_record(tmp_path / "save"))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["command"] == "train --save x" and record["start"] == save_lock.process_start_time(os.getpid())
    assert acquire(str(tmp_path / "save")) is lock  # this process already holds it
    lock.release()
    assert _record(tmp_path / "save") == ""
    lock.release()  # idempotent
    acquire(str(tmp_path / "save")).release()


@pytest.mark.e2e
def test_a_second_real_start_on_a_held_save_is_refused_naming_the_holder(tmp_path, tiny_hf_models):
    """A real ``python -m megatron_rl.train`` start (no --dry-run) while another process holds --save:
    exit 2, one ``error:`` line naming the holder's pid and host; nothing of the second run written."""
    root, out = tmp_path / "save", tmp_path / "out"
    holder = Holder(root)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", tiny_hf_models("qwen2"),
                               "--save", str(root), "--output-dir", str(out), "--num-rollout", "1"],
                              cwd=REPO, capture_output=True, text=True, timeout=HOLD_TIMEOUT_S,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        assert holder.end("exit") == 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"--save {root} is in use by another run: pid {holder.proc.pid} on host {socket.gethostname()}" \
           in errors[0] and "holder for the test" in errors[0] and "another --save" in errors[0]
    assert not os.path.exists(out / "metrics.jsonl")
    assert sorted(os.listdir(root)) == [LOCK_NAME]
    assert _record(root) == ""  # the holder released it on its way out


@pytest.mark.parametrize("how", ["raise", "SIGKILL"])
def test_a_holder_that_died_is_taken_over(tmp_path, caplog, how):
    """An exception: released at exit (no warning). SIGKILL: the kernel dropped the flock, the record
    names a dead pid of this host: taken over with a warning naming it."""
    holder = Holder(tmp_path)
    rc = holder.end(how)
    assert rc == (-signal.SIGKILL if how == "SIGKILL" else 1)
    with caplog.at_level(logging.WARNING, logger=save_lock.__name__):
        lock = acquire(str(tmp_path))
    lock.release()
    warned = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    if how == "SIGKILL":
        assert len(warned) == 1 and f"pid {holder.proc.pid} on host {socket.gethostname()}" in warned[0]
    else:
        assert warned == []


def test_a_record_of_another_host_is_refused_naming_it_and_the_file_to_delete(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "node-17", "pid": 4242, "taken_at": 0, "command": "train --save x"}))
    with pytest.raises(SaveRootLocked) as info:
        acquire(str(tmp_path))
    msg = str(info.value)
    assert "pid 4242 on host node-17" in msg and f"delete {path} and relaunch" in msg
    assert json.loads(path.read_text())["host"] == "node-17"  # left as it was
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid() + 10**7, "taken_at": 0}))
    acquire(str(tmp_path)).release()  # this host, no such pid: taken over


def test_an_unreadable_record_or_lock_file_is_named_not_read_as_pid_question_mark(tmp_path, caplog, monkeypatch):
    """Was: "in use by pid ? on host ?". A record that is not the holder's JSON (a crash's leftover: the flock is
    free, so no process of this host holds the root) is taken over with a warning quoting it; while a live holder
    keeps the flock, the refusal says its record is unreadable; a lock file this user cannot open is named with
    the fix (was an OSError traceback)."""
    path = tmp_path / LOCK_NAME
    for junk, why in (("{\"host\": \"x\"", "not JSON"), ("[1, 2]", "no host and pid")):
        path.write_text(junk)
        with caplog.at_level(logging.WARNING, logger=save_lock.__name__):
            acquire(str(tmp_path)).release()
        assert f"taking over {path}, whose record is unreadable ({why}: {junk!r})" in caplog.text, caplog.text
        assert "?" not in caplog.text.replace(repr(junk), "")
        caplog.clear()
    holder = Holder(tmp_path)
    try:
        path.write_text("garbage")  # the holder's flock stays (same inode), its record is overwritten
        with pytest.raises(SaveRootLocked, match=r"in use by another run: a run whose record is unreadable "
                                                 r"\(not JSON: 'garbage'\) holds"):
            acquire(str(tmp_path))
    finally:
        holder.end("exit")
    real_open = os.open

    def denied(name, flags, *args):  # what chmod 400 does to a non-root user (this may run as root)
        if str(name) == str(path):
            raise PermissionError(13, "Permission denied", str(name))
        return real_open(name, flags, *args)

    monkeypatch.setattr(save_lock.os, "open", denied)
    with pytest.raises(SaveRootLocked, match=rf"its lock file {path} cannot be opened for writing "
                                             r"\(PermissionError: Permission denied\); give this user"):
        acquire(str(tmp_path))
