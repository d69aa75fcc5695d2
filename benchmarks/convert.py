"""Checkpoint conversion throughput and peak memory, against a plain file copy.

Builds a random llama (default hidden 1024, 8 layers, 16 heads / 4 KV heads,
intermediate 1024, vocab 32000, fp32: ~112M parameters, ~450 MB), then in one
run measures on the same disk:

* ``copy``: ``shutil.copy`` + ``fsync`` of the safetensors file(s) into a new dir (the I/O floor),
  ``--repeat`` times before the first conversion step and after every one (the machine's load
  drifts; the fastest is the reference);
* ``hf->dist`` (once per ``--bucket-sizes`` value) and ``dist->hf``:
  ``tools/convert_ckpt.py`` in a fresh process per step (``--max-shard-size`` 100MB for
  the HF output), without ``--verify`` so the figure is the conversion alone, run ``--repeat``
  times one after another in that process (the previous output removed before each run, untimed, as the
  copy's destination is); the time is the
  tool's own ``seconds`` (from the call of the conversion to the published output: checks,
  model layout, every byte written and fsynced, ``COMPLETE.json``, the rename), not the imports;
* peak memory *of the conversion*: each tool run goes through ``--probe``, which
  imports what the tool imports, then resets the kernel's RSS high-water mark
  (``/proc/self/clear_refs`` 5), records ``VmRSS`` (the floor: interpreter +
  torch + megatron, whose import alone peaks higher than a streaming
  conversion does) and, when the tool returns, ``VmHWM``. The figure is
  ``VmHWM - floor``: what the conversion itself added at its peak (over all its runs;
  pages of the input files mapped by the conversion count too). Forked
  helpers of megatron's torch_dist writer (``dist->hf`` loads through it) are
  separate processes and not included.

Ratios: speed = the copy's best time / the step's best time (1.00: as fast as copying the
bytes), and the conversion's peak RSS / (the largest tensor + one ``--bucket-size``), the bound
the converters keep. Page cache is warm for every step alike. The load average (the machine
may be shared) is printed before and after.

    python benchmarks/convert.py [--hidden 1024 --layers 8 --vocab 32000] [--repeat 3] [--workdir DIR] [--keep]
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


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def probe(tool_argv: list[str]) -> None:
    """Run the tool in this process and write {floor, hwm} (bytes) to $RSS_PROBE_OUT."""
    import runpy

    import megatron.core.dist_checkpointing  # noqa: F401  the floor: what the tool imports anyway
    import megatron.core.models.gpt  # noqa: F401

    import megatron_rl.convert.dist_to_hf  # noqa: F401
    import megatron_rl.convert.hf_to_dist  # noqa: F401

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    floor = _status_kb("VmRSS")
    output = tool_argv[tool_argv.index("--output") + 1]
    for _ in range(int(os.environ.get("RSS_PROBE_REPEAT", "1"))):
        # the previous run's output goes before the run, untimed, as the copy's destination does
        shutil.rmtree(output, ignore_errors=True)
        sys.argv = [TOOL, *tool_argv]
        try:
            runpy.run_path(TOOL, run_name="__main__")
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    with open(os.environ["RSS_PROBE_OUT"], "w") as f:
        json.dump({"floor": floor, "hwm": _status_kb("VmHWM")}, f)


def run_rss(tool_argv: list[str], repeat: int = 1) -> tuple[float, int, int, list[float]]:
    """Run the tool ``repeat`` times in one process through ``--probe``: (wall s, floor bytes, conversion
    peak above the floor, each run's in-tool seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": REPO,
           "RSS_PROBE_REPEAT": str(repeat)}
    out_f = tempfile.TemporaryFile(mode="w+")
    err_f = tempfile.TemporaryFile(mode="w+")
    fd, probe_out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    env["RSS_PROBE_OUT"] = probe_out
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", *tool_argv], env=env, stdout=out_f,
                       stderr=err_f, text=True)
    wall = time.perf_counter() - t0
    out_f.seek(0)
    err_f.seek(0)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(tool_argv)} failed ({p.returncode}):\n{err_f.read()[-4000:]}")
    with open(probe_out) as f:
        r = json.load(f)
    os.remove(probe_out)
    seconds = [json.loads(line)["seconds"] for line in out_f.read().splitlines() if line.startswith("{")]
    return wall, r["floor"], r["hwm"] - r["floor"], seconds


