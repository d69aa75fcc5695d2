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


def test_a_prompt_that_does_not_extend_the_last_completion_starts_a_branch_trained_on_its_own(model_dir):
    """The history re-rendered differently from what was drawn (``<|user|>`` spelled by the model merges into one
    token): the second request starts a branch, its own sample with its own prompt, loss on its own completion."""
    path, tok = model_dir
    eos = tok.eos_token_id
    call = ScriptedCall([_spelled(tok, "Yes <|user|>") + [eos], [eos], [eos]])
    generate = agent_group_generate(openai_agent, "--agent-function-path t:openai_agent", cfg=_cfg(path))
    request = GenerateRequest(prompt_ids=[1], group_index=0, prompt_text="Hi")
    samples = generate(request, SamplingParams(n=1, max_new_tokens=400), call)
    assert [s.branch for s in samples] == [0, 1]  # request 2 re-renders the first turn; request 3 extends it
    assert [s.prompt_ids for s in samples] == call.contexts[:2]
    (out0, lps0, v0), (out1, lps1, v1), (out2, lps2, v2) = call.outputs
    assert (samples[0].response_ids, samples[0].loss_mask, samples[0].rollout_logprobs) == (out0, [1] * len(out0),
                                                                                            lps0)
    between = call.contexts[2][len(call.contexts[1]) + len(out1):]
    assert samples[1].response_ids == out1 + between + out2
    assert samples[1].loss_mask == [1] * len(out1) + [0] * len(between) + [1] * len(out2)
    assert samples[1].rollout_logprobs == lps1 + [0.0] * len(between) + lps2
    assert all(s.metadata["agent_branches"] == 2 for s in samples)
    assert call.contexts[1][:len(call.contexts[0])] == call.contexts[0]  # the split is after the first prompt
    assert call.contexts[1][:len(call.contexts[0]) + len(out0)] != call.contexts[0] + out0


def test_a_session_places_each_completion_on_the_branch_it_extends():
    s = Session("s")
    assert s.add(Completion([1, 2], [3, 4], [-0.5, -0.25], [1, 1], "stop")) == 0
    assert s.response_length([1, 2, 3, 4, 9, 9]) == 4
    assert s.add(Completion([1, 2, 4], [5], [-1.0], [2], "stop")) == 1  # not an extension: a new branch
    assert s.response_length([1, 2, 4, 5, 6]) == 2 and s.response_length([8]) == 0
    assert s.add(Completion([1, 2, 3, 4, 9], [7], [-1.0], [2], "length")) == 0  # extends branch 0's tip
    assert s.add(Completion([1, 2, 4, 5, 6], [8], [-2.0], [3], "stop")) == 1
    first, second = assemble(s, GenerateRequest(prompt_ids=[0], group_index=1))
    assert (first.prompt_ids, first.response_ids, first.loss_mask, first.rollout_logprobs) == (
        [1, 2], [3, 4, 9, 7], [1, 1, 0, 1], [-0.5, -0.25, 0.0, -1.0])
    assert first.token_versions == [1, 1, 2, 2] and first.finish_reason == "length" and first.branch == 0
    assert (second.prompt_ids, second.response_ids, second.loss_mask, second.token_versions) == (
        [1, 2, 4], [5, 6, 8], [1, 0, 1], [2, 3, 3])
    assert second.branch == 1 and s.splits == 1
    with pytest.raises(NonAppendPrompt, match="does not extend branch 0's tip"):
        s.add(Completion([1, 2, 3], [5], [-1.0], [2], "stop"), 0)


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


