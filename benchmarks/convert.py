"""Checkpoint conversion throughput and peak memory, against a plain file copy.

Builds a random llama (default hidden 1024, 8 layers, 16 heads / 4 KV heads,
intermediate 1024, vocab 32000, fp32: ~112M parameters, ~450 MB), then in one
run measures on the same disk:

* ``copy``: ``shutil.copy`` of the safetensors file(s) (the I/O floor);
* ``hf->dist`` and ``dist->hf``: ``tools/convert_ckpt.py`` as fresh processes
  (``--max-shard-size`` 100MB for the HF output), each with and without ``--verify``
  left out so the figure is the conversion alone;
* ``baseline``: a process that only imports what the tool imports (its RSS is the
  interpreter + torch + megatron floor, not the model).

Peak RSS is the converter process's ``ru_maxrss`` (from ``wait4``; the torch_dist
writer's forked helpers share the parent's pages and are counted separately by
the kernel, so the figure is the largest single process). Ratios: conversion
time / copy time, and peak RSS (minus the import floor) / the largest tensor
and / the model bytes. Page cache is warm for every step alike.

    python benchmarks/convert.py [--hidden 1024 --layers 8 --vocab 32000] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "convert_ckpt.py")


def run_rss(cmd: list[str]) -> tuple[float, int, str]:
    """Like run_measured, but reaps with os.wait4 to get the child's own ru_maxrss."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": REPO}
    out_f = tempfile.TemporaryFile(mode="w+")
    err_f = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=out_f, stderr=err_f, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out_f.seek(0)
    err_f.seek(0)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err_f.read()[-4000:]}")
    return wall, usage.ru_maxrss * 1024, out_f.read()


def weight_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-shard-size", default="100MB")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir; same disk for all)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    import torch

    from megatron_rl.models.hf_checkpoint import HFCheckpoint
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    work = args.workdir or tempfile.mkdtemp(prefix="convert_bench_")
    os.makedirs(work, exist_ok=True)
    try:
        hf = build_tiny_hf_model("llama", os.path.join(work, "hf"), hidden_size=args.hidden,
                                 num_hidden_layers=args.layers, vocab_size=args.vocab,
                                 intermediate_size=args.intermediate, num_attention_heads=args.heads,
                                 num_key_value_heads=args.kv_heads)
        ck = HFCheckpoint(hf)
        sizes = {}
        for n in ck.names():
            shape = ck.shape(n)
            numel = 1
            for s in shape:
                numel *= s
            sizes[n] = numel * 4
        ck.close()
        model_bytes, largest = sum(sizes.values()), max(sizes.values())
        largest_name = max(sizes, key=sizes.get)

        files = weight_files(hf)
        copy_dir = os.path.join(work, "copy")
        os.makedirs(copy_dir)
        t0 = time.perf_counter()
        for f in files:
            shutil.copy(os.path.join(hf, f), os.path.join(copy_dir, f))
        fd = os.open(copy_dir, os.O_RDONLY)
        for f in files:
            with open(os.path.join(copy_dir, f), "rb+") as fh:
                os.fsync(fh.fileno())
        os.close(fd)
        copy_s = time.perf_counter() - t0
        copied = sum(os.path.getsize(os.path.join(copy_dir, f)) for f in files)

        py = sys.executable
        base_s, base_rss, _ = run_rss([py, "-c", "import megatron_rl.convert.hf_to_dist, megatron_rl.convert."
                                       "dist_to_hf, megatron.core.models.gpt, megatron.core.dist_checkpointing"])
        d = os.path.join(work, "dist")
        h2d_s, h2d_rss, out = run_rss([py, TOOL, "hf-to-dist", "--input", hf, "--output", d, "--json",
                                       "--no-progress"])
        h2d_in = json.loads(out.strip().splitlines()[-1])["seconds"]
        back = os.path.join(work, "back")
        d2h_s, d2h_rss, out = run_rss([py, TOOL, "dist-to-hf", "--input", d, "--output", back, "--json",
                                       "--no-progress", "--max-shard-size", args.max_shard_size])
        d2h_in = json.loads(out.strip().splitlines()[-1])["seconds"]

        # the round trip must be exact for the figures to mean anything
        a, b = HFCheckpoint(hf), HFCheckpoint(back)
        assert a.names() == b.names()
        for n in a.names():
            assert torch.equal(a.read(n), b.read(n)), n
        a.close()
        b.close()

        mb = 1e6
        rows = [("copy (shutil.copy + fsync)", copy_s, None, None),
                ("hf->torch_dist (process)", h2d_s, h2d_in, h2d_rss),
                ("torch_dist->hf (process)", d2h_s, d2h_in, d2h_rss)]
        result = {"model_bytes": model_bytes, "largest_tensor": largest_name, "largest_bytes": largest,
                  "copied_bytes": copied, "import_floor_rss": base_rss, "import_floor_s": base_s, "rows": []}
        if not args.json:
            print(f"llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
                  f"intermediate={args.intermediate} fp32: model {model_bytes / mb:.0f} MB, largest tensor "
                  f"{largest_name} {largest / mb:.0f} MB; import floor: {base_rss / mb:.0f} MB RSS, {base_s:.1f} s")
            print(f"{'step':28s} {'wall s':>7s} {'in-tool s':>9s} {'MB/s':>7s} {'x copy':>7s} {'peak RSS MB':>11s} "
                  f"{'RSS/largest':>11s} {'(RSS-floor)/largest':>19s} {'(RSS-floor)/model':>17s}")
        for name, wall, inner, rss in rows:
            row = {"step": name, "wall_s": round(wall, 3), "in_tool_s": inner,
                   "mb_per_s": round(model_bytes / mb / (inner or wall), 1),
                   "x_copy": round((inner or wall) / copy_s, 2),
                   "peak_rss": rss,
                   "rss_over_largest": round(rss / largest, 2) if rss else None,
                   "extra_rss_over_largest": round((rss - base_rss) / largest, 2) if rss else None,
                   "extra_rss_over_model": round((rss - base_rss) / model_bytes, 2) if rss else None}
            result["rows"].append(row)
            if not args.json:
                f = (lambda v, fmt: format(v, fmt) if v is not None else "-")
                print(f"{name:28s} {wall:7.2f} {f(inner, '9.2f'):>9s} {row['mb_per_s']:7.1f} {row['x_copy']:7.2f} "
                      f"{f(rss and rss / mb, '11.0f'):>11s} {f(row['rss_over_largest'], '11.2f'):>11s} "
                      f"{f(row['extra_rss_over_largest'], '19.2f'):>19s} {f(row['extra_rss_over_model'], '17.2f'):>17s}")
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print("x copy and MB/s use the in-tool time (after imports); wall includes interpreter + megatron imports "
                  "and the torch_dist writer's helper start.")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
