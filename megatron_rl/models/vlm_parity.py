"""Parity of a vision-language model (:mod:`megatron_rl.models.vision_language`) with HF transformers' own model.

The text-only :mod:`megatron_rl.models.parity` drives token batches; a vision-language sample also carries
``pixel_values`` and ``image_grid_thw``, and its positions are the three M-RoPE rows. Here each sample is one
right-sized micro-batch (``[1, s]``, no packing: packing with images is not built yet, docs/vlm.md) through
megatron's ``get_forward_backward_func``; the reference is HF's ``*ForConditionalGeneration`` given the same
ids, pixels and grids (HF computes its own positions with ``get_rope_index``). The loss is parity's weighted
next-token NLL, averaged over micro-batches and DP ranks as megatron + DDP average it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.models.mrope import mrope_position_ids
from megatron_rl.models.weights import unwrap


@dataclass
class VLSample:
    input_ids: torch.Tensor  # [s] long
    weights: torch.Tensor  # [s] float, 0 on the last token
    pixel_values: Optional[torch.Tensor] = None  # [sum(t*h*w), channels * temporal_patch * patch^2]
    image_grid_thw: Optional[torch.Tensor] = None  # [images, 3] long


def random_samples(bridge, layouts: list[tuple[int, list[tuple[int, int, int]]]], seed: int) -> list[VLSample]:
    """One sample per ``(text_tokens, [(t, h, w), ...])``: ``text_tokens`` random text tokens split around the
    images, each image written as the processor does (vision start, its ``t*h*w/m^2`` pad tokens, vision end)
    with random pixel patches."""
    gen = torch.Generator().manual_seed(seed)
    vc, tokens = bridge.vision_config, bridge.vl_config
    start, end, pad = int(tokens["vision_start_token_id"]), int(tokens["vision_end_token_id"]), bridge.image_token_id
    text_top = min(pad, start, end, int(tokens.get("video_token_id", pad)))  # text ids below every special id
    patch_dim = int(vc["in_channels"]) * int(vc["temporal_patch_size"]) * int(vc["patch_size"]) ** 2
    m = bridge.spatial_merge_size
    samples = []
    for text_len, grids in layouts:
        cuts = sorted(torch.randint(0, text_len + 1, (len(grids),), generator=gen).tolist())
        pieces, prev = [], 0
        for cut, (t, h, w) in zip(cuts, grids):
            pieces.append(torch.randint(0, text_top, (cut - prev,), generator=gen))
            pieces.append(torch.tensor([start] + [pad] * (t * h * w // m ** 2) + [end]))
            prev = cut
        pieces.append(torch.randint(0, text_top, (text_len - prev,), generator=gen))
        ids = torch.cat(pieces).long()
        weights = torch.rand(len(ids), generator=gen) + 0.5
        weights[-1] = 0.0
        if grids:
            grid = torch.tensor(grids, dtype=torch.long)
            pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen)
            samples.append(VLSample(ids, weights, pixels, grid))
        else:
            samples.append(VLSample(ids, weights))
    return samples


# ------------------------------------------------------------------------- HF
def load_hf_model(hf_dir: str):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()


def hf_forward(hf_model, sample: VLSample, image_token_id: int) -> torch.Tensor:
    """HF logits ``[s, V]`` of one sample (HF computes its M-RoPE positions itself)."""
    ids = sample.input_ids[None]
    if sample.pixel_values is None:
        return hf_model(input_ids=ids).logits[0].float()
    return hf_model(input_ids=ids, pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw,
                    mm_token_type_ids=(ids == image_token_id).int()).logits[0].float()


def _weighted_nll(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.gather(-1, torch.roll(ids, -1)[:, None])[:, 0] * weights).sum()


def hf_loss(hf_model, samples_per_dp_rank: list[list[VLSample]], image_token_id: int,
            logits_out: Optional[list] = None) -> torch.Tensor:
    """The loss whose gradient megatron + DDP produce: mean over DP ranks and micro-batches (one sample each).
    ``logits_out``: receives each sample's logits (detached), so a caller needs no second forward."""
    total = torch.zeros(())
    for samples in samples_per_dp_rank:
        for s in samples:
            logits = hf_forward(hf_model, s, image_token_id)
            if logits_out is not None:
                logits_out.append(logits.detach())
            total = total + _weighted_nll(logits, s.input_ids, s.weights) / len(samples)
    return total / len(samples_per_dp_rank)


