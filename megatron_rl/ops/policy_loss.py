"""Per-token PPO/GRPO loss terms: the torch reference and the dispatch to the fused kernels.

``algorithms.losses.compute_policy_loss`` calls :func:`policy_loss_terms` for the
per-token part (TIS weight, PPO clipped surrogate, KL to the reference) and keeps
the reductions (masks, global normalisation, metrics) itself: those are linear in
the per-token terms, so the loss mask enters through the gradient the aggregation
sends back (zero on masked tokens) and the kernels need no mask of their own.

The torch functions here are the reference maths (they used to live in
``algorithms/losses.py``, which re-exports them); the fused kernels
(``csrc/common/fused_math.h``) reproduce them, gradients included.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps a wild stale log-prob from overflowing the ratio
_KL_CLAMP = 10.0  # peers' low-variance KL bound (verl's low_var_kl; slime's low_var_kl clamp)
KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+")
#: verl's straight-through estimators: the value of k1 / k3, the gradient of k2 (torch path only)
STRAIGHT_THROUGH_KL = ("k1+", "k3+", "low_var_kl+")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3", *,
                bound: bool = True) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) on tokens sampled from the policy.

    k1 = log r, k2 = (log r)^2 / 2, with ``log r = logprobs - ref_logprobs``.
    k3 = ``low_var_kl`` = exp(-log r) - 1 + log r (unbiased, >= 0, low variance),
    computed as verl's ``low_var_kl``: ``log r`` clamped to +-20 first and the
    result to at most 10. Why: unclamped, a token the policy all but ruled out
    (log-prob -100 against a reference -1) gives exp(99) -> inf and NaN gradients;
    clamped, it gives 10 and a zero gradient. Ordinary values (|log r| < ~2.5) are
    unchanged. ``bound=False`` leaves out the final clamp (``--use-unbiased-kl`` clamps the
    ratio-weighted product instead, as slime's ``compute_approx_kl``).

    ``k1+``, ``k3+``, ``low_var_kl+`` (verl's ``kl_penalty`` with a trailing ``+``): the value of the
    named estimator with the gradient of k2, ``k2 - k2.detach() + value.detach()``. Why: k1 and k3
    estimate KL's value without bias, but their gradients are not KL's gradient in expectation; k2's is.
    """
    log_r = logprobs - ref_logprobs
    if kind in STRAIGHT_THROUGH_KL:
        value = kl_estimate(logprobs, ref_logprobs, kind[:-1], bound=bound)
        k2 = 0.5 * log_r.square()
        return k2 - k2.detach() + value.detach()
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind in ("k3", "low_var_kl"):
        log_r = log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        k3 = torch.exp(-log_r) - 1.0 + log_r
        return k3.clamp(-_KL_CLAMP, _KL_CLAMP) if bound else k3
    raise ValueError(f"unknown KL estimator {kind!r} (--kl-loss-type): use one of {', '.join(KL_TYPES)}")


def ppo_clip_per_token(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip_c: float | None = None):
    """PPO clipped surrogate per token: ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``.

    With ``dual_clip_c`` the loss of negative-advantage tokens is capped at
    ``-A c`` (dual-clip PPO). Returns ``(loss, ratio, clipped, dual_clipped)``;
    the masks are bool tensors for metrics.
    """
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return loss, ratio, clipped, dual


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float, low: float = 0.0):
    """Truncated importance weights ``clamp(exp(old - rollout), low, cap)`` (detached), and the masks
    of weights capped above and raised to ``low`` below.

    Corrects for the rollout engine's numerics differing from the trainer's:
    tokens were sampled from the engine's distribution but are trained under the
    trainer's (old) one. ``low`` is slime's ``--tis-clip-low`` (0: no lower bound).
    """
    raw = torch.exp((old_logprobs - rollout_logprobs).detach().clamp(max=_LOG_RATIO_CLAMP))
    return raw.clamp(min=low, max=cap), raw > cap, raw < low


