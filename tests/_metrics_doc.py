"""docs/metrics.md's table "Which keys each mode logs", read as data, and a run's records checked against it.

Why a check in the runs, not a list in a test: the table is what users read, and the runs of each
``--async-mode`` are what the product logs; the end-to-end tests that already run a mode call
``check_mode_keys`` on their ``metrics.jsonl``, so a key logged by one mode and not documented for it (or
documented for every step and missing) fails there, naming the key and the mode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SECTION = "## Which keys each mode logs"
MODES = ("off", "one-step", "full")
COVERED = ("rollout/", "reward/", "perf/")  # the prefixes the table speaks for
EVERY_STEP = "every step"


@dataclass(frozen=True)
class KeyRow:
    """One row of the table: its keys (``<name>`` matches any name), the modes that log them, and when."""

    keys: tuple[str, ...]
    modes: frozenset[str]
    when: str

    @property
    def every_step(self) -> bool:
        return self.when == EVERY_STEP

    def matches(self, key: str) -> bool:
        return any(re.fullmatch(re.sub(r"<\w+>", ".+", re.escape(k)), key) for k in self.keys)


def documented_rows(text: str | None = None) -> list[KeyRow]:
    """The table's rows, each checked for shape (keys in backticks, modes among ``MODES``)."""
    text = DOC.read_text() if text is None else text
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---") or line.startswith("| Keys |"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"{DOC}: a row of {SECTION!r} has {len(cells)} cells: {line}"
        keys = tuple(re.findall(r"`([^`]+)`", cells[0]))
        modes = frozenset(m.strip() for m in cells[1].split(","))
        assert keys and all(k.startswith(COVERED) for k in keys), f"{DOC}: keys outside {COVERED}: {line}"
        assert modes <= set(MODES), f"{DOC}: modes {sorted(modes - set(MODES))} are not --async-mode values: {line}"
        rows.append(KeyRow(keys, modes, cells[2]))
    assert rows, f"{DOC}: {SECTION!r} has no table rows"
    return rows


def trained_records(records: Iterable[dict]) -> list[dict]:
    """The records of trained steps (the start-up record of each launch trains nothing)."""
    return [r for r in records if "rollout/reward_mean" in r]


def check_mode_keys(records: Iterable[dict], mode: str, *, present: Iterable[str] = ()) -> set[str]:
    """Every trained step's record of a run in ``--async-mode mode`` against the table: each ``rollout/``,
    ``reward/`` or ``perf/`` key it logs is documented for ``mode``, and every key documented for every step
    of ``mode`` is there. ``present``: conditional keys whose condition the run meets, required in every
    trained record too. Returns the covered keys the run logged."""
    assert mode in MODES, mode
    rows = [row for row in documented_rows() if mode in row.modes]
    required = {k for row in rows if row.every_step for k in row.keys} | set(present)
    steps = trained_records(records)
    assert steps, "the run logged no trained step"
    logged: set[str] = set()
    for record in steps:
        covered = {k for k in record if k.startswith(COVERED)}
        undocumented = sorted(k for k in covered if not any(row.matches(k) for row in rows))
        assert not undocumented, (f"step {record.get('step')} of an --async-mode {mode} run logs {undocumented}, "
                                  f"which {DOC.name}'s table {SECTION!r} does not list for {mode}: add them")
        missing = sorted(required - covered)
        assert not missing, (f"step {record.get('step')} of an --async-mode {mode} run lacks {missing}, which "
                             f"{DOC.name}'s table {SECTION!r} lists for every step of {mode}")
        logged |= covered
    return logged
