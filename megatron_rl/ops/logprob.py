"""Log-probs of target tokens and entropy from vocab-parallel (TP-sharded) logits.

Why this exists: at V=151,936 a naive ``log_softmax`` over ``[N, V]`` makes a full
float32 copy of the logits (plus another for its backward), and under tensor
parallelism it needs the vocab gathered first. Here each TP rank keeps its shard
``[N, V/tp]`` and only ``[N]``-sized statistics cross the TP group:

* forward, per token chunk: local max -> all-reduce(MAX); then one all-reduce(SUM)
  of the stacked ``[sum exp(z - m), target logit (owner rank only, 0 elsewhere),
  sum exp(z - m) * (z - m)]``. Two collectives per chunk, each ``O(chunk)``.
* backward needs no collective: the saved per-token ``logsumexp`` and entropy are
  global, so each rank forms its own shard of the gradient
  ``dL/dz = g_lp * (onehot - p) - g_H * p * (log p + H)`` (``z = logits / T``).

Invariants:
* Temporaries are bounded by two float32 ``[chunk, V/tp]`` buffers; the only
  ``[N, V/tp]`` allocation is the gradient itself (in the logits' dtype).
* bf16/fp16 logits are upcast per chunk; all arithmetic is float32 (float64 logits too).
* Outputs are float32 ``[*target_ids.shape]`` and identical on every TP rank.
* ``-inf`` logits (masked vocab) are allowed: they get probability 0 and no NaN.
* Megatron's vocab padding (``vocab_size``: columns at global index >= the real vocab)
  never enters the arithmetic: each chunk reads only this shard's real columns and
  their gradient is 0. Masking them to ``-inf`` instead would give the same values,
  but on CPU ``exp`` of a vector holding an underflowing input takes a scalar fallback,
  ~40x slower (the tiny demo model: 128 padded columns for 32 real ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Auto chunk: keep one float32 [chunk, V/tp] temporary near 64 MiB.
_AUTO_CHUNK_BYTES = 64 * 1024 * 1024
_F32_MIN = torch.finfo(torch.float32).min


def _tp_world(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _auto_chunk(vocab_local: int) -> int:
    return max(1, _AUTO_CHUNK_BYTES // (4 * max(vocab_local, 1)))


def _local_target(target: torch.Tensor, vocab_start: int, vocab_local: int):
    """Local column of each target and whether this rank owns it."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), owned


def chunk_stats(z_logits: torch.Tensor, target: torch.Tensor, *, tp_group, tp_size: int, vocab_start: int,
                temperature: float, with_entropy: bool, real_local: int):
    """``(logprobs, lse, entropy | None)`` [c] float32 of one chunk of rows ``[c, V/tp]`` (this rank's shard):
    the whole per-row arithmetic of the op's forward, two TP collectives of ``O(c)``. Its float32 temporaries
    are two ``[c, real_local]`` buffers. Shared with ``ops.linear_logprob`` (which feeds it each chunk's
    logits as it projects them), so both compute every row's log-prob with the same operations."""
    # only the real (unpadded) columns: [chunk, real_local], at least one column so a shard
    # of padding alone still takes part in the collectives (its one column is masked below)
    z = z_logits[:, :max(real_local, 1)].to(torch.float32, copy=True)
    if real_local == 0:
        z.fill_(float("-inf"))
    if temperature != 1.0:
        z.div_(temperature)
    m = z.max(dim=-1).values
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    # A row with no finite logit has no distribution; keep m finite so that row
    # cannot poison the shared chunk arithmetic.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z.sub_(m.unsqueeze(-1)).clamp_(min=_F32_MIN)
    local_idx, owned = _local_target(target, vocab_start, z.shape[1])
    picked = z.gather(1, local_idx.unsqueeze(-1)).squeeze(-1) * owned
    ez = z.exp()
    sum_exp = ez.sum(dim=-1)
    stats = [sum_exp, picked]
    if with_entropy:
        stats.append(ez.mul_(z).sum(dim=-1))
    del ez
    stacked = torch.stack(stats)
    if tp_size > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
    log_s = stacked[0].log()
    entropy = log_s - stacked[2] / stacked[0] if with_entropy else None
    return stacked[1] - log_s, m + log_s, entropy


