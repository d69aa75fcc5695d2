"""Single-device path of the chunked log-prob/entropy op against full-vocab log_softmax."""

import pytest
import torch

from megatron_rl.ops import available_backends, logprobs_and_entropy, naive_logprobs


def _case(n=29, v=53, seed=0, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_h = torch.randn(n, generator=g, dtype=torch.float64)
    return logits, target, g_lp, g_h


def _run(fn, logits, target, g_lp, g_h, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, target, **kw)
    loss = (lp.double() * g_lp).sum() + ((h.double() * g_h).sum() if h is not None else 0.0)
    loss.backward()
    return lp.detach().double(), (h.detach().double() if h is not None else None), x.grad.double()


@pytest.mark.parametrize("chunk_size", [1, 7, 29, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_grads_match_log_softmax(chunk_size, temperature):
    logits, target, g_lp, g_h = _case()
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=temperature,
                       chunk_size=chunk_size, with_entropy=True)
    # Reference in float64: the op accumulates in float32, so tolerances are float32-level.
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, temperature=temperature,
                          with_entropy=True)
    assert torch.allclose(lp, rlp, atol=2e-6, rtol=1e-6)
    assert torch.allclose(h, rh, atol=2e-6, rtol=1e-6)
    assert torch.allclose(grad, rgrad, atol=2e-6, rtol=1e-5)


def test_logprob_only_and_unused_entropy_grad():
    logits, target, g_lp, g_h = _case(seed=1)
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, g_h * 0, chunk_size=5)
    assert h is None
    rlp, _, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h * 0)
    assert torch.allclose(lp, rlp, atol=2e-6) and torch.allclose(grad, rgrad, atol=2e-6)
    # with_entropy=True but only log-probs reach the loss: entropy grad is zero-materialised.
    x = logits.clone().requires_grad_()
    lp2, _ = logprobs_and_entropy(x, target, chunk_size=5, with_entropy=True)
    (lp2.double() * g_lp).sum().backward()
    assert torch.allclose(x.grad.double(), rgrad, atol=2e-6)


def test_bf16_logits_within_bf16_tolerance():
    logits, target, g_lp, g_h = _case(n=40, v=97, seed=2)
    bf = logits.to(torch.bfloat16)
    x = bf.clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, target, temperature=0.9, chunk_size=6, with_entropy=True)
    ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
    assert lp.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    # Same bf16 values upcast: only float32 accumulation differs.
    rlp, rh, rgrad = _run(naive_logprobs, bf.double(), target, g_lp, g_h, temperature=0.9, with_entropy=True)
    assert torch.allclose(lp.double(), rlp, atol=3e-6) and torch.allclose(h.double(), rh, atol=3e-6)
    # Gradient is rounded to bf16 once (8 bits of mantissa).
    assert torch.allclose(x.grad.double(), rgrad, atol=1e-2 * rgrad.abs().max().item(), rtol=1e-2)
    # Against the original float32 logits: bf16 input rounding dominates.
    flp, fh, _ = _run(naive_logprobs, logits.double(), target, g_lp, g_h, temperature=0.9, with_entropy=True)
    assert torch.allclose(lp.double(), flp, atol=0.1, rtol=0.02)
    assert torch.allclose(h.double(), fh, atol=0.05, rtol=0.02)


def test_leading_dims_and_minus_inf_logits():
    logits, target, g_lp, g_h = _case(n=12, v=20, seed=3)
    logits[:, 3] = -float("inf")  # e.g. a masked vocab column
    target[target == 3] = 4
    lp, h, grad = _run(logprobs_and_entropy, logits.view(3, 4, 20), target.view(3, 4), g_lp.view(3, 4),
                       g_h.view(3, 4), chunk_size=5, with_entropy=True)
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, with_entropy=True)
    assert lp.shape == (3, 4) and torch.isfinite(grad).all()
    assert torch.allclose(lp.view(-1), rlp, atol=2e-6) and torch.allclose(h.view(-1), rh, atol=2e-6)
    assert torch.allclose(grad.view(12, 20), rgrad, atol=2e-6)
    assert (grad.view(12, 20)[:, 3] == 0).all()


