#!/usr/bin/env bash
# The tests marked `extended` (pyproject.toml): measured variants that the 25-min suite of scripts/test.sh leaves
# out because another of its cases covers their path (each says which). Run them before calling an issue that
# touches them resolved: ~2 min on 2 cores. Arguments go to pytest (e.g. -k fsdp).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh || exit 1
workers=${MEGATRON_RL_TEST_WORKERS:-2}
par=(); [ "$workers" != 0 ] && par=(-n "$workers" --dist loadfile)
.venv/bin/python -m pytest -q "${par[@]}" --durations=10 -m extended tests "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "no extended tests were collected" >&2; exit 1; fi
exit $rc
