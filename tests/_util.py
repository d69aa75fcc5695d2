"""Helpers for multi-rank tests: real torchrun launches with gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.infra.ports import free_port  # noqa: F401 - the tests' ports too: outside the ephemeral range

REPO = Path(__file__).resolve().parents[1]


def torchrun(script: str | os.PathLike, nproc: int, args: list[str] | None = None, timeout: float = 600,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on ``nproc`` local ranks; raise with output on failure.

    A timeout kills the whole group, so a hung collective fails the test instead of CI.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *(args or []),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} (nproc={nproc}) failed with {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def read_json(path: str | os.PathLike):
    with open(path) as f:
        return json.load(f)
