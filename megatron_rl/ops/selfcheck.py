"""A fused kernel set proves itself against the torch ops before the dispatch trusts it.

Why: the compiled CUDA kernels and the Triton kernels are the default on CUDA tensors, and a
GPU may run them before any test did (a new GPU, compiler, driver or torch). A kernel that is
wrong there would train on silently wrong gradients. So on first use per (implementation,
device, dtype) ``ops.dispatch`` calls :func:`check_kernels`, which runs the kernel set through
the same autograd wrappers the ops use (``ops.fused``) on small fixed random inputs and
compares it with the torch ops:

* log-probs + entropy, forward and both backward variants (entropy in the loss or not), at an
  odd vocab (5,003: ragged blocks, scalar loads on CUDA) and at one that is a multiple of 8
  (8,200: the 16-byte vector loads), temperature 0.7, a ``-inf`` (masked) vocab column and a
  masked token (zero upstream gradient): those two must get exactly zero gradient;
* the per-token PPO terms (ratio, dual-clip surrogate, unbiased k3 KL, TIS weight with both
  bounds; then k2 KL, no dual clip, no TIS), their masks and the gradient, over 1,037 tokens (a
  ragged block) with clamped log-ratios and clamped KL, and masked tokens.

The bound is not a constant: for each output it is ``SLACK`` times the torch path's own error
against float64 on the same inputs (the way tests/ops/ bounds the kernels), measured as
``max |diff| / (1 + |float64 value|)`` so that a ratio clamped at exp(20) and a log-prob near 1
are judged alike, and never below ``SLACK`` float32 roundings. The kernels' contract is float32
arithmetic with outputs rounded once to their dtype, so the torch path runs on the same values
in float32 and its outputs are rounded to the kernel's output dtype before they are measured.
A kernel is accepted when it is as close to float64 as the torch path is, within that factor;
a wrong gradient term is off by orders more. A mask (a clipped/capped flag) may differ from
float64 only at tokens whose deciding quantity lies within twice the value's bound of the
threshold.

Invariants: inputs are seeded, so every rank of a job on the same hardware reaches the same
verdict (ranks of one TP group running different implementations would issue different
collectives); the check never calls ``ops.dispatch`` (no recursion); its cost is measured
(``CheckResult.seconds``; benchmarks/kernel_ops.py prints it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.ops._ext import KernelUnavailableError
from megatron_rl.ops.fused import fused_logprobs, fused_policy_terms
from megatron_rl.ops.logprob import naive_logprobs, vocab_parallel_logprobs
from megatron_rl.ops.policy_loss import PolicyLossParams, PolicyTerms, torch_policy_terms

#: how many times the torch path's own error against float64 a kernel may be off
SLACK = 16.0
LOGPROB_SHAPES = ((5, 5003), (4, 8200))  # odd V (ragged, scalar loads); V % 8 == 0 (16-byte vector loads)
TEMPERATURE = 0.7
PPO_TOKENS = 1037
PPO_PARAMS = (
    PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                     tis_cap=2.0, tis_low=0.5),
    PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.2, kl_type="k2"),
)


class KernelCheckFailed(KernelUnavailableError):
    """The implementation ``MEGATRON_RL_KERNELS`` forces disagreed with the torch ops in its self-check."""


@dataclass(frozen=True)
class Disagreement:
    output: str  # e.g. "logprob V=5003 grad(logprobs+entropy)"
    max_abs_diff: float  # against float64
    error: float  # max |diff| / (1 + |float64 value|): relative for large values, absolute for small ones
    bound: float  # on ``error``

    def __str__(self) -> str:
        return (f"{self.output}: max |diff| {self.max_abs_diff:.3g}, max |diff|/(1+|ref|) {self.error:.3g} > "
                f"bound {self.bound:.3g}")


@dataclass(frozen=True)
class CheckResult:
    impl: str
    device: str
    dtype: torch.dtype
    disagreements: tuple[Disagreement, ...]
    seconds: float
    error: str | None = None  # the kernel raised instead of returning

    @property
    def ok(self) -> bool:
        return not self.disagreements and self.error is None

    def describe(self) -> str:
        what = f"{self.impl} kernels on {self.device} {str(self.dtype).removeprefix('torch.')}"
        if self.ok:
            return f"{what}: self-check passed in {self.seconds * 1e3:.1f} ms"
        why = self.error if self.error is not None else "; ".join(map(str, self.disagreements))
        return f"{what}: self-check FAILED ({why})"


def scaled_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """``max |got - exact| / (1 + |exact|)``: one measure for values near 1 (log-probs, gradients) and for a
    ratio clamped at exp(20), whose float32 rounding alone is ~30 in absolute terms."""
    if not got.numel():
        return 0.0
    exact = exact.double().to(got.device)
    return ((got.double() - exact).abs() / (1.0 + exact.abs())).max().item()


def derived_bound(ref_err: float, slack: float = SLACK) -> float:
    """``slack`` x the reference's own :func:`scaled_error` vs float64, at least ``slack`` float32 roundings."""
    return slack * max(ref_err, torch.finfo(torch.float32).eps)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double().to(a.device)).abs().max().item() if a.numel() else 0.0


