"""Stopping the CPU demo with signals, the way people and schedulers send them (torchrun, 2 gloo ranks).

Every case ends in the documented exit code and either a new complete checkpoint
(a signal once the loop runs: finish the step, save, exit 3) or the previous state
(a signal during start-up: nothing to save, exit 143/130), with no process left.

* mid-training: SIGTERM to the launch script's pid (the script ``exec``s
  ``megatron_rl.infra.launch``, so that pid IS torchrun; the test checks it), SIGTERM
  to its process group and the pid at once (what ``timeout`` and Slurm do: torchrun
  gets it twice), Ctrl-C (SIGINT to the foreground group). The signal comes while
  every rank is paused once step 3 is logged (pause point ``step_logged:3``, after
  the periodic save of step 2), so megatron's writer machinery already exists when
  torchrun forwards the signal to each worker's process group (``os.killpg``): it
  used to kill the writer's results-queue server and the stop save failed. The
  signal ends the pause, so the stop is at step 3 however busy the machine.
* start-up that hangs (a ``tensorboard`` package whose import blocks, on the driver;
  the other rank waits in a collective): SIGTERM and Ctrl-C end it promptly.

SIGKILL at start-up, mid-save and after publish: tests/e2e/test_resume.py. Every moment
is reached by state (a pause point, a marker file); timeouts only bound a hang.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from _util import PausePoint
from test_resume import Demo, _alive, _procs_using, _tree, assert_no_partial_checkpoint_visible, metrics, train_steps

from megatron_rl.infra.checkpoint_root import iter_dir, list_iterations
from megatron_rl.infra.wall_time import EXIT_WALL_TIME, RUN_STATUS_FILE

pytestmark = pytest.mark.e2e

STOP_WITHIN_S = 420  # signal -> launcher exit: a hang bound only (the stop save itself takes ~1 s here)


def read_run_status(out) -> dict | None:
    path = os.path.join(out, RUN_STATUS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _wait_for(condition, demo: Demo, what: str, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if demo.proc.poll() is not None:
            raise AssertionError(f"demo exited ({demo.proc.returncode}) before {what}\n{demo.tail()}")
        if time.monotonic() > deadline:
            demo.kill()
            raise AssertionError(f"no {what} within {timeout}s\n{demo.tail()}")
        time.sleep(0.05)


def _signal(demo: Demo, how: str) -> None:
    pid = demo.proc.pid  # start_new_session: also the process group id
    if how == "SIGTERM to the script":
        os.kill(pid, signal.SIGTERM)
    elif how == "SIGTERM to the group and the script":
        os.killpg(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGTERM)
    elif how == "Ctrl-C":
        os.killpg(pid, signal.SIGINT)
    else:
        raise ValueError(how)


def _stopped(demo: Demo) -> int:
    """Wait for the launcher after the signal; fail (killing the tree) if it hangs."""
    pids = _tree(demo.proc.pid)
    rc = demo.wait(timeout=STOP_WITHIN_S)
    deadline = time.monotonic() + 120  # a hang bound
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)] + _procs_using(demo.out)
    if left:
        demo.kill()
    assert not left, f"processes left running after the launcher exited: {left}\n{demo.tail()}"
    return rc


@pytest.mark.parametrize("how", ["SIGTERM to the script", "SIGTERM to the group and the script", "Ctrl-C"])
def test_signal_mid_training_saves_and_exits_3(tmp_path, how):
    out = tmp_path / "demo"
    root = str(out / "ckpt")
    # every rank pauses once step 3 is logged (iter_0000002 published before it): the signal arrives there
    # and ends the pause, so the stop check of step 3 sees it (polling for metrics.jsonl and then signalling
    # let the run move on meanwhile: a stop at 2 or later than 3 under load)
    point = PausePoint(tmp_path / "pause", "step_logged:3")
    demo = Demo(out, 8, "--save-interval", "2", env=point.env)
    # both ranks, not only the driver: a rank that took the signal before it reached the point would pause there
    # afterwards, for no signal (the run then hung until the launcher's 300 s save bound, exit 143)
    for rank in (0, 1):
        point.wait(demo.proc, rank=rank, output=demo.tail)  # the timeout only bounds a hang
    assert os.path.isdir(iter_dir(root, 2)) and 3 in train_steps(metrics(out))
    with open(f"/proc/{demo.proc.pid}/cmdline", "rb") as fh:
        cmdline = fh.read()
    _signal(demo, how)
    rc = _stopped(demo)
    assert rc == EXIT_WALL_TIME, f"exit code {rc}\n{demo.tail()}"
    name = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    status = read_run_status(str(out))
    assert status and status["status"] == "stopped_early" and name in status["reason"], (status, demo.tail())
    step = status["rollout_id"]
    assert step == 3 and train_steps(metrics(out))[-1] == step
    # the stop saved the step it finished: complete, loadable, the newest; no temp dir left
    assert assert_no_partial_checkpoint_visible(root, tmp_path)[-1] == step
    assert [n for n in os.listdir(root) if n.startswith(".iter_")] == []
    assert "stopped early" in demo.output and "relaunch the same command to resume" in demo.output
    assert "Traceback" not in demo.output and "BrokenPipe" not in demo.output, demo.tail()
    assert b"megatron_rl.infra.launch" in cmdline  # the script's pid was torchrun's (exec)


HANGING_TENSORBOARD = """\
import os, time
open(os.environ["HANG_MARKER"], "w").close()
time.sleep(3600)  # an optional package whose import blocks
"""


@pytest.mark.parametrize("how,code", [("SIGTERM to the script", 128 + signal.SIGTERM), ("Ctrl-C", 128 + signal.SIGINT)])
def test_signal_during_hanging_startup_ends_run(tmp_path, monkeypatch, how, code):
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text(HANGING_TENSORBOARD)
    marker = tmp_path / "importing_tensorboard"
    monkeypatch.setenv("PYTHONPATH", f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("HANG_MARKER", str(marker))
    out = tmp_path / "demo"
    demo = Demo(out, 4)
    _wait_for(marker.exists, demo, "the blocking import")
    _signal(demo, how)
    rc = _stopped(demo)
    assert rc == code, f"exit code {rc}\n{demo.tail()}"
    name = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    assert f"stopped by {name} before the run could save" in demo.output, demo.tail()
    status = read_run_status(str(out))  # recorded by the launcher: no worker could (was: no file)
    assert status["status"] == "error" and status["exit_code"] == code and status["signal"] == name, status
    assert train_steps(metrics(out)) == []
    assert not os.path.isdir(out / "ckpt") or list_iterations(str(out / "ckpt")) == []


def test_sigkill_mid_prune_leaves_only_whole_checkpoints(tmp_path):
    """SIGKILL of the driver (rank 0, alone: the OOM killer's way) while --save-max-to-keep deletes iter_1,
    renamed to .iter_0000001.deleting and not yet removed (pause point prune_renamed:iter_0000001; was:
    iter_1 padded with 20000 files so that its deletion lasted long enough to be caught by polling):
    every visible checkpoint is whole and loadable, the trash is never loaded; the launcher names the
    killed rank and exits 128 + SIGKILL = 137 (docs/checkpoints.md), with no process left."""
    out = tmp_path / "demo"
    root = str(out / "ckpt")
    trash = os.path.join(root, ".iter_0000001.deleting")
    point = PausePoint(tmp_path / "pause", "prune_renamed:iter_0000001")
    demo = Demo(out, 6, "--save-interval", "1", "--save-max-to-keep", "3", env=point.env)
    try:
        driver = point.wait(demo.proc, output=demo.tail)  # the timeout only bounds a hang
        os.kill(driver, signal.SIGKILL)
        rc = _stopped(demo)
    finally:
        if demo.proc.poll() is None:
            demo.kill()
    assert rc == 128 + signal.SIGKILL, f"exit code {rc}\n{demo.tail()}"
    assert "error: rank 0 was ended by SIGKILL" in demo.output, demo.tail()
    # recorded by the launcher (was: no run_status.json), and rank 1, whose collective broke under it, says so
    # in one line (its traceback kept in a file) instead of a gloo traceback above the launcher's line
    status = read_run_status(str(out))
    assert status["status"] == "error" and status["exit_code"] == 137 and status["rank"] == 0, status
    assert "Traceback" not in demo.output, demo.tail()
    assert os.path.isdir(trash) and not os.path.exists(iter_dir(root, 1))
    steps = assert_no_partial_checkpoint_visible(root, tmp_path)  # trash is a temp dir: never complete
    assert steps == [2, 3, 4]
