#!/usr/bin/env python
"""Report what this environment can run, without running anything heavy.

    python tools/check_env.py            # human-readable report
    python tools/check_env.py --json     # one JSON object (keys below)
    python tools/check_env.py --only megatron-core,ray --timeout 10

Reports Python, platform, torch (version, CUDA build, CUDA/cuDNN/NCCL
versions), visible accelerators (count, names, memory, compute capability) and,
for every optional backend, whether it imports, its version and what it enables
or what is lost without it.

Safety: the tool itself imports only the standard library. torch and every
optional package are imported in *separate subprocesses*, each with a timeout
and run concurrently, so a package that raises on import is reported as
``broken`` and one that hangs as ``timeout``; neither crashes nor stalls the
report. Nothing is downloaded, no server or training is started, and no memory
is allocated on an accelerator beyond what querying device properties needs
(in a child process that exits at once).

JSON keys:
  ``python``       {version, implementation, executable}
  ``platform``     {system, release, machine, platform, cpu_count}
  ``torch``        {status, version, cuda_build (bool), cuda_version, hip_version,
                    cudnn_version, nccl_version, error}
  ``accelerators`` {kind: "cuda" | "rocm" | "mps" | "none", count,
                    devices: [{index, name, memory_gib, compute_capability}]}
  ``backends``     {name: {status, module, version, enables, note, error, seconds}}
                   status is one of ok | missing | broken | timeout | unrelated
                   ("unrelated": a same-named package that is not the one we
                   mean, e.g. PyPI "apex"); ``note`` says what the status means
                   for megatron_rl.
  ``exit_code``    0 unless torch itself cannot be imported (then 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MARK = "@@CHECK_ENV@@"


@dataclass(frozen=True)
class Probe:
    """One optional package: how to import it and what it means for megatron_rl."""

    name: str  # the name people know it by (PyPI distribution name)
    module: str  # what to import
    dists: tuple[str, ...]  # distribution names to read a version from if __version__ is absent
    enables: str  # what it gives megatron_rl when present
    without: str  # what happens when absent or broken
    extra: str = ""  # python run in the child after a successful import (may set out[...])


_APEX_CHECK = """
found = []
for sub in ("apex.optimizers", "apex.amp", "amp_C"):
    try:
        importlib.import_module(sub)
        found.append(sub)
    except Exception:
        pass
if found:
    out["note_extra"] = "NVIDIA apex: " + ", ".join(found)
else:
    out["status"] = "unrelated"
"""

PROBES: tuple[Probe, ...] = (
    Probe("megatron-core", "megatron.core", ("megatron-core", "megatron_core"),
          "the Megatron training backend (--train-backend megatron)",
          "--train-backend megatron unavailable; use --train-backend fsdp"),
    Probe("transformer-engine", "transformer_engine", ("transformer-engine", "transformer_engine"),
          "FP8 (--fp8-format), TE layer specs and fused THD/CP attention",
          "FP8 and TE layer specs unavailable; local spec is used"),
    Probe("apex", "apex", ("apex",),
          "NVIDIA fused optimizers / multi-tensor kernels",
          "torch optimizers and local multi-tensor fallbacks are used", extra=_APEX_CHECK),
    Probe("flash-attn", "flash_attn", ("flash-attn", "flash_attn"),
          "FlashAttention varlen kernels for packed (THD) attention",
          "attention uses TE or torch SDPA"),
    Probe("triton", "triton", ("triton",),
          "Triton kernels for fused log-prob / entropy (megatron_rl.ops)",
          "ops use the CUDA extension if built, else torch"),
    Probe("sglang", "sglang", ("sglang",),
          "the SGLang rollout engine",
          "no SGLang rollout; use the embedded engine or --debug-train-only --load-debug-rollout-data"),
    Probe("vllm", "vllm", ("vllm",),
          "vLLM rollout engines (allocation 'vllm:...')",
          "'vllm:' allocations cannot launch; use sglang or the embedded engine"),
    Probe("torch_memory_saver", "torch_memory_saver", ("torch_memory_saver", "torch-memory-saver"),
          "releasing rollout-engine GPU memory while training when colocated (--offload-rollout)",
          "colocated runs cannot pause the engine's memory; --offload-rollout unavailable"),
    Probe("ray", "ray", ("ray",),
          "Ray placement of actors across nodes",
          "placement uses torchrun only"),
    Probe("wandb", "wandb", ("wandb",),
          "Weights & Biases logging (--wandb-project)",
          "--wandb-project unavailable; use --tensorboard-dir or stdout metrics"),
    Probe("tensorboard", "tensorboard", ("tensorboard",),
          "TensorBoard logging (--tensorboard-dir)",
          "--tensorboard-dir unavailable"),
    Probe("deepspeed", "deepspeed", ("deepspeed",),
          "nothing required by megatron_rl (reported: it patches torch ops on import)",
          "nothing lost"),
    Probe("liger-kernel", "liger_kernel", ("liger-kernel", "liger_kernel"),
          "nothing used by megatron_rl yet (reported: slime/verl users' FSDP runs fuse HF modules with it)",
          "nothing lost: the fsdp backend runs the HF modules unfused, with or without it"),
    Probe("mbridge", "mbridge", ("mbridge",),
          "mbridge HF<->Megatron bridges",
          "megatron_rl.models bridges are used"),
)

_IMPORT_CHILD = """
import importlib, importlib.metadata as md, json, sys
module, dists = sys.argv[1], sys.argv[2].split(",")
out = {"status": "ok"}
try:
    m = importlib.import_module(module)
