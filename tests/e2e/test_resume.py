"""Resume of the real RL loop (the CPU demo: torchrun, 2 gloo ranks, megatron-core DP2, embedded engine).

a. exact resume: N=4 straight vs N=2 then the same command with N=4 -> steps 3-4
   have identical metrics (every float, bit for bit) and the final iter_4
   checkpoints hold identical model, optimizer, scheduler, RNG and data state
   (the N=2 half generates with the driver's engine alone, the rest with a replica
   on every rank: steps 1-2 equal too);
b. SIGKILL of the whole process tree (i) during start-up, (ii) in the middle of a
   save, (iii) right after a checkpoint was published: no partial checkpoint is
   ever visible as complete, every rerun resumes from the newest complete one, and
   the final checkpoint equals the uninterrupted run's bit for bit;
c. wall time: the loop saves step 1, says why it stopped and exits with
   EXIT_WALL_TIME; rerunning without the limit finishes from step 1 (again equal
   to the uninterrupted run).

Killing: torchrun starts every worker in its OWN session (start_new_session=True in
torch.distributed.elastic's SubprocessHandler), so killing the launched process
group alone leaves the workers running (they keep training and saving). The test
therefore freezes (SIGSTOP) and then SIGKILLs every process group of the launched
tree: the script's own group and each worker's.

numpy's global RNG is seeded by ``initialize_parallel`` like python's and torch's,
so it is compared with the rest of the RNG state; the tests also check that a
resumed run carries the checkpointed numpy state on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from _util import PausePoint, _alive, _tree, free_port, seed_demo_dir
from megatron_rl.backends.megatron.checkpoint import EXTRA_STATE_NAME, read_checkpoint_metadata
from megatron_rl.infra import checksum
from megatron_rl.infra.checkpoint_root import (MARKER_NAME, find_latest_complete, is_temp_dir,
                                               iter_dir, list_iterations, read_latest, read_resume_state)
from megatron_rl.infra.tracking import final_lineage
from megatron_rl.infra.wall_time import EXIT_WALL_TIME
from megatron_rl.rollout import rollout_ckpt

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_TIMEOUT = 420  # one demo launch; a few rollouts take ~30-60 s on 2 busy cores
OPT_STEPS_PER_ROLLOUT = 2  # 32 prompts x 8 samples, --global-batch-size 128
KEYS = ("rollout/reward_mean", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm")


# ---- launching and killing ------------------------------------------------------------------------


def _procs_using(path: str) -> list[int]:
    """Live processes whose command line names ``path`` (a test-unique tmp dir: only ours)."""
    needle = path.encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    if needle in fh.read() and _alive(int(name)):
                        out.append(int(name))
            except OSError:
                pass
    return out


class Demo:
    """``scripts/run_demo_cpu.sh`` in its own session; output to a log file (no pipe to fill)."""

    count = 0

    def __init__(self, out, num_rollout: int, *extra: str, env: dict | None = None):
        Demo.count += 1
        self.out = str(out)
        self.log_path = f"{self.out}.launch{Demo.count}.log"
        seed_demo_dir(self.out)
        self.metrics_before = len(metrics(out))
        env = {**os.environ, "OUT": self.out, "NUM_ROLLOUT": str(num_rollout), "PY": sys.executable,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(free_port()), **(env or {})}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(["bash", "scripts/run_demo_cpu.sh", *extra], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.t0 = time.monotonic()

    @property
    def output(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()

    def tail(self) -> str:
        return self.output[-6000:]

    def new_records(self) -> list[dict]:
        return metrics(self.out)[self.metrics_before:]

    def kill(self) -> None:
        """SIGKILL every process group of the launched tree (frozen first, so nothing moves in between)."""
        pids = _tree(self.proc.pid)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            if sig == signal.SIGKILL:
                pids = list(dict.fromkeys(pids + _tree(self.proc.pid)))  # anything spawned meanwhile
            groups = set()
            for pid in pids:
                try:
                    groups.add(os.getpgid(pid))
                except ProcessLookupError:
                    pass
            for pgid in groups:
                if pgid in pids:  # the script's group and each worker's session: all ours
                    os.killpg(pgid, sig)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=120)  # a hang bound on reaping the SIGKILLed launcher
        deadline = time.monotonic() + 120  # a hang bound
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "killed processes still alive"
        stray = _procs_using(self.out)
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
        assert not stray, f"processes of {self.out} outside the killed tree: {stray}"

    def kill_group_at(self, point: PausePoint, timeout: float = LAUNCH_TIMEOUT) -> None:
        """``kill -9 -PGID`` of the launch script (which ``exec``s the launcher) once its driver is paused at
        ``point``: only the launcher is in that group (torchrun starts each worker in a session of its own);
        every rank and engine must die with it (``PR_SET_PDEATHSIG``). Was: they trained on to the end of
        the run. Fails (after cleaning up) if any process of the tree or of the run lives on."""
        pids: list[int] = []
        try:
            point.wait(self.proc, timeout=timeout, output=self.tail)  # the timeout only bounds a hang
            pids = _tree(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=120)  # a hang bound on reaping the SIGKILLed launcher
            deadline = time.monotonic() + 120  # a hang bound: the kernel sends the death signals at once
            while any(_alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [p for p in pids if _alive(p)] + _procs_using(self.out)
            assert not left, f"processes outlived the killed launch group: {left}"
        finally:
            if self.proc.poll() is None:
                self.kill()
            for pid in [p for p in pids if _alive(p)] + _procs_using(self.out):
                os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"demo did not finish in {timeout}s\n{self.tail()}") from None

    def kill_at(self, point: PausePoint, timeout: float = LAUNCH_TIMEOUT) -> None:
        """SIGKILL the run (launched with ``env=point.env``) once its driver is paused at ``point``.

        Was: poll the file system for a sign of the moment and SIGKILL then; on a busy machine the
        run had moved on in between (the save published, the next step trained)."""
        try:
            point.wait(self.proc, timeout=timeout, output=self.tail)  # the timeout only bounds a hang
        finally:
            self.kill()


def run_demo(out, num_rollout: int, *extra: str, expect_rc: int = 0) -> Demo:
    demo = Demo(out, num_rollout, *extra)
    rc = demo.wait()
    assert rc == expect_rc, f"exit code {rc}, expected {expect_rc}\n{demo.tail()}"
    return demo


def metrics(out) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def train_steps(records) -> list[int]:
    return [r["step"] for r in records if "train/pg_loss" in r]


def stable(record: dict) -> dict:
    """A metrics record without wall-clock values (timestamps, durations)."""
    return {k: v for k, v in record.items()  # attempt: which launch wrote it (metrics.jsonl's bookkeeping)
            if k not in ("time", "attempt") and not k.endswith("time_s") and not k.startswith("perf/")}  # perf/*: phase timers


def by_step(records) -> dict[int, dict]:
    return {r["step"]: stable(r) for r in records if "train/pg_loss" in r}


# ---- checkpoint contents ----------------------------------------------------------------------------


def load_torch_dist(path: str, scratch) -> dict:
    """Every item of a torch_dist dir, read with torch's own reader (no process group, no megatron)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(str(scratch), re.sub(r"\W", "_", path) + ".pt")
    dcp_to_torch_save(path, target)
    state = torch.load(target, weights_only=False)
    os.remove(target)
    return state


