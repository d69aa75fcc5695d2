"""A full disk in the middle of a real two-rank run's save (launcher + torchrun, 2 gloo ranks, megatron).

The issue: ``--save`` on a full filesystem exited 1 with torch's ``unexpected pos 704 vs 598`` (no
word of space), left ``.iter_*.tmp`` and no ``run_status.json``; a relaunch on the still-full disk
hung in the save with one rank in an all-gather and the other in the checkpoint's gather.

Here rank 0's ``common.pt`` write of the second save fails the way torch's writer fails and the
filesystem reports no room (``_disk_full_worker.py``); rank 1 has gone on into the collective shard
write. The run must end on its own (a hang fails the launch's timeout, which names the log), with
the launcher's exit 3 (a complete checkpoint, iteration 1, is there to resume from), one
``error:`` line naming the full filesystem, the temp dir removed and ``run_status.json`` saying it.
The lock on --save and the unit cases: tests/infra/test_save_lock.py, tests/infra/test_disk_full.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _util import free_port
from megatron_rl.infra.checkpoint_root import find_latest_complete, iter_dir, list_iterations
from megatron_rl.infra.wall_time import EXIT_WALL_TIME, RUN_STATUS_FILE
import pytest

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "e2e", "_disk_full_worker.py")
LAUNCH_TIMEOUT_S = 420  # two small rollouts and two saves take ~30-60 s on 2 busy cores


def test_a_full_disk_mid_save_stops_every_rank_with_exit_3_and_no_temp_dir(tmp_path):
    out = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "megatron_rl.data.synthetic", "--out", out], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=120)
    save = os.path.join(out, "ckpt")
    cmd = [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", out,
           "--nproc-per-node", "2", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           WORKER, "--hf-checkpoint", os.path.join(out, "model"), "--actor-num-gpus-per-node", "2",
           "--prompt-data", os.path.join(out, "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward",
           "--num-rollout", "2", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "4", "--global-batch-size", "32", "--advantage-estimator", "grpo",
           "--optimizer", "adam", "--lr", "1e-3", "--save", save, "--save-interval", "1", "--output-dir", out]
    log_path = os.path.join(str(tmp_path), "launch.log")
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=LAUNCH_TIMEOUT_S, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end within {LAUNCH_TIMEOUT_S}s (a rank left waiting in a "
                                 f"collective?):\n{open(log_path).read()[-6000:]}") from None
    output = open(log_path).read()
    assert rc == EXIT_WALL_TIME, output[-6000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-6000:]
    tmp = os.path.join(save, ".iter_0000002.tmp")
    assert f"writing {tmp} failed: its filesystem is full (0 B free" in errors[0]
    assert "unexpected pos 704 vs 598" in errors[0]
    assert f"{iter_dir(save, 1)} is complete: relaunch the same command once there is room" in errors[0]
    assert not os.path.exists(tmp) and list_iterations(save) == [1] and find_latest_complete(save) == 1
    with open(os.path.join(out, RUN_STATUS_FILE)) as f:
        status = json.load(f)
    assert status["status"] == "error" and status["exit_code"] == EXIT_WALL_TIME
    assert "its filesystem is full" in status["error"]
