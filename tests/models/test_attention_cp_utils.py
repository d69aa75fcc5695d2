"""cp_utils: padding, megatron's load-balanced CP chunking, shard/unshard round trip."""

import pytest
import torch

from megatron_rl.errors import ConfigError
from megatron_rl.models import cp_utils


def cu_of(lengths, dtype=torch.int32):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype)


def test_pad_multiple():
    assert cp_utils.cp_pad_multiple(1) == 1
    assert cp_utils.cp_pad_multiple(2) == 4
    assert cp_utils.cp_pad_multiple(2, tp_size=2) == 4
    assert cp_utils.cp_pad_multiple(2, tp_size=2, sequence_parallel=True) == 8
    assert cp_utils.cp_pad_multiple(1, tp_size=4, sequence_parallel=True) == 4


def test_pad_packed_appends_tail_padding():
    cu = cu_of([3, 4, 0, 1])
    x = torch.arange(1, 9).float()
    padded, cu_pad = cp_utils.pad_packed(x, cu, 4, pad_value=-1)
    assert cu_pad.tolist() == [0, 4, 8, 8, 12] and cu_pad.dtype == torch.int32
    assert padded.tolist() == [1, 2, 3, -1, 4, 5, 6, 7, 8, -1, -1, -1]
    # 2-D with a non-zero token dim
    y = torch.arange(16).view(2, 8)
    py, _ = cp_utils.pad_packed(y, cu, 4, dim=1)
    assert py.shape == (2, 12) and py[1, :4].tolist() == [8, 9, 10, 0]


def test_local_index_is_megatron_chunking():
    """One sequence: rank r holds chunks r and 2cp-1-r, same as get_batch_on_this_cp_rank."""
    seq = torch.arange(16)
    cu = cu_of([16])
    for cp_size in (1, 2, 4):
        for r in range(cp_size):
            idx = cp_utils.cp_local_index(cu, r, cp_size)
            assert torch.equal(seq[idx], cp_utils.shard_sbhd_for_cp(seq, 0, r, cp_size))
    assert cp_utils.cp_local_index(cu, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_utils.cp_local_index(cu, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp_size):
    lengths = [5, 1, 12, 7, 0, 2]
    cu = cu_of(lengths)
    x = torch.randn(int(cu[-1]), 3)
    xp, cu_pad = cp_utils.pad_packed(x, cu, cp_utils.cp_pad_multiple(cp_size))
    shards = [cp_utils.shard_packed_for_cp(xp, cu_pad, r, cp_size) for r in range(cp_size)]
    for r, sh in enumerate(shards):
        assert sh.tensor.size(0) * cp_size == xp.size(0)
        assert sh.cu_seqlens_local.tolist() == (cu_pad // cp_size).tolist()
        assert torch.equal(sh.tensor, xp[sh.global_index])
        # positions restart at 0 in every sequence and match the chunk layout
        for i, (a, b) in enumerate(zip(sh.cu_seqlens_local[:-1].tolist(), sh.cu_seqlens_local[1:].tolist())):
            L = int(cu_pad[i + 1] - cu_pad[i])
            c = L // (2 * cp_size)
            want = list(range(r * c, (r + 1) * c)) + list(range((2 * cp_size - 1 - r) * c, (2 * cp_size - r) * c))
            if cp_size == 1:
                want = list(range(L))
            assert sh.position_ids[a:b].tolist() == want
    back = cp_utils.unshard_packed_from_cp([s.tensor for s in shards], cu_pad)
    assert torch.equal(back, xp)
    perm = cp_utils.cp_gather_permutation(cu_pad, cp_size)
    assert torch.equal(torch.cat([s.tensor for s in shards])[perm], xp)


def test_make_packed_seq_params_conventions():
    cu = cu_of([3, 5])
    cu_pad = cu_of([4, 8])
    p = cp_utils.make_packed_seq_params(cu_pad)
    assert p.qkv_format == "thd" and p.cu_seqlens_q_padded is None
    assert p.cu_seqlens_q.tolist() == [0, 4, 12] and p.max_seqlen_q == 8
    p = cp_utils.make_packed_seq_params(cu_pad, cu)
    assert p.cu_seqlens_q.tolist() == [0, 3, 8] and p.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert p.cu_seqlens_kv_padded.tolist() == [0, 4, 12] and p.max_seqlen_kv == 8
    assert p.cu_seqlens_q.dtype == torch.int32


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="pad_packed"):
        cp_utils.shard_packed_for_cp(torch.zeros(6), cu_of([6]), 0, 2)
    with pytest.raises(ConfigError, match="cu_seqlens\\[-1\\]"):
        cp_utils.shard_packed_for_cp(torch.zeros(5), cu_of([8]), 0, 2)
    with pytest.raises(ConfigError, match="cp_rank"):
        cp_utils.cp_local_index(cu_of([8]), 2, 2)
    with pytest.raises(ConfigError, match="start at 0"):
        cp_utils.pad_packed(torch.zeros(4), torch.tensor([1, 4]), 2)
    with pytest.raises(ConfigError, match="multiple of 4"):
        cp_utils.shard_sbhd_for_cp(torch.zeros(6, 2), 0, 0, 2)