def _diff(a, b, where: str = "") -> list[str]:
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _rng(value) -> dict:
    (state,) = value  # one ShardedObject per rank
    return state


def assert_same_checkpoint(a: str, b: str, scratch, expected_diffs=()) -> None:
    """Bitwise: model + optimizer tensors, python/torch/megatron RNG of every rank, common and extra state.
    ``expected_diffs``: the exact list of differences there must be (anything else fails)."""
    sa, sb = load_torch_dist(a, scratch), load_torch_dist(b, scratch)
    assert sa.keys() == sb.keys()
    model = [k for k in sa if torch.is_tensor(sa[k]) and not k.startswith("optimizer.")]
    moments = [k for k in sa if k.startswith(("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."))]
    assert "embedding.word_embeddings.weight" in model and len(moments) == 2 * len(model) > 0
    rng = sorted(k for k in sa if k.startswith("megatron_rl.rng_state/"))
    assert len(rng) == 2  # one per rank
    diffs = []
    for k in sa:
        if k in rng:
            ra, rb = _rng(sa[k]), _rng(sb[k])
            assert {"random", "numpy", "torch", "tracker"} <= set(ra)
            diffs += _diff(ra, rb, k)
        else:
            diffs += _diff(sa[k], sb[k], k)
    common = [torch.load(os.path.join(p, "common.pt"), weights_only=False) for p in (a, b)]
    diffs += _diff(common[0], common[1], "common.pt")
    extra = [json.load(open(os.path.join(p, EXTRA_STATE_NAME))) for p in (a, b)]
    diffs += _diff(extra[0], extra[1], EXTRA_STATE_NAME)
    assert diffs == list(expected_diffs), f"{a} vs {b}: {diffs[:20]}"


