#!/usr/bin/env bash
# Fill gpu_wheels/ (git-ignored) with the Python packages scripts/gpu_check.sh needs beyond a GPU
# machine's CUDA torch, for a GPU machine without network: copy the folder there and run
# scripts/gpu_check.sh --wheels gpu_wheels. The wheels are for CPython 3.12 on x86-64 Linux (edit
# --python-version below for another Python): megatron-core, pinned to the version the compat layer
# is written for (megatron_rl/compat/patches.py, 0.16.x), and torch_memory_saver.
#   bash scripts/gpu_wheels.sh [DIR (default gpu_wheels)]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu_wheels}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$DIR" "megatron-core==0.16.1"
# torch_memory_saver for benchmarks/gpu_steps.py's memory_saver check (one abi3 wheel with its CUDA 12 and 13
# hooks; no dependencies)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$DIR" "torch-memory-saver==0.0.10"
ls -la "$DIR"
