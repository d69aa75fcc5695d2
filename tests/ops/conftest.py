"""The C++ CPU twins, JIT-built once per test run into a temporary TORCH_EXTENSIONS_DIR.

Every test (and the torchrun workers, through the environment) loads the same
build; a failed build fails the tests that need it with the compiler's log.
Under pytest-xdist the workers share one directory (the run's base temp dir):
torch's build lock lets the first worker build and the others load its result,
so test files that need the twins cost one build wherever they are scheduled.
"""

import os
import time

import pytest


@pytest.fixture(scope="session")
def cpu_ext_dir(tmp_path_factory):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is <run's basetemp>/popen-gwN
        shared = tmp_path_factory.getbasetemp().parent / "torch_extensions"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="session")
def cpu_ext(cpu_ext_dir):
    """The ``megatron_rl._C_cpu`` module (prebuilt if setup.py built it, else JIT-built here)."""
    from megatron_rl.ops import _ext

    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cpu_ext_dir)
    start = time.monotonic()
    try:
        module = _ext.load_cpu_ext(verbose=False)
    except _ext.KernelUnavailableError as exc:
        pytest.fail(f"building the C++ CPU twins failed (build dir {cpu_ext_dir}):\n{exc}", pytrace=False)
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    print(f"cpu_ext ready in {time.monotonic() - start:.1f}s: {module.__file__}")
    return module


@pytest.fixture
def use_kernels(monkeypatch):
    """``use_kernels(name)`` sets MEGATRON_RL_KERNELS for this test only."""
    def use(name):
        monkeypatch.setenv("MEGATRON_RL_KERNELS", name)
    return use
