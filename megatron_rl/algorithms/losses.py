"""Policy losses with EXACT global normalisation across micro-batches and DP ranks.

Why: a loss averaged per micro-batch and then averaged over micro-batches/DP
ranks weights tokens unequally whenever micro-batches differ in token count
(dynamic batching always makes them differ). Here every per-micro-batch loss is a
SUM divided by a GLOBAL denominator (``data.packing.LossDenominators``: its
``global_tokens`` / ``global_samples``, counted over the whole step on every DP
rank before training). So:

    sum over micro-batches and DP ranks of loss_mb == the one-big-batch loss

and the gradients match when the trainer SUMS gradients over micro-batches and
DP ranks (a DDP that averages over DP must have its loss scaled by dp_size).
The same holds for metrics: each is returned as ``(sum, count)`` and only
divided after ``reduce_metrics`` has summed both across micro-batches and ranks.

Invariant: a sample is never split across micro-batches (packing keeps samples
whole), so per-sample quantities (sequence means, GSPO ratios, sequence-level
importance weights) are local.
All tensors follow the flat response-aligned convention of ``data.types``.

A metric whose name ends in ``_max`` is a maximum, not a mean: its pair is
``(max, count)``, merged and all-reduced with max (``reduce_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_rl.algorithms.advantages import segment_ids
from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.data.packing import LossDenominators, PackedBatch
# The per-token maths lives in ops (the dispatch point of the fused kernels); re-exported here.
from megatron_rl.ops import PolicyLossParams, policy_loss_terms
from megatron_rl.ops.policy_loss import (  # noqa: F401
    _KL_CLAMP, _LOG_RATIO_CLAMP, kl_estimate, ppo_clip_per_token, tis_weights)

Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (sum, count), both detached float64
MAX_SUFFIX = "_max"  # metrics named *_max hold (max, count) and reduce with max


@dataclass
class LossInputs:
    """Flat per-token tensors of one micro-batch (response-aligned) + the per-sample split.

    ``logprobs`` (and ``entropy``) carry the graph; everything else is treated as
    constant. ``old_logprobs`` None means on-policy (ratio 1, taken as
    ``logprobs.detach()``).
    """

    logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    response_lengths: torch.Tensor | list[int]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __post_init__(self):
        lengths = torch.as_tensor(self.response_lengths, dtype=torch.long)
        total = int(lengths.sum())
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "response_lengths" and v is not None and tuple(v.shape) != (total,):
                raise ValueError(
                    f"LossInputs.{f.name} has shape {tuple(v.shape)} but sum(response_lengths) = {total}: "
                    f"per-token fields must be flat, response-aligned concatenations of the samples")
        self.response_lengths = lengths

    @classmethod
    def from_packed_batch(cls, batch: PackedBatch, logprobs: torch.Tensor,
                          entropy: torch.Tensor | None = None) -> "LossInputs":
        """Loss inputs of one THD micro-batch from the model's response-aligned outputs."""
        if batch.advantages is None:
            raise ValueError("PackedBatch.advantages is None: pass the Spec.compute_advantages output to "
                             "pack_samples before training")
        return cls(logprobs=logprobs, advantages=batch.advantages, loss_mask=batch.loss_mask,
                   response_lengths=batch.response_lengths, old_logprobs=batch.old_logprobs,
                   ref_logprobs=batch.ref_logprobs, rollout_logprobs=batch.rollout_logprobs,
                   teacher_logprobs=batch.teacher_logprobs, entropy=entropy)


def _segment_sum(values: torch.Tensor, response_lengths) -> torch.Tensor:
    lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    out = values.new_zeros(len(lengths))
    return out.index_add(0, segment_ids(lengths).to(values.device), values)


