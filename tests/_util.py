"""Helpers for multi-rank tests: real torchrun launches with gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.infra.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, marker_path, release_path
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


# ---- the process tree of a launch (torchrun starts every worker in a session of its own) ----------------


def _ppid_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def _tree(root: int) -> list[int]:
    children, out, todo = _ppid_map(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(root: int, timeout: float = 120) -> None:
    """SIGSTOP then SIGKILL every process of ``root``'s tree and their process groups, as a crash would end
    them all at once (nothing moves in between); waits (at most ``timeout``: a hang bound) until none lives."""
    import signal

    pids = _tree(root)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        if sig == signal.SIGKILL:
            pids = list(dict.fromkeys(pids + _tree(root)))  # anything spawned meanwhile
        for pid in pids:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "killed processes still alive"


def read_json(path: str | os.PathLike):
    with open(path) as f:
        return json.load(f)


class PausePoint:
    """A launched process stopped at a pause point (megatron_rl/infra/pause_points.py): the test waits for
    the paused marker, then acts (signal, SIGKILL, look at the files) on state that cannot move on."""

    def __init__(self, directory: str | os.PathLike, spec: str):
        self.dir, self.spec = str(directory), spec

    @property
    def env(self) -> dict[str, str]:
        return {PAUSE_AT_ENV: self.spec, PAUSE_DIR_ENV: self.dir}

    def wait(self, proc: subprocess.Popen, rank: int = 0, timeout: float = 420, output=lambda: "") -> int:
        """Wait until ``rank`` is paused; return its pid. Fails (naming the point) if ``proc`` exits first or
        nothing pauses within ``timeout`` (only a hang bound: the start-up of a run under load)."""
        marker = marker_path(self.dir, self.spec, rank)
        deadline = time.monotonic() + timeout
        while not os.path.exists(marker):
            if proc.poll() is not None:
                raise AssertionError(f"exited ({proc.returncode}) before pause point {self.spec} (rank {rank})\n"
                                     f"{output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"hung: pause point {self.spec} (rank {rank}) not reached in {timeout:.0f} s\n"
                                     f"{output()}")
            time.sleep(0.01)
        with open(marker) as fh:
            return int(fh.read())

    def release(self) -> None:
        open(release_path(self.dir, self.spec), "w").close()
