#!/usr/bin/env python
"""Turn a run's metrics.jsonl into PNG curves (reward, KL, entropy, lengths, step time).

    python tools/plot_run.py runs/demo/metrics.jsonl --out runs/demo/curves.png

Any metric can be added with ``--keys``. Keys absent from the run are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_KEYS = ["rollout/reward_mean", "eval/reward_mean", "train/kl", "train/entropy",
                "rollout/response_len_mean", "train/loss", "train/grad_norm", "perf/step_time_s"]


def plot(records: list[dict], keys: list[str], out: str, title: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        raise SystemExit(f"none of the keys {keys} are in the run; available: "
                         f"{sorted({k for r in records for k in r} - {'step', 'time'})}")
    cols = 2
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return present


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="path to metrics.jsonl")
    ap.add_argument("--out", help="PNG path (default: beside the JSONL, curves.png)")
    ap.add_argument("--keys", nargs="*", default=DEFAULT_KEYS)
    args = ap.parse_args(argv)
    from megatron_rl.infra.tracking import read_jsonl

    if not os.path.isfile(args.metrics):
        print(f"error: {args.metrics}: no such file", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(args.metrics), "curves.png")
    present = plot(read_jsonl(args.metrics), args.keys, out, title=os.path.dirname(args.metrics))
    print(f"wrote {out} ({', '.join(present)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
