#!/usr/bin/env bash
# The CPU agent demo: GRPO teaches a tiny Qwen2-architecture model to add two 6-digit numbers by calling
# the calculator tool (multi-turn: call, tool response, answer), rewarded only for the right final answer.
# The model is warm-started for a few seconds on the call format (megatron_rl/rollout/agent/calculator_task.py
# says why); RL then raises the tool-call rate and the reward. Real megatron-core on 2 gloo ranks, the
# embedded rollout engine and the built-in tool loop. Writes metrics, checkpoints and curves.png to $OUT.
# Re-running the same command resumes from the newest checkpoint (docs/agentic.md).
#   NUM_ROLLOUT=80 SEED=0 OUT=runs/agent_demo bash scripts/run_agent_demo_cpu.sh [extra flags]
# (~1.5 min on 2 cores: reward ~0.2 -> ~0.9, tool calls per sample ~0.3 -> 1.0; measured in docs/agentic.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/agent_demo}
NPROC=${NPROC:-2}
NUM_ROLLOUT=${NUM_ROLLOUT:-80}
WARM_START_STEPS=${WARM_START_STEPS:-400}
SEED=${SEED:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PY" -m megatron_rl.rollout.agent.calculator_task --out "$OUT" --warm-start-steps "$WARM_START_STEPS" --seed "$SEED"
# exec: this process becomes the launcher, so a signal to it stops the run as in scripts/run_demo_cpu.sh
# (exit codes: 0 finished, 3 stopped early, 2 refused, 1 crashed).
exec "$PY" -m megatron_rl.infra.launch --run-dir "$OUT" \
  --nproc-per-node "$NPROC" --nnodes 1 --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-$(( 20000 + RANDOM % 12000 ))}" -m megatron_rl.train \
  --hf-checkpoint "$OUT/model" \
  --actor-num-gpus-per-node "$NPROC" \
  --prompt-data "$OUT/prompts.jsonl" --input-key prompt --label-key label --rollout-shuffle \
  --eval-prompt-data "$OUT/eval.jsonl" --eval-interval 5 \
  --custom-generate-function-path megatron_rl.rollout.agent:generate --max-turns 3 --tool-timeout 10 \
  --custom-rm-path megatron_rl.rollout.agent.calculator_task:answer_reward \
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --rollout-max-response-len 48 --rollout-temperature 1.0 \
  --global-batch-size 128 --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --advantage-estimator grpo --eps-clip 0.2 \
  --optimizer adam --lr 1e-3 --adam-beta2 0.999 --grad-clip 1.0 \
  --save "$OUT/ckpt" --save-interval 20 --save-max-to-keep 2 \
  --output-dir "$OUT" --tensorboard-dir "$OUT/tb" \
  "$@"
