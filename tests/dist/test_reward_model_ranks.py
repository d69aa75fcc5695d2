"""The reward-model role on two trainer ranks (backends/reward_model.py, scripts/reward_model_worker.py): the
driver's batch scored in shares on both ranks equals HF ``AutoModelForSequenceClassification``'s own score of each
sample, one unpadded sequence per forward, in one process."""

import json
import os
import sys

import pytest

from megatron_rl.models.hf_tiny import build_tiny_reward_model

pytestmark = pytest.mark.dist

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def shared_launch(ctx):
    """A policy and a tiny one-label classifier of its vocabulary (no tokenizer: it reads the policy's ids); one
    2-rank job in the group's launch (tests/_launches.py)."""
    tmp = ctx.tmp_path_factory.mktemp("reward_model")
    p = {"policy": ctx.tiny_hf_models("qwen2"), "rm": build_tiny_reward_model("qwen2", tmp / "rm", seed=4),
         "out": tmp / "scores.json"}
    yield {2: [("reward_model", [p["policy"], p["rm"], p["out"]])]}
    return p


def hf_scores(rm_dir, samples) -> list[float]:
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, 0]) for s in samples]


def test_scores_on_two_ranks_equal_hf(shared_launch_state):
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    p = shared_launch_state
    got = json.loads(p["out"].read_text())
    want = hf_scores(p["rm"], make_samples(250))
    assert not got["own_tokenizer"]
    assert len(got["scores"]) == len(want) == 6
    assert max(abs(a - b) for a, b in zip(got["scores"], want)) < 1e-5
    assert max(want) - min(want) > 1e-2  # the scores differ from sample to sample: a share mixed up would show
