#!/usr/bin/env bash
# Our SGLang client/engine against REAL SGLang 0.5.23 on a CPU-only machine, not part
# of scripts/test.sh (too heavy: ~7 GB to install once, then 2-7 min a run; docs/sglang-cpu.md).
#   bash scripts/test_sglang_real.sh [--out DIR] [--skip-e2e] [--num-rollout N] ...
#   bash scripts/test_sglang_real.sh --launcher [--out DIR] [--skip-kill]   (the loop launching SGLang itself)
#   bash scripts/test_sglang_real.sh --record-replies [--out FILE]   (refresh the stand-in's fixture, ~2 min)
#   bash scripts/test_sglang_real.sh --routes [--out DIR]   (MoE routes of --enable-return-routed-experts, ~2 min)
#   bash scripts/test_sglang_real.sh --lora [--out DIR]   (--lora-sync adapter: PEFT adapters served by SGLang, ~1 min)
#   bash scripts/test_sglang_real.sh --vlm [--out DIR]   (a tiny Qwen2.5-VL: /generate with image_data, ~3-7 min)
# 1. installs SGLang into its own venv (SGLANG_VENV, default /work/sglang-venv; skipped when there);
# 2. runs tools/sglang_cpu/check_real_sglang.py with the project's .venv: it starts
#    `sglang.launch_server` from the SGLang venv on 127.0.0.1 (the CPU route of docs/sglang-cpu.md),
#    checks generate/log-probs, disk, tensor and distributed (gloo) weight updates and the control
#    endpoints through megatron_rl's SGLangEngine/SGLangClient/DistributedSynchronizer, then runs
#    `python -m megatron_rl.train` against it once per transport (--e2e-transports disk distributed
#    distributed-pp2: the last on 2 torchrun ranks with 2 pipeline stages).
# Writes figures.json, check.log, server.log under --out (default /tmp/sglang_real).
# --record-replies: tools/sglang_cpu/record_replies.py starts the same server, sends its fixed list of
#    requests (every endpoint megatron_rl calls, success and error statuses) and writes each reply's
#    status, shape and message to tests/rollout/fixtures/sglang_0.5.23_replies.json (commit it), which
#    tests/rollout/test_standin_replies.py holds the CI stand-in to.
# Exit: 0 all checks passed, 1 a check failed, 2 the server could not be started or set up.
set -euo pipefail
cd "$(dirname "$0")/.."
export SGLANG_VENV=${SGLANG_VENV:-/work/sglang-venv}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "error: $PY missing; run scripts/setup_cpu.sh first" >&2; exit 2; }
bash scripts/sglang_cpu_install.sh || { echo "error: installing SGLang into $SGLANG_VENV failed" >&2; exit 2; }
if [ "${1:-}" = "--launcher" ]; then
  # tools/sglang_cpu/check_launcher_real.py: python -m megatron_rl.train starts the engine itself
  # (--rollout-engine-python = the SGLang venv), trains 3 steps, then a run whose engine is killed
  # must stop with exit 2 naming the engine's log (~4 min)
  shift
  exec "$PY" tools/sglang_cpu/check_launcher_real.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
fi
if [ "${1:-}" = "--routes" ]; then
  # tools/sglang_cpu/check_routes_real.py: a tiny Qwen3-MoE served with --enable-return-routed-experts; the
  # routes each sample carries (SGLangEngine with a RouteLayout, as --use-rollout-routing-replay) equal one HF
  # forward's experts for every prompt and response token, with the radix cache and after a weight update
  shift
  exec "$PY" tools/sglang_cpu/check_routes_real.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
fi
if [ "${1:-}" = "--lora" ]; then
  # tools/sglang_cpu/check_lora_real.py: --lora-sync adapter through the disk transport into SGLang started with the
  # launcher's LoRA flags; each version's greedy generations equal HF PEFT's, adapter-only syncs, SGLang's replies
  shift
  exec "$PY" tools/sglang_cpu/check_lora_real.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
fi
if [ "${1:-}" = "--vlm" ]; then
  # tools/sglang_cpu/check_vlm_real.py: a tiny random Qwen2.5-VL (14-pixel patches) served with image_data in
  # /generate; greedy generations with images equal the embedded engine's, before and after disk weight updates
  # of every tensor and of the language model alone (--freeze-vision-tower's later syncs)
  shift
  exec "$PY" tools/sglang_cpu/check_vlm_real.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
fi
if [ "${1:-}" = "--record-replies" ]; then
  shift
  exec "$PY" tools/sglang_cpu/record_replies.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
fi
exec "$PY" tools/sglang_cpu/check_real_sglang.py --sglang-python "$SGLANG_VENV/bin/python" "$@"
