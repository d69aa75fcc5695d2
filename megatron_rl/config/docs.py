"""Generate docs/flags.md from the schema (``python -m megatron_rl.config.docs``), and
docs/migrating-from-slime.md from the flag tables (config/migration.py).

A unit test regenerates the text and fails when the committed file differs, so
the reference can never drift from the parser.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from .flags import PASS_THROUGH_PREFIX, _base_type
from .schema import GROUPS, flag_name, iter_fields

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


def _fmt_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    else:
        assert f.default_factory is not dataclasses.MISSING, f"config field {f.name} has neither a default nor a factory"
        value = f.default_factory()
    return "`" + repr(value) + "`" if value not in (None, [], {}) else "unset"


def render() -> str:
    lines = [
        "# Flags",
        "",
        "Generated from `megatron_rl/config/schema.py` by `python -m megatron_rl.config.docs`; "
        "do not edit by hand (a test fails when this file is stale).",
        "",
        "Every flag can also be given as a key of a `--config FILE.yaml` (dashes or underscores); "
        "flags on the command line win over the file. "
        f"Flags starting with `{PASS_THROUGH_PREFIX}` are passed through to SGLang unchanged "
        "(`--sglang-mem-fraction-static 0.8` -> `mem_fraction_static: '0.8'`).",
        "",
    ]
    current = None
    for group, _, f in iter_fields():
        if group != current:
            current = group
            lines += [f"## {group}", "", "| flag | type | default | help |", "|---|---|---|---|"]
        if f.name == "sglang_args":
            name = f"`{PASS_THROUGH_PREFIX}*`"
        else:
            name = ", ".join(f"`{n}`" for n in (flag_name(f), *f.metadata["aliases"]))
        base = _base_type(f)
        tname = "flag" if base is bool else ("duration" if f.metadata["type"] is not None and base is float
                                             else getattr(base, "__name__", str(base)))
        if f.metadata["choices"]:
            tname = " \\| ".join(f.metadata["choices"])
        if f.metadata.get("domain") is not None:
            tname += f" in {f.metadata['domain']}"
        help_text = f.metadata["help"].replace("|", "\\|")
        lines.append(f"| {name} | {tname} | {_fmt_default(f)} | {help_text} |")
        if f is dataclasses.fields(GROUPS[group])[-1]:
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Write docs/flags.md and docs/migrating-from-slime.md (``--check``: exit 1 if either is stale)."""
    from . import migration, verl_keys  # lazy: only the doc generator needs the peers' tables

    docs = ((DOC_PATH, render()), (migration.DOC_PATH, migration.render()), (verl_keys.DOC_PATH, verl_keys.render()))
    if argv and argv[0] == "--check":
        return 0 if all(path.exists() and path.read_text() == text for path, text in docs) else 1
    for path, text in docs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
