#!/usr/bin/env python
"""Turn a run's metrics.jsonl into PNG curves (reward, KL, entropy, lengths, step time).

    python tools/plot_run.py runs/demo/metrics.jsonl --out runs/demo/curves.png

Any metric can be added with ``--keys``. Keys absent from the run are skipped. A resumed run's curve is its
final lineage: records a later attempt rolled back (``"superseded": true``, docs/metrics.md) are left out
unless ``--all-attempts``.
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
    ap.add_argument("--all-attempts", action="store_true",
                    help="also plot the records later attempts superseded (the final lineage only by default)")
    args = ap.parse_args(argv)
    from megatron_rl.infra.plot import plot_metrics
    from megatron_rl.infra.tracking import final_lineage, read_jsonl

    if not os.path.isfile(args.metrics):
        print(f"error: {args.metrics}: no such file", file=sys.stderr)
        return 2
    from megatron_rl.infra.plot import DEFAULT_KEYS

    out = args.out or os.path.join(os.path.dirname(args.metrics), "curves.png")
    try:
        records = read_jsonl(args.metrics)
        kept = records if args.all_attempts else final_lineage(records)
        present = plot_metrics(kept, args.keys or DEFAULT_KEYS, out, title=os.path.dirname(args.metrics))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    left = len(records) - len(kept)
    print(f"wrote {out} ({', '.join(present)})" + (f"; left out {left} superseded record(s) of rolled-back steps "
                                                   "(--all-attempts plots them)" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
