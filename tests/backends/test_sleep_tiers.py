"""backends/sleep_tiers.py: what the trainer's sleep frees, per backend and device, and the log line."""

import pytest

from megatron_rl.backends.sleep_tiers import plan_sleep


@pytest.mark.parametrize("setting,backend,cuda,tier,groups,why", [
    ("auto", "megatron", True, "offload", True, "NCCL communicators hold GPU memory"),
    ("auto", "megatron", False, "none", False, "gloo groups on CPU hold no device memory"),
    ("auto", "fsdp", True, "fsdp-offload", False, "FSDP2's device mesh keeps its groups"),
    ("on", "megatron", False, "none", True, "--offload-train-groups on"),
    ("off", "megatron", True, "offload", False, "--offload-train-groups off"),
])
def test_plan(setting, backend, cuda, tier, groups, why):
    plan = plan_sleep(setting, backend=backend, cuda=cuda)
    assert (plan.tier, plan.groups) == (tier, groups) and why in plan.why_groups
    assert plan.describe().startswith(f"{tier}: ")


def test_description_says_what_is_freed():
    assert plan_sleep("auto", backend="megatron", cuda=True).describe() == (
        "offload: gradient buffers released, optimizer state to host memory (megatron-core's offload); process "
        "groups destroyed while the engine generates, rebuilt before training (auto: NCCL communicators hold GPU "
        "memory)")
