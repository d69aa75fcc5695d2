"""CPU TEST STAND-IN for SGLang's kernel package ``sgl_kernel``: not the real thing, for tests only.

Why it exists: SGLang's CPU path imports ``sgl_kernel``, whose CPU build is not on the package
index and targets AVX-512/AMX Xeons; the wheels that are there are CUDA-only. To run real
SGLang 0.5.23 on this project's 2-core AVX2 CPU machines (``scripts/test_sglang_real.sh``), this
package stands in for it. Only ``scripts/test_sglang_real.sh`` (through
``tools/sglang_cpu/check_real_sglang.py``) puts ``tools/sglang_cpu`` on ``PYTHONPATH``, and only
for the SGLang server process; nothing in ``megatron_rl`` imports it.

What it provides: ``assign_req_to_token_pool_cpu`` in pure torch, the one kernel SGLang calls
for a Qwen2 model on a non-AMX CPU (docs/sglang-cpu.md). Every other
attribute is a function that raises ``NotImplementedError`` naming itself when called, so an
SGLang code path that needs a real kernel fails loudly instead of computing something wrong.
``torch.ops.sgl_kernel`` answers the few ops SGLang binds at import time (``IMPORT_TIME_OPS``) with the same
raising functions, so the modules binding them import (the Qwen-VL processor among them).
On import it also installs ``_host_memory``: SGLang's page-locked host buffers (the routed-experts
capture of ``--enable-return-routed-experts``) allocated unpinned when there is no CUDA.
"""

from __future__ import annotations

__version__ = "0.0.0+cpu-test-standin"

STANDIN = True  # lets a check tell this stand-in from a real sgl_kernel

from sgl_kernel import _host_memory, _pinless  # noqa: E402 - SGLang's host buffers unpinned without CUDA (see there)

_host_memory.install()
_pinless.install()  # --enable-lora's pin_memory=True allocations (see there)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """Write each request's new KV-cache slots into its row of ``req_to_token``.

    For request ``i``: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` gets
    the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (consumed in
    order across requests). ``pool_len`` (the row length) is only checked.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end offset {end} past the pool row length {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} called, but this sgl_kernel is the CPU test stand-in "
            "(tools/sglang_cpu/sgl_kernel): only assign_req_to_token_pool_cpu is implemented. This SGLang "
            "code path needs the real kernel package (a GPU, or an AVX-512/AMX CPU build).")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    # Dunder lookups (__path__, __file__, ...) must fail normally or the import system breaks.
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _missing(name)


#: the torch ops SGLang 0.5.23 binds at import time on CPU from modules a Qwen2.5-VL server imports
IMPORT_TIME_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu", "fused_qkvzba_split_reshape_cat_contiguous_cpu")


def _install_op_namespace() -> None:
    """``torch.ops.sgl_kernel.NAME`` for the ``IMPORT_TIME_OPS`` no library registered: the raising ``_missing(NAME)``.

    Why: some SGLang modules bind CPU kernels at import time (``sglang/srt/models/qwen3_5.py`` reads
    ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`` under ``_is_cpu``), and the multimodal processors import them
    (``multimodal/processors/qwen_vl.py`` does, through the Qwen3.5 model module), so without the op the Qwen2.5-VL
    processor does not register and SGLang refuses the architecture. Registered ops resolve as before; a missing
    one becomes a function that raises when called, never a silent result."""
    import torch

    namespace = torch.ops.sgl_kernel  # torch caches this _OpNamespace; every later lookup gets the same object
    base = type(namespace)

    class StandInOpNamespace(base):  # type: ignore[misc, valid-type]
        def __getattr__(self, name: str):
            try:
                return base.__getattr__(self, name)
            except AttributeError:
                if name not in IMPORT_TIME_OPS:  # others must stay absent: SGLang registers fakes only for ops
                    raise  # that exist (register_fake_if_exists), which a stand-in op would break
                kernel = _missing(name)
                setattr(self, name, kernel)
                return kernel

    namespace.__class__ = StandInOpNamespace


_install_op_namespace()
