"""Worker for tests/dist/test_freeze_ranks.py: each training rank frozen in turn at each phase of a step.

Job ``freeze`` of tests/dist/harness.py (2 ranks): argv = OUT_DIR

A case is (phase, frozen rank). Its collectives run in a world of their own: a gloo group of both ranks
made for the case (the bound ``--distributed-timeout-minutes 0.005``, 0.3 s, through ``infra.collective_watch``,
from the freeze point on: ``Freezer``) and made the default group while the case runs, so the production code's
collectives (``group=None``) and the roll call's store keys are the case's, and the harness's group is
untouched whatever the case leaves in its own. The frozen rank stops itself with SIGSTOP at the phase's
point; the other rank runs the phase through the production code (``collective_watch.watched``, and for
the save and the resume ``CheckpointSaver.save`` and ``Resumer.resume_or_init`` over a backend double that
publishes and loads real files with ``publish_collectively`` and ``read_complete_marker``), records the
error it ended with and the checkpoint root, and sends the frozen rank SIGCONT; the resumed rank unwinds with :class:`Frozen` (an interrupt, which the save's
publish passes on without agreeing) and records nothing. Phases:

* ``train_step``: the step's gradient all-reduce (``dist.all_reduce``), frozen before it;
* ``weight_sync``: the export's gather to the sending rank and its broadcast, frozen before them;
* ``checkpoint_save``: ``CheckpointSaver.save`` of step 2, frozen in the middle of the backend's write;
* ``resume``: ``Resumer.resume_or_init``, frozen in the middle of the backend's load.

Before the cases, step 1 is saved whole (the harness's group, its 300 s bound); after them every rank
resumes from the root (the harness's group): the latest published checkpoint loads. Each rank writes
OUT_DIR/rank{R}.json: ``{case: {"type", "message", "missing", "root"}}`` for the cases it ran as the
rank that waited, and ``"final_resume"``.
"""

import json
import os
import signal
import time
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rl.config import parse_config
from megatron_rl.infra import checkpoint_root as ckpt
from megatron_rl.infra import collective_watch
from megatron_rl.infra.dist import all_ranks_ok
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.infra.wall_time import WallClock
from megatron_rl.runner.checkpoints import CheckpointCursor, CheckpointSaver
from megatron_rl.runner.resume import Resumer

FORMAT = "freeze_test"
MINUTES = 0.005  # the cases' bound: 0.3 s
PHASES = ("train_step", "weight_sync", "checkpoint_save", "resume")
STOP_BOUND_S = 120.0  # a hang bound on seeing the frozen rank stopped (it stops itself at once)
FIXES = {k: "" for k in ("missing", "temp", "root", "unmarked", "json", "format", "files")}


class Frozen(KeyboardInterrupt):
    """The frozen rank, resumed, leaves the phase it was frozen in (an interrupt: nothing agrees on it)."""


class Freezer:
    """Where the case's frozen rank stops itself; the other rank, at the same point, waits until it is stopped
    (its /proc state) and only then gives the case's group the short bound: the collectives before the point
    ran under the harness's 300 s whatever the machine's load, the ones after it are those the frozen rank
    never joins, so what the waiting rank ends with follows from the state, not from timing."""

    def __init__(self, phase: str = "", frozen: int = -1, pids: tuple = ()) -> None:
        self.phase, self.frozen, self.pids = phase, frozen, pids

    def point(self, phase: str) -> None:
        if phase != self.phase:
            return
        if dist.get_rank() == self.frozen:
            os.kill(os.getpid(), signal.SIGSTOP)
            raise Frozen(phase)
        wait_stopped(self.pids[self.frozen])
        c10d._set_pg_timeout(collective_watch.timeout())  # the case's group (the default while the case runs)


