"""The C++ CPU twins of the CUDA kernels (csrc/cpu) against the torch reference, through the ops dispatch.

Values and gradients: fp32 tight (float32 accumulation vs a float64 reference),
bf16/fp16 within one rounding of the output; random inputs with -inf (masked)
vocab columns, rows whose length is not a multiple of the twins' 2048-column
block nor of their 8 accumulator lanes, temperature != 1. Outputs are poisoned
before the kernels run to prove every element is written. TP=2 with partials
combined over a real gloo group runs under torchrun (scripts/cpu_ext_tp_worker.py).
"""

import importlib.util
import logging

import pytest
import torch

from megatron_rl import ops
from megatron_rl.errors import ConfigError
from megatron_rl.ops import PolicyLossParams, logprobs_and_entropy, naive_logprobs, policy_loss_terms
from megatron_rl.ops import dispatch
from megatron_rl.ops._ext import KernelUnavailableError

from _util import REPO, read_json, torchrun


def _logits_case(n, v, dtype, seed, masked_cols=(3,)):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    for c in masked_cols:
        if c < v:
            logits[:, c] = -float("inf")
            target[target == c] = (c + 1) % v
    return logits, target, torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g,
                                                                                          dtype=torch.float64)


def _run(fn, logits, target, g_lp, g_h, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, target, **kw)
    loss = (lp.double() * g_lp).sum() + ((h.double() * g_h).sum() if (h is not None and g_h is not None) else 0.0)
    loss.backward()
    return lp.detach().double(), (h.detach().double() if h is not None else None), x.grad


# V: one ragged block (< 8 lanes), one block with a ragged lane tail, three blocks with a ragged tail.
@pytest.mark.parametrize("v", [5, 37, 5003])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_fp32_match_float64_reference(cpu_ext, use_kernels, v, temperature):
    logits, target, g_lp, g_h = _logits_case(23, v, torch.float32, seed=v)
    use_kernels("cpu_ext")
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=temperature, with_entropy=True)
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, temperature=temperature,
                          with_entropy=True)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    assert torch.allclose(lp, rlp, atol=4e-6, rtol=1e-6), (lp - rlp).abs().max()
    assert torch.allclose(h, rh, atol=4e-6, rtol=1e-6), (h - rh).abs().max()
    assert torch.allclose(grad.double(), rgrad, atol=4e-6, rtol=1e-5), (grad.double() - rgrad).abs().max()
    assert (grad[:, 3] == 0).all()  # a -inf logit has probability 0 and no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logprobs_half_precision_within_one_rounding(cpu_ext, use_kernels, dtype):
    logits, target, g_lp, g_h = _logits_case(17, 2051, dtype, seed=7)
    use_kernels("cpu_ext")
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=0.9, with_entropy=True)
    assert lp.dtype == torch.float64 and grad.dtype == dtype  # (lp upcast by _run; the op returns float32)
    # Reference on the same half-precision values upcast: only float32 accumulation differs for the values,
    # the gradient is rounded to the logits' dtype once.
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, temperature=0.9, with_entropy=True)
    assert torch.allclose(lp, rlp, atol=4e-6) and torch.allclose(h, rh, atol=4e-6)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(grad.double(), rgrad, atol=eps * rgrad.abs().max().item(), rtol=eps)
    # and the torch chunked path gives the same within that rounding
    use_kernels("torch")
    tlp, th, tgrad = _run(logprobs_and_entropy, logits, target, g_lp, g_h, temperature=0.9, with_entropy=True)
    assert torch.allclose(lp, tlp, atol=4e-6) and torch.allclose(h, th, atol=4e-6)
    assert torch.allclose(grad.double(), tgrad.double(), atol=eps * rgrad.abs().max().item(), rtol=eps)


def test_logprob_only_entropy_only_and_leading_dims(cpu_ext, use_kernels):
    logits, target, g_lp, g_h = _logits_case(12, 301, torch.float32, seed=3)
    use_kernels("cpu_ext")
    lp, h, grad = _run(logprobs_and_entropy, logits, target, g_lp, None)
    assert h is None
    rlp, _, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, None)
    assert torch.allclose(lp, rlp, atol=4e-6) and torch.allclose(grad.double(), rgrad, atol=4e-6)
    # only the entropy reaches the loss
    x = logits.clone().requires_grad_()
    _, h = logprobs_and_entropy(x.view(3, 4, 301), target.view(3, 4), with_entropy=True)
    assert h.shape == (3, 4)
    (h.double().view(-1) * g_h).sum().backward()
    _, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp * 0, g_h, with_entropy=True)
    assert torch.allclose(h.double().view(-1), rh, atol=4e-6)
    assert torch.allclose(x.grad.double(), rgrad, atol=4e-6)


