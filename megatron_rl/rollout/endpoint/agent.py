"""``--agent-function-path module:function``: the user's agent, called once per sample against this run's endpoint.

The contract (docs/agentic.md, "An agent behind an OpenAI-compatible endpoint")::

    def agent(base_url: str, task: dict) -> float | dict | None      # or async def

``base_url`` is the sample's own session on the run's endpoint (``http://127.0.0.1:PORT/sessions/<id>/v1``): an
unchanged OpenAI client, ``OpenAI(base_url=base_url, api_key="none")``, sends ``chat.completions.create(...)``
there. ``task``: ``prompt`` (the prompt as the data file gives it: text, after ``--apply-chat-template`` when
given), ``label``, ``metadata`` (the prompt's ``--metadata-key`` contents), ``group_index``, ``index`` (the
sample's place in its group). It returns the sample's reward (a number), or ``{"reward": number, <metric>:
number}``, or None to have the run's reward (``--rm-type``, ``--custom-rm-path``, ``--rm-url``, ...) score the
assembled sample. The ``--n-samples-per-prompt`` agents of a group run concurrently, each call bounded by
``--user-function-timeout``; what trains is the session's records (``trajectory.assemble``), never the
agent's messages.

Why a function of a URL rather than of an engine handle: agent harnesses are written against the OpenAI API
(their tool loops, retries, message bookkeeping); giving them an endpoint trains them as they are, with the
token-in/token-out guarantee kept by recording what the engine sampled.
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError, UserFunctionError
from megatron_rl.infra.user_function import call_user_function, load_user_function
from megatron_rl.rollout.base import load_tokenizer
from megatron_rl.rollout.endpoint.server import Endpoint, LiveSession, endpoint_for
from megatron_rl.rollout.endpoint.trajectory import assemble
from megatron_rl.rollout.generate_fn import EngineCall, RolloutFunctions, check_samples, vocab_size_of
from megatron_rl.rollout.slime_compat.contract import slime_generate_groups

FLAG = "--agent-function-path"
SIGNATURE = "agent(base_url, task) -> reward, {'reward': reward, ...} or None"
#: where an agent's own reward is kept on its sample (``rewards.AgentReward`` reads it)
AGENT_REWARD = "agent_reward"
#: the file beside --save-debug-rollout-data's rollouts where the endpoint records each completion (JSON lines)
COMPLETIONS = "agent_completions.jsonl"


def load_agent(path: str) -> Callable:
    """The agent named by ``path`` (``module:function`` or ``path/to/file.py:function``), checked to take
    ``(base_url, task)``; ``ConfigError`` naming the flag otherwise."""
    fn = load_user_function(path, FLAG, example="my_agent:agent")
    try:
        inspect.signature(fn).bind("http://127.0.0.1:1/sessions/x/v1", {})
    except TypeError as exc:
        raise ConfigError(f"{FLAG} {path}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be called as "
                          f"{SIGNATURE} ({exc})") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return fn


def task_of(request: GenerateRequest, index: int) -> dict:
    return {"prompt": request.prompt_text, "label": request.label, "metadata": dict(request.metadata),
            "group_index": request.group_index, "index": index}


def _reward_of(returned: Any, where: str) -> Any:
    """The agent's return value as a sample's reward (None: the run's reward function scores it)."""
    if returned is None:
        return None
    if isinstance(returned, bool) or not isinstance(returned, (int, float, dict)):
        raise ConfigError(f"{where} returned {type(returned).__name__}; an agent returns its reward (a number), "
                          "{'reward': number, <metric>: number}, or None (the run's reward function scores the session)")
    if isinstance(returned, dict) and "reward" not in returned:
        raise ConfigError(f"{where} returned a dict without 'reward' ({', '.join(map(str, returned))}); "
                          "give {'reward': number, ...} or None")
    return returned


def agent_group_generate(fn: Callable, where: str, *, cfg: Any, tokenizer: Any = None) -> Callable:
    """The agent as ``generate_group(request, sampling, call)``: one session per sample on the run's endpoint, the
    group's agents concurrently, each session's sample assembled from its records (not yet checked:
    ``generate_fn.check_samples`` does that). A sync cut or an engine error ends the group's attempt as a native
    function's does (the lane's error is raised; a cut the engine answered as an abort gives aborted samples, so
    the group is generated again)."""
    r = getattr(cfg, "rollout", None)
    timeout_s = float(getattr(r, "user_function_timeout", 3600.0))
    max_prompt_len = int(getattr(r, "rollout_max_prompt_len", 1 << 30))
    model = getattr(getattr(cfg, "model", None), "hf_checkpoint", None) or ""
    seed = int(getattr(r, "rollout_seed", 0) or 0)
    pattern = getattr(getattr(cfg, "mode", None), "save_debug_rollout_data", None)
    journal = os.path.join(os.path.dirname(pattern) or ".", COMPLETIONS) if pattern else None

    def generate_group(request: GenerateRequest, sampling: SamplingParams, call: Any) -> list[Sample]:
        ep = endpoint_for(model, seed, load_tokenizer, journal)
        with ep.batcher.lane(call) as lane:
            def one(j: int) -> tuple[LiveSession, Any, Optional[BaseException]]:
                with ep.session(lane, sampling, max_prompt_len) as live:
                    try:
                        out = call_user_function(fn, ep.base_url(live.session.session_id), task_of(request, j),
                                                 where=where, timeout_s=timeout_s)
                        return live, out, None
                    except UserFunctionError as exc:
                        return live, None, exc

            with ThreadPoolExecutor(max_workers=max(1, sampling.n), thread_name_prefix="agent") as pool:
                results = list(pool.map(one, range(sampling.n)))
        if lane.errors:  # the engine failed or a sync cut a call: the group's attempt ends as a native one's
            raise lane.errors[0]
        refusal = next((live.error for live, _, _ in results if live.error is not None), None)
        if refusal is not None:
            raise ConfigError(f"{where}: {refusal}")
        failed = next((exc for _, _, exc in results if exc is not None), None)
        if failed is not None:
            raise failed
        if any(live.aborted for live, _, _ in results):
            return [_aborted(request) for _ in results]
        return [s for live, out, _ in results for s in _samples(live, out, request, where, ep)]

    generate_group.__name__ = f"agent_generate_group[{where}]"
    return generate_group


def _aborted(request: GenerateRequest) -> Sample:
    return Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids), response_ids=[],
                  finish_reason="abort", label=request.label, prompt_text=request.prompt_text,
                  metadata={**request.metadata, "finish_message": "an agent session's engine call was cut"})


