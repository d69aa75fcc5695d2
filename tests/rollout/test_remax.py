"""ReMax (--advantage-estimator remax): one greedy response per prompt, scored like the samples, is their baseline.

The rollout side is the real ``RolloutManager`` over parsed flags and a prompt file; the engine is a test double
whose sampled responses are ``[j, 9]`` for sample j and whose greedy response (temperature 0) is ``[prompt % 2,
9]``, so each group's baseline is known. The advantage side is the real Spec.
"""

import json

import pytest
import torch

from megatron_rl.algorithms import PolicyGradientConfig, get_spec
from megatron_rl.config import parse_config
from megatron_rl.data import sample_codec
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.manager import RolloutManager


class GreedyAwareEngine:
    tokenizer = None
    weight_version = 0

    def __init__(self):
        self.calls = []

    def generate(self, requests, sampling):
        self.calls.append((len(requests), sampling.n, sampling.temperature, sampling.top_k, sampling.top_p))
        out = []
        for r in requests:
            for j in range(sampling.n):
                first = r.metadata["prompt_index"] % 2 if sampling.temperature == 0 else j
                out.append(Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=[first, 9],
                                  rollout_logprobs=[-1.0, -1.0], finish_reason="stop", label=r.label,
                                  metadata=dict(r.metadata)))
        return out


def test_the_manager_attaches_each_groups_greedy_reward(tiny_hf_models, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(8)))
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(data),
                        "--rollout-batch-size", "4", "--n-samples-per-prompt", "3", "--advantage-estimator", "remax",
                        "--rollout-top-k", "5"])
    prompts = PromptIterator(PromptDataset(cfg.data.prompt_data), rollout_batch_size=4, n_samples_per_prompt=3)
    engine = GreedyAwareEngine()
    manager = RolloutManager(cfg, engine, prompts, lambda ss: [float(s.response_ids[0] == 1) for s in ss])
    samples, metrics = manager.generate(0)
    # the sampled groups, then one greedy response per prompt: temperature 0, n 1, no top-k/top-p filter
    assert engine.calls == [(4, 3, 1.0, 5, 1.0), (4, 1, 0.0, -1, 1.0)]
    assert len(samples) == 12 and [s.reward for s in samples[:3]] == [0.0, 1.0, 0.0]
    for s in samples:
        assert s.reward_baseline == float(s.metadata["prompt_index"] % 2 == 1)
    assert metrics["rollout/remax_baseline_mean"] == 0.5 and metrics["perf/remax_baseline_s"] >= 0
    # every training rank reads the baseline, also of the samples another rank holds
    stub, = sample_codec.decode_headers(*sample_codec.encode_headers(samples[3:4]), owners=[1])
    assert stub.reward_baseline == samples[3].reward_baseline == 1.0
    assert sample_codec.decode(*sample_codec.encode(samples[:2])) == samples[:2]


def test_remax_advantage_is_the_reward_minus_the_greedy_reward_on_loss_tokens():
    """verl's compute_remax_outcome_advantage: returns (the outcome reward, reverse-cumsummed) minus the baseline
    on the response mask, not whitened. Numbers: reward 1, baseline 0.25, mask [1, 1, 0, 1] -> 0.75 on the loss
    tokens (ours: 0 on the masked one, which the loss never reads); reward 0, baseline 1 -> -1."""
    samples = [Sample(group_index=0, prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], reward=1.0,
                      reward_baseline=0.25),
               Sample(group_index=1, prompt_ids=[1], response_ids=[5, 6], reward=0.0, reward_baseline=1.0)]
    adv = get_spec("policy_gradient", PolicyGradientConfig(advantage_estimator="remax")).compute_advantages(samples)
    assert torch.equal(adv[0], torch.tensor([0.75, 0.75, 0.0, 0.75])) and torch.equal(adv[1], torch.tensor([-1.0,
                                                                                                            -1.0]))
    samples[1].reward_baseline = None
    with pytest.raises(ConfigError, match="--advantage-estimator remax: 1 sample.*carry no reward_baseline"):
        get_spec("policy_gradient", PolicyGradientConfig(advantage_estimator="remax")).compute_advantages(samples)
