"""infra/pause_points.py: a process stops at a named point and goes on on release or on a signal.

Every case is decided by state: the paused marker (the pid in it), the release file, the signal,
the exit code and what the process printed; no sleep decides anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from _util import REPO, PausePoint
from megatron_rl.infra import pause_points
from megatron_rl.infra.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, PausePointError, PauseTimeout, pause_point

CHILD = """\
import signal, sys
from megatron_rl.infra.pause_points import pause_point
mode = sys.argv[1]
flag = []
if mode == "flag":
    signal.signal(signal.SIGTERM, lambda *_: flag.append("SIGTERM"))
if mode == "default-term":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
try:
    pause_point("other_point")  # not the one asked for: passes
    pause_point("step_logged", "2")  # the key differs: passes
    pause_point("step_logged", "3")
except KeyboardInterrupt:
    print("interrupted at the pause", flush=True)
    sys.exit(130)
print("went on", flag, flush=True)
"""


def _start(tmp_path, mode: str) -> tuple[subprocess.Popen, PausePoint]:
    point = PausePoint(tmp_path / "pause", "step_logged:3")
    env = {**os.environ, **point.env, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, point


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=120)  # a hang bound only
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


def test_without_the_variable_nothing_pauses(monkeypatch):
    monkeypatch.delenv(PAUSE_AT_ENV, raising=False)
    pause_point("step_logged", "3")  # returns: no file, no wait


def test_paused_until_released(tmp_path):
    proc, point = _start(tmp_path, "plain")
    assert point.wait(proc) == proc.pid
    assert proc.poll() is None  # still there: nothing but the release lets it go on
    point.release()
    rc, out = _finish(proc)
    assert (rc, out) == (0, "went on []\n")


def _signalled_at_the_pause(tmp_path, mode: str, sig: int):
    """(exit code, stdout) of a child in ``mode`` sent ``sig`` once it is paused."""
    proc, point = _start(tmp_path, mode)
    point.wait(proc)
    proc.send_signal(sig)
    return _finish(proc)


def test_a_signal_ends_the_pause_after_its_handler_ran(tmp_path):
    assert _signalled_at_the_pause(tmp_path, "flag", signal.SIGTERM) == (0, "went on ['SIGTERM']\n")
    assert signal.getsignal(signal.SIGTERM) is not None


def test_ctrl_c_at_the_pause_raises_keyboard_interrupt_there(tmp_path):
    assert _signalled_at_the_pause(tmp_path, "plain", signal.SIGINT) == (130, "interrupted at the pause\n")


def test_a_signal_without_a_handler_keeps_its_default_action(tmp_path):
    assert _signalled_at_the_pause(tmp_path, "default-term", signal.SIGTERM) == (-signal.SIGTERM, "")


def test_an_unended_pause_is_named_not_a_hang(tmp_path, monkeypatch):
    monkeypatch.setenv(PAUSE_AT_ENV, "published:iter_0000002")
    monkeypatch.setenv(PAUSE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(pause_points, "PAUSE_TIMEOUT_S", 0.0)  # the hang bound already passed
    with pytest.raises(PauseTimeout, match=f"{PAUSE_AT_ENV}=published:iter_0000002 .* must create "
                                           f"{tmp_path}/published:iter_0000002.release or signal pid {os.getpid()}"):
        pause_point("published", "iter_0000002")
    assert (tmp_path / "published:iter_0000002.rank0.paused").read_text() == str(os.getpid())
    (tmp_path / "published:iter_0000002.release").touch()
    pause_point("published", "iter_0000002")  # released: passes straight through


def test_the_pause_dir_must_be_given(monkeypatch):
    monkeypatch.setenv(PAUSE_AT_ENV, "published")
    monkeypatch.delenv(PAUSE_DIR_ENV, raising=False)
    with pytest.raises(PausePointError, match=f"{PAUSE_AT_ENV}=published is set without {PAUSE_DIR_ENV}"):
        pause_point("published", "iter_0000001")
