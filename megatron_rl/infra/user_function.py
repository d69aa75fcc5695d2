"""User code named by a flag: loading it (``module:function`` or ``path/to/file.py:function``) and calling it
with a deadline.

Why one loader: every flag that names user code (``--custom-rm-path``, ``--dynamic-sampling-filter-path``,
``--custom-generate-function-path``, ``--tools``, ...) must fail the same way, before any engine loads a
model, with a message that names the flag, what was wrong and the fix (a missing module, a typo in the
function's name, a module-level constant instead of a function). A file is imported once per process
(``_import``), so the driver's pre-flight import and the rollout's are the same module.

slime names functions by dotted path (``pkg.module.function``, its ``load_function``); a flag whose
slime spelling is dotted accepts that form too (``dotted=True``).

Why one bounded call (``call_user_function``): a user function that never returns used to hang a
synchronous run for good, and one that raised printed a long traceback from deep inside the rollout.
Every call into user code goes through it: the function runs in a worker thread (an ``async def``
function's coroutine on that thread's own event loop, under ``asyncio.wait_for``), the caller waits at
most the flag's timeout, and a timeout or an exception becomes one ``UserFunctionError`` line naming the
flag and function, what happened and the function's own line (``file:line in name``: the deepest frame in
the function's file, of the traceback or, for a hang, of the stuck thread). A hung thread cannot be
stopped from Python: it is left behind (a daemon thread, ended with the process) and the run stops as any
refusal does (exit code 2, ``run_status.json``). Errors of this package raised inside the function (an
engine that failed under a generate function's call) pass through unchanged: they already name their
cause, and the fault tolerance acts on them.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import time
import types
from typing import Any, Callable, NoReturn, Optional, Sequence

from megatron_rl.errors import ConfigError, MegatronRLError, UserFunctionError

__all__ = ["DEFAULT_TIMEOUT_FLAG", "call_user_function", "check_arity", "load_user_function", "load_user_object",
           "user_frame"]

#: the flag whose seconds bound a call into user code unless the caller names another (tools: --tool-timeout)
DEFAULT_TIMEOUT_FLAG = "--user-function-timeout"

_FILE_MODULES: dict[str, types.ModuleType] = {}
_FILE_MODULES_LOCK = threading.Lock()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import(module_name: str) -> types.ModuleType:
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    if not os.path.isfile(module_name):
        raise FileNotFoundError(f"no such file {module_name}")
    path = os.path.realpath(module_name)
    with _FILE_MODULES_LOCK:
        if path in _FILE_MODULES:
            return _FILE_MODULES[path]
        name = "_user_" + os.path.basename(module_name)[:-3]
        spec = importlib.util.spec_from_file_location(name, module_name)
        if spec is None or spec.loader is None:
            raise ImportError(f"{module_name} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        _FILE_MODULES[path] = module
        return module


def _split(path: str, flag: str, example: str, dotted: bool, what: str) -> tuple[str, str]:
    module_name, sep, attr = str(path).rpartition(":")
    if not sep and dotted and not str(path).endswith(".py"):
        module_name, sep, attr = str(path).rpartition(".")
    if not sep or not module_name or not attr:
        forms = f"module:{what}" + (f" or module.{what}" if dotted else "") + f" or path/to/file.py:{what}"
        raise ConfigError(f"{flag} {path} must be {forms} (e.g. {example})")
    return module_name, attr


def load_user_object(path: str, flag: str, *, what: str = "function", example: str = "my_module:fn",
                     dotted: bool = False) -> Any:
    """The object ``path`` names (``module:NAME``, ``path/to/file.py:NAME``; ``dotted``: slime's ``module.NAME``
    too); ``ConfigError`` naming ``flag`` when the module cannot be imported or has no such name."""
    given = f"{flag} {path}"
    module_name, attr = _split(path, flag, example, dotted, what)
    try:
        module = _import(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module; report it whole
        stem = module_name[:-3] if module_name.endswith(".py") else module_name.rpartition(".")[2]
        where = f" (line {exc.lineno} of {exc.filename})" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise ConfigError(f"{given}: cannot import {module_name!r} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}){where}; put the module on PYTHONPATH or "
                          f"give a file path like path/to/{os.path.basename(stem)}.py:{attr}") from None
    if not hasattr(module, attr):
        functions = what == "function"
        names = sorted(n for n, v in vars(module).items() if not n.startswith("_") and (callable(v) or not functions))
        raise ConfigError(f"{given}: module {module_name!r} has no {attr!r}; {'callables' if functions else 'names'} "
                          f"there: {', '.join(names[:20]) or 'none'}")
    return getattr(module, attr)


def load_user_function(path: str, flag: str, *, example: str = "my_module:fn", dotted: bool = False) -> Callable:
    """The callable ``path`` names; ``flag`` is how errors name the setting (``--custom-rm-path``)."""
    fn = load_user_object(path, flag, example=example, dotted=dotted)
    if not callable(fn):
        module_name, attr = _split(path, flag, example, dotted, "function")
        raise ConfigError(f"{flag} {path}: {attr!r} in {module_name!r} is a {type(fn).__name__}, not a function")
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


# ------------------------------------------------------------------ the bounded call
def _code_file(fn: Any) -> Optional[str]:
    """The source file of ``fn`` (a function, a bound method, a partial, an object with ``__call__``)."""
    for _ in range(4):
        code = getattr(fn, "__code__", None)
        if code is not None:
            return code.co_filename
        fn = getattr(fn, "func", None) or getattr(fn, "__func__", None) or type(fn).__dict__.get("__call__")
        if fn is None:
            return None
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def user_frame(frames: Sequence[types.FrameType | tuple[str, int, str]], fn: Any) -> str:
    """``file:line in name`` of the function's own last frame: the deepest of ``frames`` (outermost first) in
    ``fn``'s file, else the deepest outside this package, else the deepest; "" when there is none."""
    rows = [f if isinstance(f, tuple) else (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in frames]
    if not rows:
        return ""
    own = _code_file(fn)
    pick = next((r for r in reversed(rows) if own and r[0] == own), None)
    pick = pick or next((r for r in reversed(rows) if not r[0].startswith(_PACKAGE_DIR)
                         and "asyncio" not in r[0] and not r[0].endswith("threading.py")), None) or rows[-1]
    return f"{_short(pick[0])}:{pick[1]} in {pick[2]}"


def _traceback_frames(exc: BaseException) -> list[tuple[str, int, str]]:
    rows, tb = [], exc.__traceback__
    while tb is not None:
        rows.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return rows


def _stack(frame: Optional[types.FrameType]) -> list[types.FrameType]:
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _coroutine_frames(coro: Any) -> list[types.FrameType]:
    """The frames of a suspended coroutine, outermost first (its ``cr_await`` chain)."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def _one_line(text: object, limit: int = 300) -> str:
    line = " | ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _cuda_device() -> Optional[int]:
    """The calling thread's current CUDA device when torch is loaded and CUDA in use, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def call_user_function(fn: Callable, *args: Any, where: str, timeout_s: float,
                       timeout_flag: str = DEFAULT_TIMEOUT_FLAG,
                       passthrough: tuple[type[BaseException], ...] = (), owner: Any = None) -> Any:
    """``fn(*args)`` (awaited when it returns an awaitable) within ``timeout_s`` seconds (module docstring).

    ``where``: how the message names the function (``--custom-rm-path my_mod:score``); ``timeout_flag``: the
    flag that sets ``timeout_s``; ``owner``: the user's own function when ``fn`` wraps it (its file is where the
    line named is looked for). A ``MegatronRLError`` or a ``passthrough`` exception raised inside is raised as
    it is; any other exception, and a call still running at the deadline, is a ``UserFunctionError``."""
    owner = fn if owner is None else owner
    device = _cuda_device()  # the worker computes on the caller's device (torch's current device is per thread)
    deadline = time.monotonic() + timeout_s
    box: dict[str, Any] = {}
    done = threading.Event()

    async def bounded(awaitable: Any) -> Any:
        return await asyncio.wait_for(awaitable, max(deadline - time.monotonic(), 0.0))

    def run() -> None:
        try:
            if device is not None:
                sys.modules["torch"].cuda.set_device(device)
            result = fn(*args)
            if inspect.isawaitable(result):
                box["coro"] = result
                result = asyncio.run(bounded(result))
            box["result"] = result
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, name=f"user-function {where}"[:60], daemon=True)
    worker.start()
    if not done.wait(timeout_s):
        frames = _coroutine_frames(box.get("coro")) or _stack(sys._current_frames().get(worker.ident or -1))
        _timed_out(where, owner, timeout_s, timeout_flag, frames)
    error: Optional[BaseException] = box.get("error")
    if error is None:
        return box.get("result")
    if isinstance(error, MegatronRLError) or any(isinstance(error, kind) for kind in passthrough):
        raise error
    if isinstance(error, asyncio.TimeoutError) and time.monotonic() >= deadline - 0.01 and "coro" in box:
        _timed_out(where, owner, timeout_s, timeout_flag, [])  # wait_for cancelled the coroutine at the deadline
    at = user_frame(_traceback_frames(error), owner)
    raise UserFunctionError(f"{where} raised {type(error).__name__}: {_one_line(error) or '(no message)'}"
                            + (f" (at {at})" if at else "") + "; fix the function (this error ends the run)",
                            kind="raised", cause=error) from None


def _timed_out(where: str, fn: Any, timeout_s: float, flag: str, frames: Sequence[types.FrameType]) -> NoReturn:
    at = user_frame(frames, fn)
    raise UserFunctionError(f"{where} did not return within {timeout_s:g} s ({flag})"
                            + (f"; it was at {at}" if at else "") + ". Python cannot stop a thread, so the call is "
                            f"left behind and the run stops: make the function return (bound its own waits: a "
                            f"socket or subprocess timeout) or raise {flag}", kind="timeout")