def aggregate(per_token: torch.Tensor, loss_mask: torch.Tensor, response_lengths, mode: str,
              denoms: LossDenominators, max_response_length: int = 0) -> torch.Tensor:
    """Reduce a per-token loss to this micro-batch's share of the global loss.

    * ``token_mean``: ``sum(x * mask) / global_tokens``.
    * ``seq_mean_token_mean``: ``sum_i mean_{t in i}(x) / global_samples``.
    * ``seq_mean_token_sum``: ``sum_i sum_{t in i}(x) / global_samples`` (verl's seq-mean-token-sum).
    * ``seq_mean_token_sum_norm`` (Dr.GRPO): ``sum(x * mask) / (global_samples * max_response_length)``.

    ``global_samples`` counts every sample, fully masked ones included (they add 0
    to the numerator); a sample with no loss tokens has sequence mean 0.
    """
    masked = per_token * loss_mask.to(per_token.dtype)
    if mode == "token_mean":
        return masked.sum() / max(denoms.global_tokens, 1)
    if mode == "seq_mean_token_mean":
        tok = _segment_sum(loss_mask.to(per_token.dtype), response_lengths)
        seq = _segment_sum(masked, response_lengths) / tok.clamp(min=1.0)
        return seq.sum() / max(denoms.global_samples, 1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(denoms.global_samples, 1)
    if mode == "seq_mean_token_sum_norm":
        if max_response_length <= 0:
            raise ValueError("seq_mean_token_sum_norm needs max_response_length > 0 (--rollout-max-response-len)")
        return masked.sum() / (max(denoms.global_samples, 1) * max_response_length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; use token_mean, seq_mean_token_mean, "
                     f"seq_mean_token_sum or seq_mean_token_sum_norm")


def gspo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                   response_lengths) -> torch.Tensor:
    """GSPO-token log-ratio: value = the sequence's mean log-ratio, gradient = that of ``logprobs_t``.

    ``s_i = exp(mean_{t in i} (logp_t - old_t))``; per token ``sg[log s_i] + logp_t - sg[logp_t]``.
    Under ``seq_mean_token_mean`` its gradient equals that of the sequence-level
    GSPO objective; clipping acts on ``s_i``.
    """
    lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    mask = loss_mask.to(logprobs.dtype)
    delta = (logprobs.detach() - old_logprobs) * mask
    seq = _segment_sum(delta, lengths) / _segment_sum(mask, lengths).clamp(min=1.0)
    seq_tok = seq.repeat_interleave(lengths.to(seq.device))
    return seq_tok + logprobs - logprobs.detach()