def test_vocab_padding_with_the_twins(cpu_ext, use_kernels):
    """vocab_size through the kernel path: padding columns (garbage) are masked for the kernel, gradient 0."""
    logits, target, g_lp, g_h = _logits_case(11, 301, torch.float32, seed=8)
    use_kernels("cpu_ext")
    padded = torch.cat([logits, torch.full((11, 83), 1e4)], dim=1)
    lp, h, grad = _run(logprobs_and_entropy, padded, target, g_lp, g_h, vocab_size=301, with_entropy=True)
    rlp, rh, rgrad = _run(naive_logprobs, logits.double(), target, g_lp, g_h, with_entropy=True)
    assert torch.allclose(lp, rlp, atol=4e-6) and torch.allclose(h, rh, atol=4e-6)
    assert torch.allclose(grad[:, :301].double(), rgrad, atol=4e-6) and (grad[:, 301:] == 0).all()


def test_empty_batch_and_bad_input_errors(cpu_ext, use_kernels):
    use_kernels("cpu_ext")
    x = torch.randn(0, 10, requires_grad=True)
    lp, h = logprobs_and_entropy(x, torch.zeros(0, dtype=torch.long), with_entropy=True)
    (lp.sum() + h.sum()).backward()
    assert lp.shape == (0,) and x.grad.shape == (0, 10)
    with pytest.raises(ValueError, match=r"outside the vocab \[0, 10\)"):
        logprobs_and_entropy(torch.randn(4, 10), torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="temperature=0"):
        logprobs_and_entropy(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), temperature=0)
    with pytest.raises(RuntimeError, match="target_local must have shape"):
        cpu_ext.logprob_fwd_partials(torch.randn(4, 10), torch.zeros(3, dtype=torch.long), 1.0,
                                     *[torch.empty(4) for _ in range(4)])


def test_every_output_element_is_written(cpu_ext):
    """Poisoned (NaN / inverted-bool) output buffers come back fully overwritten, equal to fresh ones."""
    logits, target, g_lp, g_h = _logits_case(9, 4099, torch.bfloat16, seed=5)
    tl = torch.where(target % 2 == 0, target, torch.full_like(target, -1))  # half the targets on "another rank"

    def fwd(fill):
        outs = [torch.full((9,), fill) for _ in range(4)]
        cpu_ext.logprob_fwd_partials(logits, tl, 1.3, *outs)
        return outs

    clean, poisoned = fwd(0.0), fwd(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned))
    assert all(torch.isfinite(t).all() for t in poisoned)
    lse = clean[0] + clean[1].log()
    ent = torch.rand(9)

    def bwd(fill):
        grad = torch.full_like(logits, fill)
        cpu_ext.logprob_bwd(grad, logits, tl, lse, ent, g_lp.float(), g_h.float(), 1.3)
        return grad

    assert torch.equal(bwd(0.0), bwd(float("nan"))) and torch.isfinite(bwd(float("nan"))).all()

    n = 1037
    g = torch.Generator().manual_seed(6)
    lp, old, adv, ref, roll = (torch.randn(n, generator=g) for _ in range(5))

    def ppo(fill):
        outs = [torch.full((n,), fill), torch.full((n,), fill), torch.full((n,), bool(fill == fill)),
                torch.full((n,), bool(fill == fill)), torch.full((n,), fill), torch.full((n,), fill),
                torch.full((n,), bool(fill == fill)), torch.full((n,), bool(fill == fill))]
        cpu_ext.ppo_fwd(lp, old, adv, ref, roll, True, 0.8, 1.28, True, 3.0, 3, True, True, 2.0, 0.5, *outs)
        grad = torch.full((n,), fill)
        cpu_ext.ppo_bwd(grad, lp, old, adv, ref, torch.randn(n, generator=torch.Generator().manual_seed(1)),
                        torch.ones(n), True, 0.8, 1.28, True, 3.0, 3, True, True, 2.0, 0.5)
        return outs + [grad]

    clean, poisoned = ppo(0.0), ppo(float("nan"))  # bool buffers: all False vs all True beforehand
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned))


def test_saved_tensors_are_the_logits_and_per_row_stats(cpu_ext, use_kernels):
    use_kernels("cpu_ext")
    logits, target, _, _ = _logits_case(64, 301, torch.bfloat16, seed=4)
    x = logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logprobs_and_entropy(x, target, with_entropy=True)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    assert sum(t.numel() for t in saved if t.numel() < x.numel()) <= 3 * 64


