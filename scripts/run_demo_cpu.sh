#!/usr/bin/env bash
# The CPU RL demo: GRPO post-trains a tiny random-init Qwen2-architecture model on a
# verifiable task ("add one to each digit") with real megatron-core on 2 gloo ranks
# and the embedded rollout engine. Writes metrics, checkpoints and curves to $OUT.
# Re-running the same command resumes from the newest checkpoint.
#   NUM_ROLLOUT=300 OUT=runs/demo bash scripts/run_demo_cpu.sh [extra flags]   (both the defaults)
# A Slurm or Kubernetes job of the same run: JOB=slurm|k8s JOB_ARGS="..." (tools/launch_job.py, docs/launch.md).
# Asynchronous RL: add --async-mode one-step, or --async-mode full [--partial-rollout
# [--pause-generation-mode in_place]]; the embedded
# engine then runs in a process of its own (--embedded-engine-ranks process) beside the trainer ranks,
# synced from disk under $OUT/engine_weights (docs/async.md).
# An MoE policy: DEMO_FAMILY=qwen3_moe (8 experts, top-2) or DEMO_FAMILY=deepseek_v3 (MLA, shared expert,
# sigmoid router) or DEMO_FAMILY=qwen3_next (a gated delta-net layer, gated attention, a gated shared expert),
# e.g. with --expert-model-parallel-size 2 --use-routing-replay (docs/algorithms.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
NPROC=${NPROC:-2}
NUM_ROLLOUT=${NUM_ROLLOUT:-300}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PY" -m megatron_rl.data.synthetic --out "$OUT" --family "${DEMO_FAMILY:-qwen2}"
# exec: this script's process becomes torchrun (megatron_rl.infra.launch), so SIGTERM/Ctrl-C to it,
# to its process group or to torchrun all stop the run the same way: the workers finish the step,
# save, and this exits 3. Exit codes: 0 finished, 3 stopped early (relaunch to resume), 2 refused
# (one "error:" line), 143/130 stopped before anything could be saved, 1 crashed.
# The master port: MASTER_PORT, or a random one below the kernel's ephemeral range (32768-), which
# outgoing connections never take.
LAUNCH=("$PY" -m megatron_rl.infra.launch --run-dir "$OUT" --nproc-per-node "$NPROC" --nnodes 1
  --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-$(( 20000 + RANDOM % 12000 ))}")
# JOB=slurm|k8s: write a scheduler job of this run instead of starting it (tools/launch_job.py, docs/launch.md),
# with JOB_ARGS as its options, e.g. JOB=slurm JOB_ARGS="--time 30 --gpus-per-node 0 --out demo.sbatch"
if [ -n "${JOB:-}" ]; then
  read -r -a job_args <<<"${JOB_ARGS:-}"
  LAUNCH=("$PY" tools/launch_job.py "$JOB" --env "OMP_NUM_THREADS=$OMP_NUM_THREADS" "${job_args[@]}")
fi
exec "${LAUNCH[@]}" -m megatron_rl.train \
  --hf-checkpoint "$OUT/model" \
  --actor-num-gpus-per-node "$NPROC" \
  --prompt-data "$OUT/prompts.jsonl" --input-key prompt --label-key label --rollout-shuffle \
  --eval-prompt-data "$OUT/eval.jsonl" --eval-interval 20 \
  --custom-rm-path megatron_rl.data.synthetic:digit_reward \
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 32 --n-samples-per-prompt 8 \
  --rollout-max-response-len 6 --rollout-temperature 1.0 \
  --global-batch-size 128 --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
  --advantage-estimator grpo --eps-clip 0.2 --use-kl-loss --kl-loss-coef 0.05 --kl-loss-type k3 \
  --optimizer adam --lr 1e-3 --adam-beta2 0.999 --grad-clip 1.0 \
  --save "$OUT/ckpt" --save-interval 50 --save-max-to-keep 2 \
  --output-dir "$OUT" --tensorboard-dir "$OUT/tb" \
  --check-weight-update-equal \
  "$@"
