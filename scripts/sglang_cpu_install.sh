#!/usr/bin/env bash
# Installs real SGLang 0.5.23 into its own venv for running it on a CPU-only machine, the route
# of docs/sglang-cpu.md (about 7 GB; 2-5 min with torch from a local package index on 2 cores). Used by
# scripts/test_sglang_real.sh; the project's own venv (.venv, torch 2.13 CPU) is not touched,
# because SGLang needs torch 2.14.1 + torchvision 0.29.1 (torchvision 0.28's extension does not
# load and sglang imports torchvision at start-up).
#   SGLANG_VENV=/work/sglang-venv bash scripts/sglang_cpu_install.sh
# Idempotent: when the venv already imports sglang 0.5.23 with torch 2.14.1 it does nothing.
set -euo pipefail
VENV=${SGLANG_VENV:-/work/sglang-venv}
PYTHON=${SGLANG_BASE_PYTHON:-python3.11}
SGLANG_VERSION=0.5.23
T0=$(date +%s)
say() { echo "[sglang-install +$(( $(date +%s) - T0 ))s] $*"; }

installed() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$SGLANG_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
ok = (version("sglang") == sys.argv[1] and version("torch").startswith("2.14.1")
      and version("torchvision").startswith("0.29.1") and version("transformers") == "5.19.0")
import fastapi, uvicorn, zmq, xgrammar, pybase64, orjson  # noqa: F401  (the server's hard imports)
sys.exit(0 if ok else 1)
EOF
}

if installed; then
  say "already installed in $VENV (sglang $SGLANG_VERSION, torch 2.14.1): nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

# torch 2.14.1 (the CUDA build; it runs on CPU) and torchvision 0.29.1, with torch's nvidia-* wheels,
# from pip's configured index (several GB: a local index or a cache makes this step fast).
say "installing torch==2.14.1 torchvision==0.29.1"
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1

# --no-deps: sglang's pinned deps pull CUDA-only wheels (flashinfer cu13, cutlass-dsl, deep-ep,
# tilelang, sglang-kernel) that cannot install or load here.
say "installing sglang==$SGLANG_VERSION --no-deps"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

# The dependencies with which the server starts and serves over HTTP (docs/sglang-cpu.md).
say "installing sglang's CPU-safe dependencies"
"${PIP[@]}" \
  "transformers==5.19.0" "tokenizers==0.23.2" safetensors aiohttp fastapi "uvicorn>=0.51" uvloop \
  "pyzmq>=25.1.2" msgspec orjson pybase64 psutil setproctitle requests numpy scipy pillow \
  "sentencepiece==0.2.1" tiktoken pydantic python-multipart partial_json_parser interegular einops \
  prometheus-client packaging tqdm xxhash zstandard watchfiles "openai==2.8.0" "openai-harmony==0.0.4" \
  anthropic "python-dateutil<3" distro easydict "blobfile==3.0.0" setuptools "xgrammar==0.2.7" \
  "llguidance>=1.7.6,<2" ninja IPython datasets gguf "compressed-tensors==0.18.0" "numba==0.65.1" \
  "timm==1.0.25" "mistral_common>=1.11.5" modelscope "apache-tvm-ffi==0.1.11" "soundfile==0.13.1" \
  "torch==2.14.1" "torchvision==0.29.1"

if installed; then
  say "done: $VENV ($(du -sh "$VENV" | cut -f1)) in $(( $(date +%s) - T0 )) s"
else
  say "FAILED: $VENV does not import sglang $SGLANG_VERSION with torch 2.14.1 after install" >&2
  exit 1
fi
