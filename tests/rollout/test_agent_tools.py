"""The tool loop's parts alone: the calculator, tool calls that fail every way, the parser, the framing."""

import threading

import pytest

from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.errors import ConfigError
from megatron_rl.rollout.agent.framing import (FALLBACK_CLOSE, FALLBACK_OPEN, cut_after_tool_call, template_tool_turn,
                                               tool_call_end_id, tool_turn_ids, tool_turn_text)
from megatron_rl.rollout.agent.parse import parse_tool_calls
from megatron_rl.rollout.agent.tools import BUILTIN_TOOLS, calculator, load_tools, run_tool


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


@pytest.mark.parametrize("expression, value", [
    ("2+3*4", 14), ("(2+3)*4", 20), ("-5 - -3", -2), ("1 - 2 - 3", -4), ("+7", 7),
    ("123456789012345678901234567890 * 987654321098765432109876543210",
     123456789012345678901234567890 * 987654321098765432109876543210),
    ("  99999999999999999999 + 1 ", 10 ** 20),
])
def test_calculator_is_exact_integer_arithmetic(expression, value):
    assert calculator({"expression": expression}) == str(value)


@pytest.mark.parametrize("arguments, match", [
    ({"expression": "2/3"}, "unexpected '/'"), ({"expression": "(1+2"}, "not closed"),
    ({"expression": "1 2"}, "after a complete expression"), ({"expression": "3*"}, "ends too early"),
    ({"expression": 5}, "give"), ({}, "give"), ({"expression": "1+" * 3000}, "at most"),
    ({"expression": "__import__('os')"}, "unexpected"),
])
def test_calculator_refuses_what_is_not_integer_arithmetic(arguments, match):
    with pytest.raises(ValueError, match=match):
        calculator(arguments)


def test_every_tool_failure_is_an_observation_never_an_exception():
    release = threading.Event()

    def hangs(arguments):
        release.wait()
        return "late"

    registry = {**BUILTIN_TOOLS, "boom": lambda a: 1 / 0, "number": lambda a: 42, "hangs": hangs}
    try:
        assert run_tool(registry, "calculator", {"expression": "6*7"}, 5.0) == ("42", False)
        text, failed = run_tool(registry, "search", {}, 5.0)
        assert failed and text.startswith("error: unknown tool 'search'") and "calculator" in text
        text, failed = run_tool(registry, "boom", {}, 5.0)
        assert failed and "ZeroDivisionError" in text
        assert run_tool(registry, "number", {}, 5.0) == ("error: tool 'number' returned int, not a string", True)
        text, failed = run_tool(registry, "calculator", ["6*7"], 5.0)
        assert failed and "JSON object" in text
        text, failed = run_tool(registry, "calculator", {"expression": "6/7"}, 5.0)
        assert failed and text.startswith("error: tool 'calculator' failed: ValueError")
        text, failed = run_tool(registry, "hangs", {}, 0.05)
        assert failed and "timed out after 0.05 s (--tool-timeout)" in text
    finally:
        release.set()


def test_tool_registries_load_by_path_and_bad_ones_are_named(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text("REGISTRY = {'echo': lambda a: a['text']}\nNOT_A_DICT = 3\n"
                                          "BAD = {'x': 3}\nEMPTY = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_tools.cache_clear()
    assert load_tools(None) is BUILTIN_TOOLS
    assert run_tool(load_tools("my_tools:REGISTRY"), "echo", {"text": "hi"}, 5.0) == ("hi", False)
    for path, match in [("my_tools:NOT_A_DICT", "int, not a dict"), ("my_tools:BAD", "entries x are not"),
                        ("my_tools:EMPTY", "the registry is empty"), ("my_tools:NOPE", "has no 'NOPE'"),
                        ("no_such_module_xyz:R", "cannot import 'no_such_module_xyz'"),
                        ("my_tools", "must be module:REGISTRY")]:
        with pytest.raises(ConfigError, match=f"--tools {path}.*{match}"):
            load_tools(path)


def test_tool_calls_parse_and_malformed_ones_become_errors():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> and '
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call><tool_call>{"name": "y"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("calculator", {"expression": "1+1"}, True), ("calculator", {"expression": "2"}, True)]
    assert "not JSON" in calls[2].error and 'string "name"' in calls[3].error
    assert calls[4].name == "x" and "list" in calls[4].error
    assert "was not closed" in calls[5].error and len(calls) == 6
    assert parse_tool_calls("the answer is 4") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[0].arguments == {}


def test_tool_turn_framing_follows_the_chat_template(tok):
    # the test template renders "<|role|>content\n": the assistant turn ends with "\n"
    assert template_tool_turn(tok, ["42"]) == ("\n", "<|tool|>42\n<|assistant|>")
    assert tool_turn_text(tok, ["42", "error: x"]) == "\n<|tool|>42\n<|tool|>error: x\n<|assistant|>"
    assert tool_turn_text(tok, ["42"], emitted_end="\n") == "<|tool|>42\n<|assistant|>"  # not twice
    ids = tool_turn_ids(tok, ["42"])
    assert ids == tok.encode("\n<|tool|>42\n<|assistant|>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids  # the template's special token, one id


def test_qwen_like_turn_end_is_not_repeated_after_the_models_own(tmp_path):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    qwen = build_char_tokenizer(tmp_path, chat_template=template)
    assert template_tool_turn(qwen, ["7"]) == ("<|im_end|>\n", "<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    assert tool_turn_text(qwen, ["7"], emitted_end="<|im_end|>").startswith("\n<|im_start|>tool")
    assert tool_turn_text(qwen, ["7"], emitted_end="<eos>").startswith("<|im_end|>\n<|im_start|>tool")


def test_without_a_usable_template_the_hermes_framing_is_used(tmp_path):
    plain = build_char_tokenizer(tmp_path / "plain", chat_template=None)
    assert tool_turn_text(plain, ["5", "6"]) == FALLBACK_OPEN + "5" + FALLBACK_CLOSE + FALLBACK_OPEN + "6" + FALLBACK_CLOSE
    strict = build_char_tokenizer(tmp_path / "strict", chat_template=(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"))
    assert tool_turn_text(strict, ["5"]) == FALLBACK_OPEN + "5" + FALLBACK_CLOSE


def test_a_turn_is_cut_after_the_token_that_completes_the_tool_call(tok):
    ids = tok.encode('<tool_call>{"name": "f"}</tool_call>\n<|tool|>junk', add_special_tokens=False)
    keep = cut_after_tool_call(tok, ids)
    assert tok.decode(ids[:keep]).endswith("</tool_call>") and not tok.decode(ids[:keep - 1]).endswith("</tool_call>")
    assert cut_after_tool_call(tok, ids[:keep - 1]) == keep - 1  # no complete tag: everything kept
    assert tool_call_end_id(tok) is None  # the char tokenizer spells the tag


def test_a_tokenizer_with_the_tag_as_one_token_stops_on_it(tmp_path):
    qwen_like = build_char_tokenizer(tmp_path)
    qwen_like.add_tokens(["<tool_call>", "</tool_call>"])
    assert tool_call_end_id(qwen_like) == qwen_like.convert_tokens_to_ids("</tool_call>")
