"""Batch-invariant CPU ops: a token's result depends on that token's inputs only.

Why: the rollout engine and the trainer see the same token in batches of different shapes (a
decode step of 7 rows with a KV cache, a packed micro-batch of 300 tokens, left padding, right
padding). Stock kernels choose their blocking, and with it the order of each dot product's and
each reduction's additions, from the shape: MKL's fp32 ``F.linear`` gives row 0 a different
last bit for a batch of 1 (gemv), of 2, 3, 5, 6, 7 or 9 rows than for 64. Then a token's
log-prob in the rollout differs from the trainer's by ~1e-7 (fp32) or ~1e-2 (bf16), and the
first minibatch's importance ratio is 1 only approximately. Thinking Machines'
``batch_invariant_ops`` (and SGLang's ``--enable-deterministic-inference``, miles' and slime's
``--true-on-policy-mode`` built on it) fix the split sizes of every kernel; this module does the
same on the CPU with torch's own ops, under one mode:

* **matmul / linear / bmm**: every product is computed in fixed tiles of ``ROW_TILE`` rows x
  ``COL_TILE`` columns (inputs zero-padded to whole tiles, one batched ``matmul`` of identical
  ``[ROW_TILE, K] @ [K, COL_TILE]`` problems), so an output element never depends on how many
  rows or columns surround it, nor where in the batch it sits. ``K`` is not split.
* **reductions over the last dim** (``mean`` as RMSNorm uses it, ``softmax``, ``log_softmax``,
  ``logsumexp``, ``F.rms_norm``): the row max (order-free), then ``exp`` elementwise, then a
  pairwise tree sum inside fixed chunks of ``VOCAB_CHUNK`` (a power of two) and a left-to-right
  sum over chunks. Padding a row with masked entries (``-inf``, i.e. ``exp`` 0) adds exact zeros,
  so megatron's padded vocabulary and HF's exact one give the same bits.
* **attention** (``F.scaled_dot_product_attention``): keys are re-indexed from each sequence's
  first visible key (so left padding, right padding and packing do not move tile boundaries),
  scores come from the tiled matmul, the softmax is the two-pass one above over ``KEY_TILE``
  key tiles, and ``P @ V`` is summed tile by tile, left to right. A key tile entirely past a
  query's last visible key adds exact zeros, so a KV-cache decode of position ``t`` computes the
  same bits as row ``t`` of the full-sequence forward.

Why a ``TorchFunctionMode`` rather than a global ``torch.library`` override of aten kernels (what
``batch_invariant_ops`` and SGLang register): the mode is scoped to a ``with`` block and a thread, so the
engine's and trainer's forwards run invariant while the rest of the process (a reference model, the
optimizer, other engines' threads) runs the stock kernels; and it sees ``F.linear`` and
``F.scaled_dot_product_attention`` whole, above autograd, so the invariant forms are plain differentiable
compositions instead of aten kernels needing their own backward.

Elementwise ops need nothing: each element is computed alone. Everything here is composed of
differentiable torch ops, so the trainer's forward under the mode still has gradients (the
backward is not invariant and need not be).

Invariants the tests check (fp32 and bf16): a row's result is bitwise independent of the batch
size, its position in the batch, the other rows' contents and padding; decode == prefill for
attention. What this does *not* give: invariance across tensor-parallel layouts (a TP all-reduce
adds partial sums in another order) or across a different ``K`` split; the flag refuses those.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 16  # rows of one matmul tile
COL_TILE = 64  # columns of one matmul tile
KEY_TILE = 16  # keys of one attention tile (a power of two: tree-summed)
RHS_COPY_BYTES = 64 << 20  # the right operand's tile copies one bmm may hold
VOCAB_CHUNK = 256  # entries of one reduction chunk over the last dim (a power of two: tree-summed)

_STATE = threading.local()


def is_enabled() -> bool:
    """Whether the calling thread runs under :func:`batch_invariant_mode`."""
    return getattr(_STATE, "depth", 0) > 0


# ---------------------------------------------------------------------------------------------- matmul
def _round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def invariant_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (torch.matmul's broadcasting) with each output element computed the same way whatever the
    shape around it: both operands zero-padded to whole ``ROW_TILE x COL_TILE`` output tiles, all tiles in one
    batched matmul of identical problems."""
    squeeze_rows = a.dim() == 1
    squeeze_cols = b.dim() == 1
    if squeeze_rows:
        a = a.unsqueeze(0)
    if squeeze_cols:
        b = b.unsqueeze(-1)
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    if b.shape[-2] != k:
        raise RuntimeError(f"invariant_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    mp, np_ = _round_up(max(m, 1), ROW_TILE), _round_up(max(n, 1), COL_TILE)
    if mp != m:
        a = F.pad(a, (0, 0, 0, mp - m))
    if np_ != n:
        b = F.pad(b, (0, np_ - n))
    mt, nt = mp // ROW_TILE, np_ // COL_TILE
    a_tiles = a.expand(*batch, mp, k).reshape(-1, mt, ROW_TILE, k)  # [B, Mt, T, K]
    # the right operand in tile layout [B, Nt, K, Tn]; row tiles go in groups, each group one bmm of identical
    # [T, K] @ [K, Tn] problems, the group as large as keeps the right operand's copies (one per row tile of
    # the group) within RHS_COPY_BYTES: a tiny model's whole micro-batch in one call, a large weight per tile
    rhs = b.expand(*batch, k, np_).reshape(-1, k, nt, COL_TILE).movedim(-2, -3)
    group = max(1, RHS_COPY_BYTES // max(1, rhs.numel() * rhs.element_size()))
    parts = []
    for start in range(0, mt, group):
        rows = a_tiles[:, start:start + group]  # [B, g, T, K]
        g = rows.shape[1]
        lhs = rows.unsqueeze(2).expand(-1, g, nt, ROW_TILE, k).reshape(-1, ROW_TILE, k)
        right = rhs.unsqueeze(1).expand(-1, g, nt, k, COL_TILE).reshape(-1, k, COL_TILE)
        parts.append(torch.bmm(lhs, right).reshape(-1, g, nt, ROW_TILE, COL_TILE))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [B, Mt, Nt, T, Tn]
    out = out.movedim(2, 3).reshape(*batch, mp, np_)[..., :m, :n]
    if squeeze_cols:
        out = out.squeeze(-1)
    if squeeze_rows:
        out = out.squeeze(-2)
    return out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` through :func:`invariant_matmul` (rows flattened; the bias added afterwards, elementwise)."""
    lead = x.shape[:-1]
    out = invariant_matmul(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


# ------------------------------------------------------------------------------------------- reductions
def _tree_sum_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum over the last dim: zero-pad to whole ``chunk``s, pairwise tree inside each chunk (elementwise adds
    of halves), then the chunks left to right. Trailing zero chunks add exact zeros."""
    n = x.shape[-1]
    padded = _round_up(max(n, 1), chunk)
    if padded != n:
        x = F.pad(x, (0, padded - n))
    x = x.reshape(*x.shape[:-1], padded // chunk, chunk)
    width = chunk
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    parts = x.squeeze(-1).unbind(-1)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _last_dim(x: torch.Tensor, dim: Any) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and x.dim() > 0 and dim % x.dim() == x.dim() - 1


def invariant_mean(x: torch.Tensor, keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Mean over the last dim by the chunked tree sum."""
    if dtype is not None:
        x = x.to(dtype)
    out = _tree_sum_chunks(x, VOCAB_CHUNK) / x.shape[-1]
    return out.unsqueeze(-1) if keepdim else out


def _shifted_exp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, exp(x - m), sum)`` over the last dim; a row with no finite entry keeps ``m`` = 0 (no NaN)."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    return m, e, _tree_sum_chunks(e, VOCAB_CHUNK).unsqueeze(-1)


def invariant_log_softmax(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``log_softmax`` over the last dim: fixed vocab chunks (a padded vocab of ``-inf`` gives the same bits)."""
    if dtype is not None:
        x = x.to(dtype)
    m, _, total = _shifted_exp(x)
    return x - m - torch.log(total)


def invariant_softmax(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    if dtype is not None:
        x = x.to(dtype)
    _, e, total = _shifted_exp(x)
    return e / total


def invariant_logsumexp(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    m, _, total = _shifted_exp(x)
    out = m + torch.log(total)
    return out if keepdim else out.squeeze(-1)


def invariant_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: Optional[float]) -> torch.Tensor:
    """RMSNorm as HF's ``LlamaRMSNorm``/``Qwen3RMSNorm`` writes it (fp32 statistics, cast back, then the weight),
    with the invariant mean: megatron's ``torch.nn.RMSNorm`` and the HF module give the same bits under the mode."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    h = x.to(torch.float32)
    h = h * torch.rsqrt(invariant_mean(h.pow(2), keepdim=True) + eps)
    h = h.to(x.dtype)
    return h if weight is None else weight * h


# -------------------------------------------------------------------------------------------- attention
def _contiguous_visible(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, count)`` of each query's visible keys; refuses a mask whose visible keys are not one run."""
    count = keep.sum(dim=-1)
    first = torch.where(count > 0, keep.to(torch.int8).argmax(dim=-1), torch.zeros_like(count))
    pos = torch.arange(keep.shape[-1], device=keep.device)
    run = (pos >= first.unsqueeze(-1)) & (pos < (first + count).unsqueeze(-1))
    if not torch.equal(run, keep):
        raise NotImplementedError("batch-invariant attention needs each query's visible keys to be one "
                                  "contiguous run (causal, padding, packed documents); this mask is not")
    return first, count


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                        enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (``[..., heads, seq, dim]``) computed in fp32 per key tile, tiles
    aligned at each sequence's first visible key (module docstring). A query with no visible key gives 0."""
    if dropout_p:
        raise NotImplementedError("batch-invariant attention runs without dropout (dropout_p=0)")
    out_dtype = q.dtype
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk:
        k, v = k.repeat_interleave(hq // hk, dim=-3), v.repeat_interleave(hq // hk, dim=-3)
    q, k, v = q.float(), k.float(), v.float()
    lq, lk = q.shape[-2], k.shape[-2]
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        keep = keep if attn_mask is None else keep & attn_mask
    elif attn_mask is None:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    elif attn_mask.dtype == torch.bool:
        keep = attn_mask
    else:  # an additive mask: only 0 (visible) and -inf (hidden) keep the arithmetic a plain softmax
        if bool(((attn_mask != 0) & torch.isfinite(attn_mask)).any()):
            raise NotImplementedError("batch-invariant attention takes a boolean mask or an additive one of 0 / -inf")
        keep = attn_mask == 0
    batch = torch.broadcast_shapes(q.shape[:-2], keep.shape[:-2])
    keep = keep.expand(*batch, lq, lk)
    first, count = _contiguous_visible(keep)  # [*batch, lq]
    # every query of a row must share its first key (one re-indexing of K and V per row)
    has = count > 0
    row_first = torch.where(has, first, torch.full_like(first, lk)).amin(dim=-1, keepdim=True)
    row_first = torch.where(row_first == lk, torch.zeros_like(row_first), row_first)
    if bool(((first != row_first) & has).any()):
        raise NotImplementedError("batch-invariant attention needs every query of a sequence to start at the "
                                  "same key (its first token); a sliding window or CP chunking does not")
    width = _round_up(max(lk, 1), KEY_TILE)
    idx = (row_first + torch.arange(width, device=q.device)).clamp(max=lk - 1)  # [*batch, width]
    k = k.expand(*batch, lk, k.shape[-1])
    v = v.expand(*batch, lk, v.shape[-1])
    k_s = k.gather(-2, idx.unsqueeze(-1).expand(*batch, width, k.shape[-1]))
    v_s = v.gather(-2, idx.unsqueeze(-1).expand(*batch, width, v.shape[-1]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = invariant_matmul(q, k_s.transpose(-1, -2)) * scale  # [*batch, lq, width]
    visible = torch.arange(width, device=q.device) < count.unsqueeze(-1)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)  # hidden keys: exactly 0
    tiles = width // KEY_TILE
    p_t = p.reshape(*batch, lq, tiles, KEY_TILE)
    denom = _tree_sum_chunks(p_t, KEY_TILE)  # [*batch, lq, tiles]: one tree per tile
    v_t = v_s.reshape(*batch, tiles, KEY_TILE, v.shape[-1])
    partial = invariant_matmul(p_t.movedim(-2, -3), v_t)  # [*batch, tiles, lq, dv]
    total, acc = denom[..., 0], partial[..., 0, :, :]
    for t in range(1, tiles):
        total = total + denom[..., t]
        acc = acc + partial[..., t, :, :]
    out = acc / torch.where(has, total, torch.ones_like(total)).unsqueeze(-1)
    out = out.masked_fill(~has.unsqueeze(-1), 0.0)
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------------ mode
def _softmax_args(x: torch.Tensor, dim: Any = None, *rest: Any, dtype: Optional[torch.dtype] = None,
                  **_: Any) -> tuple[bool, Optional[torch.dtype]]:
    if rest and isinstance(rest[-1], torch.dtype):
        dtype = rest[-1]
    return _last_dim(x, dim), dtype


def _wrap_softmax(fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    def handler(orig, args, kwargs):
        x, *rest = args
        dim = rest[0] if rest else kwargs.get("dim")
        last, dtype = _softmax_args(x, dim, *rest[1:], dtype=kwargs.get("dtype"))
        return fn(x, dtype=dtype) if last else orig(*args, **kwargs)
    return handler


def _mean(orig, args, kwargs):
    x, *rest = args
    dim = rest[0] if rest else kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    if dim is None or not _last_dim(x, dim) or not x.is_floating_point():
        return orig(*args, **kwargs)
    return invariant_mean(x, keepdim=bool(keepdim), dtype=kwargs.get("dtype"))


def _logsumexp(orig, args, kwargs):
    x, *rest = args
    dim = rest[0] if rest else kwargs.get("dim")
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    return invariant_logsumexp(x, keepdim=bool(keepdim)) if _last_dim(x, dim) else orig(*args, **kwargs)


def _rms_norm(orig, args, kwargs):
    x, shape = args[0], args[1] if len(args) > 1 else kwargs["normalized_shape"]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    eps = args[3] if len(args) > 3 else kwargs.get("eps")
    if len(shape) != 1:
        return orig(*args, **kwargs)
    return invariant_rms_norm(x, weight, eps)


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def handler(orig, args, kwargs):
        if kwargs.get("out") is not None or len(args) != 2:
            return orig(*args, **kwargs)
        return fn(*args)
    return handler


def _linear(orig, args, kwargs):
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return invariant_linear(x, weight, bias)


def _addmm(orig, args, kwargs):
    bias, a, b = args[:3]
    if len(args) > 3 or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return orig(*args, **kwargs)
    return bias + invariant_matmul(a, b)


def _sdpa(orig, args, kwargs):
    return invariant_attention(*args, **kwargs)


# the torch entry points the mode routes, each to its invariant form (every other op runs as it is)
_ROUTES: tuple[tuple[tuple[Any, ...], Callable[..., Any]], ...] = (
    ((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
      torch.Tensor.bmm), _binary(invariant_matmul)),
    ((torch.Tensor.__rmatmul__,), _binary(lambda a, b: invariant_matmul(b, a))),
    ((F.linear,), _linear),
    ((torch.addmm,), _addmm),
    ((F.scaled_dot_product_attention,), _sdpa),
    ((torch.softmax, torch.Tensor.softmax, F.softmax), _wrap_softmax(invariant_softmax)),
    ((torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax), _wrap_softmax(invariant_log_softmax)),
    ((torch.mean, torch.Tensor.mean), _mean),
    ((torch.logsumexp, torch.Tensor.logsumexp), _logsumexp),
    ((F.rms_norm,), _rms_norm),
)
_HANDLERS: dict[Any, Callable[..., Any]] = {fn: handler for fns, handler in _ROUTES for fn in fns}


class _BatchInvariantMode(TorchFunctionMode):
    """Routes the ops above to their invariant forms; every other op runs as it is (elementwise ops are
    already invariant). Inside a handler the mode is off, so the invariant forms call the stock kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(func, args, kwargs)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the block with batch-invariant matmul, reductions and attention (``enabled=False``: a no-op, so
    callers write one ``with``). Thread-local, re-entrant."""
    if not enabled:
        yield
        return
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        with _BatchInvariantMode():
            yield
    finally:
        _STATE.depth -= 1


# ------------------------------------------------------------------------------------- token log-probs
def invariant_token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, *, temperature: float = 1.0,
                             vocab_size: Optional[int] = None,
                             with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(log-probs of target_ids, entropy | None)`` under ``softmax(logits / temperature)``, float32, with the
    same operations as the rollout sampler's (``rollout.sampling``: ``logits.float()``, ``/ T``,
    ``log_softmax``, gather), so a token's log-prob from the trainer's logits and from the engine's are the same
    bits when the logits are. ``vocab_size``: megatron's padding columns past it are dropped first."""
    z = logits if vocab_size is None else logits[..., :vocab_size]
    z = z.float() / temperature
    logprobs = invariant_log_softmax(z)
    picked = logprobs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -_tree_sum_chunks(torch.exp(logprobs) * logprobs, VOCAB_CHUNK)
    return picked, entropy
