"""Which implementation runs the fused ops: compiled CUDA, Triton, torch, or the C++ CPU twins.

``MEGATRON_RL_KERNELS=cuda|triton|torch|cpu_ext`` forces one; unset (or empty),
the choice follows the tensors' device:

* CUDA tensors: the compiled extension ``megatron_rl._C`` if built, else Triton
  if importable, else the torch chunked reference;
* CPU tensors: torch. The C++ twins (``cpu_ext``) run only when asked: their job
  is to test the CUDA kernels' maths on machines without a GPU, and their first
  use may JIT-compile them (~1 min).

What never ran is not trusted: before a fused implementation serves its first op
on a (device, dtype), ``ops.selfcheck`` runs it against the torch ops on small
random inputs (values and gradients; bounds derived from the torch path's own
float32 error). The verdict is cached for the process. On failure the default
choice logs what differed (a WARNING) and falls back to the next implementation
(CUDA -> Triton -> torch); a forced one raises ``KernelCheckFailed`` instead.

The choice is logged once per (implementation, device type) on the
``megatron_rl`` logger. An unknown name is a ConfigError naming the variable and
the choices; a known one that is not built or cannot run on the device is a
``KernelUnavailableError`` saying how to build it. Every implementation is a row
of :data:`KERNELS` (an ``infra.registry.Registry``; ops sits above infra in the
layers, so it uses the project's table type).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_rl.infra.registry import Registry
from megatron_rl.ops import _ext
from megatron_rl.ops._ext import KernelUnavailableError
from megatron_rl.ops.selfcheck import CheckResult, KernelCheckFailed, check_kernels

ENV = "MEGATRON_RL_KERNELS"
log = logging.getLogger("megatron_rl")


@dataclass(frozen=True)
class KernelImpl:
    """One implementation: ``load()`` returns its kernel set (None for torch, which calls the reference
    functions) or raises KernelUnavailableError; ``cannot_run(device)`` is None or the reason it cannot."""

    name: str
    load: Callable[[], object]
    cannot_run: Callable[[torch.device], str | None]
    summary: str


def _load_triton():
    try:
        return importlib.import_module("megatron_rl.ops.triton_kernels")
    except ImportError as exc:
        raise KernelUnavailableError(
            f"{ENV}=triton: triton is not importable ({exc}); `pip install triton` (CUDA builds of torch ship it), "
            f"or choose {ENV}=cuda|torch") from exc


def _triton_device(device: torch.device) -> str | None:
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return (f"Triton kernels need CUDA tensors, got {device.type} (on CPU only under TRITON_INTERPRET=1, "
            f"the interpreter used by the tests)")


def _only(kind: str, hint: str):
    def check(device: torch.device) -> str | None:
        return None if device.type == kind else f"it runs on {kind} tensors, got {device.type}; {hint}"
    return check


KERNELS: Registry[KernelImpl] = Registry(ENV, "kernel implementation", {
    "cuda": KernelImpl("cuda", _ext.load_cuda_ext,
                       _only("cuda", f"on CPU use {ENV}=cpu_ext (the same maths) or torch"),
                       "compiled CUDA extension megatron_rl._C"),
    "triton": KernelImpl("triton", _load_triton, _triton_device, "Triton kernels (megatron_rl/ops/triton_kernels.py)"),
    "torch": KernelImpl("torch", lambda: None, lambda device: None, "torch chunked reference"),
    "cpu_ext": KernelImpl("cpu_ext", _ext.load_cpu_ext,
                          _only("cpu", f"on GPU use {ENV}=cuda (the same maths) or triton"),
                          "C++ CPU twins megatron_rl._C_cpu"),
})

_DEFAULT_ORDER = {"cuda": ("cuda", "triton", "torch")}  # any other device: torch
_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()
_checked: dict[tuple[str, str, torch.dtype], CheckResult] = {}  # (implementation, device, dtype) -> verdict


def requested() -> str | None:
    """The implementation ``MEGATRON_RL_KERNELS`` names (None when unset or empty); unknown names raise."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    KERNELS.get(name)  # ConfigError naming the variable and the choices
    return name


def _device_key(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def self_check(name: str, kernels, device: torch.device, dtype: torch.dtype) -> CheckResult | None:
    """The cached self-check verdict of implementation ``name`` on ``device`` / ``dtype`` (run on first use;
    None for torch, the reference). A failure is logged once, as a WARNING saying what differed."""
    if kernels is None:
        return None
    key = (name, _device_key(device), dtype)
    with _lock:
        result = _checked.get(key)
        if result is None:
            result = _checked[key] = check_kernels(name, kernels, device, dtype)
            if result.ok:
                log.info("megatron_rl.ops: %s", result.describe())
            else:
                log.warning("megatron_rl.ops: %s", result.describe())
    return result


def select(device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[str, object]:
    """``(name, kernel set)`` for ``dtype`` tensors on ``device``; the kernel set is None for torch. A fused
    implementation is used only once its self-check on this device and dtype has passed."""
    device = torch.device(device)
    name = requested()
    if name is not None:
        impl = KERNELS.get(name)
        reason = impl.cannot_run(device)
        if reason:
            raise KernelUnavailableError(f"{ENV}={name} ({impl.summary}) cannot run here: {reason}")
        kernels, why = impl.load(), f"{ENV}={name}"
        result = self_check(name, kernels, device, dtype)
        if result is not None and not result.ok:
            raise KernelCheckFailed(
                f"{ENV}={name} forces {impl.summary}, which disagrees with the torch ops here: {result.describe()}. "
                f"Unset {ENV} to fall back to the next implementation, or set {ENV}=torch")
    else:
        skipped = []
        for candidate in _DEFAULT_ORDER.get(device.type, ("torch",)):
            impl = KERNELS.get(candidate)
            if impl.cannot_run(device):
                continue
            try:
                kernels = impl.load()
            except KernelUnavailableError as exc:
                skipped.append(f"{candidate}: {str(exc).splitlines()[0][:160]}")
                continue
            result = self_check(candidate, kernels, device, dtype)
            if result is not None and not result.ok:
                skipped.append(f"{candidate}: self-check failed on {str(dtype).removeprefix('torch.')}")
                continue
            name = candidate
            break
        assert name is not None, "torch ends every default order and always loads and passes"
        why = "default for the device" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
    with _lock:
        if (name, device.type) not in _logged:
            _logged.add((name, device.type))
            log.info("megatron_rl.ops: %s kernels (%s) for %s tensors; %s", name, KERNELS.get(name).summary,
                     device.type, why)
    return name, kernels


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Implementations usable on ``device`` right now without compiling anything, in default preference order
    (cpu_ext counts once it is prebuilt or already JIT-loaded in this process)."""
    device = torch.device(device)
    out = []
    for name in ("cuda", "triton", "torch", "cpu_ext"):
        impl = KERNELS.get(name)
        if impl.cannot_run(device):
            continue
        if name == "cpu_ext" and not _ext.cpu_ext_loaded_or_prebuilt():
            continue
        if name != "cpu_ext":
            try:
                impl.load()
            except KernelUnavailableError:
                continue
        out.append(name)
    return out
