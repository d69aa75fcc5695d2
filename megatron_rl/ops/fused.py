"""Autograd wrappers around the fused kernels (compiled CUDA, C++ CPU twins, Triton).

All three kernel sets expose the same four functions (``csrc/ops.h``):
``logprob_fwd_partials``, ``logprob_bwd``, ``ppo_fwd``, ``ppo_bwd``; every one writes
into outputs allocated here with ``torch.empty``. The Python side owns everything
that is not per-element maths: reshaping, dtype promotion and the TP collectives.

Log-probs under tensor parallelism: each rank's kernel reads its ``[N, V/tp]``
shard ONCE and returns per-row partials (max ``m``, ``s = sum exp(z - m)``,
``w = sum exp(z - m)(z - m)``, the target's ``z`` when this rank owns it).
:func:`combine_partials` then issues the same two collectives as the torch path
(all-reduce MAX of ``m``; all-reduce SUM of the stacked rebased ``[s, picked, w]``)
so every rank ends with identical global log-probs, logsumexp and entropy. The
backward needs no collective and recomputes the softmax from the saved logsumexp:
nothing ``[N, V]``-sized is kept besides the logits themselves.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

_F32_MIN = torch.finfo(torch.float32).min


def combine_partials(m, s, w, tz, owned, tp_group, tp_size):
    """Global ``(logprobs, lse, entropy)`` [N] float32 from this rank's partials (see module docstring)."""
    big_m = m.clone()
    if tp_size > 1:
        dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=tp_group)
    big_m = torch.where(torch.isfinite(big_m), big_m, torch.zeros_like(big_m))
    has = s > 0  # a shard row with no finite logit has m = -inf and contributes nothing
    d = torch.where(has, m - big_m, torch.zeros_like(m))
    scale = torch.where(has, d.exp(), torch.zeros_like(m))
    picked = (tz - big_m).clamp(min=_F32_MIN) * owned
    stats = torch.stack([s * scale, picked, scale * (w + d * s)])
    if tp_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
    log_s = stats[0].log()
    return stats[1] - log_s, big_m + log_s, log_s - stats[2] / stats[0]


def local_targets(target: torch.Tensor, vocab_start: int, vocab_local: int):
    """``(target_local, owned)``: each target's column in this rank's shard (-1 where another rank owns it)."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return torch.where(owned, local, torch.full_like(local, -1)).contiguous(), owned


def kernel_stats(kernels, x: torch.Tensor, target: torch.Tensor, *, tp_group, tp_size: int, vocab_start: int,
                 inv_t: float):
    """``(logprobs, lse, entropy, target_local)`` [N] of contiguous 2-D logits ``x``: the kernel's one read of
    each row, then :func:`combine_partials`' two collectives."""
    n_tok, vocab_local = x.shape
    target_local, owned = local_targets(target, vocab_start, vocab_local)
    m, s, w, tz = (torch.empty(n_tok, dtype=torch.float32, device=x.device) for _ in range(4))
    if n_tok:
        kernels.logprob_fwd_partials(x, target_local, inv_t, m, s, w, tz)
    logprobs, lse, entropy = combine_partials(m, s, w, tz, owned, tp_group, tp_size)
    return logprobs, lse, entropy, target_local


