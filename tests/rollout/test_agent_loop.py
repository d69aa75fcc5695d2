"""The tool loop, token-in/token-out: the sample trained on is exactly the engine's output tokens (with their
log-probs and versions) plus the observation tokens the loop appended (loss mask 0), nothing re-encoded.

The engine here is a scripted double that implements ``RolloutEngine`` exactly (requests in, samples out):
it plays planned turns (tool calls, malformed calls, unknown tools, answers) with random log-probs,
versions and routes (as an engine recording them for --use-rollout-routing-replay) and records every context
it was given, so each test rebuilds the trajectory from the engine's side and compares. The same loop against the real embedded engine: test_agent_manager.py.
"""

import random
from dataclasses import dataclass, field

import pytest

from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.data.types import GenerateRequest, RoutedExperts, Sample, SamplingParams
from megatron_rl.rollout.agent import AgentSettings, BUILTIN_TOOLS, run_agent
from megatron_rl.rollout.agent.framing import tool_turn_ids
from megatron_rl.rollout.agent.tools import calculator
from megatron_rl.rollout.base import EngineHealth, RolloutEngine
from megatron_rl.rollout.generate_fn import EngineHandle, generate_groups, group_generate

SPELLED_SPECIAL = "<|user|>"  # the char tokenizer spells it in 8 tokens here; encoding its text gives 1 token


@dataclass
class Turn:
    ids: list[int]
    finish: str  # what the engine reports
    results: list[str] = field(default_factory=list)  # the observations its calls must produce
    keep: int = 0  # tokens the loop keeps (up to the end of a tool call)


@dataclass
class Trace:
    turns: list[Turn]
    contexts: list[list[int]] = field(default_factory=list)
    outputs: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)
    routes: list[RoutedExperts] = field(default_factory=list)  # of each call: context + output, less the last


