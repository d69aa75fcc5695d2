"""The driver's rollout batch to the training ranks: each data-parallel rank receives only its share.

Why: broadcasting the whole batch makes every rank receive and decode every
sample (token ids, masks, log-probs, texts), although it trains on 1/DP of them.
Here the driver sends, in this order:

1. to every rank: the headers of all samples (``sample_codec.encode_headers``:
   lengths, reward, group, loss mask, number of rollout log-probs; about a tenth
   of the batch). From the lengths every rank computes the same ``RolloutPlan``
   (``TrainBackend.plan_rollout``, no communication), hence who trains on what;
2. to the first rank of each data-parallel index (its "leader"): that DP rank's
   samples, whole (``sample_codec.encode``), point to point;
3. within each DP index's peers (TP / PP / CP ranks of the same DP rank): one
   broadcast of that share from the leader.

Every rank ends with the batch as a list in rollout order: ``Sample`` for the
samples its DP rank trains on, ``SampleStub`` for the others. The driver's list
is built the same way, so a caller that reads another rank's tokens fails on
every rank alike instead of working on the driver only. With one training rank,
or when the algorithm needs every sample's log-probs for its advantages (KL
folded into the reward), the whole batch goes to every rank
(``base.broadcast_samples``). An empty or missing batch on the driver is
signalled in the first message, so every rank raises together.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_rl.backends.base import RolloutPlan, TrainBackend, broadcast_samples
from megatron_rl.data import sample_codec
from megatron_rl.data.types import AnySample, Sample
from megatron_rl.errors import BackendError
from megatron_rl.infra.dist import recv_sized, send_sized


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _bcast_buffer(sizes: Optional[torch.Tensor], buffer: Optional[torch.Tensor], src: int,
                  group) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    sizes = sizes if sizes is not None else torch.empty(2, dtype=torch.int64)
    dist.broadcast(sizes, src=src, group=group)
    if buffer is None:
        buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return sizes, buffer


def distribute_rollout(samples: Optional[Sequence[Sample]], backend: TrainBackend, global_batch_size: int, *,
                       whole: bool = False, src: int = 0) -> tuple[list[AnySample], Optional[RolloutPlan]]:
    """``(batch, plan)`` on every training rank; ``samples`` is the driver's batch (None elsewhere).

    ``whole``: every rank gets every sample (then ``plan`` is None: the caller plans as it likes).
    Collective over the whole training world.
    """
    import torch.distributed as dist

    if _world() == 1 or whole:
        whole_batch: list[AnySample] = list(broadcast_samples(None if samples is None else list(samples), src=src))
        return whole_batch, None
    me = dist.get_rank()
    if me == src:
        sizes, buffer = (sample_codec.encode_headers(samples) if samples else
                         (torch.full((2,), -1, dtype=torch.int64), None))
    else:
        sizes, buffer = torch.empty(2, dtype=torch.int64), None
    dist.broadcast(sizes, src=src)
    if int(sizes[0]) < 0:
        raise BackendError(f"distribute_rollout: the driver rank (rank {src}) passed no samples")
    if buffer is None:
        buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src)
    stubs = sample_codec.decode_headers(sizes, buffer)
    plan = backend.plan_rollout(stubs, global_batch_size)
    shares = [plan.forward.rank_samples(d) for d in range(plan.forward.dp_size)]
    for d, share in enumerate(shares):
        for i in share:
            stubs[i].owner = d
    batch: list[AnySample] = list(stubs)
    leaders, group = backend.data_parallel_peers()
    mine = backend.dp_rank
    own: Optional[list[Sample]]
    if me == src:
        assert samples is not None, "the counts are not -1: the driver had samples"
        for d, leader in enumerate(leaders):
            if leader != src:
                send_sized(*sample_codec.encode([samples[i] for i in shares[d]]), leader)
        own = [samples[i] for i in shares[mine]]
    else:
        own = None
        if me == leaders[mine]:
            own = sample_codec.decode(*recv_sized(src))
    if group is not None:  # the leader gives the share to its TP/PP/CP peers
        if me == leaders[mine]:
            assert own is not None, "a leader has its share (the driver's own, or received above)"
            _bcast_buffer(*sample_codec.encode(own), src=me, group=group)
        else:
            own = sample_codec.decode(*_bcast_buffer(None, None, src=leaders[mine], group=group))
    assert own is not None, "with no peers every rank leads its data-parallel rank and has received its share"
    if len(own) != len(shares[mine]):
        raise BackendError(f"distribute_rollout: data-parallel rank {mine} expected {len(shares[mine])} samples, "
                           f"received {len(own)}")
    for i, sample in zip(shares[mine], own):
        batch[i] = sample
    return batch, plan


__all__ = ["distribute_rollout", "AnySample"]
