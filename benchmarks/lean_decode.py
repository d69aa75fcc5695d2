"""Decode tokens/s of the embedded engine with its lean decode step against the model's own forward.

The same engine class, model and rows, one thread; ``lean`` and ``forward`` runs interleaved so a machine that
slows down mid-run slows both; the tokens and log-probs of the two are checked equal (the step is transformers'
computation bit for bit: rollout/lean_decode.py). Printed: each mode's median tokens/s over the repeats (CPU
time of the generate call) and the ratio.

    python benchmarks/lean_decode.py [--family qwen2] [--rows 16] [--tokens 192] [--repeat 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen2", help="a family of rollout.lean_decode.LEAN_FAMILIES")
    ap.add_argument("--rows", type=int, default=16, help="rows decoded together (4 prompts x 4 samples by default)")
    ap.add_argument("--tokens", type=int, default=192, help="new tokens per row")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    import torch

    from megatron_rl.data.types import SamplingParams
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout.embedded import EmbeddedEngine, EngineRow

    torch.set_num_threads(1)
    model = build_tiny_hf_model(args.family, os.path.join(tempfile.mkdtemp(prefix="lean_decode_"), "model"))
    dtype = getattr(torch, args.dtype)
    engines = {"lean": EmbeddedEngine(model, dtype=dtype), "forward": EmbeddedEngine(model, dtype=dtype,
                                                                                      lean_decode=False)}
    assert engines["lean"]._lean_decode is not None, f"{args.family} has no lean decode step"
    rows = [EngineRow([3, 4, 5 + i // 4], seed=i, max_new_tokens=args.tokens, key=i // 4) for i in range(args.rows)]
    sampling = SamplingParams(max_new_tokens=args.tokens, seed=1, ignore_eos=True)
    for engine in engines.values():  # warm-up: first calls allocate
        engine.generate_rows(rows[:2], SamplingParams(max_new_tokens=4, seed=1))
    rates: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs = {}
    for _ in range(args.repeat):
        for mode, engine in engines.items():
            start = time.process_time()
            out = engine.generate_rows(rows, sampling)
            rates[mode].append(args.rows * args.tokens / (time.process_time() - start))
            outputs[mode] = [(r.response_ids, r.logprobs) for r in out]
    same = outputs["lean"] == outputs["forward"]
    print(f"{args.family} tiny, {args.dtype}, {args.rows} rows x {args.tokens} tokens, {args.repeat} runs each, "
          f"one thread (CPU time)")
    for mode, values in rates.items():
        print(f"{mode:8s} {statistics.median(values):9.0f} tokens/s  (runs: "
              f"{', '.join(f'{v:.0f}' for v in values)})")
    print(f"lean / forward: {statistics.median(rates['lean']) / statistics.median(rates['forward']):.2f}x; "
          f"tokens and log-probs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
