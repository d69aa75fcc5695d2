"""The output projection fused into the log-prob op by row chunks (ops/linear_logprob.py) against the unfused path:
the output layer's logits (``F.linear``) through ``ops.logprobs_and_entropy``."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.ops import linear_logprobs_and_entropy, logprobs_and_entropy
from megatron_rl.ops.linear_logprob import MIN_TAIL_ROWS, row_chunks


def _case(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    return hidden, weight, torch.Generator().manual_seed(seed + 1)


def _both(hidden, weight, target, g_lp, g_h, **kw):
    """(values, hidden grad, weight grad) of the unfused path and of the fused one."""
    out = []
    for fused in (False, True):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            lp, ent = linear_logprobs_and_entropy(x, w, target, **kw)
        else:
            lp, ent = logprobs_and_entropy(F.linear(x, w), target, **kw)
        loss = (lp * g_lp).sum() + ((ent * g_h).sum() if ent is not None else 0.0)
        gx, gw = torch.autograd.grad(loss, [x, w])
        out.append(((lp.detach(), None if ent is None else ent.detach()), gx, gw))
    return out


@pytest.mark.parametrize("chunk_size,with_entropy", [(None, True), (37, True), (37, False)])  # 37: ragged tail
def test_bf16_values_and_hidden_grad_bitwise_weight_grad_within_one_rounding(chunk_size, with_entropy):
    """bf16, the training dtype: log-probs, entropy and the hidden rows' gradient are the unfused path's bit
    for bit (same matmul per row, same per-chunk arithmetic); the weight's gradient is one bf16 matmul per
    chunk summed in float32: bitwise with one chunk, within bf16 roundings of the partial sums with more."""
    n, h, v, real = 150, 32, 1501, 1400  # megatron's vocab padding: columns >= 1400
    hidden, weight, g = _case(n, h, v, torch.bfloat16)
    target = torch.randint(0, real, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    (v0, gx0, gw0), (v1, gx1, gw1) = _both(hidden, weight, target, g_lp, g_h if with_entropy else None,
                                           temperature=0.7, chunk_size=chunk_size, with_entropy=with_entropy,
                                           vocab_size=real)
    assert torch.equal(v0[0], v1[0])
    assert (v1[1] is None) == (not with_entropy) and (v1[1] is None or torch.equal(v0[1], v1[1]))
    assert torch.equal(gx0, gx1)
    assert not gw1[real:].any()  # padding columns: no gradient
    if chunk_size is None:
        assert torch.equal(gw0, gw1)
    # each chunk's partial sum rounded to bf16 where the unfused matmul rounds only the total: within a
    # rounding of each element plus one of the gradient's scale (a partial can be larger than the total)
    ref = gw0.float()
    err = (ref - gw1.float()).abs()
    assert (err <= ref.abs() * 2 ** -7 + ref.abs().max() * 2 ** -8).all(), err.max()


def test_fp32_within_float32_rounding_of_the_unfused_path():
    """float32: CPU BLAS picks its kernel by row count, so a chunk's logits may differ in the last bit
    from the one-call projection's; values stay within float32 rounding, gradients too."""
    n, h, v = 75, 16, 2000
    hidden, weight, g = _case(n, h, v, torch.float32, seed=3)
    target = torch.randint(0, v, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    (v0, gx0, gw0), (v1, gx1, gw1) = _both(hidden, weight, target, g_lp, g_h, chunk_size=11, with_entropy=True)
    torch.testing.assert_close(v1[0], v0[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(v1[1], v0[1], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-6)


def test_only_hidden_rows_weight_and_row_stats_are_saved():
    """What the backward keeps: the hidden rows, the weight, targets and per-row statistics; no
    ``[n, V]`` tensor (the logits are projected again, chunk by chunk, in the backward)."""
    n, h, v = 64, 8, 4096
    hidden, weight, g = _case(n, h, v, torch.bfloat16)
    target = torch.randint(0, v, (n,), generator=g)
    saved = []
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        lp, ent = linear_logprobs_and_entropy(x, w, target, chunk_size=16, with_entropy=True)
    assert saved and max(saved) <= max(n * h, v * h) and sum(saved) <= n * h + v * h + 4 * n, saved
    (lp.sum() + ent.sum()).backward()
    assert x.grad is not None and w.grad is not None and w.grad.dtype == torch.bfloat16


def test_frozen_weight_no_grad_and_errors():
    n, h, v = 20, 8, 300
    hidden, weight, g = _case(n, h, v, torch.float32)
    target = torch.randint(0, v, (n,), generator=g)
    x = hidden.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(x, weight, target)  # a frozen output layer (LoRA, a frozen role)
    assert ent is None
    lp.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(linear_logprobs_and_entropy(hidden, weight, target)[0], lp.detach())
    with pytest.raises(ValueError, match="target id range"):
        linear_logprobs_and_entropy(hidden, weight, target + v)
    with pytest.raises(ValueError, match=r"hidden \(20, 8\) must be \[n, h\]"):
        linear_logprobs_and_entropy(hidden, weight[:, :4], target)


def test_row_chunks_merge_a_small_tail():
    assert row_chunks(0, 4) == []
    assert row_chunks(5, 110) == [(0, 5)]
    assert row_chunks(113, 110) == [(0, 113)]  # a 3-row tail joins the chunk before it
    assert row_chunks(230, 110) == [(0, 110), (110, 220), (220, 230)]
    assert all(e - s >= MIN_TAIL_ROWS for s, e in row_chunks(1543, 110))