@dataclass
class PolicyGradientTerms:
    """Per-token policy-gradient loss of a ``--policy-loss-type`` other than vanilla (``pg`` carries the graph),
    the ratio ``exp(clamp(logp - old, +-20))`` and which tokens its clip acted on (None: the loss has no clip)."""

    pg: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor | None
    cov_selected: torch.Tensor | None = None  # clip_cov / kl_cov: the tokens the covariance rule picked


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _covariance(adv: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per token ``(A - mean A) (logp - mean logp)``, the means over this micro-batch's loss tokens (detached)."""
    lp = logprobs.detach()
    return (adv - _masked_mean(adv, mask)) * (lp - _masked_mean(lp, mask))


def policy_gradient_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          loss_mask: torch.Tensor, response_lengths, cfg: PolicyGradientConfig) -> PolicyGradientTerms:
    """The per-token loss of ``cfg.policy_loss_type`` (verl's loss_mode of that name; formulas in docs/algorithms.md).

    Always the torch path (the fused kernels implement the vanilla PPO surrogate only), in float32 at least:
    bf16/fp16 log-probs are upcast, gradients reach them through the cast. ``eps_low``/``eps_high`` are
    ``--eps-clip`` / ``--eps-clip-high``.

    * ``cispo``: ``-sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp`` (MiniMax-M1; its gradient is the clipped
      weight times ``A * grad logp`` for every token, clipped or not).
    * ``gpg``: ``-A * logp`` (GPG: plain policy gradient, no ratio).
    * ``sapo``: ``-(4 / tau) * sigmoid(tau * (r - 1)) * A``, ``tau = --sapo-tau-pos`` if ``A > 0`` else
      ``--sapo-tau-neg`` (SAPO's soft gate in place of the clip).
    * ``geo_mean`` (GMPO): per sequence ``-mean_t(A) * exp(mean_t(x_t))`` over loss tokens, ``x_t`` the log-ratio
      clipped to ``[-eps_low, eps_high]`` on the side the advantage's sign selects
      (``sign(A) * min(sign(A) lr, sign(A) clamp(lr))``). The sequence's value sits on each of its tokens, so
      ``seq_mean_token_mean`` (the only aggregation it takes) gives the mean over sequences exactly, gradient
      included.
    * ``clip_cov`` (Clip-Cov): the PPO clip ``max(-A r, -A clip(r))``, set to 0 (no gradient) on up to
      ``max(int(--clip-cov-ratio * N), 1)`` tokens the clip left alone whose covariance
      ``(A - mean A)(logp - mean logp)`` lies in ``(--clip-cov-lb, --clip-cov-ub)``, a random subset when more
      qualify (verl's ``torch.randperm``, here from a generator seeded by the micro-batch's loss-token and
      candidate counts, so tensor-parallel ranks agree).
    * ``kl_cov`` (KL-Cov): ``-A r`` (no clip), plus ``--ppo-kl-coef * |logp - old|`` on the
      ``max(int(--kl-cov-ratio * N), 1)`` tokens of largest covariance.

    Clip-Cov and KL-Cov select among THIS call's tokens (``N`` its loss tokens, the means over them): per
    micro-batch, as verl, so the selection depends on how the step is split into micro-batches.
    """
    kind = cfg.policy_loss_type
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp, old, adv = logprobs.to(dtype), old_logprobs.to(dtype), advantages.to(dtype)
    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    eps_low, eps_high = cfg.eps_clip, cfg.clip_high
    if kind == "cispo":
        weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
        return PolicyGradientTerms(-weight * adv * lp, ratio, ratio.detach() != weight)
    if kind == "gpg":
        return PolicyGradientTerms(-adv * lp, ratio, None)
    if kind == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, cfg.sapo_tau_pos), torch.full_like(adv, cfg.sapo_tau_neg))
        return PolicyGradientTerms(-torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, ratio, None)
    if kind == "geo_mean":
        lengths = torch.as_tensor(response_lengths, dtype=torch.long)
        mask = loss_mask.to(dtype)
        sign = torch.sign(adv)
        bounded = log_ratio.clamp(-eps_low, eps_high)
        x = sign * torch.minimum(sign * log_ratio, sign * bounded)
        count = _segment_sum(mask, lengths).clamp(min=1.0)
        seq_log_ratio = _segment_sum(x * mask, lengths) / count
        seq_adv = _segment_sum(adv * mask, lengths) / count
        seq_loss = -seq_adv * torch.exp(seq_log_ratio)
        clipped = (log_ratio != bounded) & (adv != 0)
        return PolicyGradientTerms(seq_loss.repeat_interleave(lengths.to(seq_loss.device)), ratio, clipped)
    if kind == "clip_cov":
        keep = loss_mask > 0
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        clipped = (pg2 > pg1) & keep
        cov = _covariance(adv, lp, loss_mask.to(dtype))
        candidates = torch.nonzero(keep & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).flatten()
        n_drop = max(int(cfg.clip_cov_ratio * int(keep.sum())), 1)
        if len(candidates) > n_drop:  # verl: a random subset (torch.randperm)
            # seeded from the micro-batch itself, not the global generator: every tensor-parallel rank holds the
            # same tokens and must drop the same ones, whatever else consumed its random stream
            g = torch.Generator().manual_seed(int(keep.sum()) * 1_000_003 + len(candidates))
            candidates = candidates[torch.randperm(len(candidates), generator=g)[:n_drop].to(candidates.device)]
        selected = torch.zeros_like(keep)
        selected[candidates] = True
        pg = torch.where(selected, torch.zeros_like(pg1), torch.maximum(pg1, pg2))
        return PolicyGradientTerms(pg, ratio, clipped, selected)
    if kind == "kl_cov":
        keep = loss_mask > 0
        pg = -adv * ratio
        selected = torch.zeros_like(keep)
        n_valid = int(keep.sum())
        if n_valid:
            valid = torch.nonzero(keep).flatten()
            cov = _covariance(adv, lp, loss_mask.to(dtype))[valid]
            top = max(1, int(n_valid * cfg.kl_cov_ratio))
            selected[valid[torch.topk(cov, top, largest=True).indices]] = True
        pg = torch.where(selected, pg + cfg.ppo_kl_coef * log_ratio.abs(), pg)
        return PolicyGradientTerms(pg, ratio, None, selected)
    raise ValueError(f"unknown policy loss {kind!r} (--policy-loss-type)")


