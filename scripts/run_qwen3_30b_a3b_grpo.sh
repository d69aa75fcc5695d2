#!/usr/bin/env bash
# GRPO on Qwen3-30B-A3B (MoE, 128 experts), multi-node: each node runs this script with
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node0 host> MASTER_PORT=29500 \
#   HF_CKPT=/models/Qwen3-30B-A3B PROMPTS=/data/prompts.jsonl SAVE=/ckpt/q30b \
#   ROLLOUT_URLS="http://10.0.0.5:30000 http://10.0.0.6:30000" \
#     bash scripts/run_qwen3_30b_a3b_grpo.sh [--dry-run] [extra flags]
# Actor: 4 nodes x 8 GPUs, TP4 x PP2 x EP8 (expert TP 1), CP1; SGLang engines on 2 more nodes. This
# torchrun job owns only the actor's nodes, so it cannot launch engines there: start one server per
# rollout node yourself (python -m sglang.launch_server --model-path $HF_CKPT --tp-size 8
# --mem-fraction-static 0.8 --enable-ep-moe --host 0.0.0.0 --port 30000) and give their URLs;
# weights reach them by NCCL broadcast (--update-weight-transport distributed; docs/sglang.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
HF_CKPT=${HF_CKPT:?set HF_CKPT to the Qwen3-30B-A3B HF directory}
PROMPTS=${PROMPTS:?set PROMPTS to a JSONL prompt file}
SAVE=${SAVE:-runs/qwen3-30b-a3b-grpo}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
read -r -a ROLLOUT <<<"${ROLLOUT_URLS:?set ROLLOUT_URLS to the SGLang server URLs of the rollout nodes, space separated}"

# megatron_rl.infra.launch runs torchrun and exits with the run's code (0 finished, 3 stopped early:
# relaunch to resume, 2 refused, 143/130 stopped before anything could be saved, 1 crashed); exec, so
# a signal to this script is a signal to torchrun, which forwards it and waits for the stop save.
LAUNCH=("$PY" -m megatron_rl.infra.launch --run-dir "$SAVE/run" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
[[ " $* " == *" --dry-run "* ]] && LAUNCH=("$PY")  # a dry run validates and prints the plan: no workers
# JOB=slurm|k8s: write a Slurm batch script or a JobSet of this run instead of starting it, with JOB_ARGS as
# its options (tools/launch_job.py, docs/launch.md); the scheduler gives each node its rank and the rendezvous
if [ -n "${JOB:-}" ]; then
  read -r -a job_args <<<"${JOB_ARGS:-}"
  LAUNCH=("$PY" tools/launch_job.py "$JOB" "${job_args[@]}")
fi
exec "${LAUNCH[@]}" -m megatron_rl.train \
  --hf-checkpoint "$HF_CKPT" --bf16 \
  --actor-num-nodes "$NNODES" --actor-num-gpus-per-node "$GPUS_PER_NODE" \
  --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 16384 \
  --rollout-batch-size 128 --n-samples-per-prompt 8 --global-batch-size 1024 \
  --optimizer adam --lr 1e-6 --weight-decay 0.1 --grad-clip 1.0 --use-distributed-optimizer \
  --recompute-granularity full \
  --rollout-backend sglang --rollout-engine-urls "${ROLLOUT[@]}" \
  --rollout-max-response-len 16384 --prompt-data "$PROMPTS" --apply-chat-template --rm-type math \
  --num-rollout 2000 \
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-tis \
  --update-weight-transport distributed --update-weight-buffer-size $((1024 * 1024 * 1024)) \
  --save "$SAVE" --save-interval 10 --save-max-to-keep 2 --wall-time-limit 7d --wall-time-reserve 1h \
  --output-dir "$SAVE/run" "$@"
