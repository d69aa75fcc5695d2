"""Next-token sampling from logits: temperature, top-k, top-p, with exact log-probs.

Pure functions (no model, no state). The rules follow SGLang's torch sampler so
the embedded engine and an SGLang server draw from the same distribution:

* log-probs reported are ``log_softmax(logits / T)`` at the sampled token, taken
  *before* top-k/top-p filtering (greedy: ``log_softmax(logits)``, T = 1);
* on the probabilities sorted descending, top-p keeps token j while the mass
  *before* it is <= top_p (so the most likely token always survives), top-k keeps
  the first k; both filters use the unfiltered probabilities, then the survivors
  are renormalised implicitly by inverse-CDF sampling.

Randomness enters only as one uniform number per row per step, supplied by the
caller; that is what makes sampling reproducible per sequence.

``banned`` token ids are never drawn (a vision-language model's vision tokens: a
response holding an image-pad token would have no image behind it); like top-k /
top-p they only narrow the support, and the reported log-probs stay the full
distribution's (what the trainer computes for the same tokens).
"""

from __future__ import annotations

import torch

from megatron_rl.errors import EngineError
from megatron_rl.rollout.base import SamplingParams


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` (need not sum to 1) using ``uniforms`` in [0, 1).

    The CDF runs in float64; the result always has positive weight (rounding at
    the top end is clamped to the last positive entry).
    """
    cdf = weights.double().cumsum(dim=-1)
    target = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
    vocab = weights.shape[-1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
    stray = weights.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    if stray.any():  # target rounded up to the total: take the last token with positive weight
        last_positive = (vocab - 1) - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        idx = torch.where(stray, last_positive, idx)
    return idx


def sample_next_tokens(logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor,
                       banned: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (token ids [B], their log-probs [B]).

    ``uniforms`` [B] in [0, 1) is the only randomness (ignored when greedy). ``banned``: ids never drawn.
    """
    logits = logits.float()
    if torch.isnan(logits).any():
        raise EngineError("the model produced NaN logits; the engine's weights are corrupt or were never loaded "
                          "(after release() without backup, send a full update_weights before generate)")
    ban = torch.tensor(banned, dtype=torch.long, device=logits.device) if banned else None
    if sampling.greedy:
        chooser = logits if ban is None else logits.index_fill(-1, ban, float("-inf"))
        tokens = chooser.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    logprobs = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logprobs.exp()
    if ban is not None:
        probs = probs.index_fill(-1, ban, 0.0)
    if sampling.top_k == -1 and sampling.top_p >= 1.0:
        tokens = inverse_cdf(probs, uniforms)
    else:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) <= sampling.top_p
        if sampling.top_k != -1:
            keep[:, sampling.top_k:] = False
        j = inverse_cdf(sorted_probs * keep, uniforms)
        tokens = sorted_ids.gather(-1, j.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def reported_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``[..., V]`` log-probs ``sample_next_tokens`` reports: ``log_softmax(logits / T)`` (greedy: T = 1)."""
    logits = logits.float()
    return torch.log_softmax(logits if sampling.greedy else logits / sampling.temperature, dim=-1)


def sampling_distribution(logits: torch.Tensor, sampling: SamplingParams, banned: tuple[int, ...] = ()) -> torch.Tensor:
    """The distribution ``sample_next_tokens`` draws each row of ``logits`` [B, V] from, as float64 probabilities in
    vocab order: temperature, top-k / top-p on the sorted unfiltered probabilities, ``banned`` removed, the
    survivors renormalised; greedy: all mass on the (unbanned) argmax.

    Why: speculative decoding (rollout/speculative.py) accepts a draft token with ``min(1, p/q)`` and resamples from
    ``norm(max(0, p - q))``; for its tokens to follow non-speculative sampling, ``p`` must be exactly this law."""
    logits = logits.float()
    ban = torch.tensor(banned, dtype=torch.long, device=logits.device) if banned else None
    if sampling.greedy:
        chooser = logits if ban is None else logits.index_fill(-1, ban, float("-inf"))
        return torch.nn.functional.one_hot(chooser.argmax(dim=-1), logits.shape[-1]).double()
    probs = torch.log_softmax(logits / sampling.temperature, dim=-1).exp()
    if ban is not None:
        probs = probs.index_fill(-1, ban, 0.0)
    if sampling.top_k != -1 or sampling.top_p < 1.0:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) <= sampling.top_p
        if sampling.top_k != -1:
            keep[:, sampling.top_k:] = False
        probs = probs * torch.zeros_like(keep).scatter(-1, sorted_ids, keep)
    probs = probs.double()
    return probs / probs.sum(dim=-1, keepdim=True)