class _Comparison:
    """Collects the outputs that differ from float64 by more than their derived bound."""

    def __init__(self):
        self.failed: list[Disagreement] = []
        self.bounds: dict[str, float] = {}

    def value(self, name: str, got: torch.Tensor, torch_path: torch.Tensor, exact: torch.Tensor) -> float:
        # where the exact value overflows the dtype (fp16: a ratio of exp(20)) or the torch path overflowed, the
        # dtype's range decides, not the kernel: those elements are left out of the bound and the comparison
        exact, torch_path = exact.to(got.device), torch_path.to(got.device).to(got.dtype)
        keep = (torch.isfinite(exact.to(got.dtype)) & torch.isfinite(torch_path.to(got.device))).cpu()
        if not keep.all():
            got, torch_path, exact = got.cpu()[keep], torch_path.cpu()[keep], exact.cpu()[keep]
        bound = derived_bound(scaled_error(torch_path, exact))
        err = scaled_error(got, exact)
        self.bounds[name] = bound
        if not err <= bound:  # NaN fails too
            self.failed.append(Disagreement(name, _maxdiff(got, exact), err, bound))
        return bound

    def zero(self, name: str, got: torch.Tensor) -> None:
        err = got.double().abs().max().item() if got.numel() else 0.0
        if not err == 0.0:
            self.failed.append(Disagreement(name, err, err, 0.0))

    def mask(self, name: str, got: torch.Tensor, exact: torch.Tensor, margin: torch.Tensor, bound: float,
             value: torch.Tensor) -> None:
        """``got`` may differ from ``exact`` only where the deciding quantity (``margin``, the flag is
        ``margin > 0``) is within twice the bound of ``value`` of its threshold."""
        value = value.double().cpu()
        wrong = (got.cpu() != exact.cpu()) & (margin.cpu().abs() > 2 * bound * (1.0 + value.abs()))
        if wrong.any():
            self.failed.append(Disagreement(f"{name} flags ({int(wrong.sum())} tokens)", 1.0, 1.0, 0.0))


def _grad_of(fn, x: torch.Tensor, weights) -> tuple[list[Any], torch.Tensor]:
    """``fn(x)``'s outputs detached (None where ``fn`` gave None: the caller knows which) and the gradient
    of their weighted sum."""
    x = x.detach().clone().requires_grad_()
    outs = fn(x)
    loss = sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, weights) if o is not None and w is not None)
    loss.backward()
    assert x.grad is not None, "backward() succeeded, so the loss depends on x"
    return [None if o is None else o.detach() for o in outs], x.grad


