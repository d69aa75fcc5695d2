#!/usr/bin/env bash
# The GPU-only checks in one script, for the lent GPU machine (one H200, ~15 min of
# device time per session in all: run it once, as one `run` command, with timeout_s <= 600).
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR (default $TMPDIR/gpu_check)] [--wheels DIR]
#
# Steps (each under its own `timeout`, each recorded in DIR/gpu_check.json with its status and
# seconds; the whole log in DIR/gpu_check.log):
#   env       python / torch / CUDA / triton / nvcc versions and the GPU
#   wheels    pip install --no-index the wheels carried in --wheels DIR (the machine has no network)
#   build     the CUDA extension in place for sm_90: MEGATRON_RL_BUILD_EXT=cuda setup.py build_ext --inplace
#   kernels   benchmarks/kernel_ops.py: CUDA and Triton vs torch vs naive log_softmax, correctness against the
#             float64 reference first (values, gradients), then time and peak memory at V=151,936; it also
#             runs the kernels' self-check (ops/selfcheck.py, what a run does before trusting them) and
#             prints its cost in ms: the first time that check meets real CUDA/Triton kernels
#   training  benchmarks/gpu_steps.py under torchrun (1 process): the megatron backend's bf16 RL step vs a
#             bare megatron-core step on a Qwen-shaped model (tokens/s, ratio), --optimizer-cpu-offload (peak
#             memory, step time, grad norms vs without), sleep/wake (memory_allocated released and restored),
#             the process groups' NCCL teardown and rebuild (forced on: --offload-train-groups auto keeps it
#             off on GPUs until this has run it), the fsdp backend (bf16, --optimizer-cpu-offload peak memory, --fp16 loss scaling, sleep/wake) and
#             FP8 when transformer-engine imports (else the reason), torch_memory_saver's pause/resume of a
#             tensor and of a whole megatron backend (freed memory, same bits after), --use-routing-replay on a
#             Qwen3-MoE with full recompute (route agreement, step time vs without), --lora-rank 16 vs full
#             fine-tuning (bf16: grad norms, step time and peak memory ratios, the merged export moving only the
#             adapted projections; skipped where transformer-engine imports), --advantage-estimator ppo on both
#             backends in bf16 (the critics' values, actor + critic steps, sleep/wake with a critic).
#             Needs megatron-core for
#             the machine's Python 3.12 (and torch_memory_saver): carry them, `bash scripts/gpu_wheels.sh`
#             fills gpu_wheels/ (5.2 MB)
#
# --dry-run runs every written step on this CPU machine at tiny sizes (the kernels step with the C++
# twins instead of CUDA/Triton; build only checks that setup.py refuses a CPU torch with a clear error),
# so the script is known to start and to write its JSON before device time is spent.
# Typical device call (carry the wheels folder; copy it into an ignored folder of the repo first):
#   run(command="bash scripts/gpu_check.sh --out $OUT --wheels gpu_wheels", carry=["gpu_wheels"], timeout_s=540)
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
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
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
result = {"dry_run": dry, "steps": steps, "kernels": read("kernels.json"), "training": read("gpu_steps.json")}
json.dump(result, open(out, "w"), indent=1)
print("wrote", out, {k: v["status"] for k, v in steps.items()})
PYEOF
# exit status: 1 if a step failed or timed out
! grep -qP '\t(failed|timeout)' "$STEPS"
