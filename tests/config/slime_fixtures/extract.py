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

#: run script -> its model script (what ``source "${SCRIPT_DIR}/models/..."`` names)
RUN_SCRIPTS = (
    "scripts/run-deepseek-r1.sh", "scripts/run-kimi-k2-Instruct.sh", "scripts/run-kimi-k2-Thinking.sh",
    "scripts/run-glm4.7-355B-A32B.sh", "scripts/run-glm4.7-30B-A3B.sh", "scripts/run-glm5-744B-A40B.sh",
    "scripts/run-glm5.2-744B-A40B.sh", "scripts/run-moonlight-16B-A3B.sh", "scripts/run-qwen3-next-80B-A3B.sh",
    "scripts/run-qwen3.5-27B.sh", "scripts/run-qwen3.5-35B-A3B-sft.sh",
)
#: model scripts with no run script of their own here (the tests run them with another script's arrays)
MODEL_SCRIPTS = ("scripts/models/deepseek-v3.sh", "scripts/models/glm4.5-355B-A32B.sh",
                 "scripts/models/glm4.5-106B-A12B.sh", "scripts/models/qwen3.5-35B-A3B.sh")
PATH_VARS = ("BASE_DIR", "BASE_FOLDER")


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
    m = re.search(r"python3\s+train\w*\.py\s*\\\n(.*?)(?:\n\s*\n|\Z)", text, re.S)
    assert m, "no train.py command"
    return "".join(line.rstrip().rstrip("\\") + " " for line in m.group(1).splitlines())


def _model_script(text: str) -> str:
    m = re.search(r'source\s+"\$\{SCRIPT_DIR\}/(?:\.\./scripts/)?(models/[^"]+)"', text)
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
    for path in RUN_SCRIPTS:
        model, args = run_args(git_dir, commit, path)
        scripts[path] = {"model_script": model, "argv": args}
    for path in MODEL_SCRIPTS:
        scripts[path] = {"model_script": path, "argv": model_args(git_dir, commit, path)}
    source = {"repository": "https://github.com/THUDM/slime", "commit": commit}
    (HERE / "scripts.json").write_text(json.dumps({**source, "scripts": scripts}, indent=1) + "\n")
    (HERE / "arguments.json").write_text(json.dumps(
        {**source, "file": "slime/utils/arguments.py", "flags": argument_flags(git_dir, commit)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
