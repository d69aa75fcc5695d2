"""Triton versions of the fused kernels, for GPUs without the compiled extension.

Same four entry points and write-into-outputs contract as ``csrc/ops.h``
(``logprob_fwd_partials``, ``logprob_bwd``, ``ppo_fwd``, ``ppo_bwd``) and the same
maths as ``csrc/common/fused_math.h``; ``ops.fused`` wraps them in autograd and
the TP collectives. Importing this module needs triton; ``ops.dispatch`` imports
it only when triton is chosen.

Runs on CPU under ``TRITON_INTERPRET=1`` (tests, small sizes). Loops over the
vocab are ``while`` loops on purpose: with numpy >= 2.4 the interpreter cannot
turn its shape-[1] runtime scalars into a ``range()`` bound ("only 0-dimensional
arrays can be converted to Python scalars"); a ``while`` condition works both
interpreted and compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Globals read inside kernels must be constexpr (compiled Triton refuses plain globals; the interpreter does not).
_F32_MIN = tl.constexpr(-3.4028234663852886e38)
_LOG_RATIO_CLAMP = tl.constexpr(20.0)
_KL_CLAMP = tl.constexpr(10.0)
_FWD_BLOCK = 4096
_BWD_BLOCK = 4096
_PPO_BLOCK = 1024


@triton.jit
def _round_out(x, OUT_BF16: tl.constexpr):
    """float32 -> the output dtype; bf16 rounded to nearest, ties to even, in integer arithmetic.

    Why not ``x.to(tl.bfloat16)``: compiled, that rounds to nearest even, but the interpreter
    (``TRITON_INTERPRET=1``, the CPU tests) truncates, with or without ``fp_downcast_rounding="rtne"``
    (RTNE is the default, so it takes the same truncating path there). The bit form below is
    the same on both, so the interpreted kernels test what the GPU computes and both equal torch's
    ``.to(torch.bfloat16)``. NaN stays a (quiet) NaN; values past bf16's range round to +-inf.
    """
    if OUT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x


@triton.jit
def _logprob_fwd_kernel(x_ptr, tgt_ptr, m_ptr, s_ptr, w_ptr, tz_ptr, V, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    w = tl.zeros([], tl.float32)
    start = 0
    while start < V:
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        d_old = tl.where(s > 0, m - ref, 0.0)  # m is -inf while s == 0
        a = tl.where(s > 0, tl.exp(d_old), 0.0)
        w = tl.where(s > 0, a * (w + d_old * s), 0.0)
        s = s * a
        finite = z != float("-inf")
        dz = tl.where(finite, z - ref, 0.0)
        e = tl.where(finite, tl.exp(dz), 0.0)
        s += tl.sum(e, 0)
        w += tl.sum(e * dz, 0)
        m = m_new
        start += BLOCK
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(w_ptr + row, w)
    t = tl.load(tgt_ptr + row)
    owned = (t >= 0) & (t < V)
    tz = tl.load(base + tl.where(owned, t, 0)).to(tl.float32) * inv_t
    tl.store(tz_ptr + row, tl.where(owned, tz, 0.0))


@triton.jit
def _logprob_bwd_kernel(g_ptr, x_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gh_ptr, V, inv_t,
                        WITH_H: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    z = tl.load(x_ptr + row * V + cols, mask=inside, other=0.0).to(tl.float32) * inv_t
    lse = tl.load(lse_ptr + row)
    a = tl.load(glp_ptr + row)
    logp = tl.maximum(z - lse, _F32_MIN)
    p = tl.exp(logp)
    g = p * (-a)
    if WITH_H:
        h = tl.load(ent_ptr + row)
        b = tl.load(gh_ptr + row)
        g += (logp + h) * p * (-b)
    t = tl.load(tgt_ptr + row)
    g = tl.where(cols == t, g + a, g) * inv_t
    tl.store(g_ptr + row * V + cols, _round_out(g, OUT_BF16).to(g_ptr.dtype.element_ty), mask=inside)


def logprob_fwd_partials(logits, target_local, inv_temperature, m_out, s_out, w_out, tz_out):
    n, v = logits.shape
    if n:
        block = min(_FWD_BLOCK, triton.next_power_of_2(max(v, 16)))
        _logprob_fwd_kernel[(n,)](logits, target_local, m_out, s_out, w_out, tz_out, v, float(inv_temperature),
                                  BLOCK=block)


def logprob_bwd(grad_out, logits, target_local, lse, entropy, g_lp, g_h, inv_temperature):
    n, v = logits.shape
    if n:
        block = min(_BWD_BLOCK, triton.next_power_of_2(max(v, 16)))
        with_h = g_h is not None
        _logprob_bwd_kernel[(n, triton.cdiv(v, block))](
            grad_out, logits, target_local, lse, entropy if with_h else lse, g_lp, g_h if with_h else g_lp, v,
            float(inv_temperature), WITH_H=with_h, BLOCK=block, OUT_BF16=grad_out.dtype == torch.bfloat16)


@triton.jit
def _clamp(x, lo, hi):
    return tl.minimum(tl.maximum(x, lo), hi)


@triton.jit
def _kl_and_grad(lp, ref, KL_TYPE: tl.constexpr):
    log_r = lp - ref
    if KL_TYPE == 1:
        kl = log_r
        dkl = tl.full(log_r.shape, 1.0, tl.float32)
    elif KL_TYPE == 2:
        kl = 0.5 * (log_r * log_r)
        dkl = log_r
    else:
        c = _clamp(log_r, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        e = tl.exp(-c)
        kl = (e - 1.0) + c
        dkl = tl.where((log_r >= -_LOG_RATIO_CLAMP) & (log_r <= _LOG_RATIO_CLAMP), 1.0 - e, 0.0)
    return kl, dkl  # unbounded: the caller clamps k3 (after the unbiased weight, as slime) and gates dkl


@triton.jit
def _kl_bound_gate(v, KL_TYPE: tl.constexpr):
    """The low-variance bound of k3: ``(clamp(v, -10, 10), 1 where the clamp passes the gradient)``."""
    if KL_TYPE == 3:
        out = _clamp(v, -_KL_CLAMP, _KL_CLAMP)
        gate = tl.where((v >= -_KL_CLAMP) & (v <= _KL_CLAMP), 1.0, 0.0)
    else:
        out = v
        gate = tl.full(v.shape, 1.0, tl.float32)
    return out, gate


@triton.jit
def _ppo_fwd_kernel(lp_ptr, old_ptr, adv_ptr, ref_ptr, roll_ptr, ratio_ptr, pg_ptr, clipped_ptr, dual_ptr, kl_ptr,
                    tw_ptr, capped_ptr, floored_ptr, n, clip_lo, clip_hi, dual_c, tis_cap, tis_low,
                    DO_PPO: tl.constexpr, HAS_DUAL: tl.constexpr, KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr,
                    DO_TIS: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    lp = tl.load(lp_ptr + i, mask=inside, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + i, mask=inside, other=0.0).to(tl.float32)
    out_ty = ratio_ptr.dtype.element_ty
    ratio = tl.exp(_clamp(lp - old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    tl.store(ratio_ptr + i, _round_out(ratio, OUT_BF16).to(out_ty), mask=inside)
    if DO_PPO:
        adv = tl.load(adv_ptr + i, mask=inside, other=0.0).to(tl.float32)
        unclipped = -adv * ratio
        clipped_loss = -adv * _clamp(ratio, clip_lo, clip_hi)
        loss = tl.maximum(unclipped, clipped_loss)
        tl.store(clipped_ptr + i, clipped_loss > unclipped, mask=inside)
        if HAS_DUAL:
            cap = -adv * dual_c
            dual = (adv < 0) & (loss > cap)
            loss = tl.where(dual, cap, loss)
        else:
            dual = loss != loss  # all False (no NaN losses from finite inputs)
        tl.store(dual_ptr + i, dual, mask=inside)
        tl.store(pg_ptr + i, _round_out(loss, OUT_BF16).to(out_ty), mask=inside)
    if KL_TYPE != 0:
        ref = tl.load(ref_ptr + i, mask=inside, other=0.0).to(tl.float32)
        kl, _ = _kl_and_grad(lp, ref, KL_TYPE)
        if UNBIASED:
            kl = ratio * kl
        kl, _ = _kl_bound_gate(kl, KL_TYPE)
        tl.store(kl_ptr + i, _round_out(kl, OUT_BF16).to(out_ty), mask=inside)
    if DO_TIS:
        roll = tl.load(roll_ptr + i, mask=inside, other=0.0).to(tl.float32)
        raw = tl.exp(tl.minimum(old - roll, _LOG_RATIO_CLAMP))
        tl.store(tw_ptr + i, _round_out(tl.minimum(tl.maximum(raw, tis_low), tis_cap), OUT_BF16).to(out_ty),
                 mask=inside)
        tl.store(capped_ptr + i, raw > tis_cap, mask=inside)
        tl.store(floored_ptr + i, raw < tis_low, mask=inside)


@triton.jit
def _ppo_bwd_kernel(g_ptr, lp_ptr, old_ptr, adv_ptr, ref_ptr, gpg_ptr, gkl_ptr, n, clip_lo, clip_hi, dual_c,
                    DO_PPO: tl.constexpr, HAS_DUAL: tl.constexpr, KL_TYPE: tl.constexpr, UNBIASED: tl.constexpr,
                    HAS_GPG: tl.constexpr, HAS_GKL: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    lp = tl.load(lp_ptr + i, mask=inside, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + i, mask=inside, other=0.0).to(tl.float32)
    lr = lp - old
    lr_gate = (lr >= -_LOG_RATIO_CLAMP) & (lr <= _LOG_RATIO_CLAMP)
    ratio = tl.exp(_clamp(lr, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    g_lr = tl.zeros([BLOCK], tl.float32)
    g_lp = tl.zeros([BLOCK], tl.float32)
    if DO_PPO and HAS_GPG:
        adv = tl.load(adv_ptr + i, mask=inside, other=0.0).to(tl.float32)
        g_pg = tl.load(gpg_ptr + i, mask=inside, other=0.0).to(tl.float32)
        unclipped = -adv * ratio
        clipped_loss = -adv * _clamp(ratio, clip_lo, clip_hi)
        loss = tl.maximum(unclipped, clipped_loss)
        # torch.maximum splits the gradient in half on ties; clamp passes it on the closed interval
        w_unc = tl.where(unclipped > clipped_loss, 1.0, tl.where(unclipped == clipped_loss, 0.5, 0.0))
        w_clp = tl.where((ratio >= clip_lo) & (ratio <= clip_hi), 1.0 - w_unc, 0.0)
        g_ratio = g_pg * w_unc * (-adv) + g_pg * w_clp * (-adv)
        if HAS_DUAL:
            g_ratio = tl.where((adv < 0) & (loss > -adv * dual_c), 0.0, g_ratio)
        g_lr += g_ratio * ratio
    if KL_TYPE != 0 and HAS_GKL:
        ref = tl.load(ref_ptr + i, mask=inside, other=0.0).to(tl.float32)
        g_kl = tl.load(gkl_ptr + i, mask=inside, other=0.0).to(tl.float32)
        kl, dkl = _kl_and_grad(lp, ref, KL_TYPE)
        if UNBIASED:
            _, gate = _kl_bound_gate(ratio * kl, KL_TYPE)
            g_lp += g_kl * gate * ratio * dkl
            g_lr += g_kl * gate * kl * ratio
        else:
            _, gate = _kl_bound_gate(kl, KL_TYPE)
            g_lp += g_kl * gate * dkl
    g = g_lp + tl.where(lr_gate, g_lr, 0.0)
    tl.store(g_ptr + i, _round_out(g, OUT_BF16).to(g_ptr.dtype.element_ty), mask=inside)


def ppo_fwd(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs, do_ppo, clip_lo, clip_hi, has_dual,
            dual_c, kl_type, unbiased_kl, do_tis, tis_cap, tis_low, ratio_out, pg_out, clipped_out, dual_out, kl_out,
            tis_w_out, tis_capped_out, tis_floored_out):
    n = logprobs.numel()
    if not n:
        return
    dummy = ratio_out  # pointer for outputs/inputs a constexpr flag switches off (never dereferenced)
    dummy_b = clipped_out if clipped_out is not None else (tis_capped_out if tis_capped_out is not None
                                                           else torch.empty(1, dtype=torch.bool,
                                                                            device=logprobs.device))
    _ppo_fwd_kernel[(triton.cdiv(n, _PPO_BLOCK),)](
        logprobs, old_logprobs, advantages, ref_logprobs if ref_logprobs is not None else logprobs,
        rollout_logprobs if rollout_logprobs is not None else logprobs, ratio_out,
        pg_out if pg_out is not None else dummy, clipped_out if clipped_out is not None else dummy_b,
        dual_out if dual_out is not None else dummy_b, kl_out if kl_out is not None else dummy,
        tis_w_out if tis_w_out is not None else dummy, tis_capped_out if tis_capped_out is not None else dummy_b,
        tis_floored_out if tis_floored_out is not None else dummy_b, n, float(clip_lo), float(clip_hi),
        float(dual_c), float(tis_cap), float(tis_low), DO_PPO=bool(do_ppo), HAS_DUAL=bool(has_dual),
        KL_TYPE=int(kl_type), UNBIASED=bool(unbiased_kl), DO_TIS=bool(do_tis), BLOCK=_PPO_BLOCK,
        OUT_BF16=ratio_out.dtype == torch.bfloat16)


def ppo_bwd(grad_out, logprobs, old_logprobs, advantages, ref_logprobs, g_pg, g_kl, do_ppo, clip_lo, clip_hi,
            has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap, tis_low):
    n = logprobs.numel()
    if not n:
        return
    _ppo_bwd_kernel[(triton.cdiv(n, _PPO_BLOCK),)](
        grad_out, logprobs, old_logprobs, advantages, ref_logprobs if ref_logprobs is not None else logprobs,
        g_pg if g_pg is not None else logprobs, g_kl if g_kl is not None else logprobs, n, float(clip_lo),
        float(clip_hi), float(dual_c), DO_PPO=bool(do_ppo), HAS_DUAL=bool(has_dual), KL_TYPE=int(kl_type),
        UNBIASED=bool(unbiased_kl), HAS_GPG=g_pg is not None, HAS_GKL=g_kl is not None, BLOCK=_PPO_BLOCK,
        OUT_BF16=grad_out.dtype == torch.bfloat16)
