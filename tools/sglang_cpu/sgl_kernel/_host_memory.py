"""CPU TEST STAND-IN, part 2: SGLang's host buffers without page-locking, on a machine without CUDA.

SGLang 0.5.23 allocates some host buffers page-locked: the routed-experts capture of
``--enable-return-routed-experts`` (``state_capturer/base.py``: ``BaseHostCache``, through
``mem_cache/pool_host/common.py``'s ``ALLOC_MEMORY_FUNCS[device]``, which registers the buffer with
``cudaHostRegister``). Page-locking only makes device-to-host copies faster; on a CPU-only machine it
initialises CUDA and the server dies at start-up. Installed by the stand-in ``sgl_kernel`` (which every
SGLang process imports, on the CPU test route only), this gives ``ALLOC_MEMORY_FUNCS["cpu"]`` the same
allocation without the registration: the same buffer, same shape and dtype, written and read by the same
SGLang code. Nothing else changes, and nothing outside ``tools/sglang_cpu`` sees it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def _allocate_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``alloc_with_host_register`` less ``cudaHostRegister`` (pinning needs CUDA)."""
    del pin_memory, registration_granularity_bytes  # page-locking is the only thing left out
    if allocator is None:
        import torch

        return torch.empty(dims, dtype=dtype, device=device)
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _allocate_unpinned


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` with the other finders, then patches it right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch now if SGLang's module is loaded already, else right after it loads. Never with CUDA."""
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:
        return
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