def _msum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.detach().to(torch.float64)
    return (values.detach().to(torch.float64) * m).sum(), m.sum()


def _mmax(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max over mask, count)`` for a ``*_max`` metric of non-negative values; 0 when nothing is masked in,
    so a rank or micro-batch without loss tokens never wins the max."""
    keep = mask.detach().bool()
    v = torch.where(keep, values.detach().to(torch.float64), torch.zeros((), dtype=torch.float64,
                                                                        device=values.device))
    return (v.max() if v.numel() else v.new_zeros(())), keep.to(torch.float64).sum()


def _seq_frac(event: torch.Tensor, loss_mask: torch.Tensor, response_lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Fraction of the sequences with loss tokens in which ``event`` holds on at least one loss token."""
    m = loss_mask.detach().to(torch.float64)
    hits = _segment_sum(event.detach().to(torch.float64) * m, response_lengths) > 0
    has_tokens = _segment_sum(m, response_lengths) > 0
    return (hits & has_tokens).to(torch.float64).sum(), has_tokens.to(torch.float64).sum()


def level_log_ratio(log_ratio: torch.Tensor, loss_mask: torch.Tensor, response_lengths, level: str) -> torch.Tensor:
    """The log importance ratio at ``level``, one value per token (a sequence's value on each of its tokens).

    With ``log_ratio = old - rollout`` per token (proximal over behaviour policy):

    * ``token``: ``log_ratio`` itself (per-token IS; slime's TIS, AReaL's decoupled PPO).
    * ``sequence``: ``sum_{t in i, mask_t = 1} log_ratio_t``, the log of the product of the token ratios
      (verl's ``rollout_is``/``rollout_rs`` ``sequence``, slime MIS's ``sequence``): the unbiased
      sequence-level weight, whose variance grows with length.
    * ``geometric``: that sum over the count of loss tokens, the log of the per-token geometric mean
      (verl's ``rollout_rs`` ``geometric`` = ``seq_mean_k1``, slime MIS's ``geometric``, AReaL's sequence
      level with ``agg: mean``): length-invariant, so one threshold fits short and long responses.

    Only loss tokens (mask 1) enter the sums: tool/observation tokens were not sampled by the policy. A
    masked token's value is replaced by 0 before summing, so an inf/NaN there cannot leak in; a sequence
    with no loss tokens gets 0 (ratio 1).
    """
    if level == "token":
        return log_ratio
    keep = loss_mask.bool()
    lr = torch.where(keep, log_ratio, torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    seq = _segment_sum(lr, lengths)
    if level == "geometric":
        seq = seq / _segment_sum(keep.to(lr.dtype), lengths).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"unknown importance-sampling level {level!r}: use token, sequence or geometric")
    return seq.repeat_interleave(lengths.to(seq.device))


@dataclass
class BoundedWeights:
    """Per-token importance weights after truncation or masking (detached), and which tokens each bound hit.

    ``raw`` is the ratio before bounding, ``exp(min(log_ratio, 20))`` (finite for any input).
    ``above``/``below``: the raw ratio was above ``cap`` / below ``low``; in ``truncate`` mode those
    tokens carry the bound, in ``mask`` mode their weight is 0 (``masked = above | below``).
    """

    weight: torch.Tensor
    raw: torch.Tensor
    above: torch.Tensor
    below: torch.Tensor

    @property
    def masked(self) -> torch.Tensor:
        return self.above | self.below


