"""CPU TEST STAND-IN, part 3: page-locking requests become no-ops on a machine without CUDA.

SGLang 0.5.23's LoRA serving (``--enable-lora``) allocates its small host-side index and offset
tensors page-locked (``lora/layers.py``, ``lora/lora.py``, ``lora/backend/torch_backend.py``:
``torch.tensor(..., pin_memory=True)``, ``tensor.pin_memory()``). Page-locking only speeds up
host-to-device copies; without CUDA torch refuses it ("Found no NVIDIA driver") and the server dies
at start-up. Installed by the stand-in ``sgl_kernel`` (imported by every SGLang process, on the CPU
test route only) when CUDA is absent, this makes ``pin_memory=True`` on torch's factory functions and
``Tensor.pin_memory()`` return the same tensor unpinned: a call that could only raise here now
allocates what it asked for, and nothing that worked before changes. Nothing outside
``tools/sglang_cpu`` sees it.
"""

from __future__ import annotations

import functools

FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
             "full_like", "empty_strided", "rand", "randn", "randint")


def _unpinned(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)  # page-locking needs CUDA; the allocation itself is the same
        return fn(*args, **kwargs)

    call.__pinless__ = True  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Never with CUDA; once per process."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "__pinless__", False):
        return
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))

    def pin_memory(self, device=None):  # the tensor itself: no page-locked copy without CUDA
        return self

    pin_memory.__pinless__ = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
    torch.Tensor.is_pinned = lambda self, device=None: False  # type: ignore[method-assign]
