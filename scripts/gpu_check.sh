#!/usr/bin/env bash
# What only a CUDA GPU can check: the fused kernels (CUDA, Triton) and the training paths CPU runs do not
# reach (bf16 on the device, NCCL, offload, sleep/wake, FP8, torch_memory_saver, PPO critics). One GPU.
#   bash scripts/gpu_check.sh [--dry-run] [--out DIR (default $TMPDIR/gpu_check)] [--wheels DIR]
# Six steps, each under its own time limit (at most 24 min in all); each step's status (ok, failed rc=N,
# timeout) and seconds in DIR/gpu_check.json with the kernels' and training figures, the whole output in
# DIR/gpu_check.log; exit 1 if a step failed or timed out.
#   env      (60 s)  python, torch, CUDA, triton and nvcc versions, the GPU's name
#   wheels  (180 s)  pip install --no-index of DIR/*.whl, for a machine without network (skipped without
#                    --wheels; bash scripts/gpu_wheels.sh fills gpu_wheels/ with megatron-core, torch_memory_saver)
#   build   (300 s)  the CUDA extension in place: MEGATRON_RL_BUILD_EXT=cuda setup.py build_ext --inplace
#                    (TORCH_CUDA_ARCH_LIST default 9.0); passes when it compiles
#   kernels (300 s)  benchmarks/kernel_ops.py --n 256 1024 4096: CUDA and Triton log-probs + entropy and PPO loss
#                    terms against the float64 reference first (values, gradients; fails above the bound derived
#                    from the float32 reference's own error), the self-check a run makes before trusting them
#                    (its cost in ms), then time and peak memory against torch chunked and naive log_softmax at
#                    V = 151,936
#   training (300 s) benchmarks/gpu_steps.py under torchrun, one process, a Qwen2-shaped model (vocab 151,936,
#                    hidden 1024, 8 layers): train_step (bf16 RL step vs a bare megatron-core step),
#                    optimizer_cpu_offload, sleep_wake (memory released and back; NCCL groups destroyed and
#                    rebuilt), fsdp (bf16, offloaded optimizer, fp16 loss scale, sleep/wake), fp8 (skipped with
#                    the reason unless transformer-engine imports), memory_saver (pause/resume: memory freed, the
#                    same bits after), routing_replay (Qwen3-MoE: route agreement, step time), lora (rank 16 vs
#                    full), ppo_critic (both backends). A check fails only when it raises (an impossible route
#                    agreement, LoRA grad norms not finite, ...); the rest are figures to read in the JSON.
#   speculative (300 s) scripts/spec_gpu_check.py: the embedded engine's MTP draft on the GPU (greedy identical
#                    to no draft, log-prob gap), and a launched SGLang server with --speculative-algorithm NEXTN on
#                    a tiny DeepSeek-V3 checkpoint with an MTP layer against one without (greedy identical,
#                    acceptance); the SGLang part is skipped, with the reason, where sglang does not import
# --dry-run runs every step on a CPU machine at tiny sizes (about 70 s): kernels on the C++ twins, build only
# checks that setup.py refuses a CPU torch with a clear error, gpu_steps.py --dry-run (also a CI test,
# tests/tools/test_gpu_steps.py). Not yet run on a GPU: docs/kernels.md, "GPU check". Without network there:
#   bash scripts/gpu_wheels.sh     # beforehand, where pip can download; then copy gpu_wheels/ along
#   bash scripts/gpu_check.sh --out DIR --wheels gpu_wheels
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT="${TMPDIR:-/tmp}/gpu_check"
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    --wheels) WHEELS="$2"; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --dry-run, --out DIR, --wheels DIR)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  echo "gpu_check.sh: --wheels $WHEELS is not a directory" >&2; exit 2
fi
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STEPS="$OUT/steps.tsv"
: >"$LOG"; : >"$STEPS"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# step NAME TIMEOUT_S COMMAND...: run, log, record status (ok / failed rc / timeout) and seconds
step() {
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local status=ok
  [ "$rc" -eq 124 ] && status=timeout
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && status="failed rc=$rc"
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$STEPS"
  echo "=== $name: $status in $((SECONDS - t0))s" | tee -a "$LOG"
}

step env 60 "$PY" -c "
import platform, shutil, subprocess, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
try:
    import triton; print('triton', triton.__version__)
except ImportError as e:
    print('triton: not importable:', e)
nvcc = shutil.which('nvcc') or '/usr/local/cuda/bin/nvcc'
print('nvcc', subprocess.run([nvcc, '--version'], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
      if shutil.which(nvcc) or __import__('os').path.exists(nvcc) else 'not found')
"

if [ -n "$WHEELS" ]; then
  if [ $DRY = 1 ]; then
    step wheels 60 bash -c "ls -1 '$WHEELS'/*.whl 2>/dev/null || echo 'no wheels in $WHEELS'"
  else
    step wheels 180 bash -c "'$PY' -m pip install -q --no-index --find-links '$WHEELS' '$WHEELS'/*.whl"
  fi
else
  printf 'wheels\tskipped (no --wheels)\t0\n' >>"$STEPS"
fi

if [ $DRY = 1 ]; then
  # On a CPU torch the cuda build must refuse with a clear message (exit 1), never start compiling.
  step build 60 bash -c "out=\$(MEGATRON_RL_BUILD_EXT=cuda '$PY' setup.py build_ext --inplace 2>&1); echo \"\$out\" | tail -1;
    echo \"\$out\" | grep -q 'MEGATRON_RL_BUILD_EXT=cuda: cannot build the CUDA extension'"
  step kernels 300 env MEGATRON_RL_KERNELS= "$PY" benchmarks/kernel_ops.py --n 4 --vocab 4099 --tokens 4096 \
    --repeat 1 --check-n 4 --json "$OUT/kernels.json"
else
  step build 300 env CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    MAX_JOBS=16 MEGATRON_RL_BUILD_EXT=cuda "$PY" setup.py build_ext --inplace
  step kernels 300 "$PY" benchmarks/kernel_ops.py --n 256 1024 4096 --json "$OUT/kernels.json"
fi

if [ $DRY = 1 ]; then
  step training 300 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port "$((20000 + RANDOM % 12000))" \
    benchmarks/gpu_steps.py --dry-run --json "$OUT/gpu_steps.json"
else
  step training 300 "$PY" -m torch.distributed.run --nproc-per-node 1 --master-port "$((20000 + RANDOM % 12000))" \
    benchmarks/gpu_steps.py --json "$OUT/gpu_steps.json"
fi

if [ $DRY = 1 ]; then
  step speculative 300 "$PY" scripts/spec_gpu_check.py --dry-run --json "$OUT/speculative.json"
else
  step speculative 300 "$PY" scripts/spec_gpu_check.py --json "$OUT/speculative.json"
fi

"$PY" - "$STEPS" "$OUT/gpu_check.json" "$DRY" <<'PYEOF'
import json, os, sys
steps_tsv, out, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
steps = {}
for line in open(steps_tsv):
    name, status, seconds = line.rstrip("\n").split("\t")
    steps[name] = {"status": status, "seconds": int(seconds)}
def read(name):
    path = os.path.join(os.path.dirname(out), name)
    return json.load(open(path)) if os.path.exists(path) else None
result = {"dry_run": dry, "steps": steps, "kernels": read("kernels.json"), "training": read("gpu_steps.json"),
          "speculative": read("speculative.json")}
json.dump(result, open(out, "w"), indent=1)
print("wrote", out, {k: v["status"] for k, v in steps.items()})
PYEOF
# exit status: 1 if a step failed or timed out
! grep -qP '\t(failed|timeout)' "$STEPS"