def numpy_rng(path: str, scratch) -> list:
    state = load_torch_dist(path, scratch)
    return [_rng(state[k])["numpy"] for k in sorted(state) if k.startswith("megatron_rl.rng_state/")]


def assert_no_partial_checkpoint_visible(root: str, scratch) -> list[int]:
    """Every published iter_* dir is complete, passes the checkpoint's own validation and loads in full;
    resume picks the newest of them; the tracker files never point past it. Returns the iterations."""
    steps = list_iterations(root)
    for step in steps:
        path = iter_dir(root, step)
        assert os.path.isfile(os.path.join(path, MARKER_NAME)), f"{path} published without {MARKER_NAME}"
        meta = read_checkpoint_metadata(path)  # marker + every listed file present with its size
        assert meta["optimizer_steps"] == OPT_STEPS_PER_ROLLOUT * step
        with open(os.path.join(path, EXTRA_STATE_NAME)) as fh:
            assert json.load(fh)["rollout_id"] == step
        state = load_torch_dist(path, scratch)  # every tensor and object readable
        assert torch.is_tensor(state["embedding.word_embeddings.weight"])
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".iter_"):
                assert is_temp_dir(os.path.join(root, name)) and os.path.isdir(os.path.join(root, name)), name
    assert find_latest_complete(root) == (steps[-1] if steps else None)
    if os.path.isdir(root):
        latest = read_latest(root)
        assert latest is None or latest in steps
        state = read_resume_state(root)
        if state is not None:
            assert state["rollout_id"] in steps and state["checkpoint"] == iter_dir(root, state["rollout_id"])
    return steps


# ---- the uninterrupted reference ------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight_and_stored(tmp_path_factory):
    """The uninterrupted run (N=4, a checkpoint every 2 rollouts), and its run dir as it stood while its driver was
    paused once rollout 2 was stored beside checkpoint 2 (pause point ``rollout_stored:rollout_2``; rank 1 waits
    in a collective meanwhile, so nothing moves): the files a SIGKILL at that moment leaves, without a launch of
    its own killed there (the kills themselves: test_sigkill_at_startup_mid_save_and_after_publish). Returns
    (the finished run's dir, the stopped copy's dir). The copy is put back at the run's own path once the run
    finished (the finished run moves aside): a stored rollout is used only under the rollout flags it was
    generated with, --hf-checkpoint and --prompt-data included, which the demo script keeps under $OUT."""
    base = tmp_path_factory.mktemp("straight")
    out, paused, finished = base / "demo", base / "paused", base / "finished"
    point = PausePoint(base / "pause", "rollout_stored:rollout_2")
    demo = Demo(out, 4, "--save-interval", "2", env=point.env)
    try:
        point.wait(demo.proc, output=demo.tail)  # the timeout only bounds a hang
        # what a SIGKILL here would leave, checked in place: rollout 2 sealed beside the one complete checkpoint
        root = str(out / "ckpt")
        path = os.path.join(root, "rollout_ckpts", "rollout_2.pt")
        assert os.path.exists(path) and open(path, "rb").read().startswith(checksum.BYTES_MAGIC)
        assert train_steps(metrics(out)) == [1, 2]  # rollout 2 (logged as step 3) was never trained
        assert assert_no_partial_checkpoint_visible(root, base) == [2]
        shutil.copytree(out, paused, symlinks=True)  # with the files' times: resume tells its checkpoints by them
    except BaseException:
        demo.kill()
        raise
    finally:
        point.release()
    rc = demo.wait()
    assert rc == 0, f"exit code {rc}\n{demo.tail()}"
    assert train_steps(metrics(out)) == [1, 2, 3, 4]
    os.rename(out, finished)
    os.rename(paused, out)
    return finished, out


