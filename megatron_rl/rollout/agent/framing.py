"""The tokens of a tool turn: what the loop appends after a model turn that called tools (loss mask 0).

The chat template is applied once, to the prompt, by the prompt dataset (``--apply-chat-template``); the
loop never re-renders the conversation. What it appends after a model turn is the text the template would
put between that turn's content and the next assistant turn's content: the end of the assistant turn (minus
the stop token the model already emitted), one tool message per result, and the generation prompt. It is
read off the template by rendering a two-message conversation with and without the tool messages
(``template_tool_turn``), and tokenised *alone*: the tokens before it are the engine's, never re-encoded.

A tokenizer without a chat template, or whose template cannot render a ``tool`` message or renders the
shorter conversation as something other than a prefix of the longer, gets the Hermes framing
``FALLBACK_OPEN + result + FALLBACK_CLOSE`` per result.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_rl.rollout.agent.parse import TOOL_CALL_END

#: stands for the assistant turn's content while reading the template's framing off a rendering
_SENTINEL = "MEGATRON_RL_ASSISTANT_CONTENT"
FALLBACK_OPEN = "\n<tool_response>\n"
FALLBACK_CLOSE = "\n</tool_response>\n"


def template_tool_turn(tokenizer: Any, results: Sequence[str]) -> Optional[tuple[str, str]]:
    """``(assistant turn end, tool messages + generation prompt)`` as the chat template renders them, or None
    when there is no template or it cannot render tool messages after an assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    head = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _SENTINEL}]
    tools = [{"role": "tool", "content": text} for text in results]
    try:
        short = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=False)
        long = tokenizer.apply_chat_template(head + tools, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template without a tool role (jinja raises): the fallback framing
        return None
    if not isinstance(short, str) or _SENTINEL not in short or not long.startswith(short):
        return None
    return short[short.rindex(_SENTINEL) + len(_SENTINEL):], long[len(short):]


def tool_turn_text(tokenizer: Any, results: Sequence[str], emitted_end: str = "") -> str:
    """The text appended after a model turn whose tool calls gave ``results``; ``emitted_end``: the decoded
    stop token that ended the turn (the template's turn end starts with it when the model closed its turn
    itself, e.g. Qwen's ``<|im_end|>``), dropped from the turn end so it is not there twice."""
    framing = template_tool_turn(tokenizer, results)
    if framing is None:
        return "".join(FALLBACK_OPEN + text + FALLBACK_CLOSE for text in results)
    turn_end, tool_turn = framing
    if emitted_end and turn_end.startswith(emitted_end):
        turn_end = turn_end[len(emitted_end):]
    return turn_end + tool_turn


def tool_turn_ids(tokenizer: Any, results: Sequence[str], emitted_end: str = "") -> list[int]:
    """``tool_turn_text`` tokenised on its own (no special tokens added: the template's are in the text)."""
    return list(tokenizer.encode(tool_turn_text(tokenizer, results, emitted_end), add_special_tokens=False))


def tool_call_end_id(tokenizer: Any) -> Optional[int]:
    """The id of ``</tool_call>`` when the tokenizer has it as one token (Qwen2.5/3, Hermes), else None."""
    ids = tokenizer.encode(TOOL_CALL_END, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def cut_after_tool_call(tokenizer: Any, output_ids: Sequence[int]) -> int:
    """How many of ``output_ids`` to keep: up to the token whose decoding completes the first
    ``</tool_call>`` (all of them when it never does). A prefix of the engine's tokens, so their log-probs
    stand; the tokens after it are dropped, never re-encoded."""
    def has_end(k: int) -> bool:
        return TOOL_CALL_END in tokenizer.decode(list(output_ids[:k]), skip_special_tokens=False)

    if not has_end(len(output_ids)):
        return len(output_ids)
    lo, hi = 1, len(output_ids)  # has_end is monotone in k: find the smallest k with it
    while lo < hi:
        mid = (lo + hi) // 2
        if has_end(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


__all__ = ["FALLBACK_CLOSE", "FALLBACK_OPEN", "cut_after_tool_call", "template_tool_turn", "tool_call_end_id",
           "tool_turn_ids", "tool_turn_text"]
