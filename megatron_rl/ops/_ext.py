"""Loading the compiled fused kernels (``csrc/``): the CUDA extension and the C++ CPU twins.

Two modules share one binding (``csrc/bindings.cpp``) and one Python API:

* ``megatron_rl._C``: CUDA kernels + CPU twins, built by ``setup.py`` with
  ``MEGATRON_RL_BUILD_EXT=cuda`` (or ``auto`` when a CUDA torch and nvcc are present).
* ``megatron_rl._C_cpu``: the CPU twins only, built by ``setup.py`` with
  ``MEGATRON_RL_BUILD_EXT=cpu``, or JIT-compiled here on first use with
  ``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR`` (default
  ``~/.cache/torch_extensions``), where later processes find it already built.

Why a JIT path at all: the twins exist to test the kernels' maths on machines
without a GPU, and a ~1 minute compile once per cache dir is cheaper than making
every ``pip install -e .`` compile C++.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import threading
from pathlib import Path

from megatron_rl.errors import ConfigError

CSRC = Path(__file__).resolve().parents[2] / "csrc"
JIT_NAME = "megatron_rl_C_cpu"
CPU_CFLAGS = ["-O3", "-fopenmp"]  # setup.py builds with the same flags
_lock = threading.Lock()
_cache: dict[str, object] = {}


class KernelUnavailableError(ConfigError):
    """The implementation asked for (``MEGATRON_RL_KERNELS``) is not built or cannot run here; the message says
    how to build it."""


def cpu_sources() -> list[Path]:
    return [CSRC / "bindings.cpp", *sorted((CSRC / "cpu").glob("*.cpp"))]


def cuda_sources() -> list[Path]:
    return [*cpu_sources(), *sorted((CSRC / "cuda").glob("*.cu"))]


def load_cuda_ext():
    """``megatron_rl._C`` (prebuilt by setup.py), or KernelUnavailableError saying how to build it."""
    if "cuda" not in _cache:
        try:
            _cache["cuda"] = importlib.import_module("megatron_rl._C")
        except ImportError as exc:
            raise KernelUnavailableError(
                f"MEGATRON_RL_KERNELS=cuda: the CUDA extension megatron_rl._C is not built ({exc}). Build it with "
                f"a CUDA build of torch and nvcc: CUDA_HOME=/usr/local/cuda MEGATRON_RL_BUILD_EXT=cuda "
                f"pip install -e . --no-build-isolation (docs/kernels.md), or choose MEGATRON_RL_KERNELS=triton|torch"
            ) from exc
    return _cache["cuda"]


def _jit_build(verbose: bool):
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        try:  # the PyPI wheel installs its binary next to the venv's python, which may not be on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            raise KernelUnavailableError(
                "MEGATRON_RL_KERNELS=cpu_ext: megatron_rl._C_cpu is not prebuilt and its JIT build needs ninja: "
                "`pip install ninja`, or build it once with MEGATRON_RL_BUILD_EXT=cpu pip install -e . "
                "--no-build-isolation") from None
    build_dir = cpp_extension._get_build_directory(JIT_NAME, verbose)  # $TORCH_EXTENSIONS_DIR/<name> or ~/.cache
    try:
        # -fopenmp: at::parallel_for is inlined from ATen's OpenMP backend; without it the loops run serially.
        return cpp_extension.load(name=JIT_NAME, sources=[str(p) for p in cpu_sources()], extra_cflags=CPU_CFLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as exc:  # the compiler's output is in the message: keep it whole
        raise KernelUnavailableError(
            f"MEGATRON_RL_KERNELS=cpu_ext: JIT build of the C++ CPU twins in {build_dir} failed:\n{exc}\n"
            f"(sources: {CSRC}; or build with MEGATRON_RL_BUILD_EXT=cpu pip install -e . --no-build-isolation)"
        ) from exc


def load_cpu_ext(verbose: bool = False):
    """``megatron_rl._C_cpu`` if setup.py built it, else the JIT build (cached across processes)."""
    with _lock:
        if "cpu" not in _cache:
            try:
                _cache["cpu"] = importlib.import_module("megatron_rl._C_cpu")
            except ImportError:
                if not CSRC.is_dir():
                    raise KernelUnavailableError(
                        f"MEGATRON_RL_KERNELS=cpu_ext: megatron_rl._C_cpu is not built and the sources {CSRC} are "
                        f"missing (an installed wheel without csrc/): reinstall with MEGATRON_RL_BUILD_EXT=cpu"
                    ) from None
                _cache["cpu"] = _jit_build(verbose)
        return _cache["cpu"]


def cpu_ext_loaded_or_prebuilt() -> bool:
    """True when ``load_cpu_ext`` would not compile: loaded already, or ``megatron_rl._C_cpu`` importable."""
    if "cpu" in _cache:
        return True
    return importlib.util.find_spec("megatron_rl._C_cpu") is not None
