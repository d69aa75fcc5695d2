#!/usr/bin/env bash
# The README's main command: set up .venv, then run the CPU RL demo
# (GRPO on a tiny model, real megatron-core on 2 gloo ranks; ~5-10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
PY=.venv/bin/python exec bash scripts/run_demo_cpu.sh "$@"  # exec: a signal to this script reaches the run