# Qwen3's chat template, in the char tokenizer's tokens: an assistant turn's thinking (``<think>...</think>`` in its
# content) is rendered only after the last user query; once a new user message follows, the earlier turns lose it.
# Tool results are user turns wrapped in <tool_response> (role "tool", so they are no query). Not append-only.
_NL = '{{ "\\n" }}'
QWEN3_STYLE = (
    "{% set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{% for m in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.multi_step_tool and m['role'] == 'user' %}{% set ns.multi_step_tool = false %}"
    "{% set ns.last_query_index = index %}{% endif %}{% endfor %}"
    "{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}" + _NL + "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}" + _NL +
    "{% elif m['role'] == 'assistant' %}{% set content = m['content'] or '' %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|assistant|>{% if loop.index0 > ns.last_query_index and reasoning %}<think>" + _NL +
    "{{ reasoning.strip('\\n') }}" + _NL + "</think>" + _NL + _NL + "{% endif %}{{ content }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{% endif %}<eos>" + _NL +
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>" + _NL + "{{ m['content'] }}" + _NL + "</tool_response>"
    + _NL + "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def thinking_agent(base_url, task):
    """A tool call, the answer, a follow-up question ("Sure?"), another tool call and the answer: four requests."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        if message.tool_calls:
            messages.append({"role": "assistant", "content": message.content, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                for c in message.tool_calls]})
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls]
        else:
            messages.append({"role": "assistant", "content": message.content})
            messages.append({"role": "user", "content": "Sure?"})
    return 1.0


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tok")
    return str(path), build_char_tokenizer(path, chat_template=QWEN3_STYLE)


def test_qwen3_thinking_drop_splits_the_session_into_branches_each_trained_on_its_own_completions(qwen3_dir):
    from megatron_rl.rollout.batch_builder import session_metrics
    from megatron_rl.rollout.generate_fn import check_samples

    path, tok = qwen3_dir
    eos = tok.eos_token_id
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    turns = ["<think>\nneed the tool\n</think>\n\n" + CALL, "<think>\nit is 42\n</think>\n\nIt is 42.",
             "<think>\ncheck again\n</think>\n\n" + CALL, "<think>\nsure\n</think>\n\nYes, 42."]
    call = ScriptedCall([enc(t) + [eos] for t in turns])
    generate = agent_group_generate(thinking_agent, "--agent-function-path t:thinking_agent", cfg=_cfg(path))
    request = GenerateRequest(prompt_ids=[1], group_index=2, prompt_text="What is 6*7?")
    sampling = SamplingParams(n=1, max_new_tokens=400)
    samples = check_samples(generate(request, sampling, call), [request], sampling, "--agent-function-path t:a", 110)

    contexts, outputs = call.contexts, call.outputs
    text = [tok.decode(c, skip_special_tokens=False) for c in contexts]
    # the template kept turn 1's thinking inside the tool chain, and dropped it once "Sure?" followed
    assert "need the tool" in text[1] and "need the tool" not in text[2] and "it is 42" not in text[2]
    assert contexts[1][:len(contexts[0]) + len(outputs[0][0])] == contexts[0] + outputs[0][0]  # append: same branch
    assert contexts[2][:len(contexts[1]) + len(outputs[1][0])] != contexts[1] + outputs[1][0]  # the split
    assert contexts[3][:len(contexts[2]) + len(outputs[2][0])] == contexts[2] + outputs[2][0]  # append in branch 1

    assert [s.branch for s in samples] == [0, 1] and all(s.group_index == 2 for s in samples)
    for s, (a, b) in zip(samples, ((0, 1), (2, 3))):  # each branch: its own first prompt, its own completions
        assert s.prompt_ids == contexts[a]
        between = contexts[b][len(contexts[a]) + len(outputs[a][0]):]
        assert s.response_ids == outputs[a][0] + between + outputs[b][0]
        assert s.loss_mask == [1] * len(outputs[a][0]) + [0] * len(between) + [1] * len(outputs[b][0])
        assert s.rollout_logprobs == outputs[a][1] + [0.0] * len(between) + outputs[b][1]
        assert s.token_versions == outputs[a][2] + [outputs[b][2][0]] * len(between) + outputs[b][2]
        assert s.metadata["agent_reward"] == 1.0 and s.metadata["agent_branches"] == 2
    # TITO: every drawn token is trained exactly once, as the engine drew it (never the re-rendered text)
    trained = [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in samples]
    assert trained == [outputs[0][0] + outputs[1][0], outputs[2][0] + outputs[3][0]]
    assert session_metrics(samples) == {"rollout/agent_branches_mean": 2.0, "rollout/agent_splits": 1.0,
                                        "rollout/agent_split_sessions_frac": 1.0}


def test_a_sessions_branches_share_its_reward_and_count_once_in_its_group():
    """Two sessions of one prompt: A (reward 1) split in two branches, B (reward 0) whole. The run's reward scores A's
    last branch once and both branches get it; GRPO's group is the two sessions (mean 0.5), not three samples."""
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.rollout.rewards import compute_rewards

    def sample(branch, text):
        return Sample(group_index=0, prompt_ids=[1], response_ids=[2, 3], response_text=text, branch=branch)

    batch = [sample(0, "early"), sample(1, "final"), sample(0, "wrong")]
    seen = []

    def rm(samples):
        seen.extend(s.response_text for s in samples)
        return [1.0 if s.response_text == "final" else 0.0 for s in samples]

    compute_rewards(batch, AgentReward("--agent-function-path m:a", rm))
    assert seen == ["final", "wrong"] and [s.reward for s in batch] == [1.0, 1.0, 0.0]
    spec = PolicyGradientSpec(PolicyGradientConfig())
    adv = [a.tolist() for a in spec.compute_advantages(batch)]
    assert adv[0] == adv[1] and adv[0][0] > 0 > adv[2][0]
    assert adv[0][0] == pytest.approx(-adv[2][0])  # the two sessions' advantages are symmetric: (1 - 0.5) / std
