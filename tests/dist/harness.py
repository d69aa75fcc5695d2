"""The one worker harness of the multi-rank tests: jobs registered by name, many jobs per launch.

Usage (what ``tests/_util.py`` ``run_jobs`` launches on every rank under torchrun, or as one plain process)::

    harness.py SPEC.json

SPEC.json is a list of ``{"job": NAME, "argv": [...]}``; each job runs in order in this process on every
rank: ``JOBS[NAME]`` names the worker module under ``tests/dist/scripts/`` and its function, called with
``argv`` (its arguments as its own usage line gives them). One launch pays torchrun's start and the
interpreter's megatron-core import (~20 s on 2 cores) once for all of them.

Between jobs, on every rank: every process group but the default one is destroyed (what a job's layouts
built, with the models built on them: ``models.parallel.destroy_parallel``), the collector runs, and this
process's thread count must stay under ``THREAD_BOUND``, and must have stayed under ``PEAK_BOUND`` while the
job ran (a sampler thread); a job that leaves more (a gloo group it made and kept: each holds worker threads
until destroyed, and ~60 leaked layouts drove a 2-core machine's load average past 600) fails the launch,
naming the job, the rank, the count and the threads by name. After the last job the harness writes ``SPEC.json.done`` on rank 0 (a test can tell a finished
launch from one that died between jobs).

The default group is made here (gloo, a 300 s timeout: a hang bound that names nothing better than "a
peer did not answer" but ends the launch), so jobs share it and never destroy it.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
TESTS = os.path.dirname(HERE)  # tests/: the jobs' shared references (tests/_mtp_reference.py, ...)

# name -> (module in tests/dist/scripts, function taking the job's argv)
JOBS: dict[str, tuple[str, str]] = {
    "backend": ("backend_worker", "main"),
    "ckpt": ("ckpt_worker", "main"),
    "convert": ("convert_worker", "main"),
    "cp_attention": ("cp_attention_worker", "main"),
    "critic": ("critic_worker", "main"),
    "data_movement": ("data_movement_worker", "main"),
    "freeze": ("freeze_worker", "main"),
    "frozen": ("frozen_worker", "main"),
    "fsdp_critic": ("fsdp_critic_worker", "main"),
    "fsdp": ("fsdp_worker", "main"),
    "fsdp_teacher": ("fsdp_worker", "teacher"),
    "groups": ("groups_worker", "main"),
    "lora": ("lora_worker", "main"),
    "memory": ("memory_worker", "main"),
    "offload": ("offload_worker", "main"),
    "on_policy": ("on_policy_worker", "main"),
    "packing": ("packing_worker", "main"),
    "parity": ("parity_layouts", "main"),
    "publish": ("publish_worker", "main"),
    "replicas": ("replicas_worker", "main"),
    "reward_model": ("reward_model_worker", "main"),
    "routing": ("routing_worker", "main"),
    "vocab_parallel": ("vocab_parallel_worker", "main"),
    "vlm": ("vlm_worker", "main"),
}
# threads a rank may hold between jobs: the interpreter, torch's pools at OMP_NUM_THREADS=1, the default
# gloo group's loops and the odd helper (measured 5-20 after a job); one leaked layout adds 30-50
THREAD_BOUND = 64
# ... and while a job runs: its live layouts' groups (measured up to ~220: a 2-rank layout with its critic's);
# a job that keeps every layout of its loop passed 700
PEAK_BOUND = 400


def thread_count() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def thread_names() -> str:
    """This process's threads by name, most first (``pt_gloo_runloop`` x 120: a gloo group's workers)."""
    from collections import Counter

    names: Counter = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names[fh.read().strip()] += 1
        except OSError:
            pass
    return ", ".join(f"{name} x {n}" for name, n in names.most_common(8))


def release_groups() -> None:
    """Every process group but the default one destroyed (megatron's layouts, the models built on them and
    anything else a job made: ``models.parallel.destroy_parallel``); a job's ``--offload-train-groups``
    wrapping of ``torch.distributed`` undone, so the next job's groups are plain ones."""
    import torch.distributed as dist

    from megatron_rl.infra import reloadable_groups

    if "megatron.core" in sys.modules:
        from megatron_rl.models.parallel import destroy_parallel  # lazy: megatron-core

        destroy_parallel()
    elif dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d

        world = c10d._get_default_group()
        for group in [g for g in list(c10d._world.pg_map) if g is not world]:
            dist.destroy_process_group(group)
    if reloadable_groups.installed():
        reloadable_groups.uninstall()


class PeakThreads:
    """The most threads this process held while a job ran (sampled every 0.2 s by a daemon thread): a job
    that leaks layouts inside its own loop (a model or group per case) shows here, not between jobs."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="harness-peak", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, thread_count())

    def reset(self) -> int:
        peak, self.peak = max(self.peak, thread_count()), 0
        return peak


def run(spec_path: str) -> None:
    import torch.distributed as dist

    for path in (TESTS, SCRIPTS):
        if path not in sys.path:
            sys.path.insert(0, path)
    with open(spec_path) as fh:
        spec = json.load(fh)
    unknown = [j["job"] for j in spec if j["job"] not in JOBS]
    if unknown:
        raise SystemExit(f"harness: unknown job(s) {unknown}; registered: {sorted(JOBS)}")
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    else:  # one plain process: a world of one on a private store (nothing in os.environ for its children)
        from megatron_rl.infra.ports import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    peaks = PeakThreads()
    for i, entry in enumerate(spec):
        t0 = time.monotonic()
        module, func = JOBS[entry["job"]]
        getattr(importlib.import_module(module), func)(list(entry.get("argv", [])))
        release_groups()
        gc.collect()
        peak = peaks.reset()
        n = thread_count()
        if peak > PEAK_BOUND:
            raise RuntimeError(f"harness: job {i} ({entry['job']} {' '.join(entry.get('argv', []))[:200]}) held "
                               f"{peak} threads on rank {rank} while it ran (bound {PEAK_BOUND}): it keeps what each "
                               f"case of its loop builds (now {n}: {thread_names()})")
        if n > THREAD_BOUND:
            raise RuntimeError(f"harness: job {i} ({entry['job']} {' '.join(entry.get('argv', []))[:200]}) left "
                               f"{n} threads on rank {rank} (bound {THREAD_BOUND}: {thread_names()}): a process "
                               "group, pool or server it started was not released")
        if rank == 0:
            print(f"[harness] job {i} {entry['job']} done in {time.monotonic() - t0:.1f} s: {n} threads ({peak} at "
                  f"most while it ran) {' '.join(entry.get('argv', []))[:160]}",
                  file=sys.stderr, flush=True)
        dist.barrier()
    if rank == 0:
        with open(spec_path + ".done", "w") as fh:
            fh.write("ok\n")


if __name__ == "__main__":
    run(sys.argv[1])
