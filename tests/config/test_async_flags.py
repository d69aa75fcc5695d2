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


def test_the_pause_generation_modes_that_keep_rows_need_full_partial_rollouts(argv, tiny_hf_models, tmp_path):
    """--pause-generation-mode retract / in_place keep rows across a sync: full mode with --partial-rollout only;
    in_place refuses a route that flushes with its last bucket, and fault tolerance is not built with either."""
    full = ["--async-mode", "full", "--partial-rollout"]
    for mode in ("retract", "in_place"):
        assert errors(argv(*URL, *full, "--pause-generation-mode", mode)) == []
        for other in (["--async-mode", "full"], ["--async-mode", "one-step"], []):
            found = [e for e in errors(argv(*URL, *other, "--pause-generation-mode", mode))
                     if "--pause-generation-mode" in e]
            assert len(found) == 1 and "add --async-mode full --partial-rollout" in found[0], other
    found = [e for e in errors(["--hf-checkpoint", tiny_hf_models("qwen2"), *URL, *full, "--pause-generation-mode",
                                "in_place", "--update-weight-transport", "distributed"])
             if "--pause-generation-mode" in e]
    assert len(found) == 1 and is_not_built_yet(found[0]) and "--update-weight-transport disk" in found[0]
    launched = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--rollout-num-gpus", "1", *full,
                "--use-fault-tolerance", "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path)]
    found = [e for e in errors([*launched, "--pause-generation-mode", "retract"]) if "--pause-generation-mode" in e]
    assert len(found) == 1 and is_not_built_yet(found[0]) and "--pause-generation-mode abort" in found[0]


def test_full_mode_with_fault_tolerance_is_accepted(tiny_hf_models, tmp_path):
    argv = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--rollout-num-gpus", "1", "--async-mode", "full",
            "--use-fault-tolerance", "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path)]
    assert [e for e in errors(argv) if "--use-fault-tolerance" in e] == []


def test_the_embedded_engine_goes_to_a_process_of_its_own_with_async(tiny_hf_models, tmp_path):
    """auto puts the embedded engine in its own process under --async-mode, synced from disk under the output
    dir; inside the trainer ranks (all / driver) it is refused naming the fix; the process refuses the
    in-process transport and memory hand-over."""
    base = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--output-dir", str(tmp_path / "run")]
    cfg = parse_config([*base, "--async-mode", "full", "--partial-rollout"], validate=False)
    assert collect_errors(cfg) == []
    assert cfg.embedded_placement == "process" and not cfg.embedded_replicas
    assert cfg.sync.update_weight_transport == "disk"
    assert cfg.sync.update_weight_disk_dir == str(tmp_path / "run" / "engine_weights")
    assert parse_config(base, validate=False).embedded_placement == "all"  # off: unchanged
    for ranks in ("all", "driver"):
        found = [e for e in errors([*base, "--async-mode", "one-step", "--embedded-engine-ranks", ranks])
                 if "--async-mode one-step" in e]
        assert len(found) == 1 and "--embedded-engine-ranks process" in found[0] and not is_not_built_yet(found[0])
    found = [e for e in errors([*base, "--embedded-engine-ranks", "process", "--update-weight-transport", "tensor"])
             if "--embedded-engine-ranks process" in e]
    assert len(found) == 1 and "use --update-weight-transport disk" in found[0]
    found = [e for e in errors([*base, "--embedded-engine-ranks", "process", "--offload-rollout"])
             if "--offload-rollout releases" in e]
    assert len(found) == 1
    found = [e for e in errors([*base, "--embedded-engine-ranks", "process", "--debug-train-only",
                                "--load-debug-rollout-data", str(tmp_path / "r_{rollout_id}.pt")])
             if "--embedded-engine-ranks process" in e]
    assert len(found) == 1 and "generates nothing" in found[0]


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