def _samples(live: LiveSession, returned: Any, request: GenerateRequest, where: str, ep: Endpoint) -> list[Sample]:
    """The session's samples, one per branch (``trajectory.assemble``), each carrying the agent's reward: a
    session's reward is every one of its branches' (``rewards.AgentReward``; docs/agentic.md, "Branches")."""
    reward = _reward_of(returned, where)
    if not live.session.branches:
        raise ConfigError(f"{where} returned without a completion from its base_url (group {request.group_index}): "
                          "an agent trains on what it asks the endpoint, so it must call "
                          "client.chat.completions.create at least once")
    samples = assemble(live.session, request)
    for sample in samples:
        if sample.branch in live.truncated:
            sample.finish_reason = "length"
        sample.prompt_text = request.prompt_text
        if ep.tokenizer is not None:
            sample.response_text = ep.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        if reward is not None:
            sample.metadata[AGENT_REWARD] = reward
    return samples


@dataclass(frozen=True)
class AgentFunctions(RolloutFunctions):
    """The run's rollout functions when ``--agent-function-path`` is given: the agent per group
    (``agent_group_generate``, its samples checked as a generate function's), groups in threads as slime's
    functions run (their engine calls arrive over HTTP and are batched by the gateway's batcher)."""

    def group_generate(self, tokenizer: Any = None) -> Callable:
        assert self.group_fn is not None
        agent_group = agent_group_generate(self.group_fn, self.group_where, cfg=self.cfg, tokenizer=tokenizer)
        where, vocab = self.group_where, self.vocab_size

        def generate_agent_group(request: GenerateRequest, sampling: SamplingParams, call: EngineCall) -> list[Sample]:
            return check_samples(agent_group(request, sampling, call), [request], sampling, where, vocab)

        generate_agent_group.__name__ = f"generate_group[{where}]"
        return generate_agent_group

    def generate(self, rollout_id: int, requests: Sequence[GenerateRequest], sampling: SamplingParams,
                 engine_call: EngineCall, tokenizer: Any = None) -> list[Sample]:
        group = self.group_generate(tokenizer)
        return [s for g in slime_generate_groups(group, requests, sampling, engine_call) for s in g]


def rollout_functions_from_config(cfg: Any) -> Optional[RolloutFunctions]:
    """The run's rollout functions: the agent's (``AgentFunctions``) with ``--agent-function-path``, else
    ``RolloutFunctions.from_config`` (``--custom-generate-function-path`` / ``--rollout-function-path``), loaded
    on the driver before the engine loads, so a bad path fails first."""
    r = cfg.rollout
    path = getattr(r, "agent_function_path", None)
    if not path:
        return RolloutFunctions.from_config(cfg)
    if r.custom_generate_function_path or r.rollout_function_path:
        raise ConfigError(f"{FLAG} {path} generates every sample through the agent endpoint, so "
                          "--custom-generate-function-path / --rollout-function-path would never be called: keep one")
    return AgentFunctions(load_agent(path), f"{FLAG} {path}", cfg=cfg, vocab_size=vocab_size_of(cfg))


__all__ = ["AGENT_REWARD", "AgentFunctions", "FLAG", "SIGNATURE", "agent_group_generate", "load_agent",
           "rollout_functions_from_config", "task_of"]
