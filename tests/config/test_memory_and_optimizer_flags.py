"""--ref-weights-location and the optimizer/parallel flags slime scripts use with Megatron-LM's implied meaning."""

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def test_default_is_auto_and_values_parse(hf_dir):
    assert parse_config(["--hf-checkpoint", hf_dir]).memory.ref_weights_location == "auto"
    for value in ("device", "host"):
        cfg = parse_config(["--hf-checkpoint", hf_dir, "--ref-weights-location", value])
        assert cfg.memory.ref_weights_location == value


@pytest.mark.parametrize("offload", ["--colocate", "--offload-train"])
def test_device_with_offloading_is_refused(hf_dir, offload):
    with pytest.raises(ConfigError, match=f"--ref-weights-location device with {offload}: .*use "
                                          "--ref-weights-location host"):
        parse_config(["--hf-checkpoint", hf_dir, "--ref-weights-location", "device", offload])
    parse_config(["--hf-checkpoint", hf_dir, "--ref-weights-location", "auto", offload])  # auto picks host there


def test_slime_defaults_that_megatron_lm_implies(hf_dir):
    """slime scripts pass --sequence-parallel at TP 1 and --optimizer-cpu-offload without
    --use-distributed-optimizer (slime always sets it): accepted, with Megatron-LM's meaning."""
    cfg = parse_config(["--hf-checkpoint", hf_dir, "--sequence-parallel"])
    assert cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size == 1
    cfg = parse_config(["--hf-checkpoint", hf_dir, "--optimizer-cpu-offload", "--use-precision-aware-optimizer"])
    assert cfg.optimizer.effective_distributed_optimizer and not cfg.optimizer.use_distributed_optimizer
    plain = parse_config(["--hf-checkpoint", hf_dir])
    assert not plain.optimizer.effective_distributed_optimizer


def test_offload_train_groups_on_needs_a_sleeping_megatron_trainer(hf_dir):
    with pytest.raises(ConfigError, match="--offload-train-groups on destroys the trainer's process groups while "
                                          "it sleeps, and it sleeps only with --offload-train or --colocate"):
        parse_config(["--hf-checkpoint", hf_dir, "--offload-train-groups", "on"])
    with pytest.raises(ConfigError, match="--offload-train-groups on with --train-backend fsdp: only the megatron"):
        parse_config(["--hf-checkpoint", hf_dir, "--offload-train-groups", "on", "--colocate", "--train-backend",
                      "fsdp"])
    cfg = parse_config(["--hf-checkpoint", hf_dir, "--offload-train-groups", "on", "--offload-train"])
    assert cfg.memory.offload_train_groups == "on"
    assert parse_config(["--hf-checkpoint", hf_dir]).memory.offload_train_groups == "auto"
    # auto and off are accepted anywhere: auto decides on the device (backends/sleep_tiers.py)
    parse_config(["--hf-checkpoint", hf_dir, "--offload-train-groups", "off", "--train-backend", "fsdp"])
