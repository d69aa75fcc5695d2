"""Worker for tests/dist/test_data_movement.py: rollout-batch broadcast and per-sample gather.

Job ``data_movement`` of tests/dist/harness.py (4 ranks): argv = OUT_DIR
Ranks play a TP2 x DP2 layout (tp = rank % 2, dp = rank // 2) in which only the
TP-rank-0 ranks hold results, as in MegatronBackend. Each rank writes what it
checked (and any error message) to OUT_DIR/rank{R}.json.
"""

import json
import os

import torch
import torch.distributed as dist

from megatron_rl.backends.base import broadcast_samples
from megatron_rl.backends.per_sample import find_holder_ranks, gather_per_sample, share_with_peers
from megatron_rl.data.packing import plan_dynamic_micro_batches
from megatron_rl.data.types import Sample
from megatron_rl.errors import BackendError


def make_samples(n=40):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        r = 0 if i % 7 == 0 else int(torch.randint(1, 9, (1,), generator=g))
        mask = torch.randint(0, 2, (r,), generator=g).tolist() if i % 3 == 0 else []  # multi-turn masks
        out.append(Sample(group_index=i // 4, prompt_ids=torch.randint(0, 500, (5,), generator=g).tolist(),
                          response_ids=torch.randint(0, 500, (r,), generator=g).tolist(),
                          rollout_logprobs=(-torch.rand(r, generator=g, dtype=torch.float64)).tolist(),
                          loss_mask=mask, reward=float(torch.rand(1, generator=g)), finish_reason="stop",
                          weight_version=3, label=str(i), prompt_text=f"p{i}", metadata={"i": i}))
    return out


def logprob(i: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + i))  # what a forward would give


def main(argv):
    out_dir = argv[0]
    rank = dist.get_rank()
    tp, dp = rank % 2, rank // 2
    result = {}
    samples = make_samples()
    got = broadcast_samples(samples if rank == 0 else None)
    result["broadcast_equal"] = got == samples and all(
        type(a.reward) is type(b.reward) and type(a.label) is type(b.label) for a, b in zip(got, samples))
    try:
        broadcast_samples(None)
    except BackendError as exc:
        result["broadcast_none_error"] = str(exc)

    plan = plan_dynamic_micro_batches([s.total_length for s in samples], dp_size=2, max_tokens_per_gpu=40)
    holdings = [[i for mb in plan.rank(d) for i in mb] for d in range(2)]
    lengths = [s.response_length for s in samples]
    # every TP rank computes the same results; TP rank 1 gets different numbers here to prove they are not read
    local = {i: logprob(i, lengths[i]) + (0 if tp == 0 else 1) for i in holdings[dp]}
    holder_ranks = find_holder_ranks(dp if tp == 0 else None, 2)
    result["holder_ranks"] = holder_ranks
    gathered = gather_per_sample(local, holdings, holder_ranks, lengths)
    result["gather_bitwise"] = all(torch.equal(t, logprob(i, lengths[i])) and t.dtype == torch.float32
                                   for i, t in enumerate(gathered))
    result["gather_lengths"] = [t.numel() for t in gathered] == lengths

    broken = {k: v for k, v in local.items() if not (dp == 1 and k == holdings[1][-1])}
    try:
        gather_per_sample(broken, holdings, holder_ranks, lengths)
    except BackendError as exc:
        result["gather_missing_error"] = str(exc)

    # owner-aligned: each DP rank's holder shares its samples with its TP peer only (None elsewhere)
    from megatron_rl.backends.base import data_parallel_peers

    leaders, group = data_parallel_peers(dp, 2)
    result["leaders"] = leaders
    mine = share_with_peers(local, holdings[dp], holder_ranks[dp], lengths, group=group)
    result["share_bitwise"] = all((t is not None and torch.equal(t, logprob(i, lengths[i]))) if i in holdings[dp]
                                  else t is None for i, t in enumerate(mine))
    try:
        share_with_peers(broken, holdings[dp], holder_ranks[dp], lengths, group=group)
        result["share_missing_error"] = None
    except BackendError as exc:
        result["share_missing_error"] = str(exc)

    # the rollout batch by data-parallel share (rollout_shards.distribute_rollout), with a backend
    # that has only the shared planning machinery, in this TP2 x DP2 layout
    from types import SimpleNamespace

    from megatron_rl.backends.base import DataParallelShare
    from megatron_rl.backends.rollout_shards import distribute_rollout
    from megatron_rl.data.types import HeldElsewhereError, SampleStub

    class Planner(DataParallelShare):  # the shared data-parallel planning, without a model
        pass

    backend = Planner()
    backend.dp_rank, backend.dp_size, backend.pad_to_multiple = dp, 2, 1
    backend.cfg = SimpleNamespace(batching=SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=40),
                                  parallel=SimpleNamespace(context_parallel_size=1))
    batch, rollout_plan = distribute_rollout(samples if rank == 0 else None, backend, 16)
    expect = backend.plan_rollout(samples, 16)  # what the full batch plans to
    owned = set(expect.forward.rank_samples(dp))
    result["shard_plan_equal"] = rollout_plan == expect
    result["shard_owned_equal"] = all(batch[i] == samples[i] for i in owned)
    stubs = [(i, b) for i, b in enumerate(batch) if i not in owned]
    result["shard_stubs"] = len(stubs) == len(samples) - len(owned) and all(
        isinstance(b, SampleStub) and b.owner == 1 - dp and b.total_length == samples[i].total_length
        and b.response_length == samples[i].response_length and b.reward == samples[i].reward
        and b.group_index == samples[i].group_index and b.effective_loss_mask() == samples[i].effective_loss_mask()
        and b.num_rollout_logprobs == len(samples[i].rollout_logprobs) for i, b in stubs)
    try:
        _ = stubs[0][1].response_ids  # a stub's tokens: must raise
        result["stub_tokens_error"] = None
    except HeldElsewhereError as exc:
        result["stub_tokens_error"] = str(exc)
    try:
        distribute_rollout(None, backend, 16)
    except BackendError as exc:
        result["shard_none_error"] = str(exc)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
