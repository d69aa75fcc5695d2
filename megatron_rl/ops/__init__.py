"""Token-level ops on (vocab-parallel) logits and per-token losses: the single dispatch point.

``logprobs_and_entropy`` (log-probs of targets + entropy from this rank's logits
shard; called by ``algorithms.spec``), ``linear_logprobs_and_entropy`` (the same from
hidden states and the output layer's weight shard, projected chunk by chunk: the
logits never exist beyond one chunk; ``ops.linear_logprob``) and ``policy_loss_terms`` (per-token PPO
surrogate, KL, TIS weight; called by ``algorithms.losses``) each run one of:

* ``torch``: the reference (``ops.logprob`` chunked TP-aware autograd;
  ``ops.policy_loss`` torch maths), always available;
* ``cuda``: the compiled kernels of ``csrc/cuda`` (``megatron_rl._C``);
* ``triton``: ``ops.triton_kernels`` (GPUs without the compiled extension);
* ``cpu_ext``: the C++ CPU twins of the CUDA kernels (``csrc/cpu``), same maths.

``ops.dispatch`` picks one per device (CUDA -> Triton -> torch on GPU, torch on
CPU) unless ``MEGATRON_RL_KERNELS`` names one, and trusts a fused one on a
(device, dtype) only after its self-check against the torch ops passed there
(``ops.selfcheck``). Every implementation matches the torch reference in values
and gradients (tests/ops/); callers never branch on it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_rl.ops import batch_invariant
from megatron_rl.ops.dispatch import KERNELS, available_backends, select
from megatron_rl.ops.fused import fused_logprobs, fused_policy_terms
from megatron_rl.ops.linear_logprob import linear_logprobs
from megatron_rl.ops.logprob import flatten_checked, naive_logprobs, real_columns, vocab_parallel_logprobs
from megatron_rl.ops.policy_loss import STRAIGHT_THROUGH_KL, PolicyLossParams, PolicyTerms, torch_policy_terms

__all__ = ["logprobs_and_entropy", "linear_logprobs_and_entropy", "policy_loss_terms", "PolicyLossParams", "PolicyTerms", "vocab_parallel_logprobs",
           "naive_logprobs", "available_backends", "KERNELS"]


def logprobs_and_entropy(logits: torch.Tensor, target_ids: torch.Tensor, *, tp_group=None,
                         vocab_start_index: int | None = None, temperature: float = 1.0,
                         chunk_size: int | None = None, with_entropy: bool = False,
                         vocab_size: int | None = None):
    """``(logprobs, entropy | None)`` of ``target_ids`` under ``softmax(logits / temperature)``.

    Same contract as :func:`megatron_rl.ops.logprob.vocab_parallel_logprobs`
    (logits are this rank's vocab shard; target ids are global; ``vocab_size`` the real
    vocab when the logits carry megatron's padding columns). ``chunk_size``
    bounds the torch path's float32 working set; the fused kernels have none (they
    stream each row once), so for them it is validated and has nothing to bound.
    """
    if batch_invariant.is_enabled():
        return _invariant_logprobs(logits, target_ids, tp_group, temperature, with_entropy, vocab_size)
    name, kernels = select(logits.device, logits.dtype)
    if kernels is None:
        return vocab_parallel_logprobs(logits, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index,
                                       temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                                       vocab_size=vocab_size)
    flat_logits, flat_target, tp_size, vocab_start, out_shape = flatten_checked(
        logits, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index, temperature=temperature,
        chunk_size=chunk_size, vocab_size=vocab_size)
    real = real_columns(flat_logits.shape[-1], vocab_start, vocab_size)
    if real < flat_logits.shape[-1]:  # the kernels read every column once: padding as -inf, as they expect
        col = torch.arange(flat_logits.shape[-1], device=flat_logits.device)
        flat_logits = flat_logits.masked_fill(col >= real, float("-inf"))
    logprobs, entropy = fused_logprobs(kernels, flat_logits, flat_target, tp_group=tp_group if tp_size > 1 else None,
                                       tp_size=tp_size, vocab_start=vocab_start, temperature=float(temperature),
                                       with_entropy=with_entropy)
    return logprobs.reshape(out_shape), (entropy.reshape(out_shape) if with_entropy else None)


def linear_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, *,
                                tp_group=None, vocab_start_index: int | None = None, temperature: float = 1.0,
                                chunk_size: int | None = None, with_entropy: bool = False,
                                vocab_size: int | None = None):
    """``(logprobs, entropy | None)`` [n] of ``target_ids`` under ``softmax(hidden @ weight.T / temperature)``:
    :func:`logprobs_and_entropy` of the output layer's logits (``weight``: its ``[V/tp, h]`` shard, no bias),
    bitwise, without materialising them: ``chunk_size`` rows are projected at a time, forward and backward
    (:mod:`megatron_rl.ops.linear_logprob`). The implementation (torch or a fused kernel set) is chosen for
    the logits' device and dtype as :func:`logprobs_and_entropy` chooses it, and runs per chunk."""
    if batch_invariant.is_enabled():
        logits = batch_invariant.invariant_linear(hidden, weight)
        return _invariant_logprobs(logits, target_ids, tp_group, temperature, with_entropy, vocab_size)
    _, kernels = select(hidden.device, torch.result_type(hidden, weight))
    return linear_logprobs(hidden, weight, target_ids, kernels=kernels, tp_group=tp_group,
                           vocab_start_index=vocab_start_index, temperature=temperature, chunk_size=chunk_size,
                           with_entropy=with_entropy, vocab_size=vocab_size)


