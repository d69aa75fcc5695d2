"""Batch-invariant ops (megatron_rl.ops.batch_invariant): a row's bits do not depend on the batch around it.

Each test compares bitwise (``torch.equal``), in fp32 and bf16: batch size, the row's position, the other
rows' contents, padding (left, right, a padded vocabulary) and, for attention, a KV-cache decode step
against the full-sequence forward."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.ops import batch_invariant
from megatron_rl.ops.batch_invariant import batch_invariant_mode, invariant_matmul, is_enabled

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_batch_size_position_or_neighbours(dtype):
    w, x = _rand(150, 256, dtype=dtype), _rand(40, 256, dtype=dtype, seed=1)
    with batch_invariant_mode():
        full = F.linear(x, w)
        for m in (1, 2, 3, 5, 7, 9):  # MKL's shape-dependent kernels differ at these sizes without the mode
            for start in (0, 40 - m):
                assert torch.equal(F.linear(x[start:start + m], w), full[start:start + m]), (m, start)
        other = x.clone()
        other[1:] = _rand(39, 256, dtype=dtype, seed=2)
        assert torch.equal(F.linear(other, w)[0], full[0])  # other rows' contents
        assert torch.equal(x @ w.t(), full) and torch.equal(torch.matmul(x, w.t()), full)
        # a column block of the weight (megatron's fused q/k/v, gate/up vs HF's separate projections)
        assert torch.equal(F.linear(x, w[37:120]), full[:, 37:120])
        b = _rand(150, dtype=dtype, seed=3)
        assert torch.equal(F.linear(x[5:6], w, b), F.linear(x, w, b)[5:6])


def test_without_the_mode_mkl_is_not_invariant_and_the_mode_is_scoped():
    w, x = _rand(64, 512, dtype=torch.float32), _rand(64, 512, dtype=torch.float32, seed=1)
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 5, 6, 7, 9))
    assert not is_enabled()
    with batch_invariant_mode():
        assert is_enabled()
        with batch_invariant_mode(False):
            assert is_enabled()  # enabled=False nests as a no-op
    assert not is_enabled()


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_matmul_is_invariant_to_batch_count(dtype, monkeypatch):
    a, b = _rand(6, 4, 21, 16, dtype=dtype), _rand(6, 4, 16, 33, dtype=dtype, seed=1)
    full = invariant_matmul(a, b)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(full.float(), (a @ b).float(), atol=tol, rtol=tol)  # the product itself, tiles put back
    assert torch.allclose(invariant_matmul(a, b[0, 0]).float(), (a @ b[0, 0]).float(), atol=tol, rtol=tol)
    assert torch.equal(invariant_matmul(a[2:3, 1:2, 5:6], b[2:3, 1:2]), full[2:3, 1:2, 5:6])
    assert torch.equal(invariant_matmul(a[0, 0], b[0, 0]), full[0, 0])
    assert invariant_matmul(a[0, 0, 0], b[0, 0]).shape == (33,)
    # row tiles grouped by the right operand's copy budget (a large weight: one tile a call) give the same bits
    x, w = _rand(70, 32, dtype=dtype, seed=2), _rand(32, 150, dtype=dtype, seed=3)
    whole = invariant_matmul(x, w)
    monkeypatch.setattr(batch_invariant, "RHS_COPY_BYTES", 2 * w.numel() * w.element_size())
    assert torch.equal(invariant_matmul(x, w), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_over_the_last_dim_ignore_batch_and_padded_vocab(dtype):
    x = _rand(9, 1000, dtype=dtype) * 4
    padded = torch.cat([x, torch.full((9, 24), float("-inf"), dtype=dtype)], dim=-1)  # megatron's vocab padding
    with batch_invariant_mode():
        ls = torch.log_softmax(x.float(), dim=-1)
        assert torch.equal(torch.log_softmax(x[4:5].float(), -1)[0], ls[4])
        assert torch.equal(F.log_softmax(padded.float(), dim=-1)[:, :1000], ls)
        assert torch.equal(x.float().softmax(-1)[2], torch.softmax(x[2:3].float(), dim=-1)[0])
        assert torch.equal(torch.logsumexp(padded.float(), -1), torch.logsumexp(x.float(), dim=-1))
        mean = x.float().pow(2).mean(-1, keepdim=True)
        assert torch.equal(x[3:5].float().pow(2).mean(-1, keepdim=True), mean[3:5])
        w = _rand(1000, dtype=dtype, seed=4)
        norm = F.rms_norm(x, (1000,), w, 1e-6)
        # HF's RMSNorm, written out (LlamaRMSNorm / Qwen3RMSNorm), gives the same bits as torch's RMSNorm
        h = x.to(torch.float32)
        hf = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        assert torch.equal(norm, hf)
        assert torch.equal(F.rms_norm(x[6:7], (1000,), w, 1e-6)[0], norm[6])
        assert ls.dtype == torch.float32 and torch.allclose(ls, torch.log_softmax(x.float(), -1).detach(), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_prefill_with_padding_and_packing(dtype):
    b, hq, hk, n, d = 3, 4, 2, 37, 16
    q, k, v = _rand(b, hq, n, d, dtype=dtype), _rand(b, hk, n, d, dtype=dtype, seed=1), _rand(b, hk, n, d, dtype=dtype, seed=2)
    with batch_invariant_mode():
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        for t in (0, 5, 15, 16, 17, 36):
            # a KV-cache decode of position t: one query against the t+1 keys so far
            step = F.scaled_dot_product_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], enable_gqa=True)
            assert torch.equal(step[:, :, 0], full[:, :, t]), t
            # left-padded by 3 in a cache of larger capacity (the embedded engine's layout), alone in its batch
            pad = 3
            kp, vp = F.pad(k[1:2, :, :t + 1], (0, 0, pad, 0)), F.pad(v[1:2, :, :t + 1], (0, 0, pad, 0))
            mask = torch.zeros(1, 1, 1, t + 1 + pad, dtype=torch.bool)
            mask[..., pad:] = True
            step = F.scaled_dot_product_attention(q[1:2, :, t:t + 1], kp, vp, attn_mask=mask, enable_gqa=True)
            assert torch.equal(step[0, :, 0], full[1, :, t]), t
        # right padding inside a packed group (megatron's THD buckets): a shorter sequence, keys past its end hidden
        short = F.scaled_dot_product_attention(q[:1, :, :20], k[:1, :, :20], v[:1, :, :20], is_causal=True,
                                               enable_gqa=True)
        assert torch.equal(short[0], full[0, :, :20])
        # a query that sees no key gives 0, not NaN
        none = torch.zeros(1, 1, 1, n, dtype=torch.bool)
        assert torch.equal(F.scaled_dot_product_attention(q[:1, :, :1], k[:1], v[:1], attn_mask=none, enable_gqa=True),
                           torch.zeros(1, hq, 1, d, dtype=dtype))
    expect = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert torch.allclose(ref, expect, atol=1e-5)


def test_attention_refuses_masks_it_cannot_make_invariant():
    q = k = v = _rand(1, 1, 4, 8, dtype=torch.float32)
    holes = torch.tensor([[True, False, True, True]]).expand(4, 4)
    with batch_invariant_mode(), pytest.raises(NotImplementedError, match="contiguous run"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=holes)
    with batch_invariant_mode(), pytest.raises(NotImplementedError, match="dropout"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_gradients_flow_through_the_invariant_forms():
    x = _rand(5, 32, dtype=torch.float32).requires_grad_()
    w = _rand(8, 32, dtype=torch.float32, seed=1).requires_grad_()
    with batch_invariant_mode():
        loss = torch.log_softmax(F.linear(x, w), dim=-1)[:, 0].sum()
    loss.backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.log_softmax(F.linear(x2, w2), dim=-1)[:, 0].sum().backward()
    assert x.grad is not None and w.grad is not None
    assert torch.allclose(x.grad, x2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)
