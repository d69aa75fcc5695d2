"""--true-on-policy-mode vs the default: the engine-vs-trainer log-prob mismatch and what the mode costs.

For each variant (off, on), in one process (megatron-core, one rank, fp32, a tiny random model of ``--family``):
one rollout of the embedded engine (``--samples`` rows, group size 4, ``--new-tokens`` tokens each), the trainer's old
log-probs over it (``forward_only``, micro-batches of 4), then one train step. Reported: how many response
tokens' rollout and old log-probs differ at all and the largest difference, and the time of each phase, as
ratios on over off in one run (median over ``--repeat`` interleaved runs).

    python benchmarks/true_on_policy.py [--family qwen3] [--samples 16] [--new-tokens 32] [--repeat 2]

A MoE family (qwen3_moe, mixtral) runs both variants with routing replay from the rollout
(``--use-rollout-routing-replay``, the mode's requirement), so the ratio is the mode's cost alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

MOE_FAMILIES = ("qwen3_moe", "mixtral")


def run(hf: str, on: bool, args) -> dict:
    import torch

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.models.parallel import destroy_parallel
    from megatron_rl.rollout import EmbeddedEngine

    g = torch.Generator().manual_seed(0)
    moe = args.family in MOE_FAMILIES  # both variants replay the engine's routes (R3); only the mode differs
    engine = EmbeddedEngine(hf, batch_invariant=on, record_routes=moe)
    prompts = [GenerateRequest(torch.randint(0, engine.vocab_size, (int(torch.randint(8, 24, (1,), generator=g)),),
                                             generator=g).tolist(), i) for i in range(args.samples // 4)]
    t0 = time.perf_counter()
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=3, n=4,
                                                      ignore_eos=True))
    generate_s = time.perf_counter() - t0
    for s in samples:
        s.reward = float(torch.rand(1, generator=g))
    argv = ["--hf-checkpoint", hf, "--lr", "1e-4", "--rollout-batch-size", str(args.samples // 4),
            "--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--seed", "7"]
    argv += ["--use-rollout-routing-replay"] if moe else []
    cfg = parse_config(argv + (["--true-on-policy-mode"] if on else []))
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    t0 = time.perf_counter()
    old = backend.forward_only(samples)
    forward_s = time.perf_counter() - t0
    diffs = torch.cat([(o - torch.tensor(s.rollout_logprobs, dtype=torch.float32)).abs()
                       for o, s in zip(old, samples)])
    t0 = time.perf_counter()
    metrics = backend.train_step(TrainBatch(samples, spec.compute_advantages(samples), old_logprobs=old))
    train_s = time.perf_counter() - t0
    destroy_parallel()
    return {"differ": int((diffs != 0).sum()), "tokens": diffs.numel(), "max": float(diffs.max()),
            "ratio_abs_dev": metrics["train/ratio_abs_dev"],
            "seconds": {"generate": generate_s, "forward_only": forward_s, "train_step": train_s}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--family", default="qwen3", help="tiny model family (megatron_rl.models.hf_tiny)")
    ap.add_argument("--samples", type=int, default=16, help="rows of the rollout (a multiple of 4)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each variant, interleaved (median times)")
    args = ap.parse_args()

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    with tempfile.TemporaryDirectory(prefix="true_on_policy_") as tmp:
        hf = build_tiny_hf_model(args.family, os.path.join(tmp, "hf"))
        results: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeat):
            for on in (False, True):
                results[on].append(run(hf, on, args))
    print(f"tiny {args.family}, fp32, 1 process: a rollout of {args.samples} rows x {args.new_tokens} "
          f"tokens, old log-probs in micro-batches of 4, one train step")
    for on in (False, True):
        r = results[on][0]
        print(f"  mode {'on ' if on else 'off'}: {r['differ']}/{r['tokens']} tokens differ, max |diff| "
              f"{r['max']:.3e}, first step mean |ratio - 1| {r['ratio_abs_dev']:.3e}")
    for phase in ("generate", "forward_only", "train_step"):
        off, on_ = (statistics.median(r["seconds"][phase] for r in results[v]) for v in (False, True))
        print(f"  {phase:>12}: off {off:.3f} s, on {on_:.3f} s ({on_ / off:.2f}x)")


if __name__ == "__main__":
    main()
