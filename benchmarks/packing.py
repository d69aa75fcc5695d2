"""Padding waste and DP imbalance: dynamic packed micro-batches vs fixed padded micro-batches.

An RL-like step: ``--num-prompts`` prompts (50-500 tokens) with ``--samples-per-prompt``
responses each, response lengths lognormal and capped at ``--max-response-len``
(long tail: most responses short, a few hit the cap). Two ways to batch it:

* dynamic: ``plan_dynamic_micro_batches`` (THD packing, no padding between
  sequences, <= --max-tokens-per-gpu per micro-batch, KK-balanced across DP);
* fixed: ``--micro-batch-size`` samples per micro-batch in rollout order, each
  padded to the longest in its micro-batch, as a non-packing trainer does.

Reported per DP size: padding waste (pad tokens / computed tokens), DP imbalance
(max/mean over ranks of computed tokens and of attention cost sum L^2, where a
padded micro-batch costs M * Lmax^2), max/mean attention cost over micro-batches,
and the lockstep cost (sum over micro-batch slots of the slowest rank's
tokens, as every DP rank waits for the slowest at the gradient all-reduce).
Ratios are fixed / dynamic from the same run. Runs in a few seconds on CPU.

    python benchmarks/packing.py [--dp 4 8] [--max-tokens-per-gpu 16384] [--micro-batch-size 4]
"""

from __future__ import annotations

import argparse
import random
import time

from megatron_rl.data.packing import padded_length, plan_dynamic_micro_batches, plan_fixed_micro_batches


def rl_lengths(num_prompts: int, samples_per_prompt: int, max_response_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths = []
    for _ in range(num_prompts):
        prompt = rng.randint(50, 500)
        for _ in range(samples_per_prompt):
            response = min(max_response_len, max(1, int(rng.lognormvariate(6.5, 1.0))))
            lengths.append(prompt + response)
    return lengths


def _ratio(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def measure(mb_lengths: list[list[list[int]]], padded: bool, real: int) -> dict:
    """Metrics from ``mb_lengths[rank][mb] = [seq lengths as computed]``; ``padded`` = pad to the
    longest in the micro-batch; ``real`` = unpadded tokens of the step."""

    def tokens(mb):
        return len(mb) * max(mb, default=0) if padded else sum(mb)

    def attn(mb):
        return len(mb) * max(mb, default=0) ** 2 if padded else sum(n * n for n in mb)

    rank_tokens = [sum(tokens(mb) for mb in mbs) for mbs in mb_lengths]
    rank_attn = [sum(attn(mb) for mb in mbs) for mbs in mb_lengths]
    mb_attn = [attn(mb) for mbs in mb_lengths for mb in mbs]
    slots = len(mb_lengths[0])
    lockstep = sum(max(tokens(mbs[j]) for mbs in mb_lengths) for j in range(slots))
    computed = sum(rank_tokens)
    return {
        "micro_batches": slots,
        "pad_waste": 1 - real / computed,
        "rank_tokens_max_over_mean": _ratio(rank_tokens),
        "rank_attn_max_over_mean": _ratio(rank_attn),
        "mb_attn_max_over_mean": _ratio(mb_attn),
        "lockstep_tokens": lockstep,
        "ideal_tokens_per_rank": real / len(mb_lengths),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-response-len", type=int, default=8192)
    ap.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--pad-to-multiple", type=int, default=1,
                    help="per-sequence padding of the dynamic plan (2*cp for CP, tp for SP)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    lengths = rl_lengths(args.num_prompts, args.samples_per_prompt, args.max_response_len, args.seed)
    srt = sorted(lengths)
    print(f"step: {len(lengths)} samples, {sum(lengths)} tokens; length p50={srt[len(srt) // 2]} "
          f"p90={srt[int(len(srt) * 0.9)]} max={srt[-1]}")
    print(f"dynamic: --max-tokens-per-gpu {args.max_tokens_per_gpu}, pad_to_multiple {args.pad_to_multiple}; fixed: --micro-batch-size "
          f"{args.micro_batch_size}, padded to longest in micro-batch")
    header = (f"{'dp':>3} {'mode':<8} {'#mb':>4} {'pad waste':>10} {'rank tok max/mean':>18} "
              f"{'rank attn max/mean':>19} {'mb attn max/mean':>17} {'lockstep tok':>13} {'plan ms':>8}")
    for dp in args.dp:
        t0 = time.perf_counter()
        dyn_plan = plan_dynamic_micro_batches(lengths, dp_size=dp, max_tokens_per_gpu=args.max_tokens_per_gpu,
                                              pad_to_multiple=args.pad_to_multiple)
        dyn_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        fix_plan = plan_fixed_micro_batches(len(lengths), dp_size=dp, micro_batch_size=args.micro_batch_size)
        fix_ms = (time.perf_counter() - t0) * 1e3
        def as_lengths(plan):
            return [[[padded_length(lengths[i], plan.pad_to_multiple) for i in mb] for mb in mbs]
                    for mbs in plan.micro_batches]
        dyn = measure(as_lengths(dyn_plan), padded=False, real=sum(lengths))
        fix = measure(as_lengths(fix_plan), padded=True, real=sum(lengths))
        print()
        print(header)
        for name, m, ms in (("dynamic", dyn, dyn_ms), ("fixed", fix, fix_ms)):
            print(f"{dp:>3} {name:<8} {m['micro_batches']:>4} {m['pad_waste']:>10.3f} "
                  f"{m['rank_tokens_max_over_mean']:>18.3f} {m['rank_attn_max_over_mean']:>19.3f} "
                  f"{m['mb_attn_max_over_mean']:>17.3f} {m['lockstep_tokens']:>13} {ms:>8.1f}")
        print(f"    fixed/dynamic: computed tokens x{(1 / (1 - fix['pad_waste'])) / (1 / (1 - dyn['pad_waste'])):.2f}, "
              f"rank token imbalance x{fix['rank_tokens_max_over_mean'] / dyn['rank_tokens_max_over_mean']:.2f}, "
              f"rank attention imbalance x{fix['rank_attn_max_over_mean'] / dyn['rank_attn_max_over_mean']:.2f}, "
              f"lockstep tokens x{fix['lockstep_tokens'] / dyn['lockstep_tokens']:.2f} "
              f"(ideal per rank {dyn['ideal_tokens_per_rank']:.0f})")


if __name__ == "__main__":
    main()
