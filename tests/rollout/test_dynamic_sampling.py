"""Dynamic sampling (DAPO): the batch is filled in rounds with groups the filter keeps.

The rollout side is the real ``RolloutManager`` over a real prompt file and parsed flags; the engine
is a test double whose prompts 0, 3, 6, ... get the same response in every sample (a constant-reward
group under the parity reward below) and the others a different response per sample.
"""

import contextlib
import json
import sys
import textwrap

import pytest
from reward_server import RewardServer  # tests/rollout/ is on sys.path (pytest's rootdir-relative import)

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.build import build_rollout
from megatron_rl.rollout.dynamic_sampling import (
    DynamicFilterOutput,
    DynamicSampler,
    StreamFilter,
    check_reward_nonzero_std,
    load_filter,
)
from megatron_rl.rollout.manager import RolloutManager

PROMPTS = 30


class PatternEngine:
    """Prompt i's samples: all the same response when ``constant(i)``, else sample j answers j."""

    tokenizer = None
    weight_version = 0

    def __init__(self, constant=lambda i: i % 3 == 0):
        self.constant = constant
        self.calls = []

    def serving(self):
        return contextlib.nullcontext()

    def generate(self, requests, sampling):
        self.calls.append((len(requests), sampling.seed))
        return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids),
                       response_ids=[0 if self.constant(r.metadata.get("prompt_index", 1)) else j, 9],
                       rollout_logprobs=[-1.0, -1.0], finish_reason="stop", label=r.label, metadata=dict(r.metadata))
                for r in requests for j in range(sampling.n)]


def parity(samples):
    return [float(s.response_ids[0] % 2) for s in samples]


@pytest.fixture
def setup(tiny_hf_models, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(PROMPTS)))

    def make(*flags, engine=None, position=None):
        cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(data),
                            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", *flags])
        prompts = PromptIterator(PromptDataset(cfg.data.prompt_data), rollout_batch_size=4, n_samples_per_prompt=2)
        if position is not None:
            prompts.load_state_dict(position)
        return RolloutManager(cfg, engine or PatternEngine(), prompts, parity,
                              dynamic_sampler=DynamicSampler.from_config(cfg))
    return make


BUILTIN = ["--dynamic-sampling-filter-path", "megatron_rl.rollout.dynamic_sampling:check_reward_nonzero_std"]


def groups(samples):
    out = {}
    for s in samples:
        out.setdefault(s.group_index, []).append(s)
    return out


def test_the_batch_has_its_size_and_no_constant_reward_group(setup):
    manager = setup(*BUILTIN, "--over-sampling-batch-size", "3")
    for rollout_id in range(3):
        before = manager.position()["offset"]
        samples, metrics = manager.generate(rollout_id)
        by_group = groups(samples)
        assert sorted(by_group) == [0, 1, 2, 3] and all(len(g) == 2 for g in by_group.values())
        assert all(len({s.reward for s in g}) > 1 for g in by_group.values())  # every group carries a signal
        drawn = manager.position()["offset"] - before  # the stream moved past every prompt drawn
        constant = sum(i % 3 == 0 for i in range(before, before + drawn))
        assert metrics["rollout/generated_groups"] == drawn and drawn % 3 == 0
        assert metrics["rollout/filtered_groups"] == constant
        assert metrics["rollout/filtered_groups_frac"] == constant / drawn
        assert metrics["rollout/excess_groups"] == drawn - constant - 4
        assert metrics["rollout/generation_cost_ratio"] == drawn / 4
        assert metrics["rollout/dynamic_filter/drop_zero_std_0.0"] == constant  # slime's metric name
        assert metrics["rollout/reward_mean"] == 0.5  # the kept batch: every group is one 0 and one 1
        assert metrics["rollout/generated_reward_mean"] == (drawn - constant) / (2 * drawn)
    assert manager.engine.calls == [(6, 42), (6, 43), (6, 44)]  # one round each: 6 drawn, 2 constant
    # rounds draw ceil(missing / 2) batches of 2 and sample with a seed of their own: prompts 0-3 keep 1, 2
    manager = setup(*BUILTIN, "--over-sampling-batch-size", "2")
    assert manager.generate(0)[1]["rollout/dynamic_sampling_rounds"] == 2
    assert manager.engine.calls == [(4, 42), (2, 42 + 7_919_993)]


def test_a_resumed_rollout_is_the_same_and_ends_at_the_same_position(setup):
    first = setup(*BUILTIN, "--over-sampling-batch-size", "2")
    first.generate(0)
    position = first.position()
    samples, metrics = first.generate(1)
    resumed = setup(*BUILTIN, "--over-sampling-batch-size", "2", position=position)
    again, again_metrics = resumed.generate(1)
    assert again == samples and again_metrics["rollout/generated_groups"] == metrics["rollout/generated_groups"]
    assert resumed.position() == first.position()


