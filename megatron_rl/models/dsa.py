"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2's ``deepseek_v32``) as HF transformers computes it.

DSA is DeepSeek-V3's multi-latent attention where each query attends only to the ``index_topk`` keys a
*lightning indexer* picks. HF's ``DeepseekV32Indexer`` (per layer, own weights):

* ``q = wq_b(qr)`` per indexer head (``qr = q_a_layernorm(q_a_proj(x))``: MLA's normed query latent),
  ``k = k_norm(wk(x))`` (one key head, a LayerNorm with bias, eps 1e-6), RoPE on the FIRST
  ``qk_rope_head_dim`` channels of both, rotate-half (not interleaved as MLA's own RoPE);
* ``score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(index_head_dim))`` with
  ``w = weights_proj(x) / sqrt(index_n_heads)``; causal mask; the ``index_topk`` best keys of each query;
* the whole indexer runs under ``no_grad``: it is not trained by HF's module and feeds no gradient back.

megatron-core 0.16.1's ``DSAttention`` / ``DSAIndexer`` (``experimental_attention_variant/dsa.py``) hold
the same parameters and compute the same score up to where it differs from HF:

1. its RoPE is on the LAST ``qk_rope_head_dim`` channels, and it shares MLA's config so the rotary
   de-interleaves the channels first (HF: first channels, rotate-half);
2. it applies a Hadamard rotation to q and k (``rotate_activation``: bf16 only, needs the CUDA package
   ``fast_hadamard_transform``) - orthogonal, so q . k is unchanged in exact arithmetic; HF skips it;
3. it asserts on packed (THD) sequences, which our training path feeds, and its indexer builds its
   linears with ``parallel_mode`` (megatron's local ``Linear`` has none);
4. its scale order (``w * softmax_scale`` then ``relu(q . k)``) equals HF's ``relu(q . k * scale)``.

So :class:`SparseIndexer` keeps megatron's module (its parameter names and its KL loss,
``compute_dsa_indexer_loss``) and replaces ``forward_with_scores`` with HF's math (1, 2);
:class:`SparseAttention` (``DSAttention``'s slot) runs it per packed sequence (3) with our sparse softmax.
Context parallelism is refused (megatron's config asserts it: the indexer would need every key of the
sequence on each rank). HF's own parameter layout is kept (``wq_b`` / ``wk`` / ``k_norm`` rows 1:1).

Training of the indexer: DeepSeek trains it with a KL loss towards the main attention's distribution
(summed over heads, L1-normalised; ``dsa_indexer_loss_coeff``), on detached inputs, so the main model's
gradients never depend on it. With coefficient 0 (the default of the bridge: what HF's module and the RL
recipes of slime / miles do) the indexer parameters are frozen (``requires_grad`` false: no gradient,
no optimizer state, no weight decay), equal to HF's ``no_grad`` indexer.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer, DSAIndexerLossAutoScaler, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules,
    compute_dsa_indexer_loss)
from megatron.core.transformer.spec_utils import ModuleSpec

#: HF's ``DeepseekV32Indexer.k_norm`` is ``nn.LayerNorm(index_head_dim, eps=1e-6)`` whatever rms_norm_eps is
INDEXER_K_NORM_EPS = 1e-6


class IndexerLinear(Linear):
    """A replicated (every TP rank holds all of it) bias-free linear for the indexer: megatron's local
    ``Linear`` taking ``DSAIndexer``'s ``parallel_mode`` argument. Its input is the whole sequence on every
    rank (gathered under SP), so its gradient is complete there: no ``sequence_parallel`` all-reduce."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode: Optional[str] = None, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        for param in self.parameters():
            param.sequence_parallel = False


class IndexerKeyNorm(torch.nn.LayerNorm):
    """HF's indexer key norm: a LayerNorm with gain and bias over ``index_head_dim``, eps 1e-6."""

    def __init__(self, config, hidden_size: int, eps: float = INDEXER_K_NORM_EPS):
        super().__init__(hidden_size, eps=INDEXER_K_NORM_EPS, dtype=config.params_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SparseIndexer(DSAIndexer):
    """megatron's ``DSAIndexer`` with HF's scoring (see the module docstring); frozen when its loss is off."""

    def __init__(self, config, submodules: DSAIndexerSubmodules, pg_collection=None, *, interleaved: bool = False):
        super().__init__(config, submodules, pg_collection=pg_collection)
        self.interleaved = interleaved  # GLM-5 (glm_moe_dsa): pairs (x0, x1), (x2, x3), ... rotate, as MLA's RoPE
        if not self.config.dsa_indexer_loss_coeff:
            for param in self.parameters():
                param.requires_grad_(False)

    def _rope(self, x: torch.Tensor, emb: torch.Tensor, mscale: float) -> torch.Tensor:
        """RoPE on the first ``qk_pos_emb_head_dim`` channels, rotate-half, as HF's indexer (interleaved: the
        pairs are first gathered into halves, as HF's ``apply_rotary_pos_emb_interleave``; q and k alike, so
        their dot product is the interleaved rotation's)."""
        r = self.qk_pos_emb_head_dim
        rot, rest = x[..., :r], x[..., r:]
        if self.interleaved:
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        cos, sin = (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index scores ``[b, s, s]`` (fp32, ``mask`` added) and the top-k keys ``[b, s, k]`` of one
        unpacked, whole (SP-gathered) stretch: ``x`` ``[s, b, hidden]``, ``qr`` ``[s, b, q_lora_rank]``."""
        s, b, _ = x.shape
        emb = self.rotary_pos_emb(s, packed_seq=False)
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        emb = emb[:s]
        q, _ = self.linear_wq_b(qr)
        q = self._rope(q.reshape(s, b, self.index_n_heads, self.index_head_dim), emb, mscale)
        k, _ = self.linear_wk(x)
        k = self._rope(self.k_norm(k).reshape(s, b, 1, self.index_head_dim), emb, mscale).reshape(s, b, -1)
        logits = torch.relu(torch.einsum("sbhd,tbd->bsht", q.float(), k.float()) * self.softmax_scale)
        weights, _ = self.linear_weights_proj(x)
        weights = weights.float() * self.index_n_heads ** -0.5  # [s, b, h]
        index_scores = torch.einsum("sbh,bsht->bst", weights, logits) + mask
        topk = index_scores.topk(min(self.index_topk, s), dim=-1).indices
        return index_scores, topk

    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        s = x.size(0)
        causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        return self.scores(x, qr, causal if mask is None else mask)


def sparse_attention(query, key, value, topk, mask, softmax_scale: float) -> torch.Tensor:
    """Softmax attention of each query over its ``topk`` keys only (and ``mask``'s allowed ones):
    ``[s, b, np, hn]`` q / k, ``[s, b, np, hv]`` v, ``topk`` ``[b, s, k]``, ``mask`` ``[b, s, s]`` additive
    (-inf = masked) -> ``[s, b, np * hv]``. fp32 scores and softmax; a row with no key left outputs 0."""
    s, b, np_, hv = value.shape
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * softmax_scale
    keep = torch.full_like(mask, float("-inf")).scatter(-1, topk, 0.0) + mask  # [b, s, s]
    probs = torch.softmax(scores + keep.unsqueeze(1), dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhst,tbhd->sbhd", probs.to(value.dtype), value)
    return out.reshape(s, b, np_ * hv)


class SparseAttention(DSAttention):
    """``core_attention`` of a DSA layer (megatron's ``MLASelfAttention`` hands it ``x`` and ``qr``): the
    indexer's top-k, then sparse attention; SBHD (causal, optional padding mask) and packed THD (each
    sequence of ``cu_seqlens`` alone, padding rows 0). Attaches the indexer's KL loss when it trains."""

    def forward(self, query, key, value, attention_mask, x, qr, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        x, qr = x.detach(), qr.detach()
        if qr.dim() == 2:  # THD: MLA squeezes its q latent to [t, q_lora_rank]
            qr = qr.unsqueeze(1)
        tp = parallel_state.get_tensor_model_parallel_group()
        if self.config.sequence_parallel and tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=tp)
            qr = gather_from_sequence_parallel_region(qr, group=tp)
        losses: list[tuple[torch.Tensor, int]] = []
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._forward_thd(query, key, value, x, qr, packed_seq_params, losses)
        else:
            s, b = query.shape[:2]
            mask = torch.full((s, s), float("-inf"), device=query.device).triu(1).expand(b, s, s)
            if attention_mask is not None:
                pad = attention_mask.reshape(-1, *attention_mask.shape[-2:]).expand(b, s, s)
                mask = mask.masked_fill(pad, float("-inf"))
            out = self._attend(query, key, value, x, qr, mask.contiguous(), losses)
        if losses:
            total = sum(n for _, n in losses)
            out = DSAIndexerLossAutoScaler.apply(out, sum(loss * (n / total) for loss, n in losses))
        return out

    def _forward_thd(self, query, key, value, x, qr, params, losses) -> torch.Tensor:
        starts = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
                  else params.cu_seqlens_q).tolist()
        bounds = params.cu_seqlens_q.tolist()
        out = query.new_zeros(query.size(0), query.size(1) * value.size(-1))
        for i, start in enumerate(starts[:-1]):
            n = bounds[i + 1] - bounds[i]
            if n == 0:
                continue
            rows = slice(start, start + n)
            mask = torch.full((n, n), float("-inf"), device=query.device).triu(1).unsqueeze(0)
            seq = self._attend(query[rows].unsqueeze(1), key[rows].unsqueeze(1), value[rows].unsqueeze(1),
                               x[rows], qr[rows], mask, losses)
            out[rows] = seq[:, 0]
        return out

    def _attend(self, query, key, value, x, qr, mask, losses) -> torch.Tensor:
        index_scores, topk = self.indexer.scores(x, qr, mask)
        out = sparse_attention(query, key, value, topk, mask, self.softmax_scale)
        coeff = float(self.config.dsa_indexer_loss_coeff or 0.0)
        if coeff and self.training and torch.is_grad_enabled():
            loss = compute_dsa_indexer_loss(index_scores.clone(), topk, query.detach(), key.detach(),
                                            self.softmax_scale, coeff, self.config.dsa_indexer_use_sparse_loss,
                                            self.indexer.pg_collection)
            losses.append((loss, query.size(0) * query.size(1)))
        return out


def sparse_attention_spec(interleaved: bool = False) -> ModuleSpec:
    """The ``core_attention`` spec of a DSA layer on megatron's local MLA spec (``interleaved``: the indexer's
    RoPE rotates interleaved pairs, GLM-5)."""
    return ModuleSpec(module=SparseAttention, submodules=DSAttentionSubmodules(indexer=ModuleSpec(
        module=SparseIndexer, params={"interleaved": interleaved}, submodules=DSAIndexerSubmodules(
            linear_wq_b=IndexerLinear, linear_wk=IndexerLinear, k_norm=IndexerKeyNorm,
            linear_weights_proj=IndexerLinear))))
