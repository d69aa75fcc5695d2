"""--true-on-policy-mode at DP2: each rank's embedded-engine replica against the trainer's old log-probs.

Usage: ``on_policy_worker.py OUT_DIR FAMILY [FAMILY ...]`` (tiny models built here, one run per family, 2 ranks).
Per family, two steps: each rank's replica generates its own prompts (rank r: group size 2 + 2r, engine chunks of
3 + r rows), the samples are all-gathered (every rank holds the whole rollout, half from each replica), the
trainer computes the old log-probs over the owner-aligned DP2 forward plan (micro-batches of 2), trains one step,
and every replica loads the exported weights. Rank 0 writes ``results.json``: per family and step, how many
response tokens' rollout and old log-probs differ (as seen on each rank), the largest difference, and the step's
mismatch, ratio and route-agreement metrics.
"""

from __future__ import annotations

import json
import os
import sys


def run_family(out_dir: str, family: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.models.parallel import destroy_parallel
    from megatron_rl.rollout.embedded import EmbeddedEngine

    rank, world = dist.get_rank(), dist.get_world_size()
    moe = family in ("qwen3_moe", "mixtral")
    path = os.path.join(out_dir, family)
    if rank == 0:
        build_tiny_hf_model(family, path, **({"num_experts_per_tok": 3} if moe else {}))
    dist.barrier()
    argv = ["--hf-checkpoint", path, "--actor-num-gpus-per-node", str(world), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--micro-batch-size", "2", "--lr", "1e-2", "--seed", "7",
            "--true-on-policy-mode", "--output-dir", os.path.join(out_dir, f"{family}_run")]
    cfg = parse_config(argv + (["--use-rollout-routing-replay"] if moe else []))
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    assert backend.dp_size == world
    engine = EmbeddedEngine.from_config(cfg)
    engine.max_batch_size = 3 + rank
    g = torch.Generator().manual_seed(100 + rank)
    steps = []
    for step in (1, 2):
        requests = [GenerateRequest(prompt_ids=torch.randint(0, 100, (k,), generator=g).tolist(),
                                    group_index=2 * rank + i) for i, k in enumerate((3 + 2 * rank, 8))]
        mine = engine.generate(requests, SamplingParams(max_new_tokens=4, temperature=1.0, n=2 + 2 * rank,
                                                        seed=10 * step + rank))
        parts: list = [None] * world
        dist.all_gather_object(parts, mine)
        samples = [s for part in parts for s in part]
        plan = backend.plan_rollout(samples, len(samples))
        old = backend.forward_only(samples, plan=plan.forward)
        diffs = torch.cat([(o - torch.tensor(s.rollout_logprobs, dtype=torch.float32)).abs()
                           for o, s in zip(old, samples)])
        advantages = spec.compute_advantages(samples, old_logprobs=old)
        metrics = backend.train_step(TrainBatch(samples, advantages, old_logprobs=old, plan=plan.steps[0][1]))
        counts = [None] * world
        dist.all_gather_object(counts, (int((diffs != 0).sum()), diffs.numel(), float(diffs.max())))
        steps.append({"differ_by_rank": counts,
                      "metrics": {k: metrics.get(k) for k in (
                          "train/mismatch_logprob_diff_frac", "train/mismatch_abs_logprob_max",
                          "train/mismatch_k3_kl", "train/ratio", "train/ratio_abs_dev", "train/route_agreement")}})
        engine.update_weights([(n, t) for bucket in backend.export_weights(1 << 40) for n, t in bucket],
                              version=step)
    destroy_parallel()
    return {"steps": steps, "samples_per_step": len(samples)}


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    out_dir, families = argv[0], argv[1:]
    results = {family: run_family(out_dir, family) for family in families}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
