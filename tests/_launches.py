"""Launches shared across test files (a pytest plugin, loaded by tests/conftest.py).

Why: a torchrun launch pays its start, every rank's torch + megatron-core import and the default group's
rendezvous (10-25 s on 2 cores) before its first job; most multi-rank test files made two to four launches
of their own. Files of one *launch group* (``LAUNCH_GROUPS``) put their jobs into common launches instead:
one launch per rank count and phase for the whole group, through ``tests/dist/harness.py``.

How a file takes part: it defines ``shared_launch(ctx)``, a generator. Each ``yield {nproc: [(job, argv),
...]}`` is one *phase*: the group's phase-k jobs of every file run together, one launch per rank count,
the most ranks first (4, 3, 2, 1: so a phase's jobs may load what its launches of more ranks wrote, e.g. a
1-rank reshard of a 2-rank save, without a phase, and so a launch, of their own), and the generator
resumes after all of them finished (so a file can damage a checkpoint phase 1 wrote before phase 2 loads
it). Each launch is a fresh set of processes: a resume in a later launch never shares a process with the
save it loads. What the generator returns is what its file's
fixture gets from ``shared_launch_state(request)``. ``ctx`` offers ``tmp_path_factory`` and
``tiny_hf_models``. A file whose phases run out early simply yields nothing more.

Every file of a group runs on one xdist worker (the scheduler below maps the group's files to one scope),
and the launches run once per worker session, when the group's first test asks. Only the files of the
group that this session collected take part (``pytest tests/dist/test_critic.py`` launches the critic's
jobs alone). A failed launch fails every test of the group with the harness's report, which names the
job that failed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

import pytest

# group -> its files (each defines ``shared_launch(ctx)``); the groups are balanced so that two xdist
# workers can each take one while the other files fill the gaps (tests/durations.json)
LAUNCH_GROUPS: dict[str, tuple[str, ...]] = {
    "megatron_ranks": (
        "tests/dist/test_backend.py", "tests/dist/test_critic.py", "tests/dist/test_routing_replay.py",
        "tests/dist/test_frozen_weights.py", "tests/dist/test_checkpoint_resume.py",
        "tests/dist/test_checkpoint_resume_layouts.py", "tests/dist/test_optimizer_offload.py",
        "tests/dist/test_static_memory.py", "tests/dist/test_true_on_policy_dp2.py",
    ),
    "layouts_and_fsdp": (
        "tests/dist/test_fsdp_backend.py", "tests/dist/test_fsdp_critic.py", "tests/dist/test_fsdp_teacher.py",
        "tests/dist/test_lora_layouts.py",
        "tests/dist/test_parity_layouts.py", "tests/dist/test_data_movement.py", "tests/dist/test_vocab_parallel.py",
        "tests/dist/test_publish.py", "tests/dist/test_freeze_ranks.py", "tests/dist/test_reloadable_groups.py", "tests/dist/test_engine_replicas.py",
        "tests/dist/test_reward_model_ranks.py",
        "tests/dist/test_cp_attention.py", "tests/dist/test_convert_layouts.py", "tests/dist/test_vlm_layouts.py",
        "tests/convert/test_convert_roundtrip.py", "tests/dist/test_packing_dist.py",
    ),
}
GROUP_OF: dict[str, str] = {f: g for g, files in LAUNCH_GROUPS.items() for f in files}


def scope_of(nodeid: str) -> str:
    """The scheduling scope of a test: its launch group, or its file."""
    path = nodeid.split("::", 1)[0]
    return GROUP_OF.get(path, path)


def pytest_xdist_make_scheduler(config, log):
    """Whole files per worker (``--dist loadfile``), with a launch group's files as one scope."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LaunchGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return LaunchGroupScheduling(config, log)


def one_job(job: str, nproc: int):
    """The ``shared_launch`` of a file with one job whose only argument is its output dir: returns that dir."""

    def shared_launch(ctx):
        out = ctx.tmp_path_factory.mktemp(job)
        yield {nproc: [(job, [out])]}
        return out

    return shared_launch


@dataclasses.dataclass
class Ctx:
    tmp_path_factory: Any
    tiny_hf_models: Callable


class _GroupRun:
    """The launches of one group in this session: the phases of every participating file's generator."""

    def __init__(self, group: str, modules: dict[str, Any], ctx: Ctx) -> None:
        from _util import run_jobs

        gens = {path: mod.shared_launch(ctx) for path, mod in modules.items()}
        self.state: dict[str, Any] = {}
        self.error: BaseException | None = None
        pending = {path: None for path in gens}  # the value sent into each generator
        phase = 0
        while gens:
            phase += 1
            by_nproc: dict[int, list] = {}
            for path in list(gens):
                try:
                    wanted = gens[path].send(pending[path])
                except StopIteration as stop:
                    self.state[path] = stop.value
                    del gens[path]
                    continue
                for nproc, jobs in wanted.items():
                    by_nproc.setdefault(int(nproc), []).extend(jobs)
            for nproc in sorted(by_nproc, reverse=True):  # most ranks first (the module docstring)
                print(f"[shared launch] {group} phase {phase}: {len(by_nproc[nproc])} job(s) on {nproc} rank(s)",
                      file=sys.stderr)
                t0 = time.monotonic()
                run_jobs(nproc, by_nproc[nproc], timeout=1800)
                print(f"[shared launch] {group} phase {phase} on {nproc} rank(s): {time.monotonic() - t0:.1f} s",
                      file=sys.stderr)


@pytest.fixture(scope="session")
def _shared_launches(request, tmp_path_factory, tiny_hf_models):
    runs: dict[str, _GroupRun | BaseException] = {}

    def get(path: str):
        group = GROUP_OF[path]
        if group not in runs:
            modules: dict[str, Any] = {}
            for item in request.session.items:
                f = item.nodeid.split("::", 1)[0]
                if GROUP_OF.get(f) == group and f not in modules:
                    modules[f] = item.module
            try:
                runs[group] = _GroupRun(group, modules, Ctx(tmp_path_factory, tiny_hf_models))
            except BaseException as exc:  # noqa: BLE001 - every test of the group reports the same failure
                runs[group] = exc
        run = runs[group]
        if isinstance(run, BaseException):
            raise RuntimeError(f"the shared launches of group {group!r} failed (tests/_launches.py)") from run
        return run.state[path]

    return get


@pytest.fixture(scope="module")
def shared_launch_state(request, _shared_launches):
    """What this file's ``shared_launch(ctx)`` generator returned, after its group's launches ran."""
    path = request.node.nodeid.split("::", 1)[0]
    if path not in GROUP_OF:
        raise RuntimeError(f"{path} is in no launch group of tests/_launches.py LAUNCH_GROUPS")
    return _shared_launches(path)
