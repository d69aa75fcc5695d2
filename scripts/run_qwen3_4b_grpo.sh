#!/usr/bin/env bash
# GRPO on Qwen3-4B, one 8-GPU node: TP2 x DP4 Megatron actor colocated with SGLang engines (TP2 each).
#   HF_CKPT=/models/Qwen3-4B PROMPTS=/data/dapo-math-17k.jsonl SAVE=/ckpt/qwen3-4b-grpo \
#     bash scripts/run_qwen3_4b_grpo.sh [--dry-run] [extra flags]
# Local rank 0 launches the 4 SGLang engines on the trainer's GPUs (logs under $SAVE/run/engines/);
# weights reach them as flattened tensor buckets (docs/sglang.md). --dry-run prints the plan and engines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-4B HF directory}
PROMPTS=${PROMPTS:?set PROMPTS to a JSONL prompt file}
SAVE=${SAVE:-runs/qwen3-4b-grpo}
NPROC=${NPROC:-8}

MODEL_ARGS=(--hf-checkpoint "$HF_CKPT" --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
  --context-parallel-size 1 --actor-num-nodes 1 --actor-num-gpus-per-node "$NPROC")
BATCH_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 32768 --rollout-batch-size 64
  --n-samples-per-prompt 8 --global-batch-size 512)
OPT_ARGS=(--optimizer adam --lr 1e-6 --weight-decay 0.1 --adam-beta2 0.98 --grad-clip 1.0
  --use-distributed-optimizer --optimizer-cpu-offload --use-precision-aware-optimizer)
ROLLOUT_ARGS=(--rollout-backend sglang --colocate --rollout-num-gpus-per-engine 2
  --rollout-max-response-len 8192 --rollout-temperature 1.0 --prompt-data "$PROMPTS"
  --input-key prompt --label-key label --apply-chat-template --rm-type math --num-rollout 3000
  --sglang-mem-fraction-static 0.7)
ALGO_ARGS=(--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type k3
  --eps-clip 0.2 --eps-clip-high 0.28 --use-tis)
SYNC_ARGS=(--update-weight-transport tensor --update-weight-buffer-size $((512 * 1024 * 1024)))
CKPT_ARGS=(--save "$SAVE" --save-interval 20 --save-max-to-keep 3 --recompute-granularity full
  --wall-time-limit 7d --wall-time-reserve 10m --output-dir "$SAVE/run")

# megatron_rl.infra.launch runs torchrun and exits with the run's code (0 finished, 3 stopped early:
# relaunch to resume, 2 refused, 143/130 stopped before anything could be saved, 1 crashed); exec, so
# a signal to this script is a signal to torchrun, which forwards it and waits for the stop save.
LAUNCH=("$PY" -m megatron_rl.infra.launch --run-dir "$SAVE/run" --nproc-per-node "$NPROC")
[[ " $* " == *" --dry-run "* ]] && LAUNCH=("$PY")  # a dry run validates and prints the plan: no workers
# JOB=slurm|k8s: write a Slurm batch script or a JobSet of this run instead of starting it, with JOB_ARGS as
# its options (tools/launch_job.py, docs/launch.md); the scheduler gives each node its rank and the rendezvous
if [ -n "${JOB:-}" ]; then
  read -r -a job_args <<<"${JOB_ARGS:-}"
  LAUNCH=("$PY" tools/launch_job.py "$JOB" "${job_args[@]}")
fi
exec "${LAUNCH[@]}" -m megatron_rl.train \
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${BATCH_ARGS[@]}" "${OPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${SYNC_ARGS[@]}" "${CKPT_ARGS[@]}" "$@"
