"""Worker for tests/dist/test_packing_dist.py: loss denominators all-reduced over the real gloo world.

Job ``packing`` of tests/dist/harness.py (2 ranks): argv = OUT_DIR. Each rank plans the dynamic micro-batches
of seven samples (a loss mask with a span of zeros in each), takes its share and all-reduces the denominators
over the default group; it writes them to OUT_DIR/rank{R}.json.
"""

import json
import os

import torch.distributed as dist

from megatron_rl.data.packing import compute_loss_denominators, plan_dynamic_micro_batches
from megatron_rl.data.types import Sample


def main(argv: list[str]) -> None:
    (out,) = argv
    rank = dist.get_rank()
    samples = [Sample(0, [1], [2] * n, loss_mask=[1] * (n // 2) + [0] * (n - n // 2))
               for n in (4, 9, 16, 25, 6, 3, 11)]
    plan = plan_dynamic_micro_batches([s.total_length for s in samples], dp_size=2, max_tokens_per_gpu=32)
    mine = [samples[i].effective_loss_mask() for i in plan.rank_samples(rank)]
    d = compute_loss_denominators(mine, group=dist.group.WORLD)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(d.__dict__, f)
