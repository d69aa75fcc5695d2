"""The CPU agent demo's task (megatron_rl/rollout/agent/calculator_task.py), in process: the prompt file, the
answer reward, and the tokenizer as the engine loads it (a tool call is a few tokens the tool loop parses and
stops at; the tool turn's tokens round-trip), and the warm-start conversations match what the loop builds."""

import json
from types import SimpleNamespace

import pytest

from megatron_rl.rollout.agent import calculator_task as task
from megatron_rl.rollout.agent.framing import FALLBACK_CLOSE, FALLBACK_OPEN, tool_call_end_id, tool_turn_ids
from megatron_rl.rollout.agent.parse import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls
from megatron_rl.rollout.agent.tools import BUILTIN_TOOLS, run_tool


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tokenizer as the engine loads it: from a directory whose config.json is a Qwen2 model's."""
    import transformers

    path = str(tmp_path_factory.mktemp("calc_tok"))
    transformers.Qwen2Config(vocab_size=task.VOCAB_SIZE).save_pretrained(path)
    return task.build_tokenizer(path)


def test_prompt_file_holds_sums_of_two_six_digit_numbers(tmp_path):
    path = task.write_prompt_file(str(tmp_path / "p.jsonl"), n=50, seed=3)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 50 and len({r["prompt"] for r in rows}) == 50
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("+")
        assert r["prompt"].endswith("=") and len(a) == len(b) == 6
        assert r["label"] == str(int(a) + int(b)) and len(r["label"]) == 7  # fixed lengths: fixed copy offsets
    assert task.write_prompt_file(str(tmp_path / "q.jsonl"), n=50, seed=3) and \
        (tmp_path / "q.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()


def _scored(text, label="1513381"):
    return task.answer_reward(SimpleNamespace(response_text=text, label=label))


def test_reward_is_for_the_right_final_answer_only():
    call = task.tool_call_text("782915+730466")
    observation = FALLBACK_OPEN + "1513381" + FALLBACK_CLOSE
    assert _scored(call + observation + "1513381") == 1.0
    assert _scored(call + observation + "1513381<eos>") == 1.0
    assert _scored("1513381") == 1.0  # an answer without the tool counts too: the tool is a means, not a goal
    assert _scored(call + observation + "1513382") == 0.0
    assert _scored(call + observation) == 0.0  # the tool's result is not the model's answer
    assert _scored(call + observation + "15133810") == 0.0
    assert _scored(call + observation + call + FALLBACK_OPEN + "error: x" + FALLBACK_CLOSE) == 0.0
    assert _scored("") == 0.0 and task.answer_reward(SimpleNamespace(response_text=None, label="1")) == 0.0


def test_a_tool_call_is_a_few_tokens_the_loop_parses_and_stops_at(tokenizer):
    text = task.tool_call_text("782915+730466")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == [TOOL_CALL_START, task.CALL_HEAD]
    assert tokenizer.convert_ids_to_tokens(ids[-2:]) == [task.CALL_TAIL, TOOL_CALL_END]
    assert len(ids) == 4 + len("782915+730466")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # one token: the loop adds it to the turn's stop tokens, as for Qwen
    assert tool_call_end_id(tokenizer) == task.VOCAB.index(TOOL_CALL_END)
    (call,) = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
    assert call.error is None and run_tool(BUILTIN_TOOLS, call.name, call.arguments, 5.0) == ("1513381", False)
    assert max(tokenizer.encode("".join(task.CHARS), add_special_tokens=False)) < task.VOCAB_SIZE


def test_tool_turns_and_errors_round_trip_through_the_tokenizer(tokenizer):
    """The tool turn keeps its newlines (a Qwen2 loader must not drop them) and an ``error:`` observation is
    spelled in characters, never unknown tokens."""
    for result in ("1513381", "error: the tool call is not JSON (Expecting value at character 0)"):
        ids = tool_turn_ids(tokenizer, [result])
        assert tokenizer.decode(ids, skip_special_tokens=False) == FALLBACK_OPEN + result + FALLBACK_CLOSE
        assert tokenizer.unk_token_id not in ids


def test_warm_start_conversations_are_what_the_loop_builds(tokenizer):
    prompt, label = "782915+730466=", "1513381"
    ids, mask = task.conversation(tokenizer, prompt, use_tool=True)
    prompt_ids = tokenizer(prompt)["input_ids"]  # as the prompt dataset tokenises it (no chat template)
    call = tokenizer.encode(task.tool_call_text("782915+730466"), add_special_tokens=False)
    observation = tool_turn_ids(tokenizer, [label])
    answer = tokenizer.encode(label, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids == prompt_ids + call + observation + answer
    assert mask == [0] * len(prompt_ids) + [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    direct, direct_mask = task.conversation(tokenizer, prompt, use_tool=False)
    assert direct == prompt_ids + answer and direct_mask == [0] * len(prompt_ids) + [1] + [0] * len(label)
    response = tokenizer.decode(ids[len(prompt_ids):], skip_special_tokens=True)
    assert task.answer_reward(SimpleNamespace(response_text=response, label=label)) == 1.0


def test_warm_start_lowers_the_loss(tokenizer):
    import torch
    import transformers

    config = transformers.Qwen2Config(vocab_size=task.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    first = task.warm_start(model, tokenizer, steps=1, batch_size=8)
    later = task.warm_start(model, tokenizer, steps=30, batch_size=8, seed=1)
    assert later < first - 1.0, (first, later)
