"""scripts/run_agent_demo_cpu.sh shortened (a short warm start, two rollouts): torchrun with 2 gloo ranks,
megatron-core training, the embedded engine and the built-in tool loop with the calculator. The
warm-started policy calls the tool in some samples from the first rollout, the multi-turn metrics are
logged every step and plotted, and the run finishes. The full demo's learning curve: docs/agentic.md."""

import json
import os
import subprocess
import sys

import pytest

from _metrics_doc import check_mode_keys
from megatron_rl.infra.ports import free_port

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_agent_demo_calls_the_tool_and_logs_the_multi_turn_metrics(tmp_path):
    out = tmp_path / "agent_demo"
    env = {**os.environ, "OUT": str(out), "NUM_ROLLOUT": "2", "WARM_START_STEPS": "200", "PY": sys.executable,
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(["bash", "scripts/run_agent_demo_cpu.sh", "--eval-interval", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # a quarter of the warm start's conversations call the tool: 128 samples a rollout never miss it
        assert 0 < r["rollout/tool_calls_mean"] <= 2 and r["rollout/turns_mean"] > 1, r
        assert 0 <= r["rollout/tool_error_frac"] <= 1 and "train/pg_loss" in r
    assert any("eval/reward_mean" in r for r in recs)
    check_mode_keys(recs, "off", present=["rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_error_frac"])
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
