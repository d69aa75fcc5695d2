"""Log-probs and entropy straight from hidden states: the output projection fused into the log-prob op, by row chunk.

Why: even at the loss rows only (``backends/loss_rows.py``) the logits ``[rows, V/tp]``
are the step's largest tensor, and the log-prob op adds its float32 working set and,
in training, a logits-sized gradient. Here the projection ``hidden @ weight.T`` runs one
chunk of rows at a time, the chunk's log-prob statistics are taken from it, and the
chunk's logits are dropped: the forward keeps only the hidden rows and each row's
``logsumexp`` (and entropy). The backward projects each chunk again, forms its softmax
gradient from the saved statistics (the same formula as ``ops.logprob``) and multiplies
it straight into the hidden rows' gradient and the weight's (Liger's fused linear
cross-entropy and slime/verl's chunked log-prob work the same way; the log-prob needs
an upstream gradient per row, so unlike a fused loss the gradient waits for backward).

Invariants:
* Alive at once: one chunk's logits (their dtype) and the log-prob op's two float32
  ``[chunk, V/tp]`` temporaries (the chunk's gradient is one of them, then cast to the logits'
  dtype), plus in backward a float32 ``[V/tp, h]`` accumulator of the weight gradient (the
  weight's own size, independent of the tokens) and the hidden rows' gradient. The memory
  planner counts exactly these (``plan/activations.py::chunked_logprob_peak``, checked against
  this op's allocations in tests/plan/test_logprob_peak.py).
* Forward values are the unfused path's (output layer on the rows, then
  ``ops.logprobs_and_entropy``): each chunk's logits come from the same matmul of the
  same rows (``F.linear``, as megatron's ``ColumnParallelLinear`` and an HF ``lm_head``
  compute them) and go through the same per-chunk arithmetic (``logprob.chunk_stats``,
  or the fused kernels' ``fused.kernel_stats``) with the same chunk size. Bitwise in
  bf16 (the training dtype; on CPU a row's bf16 product does not depend on how many rows
  the call holds); in float32, CPU BLAS picks its kernel by the number of rows, so a
  chunk's logits may differ from the one-call projection in the last bit (measured:
  <= 1 float32 ulp of a logit, tests/ops/test_linear_logprob.py). A GPU's GEMM may
  likewise choose another kernel for another row count: same arithmetic, not
  guaranteed the same bits.
* Gradients: the hidden rows' is the unfused path's row for row (the logits' gradient in
  the logits' dtype times the weight); the weight's is one matmul per chunk in the logits'
  dtype (as the output layer's is, over all rows at once), the chunks' results summed in
  float32 and rounded once to the weight's dtype: each chunk's partial sum is rounded to
  bf16 where the unfused path rounds only the total (equal within those roundings).
* TP (megatron's vocab-parallel output layer): ``weight`` is this rank's vocab shard; the
  per-chunk max and sums are all-reduced over ``tp_group`` as in ``ops.logprob``; the
  caller all-reduces the hidden rows' gradient (megatron's
  ``copy_to_tensor_model_parallel_region``), as the output layer does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.ops.fused import kernel_grad, kernel_stats, local_targets
from megatron_rl.ops.logprob import _auto_chunk, chunk_grad, chunk_stats, flatten_checked, real_columns


class _ChunkMath:
    """The per-chunk statistics and gradient of one implementation (the torch ops, or a fused kernel set)."""

    def __init__(self, kernels, tp_group, tp_size: int, vocab_start: int, temperature: float, real_local: int):
        self.kernels, self.tp_group, self.tp_size = kernels, tp_group, tp_size
        self.vocab_start, self.temperature, self.real_local = vocab_start, temperature, real_local

    def _masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The fused kernels read every column once: megatron's vocab padding as -inf, as ``ops`` feeds them."""
        if self.real_local < logits.shape[-1]:
            col = torch.arange(logits.shape[-1], device=logits.device)
            logits = logits.masked_fill(col >= self.real_local, float("-inf"))
        return logits.contiguous()

    def stats(self, logits: torch.Tensor, target: torch.Tensor, with_entropy: bool):
        if self.kernels is None:
            return chunk_stats(logits, target, tp_group=self.tp_group, tp_size=self.tp_size,
                               vocab_start=self.vocab_start, temperature=self.temperature,
                               with_entropy=with_entropy, real_local=self.real_local)
        logprobs, lse, entropy, _ = kernel_stats(self.kernels, self._masked(logits), target, tp_group=self.tp_group,
                                                 tp_size=self.tp_size, vocab_start=self.vocab_start,
                                                 inv_t=1.0 / self.temperature)
        return logprobs, lse, (entropy if with_entropy else None)

    def grad(self, logits, target, lse, entropy, g_lp, g_h) -> torch.Tensor:
        """``dL/dlogits`` ``[c, V/tp]`` in the logits' dtype (0 in the padding columns)."""
        if self.kernels is not None:
            target_local, _ = local_targets(target, self.vocab_start, logits.shape[-1])
            return kernel_grad(self.kernels, self._masked(logits), target_local, lse, entropy, g_lp, g_h,
                               1.0 / self.temperature)
        if self.real_local == 0:
            return torch.zeros_like(logits)
        grad = chunk_grad(logits, target, lse, entropy, g_lp, g_h, vocab_start=self.vocab_start,
                          temperature=self.temperature, real_local=self.real_local)
        if self.real_local == logits.shape[-1]:
            return grad.to(logits.dtype)
        out = torch.empty_like(logits)
        out[:, self.real_local:] = 0  # megatron's vocab padding: never part of the distribution
        out[:, :self.real_local] = grad
        return out


