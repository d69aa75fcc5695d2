"""The checks of ``scripts/test_sglang_real.sh`` (tools/sglang_cpu/check_real_sglang.py) collected as tests.

Why here: that script runs our SGLang client, engine and weight-sync transports against real SGLang, which
needs a 7 GB install, so it runs by hand, days apart; meanwhile the product moves under it (a config it builds,
a signature it calls) and it rots unseen. So every commit runs the same harness code against CI's protocol
double (tests/rollout/sglang_double: SGLang's command line serving the stand-in of tests/rollout/sglang_standin.py)
for the steps that check the protocol (``DOUBLE_STEPS``), and against real SGLang every step, where it is
installed (``SGLANG_PYTHON``, or the venv scripts/sglang_cpu_install.sh makes); without it those tests are
skipped, saying so and naming the command that runs them.

Left out of the double's run (real SGLang's behaviour, not our code's): ``weights_check`` (SGLang's comparison
needs CUDA and says so), ``long_prompts`` (the context-length refusal is SGLang's rule), ``abort_flush_pause`` and
``aborted_rows_retried`` (an abort sent a measured delay into a generation: how many rows it catches depends on
the machine's speed, so they run against real SGLang only; the manager the second one builds is built here on
every commit), ``unavailable_503`` (a second server with ``--max-running-requests``), ``standin_fidelity`` (the
stand-in against real replies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _util import REPO

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(REPO / "tools" / "sglang_cpu"))
from check_real_sglang import ALL_STEPS, abort_retry_manager  # noqa: E402 - tools/sglang_cpu, put on sys.path above

DOUBLE_STEPS = ["generation", "delta_routes", "seeded", "disk_updates", "sharded_disk", "control", "tensor_updates",
                "tensor_transport", "distributed_updates", "verify_checksums", "delta_sync", "fixture_still_holds"]
REAL_PYTHON = os.environ.get("SGLANG_PYTHON", os.path.join(os.environ.get("SGLANG_VENV", "/work/sglang-venv"),
                                                           "bin", "python"))


def _run(out, *args, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sglang_cpu" / "check_real_sglang.py"), "--out",
                           str(out), "--skip-e2e", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    figures = out / "figures.json"
    assert figures.exists(), f"the harness wrote no figures (exit {proc.returncode}):\n{proc.stdout[-4000:]}" \
                             f"\n{proc.stderr[-4000:]}"
    return json.loads(figures.read_text())


@pytest.fixture(scope="module")
def double_run(tmp_path_factory):
    # small batches: the steps' logic, not the double's speed, is what this run checks
    return _run(tmp_path_factory.mktemp("sglang_double"), "--against-double", "--steps", *DOUBLE_STEPS,
                "--batch", "4", "--max-new-tokens", "8", "--long-tokens", "160", timeout=900)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    if not os.access(REAL_PYTHON, os.X_OK):
        pytest.skip(f"real SGLang is not installed ({REAL_PYTHON}): bash scripts/test_sglang_real.sh installs it "
                    "and runs these checks")
    return _run(tmp_path_factory.mktemp("sglang_real"), "--sglang-python", REAL_PYTHON, timeout=1800)


def _step_checks(run: dict, step: str) -> list[dict]:
    checks = [c for c in run["checks"] if c["step"] == step]
    assert checks, f"step {step} recorded no check"
    return checks


@pytest.mark.parametrize("step", DOUBLE_STEPS)
def test_step_against_the_protocol_double(double_run, step):
    failed = [f"{c['name']}: {c['detail'][:600]}" for c in _step_checks(double_run, step) if not c["ok"]]
    assert not failed, "\n".join(failed)


def test_double_run_ends_with_its_server_alive(double_run):
    assert all(c["ok"] for c in _step_checks(double_run, "end"))


@pytest.mark.parametrize("step", ALL_STEPS)
def test_step_against_real_sglang(real_run, step):
    failed = [f"{c['name']}: {c['detail'][:600]}" for c in _step_checks(real_run, step) if not c["ok"]]
    assert not failed, "\n".join(failed)


def test_the_abort_retry_checks_manager_is_built_as_the_product_builds_it(tiny_hf_models):
    """aborted_rows_retried (real SGLang only: timing) builds a RolloutManager from parsed flags; building it here
    fails at the commit that changes what the manager needs (it once read a missing ``cfg.data``)."""
    manager = abort_retry_manager(tiny_hf_models("qwen2"), "http://127.0.0.1:9", engine=None)
    assert manager.cfg.rollout.rollout_abort_retries == 2
