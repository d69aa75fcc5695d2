"""backends/sleep_tiers.py: what the trainer's sleep frees, per backend and device, and the log line."""

import pytest

from megatron_rl.backends.sleep_tiers import plan_sleep


@pytest.mark.parametrize("setting,backend,cuda,tier,groups,why", [
    ("auto", "megatron", True, "offload", False, "never on NCCL"),
    ("on", "megatron", True, "offload", True, "--offload-train-groups on"),
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
    assert plan_sleep("on", backend="megatron", cuda=True).describe() == (
        "offload: gradient buffers released, optimizer state to host memory (megatron-core's offload); process "
        "groups destroyed while the engine generates, rebuilt before training (--offload-train-groups on)")


def test_auto_keeps_the_groups_on_a_gpu_and_says_why_and_how_to_turn_it_on():
    """The NCCL teardown never ran on a GPU: auto leaves it off there, and the logged plan names the reason, the
    check that would verify it and the explicit flag value."""
    described = plan_sleep("auto", backend="megatron", cuda=True).describe()
    assert described.startswith("offload: ") and "process groups kept (auto: off on GPUs until verified" in described
    assert "never on NCCL (scripts/gpu_check.sh runs it)" in described and "--offload-train-groups on" in described
