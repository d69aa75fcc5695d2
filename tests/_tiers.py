"""The suite's tiers, its order and its time budget (a pytest plugin, loaded by tests/conftest.py).

Tiers (markers declared in pyproject.toml, ``--strict-markers``): ``unit`` (in-process: no multi-rank
launch, no run of the product's entry points), ``dist`` (real torchrun launches of test workers), ``e2e``
(runs of ``python -m megatron_rl.train``, its launcher or a ``scripts/*.sh`` run script). A test carries
one; a test without one is ``unit``. ``pytest -m unit`` is the quick loop; README's command runs all three.

Why the tier is checked, not trusted: every process a test starts goes through ``subprocess.Popen``, which
this plugin watches; a ``unit`` test that starts torchrun, or a ``dist`` test that starts a training run,
fails at that launch with the marker to add. So the tiers stay true as the suite grows.

Order: ``tests/durations.json`` holds each file's measured seconds (setup, calls and teardowns of its tests;
a whole suite run on the 2-core CI machine: ``bash scripts/test.sh --durations-out tests/durations.json``).
Files run longest first (the xdist workers take whole files in that order, so the run ends on many short
files instead of one long file on one worker while the other idles). A file missing from it (a new one) is
placed by its tier's typical time.

Budget: at the end the plugin prints each tier's time against its share of the suite's budget (worker
minutes: the 25-min wall budget on 2 workers is 50), and the slowest files of a tier over its share. It
prints, never fails: a test decides from state, not from how fast the machine was.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from _launches import scope_of

TIERS = ("unit", "dist", "e2e")
# Each tier's share of the budget, in minutes of worker time (2 workers x 25 min = 50; the rest is
# slack for the next wave). Printed against the measured times at the end of every run.
SHARE_MIN = {"unit": 7.0, "dist": 16.0, "e2e": 16.0}
BUDGET_WALL_MIN = 25.0
# the seconds a file missing from durations.json is assumed to take, by its tier
NEW_FILE_S = {"unit": 2.0, "dist": 60.0, "e2e": 60.0}
DURATIONS = Path(__file__).with_name("durations.json")

# what a started process's command line says about its tier (the lowest tier allowed to start it)
_LAUNCH_KINDS = (
    ("e2e", ("megatron_rl.train", "megatron_rl.infra.launch", "scripts/run_", "scripts/test_sglang_real",
             "scripts/test_slurm_real")),
    ("dist", ("torch.distributed.run", "torchrun", "tests/dist/harness.py")),
)
_RANK = {tier: i for i, tier in enumerate(TIERS)}
_current: dict = {"item": None}
_config: dict = {}


def tier_of(item) -> str:
    marked = [t for t in TIERS if item.get_closest_marker(t) is not None]
    return marked[-1] if marked else "unit"


def _launch_kind(args) -> tuple[str, str] | None:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    text = " ".join(os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in argv)
    for kind, needles in _LAUNCH_KINDS:
        if any(n in text for n in needles):
            return kind, text
    return None


_popen_init = subprocess.Popen.__init__


def _watched_popen_init(self, args, *a, **kw):
    item = _current["item"]
    found = _launch_kind(args) if item is not None else None
    if found is not None:
        kind, text = found
        tier = tier_of(item)
        if _RANK[kind] > _RANK[tier]:
            pytest.fail(f"{item.nodeid} is a {tier}-tier test but starts a {kind} launch ({text[:200]}): mark it "
                        f"pytest.mark.{kind} (tests/_tiers.py)", pytrace=False)
    _popen_init(self, args, *a, **kw)


def pytest_addoption(parser):
    parser.addoption("--durations-out", default=None, metavar="PATH",
                     help="write each test file's measured seconds to PATH (the format of tests/durations.json)")


def pytest_configure(config):
    subprocess.Popen.__init__ = _watched_popen_init
    config._tier_times = defaultdict(float)
    config._file_times = defaultdict(float)
    config._file_tiers = {}
    config._t0 = time.monotonic()
    _config["config"] = config


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    """Every test gets its tier marker (``unit`` when it has none); files longest first by durations.json."""
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    estimate: dict[str, float] = defaultdict(float)  # by scheduling scope: a launch group's files as one
    files: set[str] = set()
    for item in items:
        f = _file_of(item.nodeid)
        if f not in files:
            files.add(f)
            estimate[scope_of(f)] += known.get(f, NEW_FILE_S[tier_of(item)])
    # stable: a scope's files and a file's own tests keep their order
    items.sort(key=lambda item: -estimate[scope_of(_file_of(item.nodeid))])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["item"] = item
    try:
        yield
    finally:
        _current["item"] = None


def pytest_runtest_logreport(report):
    """Runs where the reports arrive (the xdist controller, or the one process): time by tier and by file."""
    config = _config.get("config")
    if config is None:
        return
    tier = next((t for t in reversed(TIERS) if t in report.keywords), "unit")
    f = _file_of(report.nodeid)
    config._tier_times[tier] += report.duration
    config._file_times[f] += report.duration
    config._file_tiers[f] = max(tier, config._file_tiers.get(f, "unit"), key=_RANK.__getitem__)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None or not config._file_times:
        return  # an xdist worker: the controller prints
    tr = terminalreporter
    wall = (time.monotonic() - config._t0) / 60
    tr.write_sep("-", "time by tier (minutes of worker time; the budget: "
                      f"{BUDGET_WALL_MIN:.0f} min of wall time on 2 workers)")
    # a launch group's launches are timed in whichever of its files asks first: its files are listed as one
    by_scope: dict[str, float] = defaultdict(float)
    scope_tier: dict[str, str] = {}
    for f, s in config._file_times.items():
        scope = scope_of(f)
        by_scope[scope] += s
        tier = config._file_tiers.get(f, "unit")
        scope_tier[scope] = max(tier, scope_tier.get(scope, "unit"), key=_RANK.__getitem__)
    by_tier: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for scope, s in by_scope.items():
        by_tier[scope_tier[scope]].append((s, scope))
    for tier in TIERS:
        used = config._tier_times.get(tier, 0.0) / 60
        share = SHARE_MIN[tier]
        flag = "  OVER ITS SHARE" if used > share else ""
        tr.write_line(f"{tier:>5}: {used:5.1f} of {share:4.1f}{flag}")
        if flag:
            for s, f in sorted(by_tier[tier], reverse=True)[:5]:
                tr.write_line(f"         {s / 60:5.1f}  {f}")
    over = "  OVER THE BUDGET" if wall > BUDGET_WALL_MIN else ""
    tr.write_line(f" wall: {wall:5.1f} of {BUDGET_WALL_MIN:4.1f}{over}")
    out = config.getoption("--durations-out")
    if out:
        Path(out).write_text(json.dumps({f: round(s, 1) for f, s in sorted(config._file_times.items())},
                                        indent=0) + "\n")
        tr.write_line(f"file durations written to {out}")