@dataclass(frozen=True)
class PolicyLossParams:
    """The scalars of the per-token terms (from ``PolicyGradientConfig``; ops cannot import algorithms).

    ``ppo``: compute the token-level clipped surrogate (False for GSPO, whose
    sequence-level ratio the caller forms, and for ``--advantage-estimator none``).
    """

    ppo: bool
    eps_low: float
    eps_high: float
    dual_clip_c: float | None = None
    kl_type: str = "k3"
    unbiased_kl: bool = False
    tis_cap: float = 2.0
    tis_low: float = 0.0

    def __post_init__(self):
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"unknown KL estimator {self.kl_type!r} (--kl-loss-type): use one of "
                             f"{', '.join(KL_TYPES)}")


@dataclass
class PolicyTerms:
    """Per-token outputs; a part that was not asked for is None. ``pg`` and ``kl`` carry the graph."""

    ratio: torch.Tensor | None = None
    pg: torch.Tensor | None = None
    clipped: torch.Tensor | None = None
    dual: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    tis_weight: torch.Tensor | None = None
    tis_capped: torch.Tensor | None = None
    tis_floored: torch.Tensor | None = None


def torch_policy_terms(logprobs, old_logprobs, advantages, params: PolicyLossParams, *, token_log_ratio=None,
                       ref_logprobs=None, rollout_logprobs=None) -> PolicyTerms:
    """The reference: float32 inputs run exactly the op sequence ``compute_policy_loss`` has always run.

    Inputs below float32 (bf16/fp16 log-probs) are upcast and computed in float32, and the floating outputs
    are rounded once to the inputs' dtype, as the fused kernels do (``fused_math.h``: float32 arithmetic,
    outputs stored in the input dtype). Why: in bf16 every intermediate (the log-ratio, the ratio, the
    clip bounds) would be rounded to 8 mantissa bits, so tokens near the clip bounds flip side and the
    gradient differs from the kernels' by a large fraction of its size. Gradients reach the low-precision
    ``logprobs`` through the casts.
    """
    given = [t for t in (logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs) if t is not None]
    in_dtype = functools.reduce(torch.promote_types, [t.dtype for t in given])
    if in_dtype in (torch.float16, torch.bfloat16):
        up = (lambda t: None if t is None else t.float())
        terms = torch_policy_terms(up(logprobs), up(old_logprobs), up(advantages), params,
                                   ref_logprobs=up(ref_logprobs), rollout_logprobs=up(rollout_logprobs))
        for name in ("ratio", "pg", "kl", "tis_weight"):
            value = getattr(terms, name)
            if value is not None:
                setattr(terms, name, value.to(in_dtype))
        return terms
    if token_log_ratio is None:
        token_log_ratio = logprobs - old_logprobs
    terms = PolicyTerms(ratio=None)
    if rollout_logprobs is not None:
        terms.tis_weight, terms.tis_capped, terms.tis_floored = tis_weights(
            old_logprobs, rollout_logprobs, params.tis_cap, params.tis_low)
    if params.ppo:
        terms.pg, terms.ratio, terms.clipped, terms.dual = ppo_clip_per_token(
            token_log_ratio, advantages, params.eps_low, params.eps_high, params.dual_clip_c)
    if ref_logprobs is not None:
        if params.unbiased_kl:  # importance-weight the on-policy estimate (DeepSeek-V3.2; slime)
            # slime's compute_approx_kl: the low-variance bound clamps the weighted product, not the estimate
            kl = torch.exp(token_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)) * kl_estimate(
                logprobs, ref_logprobs, params.kl_type, bound=False)
            if params.kl_type in ("k3", "low_var_kl"):
                kl = kl.clamp(-_KL_CLAMP, _KL_CLAMP)
        else:
            kl = kl_estimate(logprobs, ref_logprobs, params.kl_type)
        terms.kl = kl
    return terms
