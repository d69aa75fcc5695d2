"""``gather_per_sample`` at world size 1: no collective, the holder's own tensors, clear errors."""

import pytest
import torch

from megatron_rl.backends.per_sample import gather_per_sample
from megatron_rl.errors import BackendError


def test_single_rank_returns_local_tensors_in_sample_order():
    local = {i: torch.randn(n) for i, n in enumerate([3, 0, 2])}
    out = gather_per_sample(local, [[2, 0, 1]], [0], [3, 0, 2])
    assert [t is local[i] for i, t in enumerate(out)] == [True] * 3


def test_single_rank_missing_or_wrong_length_sample_is_named():
    with pytest.raises(BackendError, match=r"no log-probs for samples \[1\]"):
        gather_per_sample({0: torch.zeros(2)}, [[0, 1]], [0], [2, 1])
    with pytest.raises(BackendError, match=r"wrong length for samples \[0\]"):
        gather_per_sample({0: torch.zeros(3), 1: torch.zeros(1)}, [[0, 1]], [0], [2, 1])


def test_share_with_peers_alone_keeps_own_samples_and_none_elsewhere():
    from megatron_rl.backends.per_sample import share_with_peers

    local = {1: torch.tensor([1.0, 2.0]), 3: torch.tensor([3.0])}
    got = share_with_peers(local, [3, 1], 0, [4, 2, 1, 1])
    assert got[0] is None and got[2] is None and got[1] is local[1] and got[3] is local[3]
    with pytest.raises(BackendError, match=r"forward produced no log-probs for samples \[2\]"):
        share_with_peers(local, [1, 2], 0, [4, 2, 1, 1])