def _logprob_case(cmp: _Comparison, kernels, device, dtype, n: int, vocab: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 4
    full[:, 3] = -float("inf")  # a masked vocab column: probability 0, gradient 0
    target = torch.randint(4, vocab, (n,), generator=g)
    target[0] = vocab - 1  # in the ragged tail
    g_lp, g_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    g_lp[1] = g_h[1] = 0.0  # a masked token: no upstream gradient
    x = full.to(dtype).to(device)
    target = target.to(device)
    t = TEMPERATURE

    def kernel(with_entropy):
        return lambda z: fused_logprobs(kernels, z, target, tp_group=None, tp_size=1, vocab_start=0, temperature=t,
                                        with_entropy=with_entropy)

    def torch_path(with_entropy):
        return lambda z: vocab_parallel_logprobs(z, target, temperature=t, with_entropy=with_entropy)

    def exact(with_entropy):
        return lambda z: naive_logprobs(z, target, temperature=t, with_entropy=with_entropy)

    for with_entropy in (True, False):
        weights = (g_lp, g_h if with_entropy else None)
        (lp64, h64), grad64 = _grad_of(exact(with_entropy), x.double(), weights)
        (lpt, ht), gradt = _grad_of(torch_path(with_entropy), x.float(), weights)
        (lpk, hk), gradk = _grad_of(kernel(with_entropy), x, weights)
        tag = f"logprob V={vocab}"
        if with_entropy:
            cmp.value(f"{tag} logprobs", lpk, lpt, lp64)
            cmp.value(f"{tag} entropy", hk, ht, h64)
        loss = "logprobs+entropy" if with_entropy else "logprobs"
        if gradk.dtype != x.dtype or gradk.shape != x.shape:
            cmp.failed.append(Disagreement(f"{tag} grad({loss}) is {gradk.dtype} {tuple(gradk.shape)}, expected "
                                           f"{x.dtype} {tuple(x.shape)}", float("inf"), float("inf"), 0.0))
            continue
        cmp.value(f"{tag} grad({loss})", gradk, gradt, grad64)
        cmp.zero(f"{tag} grad({loss}) of the -inf column", gradk[:, 3])
        cmp.zero(f"{tag} grad({loss}) of the masked token", gradk[1])


def _ppo_inputs(device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = PPO_TOKENS
    lp = torch.randn(n, generator=g, dtype=torch.float64) - 2
    old = lp + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = lp + 0.8 * torch.randn(n, generator=g, dtype=torch.float64)
    roll = old + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    old[:2] = lp[:2] + torch.tensor([30.0, -30.0], dtype=torch.float64)  # log-ratio clamped at +-20 (not at the edge)
    ref[2:5] = lp[2:5] + torch.tensor([25.0, -3.0, -2.5], dtype=torch.float64)  # k3 clamped (10) / not
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[5] = 0.0
    g_pg, g_kl = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    masked = torch.arange(n) % 7 == 3  # masked tokens: zero upstream gradient from the loss aggregation
    g_pg[masked] = g_kl[masked] = 0.0
    to = (lambda t: t.to(dtype).to(device))
    return to(lp), to(old), to(adv), to(ref), to(roll), g_pg, g_kl, masked


def _ppo_margins(lp, old, adv, ref, roll, params: PolicyLossParams) -> dict[str, torch.Tensor]:
    """Float64 deciding quantities of the masks (mask = quantity > 0)."""
    ratio = torch.exp((lp - old).clamp(-20.0, 20.0))
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - params.eps_low, 1.0 + params.eps_high)
    never = torch.full_like(adv, -float("inf"))
    out = {"clipped": clipped - unclipped, "dual": never}
    if params.dual_clip_c is not None:
        loss = torch.maximum(unclipped, clipped)
        out["dual"] = torch.where(adv < 0, loss + adv * params.dual_clip_c, never)
    raw = torch.exp((old - roll).clamp(max=20.0))
    out["tis_capped"], out["tis_floored"] = raw - params.tis_cap, params.tis_low - raw
    return out


def _ppo_case(cmp: _Comparison, kernels, device, dtype, params: PolicyLossParams, seed: int) -> None:
    lp, old, adv, ref, roll, g_pg, g_kl, masked = _ppo_inputs(device, dtype, seed)
    with_tis = params.tis_low > 0
    roll_in = roll if with_tis else None
    weights = (g_pg, g_kl)
    cast = (lambda t, dt: None if t is None else t.to(dt))

    def run(fn, x_dtype):
        def call(x):
            terms = fn(x, cast(old, x_dtype), cast(adv, x_dtype), cast(ref, x_dtype), cast(roll_in, x_dtype))
            call.terms = terms
            return terms.pg, terms.kl
        outs, grad = _grad_of(call, lp.to(x_dtype), weights)
        return call.terms, grad

    def torch_fn(x, o, a, r, ro):
        return torch_policy_terms(x, o, a, params, ref_logprobs=r, rollout_logprobs=ro)

    def kernel_fn(x, o, a, r, ro):
        return PolicyTerms(*fused_policy_terms(kernels, x, o, a, params, r, ro))

    t64, grad64 = run(torch_fn, torch.float64)
    tt, gradt = run(torch_fn, torch.float32)
    tk, gradk = run(kernel_fn, dtype)
    tag = f"ppo kl={params.kl_type}{' dual' if params.dual_clip_c else ''}{' tis' if with_tis else ''}"
    bounds = {}
    for name in ("ratio", "pg", "kl", "tis_weight"):
        exact = getattr(t64, name)
        if exact is None:
            continue
        got = getattr(tk, name)
        if got is None or got.shape != exact.shape:
            cmp.failed.append(Disagreement(f"{tag} {name} missing or misshapen", float("inf"), float("inf"), 0.0))
            continue
        bounds[name] = cmp.value(f"{tag} {name}", got, getattr(tt, name), exact)
    cmp.value(f"{tag} grad", gradk, gradt, grad64)
    cmp.zero(f"{tag} grad of masked tokens", gradk[masked.to(gradk.device)])
    lp64, old64, adv64, ref64, roll64 = (t.double() for t in (lp, old, adv, ref, roll))
    margins = _ppo_margins(lp64, old64, adv64, ref64, roll64, params)
    for name, margin in margins.items():
        exact, got = getattr(t64, name), getattr(tk, name)
        if exact is None:
            continue
        value = "tis_weight" if name.startswith("tis") else "pg"
        cmp.mask(f"{tag} {name}", got, exact, margin, bounds[value], getattr(t64, value))


def check_kernels(impl: str, kernels, device: torch.device, dtype: torch.dtype) -> CheckResult:
    """Run ``kernels`` (one implementation's kernel set) against the torch ops on ``device`` in ``dtype``."""
    start = time.perf_counter()
    cmp = _Comparison()
    error = None
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for i, (n, vocab) in enumerate(LOGPROB_SHAPES):
                _logprob_case(cmp, kernels, device, dtype, n, vocab, seed=101 + i)
            for i, params in enumerate(PPO_PARAMS):
                _ppo_case(cmp, kernels, device, dtype, params, seed=201 + i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # a kernel that raises (launch/compile error) fails its check, with the reason
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return CheckResult(impl, str(device), dtype, tuple(cmp.failed), time.perf_counter() - start, error)