def _add_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``acc += grad_logits.T @ hidden``: one matmul in the inputs' dtype per chunk (a bf16 GEMM, as the output
    layer's own weight gradient is, float32 accumulation inside it, rounded once), summed over chunks in float32."""
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden)
    else:
        acc.add_(torch.mm(grad_logits.t(), hidden))


#: a last chunk smaller than this joins the one before it: no one-row matmul (BLAS takes a matrix-vector
#: path for it, whose float32 sums may differ in the last bit from the one-call projection's)
MIN_TAIL_ROWS = 8


def row_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` covering ``n`` rows by ``chunk``, a tail under ``MIN_TAIL_ROWS`` merged into the chunk
    before it (same on every TP rank: it depends on ``n`` and ``chunk`` only)."""
    bounds = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < MIN_TAIL_ROWS:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, math, chunk, with_entropy):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for s, e in row_chunks(n, chunk):
            lp, lse[s:e], ent = math.stats(F.linear(hidden[s:e], weight), target[s:e], with_entropy)
            logprobs[s:e] = lp
            if entropy is not None:
                entropy[s:e] = ent
        ctx.save_for_backward(hidden, weight, target, lse, entropy if entropy is not None else lse)
        ctx.math, ctx.chunk, ctx.with_entropy = math, chunk, with_entropy
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logprobs, entropy
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, target, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs is None and grad_entropy is None) or not (want_hidden or want_weight):
            return None, None, None, None, None, None
        math, chunk, n = ctx.math, ctx.chunk, hidden.shape[0]
        g_lp = grad_logprobs.to(torch.float32) if grad_logprobs is not None else torch.zeros_like(lse)
        g_h = grad_entropy.to(torch.float32) if (ctx.with_entropy and grad_entropy is not None) else None
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for s, e in row_chunks(n, chunk):
            logits = F.linear(hidden[s:e], weight)
            grad = math.grad(logits, target[s:e], lse[s:e], entropy[s:e] if g_h is not None else None, g_lp[s:e],
                             None if g_h is None else g_h[s:e])
            del logits
            if grad_hidden is not None:
                grad_hidden[s:e] = torch.matmul(grad, weight)  # the output layer's input gradient, row for row
            if acc is not None:
                _add_weight_grad(acc, grad, hidden[s:e])
            del grad  # before the next chunk's logits: one chunk's working set at a time (plan/activations.py)
        grad_weight = acc.to(weight.dtype) if acc is not None else None
        return grad_hidden, grad_weight, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, *, kernels=None,
                    tp_group=None, vocab_start_index: int | None = None, temperature: float = 1.0,
                    chunk_size: int | None = None, with_entropy: bool = False, vocab_size: int | None = None):
    """``(logprobs, entropy | None)`` [n] float32 of ``target_ids`` under ``softmax(hidden @ weight.T / T)``
    without the ``[n, V/tp]`` logits ever existing beyond one chunk of rows.

    ``hidden`` ``[n, h]``; ``weight`` ``[V/tp, h]`` (this rank's vocab shard of the output layer, no bias);
    the other arguments as ``ops.logprob.vocab_parallel_logprobs`` (``chunk_size``: rows per chunk, None
    for the same ~64 MiB float32 bound). ``kernels``: a fused kernel set (``ops.dispatch.select``) or None
    for the torch arithmetic. Differentiable in ``hidden`` and ``weight``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_logprobs: hidden {tuple(hidden.shape)} must be [n, h] and weight "
                         f"{tuple(weight.shape)} [V/tp, h] with the same h")
    logits_shape = torch.empty(hidden.shape[0], weight.shape[0], device="meta")  # shapes only, for the checks
    _, flat_target, tp_size, vocab_start, _ = flatten_checked(
        logits_shape, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index, temperature=temperature,
        chunk_size=chunk_size, vocab_size=vocab_size)
    real = real_columns(weight.shape[0], vocab_start, vocab_size)
    math = _ChunkMath(kernels, tp_group if tp_size > 1 else None, tp_size, vocab_start, float(temperature), real)
    chunk = int(chunk_size or _auto_chunk(weight.shape[0]))
    out = _LinearLogprob.apply(hidden, weight, flat_target.to(hidden.device), math, chunk, bool(with_entropy))
    if with_entropy:
        return out[0], out[1]
    return out, None
