#!/usr/bin/env bash
# The README's main command: set up .venv, then run the CPU RL demo
# (GRPO on a tiny model, real megatron-core on 2 gloo ranks, 300 rollouts by default; 1.5-2 min on
# 2 cores once .venv exists: docs/benchmarks.md, "Training step (CPU demo)").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
PY=.venv/bin/python exec bash scripts/run_demo_cpu.sh "$@"  # exec: a signal to this script reaches the run
