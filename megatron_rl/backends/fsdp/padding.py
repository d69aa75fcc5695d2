"""THD micro-batch -> right-padded rows for HF models: the padding fallback.

The shared planner packs each micro-batch padding-free (``data.packing.PackedBatch``:
sequences back to back, ``cu_seqlens`` marks the boundaries). An HF model on CPU
runs PyTorch SDPA, which has no variable-length (cu_seqlens) kernel, so a packed
row would let every sequence attend to the ones before it. This module lays the
same sequences out as a ``[n, max_len]`` batch, right-padded, with an attention
mask, and maps each response token back to the ``(row, column)`` whose logits
predict it, so log-probs come out in exactly the flat response-aligned order of
the packed batch (``PackedBatch.response_positions``) and feed the same
``Spec.extract_model_output`` / ``LossInputs`` as the megatron backend
(``backends.loss_rows.padded_loss_rows`` keeps the ones that carry loss).

Why not varlen here: the padding-free path for HF models passes ``position_ids``
restarting per sequence plus flash-attention's varlen kernel (transformers'
``flash_attention_2`` reads ``cu_seqlens`` from the position ids). That needs a
GPU and flash-attn; it is not built in this version. Padding costs
``n * max_len - T`` wasted positions per micro-batch, bounded by the token budget.

Right padding keeps every real token's position id equal to its index in the
sequence (HF's default ``arange``), as in the packed layout, and no real query
ever sees a pad key (causal mask and the attention mask both exclude them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.data.packing import PackedBatch


@dataclass
class PaddedRows:
    """One micro-batch as HF model inputs plus where its response logits are.

    ``input_ids`` / ``attention_mask``: ``[n, max_len]`` (an empty micro-batch is one
    all-pad row that attends to itself: it runs forward and backward so every
    data-parallel rank issues the same FSDP collectives, and carries no loss).
    ``response_rows`` / ``response_cols``: ``[R]``, the position whose output predicts
    response token ``i`` of the flat response-aligned tensors.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_rows: torch.Tensor
    response_cols: torch.Tensor

    def to(self, device) -> "PaddedRows":
        return PaddedRows(*(t.to(device) for t in (self.input_ids, self.attention_mask,
                                                     self.response_rows, self.response_cols)))


def unpack_to_rows(mb: PackedBatch, pad_token_id: int = 0) -> PaddedRows:
    """Right-pad the sequences of ``mb`` into rows (see the module docstring)."""
    cu = mb.cu_seqlens.tolist()
    real = mb.cu_seqlens_unpadded.tolist()
    lengths = [b - a for a, b in zip(real, real[1:])]
    n, width = len(lengths), max(lengths)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        input_ids[i, :length] = mb.tokens[cu[i]:cu[i] + length]
        attention_mask[i, :length] = 1
    # packed position -> (sequence, offset in it); response positions lie inside real tokens
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    pos = mb.response_positions.long()
    rows = torch.searchsorted(starts, pos, right=True) - 1
    cols = pos - starts[rows] if pos.numel() else pos
    return PaddedRows(input_ids, attention_mask, rows, cols)
