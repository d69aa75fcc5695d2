"""``python -m megatron_rl.train`` with the built-in tool loop and the calculator, end to end (one process,
the embedded engine, megatron-core training, one rollout): the rollout it saved
(``--save-debug-rollout-data``) has loss mask 0 exactly at the observation tokens, the tool metrics are
logged, and the run trains on it.
"""

import json
import os
import subprocess
import sys

import torch

from _metrics_doc import check_mode_keys
from _tool_model import build_tool_model, write_prompts  # tests/ is on sys.path (conftest)

from megatron_rl.rollout.agent.framing import tool_turn_ids
from megatron_rl.rollout.agent.parse import parse_tool_calls
from megatron_rl.rollout.agent.tools import BUILTIN_TOOLS, run_tool
import pytest

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of zeros of ``mask``."""
    spans, start = [], None
    for i, m in enumerate(mask + [1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_train_with_the_tool_loop_masks_exactly_the_observations(tmp_path):
    model, tok, _, _ = build_tool_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl", 4)
    (tmp_path / "exact_answer.py").write_text(
        "def score(sample):\n    return float(sample.response_text.strip().endswith(sample.label))\n")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", model, "--prompt-data",
         str(tmp_path / "prompts.jsonl"), "--apply-chat-template", "--custom-rm-path", "exact_answer:score",
         "--custom-generate-function-path", "megatron_rl.rollout.agent:generate", "--max-turns", "3",
         "--tool-timeout", "20", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "160", "--rollout-max-prompt-len", "64", "--num-rollout", "1",
         "--lr", "1e-5", "--output-dir", str(out),
         "--save-debug-rollout-data", str(tmp_path / "rollouts" / "r_{rollout_id}.pt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    samples = torch.load(tmp_path / "rollouts" / "r_0.pt", weights_only=False)["samples"]
    assert len(samples) == 4
    called = 0
    for s in samples:
        ids, mask = s["response_ids"], s["loss_mask"]
        assert len(mask) == len(ids) == len(s["rollout_logprobs"]) == len(s["token_versions"])
        expected = []  # where observations must be: after each model turn that called a tool
        for start, end in _spans(mask):
            calls = parse_tool_calls(tok.decode(ids[:start], skip_special_tokens=False).rsplit("<|tool|>", 1)[-1])
            assert calls, "an observation follows a model turn with a tool call"
            results = [run_tool(BUILTIN_TOOLS, c.name, c.arguments, 20.0)[0] if c.error is None else
                       f"error: {c.error}" for c in calls]
            assert ids[start:end] == tool_turn_ids(tok, results)
            assert all(lp == 0.0 for lp in s["rollout_logprobs"][start:end])
            expected.append((start, end))
        assert len(expected) == s["metadata"]["tool_calls"] == s["metadata"]["turns"] - 1
        called += s["metadata"]["tool_calls"]
    assert called >= 1  # the model calls the calculator
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if "rollout/turns_mean" in r)
    assert step["rollout/tool_calls_mean"] == called / 4 and "train/pg_loss" in step
    check_mode_keys(records, "off", present=["rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_error_frac"])
