"""Shared fixtures: tiny HF models built locally and a torchrun launcher."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from megatron_rl.models.hf_tiny import FAMILIES, build_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory):
    """Build one tiny random-weight model per family (session-cached).

    Returns a callable ``get(family, **overrides) -> path``; overrides produce a
    separate cached model.
    """
    root = tmp_path_factory.mktemp("tiny_hf")
    cache: dict = {}

    def get(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            name = family + "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
            cache[key] = build_tiny_hf_model(family, root / name, **overrides)
        return cache[key]

    return get


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
