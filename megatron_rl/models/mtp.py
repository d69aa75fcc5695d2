"""Multi-token prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 checkpoints on megatron-core's own MTP block.

A checkpoint with ``num_nextn_predict_layers`` = D stores D MTP layers after the decoder
(``model.layers.{num_hidden_layers + d}``): ``enorm``, ``hnorm``, ``eh_proj``, a full decoder
layer, ``shared_head.norm``, and copies of the embedding and output head (``embed_tokens``,
``shared_head.head``). Depth d predicts token ``t + 2 + d`` from position t::

    h'_t = eh_proj(cat(enorm(embed(x_{t+1+d})), hnorm(h_t)))    # h_t: the previous depth's output
    h''  = decoder_layer(h')                                     # (depth 0: the decoder's, after its final norm)
    logits = head(shared_head.norm(h''))

which is megatron-core's ``MultiTokenPredictionLayer`` (``enorm``, ``hnorm``, ``eh_proj``,
``transformer_layer``, ``final_layernorm``) sharing the model's embedding and output layer,
built on the last pipeline stage (``GPTModel(mtp_block_spec=...)``, ``mtp_num_layers``).

:class:`MtpGPTModel` runs the block only when asked (:func:`capture_mtp_logits`): megatron-core
0.16.1 runs it in every forward once ``mtp_num_layers`` is set and then needs ``labels``, while
the RL forward passes compute log-probs from the main logits only and keep the MTP layers frozen.
With ``--enable-mtp-training`` the backend sets :attr:`MtpGPTModel.mtp_targets` for each training forward
(:func:`mtp_targets`) and the model adds the MTP loss at those rows (docs/parity.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from megatron_rl.models.spec import final_norm_module, layer_spec_flavour
from megatron_rl.models.weights import unwrap


def mtp_block_spec(config, layer_specs: list):
    """``MultiTokenPredictionBlockSubmodules`` with one MTP layer per entry of ``layer_specs`` (the
    decoder-layer spec of that depth), norms and ``eh_proj`` of the layer spec's backend."""
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    if layer_spec_flavour() == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column_linear
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear as column_linear
    norm = final_norm_module()
    return MultiTokenPredictionBlockSubmodules(layer_specs=[
        ModuleSpec(module=PaddedRollMtpLayer, submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=column_linear, transformer_layer=spec, layer_norm=norm))
        for spec in layer_specs])


class PaddedRollMtpLayer(MultiTokenPredictionLayer):
    """megatron-core 0.16.1's ``MultiTokenPredictionLayer`` rolling each depth's input ids within the packed
    sequences' *padded* boundaries.

    Why: megatron rolls the packed token stream per sequence by ``packed_seq_params.cu_seqlens_q`` (and under
    context parallelism divides those by the CP size to find each rank's share), but our packing pads every
    sequence to a multiple of the TP x CP split (``cu_seqlens_q_padded``, ``cp_utils.pad_packed``): with
    padding its roll reads the next sequence's tokens and, under CP, cuts the shards at the wrong places. The
    MTP layer's attention keeps the real boundaries; only the roll sees the padded ones."""

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None):
        padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
        if padded is not None:
            packed_seq_params = dataclasses.replace(packed_seq_params, cu_seqlens_q=padded, cu_seqlens_kv=padded)
        return super()._get_embeddings(input_ids, position_ids, embedding, hidden_states, packed_seq_params)


