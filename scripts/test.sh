#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, multi-rank cases included.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh || exit 1
# the layers contract (pyproject.toml [tool.importlinter], docs/architecture.md) before any test
out=$(.venv/bin/lint-imports --no-cache 2>&1) || { echo "$out"; echo "lint-imports: a layer contract is broken" >&2; exit 1; }
echo "$out" | grep -E "^Contracts:"
# lint ([tool.ruff] in pyproject.toml): pyflakes, pycodestyle's errors, bugbear, over the whole tree
out=$(.venv/bin/ruff check --no-cache . 2>&1) || { echo "$out"; echo "ruff: lint errors (see above)" >&2; exit 1; }
echo "ruff: $out"
# types ([tool.mypy] in pyproject.toml, the package): ~1 min cold on 2 cores, seconds with its cache
out=$(.venv/bin/mypy 2>&1) || { echo "$out"; echo "mypy: type errors (see above)" >&2; exit 1; }
echo "mypy: ${out##*$'\n'}"  # its verdict line (notes on unchecked bodies above it are not findings)
# Two workers, one test file each at a time (module fixtures run once; a file's tests keep their order), the
# files of a launch group together (tests/_launches.py). Alone the suite keeps 1.3 of 2 cores busy (ranks
# waiting on each other); two at once keep 1.8 busy. MEGATRON_RL_TEST_WORKERS=0 runs it in one process; N>0
# on N workers. Tiers: add -m unit for the in-process tests alone (docs/getting-started.md).
workers=${MEGATRON_RL_TEST_WORKERS:-2}
# --no-loadscope-reorder: files in collection order, longest first by tests/durations.json (tests/_tiers.py)
par=(); [ "$workers" != 0 ] && par=(-n "$workers" --dist loadfile --no-loadscope-reorder)
# -m "not extended": the measured variants beyond the budget run in scripts/test_extended.sh (a later -m in "$@" wins)
.venv/bin/python -m pytest -q "${par[@]}" --durations=30 -m "not extended" tests "$@"  # the slowest 30 and the time by tier in every log: the suite has a 25-min budget
rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