@pytest.fixture(scope="module")
def straight(straight_and_stored):
    return straight_and_stored[0]


# ---- a. exact resume ---------------------------------------------------------------------------------


def test_resumed_run_equals_uninterrupted_run_bitwise(straight, tmp_path):
    out = tmp_path / "demo"
    # the first half generates with the driver's engine alone (the straight run: a replica on each of the 2
    # ranks, --embedded-engine-ranks auto): its steps 1-2 equal the straight run's, so the replicas draw the
    # samples one engine draws (tests/dist/test_engine_replicas.py: tokens exactly, log-probs within float32
    # rounding, since a CPU's GEMM may round a smaller batch otherwise; on the demo's shapes every metric of
    # both steps has been the same bits on an AVX2 EPYC and an AVX-512 Xeon)
    run_demo(out, 2, "--save-interval", "2", "--embedded-engine-ranks", "driver")
    assert sorted(os.listdir(out / "ckpt")) == [".megatron_rl.lock", "iter_0000002",
                                                "latest_checkpointed_iteration.txt", "resume_state.json"]
    second = run_demo(out, 4, "--save-interval", "2")
    assert f"resumed from {out / 'ckpt' / 'iter_0000002'} at rollout 2" in second.output
    new = second.new_records()
    assert new[0]["step"] == 2 and new[0]["sync/weight_version"] == 2.0  # engine re-synced from the checkpoint
    assert train_steps(new) == [3, 4]

    ref, got = by_step(metrics(straight)), by_step(metrics(out))
    for step in (3, 4):
        assert set(KEYS) <= set(ref[step])
        assert got[step] == ref[step], (step, {k: (ref[step].get(k), got[step].get(k))
                                               for k in set(ref[step]) | set(got[step])
                                               if ref[step].get(k) != got[step].get(k)})
    for step in (1, 2):  # the first half is the same run (the N=2 run also evaluated at its last step)
        assert {k: v for k, v in got[step].items() if not k.startswith("eval/")} == ref[step]
    assert ref[4]["train/pg_loss"] != ref[3]["train/pg_loss"]  # the steps do differ

    # iter_2: the N=2 run's LR decay spans its own 4 optimizer steps (a constant LR here, so no numeric effect)
    assert_same_checkpoint(iter_dir(str(straight / "ckpt"), 2), iter_dir(str(out / "ckpt"), 2), tmp_path,
                           expected_diffs=["common.pt/opt_param_scheduler/lr_decay_steps: 8 != 4"])
    # iter_4: after the resume the schedule is the N=4 command's (checkpoint.load_scheduler_state), all else equal
    assert_same_checkpoint(iter_dir(str(straight / "ckpt"), 4), iter_dir(str(out / "ckpt"), 4), tmp_path)
    # numpy is restored too: the resumed process ends with the saved state
    assert numpy_rng(iter_dir(str(out / "ckpt"), 4), tmp_path) == numpy_rng(iter_dir(str(out / "ckpt"), 2),
                                                                             tmp_path)
    state = read_resume_state(str(out / "ckpt"))
    assert state["rollout_id"] == 4 and state["checkpoint"] == iter_dir(str(out / "ckpt"), 4)


