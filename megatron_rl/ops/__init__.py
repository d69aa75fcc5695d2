"""Token-level ops on (vocab-parallel) logits: log-probs of targets and entropy.

``logprobs_and_entropy`` is the single dispatch point the backends and the
algorithm specs call. The intended order is CUDA extension -> Triton kernel ->
torch; TODAY ONLY THE TORCH PATH EXISTS (``ops.logprob.vocab_parallel_logprobs``,
chunked, TP-aware, memory-frugal custom autograd). When a kernel lands it must
match that path's values and gradients and be registered here; callers do not
change.
"""

from __future__ import annotations

import torch

from megatron_rl.ops.logprob import naive_logprobs, vocab_parallel_logprobs

__all__ = ["logprobs_and_entropy", "vocab_parallel_logprobs", "naive_logprobs", "available_backends"]


def available_backends() -> list[str]:
    """Implementations ``logprobs_and_entropy`` can dispatch to, in preference order."""
    return ["torch"]


def logprobs_and_entropy(logits: torch.Tensor, target_ids: torch.Tensor, *, tp_group=None,
                         vocab_start_index: int | None = None, temperature: float = 1.0,
                         chunk_size: int | None = None, with_entropy: bool = False):
    """``(logprobs, entropy | None)`` of ``target_ids`` under ``softmax(logits / temperature)``.

    Same contract as :func:`megatron_rl.ops.logprob.vocab_parallel_logprobs`
    (logits are this rank's vocab shard; target ids are global).
    """
    return vocab_parallel_logprobs(logits, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index,
                                   temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
