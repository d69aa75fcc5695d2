"""rollout/batch_builder.py: one scoring and one set of rollout metrics for the synchronous manager and
``--async-mode full``'s producer.

The drift it replaced, each pinned here: the full-async batch logged no ``rollout/turns_mean``,
``perf/reward_s`` or ``rollout/time_s``, reduced rewards in float64 (the manager: float32), and took
``rollout/weight_version`` from the oldest token (the manager: the first sample's). The last test runs
both real paths, ``RolloutManager.generate`` and ``full_async._batch`` over a producer built by
``full_async._build_producer``, on the same engine answers and compares what they log.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import torch

from _metrics_doc import MODES, documented_rows
from megatron_rl.config import parse_config
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import Sample
from megatron_rl.rollout.batch_builder import RolloutBatchBuilder, weight_version_metrics
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.rewards import RewardShaping, reward_fn_from_config
from megatron_rl.runner import full_async

REWARDS = [0.1, 0.2, 0.7, 0.3]  # their float32 mean and std differ from the float64 ones


def _sample(i: int, reward: float, version: int = 0, token_versions=(), **metadata) -> Sample:
    s = Sample(group_index=i // 2, prompt_ids=[1, 2], response_ids=[5, 6, 7][: 1 + i % 3],
               rollout_logprobs=[-1.0] * (1 + i % 3), finish_reason="length" if i == 0 else "stop",
               weight_version=version, token_versions=list(token_versions), metadata=dict(metadata))
    s.reward = reward
    return s


def _builder(**kw) -> RolloutBatchBuilder:
    return RolloutBatchBuilder(lambda samples: [0.0] * len(samples), None, source="--rm-type test",
                               prompts="--prompt-data test.jsonl", **kw)


def test_reward_statistics_are_float32_reductions():
    metrics = _builder().metrics([_sample(i, r) for i, r in enumerate(REWARDS)], trained_at=0, time_s=1.5,
                                 reward_s=0.25)
    as32 = torch.tensor(REWARDS, dtype=torch.float32)
    as64 = torch.tensor(REWARDS, dtype=torch.float64)
    assert metrics["rollout/reward_mean"] == as32.mean().item() != as64.mean().item()
    assert metrics["rollout/reward_std"] == as32.std().item() != as64.std().item()
    assert metrics["rollout/time_s"] == 1.5 and metrics["perf/reward_s"] == 0.25


def test_the_keys_are_those_the_docs_list_for_every_step_of_every_mode_plus_what_the_samples_carry():
    plain = [_sample(i, r) for i, r in enumerate(REWARDS)]
    keys = set(_builder().metrics(plain, trained_at=0, time_s=0.0, reward_s=0.0))
    assert keys == {"rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean",
                    "rollout/response_len_max", "rollout/truncated_frac", "rollout/time_s", "perf/reward_s",
                    "rollout/weight_version", "rollout/stale_samples", "rollout/weight_version_min",
                    "rollout/weight_version_max", "rollout/mixed_version_samples", "rollout/staleness_mean",
                    "rollout/staleness_max"}
    every_step = {k for row in documented_rows() if row.every_step and row.modes == set(MODES) for k in row.keys}
    assert keys <= every_step, sorted(keys - every_step)  # docs/metrics.md: logged by every mode, every step

    multi_turn = [_sample(i, r, turns=1 + i % 2, tool_calls=i % 2, tool_errors=int(i == 3), reward_metrics={"f": i})
                  for i, r in enumerate(REWARDS)]
    metrics = _builder().metrics(multi_turn, trained_at=0, time_s=0.0, reward_s=0.0)
    assert metrics["rollout/turns_mean"] == 1.5 and metrics["rollout/tool_calls_mean"] == 0.5
    assert metrics["rollout/tool_error_frac"] == 0.5 and metrics["reward/f"] == 1.5


def test_version_metrics_count_from_the_oldest_token_against_the_weights_that_train():
    """``rollout/weight_version`` is the batch's oldest token's version (was: the first sample's in the manager),
    staleness and stale samples against ``trained_at``."""
    samples = [_sample(0, 1.0, version=3), _sample(1, 1.0, version=2, token_versions=[2, 3]),
               _sample(2, 1.0, version=1), _sample(3, 1.0, version=3)]
    metrics = _builder().metrics(samples, trained_at=3, time_s=0.0, reward_s=0.0)
    assert metrics["rollout/weight_version"] == 1.0  # the first sample's version is 3
    assert {k: metrics[k] for k in weight_version_metrics(samples, 3)} == {
        "rollout/stale_samples": 2.0, "rollout/weight_version_min": 1.0, "rollout/weight_version_max": 3.0,
        "rollout/mixed_version_samples": 1.0, "rollout/staleness_mean": 0.75, "rollout/staleness_max": 2.0}


def test_score_decodes_shapes_training_rewards_and_reads_the_eval_key_for_evaluation():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    seen = []

    def reward(samples):
        seen.extend(s.response_text for s in samples)
        return [{"reward": 1.0, "judge": 0.25} for _ in samples]

    builder = RolloutBatchBuilder(reward, Tok(), source="--custom-rm-path m:reward", prompts="--prompt-data p",
                                  eval_reward_key="judge", shaping=RewardShaping(3, clip_range=(0.0, 0.5)))
    samples = [_sample(i, 0.0) for i in range(2)]
    for s in samples:
        s.reward = None
    builder.score(samples)
    assert seen == ["5", "5 6"] and [s.reward for s in samples] == [0.5, 0.5]  # clipped: a training reward
    assert samples[0].metadata["reward_metrics"] == {"judge": 0.25, "reward_clipped": 1.0}
    builder.score(samples, evaluation=True)
    assert [s.reward for s in samples] == [0.25, 0.25]  # --eval-reward-key, never shaped


class TwoTurnEngine:
    """Answers each prompt with ``n`` samples fixed by the prompt, at version 0; odd rows record two turns and
    a tool call, as the tool loop does. Thread-safe: the producer's workers call it at once."""

    weight_version = 0

    def __init__(self):
        self.lock = threading.Lock()
        self.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(chr(97 + t % 26)
                                                                                            for t in ids))

    def generate(self, requests, sampling):
        with self.lock:
            out = []
            for r in requests:
                p = r.prompt_ids[-1]
                for j in range(sampling.n):
                    ids = [p, j, p + j][: 1 + (p + j) % 3]
                    out.append(Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=ids,
                                      rollout_logprobs=[-0.5] * len(ids), weight_version=0, label=r.label,
                                      finish_reason="length" if len(ids) == 3 else "stop",
                                      metadata={**r.metadata, **({"turns": 2, "tool_calls": 1} if j % 2 else {})}))
            return out


