"""What one sandboxed call costs (``megatron_rl/infra/sandbox.py``): milliseconds per call of a program that
does nothing, against the same interpreter started without the sandbox, and a ``--rm-type code`` batch.

Three figures, each the median of ``--calls`` calls run one after another (interleaved, so a machine that
slows down mid-run slows all of them):

* ``bare``: ``python -I -S -c pass`` as a plain subprocess (the floor: an interpreter's start);
* ``sandboxed``: ``run_python("pass")``: ``setpriv`` + ``unshare`` (four namespaces) + the sandbox's PID 1
  (an interpreter of its own) + the program's interpreter, the tmpfs mounts and the teardown;
* the overhead, their difference; and the CPU time of each (less sensitive to a busy machine than wall time);

then ``--rm-type code`` on ``--samples`` samples of 3 stdin/stdout cases each (one sandbox per case, the
cases of the batch on every core): seconds per batch and milliseconds per case.

    python benchmarks/sandbox.py [--calls 30] [--samples 16]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_rl.data.types import Sample  # noqa: E402 - after the repo is on the path
from megatron_rl.infra.sandbox import SandboxLimits, check_sandbox, run_python  # noqa: E402
from megatron_rl.rollout.code_reward import CodeReward  # noqa: E402

SOLUTION = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
LABEL = {"inputs": ["1 2\n", "40 2\n", "5 5\n"], "outputs": ["3", "42", "10"]}


def _children_cpu() -> float:
    """CPU seconds of every waited-for child so far (setpriv, unshare, the sandbox's processes: the kernel adds a
    process's own children's time to it when it reaps them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    limits = SandboxLimits()
    python = check_sandbox(limits)
    bare, boxed, bare_cpu, boxed_cpu = [], [], [], []
    for _ in range(args.calls):
        t, c = time.perf_counter(), _children_cpu()
        subprocess.run([python, "-I", "-S", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t)
        bare_cpu.append(_children_cpu() - c)
        t, c = time.perf_counter(), _children_cpu()
        result = run_python("pass", limits)
        boxed.append(time.perf_counter() - t)
        boxed_cpu.append(_children_cpu() - c)
        assert result.ok, result
    b, s = statistics.median(bare) * 1e3, statistics.median(boxed) * 1e3
    print(f"interpreter {python}, {os.cpu_count()} cores, {args.calls} calls each")
    print(f"bare python start   {b:7.1f} ms (median)")
    print(f"sandboxed call      {s:7.1f} ms (median; p90 {sorted(boxed)[int(0.9 * len(boxed))] * 1e3:.1f} ms)")
    print(f"sandbox overhead    {s - b:7.1f} ms per call")
    bc, sc = statistics.median(bare_cpu) * 1e3, statistics.median(boxed_cpu) * 1e3
    print(f"CPU per call        {bc:7.1f} ms bare, {sc:.1f} ms sandboxed (children's user + system, median)")
    samples = [Sample(group_index=i, prompt_ids=[1], response_ids=[2], response_text=SOLUTION, label=LABEL)
               for i in range(args.samples)]
    reward = CodeReward(limits)
    t = time.perf_counter()
    scores = reward(samples)
    took = time.perf_counter() - t
    assert all(r["reward"] == 1.0 for r in scores), scores
    cases = args.samples * len(LABEL["inputs"])
    print(f"--rm-type code      {took:7.2f} s for {args.samples} samples x 3 cases ({took / cases * 1e3:.0f} ms per "
          f"case, {reward.workers} at once)")


if __name__ == "__main__":
    main()