def copy_seconds(files: list[str], src: str, dst: str) -> float:
    """``shutil.copy`` of ``files`` from ``src`` into a new ``dst``, each fsynced: the I/O floor."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    t0 = time.perf_counter()
    for f in files:
        shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    for f in files:
        with open(os.path.join(dst, f), "rb+") as fh:
            os.fsync(fh.fileno())
    return time.perf_counter() - t0


def weight_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-shard-size", default="100MB")
    ap.add_argument("--bucket-sizes", default="32MB,1GB",
                    help="hf->torch_dist --bucket-size values to run, comma-separated (one row each)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir; same disk for all)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of every step (the conversions one after another in one tool process, the copy next "
                         "to each); the table shows the fastest (the machine's load drifts)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    import torch

    from megatron_rl.models.hf_checkpoint import HFCheckpoint
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    from megatron_rl.convert.safetensors_writer import parse_size

    load_before = os.getloadavg()
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
        copies = []  # the copy is timed next to every conversion step: the machine's load drifts

        def copy_now() -> None:
            copies.extend(copy_seconds(files, hf, copy_dir) for _ in range(args.repeat))

        copy_now()
        copied = sum(os.path.getsize(os.path.join(copy_dir, f)) for f in files)

        conv_rows, backs = [], []
        for i, bucket in enumerate(args.bucket_sizes.split(",")):
            d = os.path.join(work, f"dist{i}")
            h2d_s, floor, h2d_rss, secs = run_rss(["hf-to-dist", "--input", hf, "--output", d, "--json",
                                                   "--no-progress", "--bucket-size", bucket], args.repeat)
            conv_rows.append((f"hf->torch_dist --bucket {bucket}", h2d_s, secs, h2d_rss, parse_size(bucket)))
            copy_now()
            back = os.path.join(work, f"back{i}")
            d2h_s, _, d2h_rss, secs = run_rss(["dist-to-hf", "--input", d, "--output", back, "--json",
                                               "--no-progress", "--max-shard-size", args.max_shard_size,
                                               "--bucket-size", bucket], args.repeat)
            conv_rows.append((f"torch_dist->hf --bucket {bucket}", d2h_s, secs, d2h_rss, parse_size(bucket)))
            copy_now()
            backs.append(back)
        copy_s = min(copies)

        # the round trip must be exact for the figures to mean anything
        a = HFCheckpoint(hf)
        for back in backs:
            b = HFCheckpoint(back)
            assert a.names() == b.names()
            for n in a.names():
                assert torch.equal(a.read(n), b.read(n)), n
            b.close()
        a.close()

        mb = 1e6
        rows = [("copy (shutil.copy + fsync)", None, copies, None, None), *conv_rows]
        result = {"model_bytes": model_bytes, "largest_tensor": largest_name, "largest_bytes": largest,
                  "copied_bytes": copied, "import_floor_rss": floor, "repeat": args.repeat,
                  "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": []}
        if not args.json:
            print(f"llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
                  f"intermediate={args.intermediate} fp32: model {model_bytes / mb:.0f} MB, largest tensor "
                  f"{largest_name} {largest / mb:.0f} MB; RSS after imports (floor): {floor / mb:.0f} MB; "
                  f"best of {args.repeat}")
            print(f"load average before {' '.join(f'{x:.1f}' for x in load_before)}, after "
                  f"{' '.join(f'{x:.1f}' for x in result['loadavg_after'])} (1/5/15 min; {os.cpu_count()} cores)")
            print(f"{'step':31s} {'wall s':>7s} {'best s':>7s} {'first s':>7s} {'MB/s':>7s} {'speed':>6s} "
                  f"{'peak MB':>8s} {'peak/(largest+bucket)':>21s}")
        for name, wall, secs, rss, bucket_bytes in rows:
            best = min(secs)
            row = {"step": name, "wall_s": round(wall, 3) if wall is not None else None, "seconds": secs,
                   "best_s": round(best, 3), "mb_per_s": round(model_bytes / mb / best, 1),
                   "speed_of_copy": round(copy_s / best, 2), "peak_rss_above_floor": rss,
                   "peak_over_largest_plus_bucket": round(rss / (largest + bucket_bytes), 2) if rss is not None
                   else None}
            result["rows"].append(row)
            if not args.json:
                f = (lambda v, fmt: format(v, fmt) if v is not None else "-")
                print(f"{name:31s} {f(wall, '7.2f'):>7s} {best:7.2f} {secs[0]:7.2f} {row['mb_per_s']:7.1f} "
                      f"{row['speed_of_copy']:6.2f} {f(rss is not None and rss / mb or None, '8.0f'):>8s} "
                      f"{f(row['peak_over_largest_plus_bucket'], '21.2f'):>21s}")
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print("best s / first s: the tool's own seconds (after imports) of its fastest / first run in one process; "
                  "speed = copy's best s / this step's best s (1.00: as fast as copying the bytes); peak = the "
                  "conversion's RSS high-water mark above the floor (see --probe), over all runs; wall = the "
                  "process, imports included.")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