# ------------------------------------------------------------------- megatron
def megatron_run(model_chunks, samples: list[VLSample], vocab_size: int,
                 forward_only: bool = True) -> list[torch.Tensor]:
    """Forward (and backward unless ``forward_only``) of one micro-batch per sample through megatron's
    schedule; per-sample logits ``[s, vocab_size]`` gathered over TP (every rank returns them)."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = unwrap(model_chunks[0])
    # sequence parallelism splits the sequence over TP: pad each sample with text tokens of weight 0
    multiple = ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
    padded = [_pad(s, multiple) for s in samples]
    collected: list[torch.Tensor] = []

    def loss_func(sample, length, output):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(output.detach().float())
        collected.append(full[0, :length, :vocab_size].contiguous())
        logits = _mask_padded_vocab(output, vocab_size)
        targets = torch.roll(sample.input_ids, -1)[:, None]  # [s, b=1]
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float().transpose(0, 1).clone(memory_format=torch.contiguous_format), targets)
        loss = (nll[:, 0] * sample.weights).sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        sample, length = next(data_iterator)
        positions = mrope_position_ids(sample.input_ids, sample.image_grid_thw, model.image_token_id,
                                       model.spatial_merge_size)[:, None, :]
        out = chunk(sample.input_ids[None], positions, attention_mask=None, pixel_values=sample.pixel_values,
                    image_grid_thw=sample.image_grid_thw)
        return out, partial(loss_func, sample, length)

    get_forward_backward_func()(forward_step_func=forward_step,
                                data_iterator=iter(list(zip(padded, [len(s.input_ids) for s in samples]))),
                                model=model_chunks[0], num_microbatches=len(samples),
                                seq_length=max(len(s.input_ids) for s in padded), micro_batch_size=1,
                                forward_only=forward_only)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the last stage's logits, to every stage
        if not ps.is_pipeline_last_stage():
            collected = [torch.empty(len(s.input_ids), vocab_size) for s in samples]
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[-1]
        for t in collected:
            torch.distributed.broadcast(t, src=src, group=group)
    return collected


def _pad(sample: VLSample, multiple: int) -> VLSample:
    extra = -len(sample.input_ids) % multiple
    if not extra:
        return sample
    return VLSample(torch.cat([sample.input_ids, sample.input_ids.new_zeros(extra)]),
                    torch.cat([sample.weights, sample.weights.new_zeros(extra)]), sample.pixel_values,
                    sample.image_grid_thw)


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * local
    if first + local <= vocab_size:
        return logits
    cols = torch.arange(first, first + local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)


def exported_grads(bridge, model_chunks) -> dict[str, torch.Tensor]:
    """The gradients as HF checkpoint tensors (``main_grad`` under megatron's DDP, ``grad`` otherwise), through
    the weight exporter (collective over TP)."""
    params = [p for c in model_chunks for p in c.parameters()]
    saved = [p.data.clone() for p in params]
    for p in params:
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        p.data.copy_(torch.zeros_like(p) if grad is None else grad)
    try:
        return {k: v.clone() for k, v in bridge.export_hf_weights(model_chunks)}
    finally:
        for p, s in zip(params, saved):
            p.data.copy_(s)


def hf_grads(hf_model) -> dict[str, torch.Tensor]:
    """HF's parameter gradients under the checkpoint's names (transformers' own reverse conversion)."""
    from megatron_rl.models import hf_module

    named = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    out: dict[str, torch.Tensor] = {}
    for unit in hf_module.layer_units(named):
        out.update(hf_module.hf_checkpoint_names(hf_model, {n: named[n] for n in unit}))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"tensor names differ: {sorted(set(a) ^ set(b))[:10]}")
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)
