"""Import a user's function named by a flag: ``module:function`` or ``path/to/file.py:function``.

Why one loader: every flag that names user code (``--custom-rm-path``,
``--dynamic-sampling-filter-path``, ``--custom-advantage-function-path``) must fail the same way, before any engine loads a model, with
a message that names the flag, what was wrong and the fix (a missing module, a typo in the
function's name, a module-level constant instead of a function).

slime names functions by dotted path (``pkg.module.function``, its ``load_function``); a flag whose
slime spelling is dotted accepts that form too (``dotted=True``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from typing import Callable

from megatron_rl.errors import ConfigError

__all__ = ["check_arity", "load_user_function"]


def _import(module_name: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(f"no such file {module_name}")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"{module_name} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(module_name)


def load_user_function(path: str, flag: str, *, example: str = "my_module:fn", dotted: bool = False) -> Callable:
    """The callable ``path`` names; ``flag`` is how errors name the setting (``--custom-rm-path``)."""
    given = f"{flag} {path}"
    module_name, sep, func_name = str(path).rpartition(":")
    if not sep and dotted and not str(path).endswith(".py"):
        module_name, sep, func_name = str(path).rpartition(".")
    if not sep or not module_name or not func_name:
        forms = "module:function" + (" or module.function" if dotted else "")
        raise ConfigError(f"{given} must be {forms} (e.g. {example})")
    try:
        module = _import(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module; report it whole
        raise ConfigError(f"{given}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); put the module "
                          f"on PYTHONPATH or give a file path like path/to/{example.split(':')[0]}.py:"
                          f"{example.split(':')[-1]}") from exc
    fn = getattr(module, func_name, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{given}: module {module_name!r} has no {func_name!r}; callables there: "
                          f"{', '.join(names) or 'none'}")
    if not callable(fn):
        raise ConfigError(f"{given}: {func_name!r} in {module_name!r} is a {type(fn).__name__}, not a function")
    return fn


def check_arity(fn: Callable, nargs: int, flag: str, path: str, signature: str) -> None:
    """``ConfigError`` naming ``flag`` unless ``fn`` can be called with ``nargs`` positional arguments (a
    function of another shape fails here, at start-up, not at its first call mid-run)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        sig.bind(*([None] * nargs))
    except TypeError as exc:
        raise ConfigError(f"{flag} {path}: {getattr(fn, '__name__', fn)}{sig} cannot be called as {signature} "
                          f"({exc}); give a function with that signature") from None
