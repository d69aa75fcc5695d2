"""The layering rules that import-linter cannot see (its contracts: pyproject.toml, docs/architecture.md).

A function-local import of our own modules hides an edge from a reader: allowed only where
the target is heavy or optional, with the reason on the line (``# lazy: <reason>``) or on a
comment line right above a block of such imports.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rl"


def _own_local_imports():
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("megatron_rl"))
                       or isinstance(node, ast.Import) and any(a.name.startswith("megatron_rl") for a in node.names))
                if own:
                    text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                    yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno}", text + _block_comment(lines, node.lineno)


def _block_comment(lines, lineno):
    """The comment line heading the run of import lines that ``lineno`` (1-based) belongs to, if any."""
    i = lineno - 2
    while i >= 0:
        line = lines[i].strip()
        if line.startswith("#"):
            return " " + line
        if not (line.startswith(("from ", "import ")) or line.endswith((",", "(")) or line.startswith(")")
                or (line and line[0].isidentifier() and line.endswith((",", ")")))):
            return ""
        i -= 1
    return ""


def test_function_local_imports_of_our_modules_say_why():
    unexplained = [f"{where}: {text.strip()}" for where, text in _own_local_imports() if "# lazy:" not in text]
    assert not unexplained, ("move these imports to the module top, or mark a heavy/optional one "
                             "'# lazy: <reason>':\n" + "\n".join(unexplained))


def test_the_contract_runs_in_ci():
    test_sh = (PACKAGE.parent / "scripts" / "test.sh").read_text()
    assert "lint-imports" in test_sh
