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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_import_graph() -> dict[str, set[str]]:
    """Module -> our modules it imports when it runs: top-level and function-local imports, not the ones under
    ``if TYPE_CHECKING:`` (annotations only)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                module = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges.update(t for t in map(resolve, (t for t in targets if t.startswith("megatron_rl"))) if t and t != name)
        graph[name] = edges
    return graph


def test_no_module_imports_itself_back():
    """No circle of imports between our modules, function-local ones included: a circle means two modules are one
    job split in two, or a lower one reaching up (a registry beside the contract it lists, a helper above its
    users)."""
    graph = _runtime_import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other (directly or round a circle): {circles}"
