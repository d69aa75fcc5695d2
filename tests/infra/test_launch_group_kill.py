"""``kill -9 -PGID`` of a launch: the workers die with the launcher (``PR_SET_PDEATHSIG``, infra/launch.py);
and a rank SIGKILLed alone: the launcher records the end in run_status.json, its peer ends in one line.

Was: torchrun starts each worker in a session of its own, so the SIGKILL of the launch's process group (the
usual way to end a script that ``exec``s the launcher) reached torchrun alone; both ranks and their engine
trained on without a parent to the end of the run (40 steps and 3 checkpoints after the kill), holding the
``--save`` lock. Here two workers (a plain script: no torch import) each start a child of their own, as a rank
starts its engine, and record both pids; the group is killed once every pid is recorded (state, not a
sleep), and the test waits (bounded: a hang bound only) until none of the four processes lives. The real RL
loop under the same kill: tests/e2e/test_resume.py::test_sigkill_at_startup_mid_save_and_after_publish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from _util import _alive, free_port

WORKER = """\
import os, signal, subprocess, sys
# a rank's engine: dies with its rank, as megatron_rl's engine processes do (PR_SET_PDEATHSIG)
import ctypes
child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"],
                         preexec_fn=lambda: ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL))
path = os.path.join(sys.argv[1], "pids." + os.environ["RANK"])
with open(path + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.replace(path + ".tmp", path)
signal.pause()  # trains on, as far as the launcher knows
"""


def _launch(tmp_path, script_text: str) -> tuple[list[str], dict]:
    """The launcher's command (2 local ranks, run dir ``tmp_path/run``) for a worker script of ``script_text``,
    and its environment."""
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    return [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(tmp_path / "run"), "--nproc-per-node",
            "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)], env


@pytest.mark.e2e
def test_sigkill_of_the_launch_group_ends_every_worker_and_its_engine(tmp_path):
    cmd, env = _launch(tmp_path, WORKER)
    with open(tmp_path / "launch.log", "w") as log:
        proc = subprocess.Popen([*cmd, str(tmp_path)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300  # a hang bound only
        while len(pids) < 4:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()
            assert time.monotonic() < deadline, f"the workers never started\n{(tmp_path / 'launch.log').read_text()}"
            files = [tmp_path / f"pids.{rank}" for rank in (0, 1)]
            if all(f.exists() for f in files):
                pids = [int(p) for f in files for p in f.read_text().split()]
            else:
                time.sleep(0.05)
        assert all(os.getpgid(p) != proc.pid for p in pids)  # torchrun's sessions: the group kill misses them
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 -PGID
        assert proc.wait(timeout=120) == -signal.SIGKILL
        deadline = time.monotonic() + 120  # a hang bound only: the kernel sends the death signals at once
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], "workers or their children outlived the killed launcher"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


PEER = """\
import os, signal, sys
import torch.distributed as dist
from megatron_rl.train import peer_gone_report
dist.init_process_group("gloo")
dist.barrier()
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer
try:
    dist.barrier()  # rank 0 waits for rank 1, which is gone
except Exception as exc:  # what train.main does with it
    line = peer_gone_report(exc)
    if line is None:
        raise
    print(f"rank 0: {line}", file=sys.stderr, flush=True)
    sys.exit(1)
"""


@pytest.mark.e2e
def test_a_sigkilled_rank_is_recorded_in_run_status_and_its_peer_ends_in_one_line(tmp_path):
    """Was: exit 137 with no run_status.json, and rank 0's gloo traceback above the launcher's line. Now the
    launcher records the end (error, 137, the killed rank) and rank 0 prints one line naming the file that
    keeps its traceback (train.peer_gone_report, as train.main calls it)."""
    import json

    cmd, env = _launch(tmp_path, PEER)
    run_dir = tmp_path / "run"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "error: rank 1 was ended by SIGKILL" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    status = json.loads((run_dir / "run_status.json").read_text())
    assert status["status"] == "error" and status["exit_code"] == 137 and status["rank"] == 1, status
    assert status["error"].startswith("rank 1 was ended by SIGKILL")
    # rank 0 sees its collective break (usually: gloo notices the closed socket before torchrun's next poll
    # SIGTERMs it): it keeps the traceback in a file, and its one line (if it got to print it) names the file
    kept = run_dir / "rank0_traceback.txt"
    if kept.exists():
        assert "Traceback" in kept.read_text() and "by peer" in kept.read_text()  # closed or reset
    if "rank 0: a collective failed" in proc.stderr:
        assert f"This rank's traceback: {kept}" in proc.stderr