# ---- b. SIGKILL -------------------------------------------------------------------------------------


def test_sigkill_at_startup_mid_save_and_after_publish(straight, tmp_path):
    out = tmp_path / "demo"
    root = str(out / "ckpt")
    cmd = (out, 4, "--save-interval", "1")

    # (i) start-up: the driver's tracker exists (RunContext.create), the model is not built yet
    point = PausePoint(tmp_path / "pause", "context_created")
    Demo(*cmd, env=point.env).kill_at(point)
    assert os.path.exists(out / "metrics.jsonl")
    assert assert_no_partial_checkpoint_visible(root, tmp_path) == []
    assert not os.path.isdir(root) or os.listdir(root) == [".megatron_rl.lock"]  # the run's lock, nothing else
    assert train_steps(metrics(out)) == []

    # (ii) in the middle of the save of iteration 2 (every rank's files in its temp dir, no marker, nothing
    # published yet)
    tmp2 = os.path.join(root, ".iter_0000002.tmp")
    point = PausePoint(tmp_path / "pause", "publish_written:iter_0000002")
    demo = Demo(*cmd, env=point.env)
    demo.kill_at(point)
    assert os.path.isdir(tmp2) and not os.path.exists(iter_dir(root, 2)), os.listdir(root)
    assert assert_no_partial_checkpoint_visible(root, tmp_path) == [1]
    new = demo.new_records()
    assert new[0]["step"] == 0 and train_steps(new) == [1, 2]  # a fresh start: nothing to resume from

    # (iii) right after iteration 3 was published (the tracker files still say 2), by `kill -9 -PGID` of the
    # launch script alone: the ranks and their engines die with the launcher
    point = PausePoint(tmp_path / "pause", "published:iter_0000003")
    demo = Demo(*cmd, env=point.env)
    demo.kill_group_at(point)
    assert read_latest(root) == 2
    assert f"resumed from {iter_dir(root, 1)} at rollout 1" in demo.output
    new = demo.new_records()
    assert new[0]["step"] == 1 and train_steps(new) == [2, 3]
    steps = assert_no_partial_checkpoint_visible(root, tmp_path)
    assert steps[-1] == 3 and 2 in steps
    assert not os.path.exists(tmp2)  # the interrupted save was redone and published

    # to completion: resumes from 3, the newest COMPLETE checkpoint, whatever the tracker files said
    final = run_demo(*cmd)
    assert f"resumed from {iter_dir(root, 3)} at rollout 3" in final.output
    new = final.new_records()
    assert new[0]["step"] == 3 and train_steps(new) == [4]
    assert assert_no_partial_checkpoint_visible(root, tmp_path) == [3, 4]  # --save-max-to-keep 2
    assert [n for n in os.listdir(root) if n.startswith(".iter_")] == []  # no temp dir left behind
    assert read_latest(root) == 4
    state = read_resume_state(root)
    assert state["rollout_id"] == 4 and state["checkpoint"] == iter_dir(root, 4)
    # three crashes later, the same model, optimizer, RNG and data state as the uninterrupted run
    assert_same_checkpoint(iter_dir(str(straight / "ckpt"), 4), iter_dir(root, 4), tmp_path)
    ref = by_step(metrics(straight))
    assert {s: r for s, r in by_step(new).items()} == {4: ref[4]}
    # metrics.jsonl: step 2 was trained twice (by launches ii and iii: attempts 1 and 2, launch i logged nothing);
    # the records the resumes rolled back are marked superseded, and what is left (the run's curve) is one
    # record a step, the uninterrupted run's
    records = metrics(out)
    assert [r["attempt"] for r in records] == sorted(r["attempt"] for r in records) and records[-1]["attempt"] == 3
    assert [(r["attempt"], r["step"]) for r in records if r.get("superseded") and "train/pg_loss" in r] == [(1, 2)]
    lineage = final_lineage(records)
    assert train_steps(lineage) == [1, 2, 3, 4]
    assert by_step(lineage) == ref


