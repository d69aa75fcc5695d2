"""Advantage estimators: GRPO, Dr.GRPO, RLOO, GPG, OPO, REINFORCE++(-baseline), GAE, batch whitening.

All functions are pure tensor maths on the RESPONSE-ALIGNED convention of
``megatron_rl.data.types``: per-sample scalars are ``[B]``; per-token tensors are
flat ``[sum(response_lengths)]`` concatenations of the per-sample pieces.

Invariants:
* No NaN on degenerate input: all-equal group rewards give advantage 0; a group of
  size 1 gives 0 (it has no within-group contrast, and leaving the raw reward
  would mix an un-baselined REINFORCE term into a group-relative batch); empty
  responses contribute no tokens.
* Token advantages are 0 where ``loss_mask`` is 0.
* Batch-level statistics (REINFORCE++ whitening, ``--normalize-advantages``) are
  over the tensors passed in: call these on the WHOLE rollout batch, before it is
  sharded over DP ranks. They are float64 with the peers' conventions (Bessel
  variance, eps inside the square root); a constant batch whitens to exactly 0.

docs/algorithms.md lists every formula and the peer convention it follows;
tests/algorithms/vectors/ holds expected values computed independently from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


GRPO_STD_LEVELS = ("group", "batch")  # --grpo-std-level: whose spread scales a GRPO advantage

def _as_tensor(x, dtype=torch.float32) -> torch.Tensor:
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.as_tensor(list(x), dtype=dtype)


def _lengths(response_lengths) -> torch.Tensor:
    return _as_tensor(response_lengths, torch.long)


def segment_ids(response_lengths) -> torch.Tensor:
    """``[T]`` sample index of every flat response token."""
    lengths = _lengths(response_lengths)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def broadcast_to_tokens(per_sample: torch.Tensor, response_lengths, loss_mask: torch.Tensor | None = None):
    """Repeat one value per sample over that sample's response tokens (0 where masked)."""
    out = per_sample.repeat_interleave(_lengths(response_lengths).to(per_sample.device))
    return out if loss_mask is None else out * loss_mask.to(out.dtype)