def bounded_weights(log_ratio: torch.Tensor, cap: float, low: float, mode: str) -> BoundedWeights:
    """Bound the ratio ``r = exp(log_ratio)`` to ``[low, cap]`` by truncation or by masking.

    * ``truncate``: ``w = clamp(r, low, cap)``: truncated IS (Espeholt et al. 2018, IMPALA's rho-bar;
      "Your efficient RL framework secretly brings you off-policy RL training", Yao et al. 2025:
      slime's ``--use-tis``, verl's ``rollout_is``). Biased, bounded variance; every token still trains.
    * ``mask``: ``w = r`` if ``low <= r <= cap`` else 0: masked IS (slime's IcePop function and MIS
      ``mask`` mode; AReaL's decoupled PPO with ``behav_imp_weight_cap``, Fu et al. 2025, which masks
      tokens whose behaviour weight exceeds the cap). A token whose ratio is that far off says more
      about a stale or broken sample than about the policy, so it is dropped rather than down-weighted.

    ``log_ratio`` is clamped at +20 before ``exp`` (so +50 gives ``exp(20)``, never inf: as
    ``tis_weights`` and verl's ``SAFETY_BOUND``); -50 gives ``exp(-50)``, a finite tiny number. A cap
    below ``exp(20)`` (any sane one) makes the clamp invisible in ``above``.
    """
    raw = torch.exp(log_ratio.detach().clamp(max=_LOG_RATIO_CLAMP))
    above, below = raw > cap, raw < low
    if mode == "truncate":
        weight = raw.clamp(min=low, max=cap)
    elif mode == "mask":
        weight = torch.where(above | below, torch.zeros_like(raw), raw)
    else:
        raise ValueError(f"unknown importance-weight mode {mode!r} (--tis-mode): use truncate or mask")
    return BoundedWeights(weight, raw, above, below)


def off_policy_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       response_lengths, cfg: PolicyGradientConfig,
                       tis_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, Metrics]:
    """The off-policy correction weight of every token (detached; 1 where no correction is on) and its metrics.

    ``w = w_tis * w_rs``: ``w_tis`` the importance weight of ``--use-tis`` (``bounded_weights`` of the
    ratio at ``--tis-level``, bounds ``[--tis-clip-low, --tis-cap]``, ``--tis-mode``), ``w_rs`` the 0/1
    keep mask of ``--use-rs`` (the ratio at ``--rs-level`` inside ``[rs_low, --rs-upper-bound]``; verl's
    ``rollout_rs``, slime MIS's ``use_rs``). The ratio is ``exp(old - rollout)``: old = the log-probs the
    trainer recomputed before the step (AReaL's proximal policy), rollout = the engine's at sampling time
    (the behaviour policy), so with PPO's ``exp(logp - old)`` this is AReaL's decoupled objective
    ``w * clip(exp(logp - old))``. A weight of 0 removes the token's PG term but not its count in the
    loss denominator (global, counted before training: slime and AReaL keep the original count).

    ``tis_terms``: ``(weight, capped, floored)`` of the fused per-token kernel for the default token-level
    truncation, so that path stays bit for bit what ``--use-tis`` always computed.
    """
    mask = loss_mask
    weight = torch.ones_like(old_logprobs)
    metrics: Metrics = {}
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    if cfg.use_tis:
        if tis_terms is not None and cfg.tis_level == "token" and cfg.tis_mode == "truncate":
            w, capped, floored = tis_terms
            raw_max = _mmax(torch.exp(log_ratio.clamp(max=_LOG_RATIO_CLAMP)), mask)
        else:
            b = bounded_weights(level_log_ratio(log_ratio, mask, response_lengths, cfg.tis_level),
                                cfg.tis_cap, cfg.tis_clip_low, cfg.tis_mode)
            w, capped, floored, raw_max = b.weight, b.above, b.below, _mmax(b.raw, mask)
        weight = w
        metrics["tis_weight"] = _msum(w, mask)
        metrics["tis_ratio_max"] = raw_max
        if cfg.tis_mode == "truncate":
            metrics["tis_capped_frac"] = _msum(capped.double(), mask)
            if cfg.tis_clip_low:
                metrics["tis_clip_low_frac"] = _msum(floored.double(), mask)
            if cfg.tis_level != "token":  # one fate per sequence: count sequences too
                metrics["tis_seq_capped_frac"] = _seq_frac(capped, mask, response_lengths)
                if cfg.tis_clip_low:
                    metrics["tis_seq_clip_low_frac"] = _seq_frac(floored, mask, response_lengths)
        else:
            masked = capped | floored
            metrics["tis_masked_frac"] = _msum(masked.double(), mask)
            metrics["tis_seq_masked_frac"] = _seq_frac(masked, mask, response_lengths)
    if cfg.use_rs:
        r = bounded_weights(level_log_ratio(log_ratio, mask, response_lengths, cfg.rs_level),
                            cfg.rs_upper_bound, cfg.rs_low, "mask")
        weight = weight * (~r.masked).to(weight.dtype)
        metrics["rs_ratio_max"] = _mmax(r.raw, mask)
        metrics["rs_masked_frac"] = _msum(r.masked.double(), mask)
        metrics["rs_seq_masked_frac"] = _seq_frac(r.masked, mask, response_lengths)
    return weight, metrics


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> Metrics:
    """Train-vs-rollout log-prob mismatch over loss tokens: mean |diff|, k3 KL(rollout || train), the fraction of
    tokens whose two log-probs differ at all, and the largest |diff| (both 0 under --true-on-policy-mode)."""
    diff = (train_logprobs - rollout_logprobs).detach().double()
    return {"mismatch_abs_logprob": _msum(diff.abs(), loss_mask),
            "mismatch_k3_kl": _msum(torch.exp(diff) - 1.0 - diff, loss_mask),
            "mismatch_logprob_diff_frac": _msum((diff != 0).double(), loss_mask),
            "mismatch_abs_logprob_max": _mmax(diff.abs(), loss_mask)}


