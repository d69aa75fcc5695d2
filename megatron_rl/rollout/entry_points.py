"""Every flag that names user code the run calls: the table the pre-flight loads and the tests walk.

Each row says where the run calls the function, what it must return, and which flag's seconds bound one
call (``infra.user_function.call_user_function``; a hang or an exception is one error line naming the flag,
the function and its own line). The driver's pre-flight (``runner/preflight.py``) imports and checks every
row's flag through the row's loader, the one the run itself uses, before any worker starts; so a module that
does not import, a missing name, a constant where a function belongs and a function of the wrong arity are
refused in the first seconds, never after the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.algorithms.spec import CUSTOM_ADVANTAGE_FLAG, load_custom_advantage
from megatron_rl.infra.user_function import DEFAULT_TIMEOUT_FLAG
from megatron_rl.rollout.agent.tools import load_tools
from megatron_rl.rollout.dynamic_sampling import load_filter
from megatron_rl.rollout.endpoint.agent import load_agent
from megatron_rl.rollout.generate_fn import load_function
from megatron_rl.rollout.rewards import load_custom_reward
from megatron_rl.rollout.verl_reward import load_verl_reward


@dataclass(frozen=True)
class EntryPoint:
    flag: str
    value: Callable[[Any], Optional[str]]  # the flag's value in a Config (None: not given)
    signature: str  # how the run calls it
    returns: str  # what it must return (checked whole at the call site)
    call_site: str  # module::function that calls it (bounded there)
    timeout_flag: str  # the flag whose seconds bound one call
    load: Callable[[str], Any]  # imports and checks it: the loader the run uses

    def load_from(self, cfg: Any) -> Any:
        """The loaded object of this flag in ``cfg``, or None when the flag is not given."""
        value = self.value(cfg)
        return None if value is None else self.load(value)


USER_CODE: tuple[EntryPoint, ...] = (
    EntryPoint("--custom-generate-function-path", lambda c: c.rollout.custom_generate_function_path,
               "fn(request, sampling, engine), or slime's async generate(args, sample, sampling_params)",
               "the group's --n-samples-per-prompt Samples: token ids in the "
               "model's vocabulary, one finite log-prob per response token",
               "rollout/generate_fn.py::group_generate", DEFAULT_TIMEOUT_FLAG,
               lambda p: load_function(p, "--custom-generate-function-path")),
    EntryPoint("--rollout-function-path", lambda c: c.rollout.rollout_function_path,
               "fn(rollout_id, requests, sampling, engine), or slime's generate_rollout(args, rollout_id, "
               "data_source, evaluation=False)", "len(requests) x --n-samples-per-prompt Samples, "
               "request-major, checked as a generate function's", "rollout/generate_fn.py::rollout_generate",
               DEFAULT_TIMEOUT_FLAG, lambda p: load_function(p, "--rollout-function-path")),
    EntryPoint("--agent-function-path", lambda c: c.rollout.agent_function_path,
               "agent(base_url, task) per sample (def or async def), talking to base_url's /v1/chat/completions",
               "the sample's reward (a number or {'reward': number, ...}), or None: the run's reward scores it",
               "rollout/endpoint/agent.py::agent_group_generate", DEFAULT_TIMEOUT_FLAG, load_agent),
    EntryPoint("--custom-rm-path", lambda c: c.data.custom_rm_path, "fn(sample), or fn(samples) when batched; slime's async "
               "reward_func(args, sample, **kwargs) or (args, samples)",
               "a finite number, or {'reward': number, <metric>: number}, per sample",
               "rollout/rewards.py::BoundedReward", DEFAULT_TIMEOUT_FLAG, load_custom_reward),
    EntryPoint("--custom-reward-function-path", lambda c: c.data.custom_reward_function_path,
               "verl's compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **kwargs) per sample, "
               "the keywords its signature takes", "a finite number, or verl's {'score': number, <metric>: value}, "
               "per sample", "rollout/verl_reward.py::VerlReward", DEFAULT_TIMEOUT_FLAG, load_verl_reward),
    EntryPoint("--dynamic-sampling-filter-path", lambda c: c.rollout.dynamic_sampling_filter_path,
               "fn(args, samples) per prompt group", "True / False or a DynamicFilterOutput",
               "rollout/dynamic_sampling.py::DynamicSampler.judge", DEFAULT_TIMEOUT_FLAG, load_filter),
    EntryPoint(CUSTOM_ADVANTAGE_FLAG, lambda c: c.algorithm.custom_advantage_function_path,
               "fn(args, rollout_data) once per step, on every training rank", "rollout_data['advantages'] (and "
               "'returns' with a critic) set to one finite value per response token of each sample",
               "algorithms/spec.py::PolicyGradientSpec._custom_advantages", DEFAULT_TIMEOUT_FLAG,
               load_custom_advantage),
    EntryPoint("--tools", lambda c: c.rollout.tools, "REGISTRY[name](arguments: dict) per tool call",
               "a str (anything else, a hang or an exception becomes an error observation the model reads)",
               "rollout/agent/tools.py::run_tool", "--tool-timeout", load_tools),
)


def load_user_code(cfg: Any) -> list[str]:
    """Import and check every user-code flag ``cfg`` gives (``USER_CODE``); the flags loaded. Raises the
    loader's ``ConfigError`` (naming the flag, the value and the fix) for the first bad one."""
    loaded = []
    for entry in USER_CODE:
        if entry.load_from(cfg) is not None:
            loaded.append(entry.flag)
    return loaded


__all__ = ["EntryPoint", "USER_CODE", "load_user_code"]
