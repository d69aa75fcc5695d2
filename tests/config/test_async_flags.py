"""``--async-mode``'s validation: what can overlap generation with training is accepted, the rest refused
before any worker starts, naming the flag, the reason and the fix (config/rollout_rules.py)."""

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors, is_not_built_yet

URL = ["--rollout-backend", "sglang", "--rollout-engine-urls", "http://127.0.0.1:30000"]


@pytest.fixture
def argv(tiny_hf_models, tmp_path):
    def make(*extra):
        return ["--hf-checkpoint", tiny_hf_models("qwen2"), "--update-weight-transport", "disk",
                "--update-weight-disk-dir", str(tmp_path / "w"), *extra]
    return make


def errors(argv):
    return collect_errors(parse_config(argv, validate=False))


def test_one_step_against_servers_of_their_own_is_accepted(argv):
    assert errors(argv(*URL, "--async-mode", "one-step", "--async-wait-timeout", "600")) == []


def test_full_mode_against_servers_of_their_own_is_accepted(argv):
    assert errors(argv(*URL, "--async-mode", "full", "--max-staleness", "2", "--partial-rollout")) == []


def test_full_mode_pacing_flags_are_refused_elsewhere(argv):
    found = [e for e in errors(argv(*URL, "--async-mode", "one-step", "--max-staleness", "2", "--partial-rollout"))
             if "--max-staleness" in e]
    assert len(found) == 1 and "staleness 1" in found[0] and "add --async-mode full" in found[0]
    found = [e for e in errors(argv(*URL, "--async-mode", "full", "--max-staleness", "0")) if "--max-staleness" in e]
    assert len(found) == 1 and "use >= 1" in found[0]


def test_full_mode_with_fault_tolerance_is_refused_as_not_built(tiny_hf_models, tmp_path):
    argv = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--rollout-num-gpus", "1", "--async-mode", "full",
            "--use-fault-tolerance"]
    found = [e for e in errors(argv) if "--use-fault-tolerance with --async-mode full" in e]
    assert len(found) == 1 and is_not_built_yet(found[0])


def test_the_embedded_engine_in_the_driver_rank_is_refused_as_not_built(argv):
    found = [e for e in errors(argv("--update-weight-transport", "tensor", "--async-mode", "one-step"))
             if "--async-mode one-step" in e]
    assert len(found) == 1 and is_not_built_yet(found[0]) and "--rollout-engine-urls" in found[0]


@pytest.mark.parametrize("flag", ["--offload-rollout", "--offload-train"])
def test_engines_sharing_the_trainers_devices_are_refused(argv, flag):
    found = [e for e in errors(argv(*URL, "--async-mode", "one-step", flag)) if "--async-mode one-step" in e]
    assert len(found) == 1 and flag in found[0] and not is_not_built_yet(found[0])


def test_a_run_that_does_not_train_or_generate_has_nothing_to_overlap(argv, tmp_path):
    found = [e for e in errors(argv(*URL, "--async-mode", "one-step", "--debug-rollout-only"))
             if "--async-mode one-step" in e]
    assert len(found) == 1 and "trains nothing" in found[0]


def test_the_wait_timeout_without_async_is_refused(argv):
    found = [e for e in errors(argv(*URL, "--async-wait-timeout", "60")) if "--async-wait-timeout" in e]
    assert len(found) == 1 and "add --async-mode or drop it" in found[0]


@pytest.mark.parametrize("extra,needle", [
    (["--tis-mode", "mask"], "--tis-mode mask shapes what --use-tis does"),
    (["--tis-level", "sequence"], "--tis-level sequence shapes what --use-tis does"),
    (["--rs-upper-bound", "3"], "--rs-upper-bound 3.0 shapes what --use-rs does"),
    (["--use-rs", "--use-rollout-logprobs"], "--use-rollout-logprobs with --use-rs"),
])
def test_off_policy_knobs_without_their_switch_are_refused_at_parse_time(argv, extra, needle):
    assert any(needle in e for e in errors(argv(*extra))), errors(argv(*extra))