def test_kept_groups_beyond_the_batch_are_dropped_and_counted(setup):
    manager = setup(*BUILTIN, "--over-sampling-batch-size", "10", engine=PatternEngine(constant=lambda i: False))
    samples, metrics = manager.generate(0)
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # the first four drawn
    assert metrics["rollout/excess_groups"] == 6 and metrics["rollout/dynamic_sampling_rounds"] == 1
    assert manager.position()["offset"] == 10


def test_a_batch_that_cannot_fill_stops_naming_the_flags(setup):
    manager = setup(*BUILTIN, "--over-sampling-batch-size", "4", "--dynamic-sampling-max-rounds", "3",
                    engine=PatternEngine(constant=lambda i: True))
    with pytest.raises(ConfigError) as info:
        manager.generate(0)
    message = str(info.value)
    assert ("dynamic sampling kept 0 of the 4 prompt groups a batch needs (--rollout-batch-size) after 3 round(s) "
            "(--dynamic-sampling-max-rounds 3) of --over-sampling-batch-size 4 prompts") in message
    assert "dropped 12 of 12 generated groups (zero_std_0.0: 12)" in message
    assert "raise --dynamic-sampling-max-rounds / --over-sampling-batch-size" in message


def test_the_fallback_filter_keeps_constant_groups_rather_than_sample_again(setup):
    manager = setup("--dynamic-sampling-filter-path",
                    "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std_with_fallback",
                    "--over-sampling-batch-size", "5")
    samples, metrics = manager.generate(0)  # prompts 0..4: 0 and 3 constant, one of them is needed
    assert metrics["rollout/dynamic_sampling_rounds"] == 1 and metrics["rollout/filtered_groups"] == 1
    assert [s.metadata["prompt_index"] for s in samples[::2]] == [1, 2, 3, 4]


@pytest.fixture
def user_filters(tmp_path):
    path = tmp_path / "my_filters.py"
    path.write_text(textwrap.dedent("""
        from megatron_rl.rollout.dynamic_sampling import DynamicFilterOutput

        def even_prompts(args, samples, **kwargs):
            even = samples[0].metadata["prompt_index"] % 2 == 0
            return DynamicFilterOutput(keep=even, reason=None if even else "odd")

        def legacy_bool(args, samples):
            return args.batching.n_samples_per_prompt == len(samples)

        def forgot_to_return(args, samples):
            pass
    """))
    yield path
    sys.modules.pop("my_filters", None)


def test_a_filter_from_a_user_file(setup, user_filters):
    manager = setup("--dynamic-sampling-filter-path", f"{user_filters}:even_prompts")
    samples, metrics = manager.generate(0)
    assert [s.metadata["prompt_index"] for s in samples[::2]] == [0, 2, 4, 6]
    assert metrics["rollout/dynamic_filter/drop_odd"] == 4 and metrics["rollout/generated_groups"] == 8
    samples, _ = setup("--dynamic-sampling-filter-path", f"{user_filters}:legacy_bool").generate(0)
    assert len(samples) == 8
    with pytest.raises(ConfigError, match=r"forgot_to_return returned None for the group of prompt \(prompt_index 0, line 1\); a filter "
                                          r"returns True \(keep the group\), False \(drop it\) or a "
                                          r"DynamicFilterOutput"):
        setup("--dynamic-sampling-filter-path", f"{user_filters}:forgot_to_return").generate(0)


def test_filter_paths(user_filters):
    assert load_filter("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std") \
        is check_reward_nonzero_std
    assert load_filter("megatron_rl.rollout.dynamic_sampling.check_reward_nonzero_std") is check_reward_nonzero_std
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path nope must be module:function or "
                                          "module.function"):
        load_filter("nope")
    with pytest.raises(ConfigError, match=r"cannot import 'no_such_mod' \(ModuleNotFoundError.*PYTHONPATH"):
        load_filter("no_such_mod:f")
    with pytest.raises(ConfigError, match="has no 'check_std'; callables there: .*check_reward_nonzero_std"):
        load_filter("megatron_rl.rollout.dynamic_sampling:check_std")
    with pytest.raises(ConfigError, match=r"'ZERO_STD' in 'megatron_rl.rollout.dynamic_sampling' is a float"):
        load_filter("megatron_rl.rollout.dynamic_sampling:ZERO_STD")


def test_the_builtin_filter_follows_slimes_rule():
    def group(*rewards):
        return [Sample(group_index=0, prompt_ids=[1], response_ids=[2], reward=r) for r in rewards]
    assert check_reward_nonzero_std(None, group(0.0, 1.0)).keep
    assert check_reward_nonzero_std(None, group(0.5, 0.5, 0.5)) == DynamicFilterOutput(False, "zero_std_0.5")
    assert not check_reward_nonzero_std(None, group(1.0, 1.0 + 1e-9)).keep  # std <= 1e-6: no signal
    assert not check_reward_nonzero_std(None, group(1.0)).keep  # one sample never varies


# ------------------------------------------------------------------------------------- flags
@pytest.fixture
def errors(tiny_hf_models, tmp_path):
    def collect(*extra):
        return collect_errors(parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), *extra], validate=False))
    return collect