except ModuleNotFoundError as e:
    top = module.split(".")[0]
    if e.name in (module, top) or module.startswith(str(e.name) + "."):
        out = {"status": "missing"}
    else:
        out = {"status": "broken", "error": "ModuleNotFoundError: " + str(e)}
except BaseException as e:
    out = {"status": "broken", "error": type(e).__name__ + ": " + str(e)}
else:
    v = getattr(m, "__version__", None)
    if v is None:
        for d in dists:
            try:
                v = md.version(d)
                break
            except Exception:
                pass
    out["version"] = None if v is None else str(v)
    try:
        exec(sys.argv[3])
    except BaseException as e:
        out["status"] = "broken"
        out["error"] = type(e).__name__ + ": " + str(e)
print(%r + json.dumps(out), flush=True)
""" % MARK

_TORCH_CHILD = """
import json
out = {"status": "ok"}
try:
    import torch
except BaseException as e:
    out = {"status": "broken" if not isinstance(e, ModuleNotFoundError) else "missing",
           "error": type(e).__name__ + ": " + str(e)}
else:
    out["version"] = torch.__version__
    out["cuda_version"] = torch.version.cuda
    out["hip_version"] = getattr(torch.version, "hip", None)
    out["cuda_build"] = bool(torch.version.cuda or out["hip_version"])
    try:
        out["cudnn_version"] = torch.backends.cudnn.version() if out["cuda_build"] else None
    except Exception:
        out["cudnn_version"] = None
    try:
        nv = torch.cuda.nccl.version() if out["cuda_build"] else None
        out["nccl_version"] = ".".join(map(str, nv)) if isinstance(nv, tuple) else nv
    except Exception:
        out["nccl_version"] = None
    acc = {"kind": "none", "count": 0, "devices": []}
    try:
        n = torch.cuda.device_count() if out["cuda_build"] else 0
    except Exception as e:
        n = 0
        out["error"] = "device query failed: " + str(e)
    if n:
        acc["kind"] = "rocm" if out["hip_version"] else "cuda"
        acc["count"] = n
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            acc["devices"].append({"index": i, "name": p.name,
                                   "memory_gib": round(p.total_memory / 2**30, 1),
                                   "compute_capability": f"{p.major}.{p.minor}"})
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        acc = {"kind": "mps", "count": 1, "devices": [{"index": 0, "name": "Apple MPS",
               "memory_gib": None, "compute_capability": None}]}
    out["accelerators"] = acc
