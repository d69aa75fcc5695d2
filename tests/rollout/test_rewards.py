"""Built-in verifiable rewards and the --custom-rm-path loader."""

import sys
import textwrap

import pytest

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.rewards import (
    RewardShaping,
    compute_rewards,
    exact_match,
    extract_answer,
    get_reward_fn,
    math_reward,
    parse_number,
)


def sample(text, label, group_index=0):
    return Sample(group_index=group_index, prompt_ids=[1], response_ids=[2], response_text=text, label=label)


@pytest.mark.parametrize("text,label,expected", [
    ("Paris", "paris", 1.0),
    ("  The   Answer is\nyes. ", "the answer is yes", 1.0),
    ("Paris!", "Paris", 0.0),
    ("Lyon", "Paris", 0.0),
])
def test_exact_match(text, label, expected):
    assert exact_match(sample(text, label)) == expected


@pytest.mark.parametrize("text,answer", [
    (r"so the result is \boxed{\frac{1}{2}} and we are done", r"\frac{1}{2}"),
    (r"first \boxed{3} then \boxed{ {4}+1 }", "{4}+1"),
    (r"\fbox{7}", "7"),
    (r"\boxed 12$", "12"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### -3.5\nextra text", "-3.5"),
    ("total is 1,000 apples, then 12 pears.", "12"),
    ("We get 3/4 of it", "3/4"),
    ("no digits here", None),
    (r"\boxed{unbalanced", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text,value", [
    ("42", 42.0), ("-3.5", -3.5), ("1,000", 1000.0), ("1,234.5", 1234.5), ("3/4", 0.75),
    (r"\frac{1}{8}", 0.125), (r"-\dfrac{3}{2}", -1.5), (r"\frac12", 0.5), ("50%", 50.0), (r"50\%", 50.0),
    ("$12$", 12.0), ("1e-3", 0.001), (".5", 0.5), ("x+1", None), ("1,2,3", None), ("1/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text,label,expected", [
    (r"The answer is \boxed{0.5}.", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    ("so 6 * 12 = 72\n#### 72", "Natalia ... 48+24 = 72\n#### 72", 1.0),  # GSM8K-style label
    ("I think it is 72.", 72, 1.0),  # integer label
    ("answer: 1,000", "1000", 1.0),
    ("answer: 71", "72", 0.0),
    (r"\boxed{x + 1}", "x+1", 1.0),
    (r"\boxed{x+2}", "x+1", 0.0),
    ("nothing numeric", "5", 0.0),
    ("0.3333334", "1/3", 1.0),  # relative tolerance 1e-6
    ("0.3334", "1/3", 0.0),
])
def test_math_reward(text, label, expected):
    assert math_reward(sample(text, label)) == expected


def test_builtins_need_text_and_label():
    with pytest.raises(ConfigError, match="needs sample.response_text but it is None; give the rollout engine a tok"):
        math_reward(sample(None, "1"))
    with pytest.raises(ConfigError, match="set --label-key"):
        exact_match(sample("a", None))


def test_registry_selection_and_errors():
    samples = [sample(r"\boxed{2}", "2"), sample("3", "2")]
    assert compute_rewards(samples, get_reward_fn("math")) == [1.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0]
    with pytest.raises(ConfigError, match="--rm-type gpqa is not a built-in reward; choose one of exact_match, math"):
        get_reward_fn("gpqa")
    with pytest.raises(ConfigError, match="mutually exclusive"):
        get_reward_fn("math", "m:f")
    with pytest.raises(ConfigError, match="no reward function: pass --rm-type"):
        get_reward_fn()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        from megatron_rl.rollout.rewards import batched_reward

        def length_bonus(sample):
            return len(sample.response_text) / 10

        def by_group(samples):
            return [float(s.group_index) for s in samples]

        @batched_reward
        def marked(batch):
            return [1.0] * len(batch)

        def short(samples):
            return [1.0]

        def nan_reward(sample):
            return float("nan")

        NOT_A_FUNCTION = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_custom_rewards_per_sample_and_batched(user_module):
    samples = [sample("abcd", None, 0), sample("ab", None, 5)]
    assert compute_rewards(samples, get_reward_fn(custom_rm_path="my_rewards:length_bonus")) == [0.4, 0.2]
    assert compute_rewards(samples, get_reward_fn(custom_rm_path="my_rewards:by_group")) == [0.0, 5.0]
    assert compute_rewards(samples, get_reward_fn(custom_rm_path="my_rewards:marked")) == [1.0, 1.0]
    by_file = get_reward_fn(custom_rm_path=f"{user_module}/my_rewards.py:length_bonus")
    assert compute_rewards(samples, by_file) == [0.4, 0.2]


def test_custom_reward_errors_name_the_flag_and_fix(user_module):
    with pytest.raises(ConfigError, match="--custom-rm-path my_rewards must be module:function"):
        get_reward_fn(custom_rm_path="my_rewards")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_mod' \(ModuleNotFoundError.*PYTHONPATH"):
        get_reward_fn(custom_rm_path="no_such_mod:f")
    with pytest.raises(ConfigError, match="cannot import '/nope/r.py'"):
        get_reward_fn(custom_rm_path="/nope/r.py:f")
    with pytest.raises(ConfigError, match="has no 'scroe'; callables there: batched_reward, by_group, length_bonus"):
        get_reward_fn(custom_rm_path="my_rewards:scroe")
    with pytest.raises(ConfigError, match="'NOT_A_FUNCTION' in 'my_rewards' is a int, not a function"):
        get_reward_fn(custom_rm_path="my_rewards:NOT_A_FUNCTION")
    samples = [sample("a", None), sample("b", None)]
    with pytest.raises(ConfigError, match="returned 1 rewards for 2 samples"):
        compute_rewards(samples, get_reward_fn(custom_rm_path="my_rewards:short"), "--custom-rm-path my_rewards:short")
    with pytest.raises(ConfigError, match="returned nan for sample 0; rewards must be finite"):
        compute_rewards(samples, get_reward_fn(custom_rm_path="my_rewards:nan_reward"))


@pytest.mark.parametrize("text,label,expected", [
    ("<think>maybe \\boxed{3}</think> so \\boxed{42}", "42", 1.0),  # only the part after </think> counts
    ("<think>\\boxed{42}</think> the answer is 42", "42", 0.0),  # no boxed answer after </think>
    ("\\boxed{42}", "42", 0.0),  # no </think> and no ###Response: slime gives 0
    ("###Response the result: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("</think>\\boxed{7}", "\\boxed{7}", 1.0),  # a boxed label is compared by its contents
    ("</think>\\boxed{7}", "", 0.0),
])
def test_deepscaler_reward_follows_slimes_rule(text, label, expected):
    from megatron_rl.rollout.rewards import deepscaler_reward

    assert deepscaler_reward(Sample(0, [1], [2], response_text=text, label=label)) == expected


def test_rm_type_choices_are_the_builtin_rewards():
    """--rm-type is refused while parsing flags unless it names a built-in (no late failure)."""
    from megatron_rl.config.schema import BUILTIN_REWARD_NAMES
    from megatron_rl.rollout.rewards import BUILTIN_REWARDS

    assert tuple(BUILTIN_REWARDS) == BUILTIN_REWARD_NAMES


def test_reward_key_picks_the_training_reward_of_a_dict():
    """slime's --reward-key: sample.reward[reward_key] trains; here the other keys stay metrics."""
    from megatron_rl.rollout.rewards import compute_rewards

    samples = [sample("a", "a"), sample("b", "a")]
    fn = (lambda ss: [{"acc": 1.0, "format": 0.5}, {"acc": 0.0, "format": 1.0}])
    assert compute_rewards(samples, fn, reward_key="acc") == [1.0, 0.0]
    assert samples[0].metadata["reward_metrics"] == {"format": 0.5}
    assert compute_rewards(samples, fn, reward_key="format", key_flag="--eval-reward-key") == [0.5, 1.0]
    with pytest.raises(ConfigError, match="without a 'score' key .* --reward-key score names the key"):
        compute_rewards(samples, fn, reward_key="score")
    with pytest.raises(ConfigError, match=r"returned 1.0 for sample 0, but --eval-reward-key acc picks"):
        compute_rewards(samples, lambda ss: [1.0, 0.0], reward_key="acc", key_flag="--eval-reward-key")
    with pytest.raises(ConfigError, match="without a 'reward' key .* or give --reward-key KEY"):
        compute_rewards(samples, fn)


def _lengths(*lengths):
    return [Sample(group_index=0, prompt_ids=[1], response_ids=[5] * n) for n in lengths]


def test_overlong_penalty_is_dapos_ramp_then_the_clip():
    """verl's DAPO reward manager: expected = max - N, penalty = min(-(L - expected) / N * F, 0). Numbers for
    max 20, N 8, F 0.5: 0 up to L 12, -0.25 at 16, -0.5 at 20; then the clip to [-0.3, 0.8]."""
    shaping = RewardShaping(max_response_len=20, overlong_buffer_len=8, overlong_penalty_factor=0.5,
                            clip_range=(-0.3, 0.8))
    samples = _lengths(5, 12, 13, 16, 20, 20)
    scores = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    got = compute_rewards(samples, lambda ss: list(scores), shaping=shaping)
    assert got == pytest.approx([0.8, 0.8, 0.8, -0.25, -0.3, 0.5])
    assert [s.reward for s in samples] == got
    penalties = [s.metadata["reward_metrics"]["overlong_penalty"] for s in samples]
    assert penalties == pytest.approx([0.0, 0.0, -0.0625, -0.25, -0.5, -0.5])
    assert [s.metadata["reward_metrics"]["reward_clipped"] for s in samples] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    # no shaping: the reward function's numbers untouched, no shaping metrics
    samples = _lengths(20)
    assert compute_rewards(samples, lambda ss: [1.0]) == [1.0] and "reward_metrics" not in samples[0].metadata


def test_shaping_keeps_a_dict_rewards_metrics_and_skips_evaluation(tiny_hf_models, tmp_path):
    """Through the real RolloutManager and parsed flags: training rewards are shaped, evaluation's are not."""
    import json

    from megatron_rl.config import parse_config
    from megatron_rl.data.prompts import PromptDataset, PromptIterator
    from megatron_rl.rollout.manager import RolloutManager

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(4)))

    class LongEngine:
        tokenizer = None
        weight_version = 0

        def generate(self, requests, sampling):
            return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=[7] * 10,
                           rollout_logprobs=[-1.0] * 10, finish_reason="length", label=r.label,
                           metadata=dict(r.metadata)) for r in requests for _ in range(sampling.n)]

    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(data),
                        "--eval-prompt-data", str(data), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                        "--rollout-max-response-len", "10", "--overlong-buffer-len", "4",
                        "--overlong-penalty-factor", "2", "--reward-clip-range", "-1.5", "5"])
    prompts = PromptIterator(PromptDataset(cfg.data.prompt_data), rollout_batch_size=2, n_samples_per_prompt=2)
    manager = RolloutManager(cfg, LongEngine(), prompts, lambda ss: [{"reward": 1.0, "format": 1.0} for _ in ss],
                             eval_dataset=PromptDataset(str(data)))
    samples, metrics = manager.generate(0)
    assert [s.reward for s in samples] == [-1.0] * 4  # 1 - 2 (a full-length response), inside the clip
    assert metrics["reward/overlong_penalty"] == -2.0 and metrics["reward/format"] == 1.0
    assert metrics["reward/reward_clipped"] == 0.0
    ev = manager.evaluate(0)
    assert ev["eval/reward_mean"] == 1.0 and "eval/reward/overlong_penalty" not in ev
