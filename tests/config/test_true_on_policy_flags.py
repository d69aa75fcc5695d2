"""--true-on-policy-mode: accepted where the engine and trainer are checked bitwise (dense llama/qwen2/qwen3,
MoE qwen3_moe/mixtral with routing replay R3, TP1, fp32, embedded engine, megatron backend), refused by name everywhere else (docs/on-policy.md)."""

import dataclasses
import re

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.on_policy_rules import true_on_policy_errors
from megatron_rl.errors import ConfigError


def _replace(cfg, group: str, **fields):
    return dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **fields)})


def test_accepted_on_a_dense_fp32_tp1_run_and_it_reads_the_rollout_logprobs(tiny_hf_models):
    from megatron_rl.algorithms.from_config import spec_from_config

    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen3"), "--true-on-policy-mode"])
    assert cfg.algorithm.true_on_policy_mode and true_on_policy_errors(cfg) == []
    assert spec_from_config(cfg).prepare_batch([]).rollout_logprobs  # the mismatch metrics are logged
    off = parse_config(["--hf-checkpoint", tiny_hf_models("qwen3")])
    assert not spec_from_config(off).prepare_batch([]).rollout_logprobs


@pytest.mark.parametrize("group, fields, flag", [
    ("parallel", {"tensor_model_parallel_size": 2}, "--tensor-model-parallel-size 2"),
    ("parallel", {"context_parallel_size": 2}, "--context-parallel-size 2"),
    ("parallel", {"pipeline_model_parallel_size": 2}, "--pipeline-model-parallel-size 2"),
    ("parallel", {"expert_model_parallel_size": 2}, "--expert-model-parallel-size 2"),
    ("rollout", {"rollout_backend": "sglang"}, "--rollout-backend sglang"),
    ("precision", {"train_backend": "fsdp"}, "--train-backend fsdp"),
    ("precision", {"bf16": True}, "--bf16"),
    ("precision", {"fp8_format": "e4m3"}, "--fp8-format e4m3"),
    ("lora", {"lora_rank": 8}, "--lora-rank 8"),
])
def test_each_layout_not_yet_invariant_is_refused_by_name(tiny_hf_models, group, fields, flag):
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen3"), "--true-on-policy-mode"])
    errors = true_on_policy_errors(_replace(cfg, group, **fields))
    assert len(errors) == 1 and errors[0].startswith(f"--true-on-policy-mode with {flag}: ")
    assert true_on_policy_errors(_replace(_replace(cfg, "algorithm", true_on_policy_mode=False), group, **fields)) == []


def test_a_model_type_not_checked_bitwise_is_refused_at_validation(tiny_hf_models):
    path = tiny_hf_models("glm4_moe")  # a sigmoid router with a shared expert: not the checked MoE form
    with pytest.raises(ConfigError, match=re.escape(f"--true-on-policy-mode with --hf-checkpoint {path}: model_type "
                                                    "'glm4_moe' is not yet checked bitwise")):
        parse_config(["--hf-checkpoint", path, "--true-on-policy-mode", "--use-rollout-routing-replay"])


def test_a_sliding_window_is_refused(tiny_hf_models):
    path = tiny_hf_models("mixtral", sliding_window=16)
    with pytest.raises(ConfigError, match=re.escape(f"--true-on-policy-mode with --hf-checkpoint {path}: "
                                                    "sliding-window attention")):
        parse_config(["--hf-checkpoint", path, "--true-on-policy-mode", "--use-rollout-routing-replay"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_model_is_accepted_with_rollout_routing_replay_only(tiny_hf_models, family):
    path = tiny_hf_models(family)
    cfg = parse_config(["--hf-checkpoint", path, "--true-on-policy-mode", "--use-rollout-routing-replay"])
    assert true_on_policy_errors(cfg) == []
    with pytest.raises(ConfigError, match=re.escape(f"--true-on-policy-mode with the MoE model {path}: a MoE model "
                                                    "needs the engine's experts replayed in the trainer (R3): add "
                                                    "--use-rollout-routing-replay")):
        parse_config(["--hf-checkpoint", path, "--true-on-policy-mode"])
    for fields, flag in (({"moe_grouped_gemm": True}, "--moe-grouped-gemm"),
                         ({"moe_permute_fusion": True}, "--moe-permute-fusion"),
                         ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type flex"),
                         ({"moe_token_dispatcher_type": "allgather"}, "--moe-token-dispatcher-type allgather")):
        errors = true_on_policy_errors(_replace(cfg, "megatron", **fields))
        assert len(errors) == 1 and f": {flag}: fused/grouped MoE kernels" in errors[0]


def test_tp2_is_refused_before_any_worker_starts(tiny_hf_models):
    with pytest.raises(ConfigError, match=re.escape("--true-on-policy-mode with --tensor-model-parallel-size 2: a "
                                                    "row-parallel linear splits each dot product")):
        parse_config(["--hf-checkpoint", tiny_hf_models("qwen3"), "--true-on-policy-mode",
                      "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"])
