"""Make ``import slime`` find megatron_rl's compatibility package, but only when no real slime is installed.

Why a meta-path finder placed last: every finder before it (the standard path finder first) is asked before it,
so an installed slime (on ``sys.path``, in site-packages, editable) is always the one imported and is never
shadowed; only when nothing else finds ``slime`` does this finder answer, with ``shim/slime``. Submodules
(``slime.utils.types``) are then found by the standard machinery under that package's ``__path__``. Installed
when a function's module fails to import for want of ``slime`` (``load_needing_slime``), and before a slime
function is called (``contract.py``); idempotent."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from typing import Callable, Optional, Sequence, TypeVar

from megatron_rl.errors import ConfigError

T = TypeVar("T")

SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
_LOCK = threading.Lock()


class SlimeShimFinder(importlib.abc.MetaPathFinder):
    """Finds the top-level ``slime`` package in ``SHIM_DIR`` (asked last: see the module docstring)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: object = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "slime":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [SHIM_DIR])


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (a no-op when it is already there)."""
    with _LOCK:
        if not any(isinstance(f, SlimeShimFinder) for f in sys.meta_path):
            sys.meta_path.append(SlimeShimFinder())


def load_needing_slime(load: Callable[[], T]) -> T:
    """``load()`` (a user-function loader); when it fails because ``slime`` is not importable, again with the
    finder installed: a module written for slime imports ``slime...`` at its top, before its functions'
    signatures can say that it is slime's."""
    try:
        return load()
    except ConfigError as exc:
        if "No module named 'slime" not in str(exc) or any(isinstance(f, SlimeShimFinder) for f in sys.meta_path):
            raise
    install()
    return load()


def is_shim(module: object) -> bool:
    """Whether ``module`` (an imported ``slime``) is the compatibility package, not an installed slime."""
    return bool(getattr(module, "IS_MEGATRON_RL_SHIM", False))


def slime_module(name: str):
    """``slime.<name>`` imported (the installed slime's, else the compatibility package's)."""
    install()
    return importlib.import_module(f"slime.{name}")


__all__ = ["SHIM_DIR", "SlimeShimFinder", "install", "is_shim", "load_needing_slime", "slime_module"]
