"""Tools the agent loop calls: a registry is a plain ``dict`` of name -> ``callable(arguments: dict) -> str``.

``--tools module:REGISTRY`` names the registry (default: ``BUILTIN_TOOLS``). Whatever a tool does, the loop
never crashes on it: an unknown name, an exception, a result that is not a string and a call that outlives
``--tool-timeout`` all become an observation text starting with ``error:`` (``run_tool``), which the model
sees and learns from, and which is counted in the sample's ``tool_errors``.

A timed-out tool's thread cannot be killed from Python: it is left running as a daemon and its result is
dropped. Tools that may hang should bound themselves (a subprocess with a timeout, a socket timeout).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, Mapping, Optional

from megatron_rl.errors import ConfigError, UserFunctionError
from megatron_rl.infra.user_function import call_user_function, check_arity, load_user_object

Tool = Callable[[dict], str]
ToolRegistry = Mapping[str, Tool]

#: the calculator refuses longer expressions: its integers stay a size whose product is instant
MAX_EXPRESSION_CHARS = 4096

_TOKEN = re.compile(r"\s*(?:(\d+)|(\S))")


def calculator(arguments: dict) -> str:
    """Exact integer arithmetic: ``{"expression": "123456789 * 987654321 - 5"}`` -> ``"121932631112635264"``.

    ``+``, ``-`` (binary and unary), ``*`` and parentheses over non-negative integer literals of any length,
    with the usual precedence; Python's big integers, so the answer is exact however long. No ``eval``."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        raise ValueError('give {"expression": "<integers with + - * and parentheses>"}')
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    tokens = [(m.group(1), m.group(2)) for m in _TOKEN.finditer(expression) if m.group(1) or m.group(2)]
    pos = 0

    def peek() -> Optional[str]:
        return tokens[pos][1] if pos < len(tokens) else None

    def expr() -> int:
        nonlocal pos
        value = term()
        while peek() in ("+", "-"):
            op = tokens[pos][1]
            pos += 1
            value = value + term() if op == "+" else value - term()
        return value

    def term() -> int:
        nonlocal pos
        value = factor()
        while peek() == "*":
            pos += 1
            value *= factor()
        return value

    def factor() -> int:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError("the expression ends too early")
        number, op = tokens[pos]
        pos += 1
        if number is not None:
            return int(number)
        if op == "-":
            return -factor()
        if op == "+":
            return factor()
        if op == "(":
            value = expr()
            if peek() != ")":
                raise ValueError("a '(' is not closed")
            pos += 1
            return value
        raise ValueError(f"unexpected {op!r}; only integers, + - * and parentheses")

    value = expr()
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos][0] or tokens[pos][1]!r} after a complete expression")
    return str(value)


#: the registry used without --tools
BUILTIN_TOOLS: dict[str, Tool] = {"calculator": calculator}


@functools.lru_cache(maxsize=8)
def load_tools(path: Optional[str]) -> ToolRegistry:
    """The registry named by ``--tools module:REGISTRY`` (None: ``BUILTIN_TOOLS``), checked: a mapping of
    string names to callables. Cached: every group's loop asks for it."""
    if path is None:
        return BUILTIN_TOOLS
    registry = load_user_object(path, "--tools", what="REGISTRY", example="my_tools:TOOLS")
    if not isinstance(registry, Mapping):
        raise ConfigError(f"--tools {path}: {type(registry).__name__}, not a dict of tool name -> "
                          "callable(arguments: dict) -> str")
    bad = [str(name) for name, fn in registry.items() if not isinstance(name, str) or not callable(fn)]
    if bad or not registry:
        raise ConfigError(f"--tools {path}: " + (f"entries {', '.join(bad)} are not name -> callable" if bad
                                                 else "the registry is empty") + "; give a dict of tool name -> "
                          "callable(arguments: dict) -> str")
    for name, fn in registry.items():  # a tool of another shape is refused here, not at its first call
        check_arity(fn, 1, "--tools", f"{path} (tool {name!r})", "tool(arguments: dict)")
    return dict(registry)


def run_tool(registry: ToolRegistry, name: Optional[str], arguments: Any, timeout_s: float) -> tuple[str, bool]:
    """``(observation text, whether it is an error)`` of calling ``registry[name](arguments)`` within
    ``timeout_s`` seconds; never raises."""
    if name is None or name not in registry:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(registry))}", True
    tool = registry[name]
    if not isinstance(arguments, dict):
        return f"error: tool {name!r} takes a JSON object of arguments, not {type(arguments).__name__}", True
    try:  # the one bounded call into user code (infra.user_function), under --tool-timeout
        result = call_user_function(tool, dict(arguments), where=f"--tools tool {name!r}", timeout_s=timeout_s,
                                    timeout_flag="--tool-timeout")
    except UserFunctionError as exc:
        if exc.kind == "timeout":
            return f"error: tool {name!r} timed out after {timeout_s:g} s (--tool-timeout)", True
        cause = exc.cause
        return f"error: tool {name!r} failed: {type(cause).__name__}: {cause}", True
    except Exception as exc:  # noqa: BLE001 - one of this package's errors raised by the tool: the model is told
        return f"error: tool {name!r} failed: {type(exc).__name__}: {exc}", True
    if not isinstance(result, str):
        return f"error: tool {name!r} returned {type(result).__name__}, not a string", True
    return result, False


__all__ = ["BUILTIN_TOOLS", "Tool", "ToolRegistry", "calculator", "load_tools", "run_tool"]
