"""``--agent-function-path``: an agent written with the official ``openai`` client (unchanged calls) against the run's
endpoint; the trained sample is the engine's recorded tokens, never the conversation re-tokenised.

The engine is a scripted double speaking the engine call's exact contract (requests in, samples with the tokens,
log-probs and weight versions out); the tokenizer is the char tokenizer with a chat template that renders tools and
tool calls. Its special tokens make re-tokenisation visible: a model that spells ``<|user|>`` one character per
token gets a text that encodes to one token, so a trajectory rebuilt from messages would differ from what was drawn.
"""

import json
import random
from types import SimpleNamespace

import pytest

from _agent_chat import TEMPLATE, TOOLS  # tests/ is on sys.path (conftest)
from _tokenizer import build_char_tokenizer

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.endpoint.agent import agent_group_generate, load_agent
from megatron_rl.rollout.endpoint.trajectory import Completion, NonAppendPrompt, Session, assemble
from megatron_rl.rollout.rewards import AgentReward

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def openai_agent(base_url, task):
    """Three model turns through the official client: a tool call, the answer, a follow-up."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if message.tool_calls:
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            for c in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": c.id, "content": "42"})
        else:
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": "Sure?"})
    openai_agent.messages = messages
    return 1.0 if "42" in (messages[3].get("content") or "") else 0.0


class ScriptedCall:
    """The engine call's contract (``generate_fn.EngineCall``): plays ``turns`` in order, random log-probs."""

    def __init__(self, turns):
        self.turns, self.contexts, self.outputs = list(turns), [], []
        self.rng = random.Random(0)

    def __call__(self, requests, sampling):
        out = []
        for r in requests:
            ids = self.turns[len(self.outputs)][:sampling.max_new_tokens]
            lps = [-self.rng.random() * 4 for _ in ids]
            versions = [5] * (len(ids) // 2) + [6] * (len(ids) - len(ids) // 2)  # a sync landed mid-turn
            self.contexts.append(list(r.prompt_ids))
            self.outputs.append((ids, lps, versions))
            out.append(Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=ids,
                              rollout_logprobs=lps, finish_reason="stop", weight_version=versions[0],
                              token_versions=versions))
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent_tok")
    tok = build_char_tokenizer(path, chat_template=TEMPLATE)
    return str(path), tok


def _cfg(path):
    return SimpleNamespace(model=SimpleNamespace(hf_checkpoint=path), mode=SimpleNamespace(save_debug_rollout_data=None),
                           rollout=SimpleNamespace(user_function_timeout=60.0, rollout_max_prompt_len=512,
                                                   rollout_seed=1))


def _spelled(tok, text):
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_an_openai_client_agent_trains_on_the_recorded_tokens_not_the_re_tokenised_text(model_dir):
    path, tok = model_dir
    eos = tok.eos_token_id
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    # the last turn spells <|user|> character by character: its text encodes to one special token
    call = ScriptedCall([enc(CALL) + [eos], enc("42") + [eos], _spelled(tok, "Yes <|user|>") + [eos]])
    generate = agent_group_generate(openai_agent, "--agent-function-path t:openai_agent", cfg=_cfg(path))
    request = GenerateRequest(prompt_ids=[1], group_index=3, prompt_text="What is 6*7?", label="42")
    [sample] = generate(request, SamplingParams(n=1, max_new_tokens=400), call)

    assert len(call.contexts) == 3 and sample.metadata["agent_reward"] == 1.0
    assert sample.prompt_ids == call.contexts[0]
    # the trajectory: each completion exactly as drawn (mask 1), the template's tokens between (mask 0)
    ids, mask, lps, versions = [], [], [], []
    at = len(call.contexts[0])
    for context, (out, out_lps, out_versions) in zip(call.contexts, call.outputs):
        between = context[at:]
        ids += between + out
        mask += [0] * len(between) + [1] * len(out)
        lps += [0.0] * len(between) + out_lps
        versions += [out_versions[0]] * len(between) + out_versions
        at = len(context) + len(out)
    assert (sample.response_ids, sample.loss_mask, sample.rollout_logprobs, sample.token_versions) == (
        ids, mask, lps, versions)
    assert sample.finish_reason == "stop" and sample.weight_version == 5
    # the tool call reached the agent as OpenAI tool_calls, and its result went back through the template
    messages = openai_agent.messages
    assert messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "6*7"}'}
    assert messages[1]["content"] is None and messages[2] == {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"], "content": "42"}
    assert tok.decode(call.contexts[1][len(call.contexts[0]):], skip_special_tokens=False).startswith(CALL + "<eos>")
    # re-tokenising the conversation gives other ids than the engine drew: the sample is not that
    as_objects = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                          "arguments": json.loads(c["function"]["arguments"])}}
                                       for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages[:-1]]
    rendered = enc(tok.apply_chat_template(as_objects, tools=TOOLS, tokenize=False))
    assert rendered != sample.prompt_ids + sample.response_ids
    assert rendered[:len(call.contexts[2])] == call.contexts[2]