def chunk_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
               g_lp: torch.Tensor, g_h: torch.Tensor | None, *, vocab_start: int, temperature: float,
               real_local: int) -> torch.Tensor:
    """float32 ``dL/dlogits`` ``[c, real_local]`` of one chunk of rows from the saved (global) ``lse`` and
    ``entropy``: ``g_lp * (onehot - p) - g_h * p * (log p + H)``, over ``z = logits / T``. No collective;
    two float32 ``[c, real_local]`` temporaries (the result is one of them). ``real_local`` >= 1."""
    logp = logits[:, :real_local].to(torch.float32, copy=True)
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(lse.unsqueeze(-1)).clamp_(min=_F32_MIN)
    p = logp.exp()
    g_lp = g_lp.unsqueeze(-1)
    if g_h is not None:
        assert entropy is not None
        # dH/dz = -p * (log p + H); fold into logp's buffer to stay at two temporaries.
        logp.add_(entropy.unsqueeze(-1)).mul_(p).mul_(-g_h.unsqueeze(-1))
        grad = p.mul_(-g_lp).add_(logp)
    else:
        grad = p.mul_(-g_lp)
    del logp
    local_idx, owned = _local_target(target, vocab_start, real_local)
    grad.scatter_add_(1, local_idx.unsqueeze(-1), (g_lp.squeeze(-1) * owned).unsqueeze(-1))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, tp_size, vocab_start, temperature, chunk_size, with_entropy,
                real_local):
        n_tok, vocab_local = logits.shape
        logprobs = torch.empty(n_tok, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)  # logsumexp of z = logits / T, for backward
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for s in range(0, n_tok, chunk_size):
            e = min(s + chunk_size, n_tok)
            lp, lse[s:e], ent = chunk_stats(logits[s:e], target[s:e], tp_group=tp_group, tp_size=tp_size,
                                            vocab_start=vocab_start, temperature=temperature,
                                            with_entropy=with_entropy, real_local=real_local)
            logprobs[s:e] = lp
            if entropy is not None:
                entropy[s:e] = ent
        ctx.save_for_backward(logits, target, lse, entropy if with_entropy else lse)
        ctx.cfg = (vocab_start, temperature, chunk_size, with_entropy, real_local)
        if with_entropy:
            return logprobs, entropy
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, target, lse, entropy = ctx.saved_tensors
        vocab_start, temperature, chunk_size, with_entropy, real_local = ctx.cfg
        n_tok, vocab_local = logits.shape
        grad_logits = torch.empty_like(logits)
        grad_logits[:, real_local:] = 0  # vocab padding: never part of the distribution
        if real_local == 0:
            return grad_logits, None, None, None, None, None, None, None, None
        g_lp_all = grad_logprobs.to(torch.float32)
        g_h_all = grad_entropy.to(torch.float32) if (with_entropy and grad_entropy is not None) else None
        for s in range(0, n_tok, chunk_size):
            e = min(s + chunk_size, n_tok)
            grad = chunk_grad(logits[s:e], target[s:e], lse[s:e], entropy[s:e], g_lp_all[s:e],
                              None if g_h_all is None else g_h_all[s:e], vocab_start=vocab_start,
                              temperature=temperature, real_local=real_local)
            grad_logits[s:e, :real_local].copy_(grad)
        return grad_logits, None, None, None, None, None, None, None, None


