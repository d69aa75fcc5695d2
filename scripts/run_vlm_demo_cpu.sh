#!/usr/bin/env bash
# The vision-language CPU demo: GRPO on a tiny random Qwen2.5-VL that must count the colored squares in a 16 x 16
# picture (megatron_rl/data/vlm_demo.py: the answer is only in the image). One process: the megatron backend trains
# on the images, the embedded engine generates with them (docs/vlm.md).
#   bash scripts/run_vlm_demo_cpu.sh [extra flags, e.g. --dry-run]
# Env: PY (python), OUT (run dir, default runs/vlm_demo), NUM_ROLLOUT (default 80).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/vlm_demo}
NUM_ROLLOUT=${NUM_ROLLOUT:-80}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PY" -m megatron_rl.data.vlm_demo --out "$OUT"
exec "$PY" -m megatron_rl.train \
  --hf-checkpoint "$OUT/model" --actor-num-gpus-per-node 1 --rollout-backend embedded \
  --prompt-data "$OUT/prompts.jsonl" --input-key prompt --label-key label --rollout-shuffle \
  --multimodal-keys '{"image": "images"}' \
  --custom-rm-path megatron_rl.data.synthetic:digit_reward \
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --rollout-max-response-len 2 --rollout-temperature 1.0 \
  --global-batch-size 128 --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --advantage-estimator grpo --eps-clip 0.2 \
  --optimizer adam --lr 1e-3 --adam-beta2 0.999 --grad-clip 1.0 \
  --output-dir "$OUT" --tensorboard-dir "$OUT/tb" \
  "$@"