def test_the_synchronous_and_the_full_async_paths_log_the_same_batch_metrics(tiny_hf_models, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i % 2)}) + "\n" for i in range(8)))
    reward = tmp_path / "text_parity.py"  # reads the decoded text, so decoding is on both paths
    reward.write_text("def score(sample):\n"
                      "    return float(len(sample.response_text) % 2) + 0.1 * sample.response_ids[0]\n")
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(data),
                        "--custom-rm-path", f"{reward}:score", "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "2", "--async-mode", "full", "--max-staleness", "1",
                        "--embedded-engine-ranks", "driver"], validate=False)

    def manager() -> RolloutManager:
        prompts = PromptIterator(PromptDataset(str(data)), rollout_batch_size=2, n_samples_per_prompt=2)
        return RolloutManager(cfg, TwoTurnEngine(), prompts, reward_fn_from_config(cfg))

    sync_samples, sync_metrics = manager().generate(0)

    rollout = manager()
    cursor = SimpleNamespace(extra=None, resumed_at=None, path=None)
    parts = SimpleNamespace(ctx=SimpleNamespace(cfg=cfg, checkpoints=SimpleNamespace(cursor=cursor)),
                            rollout=rollout, synced_version=0)
    producer = full_async._build_producer(parts, start=0)
    producer.start()
    try:
        async_samples, async_metrics = full_async._batch(producer, parts, 0)
    finally:
        producer.stop()

    assert [(s.group_index, s.response_ids, s.reward, s.response_text) for s in async_samples] == \
        [(s.group_index, s.response_ids, s.reward, s.response_text) for s in sync_samples]
    shared = set(rollout.batch_builder.metrics(sync_samples, trained_at=0, time_s=0.0, reward_s=0.0))
    assert {"rollout/turns_mean", "rollout/tool_calls_mean", "perf/reward_s", "rollout/time_s"} <= shared
    assert shared <= set(sync_metrics) and shared <= set(async_metrics)
    timings = {"rollout/time_s", "perf/reward_s"}
    assert {k: async_metrics[k] for k in shared - timings} == {k: sync_metrics[k] for k in shared - timings}
    assert all(async_metrics[k] > 0 and sync_metrics[k] > 0 for k in timings)
