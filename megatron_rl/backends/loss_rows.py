"""Logits only where the loss reads them: the output layer sees the loss rows, nothing else.

Why: the output layer's logits, ``[tokens, vocab]``, are the largest tensor of an RL
step (a 32k-token packed micro-batch at a 152k vocab is 9.7 GB in bf16, twice that
once the log-prob op works in float32). An agentic trajectory is mostly prompt and
tool observations, whose log-probs no loss term ever reads (their loss mask is 0).
So before the output layer runs, a forward pre-hook keeps only the hidden states of
the positions whose next token carries loss; the logits, the log-probs and the
entropy are computed for those rows alone, and the response-aligned results hold
0.0 everywhere else (every consumer masks them: the policy loss, KL, TIS, the
mismatch metrics). The log-prob of a kept row is bitwise what the full-sequence
path computes for it: the same hidden state through the same matmul.

The projection itself runs in row chunks (``ops.linear_logprobs_and_entropy``): where
the output layer's output is its matmul and nothing else (``projects_plainly``), its
forward is replaced for the pass by one that takes the kept rows and the layer's weight
and returns per-row ``[log-prob, entropy]`` (``project_rows``), so even the loss rows'
logits exist one chunk at a time, forward and backward. A layer whose logits are changed
after its matmul (a forward hook: Gemma's soft-capping; an HF model that scales or caps
them after ``lm_head``; a LoRA-wrapped head) keeps the loss-rows logits path above.

A micro-batch with no loss rows still sends one row through the output layer (row
0, whose result is multiplied by zero), so every rank runs the same kernels and
collectives, forward and backward.

Layouts: megatron's output layer sees ``[s, 1, h]`` (the packed tokens, this CP
rank's shard of them, gathered from sequence parallelism by the hook itself); an
HF model's ``lm_head`` sees ``[n, width, h]`` right-padded rows, flattened here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from megatron_rl.algorithms.spec import ModelOutput
from megatron_rl.data.packing import PackedBatch


@dataclass(frozen=True)
class LossRows:
    """The rows of a micro-batch's hidden states the output layer computes.

    ``rows`` int64 ``[n]``: row indices into the hidden states the output layer
    receives (flattened over its leading dims); ``targets`` ``[n]``: the token each
    row predicts; ``count`` of them carry loss (the rest is the single placeholder
    row of a micro-batch without loss rows); ``response_index`` ``[count]``: where
    each lands in the flat response-aligned tensors (``num_response`` long).
    """

    rows: torch.Tensor
    targets: torch.Tensor
    response_index: torch.Tensor
    num_response: int
    projected: bool = False  # the output layer returned per-row [log-prob(, entropy)], not logits (project_rows)

    @property
    def count(self) -> int:
        return int(self.response_index.numel())

    @property
    def empty(self) -> bool:
        return self.count == 0

    def to_response(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values ``[n]`` -> response-aligned ``[num_response]``, 0.0 where no loss is read.
        Differentiable in ``values`` (an out-of-place ``index_copy``)."""
        out = values.new_zeros(self.num_response)
        if self.empty:
            return out + _zero_through(values)
        return out.index_copy(0, self.response_index.to(values.device), values[:self.count])

    def to_rows(self, values: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Per-row values ``[n]`` -> ``[num_rows]`` indexed like the hidden states, 0.0 elsewhere
        (a CP rank's shard, before the CP all-gather reassembles whole sequences)."""
        out = values.new_zeros(num_rows)
        if self.empty:
            return out + _zero_through(values)
        return out.index_copy(0, self.rows[:self.count].to(values.device), values[:self.count])


def _zero_through(values: torch.Tensor) -> torch.Tensor:
    """0.0 that depends on ``values``: a rank without loss rows still backpropagates through its model,
    so its backward issues the same collectives as its peers' (a CP rank whose shard holds no loss row
    would otherwise skip the backward of attention's CP all-gathers and hang the others; FSDP ranks
    must reduce-scatter every parameter's gradient)."""
    return values.sum() * 0.0


def _with_placeholder(rows: torch.Tensor, targets: torch.Tensor, response_index: torch.Tensor,
                      num_response: int) -> LossRows:
    if rows.numel() == 0:
        rows = torch.zeros(1, dtype=torch.long)
        targets = torch.zeros(1, dtype=torch.long)
    return LossRows(rows, targets, response_index, num_response)


def _loss_response_index(mb: PackedBatch) -> torch.Tensor:
    return (mb.loss_mask != 0).nonzero().squeeze(1).cpu()


def packed_loss_rows(mb: PackedBatch, local_index: Optional[torch.Tensor] = None) -> LossRows:
    """Loss rows of a packed micro-batch over its tokens, or, given ``local_index`` (the global packed
    positions a CP rank holds, in its local order: ``cp_utils.cp_local_index``), over that rank's shard.

    Under CP a rank keeps the loss rows that fall in its shard; the others' rows are
    the other ranks' (the CP all-gather of per-row results reassembles them).
    """
    idx = _loss_response_index(mb)
    positions = mb.response_positions.cpu().long().index_select(0, idx)
    targets = mb.response_target_ids.cpu().long().index_select(0, idx)
    if local_index is None:
        return _with_placeholder(positions, targets, idx, int(mb.loss_mask.numel()))
    local_index = local_index.cpu().long()
    which = torch.full((mb.num_tokens,), -1, dtype=torch.long)  # global position -> its loss row, or -1
    which[positions] = torch.arange(positions.numel())
    hit = which.index_select(0, local_index)
    local_rows = (hit >= 0).nonzero().squeeze(1)
    mine = hit.index_select(0, local_rows)
    return _with_placeholder(local_rows, targets.index_select(0, mine), idx.index_select(0, mine),
                             int(mb.loss_mask.numel()))


def padded_loss_rows(mb: PackedBatch, response_rows: torch.Tensor, response_cols: torch.Tensor,
                     width: int) -> LossRows:
    """Loss rows of a micro-batch laid out as right-padded rows ``[n, width]`` (the HF path):
    ``response_rows/cols`` say where each response token's logits are; rows index ``[n * width]``."""
    idx = _loss_response_index(mb)
    flat = response_rows.cpu().long() * width + response_cols.cpu().long()
    return _with_placeholder(flat.index_select(0, idx), mb.response_target_ids.cpu().long().index_select(0, idx),
                             idx, int(mb.loss_mask.numel()))


@contextlib.contextmanager
def keep_rows(layer: torch.nn.Module, select: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While open, ``layer``'s first positional input is replaced by ``select(input)``.

    The hook is removed on exit (an exception included); it changes nothing else
    the layer does, so the model's own code after the layer (softcapping, scaling)
    still applies to the kept rows."""
    def pre_hook(module, args):
        return (select(args[0]), *args[1:])

    handle = layer.register_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


def pack_output(out: ModelOutput) -> torch.Tensor:
    """``[n, 1]`` log-probs, or ``[n, 2]`` log-probs and entropy: what a projected output layer returns per row."""
    if out.entropy is None:
        return out.logprobs.unsqueeze(-1)
    return torch.stack([out.logprobs, out.entropy], dim=-1)


def unpack_output(packed: torch.Tensor) -> ModelOutput:
    """``pack_output``'s inverse over the rows of ``[..., n, k]`` (leading dims of size 1 dropped)."""
    flat = packed.reshape(-1, packed.shape[-1])
    return ModelOutput(flat[:, 0], flat[:, 1] if flat.shape[1] == 2 else None)


def projects_plainly(layer: torch.nn.Module, linear_type: type) -> bool:
    """Whether ``layer``'s output is exactly ``input @ weight.T`` of ``linear_type`` (megatron's
    ``ColumnParallelLinear``, or ``nn.Linear`` for an HF ``lm_head``): no bias, no forward hook that changes
    the logits (Gemma's soft-capping), not a subclass or wrapper (LoRA). Only then may its forward be
    replaced by the chunked log-prob op: anything applied to the logits after the matmul would be lost."""
    return (type(layer) is linear_type and getattr(layer, "bias", None) is None
            and not layer._forward_hooks and not layer._forward_hooks_with_kwargs)


@contextlib.contextmanager
def project_rows(layer: torch.nn.Module, forward: Callable[..., object]) -> Iterator[None]:
    """While open, ``layer``'s forward is ``forward`` (an instance attribute: ``nn.Module.__call__`` still
    runs the layer's hooks, FSDP's included). Restored on exit, an exception included."""
    before = layer.__dict__.get("forward")
    layer.forward = forward
    try:
        yield
    finally:
        if before is None:
            del layer.forward
        else:
            layer.forward = before


def select_hf_rows(rows: LossRows) -> Callable[[torch.Tensor], torch.Tensor]:
    """``[n, width, h]`` -> ``[1, len(rows), h]`` (an HF ``lm_head``'s input, batch of one)."""
    def select(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat.index_select(0, rows.rows.to(hidden.device)).unsqueeze(0)
    return select
