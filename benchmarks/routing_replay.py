"""MoE routing replay (--use-routing-replay, R2) vs none: ratio drift, route agreement, step time.

Several optimizer steps on one rollout batch (``--num-steps-per-rollout-updates``-style: the old
log-probs are fixed, the policy moves): the importance ratio ``exp(logp - old)`` of the later steps
carries the policy change and, without replay, the tokens whose router now picks other experts.
Per step it prints ``train/ratio_abs_dev`` (mean |ratio - 1| over the loss tokens) for both variants,
the fraction of (token, layer) pairs where the trainer's own router still agrees with the replayed
experts, and the step time of each, as ratios in one run. Same model, batch and seed for both
variants, in one process (megatron-core, one rank).

    python benchmarks/routing_replay.py [--experts 16] [--topk 2] [--steps 6] [--lr 1e-4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def _samples(vocab: int, n: int, seed: int = 0):
    import torch

    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(16, 48, (1,), generator=g)), int(torch.randint(32, 96, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(group_index=i // 4, prompt_ids=ids[:p], response_ids=ids[p:],
                          reward=float(torch.rand(1, generator=g))))
    return out


def run(hf: str, replay: bool, args) -> list[dict]:
    import torch

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    torch.manual_seed(0)
    argv = ["--hf-checkpoint", hf, "--lr", str(args.lr), "--rollout-batch-size", str(args.samples // 4),
            "--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--seed", "7", "--weight-decay", "0"]
    cfg = parse_config(argv + (["--use-routing-replay"] if replay else []))
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    samples = _samples(backend.vocab_size, args.samples)
    old = backend.forward_only(samples)
    adv = spec.compute_advantages(samples)
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old))
        steps.append({"ratio_abs_dev": m["train/ratio_abs_dev"], "agreement": m.get("train/route_agreement"),
                      "seconds": time.perf_counter() - t0})
    destroy_parallel()
    return steps


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

    with tempfile.TemporaryDirectory(prefix="routing_replay_") as tmp:
        hf = build_tiny_hf_model("qwen3_moe", os.path.join(tmp, "hf"), num_experts=args.experts,
                                 num_experts_per_tok=args.topk)
        results: dict[bool, list[list[dict]]] = {False: [], True: []}
        for _ in range(args.repeat):
            for replay in (False, True):
                results[replay].append(run(hf, replay, args))
    print(f"tiny qwen3_moe: {args.experts} experts, top-{args.topk}, 4 layers; {args.samples} samples, "
          f"{args.steps} optimizer steps on one rollout batch, lr {args.lr}; fp32, 1 process")
    print(f"\n{'step':>4} | {'|ratio-1| none':>14} {'|ratio-1| r2':>12} {'r2/none':>8} | {'route agreement':>15}")
    none, r2 = results[False][0], results[True][0]
    for i, (a, b) in enumerate(zip(none, r2)):
        rel = b["ratio_abs_dev"] / a["ratio_abs_dev"] if a["ratio_abs_dev"] else float("nan")
        print(f"{i:>4} | {a['ratio_abs_dev']:14.3e} {b['ratio_abs_dev']:12.3e} {rel:8.2f} | {b['agreement']:15.4f}")
    t_none = statistics.median(s["seconds"] for rep in results[False] for s in rep[1:])
    t_r2 = statistics.median(s["seconds"] for rep in results[True] for s in rep[1:])
    print(f"\nstep time (median over steps after the first, {args.repeat} runs each): none {t_none:.3f} s, "
          f"r2 {t_r2:.3f} s, r2/none {t_r2 / t_none:.2f}x")


if __name__ == "__main__":
    main()
