#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, multi-rank cases included.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh || exit 1
# the layers contract (pyproject.toml [tool.importlinter], docs/architecture.md) before any test
out=$(.venv/bin/lint-imports --no-cache 2>&1) || { echo "$out"; echo "lint-imports: a layer contract is broken" >&2; exit 1; }
echo "$out" | grep -E "^Contracts:"
.venv/bin/python -m pytest -q --durations=30 tests "$@"  # the slowest 30 in every log: the suite has a 25-min budget
rc=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