def _invariant_logprobs(logits, target_ids, tp_group, temperature, with_entropy, vocab_size):
    """Under ``batch_invariant_mode`` (``--true-on-policy-mode``): the rollout sampler's arithmetic on the whole
    vocabulary row (``ops.batch_invariant.invariant_token_logprobs``); a TP-sharded vocabulary would need its
    partial sums reduced in a fixed order, which the mode does not do (the flag refuses TP > 1)."""
    if tp_group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(tp_group) > 1:
        raise RuntimeError("batch-invariant log-probs need the whole vocabulary on one rank (TP 1): "
                           "--true-on-policy-mode refuses --tensor-model-parallel-size > 1")
    return batch_invariant.invariant_token_logprobs(logits, target_ids, temperature=float(temperature),
                                                    vocab_size=vocab_size, with_entropy=with_entropy)


def policy_loss_terms(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      params: PolicyLossParams, *, token_log_ratio: torch.Tensor | None = None,
                      ref_logprobs: torch.Tensor | None = None,
                      rollout_logprobs: torch.Tensor | None = None) -> PolicyTerms:
    """Per-token PPO/GRPO terms of flat ``[T]`` tensors: TIS weight (when ``rollout_logprobs``), clipped
    surrogate ``pg`` (when ``params.ppo``), KL to the reference (when ``ref_logprobs``).

    ``token_log_ratio`` (``logprobs - old_logprobs``, if the caller already holds it) lets the torch path reuse
    the caller's autograd node, so its graph and gradients stay exactly those of the pre-dispatch code.
    """
    given = [t for t in (logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs) if t is not None]
    name, kernels = select(logprobs.device, functools.reduce(torch.promote_types, [t.dtype for t in given]))
    if kernels is None:
        return torch_policy_terms(logprobs, old_logprobs, advantages, params, token_log_ratio=token_log_ratio,
                                  ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs)
    if ref_logprobs is not None and params.kl_type in STRAIGHT_THROUGH_KL:
        # the kernels know verl's four estimators, not the straight-through ones: their KL on the torch path
        terms = PolicyTerms(*fused_policy_terms(kernels, logprobs, old_logprobs, advantages, params, None,
                                                rollout_logprobs))
        terms.kl = torch_policy_terms(logprobs, old_logprobs, advantages, dataclasses.replace(params, ppo=False),
                                      ref_logprobs=ref_logprobs).kl
        return terms
    outs = fused_policy_terms(kernels, logprobs, old_logprobs, advantages, params, ref_logprobs, rollout_logprobs)
    return PolicyTerms(*outs)
