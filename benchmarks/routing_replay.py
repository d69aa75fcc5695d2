"""MoE routing replay vs none: R2 (--use-routing-replay) and R3 (--use-rollout-routing-replay).

One rollout from the embedded engine in bf16 (as a serving engine computes; it records its routes), then
several optimizer steps of an fp32 trainer on it (``--num-steps-per-rollout-updates``-style: the old
log-probs fixed, the policy moving), for each variant:

* the engine-vs-trainer mismatch of the old pass: mean |old log-prob - rollout log-prob| over the
  response tokens (R3 computes the old pass with the engine's experts; none and R2 with the trainer's);
* per step, ``train/ratio_abs_dev`` (mean |ratio - 1| over the loss tokens: the policy change plus, without
  replay, tokens whose router now picks other experts) and ``train/route_agreement`` (how often the
  trainer's own router picks the replayed experts: R2 the old pass's, R3 the engine's);
* the step time, as ratios to none in one run.

Same model, rollout and seed for every variant, in one process (megatron-core, one rank).

    python benchmarks/routing_replay.py [--experts 16] [--topk 2] [--steps 6] [--lr 1e-4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def rollout(hf: str, args):
    """The engine's samples: random prompts, ``n`` 4, bf16, routes recorded; rewards drawn at random."""
    import torch

    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.rollout import EmbeddedEngine

    g = torch.Generator().manual_seed(0)
    engine = EmbeddedEngine(hf, dtype=torch.bfloat16, record_routes=True)
    prompts = [GenerateRequest(torch.randint(0, engine.vocab_size, (int(torch.randint(16, 48, (1,), generator=g)),),
                                             generator=g).tolist(), i) for i in range(args.samples // 4)]
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=3, n=4,
                                                       ignore_eos=True))
    for s in samples:
        s.reward = float(torch.rand(1, generator=g))
    return samples


def run(hf: str, variant: str, samples, args) -> dict:
    import torch

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    torch.manual_seed(0)
    argv = ["--hf-checkpoint", hf, "--lr", str(args.lr), "--rollout-batch-size", str(args.samples // 4),
            "--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--seed", "7", "--weight-decay", "0"]
    flag = {"none": [], "r2": ["--use-routing-replay"], "r3": ["--use-rollout-routing-replay"]}[variant]
    cfg = parse_config(argv + flag)
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    old = backend.forward_only(samples)
    diffs = torch.cat([(o.double() - torch.tensor(s.rollout_logprobs, dtype=torch.float64)).abs()
                       for o, s in zip(old, samples)])
    adv = spec.compute_advantages(samples)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old))
        steps.append({"ratio_abs_dev": m["train/ratio_abs_dev"], "agreement": m.get("train/route_agreement"),
                      "seconds": time.perf_counter() - t0})
    destroy_parallel()
    return {"mismatch": float(diffs.mean()), "mismatch_max": float(diffs.max()), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each variant, interleaved (median step time)")
    args = ap.parse_args()

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    variants = ("none", "r2", "r3")
    with tempfile.TemporaryDirectory(prefix="routing_replay_") as tmp:
        hf = build_tiny_hf_model("qwen3_moe", os.path.join(tmp, "hf"), num_experts=args.experts,
                                 num_experts_per_tok=args.topk)
        samples = rollout(hf, args)
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeat):
            for v in variants:
                results[v].append(run(hf, v, samples, args))
    tokens = sum(len(s.response_ids) for s in samples)
    print(f"tiny qwen3_moe: {args.experts} experts, top-{args.topk}, 4 layers; a bf16 embedded-engine rollout of "
          f"{len(samples)} samples ({tokens} response tokens); fp32 trainer, {args.steps} optimizer steps on it, "
          f"lr {args.lr}; 1 process")
    first = {v: results[v][0] for v in variants}
    print("\nold pass vs engine, mean |log-prob diff| over response tokens (max):")
    for v in variants:
        print(f"  {v:>4}: {first[v]['mismatch']:.3e} ({first[v]['mismatch_max']:.3e})"
              + (f"   {v}/none {first[v]['mismatch'] / first['none']['mismatch']:.2f}" if v != "none" else ""))
    print(f"\n{'step':>4} | {'|ratio-1| none':>14} {'r2':>10} {'r3':>10} {'r2/none':>8} {'r3/none':>8} | "
          f"{'agree r2':>8} {'agree r3':>8}")
    for i in range(args.steps):
        a, b, c = (first[v]["steps"][i] for v in variants)
        base = a["ratio_abs_dev"]
        rel = [x["ratio_abs_dev"] / base if base else float("nan") for x in (b, c)]
        print(f"{i:>4} | {base:14.3e} {b['ratio_abs_dev']:10.3e} {c['ratio_abs_dev']:10.3e} {rel[0]:8.2f} "
              f"{rel[1]:8.2f} | {b['agreement']:8.4f} {c['agreement']:8.4f}")
    times = {v: statistics.median(s["seconds"] for rep in results[v] for s in rep["steps"][1:]) for v in variants}
    print(f"\nstep time (median over steps after the first, {args.repeat} runs each): none {times['none']:.3f} s, "
          f"r2 {times['r2']:.3f} s ({times['r2'] / times['none']:.2f}x), r3 {times['r3']:.3f} s "
          f"({times['r3'] / times['none']:.2f}x)")

if __name__ == "__main__":
    main()
