"""A verl user's data and reward function, unchanged, train the CPU demo model (``python -m megatron_rl.train``, one
process: the embedded engine, megatron-core training, two rollouts).

The data: a parquet file in verl's schema (``examples/data_preprocess/gsm8k.py``'s columns), built here with pyarrow
from the demo's digit task: chat-message prompts, ``data_source`` ``openai/gsm8k``, the final answer (the answer's
last digit) as ``reward_model.ground_truth``, ``extra_info``. The reward: verl's own
``verl/utils/reward_score/gsm8k.py`` (fixtures/verl/gsm8k.py, byte for byte: its sha256 is checked) through
``--custom-reward-function-path``, with verl's ``reward_kwargs`` ``{"method": "flexible"}`` (the demo's vocabulary
has no ``####``, so the strict method would score every sample 0). Every saved sample's reward is what that file's
``compute_score`` gives its response, and the sample carries the row's data_source and extra_info.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from _util import seed_demo_dir

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERL_GSM8K = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "verl", "gsm8k.py")


def _verl_rows(prompts_jsonl, count):
    rows = []
    for i, line in enumerate(open(prompts_jsonl).read().splitlines()[:count]):
        record = json.loads(line)
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": record["prompt"]}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": record["label"].split()[-1]},
                     "extra_info": {"split": "train", "index": i, "answer": record["label"]}})
    return rows


def test_a_verl_parquet_and_verls_gsm8k_reward_train_the_demo(tmp_path):
    source = open(os.path.join(os.path.dirname(VERL_GSM8K), "SOURCE")).read()
    assert hashlib.sha256(open(VERL_GSM8K, "rb").read()).hexdigest() in source  # verl's file, unchanged
    out = tmp_path / "demo"
    seed_demo_dir(out)
    tok_config = out / "model" / "tokenizer_config.json"  # the digit tokenizer, given a chat template
    config = json.loads(tok_config.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok_config.write_text(json.dumps(config))
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(out / "prompts.jsonl", 64)), str(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(out / "model"), "--prompt-data", str(data),
         "--apply-chat-template", "--custom-reward-function-path", VERL_GSM8K,
         "--custom-reward-function-kwargs", '{"method": "flexible"}',
         "--num-rollout", "2", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
         "--rollout-max-response-len", "6", "--rollout-temperature", "1.0", "--global-batch-size", "128",
         "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--advantage-estimator", "grpo",
         "--lr", "1e-3", "--output-dir", str(out),
         "--save-debug-rollout-data", str(tmp_path / "rollouts" / "r_{rollout_id}.pt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    spec = importlib.util.spec_from_file_location("verl_gsm8k", VERL_GSM8K)
    verl_gsm8k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verl_gsm8k)
    rewards = []
    for rollout_id in (0, 1):
        samples = torch.load(tmp_path / "rollouts" / f"r_{rollout_id}.pt", weights_only=False)["samples"]
        assert len(samples) == 16 * 8
        for s in samples:
            assert s["reward"] == verl_gsm8k.compute_score(s["response_text"], s["label"], method="flexible")
            assert s["metadata"]["data_source"] == "openai/gsm8k" and s["metadata"]["extra_info"]["answer"]
            rewards.append(s["reward"])
    assert 0 < sum(rewards) < len(rewards)  # a signal to train on: some right, some wrong
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all("train/pg_loss" in r for r in train)