def _ppo_inputs(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(n, generator=g, dtype=torch.float64) - 2
    old = lp + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = lp + 0.8 * torch.randn(n, generator=g, dtype=torch.float64)
    roll = old + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    old[:4] = lp[:4] + torch.tensor([30.0, -30.0, 20.0, -20.0], dtype=torch.float64)  # beyond / at the +-20 clamp
    ref[4:8] = lp[4:8] + torch.tensor([25.0, -25.0, -3.0, -2.5], dtype=torch.float64)  # KL clamps (k3 -> 10)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[8] = 0.0
    to = (lambda t: t.to(dtype))
    return to(lp), to(old), to(adv), to(ref), to(roll), torch.randn(n, generator=g, dtype=torch.float64), \
        torch.randn(n, generator=g, dtype=torch.float64)


def _torch_and_twin(use_kernels, lp, old, adv, params, ref, roll, g_pg, g_kl):
    """``(terms, grad of lp)`` of the torch path, then of the C++ twin, for one weighting of pg and kl."""
    results = []
    for impl in ("torch", "cpu_ext"):
        use_kernels(impl)
        x = lp.clone().requires_grad_()
        t = policy_loss_terms(x, old, adv, params, ref_logprobs=ref, rollout_logprobs=roll)
        ((t.pg.double() * g_pg).sum() + (t.kl.double() * g_kl).sum()).backward()
        results.append((t, x.grad))
    return results


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dual,unbiased", [(None, False), (3.0, True)])
def test_policy_terms_match_torch(cpu_ext, use_kernels, kl_type, dual, unbiased):
    lp, old, adv, ref, roll, g_pg, g_kl = _ppo_inputs(301, torch.float32, seed=11)
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=dual, kl_type=kl_type,
                              unbiased_kl=unbiased, tis_cap=2.0, tis_low=0.5)
    (tt, tg), (ct, cg) = _torch_and_twin(use_kernels, lp, old, adv, params, ref, roll, g_pg, g_kl)
    for name in ("ratio", "pg", "kl", "tis_weight"):
        a, b = getattr(tt, name), getattr(ct, name)
        assert b.dtype == a.dtype and torch.allclose(a, b, atol=1e-6, rtol=1e-6), (name, (a - b).abs().max())
    for name in ("clipped", "dual", "tis_capped", "tis_floored"):
        assert torch.equal(getattr(tt, name), getattr(ct, name)), name
    assert torch.allclose(tg, cg, atol=1e-6, rtol=1e-5), (tg - cg).abs().max()


def test_policy_terms_bf16_and_optional_parts(cpu_ext, use_kernels):
    lp, old, adv, ref, roll, g_pg, _ = _ppo_inputs(129, torch.bfloat16, seed=12)
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.2)
    out = {}
    for impl in ("torch", "cpu_ext"):
        use_kernels(impl)
        x = lp.clone().requires_grad_()
        t = policy_loss_terms(x, old, adv, params)  # no KL, no TIS
        (t.pg.double() * g_pg).sum().backward()
        out[impl] = (t, x.grad)
    (tt, tg), (ct, cg) = out["torch"], out["cpu_ext"]
    assert ct.kl is None and ct.tis_weight is None and ct.pg.dtype == torch.bfloat16 and cg.dtype == torch.bfloat16
    # both compute in float32 and round each output once, to nearest even: within one bf16 step
    assert torch.allclose(tt.pg.double(), ct.pg.double(), rtol=2.0 ** -7, atol=0.0)
    assert torch.equal(tt.clipped, ct.clipped) and torch.equal(tt.dual, ct.dual)
    assert torch.allclose(tg.double(), cg.double(), rtol=2.0 ** -7, atol=0.0), (tg.double() - cg.double()).abs().max()
    # KL only (GSPO / advantage "none" path): no surrogate
    use_kernels("cpu_ext")
    t = policy_loss_terms(lp.float(), old.float(), adv.float(), PolicyLossParams(ppo=False, eps_low=0.2,
                          eps_high=0.2, kl_type="k3"), ref_logprobs=ref.float())
    assert t.pg is None and t.clipped is None and t.kl is not None