@pytest.mark.parametrize("chunk_size", [4, None])
def test_vocab_padding_never_enters_the_softmax(chunk_size):
    """vocab_size: megatron's padding columns hold garbage (not -inf) and change nothing; their gradient is 0."""
    logits, target, g_lp, g_h = _case(n=23, v=41, seed=6)
    padded = torch.cat([logits, torch.full((23, 23), 1e4)], dim=1)  # 41 real + 23 padding columns
    lp, h, grad = _run(logprobs_and_entropy, padded, target, g_lp, g_h, chunk_size=chunk_size, with_entropy=True,
                       vocab_size=41, temperature=0.8)
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, with_entropy=True, temperature=0.8)
    assert torch.allclose(lp, rlp, atol=2e-6) and torch.allclose(h, rh, atol=2e-6)
    assert torch.allclose(grad[:, :41], rgrad, atol=2e-6) and (grad[:, 41:] == 0).all()
    with pytest.raises(ValueError, match=r"outside the vocab \[0, 41\)"):
        logprobs_and_entropy(padded, torch.full((23,), 41), vocab_size=41)
    with pytest.raises(ValueError, match="vocab_size=65 must be in"):
        logprobs_and_entropy(padded, target, vocab_size=65)


def test_backward_saves_no_full_vocab_float32_copy():
    """The autograd graph keeps the logits themselves plus [N]-sized statistics only."""
    logits, target, _, _ = _case(n=64, v=301, seed=4, dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs_and_entropy(x, target, chunk_size=8, with_entropy=True)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() == x.data_ptr()
    assert sum(t.numel() for t in saved if t.numel() < x.numel()) <= 4 * 64


def test_bad_input_errors_name_the_value():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="target_ids shape"):
        logprobs_and_entropy(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature=0"):
        logprobs_and_entropy(logits, torch.zeros(4, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match=r"outside the vocab \[0, 10\)"):
        logprobs_and_entropy(logits, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="chunk_size=0"):
        logprobs_and_entropy(logits, torch.zeros(4, dtype=torch.long), chunk_size=0)
    # On CPU: torch, plus the C++ twins once built (prebuilt, or JIT-loaded by tests/ops/test_cpu_ext.py).
    from megatron_rl.ops import _ext
    assert available_backends() == ["torch"] + (["cpu_ext"] if _ext.cpu_ext_loaded_or_prebuilt() else [])


def test_empty_token_batch():
    x = torch.randn(0, 10, requires_grad=True)
    lp, h = logprobs_and_entropy(x, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and h.shape == (0,)
    (lp.sum() + h.sum()).backward()
    assert x.grad.shape == (0, 10)


def _spy_chunk_sizes(monkeypatch):
    """Record the chunk size the autograd op really runs with (the real op still runs)."""
    from megatron_rl.ops import logprob

    seen, real = [], logprob._VocabParallelLogprob.apply

    def apply(*args):
        seen.append(args[6])
        return real(*args)

    monkeypatch.setattr(logprob._VocabParallelLogprob, "apply", apply)
    return seen


@pytest.mark.parametrize("flag_value", [None, 1, 3, 7])
def test_log_probs_chunk_size_flag_reaches_the_op(tiny_hf_models, monkeypatch, flag_value):
    """--log-probs-chunk-size -> spec_from_config -> extract_model_output -> the op's chunk loop;
    the results do not depend on it (bitwise)."""
    from megatron_rl.config import parse_config
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.ops.logprob import _auto_chunk

    argv = ["--hf-checkpoint", tiny_hf_models("qwen2")]
    if flag_value is not None:
        argv += ["--log-probs-chunk-size", str(flag_value)]
    spec = spec_from_config(parse_config(argv, validate=False))
    reference = spec_from_config(parse_config(argv[:2], validate=False))
    logits, target, _, _ = _case(n=29, v=53, seed=3)
    seen = _spy_chunk_sizes(monkeypatch)
    out = spec.extract_model_output(logits, target)
    assert seen == [flag_value or _auto_chunk(53)]
    ref = reference.extract_model_output(logits, target)
    assert torch.equal(out.logprobs, ref.logprobs) and torch.equal(out.entropy, ref.entropy)