def _group_stats(rewards: torch.Tensor, group_index):
    """Per-sample group sum, count, unbiased std (0 for groups of size 1) and whether the group
    has any contrast (size > 1 and not all rewards equal: float rounding of the mean must not
    turn an all-equal group into tiny nonzero advantages)."""
    _, inverse = torch.unique(_as_tensor(group_index, torch.long), return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    g_sum = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    g_cnt = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = g_sum / g_cnt
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    std = torch.where(g_cnt > 1, (sq / (g_cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    g_max = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amax")
    g_min = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, inverse, r, "amin")
    contrast = (g_cnt > 1) & (g_max > g_min)
    return g_sum[inverse], g_cnt[inverse], std[inverse], contrast[inverse]


def grpo_advantages(rewards, group_index, *, normalize_std: bool = True, eps: float = 1e-6,
                    std_level: str = "group") -> torch.Tensor:
    """GRPO per-sample advantage ``(r - mean_g) / (std + eps)``; Dr.GRPO when ``normalize_std=False``.

    ``std`` is the unbiased (n-1) std of the group (``std_level="group"``), as in the GRPO paper's
    reference implementations, or of every reward of the batch (``"batch"``: TRL's
    ``scale_rewards="batch"``, the group-mean baseline over the batch's spread as "Tricks or Traps"
    (arXiv 2508.08221) recommends: a group's scale no longer depends on how hard its prompt was).
    Groups are identified by ``group_index`` and need not be contiguous. A group without contrast
    gives 0 at either level.
    """
    r = _as_tensor(rewards)
    if r.numel() == 0:
        return r
    if std_level not in GRPO_STD_LEVELS:
        raise ValueError(f"std_level {std_level!r}: one of {GRPO_STD_LEVELS}")
    g_sum, g_cnt, std, contrast = _group_stats(r, group_index)
    adv = r.double() - g_sum / g_cnt
    if normalize_std:
        if std_level == "batch":  # one std for all (0 for a single reward: no group has contrast then)
            std = torch.full_like(std, r.double().std().item() if r.numel() > 1 else 0.0)
        adv = adv / torch.where(contrast, std + eps, torch.ones_like(std))
    return torch.where(contrast, adv, torch.zeros_like(adv)).to(r.dtype)


def rloo_advantages(rewards, group_index) -> torch.Tensor:
    """RLOO per-sample advantage ``r_i - mean_{j != i in group} r_j`` (0 for groups of size 1)."""
    r = _as_tensor(rewards)
    if r.numel() == 0:
        return r
    g_sum, g_cnt, _, contrast = _group_stats(r, group_index)
    baseline = (g_sum - r.double()) / (g_cnt - 1).clamp(min=1)
    return torch.where(contrast, r.double() - baseline, torch.zeros_like(baseline)).to(r.dtype)


def gpg_advantages(rewards, group_index) -> torch.Tensor:
    """GPG per-sample advantage ``alpha * (r_i - mean_g)``, ``alpha = B / max(#{i: r_i != 0}, 1)`` over the
    batch (verl's gpg estimator with ``f_norm = 1``): the group-mean baseline, scaled up by how few samples
    of the batch earned any reward. Needs the whole rollout batch (``alpha`` is a batch statistic).
    A group of size 1 or without contrast gives 0 (verl keeps ``alpha * r`` for a single sample)."""
    r = _as_tensor(rewards)
    if r.numel() == 0:
        return r
    g_sum, g_cnt, _, contrast = _group_stats(r, group_index)
    alpha = r.numel() / max(int(torch.count_nonzero(r)), 1)
    adv = alpha * (r.double() - g_sum / g_cnt)
    return torch.where(contrast, adv, torch.zeros_like(adv)).to(r.dtype)


def opo_advantages(rewards, group_index, token_counts) -> torch.Tensor:
    """OPO per-sample advantage ``r_i - sum_g(l_j r_j) / sum_g(l_j)``: the length-weighted group mean as the
    baseline (OPO, arXiv 2505.23585; verl's opo), ``l_j`` the loss-token count of sample ``j``. A group of
    size 1, without contrast, or with no loss token gives 0 (verl keeps ``r`` for a single sample)."""
    r = _as_tensor(rewards)
    if r.numel() == 0:
        return r
    _, _, _, contrast = _group_stats(r, group_index)
    _, inverse = torch.unique(_as_tensor(group_index, torch.long), return_inverse=True)
    n_groups = int(inverse.max()) + 1
    lengths = _as_tensor(token_counts, torch.float64)
    weighted = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, lengths * r.double())
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, lengths)
    ok = contrast & (total[inverse] > 0)
    adv = r.double() - weighted[inverse] / total[inverse].clamp(min=1.0)
    return torch.where(ok, adv, torch.zeros_like(adv)).to(r.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries, 0 elsewhere (verl's ``masked_whiten``).

    Why this exact form: statistics are float64 and ``eps`` sits INSIDE the square
    root with the unbiased (Bessel, n-1) variance, as the peers compute it. The old
    float32 ``/ (std + eps)`` turned a constant batch into large same-sign
    advantages (the float32 mean of six 0.1s is 1 ulp off and was divided by
    ~1e-8). A batch whose masked values are all equal, or that has fewer than two
    masked entries (no variance to divide by), gives exactly 0. The result has
    ``x``'s dtype.
    """
    m = mask.to(torch.float64)
    sel = x.detach().to(torch.float64)[m > 0]
    if sel.numel() < 2 or bool(sel.max() == sel.min()):
        return torch.zeros_like(x)
    mean = sel.mean()
    var = ((sel - mean) ** 2).sum() / (sel.numel() - 1)
    return ((x.detach().to(torch.float64) - mean) / torch.sqrt(var + eps) * m).to(x.dtype)


def _to_padded(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Flat response-aligned ``[T]`` -> right-padded ``[B, max_len]`` (zeros past each length)."""
    n = len(lengths)
    width = int(lengths.max()) if n else 0
    out = flat.new_zeros(n, width)
    if flat.numel():
        col = torch.arange(flat.numel()) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        out[segment_ids(lengths), col] = flat
    return out


def _from_padded(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    valid = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return padded[valid]


def discounted_returns(token_rewards: torch.Tensor, response_lengths, gamma: float = 1.0) -> torch.Tensor:
    """Per-sample reverse cumulative sum ``G_t = r_t + gamma * G_{t+1}`` over flat tokens."""
    lengths = _lengths(response_lengths)
    padded = _to_padded(token_rewards, lengths)
    running = padded.new_zeros(padded.shape[0])
    for t in range(padded.shape[1] - 1, -1, -1):  # right padding is all zeros, so it adds nothing
        running = padded[:, t] + gamma * running
        padded[:, t] = running
    return _from_padded(padded, lengths)


def reinforce_plus_plus_advantages(rewards, response_lengths, loss_mask: torch.Tensor, *,
                                   kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                                   group_index=None, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++ token advantages: whitened returns of KL-penalised token rewards.

    Token reward = ``-kl_coef * kl_t`` on every loss token, plus the sample reward
    on its LAST loss token (the reward is for the finished response). Returns are
    discounted with ``gamma`` per sample and whitened over all loss tokens of the
    batch (``masked_whiten``). ``kl`` is the per-token KL estimate of the policy to the reference
    (e.g. ``old_logprobs - ref_logprobs``), flat and response-aligned. With
    ``group_index`` the group mean reward is subtracted first (REINFORCE++-baseline).
    """
    r = _as_tensor(rewards, torch.float64)
    mask = loss_mask.to(torch.float64)
    lengths = _lengths(response_lengths)
    if group_index is not None and r.numel():
        g_sum, g_cnt, _, contrast = _group_stats(r, group_index)
        r = torch.where(contrast, r - g_sum / g_cnt, torch.zeros_like(g_sum))
    token_rewards = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl.detach().to(torch.float64) * mask
    seg = segment_ids(lengths)
    if mask.numel():
        pos = torch.arange(mask.numel())
        last = torch.full((len(lengths),), -1, dtype=torch.long).scatter_reduce(
            0, seg, torch.where(mask > 0, pos, torch.full_like(pos, -1)), reduce="amax")
        has = last >= 0
        token_rewards = token_rewards.index_add(0, last[has], r[has])
    returns = discounted_returns(token_rewards, lengths, gamma)
    return masked_whiten(returns, mask, eps).to(torch.float32)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_lengths, *,
                   loss_mask: torch.Tensor | None = None, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per sample; returns ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``
    and ``returns = A + V``, where "next" is the next UNMASKED token of the same
    sample (``V`` = 0 and ``A`` = 0 past its last one: the episode ends). Why:
    masked spans of multi-turn samples (tool output, observations) are not the
    policy's actions, so they are skipped rather than counted as timesteps (verl's
    multi-turn GAE). Masked positions get advantage and return 0, and a reward put
    on a masked token is dropped (verl does the same): put rewards on loss tokens.
    ``loss_mask`` None means every token counts. Statistics are float64; inputs
    are flat, response-aligned and detached from any graph; outputs are float32;
    whitening, if wanted, is the caller's choice.
    """
    lengths = _lengths(response_lengths)
    flat_mask = torch.ones_like(token_rewards, dtype=torch.float64) if loss_mask is None else loss_mask
    rewards = _to_padded(token_rewards.detach().to(torch.float64), lengths)
    vals = _to_padded(values.detach().to(torch.float64), lengths)
    live = _to_padded(flat_mask.detach().to(torch.float64), lengths) > 0  # padding is never live
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running = rewards.new_zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        step = delta + gamma * lam * running
        on = live[:, t]
        adv[:, t] = torch.where(on, step, torch.zeros_like(step))
        running = torch.where(on, step, running)  # a masked token passes the future through unchanged
        next_value = torch.where(on, vals[:, t], next_value)
    ret = torch.where(live, adv + vals, torch.zeros_like(adv))
    return _from_padded(adv, lengths).to(torch.float32), _from_padded(ret, lengths).to(torch.float32)


def per_sample(flat: torch.Tensor, response_lengths) -> list[torch.Tensor]:
    """Split a flat response-aligned tensor back into per-sample pieces."""
    return list(torch.split(flat, _lengths(response_lengths).tolist()))


def flat_loss_mask(loss_masks: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate per-sample loss masks into the flat response-aligned ``[T]`` float mask."""
    return torch.tensor([v for m in loss_masks for v in m], dtype=torch.float32)
