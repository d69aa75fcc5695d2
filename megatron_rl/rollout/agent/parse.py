"""Tool calls in a model turn, in the Qwen / Hermes form: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Parsing never raises: a block that is not JSON, not an object with a string ``name``, whose ``arguments`` is
neither an object nor a JSON string of one, or a ``<tool_call>`` never closed becomes a ``ToolCall`` with an
``error``, which the loop turns into an observation (the model learns the format from it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.S)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``error`` set (and ``name`` possibly None) when the block was malformed."""

    name: Optional[str]
    arguments: Any = field(default_factory=dict)
    error: Optional[str] = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last one as an error)."""
    calls = [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]
    tail = text[text.rfind(TOOL_CALL_END) + len(TOOL_CALL_END):] if TOOL_CALL_END in text else text
    if TOOL_CALL_START in tail:
        calls.append(ToolCall(None, error=f"a {TOOL_CALL_START} was not closed by {TOOL_CALL_END}"))
    return calls


def _parse_block(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as exc:
        return ToolCall(None, error=f"the tool call is not JSON ({exc.msg} at character {exc.pos}); write "
                                    '{"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='the tool call needs a string "name": {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error='"arguments" is a string that is not JSON; give an object')
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error=f'"arguments" is a {type(arguments).__name__}; give an object')
    return ToolCall(obj["name"], arguments)


__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "ToolCall", "parse_tool_calls"]
