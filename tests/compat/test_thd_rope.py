"""The packed-sequence RoPE patch (compat.patches.patch_thd_rope_gather) is bitwise megatron's own.

Megatron's ``_apply_rotary_pos_emb_thd`` is kept as ``.original``; both run on the same
inputs: sequences of many lengths (1 included), context parallelism 1/2/4 on every rank,
freqs covering the longest sequence or every packed position (offset mode), interleaved
RoPE, partial rotary dims, bf16 inputs. ``torch.equal``: not close, identical.
"""

import pytest
import torch

from megatron_rl.compat import apply_cpu_compat


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture(scope="module")
def rope():
    apply_cpu_compat()
    from megatron.core.models.common.embeddings import rope_utils

    patched = rope_utils._apply_rotary_pos_emb_thd
    assert getattr(patched, "_megatron_rl_compat", False), "the patch is applied on CPU hosts"
    return patched, patched.original


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("interleaved,rot_dim,dtype", [(False, 16, torch.float32), (True, 16, torch.float32),
                                                       (False, 8, torch.float32), (False, 16, torch.bfloat16)])
def test_patched_thd_rope_is_bitwise_megatrons(rope, cp, offsets, interleaved, rot_dim, dtype):
    patched, original = rope
    g = torch.Generator().manual_seed(cp * 10 + offsets)
    lengths = [2 * cp * n for n in (1, 3, 7, 2, 11, 1, 5)] if cp > 1 else [1, 3, 7, 2, 11, 1, 5, 64]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    rows = int(cu[-1]) if offsets else max(lengths)
    freqs = torch.randn(rows, 1, 1, rot_dim, generator=g) * 3
    for rank in range(cp):
        t = torch.randn(int(cu[-1]) // cp, 4, 16, generator=g).to(dtype).requires_grad_()
        want = original(t, cu, freqs, interleaved, False, 1.0, _Group(cp, rank))
        got = patched(t, cu, freqs, rotary_interleaved=interleaved, mscale=1.0, cp_group=_Group(cp, rank))
        assert got.dtype == want.dtype and torch.equal(got, want)
        upstream = torch.randn(want.shape, generator=g).to(dtype)  # and the gradient, bit for bit
        assert torch.equal(*(torch.autograd.grad(out, t, upstream)[0] for out in (got, want)))


def test_shapes_megatron_would_reject_still_reach_megatron(rope):
    patched, _ = rope
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError):  # t holds fewer tokens than cu_seqlens says: megatron's split fails
        patched(torch.randn(7, 2, 8), cu, torch.randn(16, 1, 1, 8), cp_group=_Group(1, 0))
    with pytest.raises(ValueError, match="cp_group must be provided"):
        patched(torch.randn(10, 2, 8), cu, torch.randn(16, 1, 1, 8), cp_group=None)


def test_cos_sin_derived_once_per_micro_batch_and_still_bitwise(rope):
    """q and k of every layer share (cu_seqlens, freqs): the rows and cos/sin are built once for them, and a
    new micro-batch (new tensors) builds again; mscale and the MLA layout stay megatron's, bit for bit."""
    patched, original = rope
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 3, 10, 11, 19], dtype=torch.int32)
    freqs = torch.randn(19, 1, 1, 16, generator=g)
    before = patched.memo.builds
    for _layer in range(3):
        for heads in (4, 2):  # q, then k with fewer heads
            for mla in (False, True):
                t = torch.randn(19, heads, 16, generator=g)
                want = original(t, cu, freqs, False, mla, 0.7, _Group(1, 0))
                got = patched(t, cu, freqs, multi_latent_attention=mla, mscale=0.7, cp_group=_Group(1, 0))
                assert torch.equal(got, want)
    assert patched.memo.builds == before + 1
    cu2 = cu.clone()
    t = torch.randn(19, 4, 16, generator=g)
    assert torch.equal(patched(t, cu2, freqs, mscale=0.7, cp_group=_Group(1, 0)),
                       original(t, cu2, freqs, False, False, 0.7, _Group(1, 0)))
    assert patched.memo.builds == before + 2
