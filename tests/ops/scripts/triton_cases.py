"""Cases for the Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU) vs the torch reference.

Run by tests/ops/test_triton_kernels.py in a fresh ``pytest`` process whose
environment has TRITON_INTERPRET=1 from the start: triton.jit chooses the
interpreter when a function is decorated, and triton's own library functions
(``tl.max``, ``tl.sum``) are decorated when triton is first imported -- which
megatron-core does early in any test session.

Small sizes on purpose: the interpreter runs a 32 x 1031 forward+backward in ~4 s.
The vocab block is shrunk to 256 so rows span several blocks with a ragged tail.
TP=2 runs in tests/ops/scripts/cpu_ext_tp_worker.py when triton is importable.
"""

import importlib.util
import os

import pytest
import torch

from megatron_rl.ops import PolicyLossParams, logprobs_and_entropy, naive_logprobs, policy_loss_terms

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton==3.6.0; CUDA torch ships it)")

if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl

    from megatron_rl.ops import triton_kernels as _tk

    @triton.jit
    def _round_store_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(y_ptr + i, _tk._round_out(x, True), mask=i < n)


@pytest.fixture(scope="module")
def triton_kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("run with TRITON_INTERPRET=1 set before python starts (tests/ops/test_triton_kernels.py does)")
    import megatron_rl.ops.triton_kernels as tk

    return tk


@pytest.fixture
def interpret(monkeypatch, triton_kernels):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MEGATRON_RL_KERNELS", "triton")
    monkeypatch.setattr(triton_kernels, "_FWD_BLOCK", 256)
    monkeypatch.setattr(triton_kernels, "_BWD_BLOCK", 256)
    monkeypatch.setattr(triton_kernels, "_PPO_BLOCK", 128)
    return triton_kernels


def _case(n, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 4).to(dtype)
    logits[:, 2] = -float("inf")
    target = torch.randint(0, v, (n,), generator=g)
    target[target == 2] = 3
    return logits, target, torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g,
                                                                                          dtype=torch.float64)


def _run(fn, logits, target, g_lp, g_h, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, target, **kw)
    ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
    return lp.detach().double(), h.detach().double(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_reference(interpret, monkeypatch, dtype):
    logits, target, g_lp, g_h = _case(32, 1031, dtype, seed=1)
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=0.7, with_entropy=True)
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, temperature=0.7, with_entropy=True)
    assert grad.dtype == dtype and (grad[:, 2] == 0).all()
    assert torch.allclose(lp, rlp, atol=4e-6) and torch.allclose(h, rh, atol=4e-6)
    if dtype == torch.float32:
        # |logits / T| reaches ~25 here, so fp32 rounding alone moves a gradient by ~4e-6, and by how much
        # depends on the CPU's vectorised exp/log (an AMD and an Intel VM differ in the last bits): the bound
        # is the torch chunked op's own distance from float64 on the same inputs, doubled, at least 4e-6
        monkeypatch.setenv("MEGATRON_RL_KERNELS", "torch")
        _, _, tgrad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=0.7, with_entropy=True)
        monkeypatch.setenv("MEGATRON_RL_KERNELS", "triton")
        tol = max(4e-6, 2 * (tgrad.double() - rgrad).abs().max().item())
    else:
        tol = torch.finfo(dtype).eps * rgrad.abs().max().item()
    assert torch.allclose(grad.double(), rgrad, atol=tol, rtol=torch.finfo(dtype).eps), (grad.double() - rgrad).abs().max()


def test_every_output_element_is_written(interpret):
    logits, target, g_lp, g_h = _case(8, 777, torch.float32, seed=2)
    tl_ = torch.where(target % 2 == 0, target, torch.full_like(target, -1))
    outs = [torch.full((8,), float("nan")) for _ in range(4)]
    interpret.logprob_fwd_partials(logits, tl_, 1.0, *outs)
    assert all(torch.isfinite(t).all() for t in outs)
    grad = torch.full_like(logits, float("nan"))
    interpret.logprob_bwd(grad, logits, tl_, outs[0] + outs[1].log(), torch.rand(8), g_lp.float(), g_h.float(), 1.0)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_terms_match_torch(interpret, monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    n = 301
    lp, old, adv, ref, roll = (torch.randn(n, generator=g) for _ in range(5))
    old[:2] = lp[:2] + torch.tensor([30.0, -30.0])
    ref[2:4] = lp[2:4] + torch.tensor([25.0, -3.0])
    lp, old, adv, ref, roll = (t.to(dtype) for t in (lp, old, adv, ref, roll))
    g_pg, g_kl = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                              tis_cap=2.0, tis_low=0.5)
    res = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("MEGATRON_RL_KERNELS", impl)
        x = lp.clone().requires_grad_()
        t = policy_loss_terms(x, old, adv, params, ref_logprobs=ref, rollout_logprobs=roll)
        ((t.pg.double() * g_pg).sum() + (t.kl.double() * g_kl).sum()).backward()
        res[impl] = (t, x.grad)
    (tt, tg), (ct, cg) = res["torch"], res["triton"]
    # both sides compute in float32 and round each output once (bf16: to nearest even), so bf16 outputs agree
    # within one bf16 step (2^-7 relative; only where the two float32 exp/log differ in the last bits)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0.0, rtol=2.0 ** -7)
    for name in ("ratio", "pg", "kl", "tis_weight"):
        a, b = getattr(tt, name).double(), getattr(ct, name).double()
        assert torch.allclose(a, b, **tol), (name, (a - b).abs().max())
    for name in ("clipped", "dual", "tis_capped", "tis_floored"):
        assert torch.equal(getattr(tt, name), getattr(ct, name)), name
    if dtype == torch.float32:
        assert torch.allclose(tg, cg, atol=1e-6, rtol=1e-5), (tg - cg).abs().max()
    else:
        assert torch.allclose(tg.double(), cg.double(), rtol=2.0 ** -7, atol=0.0), (tg.double() - cg.double()).abs().max()


def test_bf16_outputs_round_to_nearest_even(interpret):
    """The kernels' bf16 stores equal torch's ``.to(torch.bfloat16)`` bit for bit: ties (to even, both ways),
    just-above/below-half, overflow to inf, +-inf and NaN (the interpreter's own cast truncates instead)."""
    import triton

    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000, 0x7F7FFFFF,
                         0x7F800000, 0xFF800000, 0x00008000, 0x00018000, 0x7FC00000], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.randn(500, generator=torch.Generator().manual_seed(9)) * 1e3])
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    _round_store_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert same.all(), (x[~same], y[~same], want[~same])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_pass_their_self_check(triton_kernels, dtype):
    """ops.selfcheck at the kernels' own block sizes (those a GPU runs), under the interpreter."""
    from megatron_rl.ops import selfcheck

    result = selfcheck.check_kernels("triton", triton_kernels, torch.device("cpu"), dtype)
    assert result.ok, result.describe()
    print(result.describe())
