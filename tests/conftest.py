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


@pytest.fixture(scope="module")
def tp1_world():
    """World-size-1 gloo + megatron's parallel state, torn down only if made here."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from _util import free_port  # tests/ is on sys.path (above)

    made = not dist.is_initialized()
    if made:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    made_mp = not parallel_state.model_parallel_is_initialized()
    if made_mp:
        parallel_state.initialize_model_parallel()
    yield
    if made_mp:
        parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()
