"""The wall clock, its reserve and the signal handling before and after the loop can save."""

import os
import signal
import subprocess
import sys

import pytest

from megatron_rl.infra.wall_time import WallClock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_wall_clock_reserve_and_eval_gate():
    clock = WallClock(limit_s=100.0, reserve_s=10.0, elapsed_before_s=85.0)
    assert not clock.should_stop() and not clock.can_eval()  # 15 s left: < 2 reserves
    clock = WallClock(limit_s=100.0, reserve_s=10.0, elapsed_before_s=91.0)
    assert clock.should_stop() and "under --wall-time-reserve" in clock.stop_reason()
    assert not WallClock(None, 600).should_stop()


def test_wall_clock_sigterm():
    clock = WallClock(None, 1.0)
    old = signal.getsignal(signal.SIGTERM)
    try:
        clock.install_signal_handlers()
        clock.stop_at_next_step_on_signal()  # the loop is ready to save: a signal only asks for a stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert clock.should_stop() and "SIGTERM" in clock.stop_reason()
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, signal.default_int_handler)


STARTUP_HANG = """
import sys, time
from megatron_rl.infra.wall_time import WallClock
WallClock(None, 1.0).install_signal_handlers()
print("ready", flush=True)
time.sleep(3600)  # a start-up that hangs (an import that blocks): only the signal can end it in time
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_startup_ends_the_process(sig):
    """Before the loop can save, SIGTERM/SIGINT end the process at once (they used to only set a flag)."""
    proc = subprocess.Popen([sys.executable, "-c", STARTUP_HANG], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=120)  # a hang bound: only the signal ends it sooner
    finally:
        proc.kill()
    assert rc == -sig
