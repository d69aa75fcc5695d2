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

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="path to metrics.jsonl")
    ap.add_argument("--out", help="PNG path (default: beside the JSONL, curves.png)")
    ap.add_argument("--keys", nargs="*", default=None, help="metric names (default: reward, KL, entropy, lengths, step time)")
    args = ap.parse_args(argv)
    from megatron_rl.infra.plot import plot_metrics
    from megatron_rl.infra.tracking import read_jsonl

    if not os.path.isfile(args.metrics):
        print(f"error: {args.metrics}: no such file", file=sys.stderr)
        return 2
    from megatron_rl.infra.plot import DEFAULT_KEYS

    out = args.out or os.path.join(os.path.dirname(args.metrics), "curves.png")
    present = plot_metrics(read_jsonl(args.metrics), args.keys or DEFAULT_KEYS, out, title=os.path.dirname(args.metrics))
    print(f"wrote {out} ({', '.join(present)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
