"""Stopping the CPU demo with signals, the way people and schedulers send them (torchrun, 2 gloo ranks).

Every case ends in the documented exit code and either a new complete checkpoint
(a signal once the loop runs: finish the step, save, exit 3) or the previous state
(a signal during start-up: nothing to save, exit 143/130), with no process left.

* mid-training: SIGTERM to the launch script's pid (the script ``exec``s
  ``megatron_rl.infra.launch``, so that pid IS torchrun; the test checks it), SIGTERM
  to its process group and the pid at once (what ``timeout`` and Slurm do: torchrun
  gets it twice), Ctrl-C (SIGINT to the foreground group). The signal comes after
  the periodic save of step 2, so megatron's writer machinery already exists when
  torchrun forwards the signal to each worker's process group (``os.killpg``): it
  used to kill the writer's results-queue server and the stop save failed.
* start-up that hangs (a ``tensorboard`` package whose import blocks, on the driver;
  the other rank waits in a collective): SIGTERM and Ctrl-C end it promptly.

SIGKILL at start-up, mid-save and after publish: tests/e2e/test_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from test_resume import Demo, _alive, _procs_using, _tree, assert_no_partial_checkpoint_visible, metrics, train_steps

from megatron_rl.infra.checkpoint_root import iter_dir, list_iterations
from megatron_rl.infra.wall_time import EXIT_WALL_TIME, RUN_STATUS_FILE

STOP_WITHIN_S = 120  # signal -> launcher exit; the stop save itself takes ~1 s here


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


def _logged_train_steps(out) -> list[int]:
    """Train steps in metrics.jsonl so far, ignoring a last line still being written."""
    try:
        return train_steps(metrics(out))
    except json.JSONDecodeError:
        return []


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
    """Wait for the launcher after the signal; fail (killing the tree) if it does not end in time."""
    t0 = time.monotonic()
    pids = _tree(demo.proc.pid)
    rc = demo.wait(timeout=STOP_WITHIN_S)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)] + _procs_using(demo.out)
    if left:
        demo.kill()
    assert not left, f"processes left running after the launcher exited: {left}\n{demo.tail()}"
    assert time.monotonic() - t0 < STOP_WITHIN_S
    return rc


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the script", "SIGTERM to the group and the script", "Ctrl-C"])
def test_signal_mid_training_saves_and_exits_3(tmp_path, how):
    out = tmp_path / "demo"
    root = str(out / "ckpt")
    demo = Demo(out, 8, "--save-interval", "2")
    _wait_for(lambda: os.path.isdir(iter_dir(root, 2)), demo, "iter_0000002")
    # and step 3 logged: a signal now is answered by a save made after it (the stop save at 3, or
    # the periodic one at 4). Sent right after iter_0000002's publish it could be seen by the
    # step-2 stop check, which saves nothing new (that race made step == 2 under load).
    _wait_for(lambda: 3 in _logged_train_steps(out), demo, "train step 3 in metrics.jsonl")
    with open(f"/proc/{demo.proc.pid}/cmdline", "rb") as fh:
        cmdline = fh.read()
    _signal(demo, how)
    rc = _stopped(demo)
    assert rc == EXIT_WALL_TIME, f"exit code {rc}\n{demo.tail()}"
    name = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    status = read_run_status(str(out))
    assert status and status["status"] == "stopped_early" and name in status["reason"], (status, demo.tail())
    step = status["rollout_id"]
    assert 2 < step < 8 and train_steps(metrics(out))[-1] == step
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


@pytest.mark.slow
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
    assert read_run_status(str(out)) is None and train_steps(metrics(out)) == []
    assert not os.path.isdir(out / "ckpt") or list_iterations(str(out / "ckpt")) == []


def _freeze(demo: Demo, sig: signal.Signals) -> None:
    """SIGSTOP/SIGCONT every process of the launched tree (the workers live in their own sessions)."""
    for pid in _tree(demo.proc.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_sigkill_mid_prune_leaves_only_whole_checkpoints(tmp_path):
    """SIGKILL while --save-max-to-keep deletes iter_1 (renamed to .iter_0000001.deleting, then rmtree'd):
    every visible checkpoint is whole and loadable, the newest is resumed from, the trash is never loaded.
    iter_1 is padded with empty files (the run frozen meanwhile) so that its deletion lasts long enough to
    be caught."""
    out = tmp_path / "demo"
    root = str(out / "ckpt")
    trash = os.path.join(root, ".iter_0000001.deleting")
    demo = Demo(out, 6, "--save-interval", "1", "--save-max-to-keep", "3")
    try:
        _wait_for(lambda: os.path.isdir(iter_dir(root, 1)), demo, "iter_0000001")
        _freeze(demo, signal.SIGSTOP)
        padding = os.path.join(iter_dir(root, 1), "padding")
        os.mkdir(padding)
        for i in range(20000):
            os.close(os.open(os.path.join(padding, str(i)), os.O_CREAT | os.O_WRONLY))
        _freeze(demo, signal.SIGCONT)
        demo.kill_when(lambda: os.path.isdir(trash), ".iter_0000001.deleting")
    finally:
        if demo.proc.poll() is None:
            demo.kill()
    assert os.path.isdir(trash) and not os.path.exists(iter_dir(root, 1))
    steps = assert_no_partial_checkpoint_visible(root, tmp_path)  # trash is a temp dir: never complete
    assert steps == [2, 3, 4]
