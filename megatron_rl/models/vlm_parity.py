"""Parity of a vision-language model (:mod:`megatron_rl.models.vision_language`) with HF transformers' own model.

The text-only :mod:`megatron_rl.models.parity` drives token batches; a vision-language sample also carries
``pixel_values`` and ``image_grid_thw``, and its positions are the three M-RoPE rows. Here micro-batches of
samples go through megatron's ``get_forward_backward_func``, packed THD (every sample padded to the CP x SP
multiple; under context parallelism the whole packed batch goes to every CP rank, which writes the image
features in and then keeps its chunks) or one unpacked sample per micro-batch; the reference is HF's
``*ForConditionalGeneration`` given each sample's ids, pixels and grids (HF computes its own positions with
``get_rope_index``). The loss is parity's weighted next-token NLL, summed over a micro-batch, averaged over
micro-batches and DP ranks as megatron + DDP average it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.models import cp_utils, hf_module
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


def hf_loss(hf_model, microbatches_per_dp_rank: list[list[list[VLSample]]], image_token_id: int,
            logits_out: Optional[list] = None) -> torch.Tensor:
    """The loss whose gradient megatron + DDP produce: summed over a micro-batch's samples, mean over micro-batches
    and DP ranks. ``logits_out``: receives each sample's logits (detached), so a caller needs no second forward."""
    total = torch.zeros(())
    for microbatches in microbatches_per_dp_rank:
        for mb in microbatches:
            for s in mb:
                logits = hf_forward(hf_model, s, image_token_id)
                if logits_out is not None:
                    logits_out.append(logits.detach())
                total = total + _weighted_nll(logits, s.input_ids, s.weights) / len(microbatches)
    return total / len(microbatches_per_dp_rank)


# ------------------------------------------------------------------- megatron
@dataclass
class _Prepared:
    input_ids: torch.Tensor  # [1, T]: the whole (packed) micro-batch, as the model takes it
    position_ids: torch.Tensor  # [3, 1, T]
    targets: torch.Tensor  # [1, T_local]: this CP rank's tokens
    weights: torch.Tensor  # [1, T_local]
    pixel_values: Optional[torch.Tensor]
    image_grid_thw: Optional[torch.Tensor]
    packed_seq_params: object
    cu_pad: Optional[torch.Tensor]
    lengths: list[int]


def _prepare(mb: list[VLSample], packed: bool, image_token_id: int, merge: int, sp: bool) -> _Prepared:
    """One micro-batch as the model takes it: packed THD (every sample padded to the CP x SP multiple, the whole
    batch given to every CP rank, the loss's targets and weights this rank's share), or one unpacked sample
    (padded to the TP size under sequence parallelism)."""
    from megatron.core import parallel_state as ps

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    multiple = cp_utils.cp_pad_multiple(cp, tp, sp) if packed else (tp if sp else 1)
    ids, pos, tgt, wts, cu = [], [], [], [], [0]
    for s in mb:
        n = len(s.input_ids)
        extra = -n % multiple
        p = mrope_position_ids(s.input_ids, s.image_grid_thw, image_token_id, merge)
        tail = p.max() + 1 + torch.arange(extra)  # padding continues every row
        ids.append(torch.cat([s.input_ids, s.input_ids.new_zeros(extra)]))
        pos.append(torch.cat([p, tail.expand(3, extra)], dim=1))
        tgt.append(torch.cat([torch.roll(s.input_ids, -1), s.input_ids.new_zeros(extra)]))
        wts.append(torch.cat([s.weights, s.weights.new_zeros(extra)]))
        cu.append(cu[-1] + n + extra)
    pixel_list = [s.pixel_values for s in mb if s.pixel_values is not None]
    grid_list = [s.image_grid_thw for s in mb if s.image_grid_thw is not None]
    pixels = torch.cat(pixel_list) if pixel_list else None
    grids = torch.cat(grid_list) if grid_list else None
    lengths = [len(s.input_ids) for s in mb]
    if not packed:
        assert len(mb) == 1, "an unpacked micro-batch holds one sample"
        return _Prepared(ids[0][None], pos[0][:, None], tgt[0][None], wts[0][None], pixels, grids, None, None,
                         lengths)
    cu_pad = torch.tensor(cu, dtype=torch.int32)
    real = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    index = cp_utils.cp_local_index(cu_pad, ps.get_context_parallel_rank(), cp)
    return _Prepared(torch.cat(ids)[None], torch.cat(pos, dim=1)[:, None], torch.cat(tgt)[index][None],
                     torch.cat(wts)[index][None], pixels, grids, cp_utils.make_packed_seq_params(cu_pad, real), cu_pad,
                     lengths)


