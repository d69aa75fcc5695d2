"""Shared fixtures: tiny HF models built locally and a torchrun launcher."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import megatron_rl.compat  # noqa: E402,F401  (before any test imports megatron-core: its cheap first import)
from megatron_rl.models.hf_tiny import FAMILIES, build_tiny_hf_model  # noqa: E402

# the tiers, their time budget and the order of the files (tests/_tiers.py); launches shared across files
# (tests/_launches.py)
pytest_plugins = ["_tiers", "_launches"]


# torch.distributed's variables as the session began: a test that leaves one behind would hand its port
# (still held by its store) to every torchrun a later test in the same worker starts
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_DIST_ENV_AT_START = {k: os.environ.get(k) for k in _DIST_ENV}


@pytest.fixture(autouse=True)
def _dist_env_restored():
    yield
    for k, v in _DIST_ENV_AT_START.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
    if made:  # a private store, not MASTER_PORT: a subprocess a later test starts must not inherit its port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    made_mp = not parallel_state.model_parallel_is_initialized()
    if made_mp:
        parallel_state.initialize_model_parallel()
    yield
    if made_mp:
        parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()
