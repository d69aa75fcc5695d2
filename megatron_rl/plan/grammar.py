"""Parse AReaL-compatible allocation strings into an :class:`Allocation`.

Grammar (``|`` binds tighter than ``+``; whitespace between tokens is ignored)::

    expr   := comp ('+' comp)*            separate GPU sets, demands add up
    comp   := alloc ('|' alloc)*          colocated: members share the GPUs
    alloc  := backend ['[' name ']'] ':' (dims | hybrid)
    hybrid := '('? 'attn:' dims '|' 'ffn:' dims ')'?      megatron only
    dims   := (letter int)+               each letter at most once, 1 <= int <= 2**20,
                                          int in ASCII digits [0-9] only

Inference backends (sglang, vllm) take d,t,p; training backends (megatron, fsdp)
take d,t,p,c,e; the hybrid attn section takes d,t,p,c and the ffn section
d,t,p,e. Every error is a :class:`PlanError` that quotes the input with a caret
under the offending part, so a long command line still shows *where* it broke.

A hand-written recursive-descent parser (not lark, unlike AReaL) keeps this
dependency-free and lets each failure say what was expected at that column.
"""

from __future__ import annotations

import difflib
import re

from megatron_rl.errors import PlanError
from megatron_rl.plan.allocation import (
    ATTN_DIMS, BACKENDS, DIM_NAMES, FFN_DIMS, INFERENCE_BACKENDS, INFERENCE_DIMS, MAX_SIZE,
    TRAINING_DIMS, Allocation, Component, Dims, assign_roles,
)

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_DIMS = re.compile(r"(?:[a-z][0-9]+)+\Z")
_DIMS_TOKEN = re.compile(r"[^+|()\[\]:\s]*")
_ASCII_DIGITS = frozenset("0123456789")


def parse_allocation(text: str, weight_update: str | None = None) -> Allocation:
    """Parse ``text`` (e.g. ``"sglang:d4t2+megatron:d2p2t2"``) into a validated Allocation.

    ``weight_update`` (disk/tensor/distributed/xccl) is carried on the plan because
    strings do not state it. Raises :class:`PlanError` pointing at the bad column.
    """
    if not isinstance(text, str):
        raise PlanError(f"allocation must be a string such as 'sglang:d2t4+megatron:d4', got {text!r}")
    return _Parser(text).parse(weight_update)


