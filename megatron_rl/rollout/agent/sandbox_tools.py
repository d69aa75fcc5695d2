"""Sandboxed tools: ``python`` and ``shell`` run the model's code in the local sandbox (``infra.sandbox``); what
it printed is the observation.

``--tools megatron_rl.rollout.agent.sandbox_tools:TOOLS`` gives the tool loop ``python``, ``shell`` and
``calculator``; a registry of your own may hold ``sandbox_tools.python`` / ``sandbox_tools.shell`` beside your
tools. The loop binds every sandboxed tool of the registry to the run's ``--sandbox-*`` limits
(``configure_sandboxed``), and the run's pre-flight checks once that this machine can give the sandbox
(``check_sandboxed_tools``), so a missing ``unshare`` stops the run in its first seconds, not at the first call.

A call is ``{"code": "<python source>"}`` (``python``, run by ``python -I -u main.py``) or ``{"command":
"<shell command line>"}`` (``shell``, run by ``/bin/sh -c``). The observation is the program's stdout, then its
stderr, then one status line when it did not simply exit 0: ``[sandbox: exit 1; memory limit
(--sandbox-memory-mb 512)]``; at most ``--sandbox-output-bytes`` of output plus that line, ``(no output)`` when
there was none. A program that fails, loops or runs into a limit is an observation like any other (the tool
worked: the model reads what happened); only a malformed call or a sandbox that cannot start is a tool error.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from megatron_rl.errors import ConfigError
from megatron_rl.infra.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_python, run_sandboxed
from megatron_rl.rollout.agent.tools import Tool, ToolRegistry, calculator

_FENCE = re.compile(r"^\s*```[\w+-]*\s*\n(.*?)\n?\s*```\s*$", re.S)


def observation(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model reads of one run (module docstring)."""
    parts = [text for text in (result.stdout, result.stderr) if text]
    if not (result.exit_code == 0 and not result.contained):
        parts.append(result.status_line(limits))
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts).rstrip("\n")
    return text or "(no output)"


@dataclass(frozen=True)
class PythonTool:
    """``python``: run ``arguments["code"]`` in a fresh sandbox under ``limits``."""

    limits: SandboxLimits = SandboxLimits()

    def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError('give {"code": "<python source>"}')
        fenced = _FENCE.match(code)  # a model that wraps its code in a markdown fence
        return observation(run_python(fenced.group(1) if fenced else code, self.limits), self.limits)

    def with_limits(self, limits: SandboxLimits) -> "PythonTool":
        return dataclasses.replace(self, limits=limits)


@dataclass(frozen=True)
class ShellTool:
    """``shell``: run ``arguments["command"]`` with ``/bin/sh -c`` in a fresh sandbox under ``limits``."""

    limits: SandboxLimits = SandboxLimits()

    def __call__(self, arguments: dict) -> str:
        command = arguments.get("command")
        if not isinstance(command, str):
            raise ValueError('give {"command": "<shell command line>"}')
        return observation(run_sandboxed(["/bin/sh", "-c", command], self.limits), self.limits)

    def with_limits(self, limits: SandboxLimits) -> "ShellTool":
        return dataclasses.replace(self, limits=limits)


python = PythonTool()
shell = ShellTool()

#: ``--tools megatron_rl.rollout.agent.sandbox_tools:TOOLS``
TOOLS: dict[str, Tool] = {"python": python, "shell": shell, "calculator": calculator}


def _sandboxed(tool: Any) -> bool:
    return callable(getattr(tool, "with_limits", None))


def configure_sandboxed(registry: ToolRegistry, limits: SandboxLimits) -> ToolRegistry:
    """``registry`` with every sandboxed tool (one with ``with_limits``) bound to ``limits``."""
    if not any(_sandboxed(tool) for tool in registry.values()):
        return registry
    return {name: tool.with_limits(limits) if _sandboxed(tool) else tool  # type: ignore[attr-defined]
            for name, tool in registry.items()}


def check_sandboxed_tools(registry: ToolRegistry, limits: SandboxLimits, tool_timeout: float) -> None:
    """At the rollout's start: a registry with sandboxed tools needs a sandbox on this machine that starts
    Python under ``limits``, and a wall bound the tool loop waits for (below ``--tool-timeout``)."""
    sandboxed = sorted(name for name, tool in registry.items() if _sandboxed(tool))
    if not sandboxed:
        return
    if limits.wall_seconds >= tool_timeout:
        raise ConfigError(f"--sandbox-wall-seconds {limits.wall_seconds:g} must be below --tool-timeout "
                          f"{tool_timeout:g}: the sandboxed tools ({', '.join(sandboxed)}) end their program at the "
                          "wall bound and answer; past --tool-timeout the loop stops waiting and the answer is "
                          "lost. Lower the one or raise the other")
    check_sandbox(limits)


__all__ = ["PythonTool", "ShellTool", "TOOLS", "check_sandboxed_tools", "configure_sandboxed", "observation",
           "python", "shell"]
