#!/usr/bin/env bash
# The README's main command: set up, then run the main job.
# (Until the CPU RL demo lands this checks a real placement plan and the environment.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
.venv/bin/python tools/check_env.py
.venv/bin/python tools/check_plan.py 'sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)' --n-nodes 4 --n-gpus-per-node 8
