"""Shared fixtures: tiny HF models built locally and a torchrun launcher."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import megatron_rl.compat  # noqa: E402,F401  (before any test imports megatron-core: its cheap first import)
from megatron_rl.models.hf_tiny import FAMILIES, build_tiny_hf_model  # noqa: E402

# The heaviest test files, heaviest first (seconds of each file on the 2-core CI machine, from a junit run of the
# suite and scripts/test.sh's --durations log). scripts/test.sh runs two xdist workers that take whole files
# (--dist loadfile) in collection order (--no-loadscope-reorder; xdist's default order is by number of tests,
# which put these few-test, minute-long files LAST, so one worker could finish one alone while the other
# idled). Longest first, the run ends on many short files. Files not listed keep pytest's order after these.
HEAVY_FIRST = (
    "tests/e2e/test_demo.py", "tests/e2e/test_resume.py", "tests/e2e/test_sglang_launched.py",
    "tests/e2e/test_signals.py", "tests/e2e/test_async_full.py", "tests/dist/test_fsdp_backend.py",
    "tests/dist/test_check_parity_tool.py", "tests/rollout/test_sglang_launcher.py", "tests/dist/test_backend.py",
    "tests/convert/test_convert_roundtrip.py", "tests/dist/test_parity_layouts.py", "tests/dist/test_frozen_weights.py",
    "tests/dist/test_checkpoint_resume_layouts.py", "tests/dist/test_convert_layouts.py",
    "tests/e2e/test_custom_advantage.py", "tests/dist/test_optimizer_offload.py", "tests/dist/test_checkpoint_resume.py",
    "tests/e2e/test_sglang_distributed.py", "tests/dist/test_critic.py", "tests/e2e/test_agent_demo.py",
    "tests/e2e/test_async_one_step.py", "tests/ops/test_cpu_ext.py", "tests/config/test_train_startup_errors.py",
    "tests/dist/test_lora_layouts.py", "tests/rollout/test_agent_manager.py", "tests/dist/test_cp_attention.py",
    "tests/dist/test_routing_replay.py", "tests/e2e/test_fresh_start.py", "tests/tools/test_check_env.py",
    "tests/convert/test_convert.py", "tests/e2e/test_save_root.py", "tests/tools/test_gpu_steps.py",
    "tests/rollout/test_embedded.py", "tests/ops/test_triton_kernels.py", "tests/dist/test_engine_replicas.py",
    "tests/dist/test_data_movement.py", "tests/e2e/test_launch_scripts.py", "tests/convert/test_streaming_save.py",
    "tests/dist/test_reloadable_groups.py", "tests/e2e/test_agent_e2e.py", "tests/rollout/test_embedded_server.py",
    "tests/dist/test_sglang_tensor_ranks.py",
)


def pytest_collection_modifyitems(session, config, items):
    """``HEAVY_FIRST`` first (a stable sort: the other files, and every file's own tests, keep their order)."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


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
