"""The multi-turn tool loop of one prompt group, token-in/token-out.

Per turn, every unfinished trajectory of the group continues in one engine call (``generate_batch``) from
exactly its tokens so far (prompt + response); the turn's output tokens are appended as the engine returned
them, with their behaviour log-probs, loss mask 1 and their weight versions. If the turn calls tools, their
results are framed as a tool turn (``framing``), tokenised alone and appended with loss mask 0, log-prob 0.0
and the version of the turn's last token; then the next turn. So the trajectory trained on is the
concatenation of engine output tokens and observation tokens, nothing re-encoded.

A turn ends at the engine's stop tokens (EOS, ``--rollout-stop-token-ids``) or at the end of a tool call:
``</tool_call>`` is a stop token when the tokenizer has it as one token; otherwise the turn's output is cut
after the token whose decoding completes ``</tool_call>`` (a prefix of the engine's tokens).

A trajectory ends when a turn calls no tool (finish_reason as the engine said: "stop" or "length"), when it
used ``--max-turns`` turns and the last one still called a tool ("length", nothing executed), when the
response budget (``sampling.max_new_tokens``, --rollout-max-response-len, for all turns and observations
together) leaves no room for the observation and one more token ("length", observation dropped), or when
the engine aborted a turn ("abort": the rollout manager generates the group again). Each turn's
``max_new_tokens`` is what the budget has left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.data.types import GenerateRequest, RoutedExperts, Sample, SamplingParams
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.agent.framing import cut_after_tool_call, tool_call_end_id, tool_turn_ids
from megatron_rl.rollout.agent.parse import parse_tool_calls
from megatron_rl.rollout.agent.tools import ToolRegistry, run_tool
from megatron_rl.rollout.generate_fn import EngineHandle, Generation


@dataclass(frozen=True)
class AgentSettings:
    """The loop's limits: ``--max-turns`` (model turns per trajectory), ``--tool-timeout`` (seconds per call)."""

    tools: ToolRegistry
    max_turns: int = 8
    tool_timeout_s: float = 30.0


