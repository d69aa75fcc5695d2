"""``--agent-function-path`` end to end: an agent written with the official ``openai`` client (unchanged calls:
``client.chat.completions.create(model=..., messages=..., tools=...)``, three model turns, one of them a tool call)
trains the CPU demo model for two rollouts through the run's OpenAI-compatible endpoint (``python -m
megatron_rl.train`` in one process, the embedded engine behind it). The model is a tiny Qwen2 that memorised the
conversation as the chat template renders it (tool call in Hermes form, the tool's result, the answer, a
follow-up), so the agent's three turns run. Before its third request the agent compacts its history (the tool
exchange dropped), a request that does not extend the session's tokens: the session splits into two branches,
each trained as a sample of its own (docs/agentic.md, "Branches"). What trained equals what the engine returned:
every saved sample is its branch's recorded completions (``agent_completions.jsonl``) token for token: prompt,
output ids and log-probs under loss mask 1, the template's tokens between them under loss mask 0."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from _agent_chat import TEMPLATE, TOOLS  # tests/ is on sys.path (conftest)

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUESTION = "What is 12*34?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'

AGENT = '''
from openai import OpenAI

TOOLS = {tools!r}


def agent(base_url, task):
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{{"role": "user", "content": task["prompt"]}}]
    answer = None
    for turn in range(3):
        if turn == 2:  # compaction: the tool exchange dropped from the history
            messages = [messages[0]] + messages[3:]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=100)
        message = reply.choices[0].message
        if message.tool_calls:
            messages.append({{"role": "assistant", "content": message.content, "tool_calls": [
                {{"id": c.id, "type": "function", "function": {{"name": c.function.name,
                                                               "arguments": c.function.arguments}}}}
                for c in message.tool_calls]}})
            for c in message.tool_calls:
                messages.append({{"role": "tool", "tool_call_id": c.id, "content": "408"}})
        else:
            messages.append({{"role": "assistant", "content": message.content}})
            answer = answer or message.content
            messages.append({{"role": "user", "content": "Sure?"}})
    return 1.0 if answer == task["label"] else 0.0
'''


def _model(path):
    """A tiny Qwen2 (char tokenizer, TEMPLATE) that memorised the three-turn conversation."""
    import transformers

    from _tokenizer import build_char_tokenizer

    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32")
    config.save_pretrained(str(path))
    tok = build_char_tokenizer(path, chat_template=TEMPLATE)
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    call = {"id": "c", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}  # as the endpoint renders it
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
    first = tok.encode(tok.apply_chat_template(chat[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)
    whole = tok.encode(tok.apply_chat_template(chat, tools=TOOLS, tokenize=False), add_special_tokens=False)
    assert whole[:len(first)] == first and CALL in tok.decode(whole)
    ids = torch.tensor([whole])
    labels = ids.clone()
    labels[0, :len(first)] = -100
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(150):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.01, f"the model did not memorise its conversation (loss {loss.item():.3f})"
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def test_an_openai_client_agent_trains_through_the_endpoint_on_exactly_the_recorded_completions(tmp_path):
    model = _model(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": QUESTION, "label": "408"}) + "\n")
    (tmp_path / "my_agent.py").write_text(textwrap.dedent(AGENT.format(tools=TOOLS)))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", model, "--prompt-data",
         str(tmp_path / "prompts.jsonl"), "--agent-function-path", f"{tmp_path / 'my_agent.py'}:agent",
         "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "200",
         "--rollout-max-prompt-len", "64", "--rollout-temperature", "0.5", "--num-rollout", "2", "--lr", "1e-5",
         "--output-dir", str(out), "--save-debug-rollout-data", str(tmp_path / "rollouts" / "r_{rollout_id}.pt")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    records = [json.loads(line) for line in (tmp_path / "rollouts" / "agent_completions.jsonl").read_text().splitlines()]
    sessions: dict = {}
    for r in records:
        sessions.setdefault(r["session"], []).append(r)
    called = rewarded = 0
    for rollout in (0, 1):
        samples = torch.load(tmp_path / "rollouts" / f"r_{rollout}.pt", weights_only=False)["samples"]
        assert [s["branch"] for s in samples] == [0, 1, 0, 1]  # two sessions, each split by the compaction
        for s in samples:
            recorded = sessions[s["metadata"]["agent_session"]]
            assert len(recorded) == 3  # the agent's three turns, each one engine completion
            completions = recorded[:2] if s["branch"] == 0 else recorded[2:]  # the third starts branch 1
            assert s["prompt_ids"] == completions[0]["prompt_ids"]
            ids, mask, lps = [], [], []
            at = len(completions[0]["prompt_ids"])
            for c in completions:
                between = c["prompt_ids"][at:]
                ids += between + c["output_ids"]
                mask += [0] * len(between) + [1] * len(c["output_ids"])
                lps += [0.0] * len(between) + c["logprobs"]
                at = len(c["prompt_ids"]) + len(c["output_ids"])
            assert (s["response_ids"], s["loss_mask"], s["rollout_logprobs"]) == (ids, mask, lps)
            called += CALL in s["response_text"]
            rewarded += s["reward"] == 1.0
            if s["branch"] == 1:
                del sessions[s["metadata"]["agent_session"]]
    assert not sessions  # every recorded session trained, as its two branches
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "rollout/agent_splits" in r]
    assert [(r["rollout/agent_splits"], r["rollout/agent_branches_mean"]) for r in steps] == [(2.0, 2.0)] * 2
    assert called > 0 and rewarded > 0, [s["response_text"] for s in samples]
