"""Fixtures of the partial-rollout tests: two weight versions of one tiny model and their HF references."""

import pytest
import torch
import transformers


@pytest.fixture(scope="module")
def models(tiny_hf_models):
    """Two tiny qwen2 checkpoints of one shape: version 0's weights and version 1's."""
    return {0: tiny_hf_models("qwen2"), 1: tiny_hf_models("qwen2", seed=1)}


@pytest.fixture(scope="module")
def references(models):
    return {v: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for v, p in models.items()}
