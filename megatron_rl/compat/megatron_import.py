"""The first ``import megatron.core`` of a process, made cheaper without changing what runs.

Importing megatron-core 0.16.1 costs ~2.2 s of CPU per process here, half of it for two things this
engine never uses at import time:

* ``megatron.core.timers`` runs ``try: import wandb`` (~0.5 s) only to write megatron's own timers to
  W&B when handed a writer, which this engine never does: metrics go through ``infra.tracking``,
  which imports wandb itself on the driver when ``--wandb-project`` asks (before megatron, so the
  hiding below is then skipped).
* Modules decorate functions with ``jit_fuser`` = ``torch.compile`` at import, which imports
  ``torch._dynamo`` and ``torch._inductor`` (~1.1 s). On a CPU host ``patch_jit_fuser`` turns the
  fuser off anyway (dynamo tracing costs seconds per shape there for no gain); with
  ``torch.compile`` an identity while megatron imports, those functions are plain Python from the
  start, including the methods (``TopKRouter._apply_expert_bias``, ``L2Norm._norm``,
  ``Attention._apply_output_gate``) the patch cannot unwrap and which dynamo compiled on their
  first call. On a GPU host ``torch.compile`` is left alone.

:func:`install` puts a one-shot finder on ``sys.meta_path`` (no import happens until some module
imports megatron-core; a process that never does pays nothing). Every process importing
``megatron_rl.compat`` (the models, backends and converters do, before megatron) gets it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence

import torch

TARGET = "megatron.core"


def _compile_deferred(model: Any = None, **_kwargs: Any) -> Any:
    """``torch.compile`` while megatron imports on a CPU host: the function itself (either call form)."""
    if model is None:
        return lambda fn: fn
    return model


@contextlib.contextmanager
def quiet_import(cpu_host: bool) -> Iterator[None]:
    """wandb hidden (unless already imported) and, on a CPU host, ``torch.compile`` an identity."""
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        # a None entry makes `import wandb` raise ImportError: megatron falls back to wandb = None
        sys.modules["wandb"] = None  # type: ignore[assignment]  # typeshed's dict omits None, the documented block
    compile_ = torch.compile
    if cpu_host:
        torch.compile = _compile_deferred
    try:
        yield
    finally:
        torch.compile = compile_
        if hide_wandb and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


class _Loader(importlib.abc.Loader):
    """Runs megatron.core's own loader inside :func:`quiet_import` (its ``__init__`` imports the rest)."""

    def __init__(self, inner: importlib.abc.Loader, cpu_host: bool):
        self.inner = inner
        self.cpu_host = cpu_host

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with quiet_import(self.cpu_host):
            self.inner.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` once, through the other finders, and wraps its loader."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None,
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != TARGET:
            return None
        uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, cpu_host=not torch.cuda.is_available())
        return spec


_FINDER = _Finder()


def install() -> bool:
    """Put the finder first on ``sys.meta_path``; False when megatron-core is already imported."""
    if TARGET in sys.modules:
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def uninstall() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_FINDER)