def compute_policy_loss(inputs: LossInputs, denoms: LossDenominators,
                        cfg: PolicyGradientConfig) -> tuple[torch.Tensor, Metrics]:
    """The full RL loss of one micro-batch and its metric sums.

    ``loss = agg(w * pg) + kl_loss_coef * agg(kl) - entropy_coef * agg(H) + opd_coef * agg(w * opd)``
    where ``w`` is the off-policy correction weight (``off_policy_weights``: TIS and rejection
    sampling; 1 with neither), ``kl`` the KL estimate (times the
    ratio ``exp(logp - old)`` with ``use_unbiased_kl``, the k3 bound then clamping the product, as
    slime), ``pg`` the PPO/GSPO
    clipped surrogate and ``opd = sg[logp - teacher_logp] * ratio`` the
    policy-gradient form of the per-token reverse KL to the teacher (its gradient
    is ``(logp - teacher) * grad logp``; the plain k1 sample would have expectation-zero gradient).
    """
    x, mask, lengths = inputs, inputs.loss_mask, inputs.response_lengths

    def agg(v):
        return aggregate(v, mask, lengths, cfg.loss_agg_mode, denoms, cfg.max_response_length)

    def need(name, flag):
        if getattr(x, name) is None:
            raise ValueError(f"LossInputs.{name} is None but {flag} needs it: have the trainer compute it "
                             f"(see Spec.prepare_batch requirements)")
        return getattr(x, name)

    old = x.old_logprobs if x.old_logprobs is not None else x.logprobs.detach()
    metrics: Metrics = {"loss_tokens": (mask.detach().double().sum(), torch.ones((), dtype=torch.float64))}
    rollout = need("rollout_logprobs", "--use-tis" if cfg.use_tis else "--use-rs") if (
        cfg.use_tis or cfg.use_rs) else None
    # The fused kernels compute the default token-level truncated weight; other corrections are formed here.
    kernel_tis = cfg.use_tis and cfg.tis_level == "token" and cfg.tis_mode == "truncate"
    ref = need("ref_logprobs", "--kl-loss-coef") if (cfg.kl_loss_coef or x.ref_logprobs is not None) else None
    token_log_ratio = x.logprobs - old
    # Only the vanilla PPO surrogate may come from a fused kernel: other --policy-loss-type values are formed
    # on the torch path (policy_gradient_terms), the kernels then give only the KL and TIS terms.
    use_ppo = cfg.advantage_estimator != "none" and not cfg.use_gspo and cfg.policy_loss_type == "vanilla"
    # The per-token terms (TIS weight, PPO surrogate, KL) come from the ops dispatch: torch or a fused kernel.
    terms = policy_loss_terms(
        x.logprobs, old, x.advantages,
        PolicyLossParams(ppo=use_ppo, eps_low=cfg.eps_clip, eps_high=cfg.clip_high, dual_clip_c=cfg.eps_clip_c,
                         kl_type=cfg.kl_loss_type, unbiased_kl=cfg.use_unbiased_kl, tis_cap=cfg.tis_cap,
                         tis_low=cfg.tis_clip_low),
        token_log_ratio=token_log_ratio, ref_logprobs=ref, rollout_logprobs=rollout if kernel_tis else None)
    weight = torch.ones_like(x.logprobs)
    if rollout is not None:
        tis_terms = None
        if kernel_tis:
            assert terms.tis_weight is not None and terms.tis_capped is not None and terms.tis_floored is not None, \
                "policy_loss_terms returns the TIS terms whenever rollout_logprobs is given"
            tis_terms = (terms.tis_weight, terms.tis_capped, terms.tis_floored)
        weight, correction_metrics = off_policy_weights(old, rollout, mask, lengths, cfg, tis_terms)
        metrics.update(correction_metrics)
    if x.rollout_logprobs is not None:  # --use-rollout-logprobs: old IS rollout; the training forward is compared
        metrics.update(mismatch_metrics(x.logprobs if cfg.use_rollout_logprobs else old, x.rollout_logprobs, mask))

    # verl's ppo_kl: masked mean of -(new - old), the log-ratio clamped to [-20, 20] first (as for the ratio)
    metrics["ppo_kl"] = _msum(-token_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP), mask)
    loss = x.logprobs.new_zeros(())
    if cfg.advantage_estimator != "none":
        pg: torch.Tensor | None
        ratio: torch.Tensor | None
        clipped: torch.Tensor | None
        dual: torch.Tensor | None = None
        cov_selected: torch.Tensor | None = None
        if cfg.policy_loss_type != "vanilla":
            alt = policy_gradient_terms(x.logprobs, old, x.advantages, mask, lengths, cfg)
            pg, ratio, clipped, cov_selected = alt.pg, alt.ratio, alt.clipped, alt.cov_selected
        elif cfg.use_gspo:
            log_ratio = gspo_log_ratio(x.logprobs, old, mask, lengths)
            pg, ratio, clipped, dual = ppo_clip_per_token(log_ratio, x.advantages, cfg.gspo_eps_clip,
                                                          cfg.gspo_eps_clip_high)
        else:
            pg, ratio, clipped, dual = terms.pg, terms.ratio, terms.clipped, terms.dual
        assert pg is not None and ratio is not None, "the policy term is asked for whenever it is used"
        loss = loss + agg(weight * pg)
        metrics["pg_loss"] = _msum(pg, mask)
        if clipped is not None:
            metrics["clip_frac"] = _msum(clipped.double(), mask)
        if dual is not None:
            metrics["dual_clip_frac"] = _msum(dual.double(), mask)
        if cov_selected is not None:  # clip_cov / kl_cov
            metrics["cov_selected_frac"] = _msum(cov_selected.double(), mask)
        metrics["ratio"] = _msum(ratio, mask)
        metrics["ratio_abs_dev"] = _msum((ratio - 1.0).abs(), mask)
    if ref is not None:
        kl = terms.kl
        assert kl is not None, "policy_loss_terms returns the KL term whenever ref_logprobs is given"
        metrics["kl"] = _msum(kl, mask)
        if cfg.kl_loss_coef:
            loss = loss + cfg.kl_loss_coef * agg(kl)
    if cfg.entropy_coef or x.entropy is not None:
        entropy = need("entropy", "--entropy-coef")
        metrics["entropy"] = _msum(entropy, mask)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * agg(entropy)
    if cfg.opd_coef or x.teacher_logprobs is not None:
        reverse_kl = (x.logprobs - need("teacher_logprobs", "--opd-coef")).detach()
        metrics["opd_reverse_kl"] = _msum(reverse_kl, mask)
        if cfg.opd_coef:
            opd = reverse_kl * torch.exp(token_log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
            loss = loss + cfg.opd_coef * agg(weight * opd)
    return loss, metrics


def compute_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       loss_mask: torch.Tensor, response_lengths, denoms: LossDenominators, *, value_clip: float,
                       loss_agg_mode: str, max_response_length: int = 0) -> tuple[torch.Tensor, Metrics]:
    """The critic's clipped value loss of one micro-batch (verl's ``compute_value_loss``, from TRL):

    ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))`` with ``agg`` the run's
    ``--loss-agg-mode`` over the step's GLOBAL denominators (so micro-batch losses sum to the whole
    step's, as the policy loss), ``V`` the values being trained (carrying the graph), ``V_old`` the
    critic's values from the step's forward-only pass, ``R`` the GAE returns, ``c`` = ``--value-clip``.
    Metrics (sum, count pairs): ``value_loss`` (half the clipped squared error per loss token: verl's
    ``vf_loss`` under token_mean),
    ``vf_clipfrac`` (verl's: share of loss tokens whose clipped error is the larger one), ``vpred_mean``.
    """
    old = old_values.detach().to(values.dtype)
    ret = returns.detach().to(values.dtype)
    clipped = old + (values - old).clamp(-value_clip, value_clip)
    unclipped_err = (values - ret) ** 2
    clipped_err = (clipped - ret) ** 2
    err = torch.maximum(unclipped_err, clipped_err)
    loss = 0.5 * aggregate(err, loss_mask, response_lengths, loss_agg_mode, denoms, max_response_length)
    metrics: Metrics = {"value_loss": _msum(0.5 * err, loss_mask),
                        "vf_clipfrac": _msum((clipped_err > unclipped_err).to(torch.float64), loss_mask),
                        "vpred_mean": _msum(values, loss_mask)}
    return loss, metrics


