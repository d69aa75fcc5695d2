"""Helpers for multi-rank tests: real torchrun launches with gloo on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_rl.infra.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, marker_path, release_path
from megatron_rl.infra.ports import free_port  # noqa: F401 - the tests' ports too: outside the ephemeral range

REPO = Path(__file__).resolve().parents[1]


def torchrun(script: str | os.PathLike, nproc: int, args: list[str] | None = None, timeout: float = 600,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on ``nproc`` local ranks; raise with output on failure.

    A timeout kills the whole group, so a hung collective fails the test instead of CI. Each rank runs the
    script through ``tests/_torchrun_entry.py``, which ends a rank whose script succeeded without the
    interpreter's finalization (a gloo teardown race can abort a finished rank there).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(REPO / "tests" / "_torchrun_entry.py"), str(script), *(args or []),
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


HARNESS = REPO / "tests" / "dist" / "harness.py"


def run_jobs(nproc: int, jobs: list[tuple[str, list]], timeout: float = 600, env: dict | None = None,
             spec_dir: str | os.PathLike | None = None, plain: bool = False) -> subprocess.CompletedProcess:
    """One torchrun launch of ``nproc`` ranks running ``jobs`` in order through ``tests/dist/harness.py``: each
    ``(name, argv)`` is a job registered in its ``JOBS`` table (a worker of ``tests/dist/scripts``). Between
    jobs the harness releases every process group but the default one and fails the launch if a rank holds
    more threads than its bound. ``plain``: one process without torchrun (``nproc`` must be 1). Raises with
    the output on failure, as :func:`torchrun`."""
    import tempfile

    fd, spec = tempfile.mkstemp(prefix="jobs_", suffix=".json", dir=spec_dir)
    with os.fdopen(fd, "w") as fh:
        json.dump([{"job": name, "argv": [str(a) for a in argv]} for name, argv in jobs], fh)
    try:
        if plain:
            assert nproc == 1, "a plain harness process is one rank"
            full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
            for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                full_env.pop(var, None)
            proc = subprocess.run([sys.executable, str(HARNESS), spec], cwd=REPO, env=full_env, capture_output=True,
                                  text=True, timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"harness {spec} failed with {proc.returncode}\n--- stdout ---\n"
                                     f"{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
        else:
            proc = torchrun(HARNESS, nproc, [spec], timeout=timeout, env=env)
        assert os.path.exists(spec + ".done"), f"the harness ended without finishing its jobs:\n{proc.stdout[-4000:]}"
        for line in proc.stderr.splitlines():  # each job's thread counts (pytest -s shows them)
            if line.startswith("[harness]"):
                print(line, file=sys.stderr)
        return proc
    finally:
        for path in (spec, spec + ".done"):
            if os.path.exists(path):
                os.remove(path)


# ---- the CPU demo's files, built once per test process --------------------------------------------------

_DEMO_TEMPLATE: dict[str, str] = {}


def seed_demo_dir(out: str | os.PathLike) -> None:
    """Put the CPU demo's tiny model and prompt files into ``out`` (when it holds no model yet), copied from
    one set built in this process with the function ``scripts/run_demo_cpu.sh`` runs first
    (``megatron_rl.data.synthetic.prepare``, default arguments: the same files, byte for byte). That step
    then finds them and keeps them, so a launch skips a new interpreter's torch + transformers import and the
    model build (~4 s idle, ~8 s on busy cores), about twenty times in the suite. The step's own build
    is tested in tests/data/test_synthetic.py and by every launch of the demo script outside the tests."""
    import shutil
    import tempfile

    from megatron_rl.data import synthetic

    if os.path.isfile(os.path.join(out, "model", "config.json")):
        return
    if "dir" not in _DEMO_TEMPLATE:
        template = tempfile.mkdtemp(prefix="mrl_demo_template_")
        synthetic.prepare(template)
        _DEMO_TEMPLATE["dir"] = template
        import atexit

        atexit.register(shutil.rmtree, template, True)
    template = _DEMO_TEMPLATE["dir"]
    os.makedirs(out, exist_ok=True)
    shutil.copytree(os.path.join(template, "model"), os.path.join(out, "model"))
    for name in ("prompts.jsonl", "eval.jsonl"):
        shutil.copyfile(os.path.join(template, name), os.path.join(out, name))


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


def launch_async_run(hf: str, tmp_path: Path, out: Path, url: str, flags: list[str], *, prompts: int,
                     env_extra: dict | None = None) -> subprocess.Popen:
    """``python -m megatron_rl.train`` on 2 torchrun ranks against the SGLang server at ``url`` (token-id prompts,
    a parity reward on the last token, the disk transport, checkpoints every 2 steps under ``out/ckpt``) in a
    session of its own, output appended to ``<out>.log``; ``flags``: the run's own (async mode, sizes)."""
    prompt_file = tmp_path / "prompts.jsonl"
    if not prompt_file.exists():
        prompt_file.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n"
                                       for i in range(prompts)))
        (tmp_path / "parity_reward.py").write_text("def score(sample):\n    return float(sample.response_ids[-1] % 2)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tmp_path),
           **(env_extra or {})}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    log = open(f"{out}.log", "a")
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(out), "--nproc-per-node", "2",
         "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "megatron_rl.train", "--hf-checkpoint", hf, "--actor-num-gpus-per-node", "2",
         "--prompt-data", str(prompt_file), "--custom-rm-path", "parity_reward:score", "--lr", "1e-2",
         "--rollout-backend", "sglang", "--rollout-engine-urls", url,
         "--update-weight-transport", "disk", "--update-weight-disk-dir", str(out) + ".weights",
         "--save", str(out / "ckpt"), "--save-interval", "2", "--output-dir", str(out), *flags],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finished_run(proc: subprocess.Popen, out, timeout: float) -> str:
    """The output of a launch from :func:`launch_async_run` once it exited 0 (its tree killed on a hang)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise AssertionError(f"hung\n{open(f'{out}.log').read()[-6000:]}") from None
    text = open(f"{out}.log").read()
    assert rc == 0, text[-6000:]
    return text


class InThread:
    """``fn()`` in a thread; ``result()`` joins it (a hang bound of ``bound_s``) and re-raises what it raised."""

    def __init__(self, fn, bound_s: float = 300, what: str = "the call"):
        self.out: dict = {}
        self.bound_s, self.what = bound_s, what
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            self.out["error"] = exc

    def result(self):
        self.thread.join(self.bound_s)
        assert not self.thread.is_alive(), f"{self.what} did not return"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]


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


def hf_response_logprobs(hf_dir: str, samples) -> list:
    """HF transformers' full-sequence log-softmax (float64) of each sample's response tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    for s in samples:
        p = len(s.prompt_ids)
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
        out.append(torch.log_softmax(logits.double(), -1)[p - 1:-1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


def loss_token_error(want, got, samples) -> float:
    """Max |want - got| over the response tokens that carry loss; asserts the others (tool observations) read
    exactly 0.0: the backends never compute their logits (backends/loss_rows.py)."""
    import torch

    worst = 0.0
    for w, g, s in zip(want, got, samples):
        g = torch.tensor(g, dtype=torch.float64)
        keep = torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.bool)
        assert not g[~keep].any(), "a token without loss got a log-prob: its logits were computed"
        worst = max(worst, (w - g)[keep].abs().max().item() if keep.any() else 0.0)
    return worst


def check_logprobs_against_hf(hf_dir: str, samples, logprobs, tol: float = 1e-5) -> None:
    """A backend's response log-probs of ``samples`` equal HF transformers' at every token that carries loss, and
    are exactly 0.0 at the ones that carry none; the batch must hold some of those, or this proves nothing."""
    worst = loss_token_error(hf_response_logprobs(hf_dir, samples), logprobs, samples)
    assert worst < tol, worst
    assert any(0 in s.loss_mask for s in samples), "the batch has no token without loss"