def megatron_run(model_chunks, microbatches: list[list[VLSample]], vocab_size: int, forward_only: bool = True,
                 packed: bool = True) -> list[torch.Tensor]:
    """Forward (and backward unless ``forward_only``) of the micro-batches through megatron's schedule; per-sample
    logits ``[s, vocab_size]`` gathered over TP and CP, on every rank. ``packed``: each micro-batch one THD
    batch (needed for context parallelism); otherwise every micro-batch must hold one sample."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = unwrap(model_chunks[0])
    preps = [_prepare(mb, packed, model.image_token_id, model.spatial_merge_size, bool(model.config.sequence_parallel))
             for mb in microbatches]
    collected: list[torch.Tensor] = []

    def loss_func(prep, output):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(output.detach().float())[0]
        if prep.cu_pad is not None:
            full = cp_utils.gather_packed_from_cp(full, prep.cu_pad)
            starts = prep.cu_pad.tolist()
        else:
            starts = [0]
        collected.extend(full[a:a + n, :vocab_size].contiguous() for a, n in zip(starts, prep.lengths))
        logits = _mask_padded_vocab(output, vocab_size)
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float().transpose(0, 1).clone(memory_format=torch.contiguous_format), prep.targets.transpose(0, 1))
        loss = (nll.transpose(0, 1) * prep.weights).sum()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        prep = next(data_iterator)
        out = chunk(prep.input_ids, prep.position_ids, attention_mask=None, pixel_values=prep.pixel_values,
                    image_grid_thw=prep.image_grid_thw, packed_seq_params=prep.packed_seq_params)
        return out, partial(loss_func, prep)

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(preps),
                                model=model_chunks[0], num_microbatches=len(preps),
                                seq_length=max(p.input_ids.shape[1] for p in preps), micro_batch_size=1,
                                forward_only=forward_only)
    shapes = [(n, vocab_size) for p in preps for n in p.lengths]
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the last stage's logits, to every stage
        if not ps.is_pipeline_last_stage():
            collected = [torch.empty(shape) for shape in shapes]
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[-1]
        for t in collected:
            torch.distributed.broadcast(t, src=src, group=group)
    return collected


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


def hf_grads(hf_model, shapes: Optional[dict[str, tuple[int, ...]]] = None) -> dict[str, torch.Tensor]:
    """HF's parameter gradients under the checkpoint's names (transformers' own reverse conversion). ``shapes``
    (the bridge's ``hf_param_shapes``): a stacked expert tensor the reverse conversion leaves in transformers'
    in-memory layout (Qwen3-VL-MoE's ``[E, 2f, h]``: its load-time ``Transpose(check_dims=True)`` is not undone)
    is given the checkpoint's (its last two dims swapped)."""
    named = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    out: dict[str, torch.Tensor] = {}
    for unit in hf_module.layer_units(named):
        out.update(hf_module.hf_checkpoint_names(hf_model, {n: named[n] for n in unit}))
    for name, grad in list(out.items()):
        want = (shapes or {}).get(name)
        if want is not None and grad.dim() == 3 and tuple(grad.shape) != tuple(want):
            out[name] = grad.transpose(1, 2)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"tensor names differ: {sorted(set(a) ^ set(b))[:10]}")
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)