def test_compute_policy_loss_end_to_end(cpu_ext, use_kernels):
    """The whole loss (masks, ragged samples, TIS, dual clip, unbiased k3, entropy) with the twins vs torch."""
    from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss
    from megatron_rl.data.packing import LossDenominators

    lengths = [7, 0, 13, 4, 1]
    lp, old, adv, ref, roll, _, _ = _ppo_inputs(sum(lengths), torch.float32, seed=13)
    mask = (torch.arange(sum(lengths)) % 5 != 2).float()
    cfg = PolicyGradientConfig(eps_clip_high=0.28, eps_clip_c=3.0, kl_loss_coef=0.1, use_unbiased_kl=True,
                               use_tis=True, tis_clip_low=0.5, entropy_coef=0.01, loss_agg_mode="seq_mean_token_mean")
    dn = LossDenominators(sum(lengths), len(lengths), sum(lengths), len(lengths))
    entropy = torch.rand(sum(lengths), generator=torch.Generator().manual_seed(0))
    res = {}
    for impl in ("torch", "cpu_ext"):
        use_kernels(impl)
        x = lp.clone().requires_grad_()
        loss, metrics = compute_policy_loss(LossInputs(x, adv, mask, lengths, old_logprobs=old, ref_logprobs=ref,
                                                       rollout_logprobs=roll, entropy=entropy),
                                            dn, cfg)
        loss.backward()
        res[impl] = (loss.detach(), x.grad, metrics)
    (l0, g0, m0), (l1, g1, m1) = res["torch"], res["cpu_ext"]
    assert torch.allclose(l0, l1, atol=1e-6) and torch.allclose(g0, g1, atol=1e-7)
    assert (g1[mask == 0] == 0).all()
    assert sorted(m0) == sorted(m1)
    for k in m0:
        assert torch.allclose(m0[k][0], m1[k][0], atol=1e-5) and torch.equal(m0[k][1], m1[k][1]), k