class ScriptedEngine(RolloutEngine):
    """Plays ``plans[prompt][j]`` (one ``Trace`` per sample of a prompt); a context continues the trace whose
    last context + output it starts with."""

    def __init__(self, plans: dict[tuple, list[Trace]], seed: int = 0):
        self.plans, self.rng, self.version = plans, random.Random(seed), 3
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    @classmethod
    def from_config(cls, cfg, placement=None):
        raise NotImplementedError

    def _trace(self, context: list[int], j: int) -> Trace:
        for prompt, traces in self.plans.items():
            if tuple(context) == prompt:
                return traces[j]
            for t in traces:
                if t.outputs and len(t.outputs) < len(t.turns):
                    known = t.contexts[-1] + t.outputs[-1][0][:t.turns[len(t.outputs) - 1].keep]
                    if len(context) > len(known) and context[:len(known)] == known:
                        return t
        raise AssertionError(f"no trace continues {context}")

    def generate(self, requests, sampling):
        self.calls.append(([list(r.prompt_ids) for r in requests], sampling))
        out = []
        for r in requests:
            for j in range(sampling.n):
                t = self._trace(list(r.prompt_ids), j)
                turn = t.turns[len(t.outputs)]
                ids = turn.ids[:sampling.max_new_tokens]
                finish = turn.finish if len(ids) == len(turn.ids) else "length"
                logprobs = [-self.rng.random() * 5 for _ in ids]
                versions = sorted(self.rng.choice([self.version, self.version + 1]) for _ in ids)
                routes = RoutedExperts.from_indices(
                    [[[self.rng.randrange(8) for _ in range(2)] for _ in range(3)]
                     for _ in range(len(r.prompt_ids) + len(ids) - 1)], 8)
                t.contexts.append(list(r.prompt_ids))
                t.outputs.append((ids, logprobs, versions))
                t.routes.append(routes)
                out.append(Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=ids,
                                  rollout_logprobs=logprobs, finish_reason=finish, weight_version=versions[0],
                                  token_versions=versions if len(set(versions)) > 1 else [],
                                  metadata=dict(r.metadata), routed_experts=routes))
        return out

    def update_weights(self, named_tensors, version): ...
    def update_weights_from_disk(self, path, version): ...
    def named_weights(self): return iter(())
    def release(self): ...
    def resume(self): ...
    def health(self): return EngineHealth(True, self.version, False, True)

    @property
    def weight_version(self):
        return self.version


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _spelled(tok, text):
    """``text`` one character per token, special-token names included (what a model may emit)."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def random_trace(tok, rng: random.Random, max_turns: int) -> Trace:
    turns, tag = [], rng.randrange(10 ** 9)  # the tag tells the traces of a group apart
    for k in range(max_turns):
        kind = rng.choice(["call", "call", "bad", "unknown", "answer"]) if k < max_turns - 1 else "answer"
        if kind == "answer":
            ids = _enc(tok, f"{tag} so it is {rng.randrange(10 ** 6)} ") + _spelled(tok, SPELLED_SPECIAL) + [tok.eos_token_id]
            turns.append(Turn(ids, "stop", keep=len(ids)))
            break
        turns.append(call_turn(tok, kind, f"{tag} step {k}", rng.randrange(10 ** 30), rng.randrange(10 ** 30)))
    return Trace(turns)


def call_turn(tok, kind: str, text: str, a: int, b: int) -> Turn:
    """A turn writing ``text`` and a tool call: a calculator call of ``a*b``, a malformed one ("bad") or one
    of an unknown tool; then more tokens the loop cuts off (the model runs on writing a made-up tool turn)."""
    body = {"call": f'{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}',
            "bad": f'{{"name": calculator {a}', "unknown": '{"name": "search", "arguments": {"q": "x"}}'}[kind]
    call = _enc(tok, f"{text}: <tool_call>{body}</tool_call>")
    junk = _spelled(tok, "\n<|tool|>made up") + [tok.eos_token_id]
    result = {"call": str(a * b), "bad": None, "unknown": None}[kind]
    return Turn(call + junk, "stop", results=[result], keep=len(call))


def check_trajectory(tok, prompt: list[int], trace: Trace, sample: Sample) -> int:
    """The sample equals the engine's outputs plus the observations, turn by turn; returns its tool calls."""
    response, mask, logprobs, versions, calls = [], [], [], [], 0
    for k, (context, (ids, lps, vers)) in enumerate(zip(trace.contexts, trace.outputs)):
        assert context == prompt + response  # each turn continues exactly the tokens so far
        keep = min(trace.turns[k].keep, len(ids))
        response += ids[:keep]
        mask += [1] * keep
        logprobs += lps[:keep]
        versions += vers[:keep]
        if k + 1 < len(trace.contexts):  # the loop appended an observation before the next turn
            observation = trace.contexts[k + 1][len(prompt) + len(response):]
            expected = [r if r is not None else None for r in trace.turns[k].results]
            texts = tok.decode(observation)
            if expected[0] is not None:
                assert observation == tool_turn_ids(tok, expected)
            else:
                assert "error:" in texts
            response += observation
            mask += [0] * len(observation)
            logprobs += [0.0] * len(observation)
            versions += [vers[keep - 1]] * len(observation)
            calls += 1
    assert sample.response_ids == response
    assert sample.loss_mask == mask
    assert sample.rollout_logprobs == logprobs
    assert sample.token_versions == versions
    assert sample.weight_version == trace.outputs[0][2][0]
    # routes: the last call's (its context was every earlier token), cut to the sample's tokens less the last
    assert sample.routed_experts == trace.routes[-1].first(len(prompt) + len(response) - 1)
    return calls


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_trajectories_are_engine_tokens_plus_observation_tokens(tok, seed):
    rng = random.Random(seed)
    prompt = _enc(tok, f"<|user|>question {seed}\n<|assistant|>")
    n = 4
    traces = [random_trace(tok, rng, max_turns=rng.randint(1, 5)) for _ in range(n)]
    engine = ScriptedEngine({tuple(prompt): traces}, seed=seed)
    request = GenerateRequest(prompt_ids=prompt, group_index=7, label="x", metadata={"prompt_index": 3})
    samples = run_agent(request, SamplingParams(max_new_tokens=4096, seed=seed, n=n),
                        EngineHandle(engine.generate, tokenizer=tok, request=request),
                        AgentSettings(tools=BUILTIN_TOOLS, max_turns=8))
    assert len(samples) == n
    for trace, sample in zip(traces, samples):
        calls = check_trajectory(tok, prompt, trace, sample)
        assert sample.metadata["tool_calls"] == calls and sample.metadata["turns"] == len(trace.outputs)
        errors = sum(t.results[0] is None for t in trace.turns if t.results)
        assert sample.metadata["tool_errors"] == errors
        assert sample.finish_reason == "stop" and sample.metadata["agent_stop"] == "answer"
        assert sample.group_index == 7 and sample.metadata["prompt_index"] == 3 and sample.label == "x"
        # the spelled special token stays as the engine emitted it: re-encoding the text would merge it
        spelled = _spelled(tok, SPELLED_SPECIAL)
        tail = sample.response_ids[-len(spelled) - 1:-1]
        assert tail == spelled and _enc(tok, tok.decode(tail, skip_special_tokens=False)) != spelled
    # one engine call per turn: the first for all samples (n rows), then one per turn for those still going
    assert engine.calls[0][1].n == n and all(s.n == 1 for _, s in engine.calls[1:])


