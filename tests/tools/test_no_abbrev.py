"""Every command-line parser refuses flag prefixes (``allow_abbrev=False``).

Why: with prefix matching ``--over`` silently means the destructive ``--overwrite`` and
``--n-gpu`` means ``--n-gpus-per-node``; a typo must be refused, not guessed. The walk is
static (AST) so a parser added later in any tool, benchmark or module is covered too.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WALKED = ("tools", "benchmarks", "megatron_rl", "scripts")


def _parser_calls():
    for top in WALKED:
        for dirpath, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                tree = ast.parse(open(path).read(), path)
                parser_classes = {"ArgumentParser"} | {
                    c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                    and any((getattr(b, "attr", None) or getattr(b, "id", None)) == "ArgumentParser" for b in c.bases)}
                for node in ast.walk(tree):
                    if not isinstance(node, ast.Call):
                        continue
                    fn = node.func
                    called = getattr(fn, "attr", None) or getattr(fn, "id", None)
                    if called in parser_classes or called == "add_parser":
                        yield os.path.relpath(path, REPO), node.lineno, node


def test_every_parser_disables_prefix_matching():
    calls = list(_parser_calls())
    assert len(calls) >= 12, "the walk found too few parsers; is the tree layout different?"
    bad = [f"{path}:{line}" for path, line, node in calls
           if not any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                      for k in node.keywords)]
    assert not bad, f"parsers that accept flag prefixes (add allow_abbrev=False): {bad}"


@pytest.mark.parametrize("argv", [
    ["hf-to-dist", "--input", "a", "--output", "b", "--over"],
    ["dist-to-hf", "--input", "a", "--output", "b", "--hf-conf", "c"],
])
def test_convert_tool_refuses_a_prefix(argv, capsys):
    import sys

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import convert_ckpt

    with pytest.raises(SystemExit) as exc:
        convert_ckpt.build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments: --" in capsys.readouterr().err