def test_dispatch_choices_and_errors(monkeypatch, caplog):
    monkeypatch.setenv("MEGATRON_RL_KERNELS", "cudnn")
    with pytest.raises(ConfigError, match=r"MEGATRON_RL_KERNELS='cudnn' is not a known kernel implementation; "
                                          r"choose one of cpu_ext, cuda, torch, triton"):
        logprobs_and_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("MEGATRON_RL_KERNELS", "cuda")
    with pytest.raises(KernelUnavailableError, match=r"MEGATRON_RL_KERNELS=cuda .* cannot run here: it runs on cuda "
                                                     r"tensors, got cpu; on CPU use MEGATRON_RL_KERNELS=cpu_ext"):
        logprobs_and_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("MEGATRON_RL_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        policy_loss_terms(torch.zeros(3), torch.zeros(3), torch.zeros(3), PolicyLossParams(True, 0.2, 0.2))
    # unset and empty both mean "default for the device": torch on CPU, logged once
    for value in ("", None):
        if value is None:
            monkeypatch.delenv("MEGATRON_RL_KERNELS")
        else:
            monkeypatch.setenv("MEGATRON_RL_KERNELS", value)
        monkeypatch.setattr(dispatch, "_logged", set())
        with caplog.at_level(logging.INFO, logger="megatron_rl"):
            assert dispatch.select(torch.device("cpu")) == ("torch", None)
            dispatch.select(torch.device("cpu"))
        lines = [r.getMessage() for r in caplog.records if "megatron_rl.ops:" in r.getMessage()]
        assert len(lines) == 1 and "torch kernels" in lines[0] and "default for the device" in lines[0]
        caplog.clear()
    assert "torch" in ops.available_backends("cpu") and "cuda" not in ops.available_backends("cpu")


def test_cuda_extension_missing_says_how_to_build(monkeypatch):
    from megatron_rl.ops import _ext

    monkeypatch.setattr(_ext, "_cache", {})
    try:
        import megatron_rl._C  # noqa: F401
        pytest.skip("megatron_rl._C is built here")
    except ImportError:
        pass
    with pytest.raises(KernelUnavailableError, match="MEGATRON_RL_BUILD_EXT=cuda pip install -e ."):
        _ext.load_cuda_ext()


def test_cpu_ext_without_ninja_says_how_to_get_it(monkeypatch):
    import sys

    from megatron_rl.ops import _ext

    if _ext.importlib.util.find_spec("megatron_rl._C_cpu") is not None:
        pytest.skip("megatron_rl._C_cpu is prebuilt here: no JIT build to refuse")
    monkeypatch.setattr(_ext, "_cache", {})
    monkeypatch.setattr(_ext.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "ninja", None)  # `import ninja` raises ImportError
    with pytest.raises(KernelUnavailableError, match=r"JIT build needs ninja: `pip install ninja`, or build it once "
                                                     r"with MEGATRON_RL_BUILD_EXT=cpu"):
        _ext.load_cpu_ext()


def test_linear_logprobs_with_the_twins_match_their_unfused_path(cpu_ext, use_kernels):
    """The output projection fused by row chunks (ops.linear_logprob) runs the twins per chunk: values bitwise
    theirs on the output layer's logits, gradients within one rounding (bf16 logits, padded vocab)."""
    import torch.nn.functional as F

    use_kernels("cpu_ext")
    g = torch.Generator().manual_seed(4)
    n, h, v, real = 90, 16, 1031, 1000
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.3).bfloat16()
    target = torch.randint(0, real, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    got = []
    for fused in (False, True):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kw = dict(temperature=0.7, with_entropy=True, vocab_size=real)
        lp, ent = (ops.linear_logprobs_and_entropy(x, w, target, chunk_size=32, **kw) if fused
                   else logprobs_and_entropy(F.linear(x, w), target, **kw))
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        got.append((lp.detach(), ent.detach(), x.grad, w.grad))
    (lp0, e0, gx0, gw0), (lp1, e1, gx1, gw1) = got
    assert torch.equal(lp0, lp1) and torch.equal(e0, e1) and torch.equal(gx0, gx1)
    ref = gw0.float()  # per-chunk partial sums rounded to bf16 (tests/ops/test_linear_logprob.py)
    assert ((ref - gw1.float()).abs() <= ref.abs() * 2 ** -7 + ref.abs().max() * 2 ** -8).all()


@pytest.mark.dist
def test_tp2_partials_combined_over_gloo(cpu_ext, cpu_ext_dir, tmp_path):
    """Two ranks, each with its vocab shard: the twins' partials all-reduced over a real gloo group give the
    single-process float64 reference (values and each shard's gradient), as the torch TP path does; and the
    output projection fused by row chunks equals the unfused path under TP for every implementation."""
    script = REPO / "tests" / "ops" / "scripts" / "cpu_ext_tp_worker.py"
    torchrun(script, 2, [str(tmp_path)], timeout=240, env={"TORCH_EXTENSIONS_DIR": str(cpu_ext_dir)})
    for rank in range(2):
        errors = read_json(tmp_path / f"rank{rank}.json")
        impls = 3 if importlib.util.find_spec("triton") else 2  # the worker adds Triton (interpreted) when present
        assert len(errors) == impls * 2 * 3, sorted(errors)
        bad = {k: v for k, v in errors.items() if v > (2e-2 if "bf16/grad" in k else 5e-6)}
        assert not bad, bad
        # the output projection fused by row chunks, each rank on its vocab shard (padding on rank 1)
        linear = read_json(tmp_path / f"linear_rank{rank}.json")
        assert len(linear) == impls, linear
        for impl, check in linear.items():
            assert check["values_bitwise"] and check["hidden_grad_bitwise"], (impl, check)
            assert check["weight_grad_rel"] <= 2 ** -7, (impl, check)


@pytest.mark.parametrize("kl_type", ["k1+", "k3+", "low_var_kl+"])
def test_straight_through_kl_goes_around_the_kernels(cpu_ext, use_kernels, kl_type):
    """verl's k3+: the kernels supply the surrogate and TIS, the KL comes from the torch path. Its value is the
    base estimator's (k3 clamped as verl's), its gradient k2's: logp - ref, even where k3 is clamped."""
    from megatron_rl.ops.policy_loss import kl_estimate

    lp, old, adv, ref, roll, g_pg, g_kl = _ppo_inputs(301, torch.float32, seed=13)
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, kl_type=kl_type, tis_cap=2.0)
    (tt, tg), (ct, cg) = _torch_and_twin(use_kernels, lp, old, adv, params, ref, roll, g_pg, g_kl)
    assert torch.equal(tt.kl, ct.kl) and torch.allclose(tt.pg, ct.pg, atol=1e-6, rtol=1e-6)
    assert torch.allclose(tg, cg, atol=1e-6, rtol=1e-5)
    assert torch.equal(ct.kl, kl_estimate(lp, ref, kl_type[:-1]))  # the value: the base estimator's
    # the gradient: the surrogate's (no KL) plus k2's, d/dlogp 0.5 (logp - ref)^2 = logp - ref
    use_kernels("cpu_ext")
    x = lp.clone().requires_grad_()
    t = policy_loss_terms(x, old, adv, params, ref_logprobs=None, rollout_logprobs=roll)
    (t.pg.double() * g_pg).sum().backward()
    assert torch.allclose(cg, x.grad + ((lp - ref).double() * g_kl).float(), atol=1e-6, rtol=1e-5)