def test_turn_limit_and_response_budget_end_a_trajectory(tok):
    prompt = _enc(tok, "<|user|>q\n<|assistant|>")
    call_turns = [call_turn(tok, "call", f"turn {k}", 10 ** 20 + k, 3) for k in range(3)]
    traces = [Trace(call_turns[:3] + [Turn(_enc(tok, "42") + [tok.eos_token_id], "stop", keep=3)]) for _ in range(2)]
    engine = ScriptedEngine({tuple(prompt): traces})
    request = GenerateRequest(prompt_ids=prompt, group_index=0)
    # two turns allowed: the second still calls a tool, which is not run
    samples = run_agent(request, SamplingParams(max_new_tokens=4096, n=1), EngineHandle(engine.generate, tokenizer=tok),
                        AgentSettings(tools=BUILTIN_TOOLS, max_turns=2))
    s = samples[0]
    assert (s.finish_reason, s.metadata["agent_stop"], s.metadata["turns"], s.metadata["tool_calls"]) == (
        "length", "max_turns", 2, 1)
    assert s.loss_mask[-1] == 1  # ends on the model's call, no observation after it
    # a budget that fits one turn and its observation but not all turns: the last turn gets what is left
    traces2 = [Trace([Turn(t.ids, t.finish, t.results, t.keep) for t in traces[0].turns])]
    engine2 = ScriptedEngine({tuple(prompt): traces2})
    first, obs = call_turns[0].keep, len(tool_turn_ids(tok, call_turns[0].results))
    budget = first + obs + 5
    s = run_agent(request, SamplingParams(max_new_tokens=budget, n=1), EngineHandle(engine2.generate, tokenizer=tok),
                  AgentSettings(tools=BUILTIN_TOOLS))[0]
    assert len(s.response_ids) == budget and s.finish_reason == "length"
    assert engine2.calls[1][1].max_new_tokens == 5  # the second turn's budget is what remained
    assert s.metadata["agent_stop"] in ("budget", "max_turns") or s.metadata["turns"] == 2


def test_an_aborted_turn_ends_the_sample_as_aborted(tok):
    prompt = _enc(tok, "<|user|>q\n<|assistant|>")
    call = call_turn(tok, "call", "first", 6, 7)
    trace = Trace([call, Turn(_enc(tok, "12"), "abort", keep=2)])
    engine = ScriptedEngine({tuple(prompt): [trace]})
    s = run_agent(GenerateRequest(prompt_ids=prompt, group_index=0), SamplingParams(max_new_tokens=4096, n=1),
                  EngineHandle(engine.generate, tokenizer=tok), AgentSettings(tools=BUILTIN_TOOLS))[0]
    assert s.finish_reason == "abort" and s.metadata["agent_stop"] == "abort"


def test_the_tool_call_end_token_is_a_stop_token_when_the_tokenizer_has_it(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    end = tok.convert_tokens_to_ids("</tool_call>")
    prompt = _enc(tok, "<|user|>q\n<|assistant|>")
    call = _enc(tok, '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert call[-1] == end
    trace = Trace([Turn(call, "stop", results=["42"], keep=len(call)),
                   Turn(_enc(tok, "42") + [tok.eos_token_id], "stop", keep=3)])
    engine = ScriptedEngine({tuple(prompt): [trace]})
    s = run_agent(GenerateRequest(prompt_ids=prompt, group_index=0),
                  SamplingParams(max_new_tokens=4096, n=1, stop_token_ids=(9,)),
                  EngineHandle(engine.generate, tokenizer=tok), AgentSettings(tools=BUILTIN_TOOLS))[0]
    assert all(sp.stop_token_ids == (9, end) for _, sp in engine.calls)
    assert check_trajectory(tok, prompt, trace, s) == 1 and calculator({"expression": "6*7"}) == "42"


def test_groups_run_in_lockstep_one_engine_call_per_turn(tok):
    """Four groups through ``generate_groups``: their turns share engine calls (one per round, rows ordered
    by group), and each group's samples equal its engine outputs plus observations."""
    rng = random.Random(11)
    prompts = [_enc(tok, f"<|user|>q{g}\n<|assistant|>") for g in range(4)]
    plans = {tuple(p): [random_trace(tok, rng, max_turns=3) for _ in range(2)] for p in prompts}
    engine = ScriptedEngine(plans)
    requests = [GenerateRequest(prompt_ids=p, group_index=g) for g, p in enumerate(prompts)]
    from megatron_rl.rollout.agent import generate as agent_generate

    fn = group_generate(agent_generate, "--custom-generate-function-path megatron_rl.rollout.agent:generate",
                        tokenizer=tok)
    samples = generate_groups(fn, requests, SamplingParams(max_new_tokens=4096, n=2, seed=1), engine.generate)
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    for g, p in enumerate(prompts):
        for trace, sample in zip(plans[tuple(p)], samples[2 * g:2 * g + 2]):
            check_trajectory(tok, p, trace, sample)
    longest = max(len(t.outputs) for traces in plans.values() for t in traces)
    assert len(engine.calls) == longest  # every round one engine call, whatever the number of groups
    assert [len(c) for c, _ in engine.calls][0] == 4  # the first round: each group's prompt, n rows each
