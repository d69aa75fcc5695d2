"""Multi-turn tool use, built in: ``--custom-generate-function-path megatron_rl.rollout.agent:generate``.

The built-in agent is a custom generate function like a user's (``rollout.generate_fn``'s per-group
contract), so it runs on every engine and through the same checks. Its flags: ``--tools module:REGISTRY``
(default: the built-in ``calculator``), ``--max-turns``, ``--tool-timeout``, the ``--sandbox-*`` limits of
sandboxed tools; the response budget of all turns together is ``--rollout-max-response-len``. Modules:
``loop`` (the turns), ``parse`` (Qwen/Hermes ``<tool_call>`` blocks), ``framing`` (observation tokens from
the chat template), ``tools`` (registry, calculator, timeouts), ``sandbox_tools`` (the sandboxed ``python``
and ``shell`` tools); ``calculator_task`` is the CPU agent demo's task (scripts/run_agent_demo_cpu.sh).
docs/agentic.md.
"""

from __future__ import annotations

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.infra.sandbox import SandboxLimits
from megatron_rl.rollout.agent.loop import AgentSettings, run_agent
from megatron_rl.rollout.agent.sandbox_tools import check_sandboxed_tools, configure_sandboxed
from megatron_rl.rollout.agent.tools import BUILTIN_TOOLS, calculator, load_tools
from megatron_rl.rollout.generate_fn import EngineHandle


def settings_from_config(cfg) -> AgentSettings:
    """The loop's settings from the run's flags (defaults when the handle carries no config)."""
    if cfg is None:
        return AgentSettings(tools=BUILTIN_TOOLS)
    r = cfg.rollout
    tools = configure_sandboxed(load_tools(r.tools), SandboxLimits.from_config(cfg))
    return AgentSettings(tools=tools, max_turns=r.max_turns, tool_timeout_s=r.tool_timeout)


def check_tools(cfg) -> None:
    """At the rollout's start: ``--tools`` imported and checked, and, when it holds sandboxed tools, the
    sandbox checked on this machine under the ``--sandbox-*`` limits (``sandbox_tools.check_sandboxed_tools``)."""
    check_sandboxed_tools(load_tools(cfg.rollout.tools), SandboxLimits.from_config(cfg), cfg.rollout.tool_timeout)


def generate(request: GenerateRequest, sampling: SamplingParams, engine: EngineHandle) -> list[Sample]:
    """The per-group generate function of the tool loop (``loop.run_agent``), configured by the run's flags."""
    return run_agent(request, sampling, engine, settings_from_config(engine.cfg))


__all__ = ["AgentSettings", "BUILTIN_TOOLS", "calculator", "check_tools", "generate", "load_tools", "run_agent",
           "settings_from_config"]
