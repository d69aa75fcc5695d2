"""The gated delta-net pieces of megatron_rl.models.gated_delta against HF Qwen3-Next's own torch reference
(``torch_chunk_gated_delta_rule``, ``causal_conv1d_fn``): packed sequences restart exactly at cu_seqlens."""

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from megatron_rl.models import gated_delta


class _Packed:  # the PackedSeqParams fields sequence_starts reads
    def __init__(self, real, padded=None):
        self.cu_seqlens_q = torch.tensor(real, dtype=torch.int32)
        self.cu_seqlens_q_padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)


def test_sequence_starts_follow_the_padded_layout():
    start, valid = gated_delta.sequence_starts(9, _Packed([0, 3, 5], [0, 4, 9]), "cpu")
    assert start.tolist() == [0, 0, 0, 0, 4, 4, 4, 4, 4]
    assert valid.tolist() == [True, True, True, False, True, True, False, False, False]
    with pytest.raises(ValueError, match="context parallelism"):
        gated_delta.sequence_starts(5, _Packed([0, 3, 9]), "cpu")


def test_packed_conv_and_recurrence_equal_hf_per_sequence():
    """Three sequences packed in one row vs HF's chunked rule (chunk 64 > lengths: one chunk; and chunk 4:
    several) and F.conv1d on each sequence alone: <= 1e-5 in float32 (value heads 2 per key head)."""
    gen = torch.Generator().manual_seed(0)
    lengths, nk, nv, dk, dv, kernel = [7, 1, 12], 2, 4, 8, 12, 4
    total = sum(lengths)
    cu = [0, 7, 8, 20]
    x = torch.randn(1, total, 2 * nk * dk + nv * dv, generator=gen)
    weight = torch.randn(x.shape[-1], kernel, generator=gen) * 0.5
    start, _ = gated_delta.sequence_starts(total, _Packed(cu), "cpu")
    conv = gated_delta.causal_conv1d(x, weight, start)
    q = torch.randn(1, total, nk, dk, generator=gen)
    k = torch.randn(1, total, nk, dk, generator=gen)
    v = torch.randn(1, total, nv, dv, generator=gen)
    g = -torch.rand(1, total, nv, generator=gen) * 2
    beta = torch.rand(1, total, nv, generator=gen)
    r = nv // nk
    ours = gated_delta.gated_delta_rule(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, g, beta, start)
    assert ours.shape == v.shape
    for a, b in zip(cu[:-1], cu[1:]):
        ref_conv = hf.causal_conv1d_fn(x[:, a:b].transpose(1, 2), weight, None).transpose(1, 2)
        assert (conv[:, a:b] - ref_conv).abs().max() <= 1e-5
        for chunk in (64, 4):
            ref, _ = hf.torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                                     chunk_size=chunk, use_qk_l2norm_in_kernel=True)
            assert (ours[:, a:b] - ref).abs().max() <= 1e-5, (a, b, chunk)
