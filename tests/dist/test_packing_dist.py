"""Loss denominators all-reduced over a real 2-rank gloo DP group (torchrun).

Kept beside the other packing tests (marked slow) because it exercises one
function; it launches two processes and runs in a few seconds.
"""

import json
import textwrap

import pytest

from _util import torchrun

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from megatron_rl.data.packing import compute_loss_denominators, plan_dynamic_micro_batches
    from megatron_rl.data.types import Sample

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    samples = [Sample(0, [1], [2] * n, loss_mask=[1] * (n // 2) + [0] * (n - n // 2))
               for n in (4, 9, 16, 25, 6, 3, 11)]
    plan = plan_dynamic_micro_batches([s.total_length for s in samples], dp_size=2, max_tokens_per_gpu=32)
    mine = [samples[i].effective_loss_mask() for i in plan.rank_samples(rank)]
    d = compute_loss_denominators(mine, group=dist.group.WORLD)
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(d.__dict__, f)
    dist.destroy_process_group()
""")


def test_denominators_all_reduce_over_dp_group(tmp_path):
    script = tmp_path / "dens.py"
    script.write_text(SCRIPT)
    torchrun(script, nproc=2, args=[str(tmp_path)], timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    total_tokens = sum(n // 2 for n in (4, 9, 16, 25, 6, 3, 11))
    for d in got:
        assert d["global_tokens"] == total_tokens and d["global_samples"] == 7
    assert got[0]["local_tokens"] + got[1]["local_tokens"] == total_tokens
    assert got[0]["local_samples"] + got[1]["local_samples"] == 7
    assert {got[0]["local_samples"], got[1]["local_samples"]} == {3, 4}