def merge_metrics(parts: Iterable[Metrics]) -> Metrics:
    """Sum ``(sum, count)`` pairs of several micro-batches, name by name (``*_max``: max of the values)."""
    out: Metrics = {}
    for part in parts:
        for k, (s, c) in part.items():
            if k in out:
                top = torch.maximum(out[k][0], s.detach().double()) if k.endswith(MAX_SUFFIX) else out[k][0] + s
                out[k] = (top, out[k][1] + c)
            else:
                out[k] = (s.detach().double(), c.detach().double())
    return out


def reduce_metrics(parts: Iterable[Metrics], group=None) -> dict[str, float]:
    """Exact means: sum over micro-batches, all-reduce over ``group`` (the DP group), then divide.

    ``group=None`` reduces locally only (TP ranks hold duplicate metrics, so never
    reduce over the whole world). Metric names depend on the config and on which
    optional inputs are given; every rank of ``group`` must give the same ones.
    ``loss_tokens`` is reported as a total, ``*_max`` as the maximum (all-reduced with MAX; 0 when
    no rank had a token), everything else as a mean.
    """
    merged = merge_metrics(parts)
    out: dict[str, float] = {}
    sums = sorted(k for k in merged if not k.endswith(MAX_SUFFIX))
    maxes = sorted(k for k in merged if k.endswith(MAX_SUFFIX))
    if sums:
        stacked = torch.stack([torch.stack(merged[k]) for k in sums])
        if group is not None:
            dist.all_reduce(stacked, group=group)
        for k, (s, c) in zip(sums, stacked.tolist()):
            out[k] = s if k == "loss_tokens" else (s / c if c > 0 else 0.0)
    if maxes:  # same names on every rank, so every rank joins this collective or none does
        stacked = torch.stack([torch.stack(merged[k]) for k in maxes])
        if group is not None:
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
        for k, (m, c) in zip(maxes, stacked.tolist()):
            out[k] = m if c > 0 else 0.0
    return dict(sorted(out.items()))