class PublishingBackend:
    """What ``CheckpointSaver`` and ``Resumer`` need of a backend: ``save`` publishes each rank's file and the
    extra state (rank 0) with ``publish_collectively``; ``load`` checks the marker's files on every rank,
    agreed (``all_ranks_ok``), and returns the extra state."""

    def __init__(self, freezer: Freezer) -> None:
        self.freezer = freezer

    def save(self, path: str, extra: dict) -> None:
        rank = dist.get_rank()

        def write(tmp: str) -> None:
            with open(os.path.join(tmp, f"rank{rank}.bin"), "wb") as fh:
                fh.write(f"rank {rank} of {path}\n".encode() * 64)
            self.freezer.point("checkpoint_save")  # the rank's part half written, the other's on disk
            if rank == 0:
                with open(os.path.join(tmp, "extra.json"), "w") as fh:
                    json.dump(extra, fh)

        publish_collectively(path, write, seal=lambda tmp: {"format": FORMAT})

    def load(self, path: str) -> dict:
        error = None
        try:
            ckpt.read_complete_marker(path, (FORMAT,), "checkpoint", FIXES)
            self.freezer.point("resume")
        except ckpt.CheckpointError as e:
            error = e
        all_ranks_ok(error, reraise_own=True)
        with open(os.path.join(path, "extra.json")) as fh:
            return json.load(fh)


def root_state(root: str) -> dict:
    """What a relaunch finds under the root: the pointer, the newest complete iteration, the candidates."""
    return {"latest": ckpt.read_latest(root), "newest_complete": ckpt.find_latest_complete(root),
            "candidates": ckpt.resume_candidates(root), "entries": sorted(os.listdir(root))}


def run_phase(phase: str, cfg, freezer: Freezer) -> None:
    backend = PublishingBackend(freezer)
    if phase == "train_step":
        with collective_watch.watched(collective_watch.TRAIN_STEP):
            freezer.point(phase)
            dist.all_reduce(torch.ones(1024))
    elif phase == "weight_sync":
        with collective_watch.watched(collective_watch.WEIGHT_SYNC):
            freezer.point(phase)
            shard = torch.full((256,), float(dist.get_rank()))
            gathered = [torch.empty(256) for _ in range(2)] if dist.get_rank() == 0 else None
            dist.gather(shard, gathered, dst=0)
            dist.broadcast(torch.ones(16), src=0)
    elif phase == "checkpoint_save":
        saver = CheckpointSaver(cfg, CheckpointCursor(), WallClock(None, 0.0), SimpleNamespace(wandb_run_id=None),
                                dist.get_rank() == 0)
        saver.save(backend, None, 2)
    elif phase == "resume":
        Resumer(cfg, CheckpointCursor()).resume_or_init(backend, None)


def wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + STOP_BOUND_S
    while True:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"hung: the frozen rank (pid {pid}) did not stop within {STOP_BOUND_S} s")
        time.sleep(0.01)


def main(argv):
    out = argv[0]
    rank = dist.get_rank()
    root = os.path.join(out, "save")
    hf = argv[1]
    cfg = parse_config(["--hf-checkpoint", hf, "--save", root, "--save-interval", "1", "--actor-num-gpus-per-node", "2"])
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    saver = CheckpointSaver(cfg, CheckpointCursor(), WallClock(None, 0.0), SimpleNamespace(wandb_run_id=None),
                            rank == 0)
    saver.save(PublishingBackend(Freezer()), None, 1)  # the harness's group: step 1 complete before any freeze
    harness_group = c10d._get_default_group()
    results: dict = {}
    try:
        collective_watch.configure(MINUTES)
        for phase in PHASES:
            for frozen in range(2):
                case = f"{phase}:rank{frozen}"
                group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
                c10d._update_default_pg(group)  # the case's world: production code's group=None is this one
                try:
                    run_phase(phase, cfg, Freezer(phase, frozen, tuple(pids)))
                    if rank != frozen:
                        results[case] = {"type": "ok"}
                except Frozen:
                    pass  # resumed: the other rank is done with the case
                except Exception as e:  # noqa: BLE001 - recorded: the test reads what the waiting rank saw
                    results[case] = {"type": type(e).__name__, "message": str(e),
                                     "missing": list(getattr(e, "missing_ranks", ())), "root": root_state(root)}
                finally:
                    c10d._update_default_pg(harness_group)
                if rank != frozen:
                    os.kill(pids[frozen], signal.SIGCONT)  # stopped: its Freezer.point saw it
                dist.barrier()  # the harness's group: both ranks are past the case
                dist.destroy_process_group(group)
    finally:
        collective_watch.configure(collective_watch.DEFAULT_MINUTES)
    results["final_resume"] = {"step": Resumer(cfg, CheckpointCursor()).resume_or_init(
        PublishingBackend(Freezer()), None), "root": root_state(root)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