def test_a_prompt_that_does_not_extend_the_last_completion_is_refused_by_name(model_dir):
    path, tok = model_dir
    eos = tok.eos_token_id
    call = ScriptedCall([_spelled(tok, "Yes <|user|>") + [eos], [eos]])  # its re-rendering merges <|user|>
    generate = agent_group_generate(openai_agent, "--agent-function-path t:openai_agent", cfg=_cfg(path))
    request = GenerateRequest(prompt_ids=[1], group_index=0, prompt_text="Hi")
    with pytest.raises(ConfigError, match=r"^--agent-function-path t:openai_agent: agent session \w+: request 2's "
                                          r"rendered prompt \(\d+ tokens\) does not extend completion 1's prompt"):
        generate(request, SamplingParams(n=1, max_new_tokens=400), call)
    assert len(call.contexts) == 1  # refused before the engine


def test_assembly_refuses_a_non_append_session_and_a_budget_is_counted_from_the_first_prompt():
    s = Session("s")
    s.add(Completion([1, 2], [3, 4], [-0.5, -0.25], [1, 1], "stop"))
    assert s.response_length([1, 2, 3, 4, 9, 9]) == 4
    with pytest.raises(NonAppendPrompt, match="first difference at token 2"):
        s.add(Completion([1, 2, 4], [5], [-1.0], [2], "stop"))
    s.add(Completion([1, 2, 3, 4, 9], [7], [-1.0], [2], "length"))
    sample = assemble(s, GenerateRequest(prompt_ids=[0], group_index=1))
    assert (sample.prompt_ids, sample.response_ids, sample.loss_mask, sample.rollout_logprobs) == (
        [1, 2], [3, 4, 9, 7], [1, 1, 0, 1], [-0.5, -0.25, 0.0, -1.0])
    assert sample.token_versions == [1, 1, 2, 2] and sample.finish_reason == "length"


def test_the_agents_reward_comes_first_then_the_runs_reward_function():
    samples = [Sample(group_index=0, prompt_ids=[1], response_ids=[2], metadata={"agent_reward": 0.5}),
               Sample(group_index=0, prompt_ids=[1], response_ids=[2])]
    assert AgentReward("--agent-function-path m:a", lambda batch: [0.25] * len(batch))(samples) == [0.5, 0.25]
    with pytest.raises(ConfigError, match=r"no reward for sample 1: --agent-function-path m:a returned None"):
        AgentReward("--agent-function-path m:a", None)(samples)


def test_pre_flight_checks_the_agents_signature(tmp_path):
    module = tmp_path / "agents_mod.py"
    module.write_text("def agent(base_url, task):\n    return None\n\nasync def one(url):\n    return 1.0\n")
    assert load_agent(f"{module}:agent").__name__ == "agent"
    with pytest.raises(ConfigError, match=r"--agent-function-path .*agents_mod.py:one: one\(url\) cannot be called "
                                          r"as agent\(base_url, task\)"):
        load_agent(f"{module}:one")


def text_agent(base_url, task):
    """Two ``/v1/completions`` calls through the official client, the second continuing the first's text."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    first = client.completions.create(model="policy", prompt=task["prompt"], max_tokens=50)
    second = client.completions.create(model="policy", prompt=task["prompt"] + first.choices[0].text + "\nok:")
    return {"reward": float(second.choices[0].text == "7"), "turns": 2.0}


def test_text_completions_are_recorded_and_assembled_the_same_way(model_dir):
    path, tok = model_dir
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    call = ScriptedCall([enc("3+4"), enc("7") + [tok.eos_token_id]])
    generate = agent_group_generate(text_agent, "--agent-function-path t:text_agent", cfg=_cfg(path))
    [sample] = generate(GenerateRequest(prompt_ids=[1], group_index=0, prompt_text="sum:"),
                        SamplingParams(n=1, max_new_tokens=100), call)
    assert call.contexts == [enc("sum:"), enc("sum:3+4\nok:")]
    assert sample.response_ids == enc("3+4\nok:7") + [tok.eos_token_id]
    assert sample.loss_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert sample.metadata["agent_reward"] == {"reward": 1.0, "turns": 2.0}
