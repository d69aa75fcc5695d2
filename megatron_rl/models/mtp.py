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
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from megatron.core.models.gpt import GPTModel

from megatron_rl.models.spec import final_norm_module, layer_spec_flavour
from megatron_rl.models.weights import unwrap


def mtp_block_spec(config, layer_specs: list):
    """``MultiTokenPredictionBlockSubmodules`` with one MTP layer per entry of ``layer_specs`` (the
    decoder-layer spec of that depth), norms and ``eh_proj`` of the layer spec's backend."""
    from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                                  MultiTokenPredictionLayer,
                                                                  MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec

    if layer_spec_flavour() == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as column_linear
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear as column_linear
    norm = final_norm_module()
    return MultiTokenPredictionBlockSubmodules(layer_specs=[
        ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=column_linear, transformer_layer=spec, layer_norm=norm))
        for spec in layer_specs])


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

    def _postprocess(self, *args, **kwargs):
        if self.run_mtp:
            return super()._postprocess(*args, **kwargs)
        kwargs["mtp_in_postprocess"] = False
        saved, self.config.mtp_num_layers = self.config.mtp_num_layers, None
        try:
            return super()._postprocess(*args, **kwargs)
        finally:
            self.config.mtp_num_layers = saved


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