def flatten_checked(logits: torch.Tensor, target_ids: torch.Tensor, *, tp_group=None,
                    vocab_start_index: int | None = None, temperature: float = 1.0, chunk_size: int | None = None,
                    vocab_size: int | None = None):
    """Validate the arguments of the log-prob op (every implementation) and flatten them.

    Returns ``(flat_logits [N, V/tp], flat_target [N] int64, tp_size, vocab_start_index, out_shape)``.
    """
    if logits.dim() < 1 or target_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_logprobs: target_ids shape {tuple(target_ids.shape)} must equal logits shape "
            f"without its vocab dim {tuple(logits.shape[:-1])}; pass response-aligned targets, one per logit row")
    if not (temperature > 0):
        raise ValueError(f"vocab_parallel_logprobs: temperature={temperature} must be > 0 (use the rollout "
                         f"sampling temperature; greedy decoding has no log-probs to match)")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"vocab_parallel_logprobs: chunk_size={chunk_size} must be >= 1 or None (auto)")
    if target_ids.dtype.is_floating_point:
        raise ValueError(f"vocab_parallel_logprobs: target_ids dtype {target_ids.dtype} must be an integer type")
    tp_size, tp_rank = _tp_world(tp_group)
    vocab_local = logits.shape[-1]
    if vocab_start_index is None:
        vocab_start_index = tp_rank * vocab_local
    out_shape = target_ids.shape
    flat_logits = logits.reshape(-1, vocab_local)
    flat_target = target_ids.reshape(-1).long()
    if vocab_size is not None and not 0 < vocab_size <= vocab_local * tp_size:
        raise ValueError(f"vocab_parallel_logprobs: vocab_size={vocab_size} must be in [1, {vocab_local * tp_size}] "
                         f"(the padded vocab: {vocab_local} per rank x tp_size {tp_size})")
    limit = vocab_local * tp_size if vocab_size is None else vocab_size
    if flat_target.numel() and (int(flat_target.min()) < 0 or int(flat_target.max()) >= limit):
        raise ValueError(
            f"vocab_parallel_logprobs: target id range [{int(flat_target.min())}, {int(flat_target.max())}] is "
            f"outside the vocab [0, {limit}) ({vocab_local} per rank x tp_size {tp_size}"
            f"{'' if vocab_size is None else f', {vocab_size} real'}); "
            f"check the tokenizer matches the model's vocab size")
    return flat_logits, flat_target, tp_size, int(vocab_start_index), out_shape


def real_columns(vocab_local: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many leading columns of a ``vocab_local``-wide shard starting at ``vocab_start`` are real
    vocab (the rest is megatron's padding of the vocab to a multiple of 128 x TP)."""
    if vocab_size is None:
        return vocab_local
    return max(0, min(vocab_local, vocab_size - vocab_start))


def vocab_parallel_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, *, tp_group=None,
                            vocab_start_index: int | None = None, temperature: float = 1.0,
                            chunk_size: int | None = None, with_entropy: bool = False,
                            vocab_size: int | None = None):
    """Return ``(logprobs, entropy | None)`` of ``target_ids`` under ``softmax(logits / temperature)``.

    ``logits`` is this rank's vocab shard ``[..., V/tp]`` (Megatron's
    ``ColumnParallelLinear`` output layout: rank r holds columns
    ``[r*V/tp, (r+1)*V/tp)`` unless ``vocab_start_index`` says otherwise);
    ``target_ids`` holds GLOBAL vocab ids with shape ``logits.shape[:-1]``.
    ``tp_group`` None (or a size-1 group) is the single-device path. ``chunk_size``
    is the number of tokens per chunk (None: about 64 MiB of float32 per chunk).
    ``vocab_size``: the real vocab when the logits carry megatron's padding columns
    (global ids >= ``vocab_size``): they get probability 0 and gradient 0 (None: no padding).
    Both outputs are float32 and differentiable w.r.t. ``logits``.
    """
    flat_logits, flat_target, tp_size, vocab_start_index, out_shape = flatten_checked(
        logits, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index, temperature=temperature,
        chunk_size=chunk_size, vocab_size=vocab_size)
    chunk = chunk_size or _auto_chunk(flat_logits.shape[-1])
    real = real_columns(flat_logits.shape[-1], vocab_start_index, vocab_size)
    out = _VocabParallelLogprob.apply(flat_logits, flat_target, tp_group if tp_size > 1 else None, tp_size,
                                      vocab_start_index, float(temperature), int(chunk), bool(with_entropy), real)
    if with_entropy:
        logprobs, entropy = out
        return logprobs.reshape(out_shape), entropy.reshape(out_shape)
    return out.reshape(out_shape), None


def naive_logprobs(full_logits: torch.Tensor, target_ids: torch.Tensor, *, temperature: float = 1.0,
                   with_entropy: bool = False):
    """Reference: ``log_softmax`` over the gathered ``[N, V]`` float32 logits.

    Materialises full-vocab float32 copies; kept only as the ground truth for tests
    and as the baseline in ``benchmarks/logprob_memory.py``.
    """
    logp_all = torch.log_softmax(full_logits.float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:  # p log p -> 0 where a logit is -inf (no 0 * -inf NaN)
        entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logprobs, entropy
