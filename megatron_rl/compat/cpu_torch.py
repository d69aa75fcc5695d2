"""A ``torch`` stand-in for megatron-core modules when there is no CUDA.

megatron-core assumes a GPU at a few hundred call sites: ``torch.cuda.current_device()``
as an allocation device, ``device="cuda"`` literals, streams, events, ``synchronize``,
NVTX ranges and CUDA RNG state. Rather than patching each function (brittle across
releases), :func:`install` rebinds the global name ``torch`` *inside megatron.core
modules only* to :class:`CpuTorch`, which forwards every attribute to the real torch
except:

* factory functions (``torch.empty/zeros/tensor/...``) map a CUDA ``device`` to CPU
  and drop ``pin_memory=True`` (pinning needs an accelerator);
* ``torch.device("cuda"[, i])`` becomes ``torch.device("cpu")``;
* ``torch.cuda`` is :class:`CpuCuda`: ``current_device()`` is the CPU device,
  streams/events are no-op objects, ``synchronize`` and NVTX are no-ops, and the RNG
  calls (``get_rng_state/set_rng_state/manual_seed``) act on the CPU generator so
  megatron's model-parallel RNG tracker forks real state.

Invariants: nothing outside ``megatron.core`` sees a changed ``torch``; the real
``torch`` module object is never mutated here; installing twice is a no-op.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch

_CPU = torch.device("cpu")

# Factory functions that take ``device=`` (and some ``pin_memory=``).
FACTORY_FUNCTIONS = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn",
    "randint", "randperm", "eye", "linspace", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like", "empty_strided", "scalar_tensor", "tril_indices",
    "triu_indices",
)


def is_cuda_device(device: Any) -> bool:
    """True for the device spellings megatron uses for "the current GPU"."""
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare int as cuda:<int>
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _map_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and is_cuda_device(kwargs["device"]):
        kwargs["device"] = _CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        return fn(*args, **_map_kwargs(kwargs))

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__wrapped__ = fn
    return factory


class _DeviceMeta(type):
    def __call__(cls, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return _CPU
        if kwargs.get("type", "").startswith("cuda"):
            return _CPU
        return torch.device(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)


class CpuDevice(metaclass=_DeviceMeta):
    """``torch.device`` that turns CUDA spellings into the CPU device."""


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, event=None):
        return event if event is not None else _NoOpEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NoOpStream)

    def __hash__(self):
        return 0


class _NoOpEvent:
    """Stands in for ``torch.cuda.Event``; ``elapsed_time`` reports 0 ms."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_DEFAULT_STREAM = _NoOpStream()


class _NoOpNvtx:
    @staticmethod
    def range_push(*args, **kwargs):
        return 0

    @staticmethod
    def range_pop(*args, **kwargs):
        return 0

    @staticmethod
    def mark(*args, **kwargs):
        return None

    @staticmethod
    @contextlib.contextmanager
    def range(*args, **kwargs):
        yield


class CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron-core needs it on a CPU-only host."""

    def __init__(self):
        super().__init__("megatron_rl.compat.cpu_torch.cuda")
        self.nvtx = _NoOpNvtx()
        self.Stream = _NoOpStream
        self.Event = _NoOpEvent
        self.random = self  # megatron calls torch.cuda.random.get_rng_state(...)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    # -- devices ---------------------------------------------------------
    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def set_device(*args, **kwargs):
        return None

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    # -- streams ---------------------------------------------------------
    @staticmethod
    def current_stream(*args, **kwargs):
        return _DEFAULT_STREAM

    @staticmethod
    def default_stream(*args, **kwargs):
        return _DEFAULT_STREAM

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    # -- memory stats (all zero) -----------------------------------------
    @staticmethod
    def memory_allocated(*args, **kwargs):
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def empty_cache():
        return None

    # -- RNG: the CPU default generator plays the role of the GPU's -------
    @staticmethod
    def get_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


class CpuTorch(types.ModuleType):
    """The ``torch`` module as seen by megatron-core on a CPU-only host."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = CpuCuda()
        self.device = CpuDevice
        for name in FACTORY_FUNCTIONS:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


CPU_TORCH = CpuTorch()


def install(prefix: str = "megatron.core") -> list[str]:
    """Rebind ``torch`` to :data:`CPU_TORCH` in every loaded module under ``prefix``.

    Returns the names of modules changed by this call (empty when already done).
    Call again after importing more megatron modules: it only touches new ones.
    """
    changed = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        if getattr(module, "torch", None) is torch:
            setattr(module, "torch", CPU_TORCH)
            changed.append(name)
    return changed
