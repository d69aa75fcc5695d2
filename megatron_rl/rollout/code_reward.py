"""``--rm-type code``: the response's code run against the label's tests in the local sandbox (``infra.sandbox``).

The code is the last fenced block of the response (```` ```python ... ``` ````, or a fence without a
language); a response without one scores 0. The label (``--label-key``; a dict, or a JSON string of one) is
one of the two forms code datasets use:

* ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` (APPS, CodeContests, TACO): the code is run once
  per case with the input on stdin; the case passes when it exits 0 and its stdout equals the output, both
  compared line by line without trailing white space and trailing empty lines;
* ``{"asserts": ["assert add(1, 2) == 3", ...]}`` (MBPP, HumanEval-style): per case, the code runs as module
  ``solution``, then the statement; it passes when the statement finished and the harness printed, after it,
  a nonce the solution never saw (so a solution that exits with status 0 early passes nothing).

Every case runs in a fresh sandbox under the run's ``--sandbox-*`` limits (a case that loops or runs into a
limit fails, it does not stop the run); the cases of a batch run in parallel, one per CPU core.

The reward is the fraction of cases passed (dense: partial programs get partial credit), returned as a dict
reward ``{"reward": passed / cases, "all_passed": 0 or 1}``, so ``reward/all_passed`` is logged beside it and
``--reward-key all_passed`` trains on the all-or-nothing score (the sparse rule of DeepCoder and most code RL
recipes) instead. A label in neither form is refused naming the sample. What the sandbox does not contain is
documented there: a solution that reads the harness from its own process can still fake a pass, so the
reward is for training, not for judging adversarial code.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.infra.sandbox import SandboxLimits, check_sandbox, run_python

_BLOCK = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)

#: the assert-form harness: the solution as module ``solution``, then the case, then the nonce (read from stdin
#: before the solution runs, so the solution's source never held it)
HARNESS = """import sys, types
nonce = sys.stdin.readline().strip()
solution = types.ModuleType("solution")
sys.modules["solution"] = solution
exec(compile(open("solution.py").read(), "solution.py", "exec"), solution.__dict__)
exec(compile(open("case.py").read(), "case.py", "exec"), dict(solution.__dict__))
print(nonce)
"""


def extract_code(text: str) -> Optional[str]:
    """The last fenced code block of ``text`` whose language is Python or unnamed, or None."""
    blocks = [body for lang, body in _BLOCK.findall(text) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks else None


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in str(text).splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass(frozen=True)
class Case:
    """One test: stdin -> expected stdout, or an assert statement."""

    stdin: str = ""
    expected: Optional[str] = None
    statement: Optional[str] = None


def parse_cases(label: Any, where: str) -> list[Case]:
    """The cases of a label in either form (module docstring); a ConfigError naming ``where`` otherwise."""
    form = ('give the label as {"inputs": [stdin, ...], "outputs": [stdout, ...]} or {"asserts": '
            '["assert f(1) == 2", ...]} (a dict or a JSON string of one)')
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError:
            raise ConfigError(f"--rm-type code: the label of {where} is not JSON; {form}") from None
    if not isinstance(label, dict):
        raise ConfigError(f"--rm-type code: the label of {where} is a {type(label).__name__}; {form}")
    if "asserts" in label:
        statements = label["asserts"]
        if not isinstance(statements, list) or not statements or not all(isinstance(s, str) for s in statements):
            raise ConfigError(f"--rm-type code: the label of {where} has 'asserts' that is not a non-empty list of "
                              f"strings; {form}")
        return [Case(statement=s) for s in statements]
    inputs, outputs = label.get("inputs"), label.get("outputs")
    if (not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs)
            or not all(isinstance(v, str) for v in inputs + outputs)):
        raise ConfigError(f"--rm-type code: the label of {where} has no 'asserts' and no equally long, non-empty "
                          f"lists of strings 'inputs' and 'outputs' (keys: {', '.join(map(str, label)) or 'none'}); "
                          f"{form}")
    return [Case(stdin=i, expected=o) for i, o in zip(inputs, outputs)]


def run_case(code: str, case: Case, limits: SandboxLimits) -> bool:
    """Whether ``code`` passes ``case`` in a fresh sandbox."""
    if case.statement is None:
        result = run_python(code, limits, stdin=case.stdin.encode())
        return result.ok and _lines(result.stdout) == _lines(case.expected or "")
    nonce = secrets.token_hex(16)
    result = run_python(HARNESS, limits, files={"solution.py": code, "case.py": case.statement},
                        stdin=(nonce + "\n").encode())
    return result.ok and _lines(result.stdout)[-1:] == [nonce]


@dataclass(frozen=True)
class CodeReward:
    """The batched ``--rm-type code`` under ``limits`` (module docstring); ``workers``: cases run at once."""

    limits: SandboxLimits = SandboxLimits()
    workers: int = max(os.cpu_count() or 1, 1)
    batched = True

    def __call__(self, samples: list[Sample]) -> list[dict[str, float]]:
        work: list[tuple[int, str, Case]] = []
        counts = []
        for i, sample in enumerate(samples):
            where = f"sample {i} (group {sample.group_index})"
            if sample.label is None:
                raise ConfigError(f"--rm-type code needs a label with the tests, but {where} has none; set "
                                  "--label-key to the JSON key holding them")
            if sample.response_text is None:
                raise ConfigError("--rm-type code needs sample.response_text but it is None; give the rollout "
                                  "engine a tokenizer (an --hf-checkpoint directory with tokenizer files)")
            cases = parse_cases(sample.label, where)
            counts.append(len(cases))
            code = extract_code(sample.response_text)
            if code is not None:
                work += [(i, code, case) for case in cases]
        if work:
            check_sandbox(self.limits)  # cached: a machine without the sandbox says so once, by name
        passed = [0] * len(samples)
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="code-reward") as pool:
            for (i, _, _), ok in zip(work, pool.map(lambda w: run_case(w[1], w[2], self.limits), work)):
                passed[i] += ok
        return [{"reward": p / n, "all_passed": float(p == n)} for p, n in zip(passed, counts)]


def code_reward(sample: Sample) -> dict[str, float]:
    """One sample under the default limits (``CodeReward`` is the batched form the run uses)."""
    return CodeReward()([sample])[0]


def code_reward_from_config(cfg: Any) -> CodeReward:
    """``--rm-type code`` under the run's ``--sandbox-*`` limits, the sandbox checked on this machine now."""
    reward = CodeReward(SandboxLimits.from_config(cfg))
    check_sandbox(reward.limits)
    return reward


__all__ = ["Case", "CodeReward", "HARNESS", "code_reward", "code_reward_from_config", "extract_code",
           "parse_cases", "run_case"]