def kernel_grad(kernels, x: torch.Tensor, target_local: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                g_lp: torch.Tensor | None, g_h: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """``dL/dx`` in ``x``'s dtype from the saved ``lse`` / ``entropy`` (no collective)."""
    grad = torch.empty_like(x)
    g_lp = g_lp.to(torch.float32).contiguous() if g_lp is not None else torch.zeros_like(lse)
    g_h = g_h.to(torch.float32).contiguous() if g_h is not None else None
    if x.shape[0]:
        kernels.logprob_bwd(grad, x, target_local, lse, entropy if g_h is not None else None, g_lp, g_h, inv_t)
    return grad


class FusedLogprob(torch.autograd.Function):
    """``(logprobs, entropy)`` [N] float32 of 2-D ``logits`` with a kernel set; the TP contract of
    ``ops.logprob.vocab_parallel_logprobs``."""

    @staticmethod
    def forward(ctx, logits, target, kernels, tp_group, tp_size, vocab_start, temperature):
        x = logits.contiguous()
        inv_t = 1.0 / temperature
        logprobs, lse, entropy, target_local = kernel_stats(kernels, x, target, tp_group=tp_group, tp_size=tp_size,
                                                            vocab_start=vocab_start, inv_t=inv_t)
        ctx.save_for_backward(x, target_local, lse, entropy)
        ctx.kernels, ctx.inv_t, ctx.in_dtype = kernels, inv_t, logits.dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        x, target_local, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        grad = kernel_grad(ctx.kernels, x, target_local, lse, entropy, grad_logprobs, grad_entropy, ctx.inv_t)
        return grad, None, None, None, None, None, None


def fused_logprobs(kernels, flat_logits, flat_target, *, tp_group, tp_size, vocab_start, temperature,
                   with_entropy):
    logprobs, entropy = FusedLogprob.apply(flat_logits, flat_target, kernels, tp_group, tp_size, vocab_start,
                                           temperature)
    return logprobs, (entropy if with_entropy else None)


_KL_TYPES = {"k1": 1, "k2": 2, "k3": 3, "low_var_kl": 3}


def _kernel_params(params, do_tis: bool, kl_on: bool):
    """The scalar arguments of ppo_fwd/ppo_bwd, in csrc/ops.h MRL_PPO_PARAMS order. Clip bounds are formed in
    float64 as the torch path does (``1.0 - eps``), then rounded once to float32 by the kernel."""
    has_dual = params.dual_clip_c is not None
    return (bool(params.ppo), 1.0 - params.eps_low, 1.0 + params.eps_high, has_dual,
            float(params.dual_clip_c) if has_dual else 0.0, _KL_TYPES[params.kl_type] if kl_on else 0,
            bool(params.unbiased_kl and kl_on), do_tis, float(params.tis_cap), float(params.tis_low))


class FusedPolicyTerms(torch.autograd.Function):
    """Per-token PPO surrogate, KL and TIS weight in one kernel; differentiable in ``pg`` and ``kl``."""

    @staticmethod
    def forward(ctx, logprobs, old, adv, ref, rollout, kernels, kparams):
        n = logprobs.shape[0]
        do_ppo, kl_type, do_tis = kparams[0], kparams[5], kparams[7]

        def out(on, dtype=logprobs.dtype):
            return torch.empty(n, dtype=dtype, device=logprobs.device) if on else None

        ratio = out(True)
        pg, clipped, dual = out(do_ppo), out(do_ppo, torch.bool), out(do_ppo, torch.bool)
        kl = out(kl_type != 0)
        tis_w, capped, floored = out(do_tis), out(do_tis, torch.bool), out(do_tis, torch.bool)
        if n:
            kernels.ppo_fwd(logprobs, old, adv, ref, rollout, *kparams, ratio, pg, clipped, dual, kl, tis_w, capped,
                            floored)
        ctx.save_for_backward(logprobs, old, adv, ref)
        ctx.kernels, ctx.kparams = kernels, kparams
        ctx.set_materialize_grads(False)
        outs = (ratio, pg, clipped, dual, kl, tis_w, capped, floored)
        ctx.mark_non_differentiable(*[t for i, t in enumerate(outs) if t is not None and i not in (1, 4)])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _g_ratio, g_pg, _g_clipped, _g_dual, g_kl, *_rest):
        logprobs, old, adv, ref = ctx.saved_tensors
        if g_pg is None and g_kl is None:
            return (None,) * 7
        grad = torch.empty_like(logprobs)
        conv = (lambda g: None if g is None else g.to(logprobs.dtype).contiguous())
        if logprobs.shape[0]:
            ctx.kernels.ppo_bwd(grad, logprobs, old, adv, ref, conv(g_pg), conv(g_kl), *ctx.kparams)
        return grad, None, None, None, None, None, None


def fused_policy_terms(kernels, logprobs, old_logprobs, advantages, params, ref_logprobs, rollout_logprobs):
    """``(ratio, pg, clipped, dual, kl, tis_w, capped, floored)`` with None for disabled parts. Inputs are promoted
    to one dtype (as torch's binary ops would) and made contiguous; gradients flow back through the casts."""
    given = [t for t in (logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs) if t is not None]
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in given])
    conv = (lambda t: None if t is None else t.to(dtype).contiguous())
    kparams = _kernel_params(params, rollout_logprobs is not None, ref_logprobs is not None)
    return FusedPolicyTerms.apply(conv(logprobs), conv(old_logprobs.detach()), conv(advantages.detach()),
                                  conv(None if ref_logprobs is None else ref_logprobs.detach()),
                                  conv(None if rollout_logprobs is None else rollout_logprobs.detach()),
                                  kernels, kparams)