print(%r + json.dumps(out), flush=True)
""" % MARK


def _run_child(args: list[str], timeout: float) -> tuple[dict, float]:
    """Run ``python -c`` in its own session; kill the whole group on timeout."""
    t0 = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return ({"status": "timeout", "error": f"import did not finish within {timeout:g}s "
                 f"(raise --timeout if the package is just slow)"}, time.monotonic() - t0)
    seconds = time.monotonic() - t0
    # the mark need not start a line: a package may print without a trailing newline on import
    at = stdout.rfind(MARK)
    if at >= 0:
        try:
            return json.loads(stdout[at + len(MARK):].splitlines()[0]), seconds
        except (ValueError, IndexError):
            pass
    tail = (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {"status": "broken", "error": f"import process died: {tail}"}, seconds


def _probe_backend(probe: Probe, timeout: float) -> dict:
    res, seconds = _run_child([_IMPORT_CHILD, probe.module, ",".join(probe.dists), probe.extra], timeout)
    status = res["status"]
    if status == "ok":
        note = "enables " + probe.enables
        if res.get("note_extra"):
            note += f" ({res['note_extra']})"
    elif status == "unrelated":
        note = (f"'{probe.module}' imports but is not the package megatron_rl means (PyPI 'apex' is an "
                f"unrelated project); {probe.without}")
    elif status == "missing":
        note = "not installed -> " + probe.without
    else:
        note = f"{status} on import -> {probe.without}"
    return {"status": status, "module": probe.module, "version": res.get("version"),
            "enables": probe.enables, "note": note, "error": res.get("error"),
            "seconds": round(seconds, 2)}


def collect(timeout: float = 60.0, only: list[str] | None = None, jobs: int | None = None) -> dict:
    """Gather the whole report as a dict (the ``--json`` object)."""
    probes = [p for p in PROBES if only is None or p.name in only]
    unknown = sorted(set(only or ()) - {p.name for p in PROBES})
    if unknown:
        raise SystemExit(f"check_env: unknown --only name(s) {unknown}; choose from "
                         f"{', '.join(p.name for p in PROBES)}")
    workers = jobs or (len(probes) + 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        # torch is required, not optional: a short --timeout meant for optional packages
        # must not report a merely slow torch import (busy machine) as a failure.
        torch_future = pool.submit(_run_child, [_TORCH_CHILD], max(timeout, 60.0))
        futures = {p.name: pool.submit(_probe_backend, p, timeout) for p in probes}
        torch_res, _ = torch_future.result()
        backends = {name: f.result() for name, f in futures.items()}
    accelerators = torch_res.pop("accelerators", {"kind": "none", "count": 0, "devices": []})
    torch_info = {"status": torch_res.get("status"), "version": torch_res.get("version"),
                  "cuda_build": torch_res.get("cuda_build", False),
                  "cuda_version": torch_res.get("cuda_version"), "hip_version": torch_res.get("hip_version"),
                  "cudnn_version": torch_res.get("cudnn_version"), "nccl_version": torch_res.get("nccl_version"),
                  "error": torch_res.get("error")}
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
                     "platform": platform.platform(), "cpu_count": os.cpu_count()},
        "torch": torch_info,
        "accelerators": accelerators,
        "backends": backends,
        "exit_code": 0 if torch_info["status"] == "ok" else 1,
    }


def format_report(report: dict) -> str:
    """The human-readable table."""
    py, pf, t, acc = report["python"], report["platform"], report["torch"], report["accelerators"]
    lines = [f"python        {py['version']} ({py['implementation']}) {py['executable']}",
             f"platform      {pf['platform']} ({pf['machine']}, {pf['cpu_count']} CPUs)"]
    if t["status"] == "ok":
        build = (f"CUDA {t['cuda_version']}" if t["cuda_version"] else
                 f"ROCm {t['hip_version']}" if t["hip_version"] else "CPU-only build")
        lines.append(f"torch         {t['version']} ({build}; cuDNN {t['cudnn_version'] or '-'}, "
                     f"NCCL {t['nccl_version'] or '-'})")
    else:
        lines.append(f"torch         {t['status'].upper()}: {t['error']}")
    if acc["count"]:
        lines.append(f"accelerators  {acc['count']} x {acc['kind']}")
        for d in acc["devices"]:
            lines.append(f"  [{d['index']}] {d['name']}  {d['memory_gib']} GiB  "
                         f"compute capability {d['compute_capability']}")
    else:
        lines.append("accelerators  none (CPU only: gloo, CPU shim, embedded engine)")
    rows = [(name, b["status"], b["version"] or "-", b["note"] + (f" [{b['error']}]" if b["error"] else ""))
            for name, b in report["backends"].items()]
    if rows:
        w0 = max(len(r[0]) for r in rows + [("backend",)])
        w1 = max(len(r[1]) for r in rows + [("", "status")])
        w2 = max(len(r[2]) for r in rows + [("", "", "version")])
        lines.append("")
        lines.append(f"{'backend':<{w0}}  {'status':<{w1}}  {'version':<{w2}}  meaning")
        for r in rows:
            lines.append(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]:<{w2}}  {r[3]}")
    return "\n".join(lines)


MAX_TIMEOUT_S = 86400.0  # a day: an import that takes longer is hung; far below what the waits accept


def _positive(kind, most: float | None = None, fix: str = ""):
    """argparse type: a finite number > 0 and <= ``most`` (a negative --timeout used to be accepted and fail
    every probe; inf or 1e10 raised OverflowError from the wait: a traceback, not a refusal)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number{fix}") from None
        if not value > 0:  # nan too
            raise argparse.ArgumentTypeError(f"{text} must be > 0{fix}")
        if not math.isfinite(value) or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{text} must be finite and at most {most:g}{fix}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description="Report the environment megatron_rl would run in "
                                             "(imports each optional package in a subprocess).")
    ap.add_argument("--json", action="store_true", help="print one JSON object (keys in the module docstring)")
    ap.add_argument("--timeout", type=_positive(float, MAX_TIMEOUT_S, "; give the seconds each optional import may "
                                                "take, e.g. --timeout 60"), default=60.0,
                    help="seconds allowed for each optional import (default 60; torch always gets >= 60)")
    ap.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    help="comma-separated backend names to probe (default: all)")
    ap.add_argument("--jobs", type=_positive(int, fix="; give how many imports may run at once, e.g. --jobs 4"),
                    default=None, help="concurrent import probes (default: all at once)")
    args = ap.parse_args(argv)
    report = collect(timeout=args.timeout, only=args.only, jobs=args.jobs)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
