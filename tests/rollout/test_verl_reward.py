"""verl's reward-function contract (rollout/verl_reward.py): compute_score called per sample by keyword with the keywords
its signature takes; sync or async; a number or verl's dict (score + metrics logged as reward/<key>)."""

import pytest

from megatron_rl.config import parse_config
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.rewards import compute_rewards, reward_fn_from_config, reward_metrics
from megatron_rl.rollout.verl_reward import load_verl_reward, parse_reward_kwargs

MODULE = '''
import asyncio

CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    CALLS.append((data_source, solution_str, ground_truth, extra_info, kwargs))
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth, "pred": solution_str,
            "format": 0.5}


def per_source(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's per-dataset scorer shape (verl/utils/reward_score/gsm8k.py)."""
    return score if (solution_str.split()[-1] == ground_truth) == (method == "strict") else format_score


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return len(solution_str)


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
'''


def _sample(response, label, **metadata):
    return Sample(group_index=0, prompt_ids=[1], response_ids=[2], response_text=response, label=label,
                  metadata=dict(metadata))


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(MODULE)
    return str(path)


def test_verl_keywords_reach_the_function_and_a_dict_result_becomes_reward_and_metrics(module):
    fn = load_verl_reward(module, {"flag": 1})  # file.py alone: its compute_score (verl's default name)
    samples = [_sample("72", "72", data_source="openai/gsm8k", extra_info={"index": 3}), _sample("7", "72")]
    rewards = compute_rewards(samples, fn, source=f"--custom-reward-function-path {module}")
    assert rewards == [1.0, 0.0]
    calls = fn.fn.__globals__["CALLS"]
    assert calls == [("openai/gsm8k", "72", "72", {"index": 3}, {"flag": 1}), (None, "7", "72", {}, {"flag": 1})]
    assert samples[0].metadata["reward_metrics"] == {"acc": 1.0, "format": 0.5}  # the text 'pred' is no metric
    assert reward_metrics(samples) == {"reward/acc": 0.5, "reward/format": 0.5}


def test_a_per_dataset_scorer_gets_only_the_keywords_it_takes(module):
    strict = load_verl_reward(f"{module}:per_source")
    assert strict([_sample("so 5", "5"), _sample("so 4", "5")]) == [1.0, 0.0]
    loose = load_verl_reward(f"{module}:per_source", parse_reward_kwargs('{"method": "flexible"}'))
    assert loose([_sample("so 5", "5"), _sample("so 4", "5")]) == [0.0, 1.0]


def test_an_async_function_scores_the_batch(module):
    assert load_verl_reward(f"{module}:async_score")([_sample("abc", "x"), _sample("a", "x")]) == [3, 1]


def test_a_dict_without_score_and_bad_kwargs_are_refused(module):
    with pytest.raises(ConfigError, match=r"returned a dict without 'score' for sample 0 \(keys: acc\)"):
        load_verl_reward(f"{module}:no_score")([_sample("a", "b")])
    with pytest.raises(ConfigError, match=r"^--custom-reward-function-kwargs '\[1\]': a list; give a JSON object"):
        parse_reward_kwargs("[1]")


def test_the_flag_is_the_runs_reward_and_excludes_the_others(module, tmp_path, tiny_hf_models):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2], "label": "x"}\n')
    base = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(prompts),
            "--custom-reward-function-path", f"{module}:compute_score"]
    cfg = parse_config([*base, "--custom-reward-function-kwargs", '{"a": 1}'])
    fn = reward_fn_from_config(cfg)
    assert fn.reward_kwargs == {"a": 1} and fn.path == f"{module}:compute_score"
    with pytest.raises(ConfigError, match=r"--custom-reward-function-path .* and --rm-type each name the reward"):
        parse_config([*base, "--rm-type", "gsm8k"])
    with pytest.raises(ConfigError, match=r"--custom-reward-function-kwargs are the keyword arguments of"):
        parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(prompts), "--rm-type",
                      "gsm8k", "--custom-reward-function-kwargs", "{}"])