def point_at(text: str, start: int, end: int, message: str) -> PlanError:
    """A PlanError whose message quotes ``text`` with carets under ``[start, end)``."""
    start = max(0, min(start, len(text)))
    end = max(start + 1, min(end, len(text) + 1))
    caret = " " * start + "^" * (end - start)
    return PlanError(f"bad allocation {text!r} at column {start + 1}: {message}\n  {text}\n  {caret}")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.names: dict[str, int] = {}

    # -- helpers ------------------------------------------------------------------
    def _ws(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def _peek(self) -> str:
        self._ws()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _fail(self, start: int, end: int, message: str) -> PlanError:
        return point_at(self.text, start, end, message)

    def _expect(self, char: str, what: str):
        if self._peek() != char:
            got = self._peek() or "end of input"
            raise self._fail(self.pos, self.pos + 1, f"expected '{char}' {what}, found {got!r}")
        self.pos += 1

    # -- grammar ------------------------------------------------------------------
    def parse(self, weight_update: str | None) -> Allocation:
        if not self.text.strip():
            raise PlanError("the allocation string is empty; write e.g. sglang:d2t4+megatron:d4 "
                            "(rollout + training) or megatron:d8 (training only)")
        groups = [self._comp()]
        while self._peek() == "+":
            self.pos += 1
            groups.append(self._comp())
        ch = self._peek()
        if ch:
            if ch == ")":
                raise self._fail(self.pos, self.pos + 1,
                                 "unbalanced ')': no '(' is open here (parentheses only wrap a "
                                 "megatron hybrid layout, megatron:(attn:...|ffn:...))")
            raise self._fail(self.pos, len(self.text),
                             f"unexpected {self.text[self.pos:]!r} after a complete component; "
                             f"join components with '+' (separate GPUs) or '|' (shared GPUs)")
        try:
            return Allocation(assign_roles(groups), weight_update=weight_update, source=self.text)
        except PlanError as exc:
            raise PlanError(f"bad allocation {self.text!r}: {exc}") from None

    def _comp(self) -> list[Component]:
        members = [self._alloc()]
        while self._peek() == "|":
            self.pos += 1
            members.append(self._alloc())
        return members

    def _alloc(self) -> Component:
        self._ws()
        start = self.pos
        ch = self._peek()
        if ch in ("", "+", "|"):
            where = "at the end" if ch == "" else f"before '{ch}'"
            raise self._fail(start, start + 1,
                             f"empty component {where}: every '+' or '|' must sit between two "
                             f"components (remove the extra '{ch or self.text.rstrip()[-1:]}')")
        if ch == "(":
            raise self._fail(start, start + 1,
                             "'(' without a backend: parentheses only wrap a megatron hybrid "
                             "layout, e.g. megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)")
        m = _IDENT.match(self.text, self.pos)
        if not m:
            raise self._fail(start, start + 1,
                             f"expected a backend ({', '.join(BACKENDS)}), found {ch!r}")
        ident = m.group()
        self.pos = m.end()
        backend = ident.lower()
        if backend not in BACKENDS:
            if _BARE_DIMS.match(ident):
                raise self._fail(start, m.end(),
                                 f"'{ident}' has no backend; write sglang:{ident} (rollout) or "
                                 f"megatron:{ident} (training)")
            if backend in ("attn", "ffn"):
                raise self._fail(start, m.end(),
                                 "a hybrid MoE layout needs its backend; write "
                                 "megatron:(attn:...|ffn:...)")
            close = difflib.get_close_matches(backend, BACKENDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise self._fail(start, m.end(),
                             f"unknown backend '{ident}'{hint}; choose one of {', '.join(BACKENDS)}")
        name = None
        if self._peek() == "[":
            lb = self.pos
            self.pos += 1
            self._ws()
            nm = _IDENT.match(self.text, self.pos)
            if not nm:
                raise self._fail(lb, self.pos + 1,
                                 f"expected a component name after '[' (e.g. {backend}[actor]:...)")
            name = nm.group()
            if name in self.names:
                raise self._fail(nm.start(), nm.end(),
                                 f"component name '{name}' is already used at column "
                                 f"{self.names[name] + 1}; names must be unique")
            self.names[name] = nm.start()
            self.pos = nm.end()
            if self._peek() != "]":
                raise self._fail(lb, self.pos + 1, f"unbalanced '[': close the name with ']' "
                                                   f"({backend}[{name}]:...)")
            self.pos += 1
        if self._peek() != ":":
            got = self._peek() or "end of input"
            raise self._fail(self.pos, self.pos + 1,
                             f"expected ':' after '{self.text[start:self.pos].strip()}', found "
                             f"{got!r}; write {backend}{f'[{name}]' if name else ''}:d<N>...")
        self.pos += 1
        ffn = None
        if self._peek() == "(" or self.text.startswith("attn", self.pos):
            dims, ffn = self._hybrid(backend)
        else:
            allowed = INFERENCE_DIMS if backend in INFERENCE_BACKENDS else TRAINING_DIMS
            dims = self._dims(allowed, backend)
        end = self.pos
        try:
            return Component(backend, dims, name, ffn, span=(start, end))
        except PlanError as exc:
            raise self._fail(start, end, str(exc)) from None

    def _hybrid(self, backend: str) -> tuple[Dims, Dims]:
        open_at = self.pos if self._peek() == "(" else None
        if open_at is not None:
            self.pos += 1
        if backend != "megatron":
            raise self._fail(open_at if open_at is not None else self.pos, self.pos + 4,
                             f"the attn/ffn hybrid layout is megatron-only, not {backend}; "
                             f"write megatron:(attn:...|ffn:...)")
        sections = {}
        for i, (label, allowed) in enumerate((("attn", ATTN_DIMS), ("ffn", FFN_DIMS))):
            if i == 1:
                self._expect("|", "between the attn and ffn sections")
            self._ws()
            if not self.text.startswith(label, self.pos):
                raise self._fail(self.pos, self.pos + max(1, len(label)),
                                 f"expected '{label}:' here (hybrid form is "
                                 f"megatron:(attn:d..t..p..c..|ffn:d..t..p..e..))")
            self.pos += len(label)
            self._expect(":", f"after '{label}'")
            sections[label] = self._dims(allowed, f"{label} section")
        if open_at is not None:
            if self._peek() != ")":
                raise self._fail(open_at, self.pos + 1,
                                 "unbalanced '(': the hybrid layout opened here is never closed; "
                                 "add ')' after the ffn dims")
            self.pos += 1
        return sections["attn"], sections["ffn"]

    def _dims(self, allowed: str, owner: str) -> Dims:
        self._ws()
        start = self.pos
        match = _DIMS_TOKEN.match(self.text, self.pos)
        assert match is not None, "_DIMS_TOKEN ends in '*', so it matches at least the empty string"
        token = match.group()
        if not token:
            raise self._fail(start, start + 1,
                             f"no parallel degrees after ':'; write at least d<N>, e.g. "
                             f"{owner.split()[0]}:d1")
        values: dict[str, int] = {}
        i = 0
        while i < len(token):
            at = start + i
            letter = token[i]
            j = i + 1
            while j < len(token) and token[j] in _ASCII_DIGITS:
                j += 1
            digits = token[i + 1:j]
            if j < len(token) and token[j].isdigit():  # e.g. full-width '２': str.isdigit says yes
                raise self._fail(start + j, start + j + 1,
                                 f"{token[j]!r} is not an ASCII digit; write sizes with 0-9 only")
            if not letter.isalpha():
                raise self._fail(at, start + len(token),
                                 f"expected a degree letter ({', '.join(allowed)}) followed by a "
                                 f"number, found {token[i:]!r}")
            if letter not in DIM_NAMES:
                raise self._fail(at, at + 1,
                                 f"unknown degree letter '{letter}'; {owner} takes "
                                 f"{', '.join(f'{k} ({DIM_NAMES[k]})' for k in allowed)}")
            if letter not in allowed:
                move = {("attn section", "e"): "; move it to the ffn section",
                        ("ffn section", "c"): "; move it to the attn section"}.get((owner, letter), "")
                raise self._fail(at, j,
                                 f"{owner} does not take '{letter}' ({DIM_NAMES[letter]}); it takes "
                                 f"only {', '.join(allowed)}{move}")
            if not digits:
                raise self._fail(at, at + 1, f"'{letter}' needs a size, e.g. {letter}2")
            if letter in values:
                raise self._fail(at, j, f"'{letter}' is given twice; state each degree at most once")
            if len(digits.lstrip("0")) > len(str(MAX_SIZE)):  # before int(): 5000 digits raise there
                raise self._fail(at, start + j, f"{DIM_NAMES[letter]} size {letter}<{len(digits)} digits> is "
                                        f"too large: the planner accepts at most {MAX_SIZE} (2**20)")
            size = int(digits)
            if size > MAX_SIZE:
                raise self._fail(at, start + j, f"{DIM_NAMES[letter]} size {letter}{size} is too large: the "
                                        f"planner accepts at most {MAX_SIZE} (2**20)")
            if size < 1:
                raise self._fail(at, j,
                                 f"{DIM_NAMES[letter]} size must be a positive integer, got "
                                 f"{letter}{digits}; use {letter}1 or leave it out")
            values[letter] = size
            i = j
        self.pos = start + len(token)
        return Dims(**values)