def test_dynamic_sampling_flag_errors(errors):
    (found,) = [e for e in errors("--over-sampling-batch-size", "64", "--dynamic-sampling-max-rounds", "3")
                if "--over-sampling-batch-size" in e]
    assert "--over-sampling-batch-size and --dynamic-sampling-max-rounds size the rounds of dynamic sampling" in found
    (found,) = [e for e in errors(*BUILTIN, "--n-samples-per-prompt", "1") if "never varies" in e]
    assert "sample at least 2 responses per prompt" in found
    assert any("--over-sampling-batch-size 0 must be >= 1" in e for e in errors(*BUILTIN, "--over-sampling-batch-"
                                                                                "size", "0"))
    assert errors(*BUILTIN, "--over-sampling-batch-size", "64", "--dynamic-sampling-max-rounds", "3") == []


def test_dynamic_sampling_with_async_modes(errors, tmp_path):
    servers = ["--rollout-backend", "sglang", "--rollout-engine-urls", "http://127.0.0.1:30000",
               "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")]
    assert errors(*servers, *BUILTIN, "--async-mode", "one-step") == []  # the rollout thread fills it in rounds
    assert errors(*servers, *BUILTIN, "--async-mode", "full") == []  # the producer judges each finished group


def _group(prompt_index: int, rewards: list[float]) -> list:
    return [Sample(group_index=0, prompt_ids=[1], response_ids=[2], reward=r, metadata={"prompt_index": prompt_index})
            for r in rewards]


def test_stream_filter_judges_each_group_counts_and_stops_a_hopeless_run():
    sampler = DynamicSampler(check_reward_nonzero_std, "check_reward_nonzero_std", over_sampling_batch_size=2,
                             max_rounds=3)
    stream = StreamFilter(sampler, None, batch_size=2)
    assert stream.limit == 6  # 3 rounds x max(batch 2, over-sampling 2)
    assert stream.keep(_group(0, [0.0, 1.0])) and not stream.keep(_group(1, [1.0, 1.0]))
    m = stream.metrics(kept_groups=1)
    assert m["rollout/generated_groups"] == 2 and m["rollout/filtered_groups"] == 1
    assert m["rollout/filtered_groups_frac"] == 0.5 and m["rollout/generation_cost_ratio"] == 2.0
    assert m["rollout/generated_reward_mean"] == 0.75
    assert stream.metrics(kept_groups=1)["rollout/generated_groups"] == 0  # counts start again per step
    for i in range(4):  # 1 dropped in a row already (prompt 1): the 6th in a row ends the run
        assert not stream.keep(_group(10 + i, [0.0, 0.0]))
    with pytest.raises(ConfigError, match=r"dropped 6 finished prompt groups in a row \(--dynamic-sampling-max-rounds 3"):
        stream.keep(_group(20, [0.0, 0.0]))


def test_the_built_rollout_fills_its_batch_from_a_reward_server(tiny_hf_models, tmp_path):
    """build_rollout from flags: the embedded engine on a tiny model, rewards from a reward server in a
    thread (--rm-url), the built-in filter; every kept group varies and the server saw every sample."""
    def parity_of_first_token(body):
        rewards = [{"reward": float(s["response_ids"][0] % 2), "length": float(len(s["response_ids"]))}
                   for s in body["samples"]]
        return 200, json.dumps({"rewards": rewards}).encode()

    server = RewardServer(parity_of_first_token)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(40)))
    try:
        cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(data),
                            "--embedded-engine-ranks", "driver", "--rollout-batch-size", "3",
                            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "3",
                            "--rm-url", server.url, "--rm-batch-size", "8", *BUILTIN,
                            "--over-sampling-batch-size", "2", "--dynamic-sampling-max-rounds", "20"])
        manager = build_rollout(cfg)
        samples, metrics = manager.generate(0)
        manager.batch_builder.reward_fn.close()
    finally:
        server.close()
    by_group = groups(samples)
    assert sorted(by_group) == [0, 1, 2] and all(len(g) == 4 for g in by_group.values())
    assert all(len({s.reward for s in g}) > 1 for g in by_group.values())
    scored = sum(len(b["samples"]) for b in server.bodies)
    assert scored == 4 * metrics["rollout/generated_groups"] == 4 * manager.position()["offset"]
    assert metrics["reward/length"] == sum(s.response_length for s in samples) / len(samples)


def test_dict_rewards_are_logged_in_rollout_and_evaluation_metrics(setup, tmp_path):
    def scored(samples):
        return [{"reward": float(s.response_ids[0] % 2), "first_token": float(s.response_ids[0])} for s in samples]

    manager = setup(*BUILTIN)
    manager.batch_builder.reward_fn = scored
    manager.eval_datasets = {"held_out": manager.prompts.dataset}
    samples, metrics = manager.generate(0)
    assert metrics["reward/first_token"] == 0.5 and metrics["rollout/reward_mean"] == 0.5  # kept groups: 0 and 1
    evaluation = manager.evaluate(0)  # one sample per evaluation prompt: the double answers token 0
    assert evaluation["eval/held_out/reward/first_token"] == 0.0