@dataclass
class Trajectory:
    """One sample's response as it grows: response-aligned token ids, log-probs, loss mask and versions."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: Optional[str] = None  # set when the trajectory ended
    agent_stop: str = ""  # why it ended: answer, max_turns, budget, abort
    finish_message: Optional[str] = None
    # the latest turn's routes (--use-rollout-routing-replay): its prefill routed the whole context again
    routes: Optional[RoutedExperts] = None
    weight_version: Optional[int] = None

    def add_turn(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.versions += versions

    def add_observation(self, ids: list[int], version: int) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [version] * len(ids)

    def end(self, finish_reason: str, why: str) -> None:
        self.finish_reason, self.agent_stop = finish_reason, why


def run_agent(request: GenerateRequest, sampling: SamplingParams, engine: EngineHandle,
              settings: AgentSettings) -> list[Sample]:
    """The group's ``sampling.n`` trajectories (module docstring), as ``Sample``s with metadata ``turns``,
    ``tool_calls``, ``tool_errors`` and ``agent_stop``."""
    tok = engine.tokenizer
    if tok is None:
        raise ConfigError("the tool loop (--custom-generate-function-path megatron_rl.rollout.agent:generate) reads "
                          "tool calls as text, so the engine needs a tokenizer: give an --hf-checkpoint directory "
                          "with tokenizer files")
    end_id = tool_call_end_id(tok)
    stops = tuple(sampling.stop_token_ids) + ((end_id,) if end_id is not None and end_id not in
                                              sampling.stop_token_ids else ())
    turn_sampling = dataclasses.replace(sampling, stop_token_ids=stops)
    budget = sampling.max_new_tokens
    trajectories = [Trajectory() for _ in range(sampling.n)]
    outputs: list[Generation] = engine.generate(request.prompt_ids, turn_sampling)
    live = list(range(sampling.n))
    while True:
        for i, gen in zip(live, outputs):
            _take_turn(trajectories[i], gen, tok, end_id, budget, settings)
        live = [i for i in live if trajectories[i].finish_reason is None]
        if not live:
            break
        contexts = [list(request.prompt_ids) + trajectories[i].response_ids for i in live]
        left = [budget - len(trajectories[i].response_ids) for i in live]
        outputs = [g[0] for g in engine.generate_batch(contexts, dataclasses.replace(turn_sampling, n=1), left)]
    return [_sample(request, t) for t in trajectories]


def _take_turn(t: Trajectory, gen: Generation, tok, end_id: Optional[int], budget: int,
               settings: AgentSettings) -> None:
    """Append one engine turn to ``t``, run its tool calls and append their observation, or end ``t``."""
    t.turns += 1
    if t.weight_version is None:
        t.weight_version = gen.weight_version
    keep = len(gen.output_ids) if end_id is not None else cut_after_tool_call(tok, gen.output_ids)
    cut = keep < len(gen.output_ids)
    ids = list(gen.output_ids[:keep])
    t.add_turn(ids, list(gen.logprobs[:keep]), list(gen.token_versions[:keep]))
    if gen.routes is not None:  # its input was the whole trajectory so far: these supersede the earlier turns'
        t.routes = gen.routes
    if gen.finish_reason == "abort":
        t.finish_message = gen.finish_message
        return t.end("abort", "abort")
    calls = parse_tool_calls(tok.decode(ids, skip_special_tokens=False))
    finish = "stop" if cut else gen.finish_reason
    if not calls:
        return t.end(finish, "answer")
    if t.turns >= settings.max_turns:
        return t.end("length", "max_turns")
    if len(t.response_ids) >= budget:
        return t.end("length", "budget")
    results = []
    for call in calls:
        if call.error is not None:
            text, failed = f"error: {call.error}", True
        else:
            text, failed = run_tool(settings.tools, call.name, call.arguments, settings.tool_timeout_s)
        results.append(text)
        t.tool_calls += 1
        t.tool_errors += failed
    # the model closed its turn itself with a stop token (e.g. <|im_end|>): the framing must not repeat it
    emitted_end = tok.decode([ids[-1]], skip_special_tokens=False) if finish == "stop" and not cut and ids else ""
    observation = tool_turn_ids(tok, results, emitted_end)
    if len(t.response_ids) + len(observation) + 1 > budget:
        return t.end("length", "budget")
    t.add_observation(observation, t.versions[-1])


def _sample(request: GenerateRequest, t: Trajectory) -> Sample:
    metadata = dict(request.metadata)
    metadata.update(turns=t.turns, tool_calls=t.tool_calls, tool_errors=t.tool_errors, agent_stop=t.agent_stop)
    if t.finish_message is not None:
        metadata["finish_message"] = t.finish_message
    return Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids),
                  response_ids=t.response_ids, rollout_logprobs=t.logprobs, loss_mask=t.loss_mask,
                  finish_reason=t.finish_reason or "length", weight_version=int(t.weight_version or 0),
                  label=request.label, prompt_text=request.prompt_text, metadata=metadata,
                  token_versions=t.versions, routed_experts=_routes(request, t))


def _routes(request: GenerateRequest, t: Trajectory) -> Optional[RoutedExperts]:
    """The sample's routes: the last turn's (its input was prompt + every earlier token), cut to the sample's
    ``total_length - 1`` tokens (a turn cut after its tool call dropped tokens the engine had routed)."""
    if t.routes is None:
        return None
    need = len(request.prompt_ids) + len(t.response_ids) - 1
    if t.routes.tokens < need:  # only when the trajectory ended on tokens the last turn never saw
        raise RuntimeError(f"agent loop: the last turn's routes cover {t.routes.tokens} tokens, the sample needs "
                           f"{need}")
    return t.routes.first(need)


__all__ = ["AgentSettings", "Trajectory", "run_agent"]