class MtpGPTModel(GPTModel):
    """``GPTModel`` holding megatron's MTP block, which its forward runs only while ``run_mtp`` is set.

    Off (the default), the forward is the plain model's: no MTP compute and no ``labels`` needed
    (megatron-core reads ``config.mtp_num_layers`` in its post-processing, so it is hidden from
    that one call). The block's parameters are still built, loaded, checkpointed and exported.
    """

    run_mtp = False

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """megatron-core 0.16.1 reads ``metadata["dp_cp_group"]`` to tie the MTP stage's copy of the embedding to
        the first stage's (pipeline parallel) but defaults ``metadata`` to None: fill it in as its modules do."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    mtp_targets: Optional["MtpTargets"] = None  # set per training forward by --enable-mtp-training
    last_mtp_loss: Optional[torch.Tensor] = None  # the unscaled MTP loss of the last training forward (detached)

    def _postprocess(self, *args, **kwargs):
        if self.run_mtp:
            return super()._postprocess(*args, **kwargs)
        kwargs["mtp_in_postprocess"] = False
        saved, self.config.mtp_num_layers = self.config.mtp_num_layers, None
        try:
            out = super()._postprocess(*args, **kwargs)
        finally:
            self.config.mtp_num_layers = saved
        if self.mtp_targets is not None and self.post_process and getattr(self, "mtp_process", False):
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            targets = self.mtp_targets
            loss = self._mtp_train_loss(kwargs, targets)
            self.last_mtp_loss = loss.detach()
            if targets.cp_group is not None:  # this CP rank's rows: the metric is the whole sequences'
                torch.distributed.all_reduce(self.last_mtp_loss, group=targets.cp_group)
            # megatron's averaging mode (DDP averages over data x context parallel ranks) scales a CP rank's loss
            # by the CP size, as its schedule does the main loss; the per-token mode sums the gradients instead
            cp_scale = 1 if self.config.calculate_per_token_loss else targets.cp_size
            out = MTPLossAutoScaler.apply(out, loss * (targets.factor * cp_scale / saved))
        return out

    def _mtp_train_loss(self, kw: dict, targets: "MtpTargets") -> torch.Tensor:
        """The MTP language-model loss ``sum_d sum_j w_j CE_d(rows_j)`` (unscaled), as slime trains it: the MTP
        block sees the decoder's hidden states, the embedding and the output weight detached, so only the MTP
        layers receive its gradient."""
        from megatron.core import tensor_parallel

        embedding = self.embedding

        def detached_embedding(**k):
            return embedding(**k).detach()

        hidden = self.mtp(input_ids=kw["input_ids"], position_ids=kw["position_ids"],
                          hidden_states=kw["hidden_states"].detach(), attention_mask=kw.get("attention_mask"),
                          inference_params=None, rotary_pos_emb=kw.get("rotary_pos_emb"),
                          rotary_pos_cos=kw.get("rotary_pos_cos"), rotary_pos_sin=kw.get("rotary_pos_sin"),
                          packed_seq_params=kw.get("packed_seq_params"),
                          sequence_len_offset=kw.get("sequence_len_offset"), embedding=detached_embedding,
                          **(kw.get("extra_block_kwargs") or {}))
        depths = torch.chunk(hidden, 1 + self.config.mtp_num_layers, dim=0)[1:]
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight).detach()
        layer = self.output_layer
        tp = layer.tp_group.size() if getattr(layer, "tp_group", None) is not None else 1
        start = (layer.tp_group.rank() if tp > 1 else 0) * weight.shape[0]
        total = hidden.new_zeros((), dtype=torch.float32)
        for d, h in enumerate(depths):
            if self.config.sequence_parallel and tp > 1:  # not the layer's flag: the backend lowers it for its rows
                h = tensor_parallel.gather_from_sequence_parallel_region(h, group=layer.tp_group)
            elif tp > 1:
                h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=layer.tp_group)
            rows = targets.rows[d].to(h.device)
            logits = torch.nn.functional.linear(h[:, 0].index_select(0, rows), weight).float()  # [n, V/tp]
            cols = torch.arange(start, start + logits.shape[-1], device=logits.device)
            logits = logits.masked_fill(cols >= targets.vocab_size, float("-inf"))  # megatron's vocab padding
            ce = tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], targets.ids[d].to(h.device)[:, None])
            total = total + (ce[:, 0] * targets.weights[d].to(h.device)).sum()
        return total


class MtpTargets:
    """Per MTP depth d: the positions ``rows[d]`` of this rank's token shard whose depth-d output scores a
    loss-masked response token, that token (``ids[d]``) and its weight (``weights[d]``: loss mask / normaliser).

    Under context parallelism (``cp_group``) a rank holds its rows only, and the CP ranks' losses sum to the whole
    sequences' (the gradients of the MTP layers add up over the CP ranks in DDP's reduction)."""

    def __init__(self, rows: list, ids: list, weights: list, vocab_size: int, factor: float,
                 cp_group: Any = None, cp_size: int = 1):
        self.rows, self.ids, self.weights, self.vocab_size, self.factor = rows, ids, weights, vocab_size, factor
        self.cp_group, self.cp_size = cp_group, cp_size


def mtp_targets(cu_seqlens: torch.Tensor, response_lengths: torch.Tensor, response_positions: torch.Tensor,
                response_target_ids: torch.Tensor, loss_mask: torch.Tensor, depths: int, normaliser: float,
                vocab_size: int, factor: float, local_index: Optional[torch.Tensor] = None,
                cp_group: Any = None) -> MtpTargets:
    """The MTP targets of one packed micro-batch: response token j (predicted by the main head at
    ``response_positions[j]``) is depth d's target at position ``response_positions[j] - 1 - d`` (depth d
    predicts token t + 2 + d), where that position lies in the token's own sequence and its loss mask is nonzero;
    weight ``loss_mask / normaliser``; the loss enters the step as ``factor / depths`` times their weighted sum
    (megatron's ``mtp_loss_scaling_factor / mtp_num_layers``).

    ``local_index`` (context parallelism: ``cp_utils.cp_local_index``, the packed positions this CP rank holds, in
    its order; ``cp_group`` its group): keep the rows this rank holds, as positions of its shard."""
    starts = cu_seqlens[:-1].long().repeat_interleave(response_lengths.long())
    local = None
    if local_index is not None:
        device = response_positions.device  # the micro-batch's (the backend moves it to the model's device)
        local = torch.full((int(cu_seqlens[-1]),), -1, dtype=torch.long, device=device)
        local[local_index.to(device).long()] = torch.arange(local_index.numel(), device=device)
    rows, ids, weights = [], [], []
    for d in range(depths):
        pos = response_positions.long() - 1 - d
        keep = (pos >= starts) & (loss_mask != 0)
        if local is not None:
            keep &= local[pos.clamp(min=0)] >= 0
            pos = local[pos.clamp(min=0)]
        rows.append(pos[keep])
        ids.append(response_target_ids.long()[keep])
        weights.append(loss_mask[keep].float() / normaliser)
    cp_size = 1 if local_index is None else int(cu_seqlens[-1]) // local_index.numel()
    return MtpTargets(rows, ids, weights, vocab_size, factor, cp_group if cp_size > 1 else None, cp_size)


def mtp_parameters(model_chunks) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every MTP-block parameter of this rank's chunks."""

    for chunk in model_chunks:
        model = unwrap(chunk)
        if getattr(model, "mtp_process", False):
            yield from ((f"mtp.{n}", p) for n, p in model.mtp.named_parameters())


def freeze_mtp(model_chunks) -> int:
    """Freeze the MTP block (no gradient, no optimizer state); returns how many parameters it froze.
    Call before the DDP wrap and the optimizer are built."""
    n = 0
    for _, p in mtp_parameters(model_chunks):
        p.requires_grad_(False)
        n += 1
    return n


@contextlib.contextmanager
def capture_mtp_logits(model: Any) -> Iterator[list[torch.Tensor]]:
    """Run ``model``'s MTP block in the forwards inside the block and collect each depth's logits.

    Yields a list that fills with one ``[s, b, V/tp]`` tensor per MTP depth per forward (megatron
    calls the shared output layer on each depth before the main hidden states). The forwards
    must pass ``labels`` (megatron-core computes the MTP loss from them)."""

    model = unwrap(model)
    depths = model.config.mtp_num_layers
    calls: list[torch.Tensor] = []
    got: list[torch.Tensor] = []

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        calls.append(logits.detach().clone())  # a copy: megatron's cross entropy then edits the logits in place
        if len(calls) == depths + 1:  # the depths, then the main logits
            got.extend(calls[:depths])
            calls.clear()

    handle = model.output_layer.register_forward_hook(hook)
    model.run_mtp = True
    try:
        yield got
    finally:
        model.run_mtp = False
        handle.remove()


def mtp_logits(model_chunks, seqs: list[torch.Tensor], vocab_size: int) -> list[list[torch.Tensor]]:
    """Each MTP depth's logits ``[L_i, vocab_size]`` for each sequence (one per micro-batch, ``[1, L]``),
    run through megatron's pipeline schedule; every rank of the PP group returns them (collective).
    Position t of depth d scores token ``t + 2 + d``; the last ``d + 1`` positions see padding tokens."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func


    last = unwrap(model_chunks[-1])
    depths = int(last.config.mtp_num_layers or 0)
    holder = last if ps.is_pipeline_last_stage() else None
    collected: list = []

    def forward_step(data_iterator, model):
        seq = next(data_iterator)
        ids = seq[None]
        out = model(ids, torch.arange(len(seq))[None], attention_mask=None, labels=torch.roll(ids, -1, dims=-1))
        return out, lambda output: (output.sum() * 0, {})

    with contextlib.ExitStack() as stack:
        got = stack.enter_context(capture_mtp_logits(holder)) if holder is not None else None
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(seqs) for _ in model_chunks] if len(model_chunks) > 1
            else iter(seqs), model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=len(seqs), seq_length=max(len(s) for s in seqs), micro_batch_size=1, forward_only=True)
        if got is not None:
            for logits in got:
                full = tensor_parallel.gather_from_tensor_model_parallel_region(logits.float())
                collected.append(full[:, 0, :vocab_size].contiguous())
    shapes = [(len(s), vocab_size) for s in seqs for _ in range(depths)]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        if holder is None:
            collected = [torch.empty(shape) for shape in shapes]
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[-1]
        for t in collected:
            torch.distributed.broadcast(t, src=src, group=group)
    return [collected[i * depths:(i + 1) * depths] for i in range(len(seqs))]
