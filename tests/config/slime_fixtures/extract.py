"""Regenerate the slime fixtures of this folder from a checkout of THUDM/slime (run by hand, not by pytest).

    python tests/config/slime_fixtures/extract.py SLIME_GIT_DIR [COMMIT]

Writes ``scripts.json`` (each launch script's ``train.py`` argv, as bash would expand it) and
``arguments.json`` (every flag ``slime/utils/arguments.py`` declares). The scripts are not run: only
their bash array and variable definitions and the ``train.py`` command line are evaluated, by bash,
with the paths' variables left as ``$BASE_DIR`` etc. (the tests point them at local directories).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PATH_VARS = ("BASE_DIR", "BASE_FOLDER")


def _scripts(git_dir: str, commit: str) -> tuple[list[str], list[str]]:
    """(every ``run-*.sh`` under scripts/, every ``scripts/models/*.sh``)."""
    names = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", commit, "scripts/"], check=True,
                           capture_output=True, text=True).stdout.split()
    run = [n for n in names if n.endswith(".sh") and n.split("/")[-1].startswith("run-")]
    return run, [n for n in names if n.startswith("scripts/models/") and n.endswith(".sh")]


def _show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _definitions(text: str) -> str:
    """The script's array definitions ``NAME=( ... )`` and plain variable assignments (no command
    substitution: nothing is executed but arithmetic and expansion)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^\s*[A-Za-z_][A-Za-z0-9_]*=\($", line.rstrip()) or re.match(r"^\s*[A-Za-z_]\w*=\(\s*#", line):
            block = [line]
            while not lines[i].strip().startswith(")"):
                i += 1
                block.append(lines[i])
            out += block
        elif (re.match(r"^\s*[A-Za-z_]\w*=", line) and not re.search(r"\$\((?!\()|`", line)
              and line.count('"') % 2 == 0):  # (a multi-line string, e.g. RUNTIME_ENV_JSON, is not an argument)
            out.append(line)
        i += 1
    return "\n".join(out)


def _command(text: str) -> str:
    """The ``python3 train*.py`` command's arguments (its continued lines)."""
    m = re.search(r"python3\s+\S*train\w*\.py\s*\\\n(.*?)(?:\n\s*\n|\Z)", text, re.S)
    assert m, "no train.py command"
    return "".join(line.rstrip().rstrip("\\") + " " for line in m.group(1).splitlines())


def _model_script(text: str) -> str:
    m = re.search(r'source\s+"\$\{SCRIPT_DIR\}/(?:\.\./)?(?:scripts/)?(models/[^"]+)"', text)
    assert m, "no models/*.sh sourced"
    return "scripts/" + m.group(1)


def _expand(program: str) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", **{v: "$" + v for v in PATH_VARS}}
    out = subprocess.run(["bash", "-c", program], check=True, capture_output=True, text=True, env=env).stdout
    return out.split("\0")[:-1]


def model_args(git_dir: str, commit: str, path: str) -> list[str]:
    return _expand(_show(git_dir, commit, path) + "\nprintf '%s\\0' \"${MODEL_ARGS[@]}\"\n")


def run_args(git_dir: str, commit: str, path: str) -> tuple[str, list[str]]:
    text = _show(git_dir, commit, path)
    model = _model_script(text)
    program = (_show(git_dir, commit, model) + "\n" + _definitions(text) + "\nprintf '%s\\0' " + _command(text))
    return model, _expand(program)


def argument_flags(git_dir: str, commit: str) -> list[str]:
    tree = ast.parse(_show(git_dir, commit, "slime/utils/arguments.py"))
    flags = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
    return sorted(set(flags))


def main(argv: list[str]) -> int:
    git_dir = argv[0]
    commit = argv[1] if len(argv) > 1 else subprocess.run(
        ["git", "-C", git_dir, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    scripts: dict[str, dict] = {}
    run_scripts, model_scripts = _scripts(git_dir, commit)
    for path in run_scripts:
        model, args = run_args(git_dir, commit, path)
        scripts[path] = {"model_script": model, "argv": args}
    for path in model_scripts:  # each MODEL_ARGS alone (the tests compare them with the published configs)
        scripts[path] = {"model_script": path, "argv": model_args(git_dir, commit, path)}
    source = {"repository": "https://github.com/THUDM/slime", "commit": commit}
    lines = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in scripts.items())
    head = json.dumps(source)[:-1]  # one script per line: a diff against a newer slime reads per script
    (HERE / "scripts.json").write_text(f'{head}, "scripts": {{\n{lines}\n}}}}\n')
    (HERE / "arguments.json").write_text(json.dumps(
        {**source, "file": "slime/utils/arguments.py", "flags": argument_flags(git_dir, commit)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