def test_stopped_after_rollout_was_generated_resumes_without_regenerating_it(straight_and_stored, tmp_path):
    """Stopped once rollout 2 was generated (rollout_ckpts/rollout_2.pt, written right after iter_2) and before
    its training finished (the files as they stood at that moment: ``straight_and_stored``): the rerun loads
    rollout 2 instead of calling the engine, and ends bitwise equal."""
    straight, out = straight_and_stored
    root = str(out / "ckpt")
    stored = os.path.join(root, "rollout_ckpts", "rollout_2.pt")
    assert train_steps(metrics(out)) == [1, 2]
    generated = rollout_ckpt.read_rollout_file(stored)  # checksum checked (the file is sealed)

    final = run_demo(out, 4, "--save-interval", "2")
    assert f"resumed from {iter_dir(root, 2)} at rollout 2" in final.output
    assert f"rollout 2: loaded from {stored}, not regenerated" in final.output
    new = final.new_records()
    assert train_steps(new) == [3, 4]
    # the killed run's own generation time: the metrics came from the file, not from a new generation
    assert next(r for r in new if r["step"] == 3)["rollout/time_s"] == generated["metrics"]["rollout/time_s"]
    ref = by_step(metrics(straight))
    assert by_step(new) == {3: ref[3], 4: ref[4]}
    assert_same_checkpoint(iter_dir(str(straight / "ckpt"), 4), iter_dir(root, 4), tmp_path)
    assert sorted(os.listdir(os.path.join(root, "rollout_ckpts"))) == ["rollout_2.pt"]  # iter_2, iter_4 kept


# ---- c. wall time -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wall_stop(tmp_path_factory):
    """The demo with a limit whose reserve is already reached after step 1 (run once, checked by two tests)."""
    out = tmp_path_factory.mktemp("wall") / "demo"
    demo = Demo(out, 4, "--wall-time-limit", "1000", "--wall-time-reserve", "999")
    rc = demo.wait()
    return out, demo, rc


def test_wall_time_stop_saves_step_1_and_rerun_finishes(wall_stop, straight, tmp_path):
    out, demo, rc = wall_stop
    root = str(out / "ckpt")
    assert rc != 0, demo.tail()  # stopped early, not a normal finish
    assert re.search(r"stopping early: wall time: \d+s left of --wall-time-limit 1000s, under "
                     r"--wall-time-reserve 999s; relaunch the same command to resume", demo.output), demo.tail()
    assert "curves:" not in demo.output  # the script did not carry on as after a finished run
    assert train_steps(metrics(out)) == [1]
    assert assert_no_partial_checkpoint_visible(root, tmp_path) == [1]  # saved by the stop (interval is 50)
    state = read_resume_state(root)
    assert state["rollout_id"] == 1 and state["checkpoint"] == iter_dir(root, 1) and state["elapsed_s"] > 0

    final = run_demo(out, 4)
    assert f"resumed from {iter_dir(root, 1)} at rollout 1" in final.output
    new = final.new_records()
    assert new[0]["step"] == 1 and train_steps(new) == [2, 3, 4]
    assert assert_no_partial_checkpoint_visible(root, tmp_path) == [1, 4]
    ref = by_step(metrics(straight))
    assert by_step(new) == {s: ref[s] for s in (2, 3, 4)}
    assert_same_checkpoint(iter_dir(str(straight / "ckpt"), 4), iter_dir(root, 4), tmp_path)


def test_wall_time_stop_exit_code(wall_stop):
    """The documented contract (megatron_rl/infra/wall_time.py): stopped on purpose -> EXIT_WALL_TIME (3)."""
    _, demo, rc = wall_stop
    assert rc == EXIT_WALL_TIME, f"exit code {rc}\n{demo.tail()}"
