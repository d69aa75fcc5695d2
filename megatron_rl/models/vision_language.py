"""A vision-language model in megatron-core: megatron's ``GPTModel`` with multimodal RoPE for the language
model, and the checkpoint's own HF vision tower and merger in front of it (Qwen2.5-VL; Qwen3-VL with its
interleaved M-RoPE, :class:`InterleavedMultimodalRotaryEmbedding`, and its DeepStack features added after the
first decoder layers, :meth:`VisionLanguageGPTModel.attach_vision`).

Why the HF vision module (``transformers``' ``Qwen2_5_VisionTransformerPretrainedModel``) and not
megatron-core's vision modules: parity with HF is then by construction (the same code computes the image
features), and the tower is small next to the language model (Qwen2.5-VL-7B: 0.67 B of 8.3 B parameters), so
it runs replicated on every tensor-parallel rank and data-parallel across DP ranks (docs/parity.md,
"Vision-language models"). Its parameters carry no tensor-parallel attributes: megatron's DDP reduces their
gradients over data parallelism like any replicated parameter, and every TP rank computes the same gradient
(the first layer's column-parallel input all-reduces the gradient of the embeddings the features were
scattered into).

:class:`VisionLanguageGPTModel` is what :meth:`Qwen2_5_VLBridge.build_model
<megatron_rl.models.families.Qwen2_5_VLBridge>` builds. Its ``forward`` takes megatron's arguments plus
``pixel_values`` / ``image_grid_thw``; on the first pipeline stage it embeds the tokens, runs the vision
tower and scatters the features at the image-pad tokens (:func:`~megatron_rl.models.mrope.scatter_image_features`)
on the whole sequence, then splits it as the decoder takes it (this context-parallel rank's chunks of a packed
batch, this TP rank's share under sequence parallelism) and hands it to the decoder as ``decoder_input``. Position ids are
``[3, b, s]`` (:func:`~megatron_rl.models.mrope.mrope_position_ids`); ``[b, s]`` ids (a text-only batch)
are used for all three sections, which is plain RoPE.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel

from megatron_rl.errors import BridgeError, ConfigError
from megatron_rl.models import cp_utils
from megatron_rl.models.mrope import check_image_tokens, scatter_image_features


def build_vision_tower(classes: tuple[str, str, str], vision_config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The HF vision tower + merger(s) of a vision-language config (``vision_config``): ``classes`` is the bridge's
    (transformers module, vision config class, vision model class). Built on the current default device (``meta``
    under the streaming converters' ``torch.device("meta")``)."""
    import importlib  # lazy: transformers (~seconds)

    module_name, config_name, model_name = classes
    hf = importlib.import_module(module_name)
    config_cls = getattr(hf, config_name, None) or getattr(importlib.import_module(
        module_name.replace(".modeling_", ".configuration_")), config_name)
    config = config_cls(**{k: v for k, v in vision_config.items() if k != "model_type"})
    return getattr(hf, model_name)._from_config(config, dtype=dtype)


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Multimodal RoPE whose rotary channels take their position row round-robin (Qwen3-VL): channel ``j`` of the
    ``head_dim / 2`` frequencies uses the height row when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width
    row when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, the temporal row otherwise; the result is doubled over
    the two rotate-half halves, as transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``.
    megatron-core 0.16.1's ``MultimodalRotaryEmbedding`` only knows contiguous sections; this replaces its
    ``forward`` (same arguments, same ``[s, b, 1, head_dim]`` output, same CP slice when a CP group is given) and
    keeps its inverse frequencies."""

    def __init__(self, contiguous: MultimodalRotaryEmbedding):
        torch.nn.Module.__init__(self)
        self.inv_freq = contiguous.inv_freq
        self.rotary_interleaved = contiguous.rotary_interleaved
        self.seq_len_interpolation_factor = contiguous.seq_len_interpolation_factor
        self.cp_group = contiguous.cp_group

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq * (1 / self.seq_len_interpolation_factor)
        freqs = seq[..., None].float() * self.inv_freq  # [3, b, s, dim / 2]
        rows = interleaved_rows(freqs.shape[-1], mrope_section).to(freqs.device)
        freqs = freqs.gather(0, rows.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]  # [b, s, dim / 2]
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        emb = emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]
        cp_group = self.cp_group if cp_group is None else cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


def interleaved_rows(channels: int, mrope_section: list[int]) -> torch.Tensor:
    """Which position row (0 temporal, 1 height, 2 width) each of the ``channels`` rotary frequencies takes in
    interleaved M-RoPE."""
    j = torch.arange(channels)
    rows = torch.zeros(channels, dtype=torch.long)
    rows[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
    rows[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
    return rows


class VisionLanguageGPTModel(GPTModel):
    """``GPTModel`` (``position_embedding_type="mrope"``) with a ``vision`` tower on the first stage, set by
    :meth:`attach_vision` after construction, and the image token facts on every stage (:meth:`set_image_tokens`)."""

    image_token_id: int = -1
    spatial_merge_size: int = 1
    _deepstack: list = []  # this forward's DeepStack residuals (attach_vision)

    def set_image_tokens(self, image_token_id: int, spatial_merge_size: int) -> None:
        """Which token id the processor writes per merged image patch, and the merger's patch side (every stage:
        the positions are computed from them)."""
        self.image_token_id = int(image_token_id)
        self.spatial_merge_size = int(spatial_merge_size)

    def attach_vision(self, vision: torch.nn.Module, patch_dim: int, deepstack_layers: int = 0) -> None:
        """The tower, the width of one pixel patch it takes (channels x temporal patch x patch^2), and how many
        decoder layers take its DeepStack features (Qwen3-VL: after each of the first ``deepstack_layers`` layers,
        the features of one tower block, through its own merger, are added at the image tokens).

        DeepStack is a residual add at given positions after given layers: a forward hook on each of those layers
        adds this micro-batch's residual (zeros but at the image tokens, split as the decoder's hidden states are:
        this CP rank's chunks, this TP rank's share under sequence parallelism), set by :meth:`image_embeddings`
        and dropped after the forward. The layers must be on this (the first) stage; a layer recomputed in the
        backward would not find its residual, so full activation recomputation is refused."""
        self.vision = vision
        self.patch_dim = int(patch_dim)
        self._deepstack: list[Optional[torch.Tensor]] = []
        if not deepstack_layers:
            return
        if self.config.recompute_granularity == "full":
            raise BridgeError(f"full activation recomputation with DeepStack (the vision features added after the "
                              f"first {deepstack_layers} decoder layers would be missing when a layer is "
                              "recomputed in the backward); use --recompute-granularity selective or none")
        held = {layer.layer_number - 1: layer for layer in self.decoder.layers}  # global 0-based indices
        missing = [k for k in range(deepstack_layers) if k not in held]
        if missing:
            raise BridgeError(f"DeepStack adds vision features after decoder layers 0..{deepstack_layers - 1}, but "
                              f"the first pipeline stage holds layers {sorted(held)}; use fewer pipeline stages")
        for k in range(deepstack_layers):
            held[k].register_forward_hook(self._deepstack_hook(k))

    def _deepstack_hook(self, k: int):
        def add_features(module, args, output):
            residual = self._deepstack[k] if k < len(self._deepstack) else None
            if residual is None:
                return output
            hidden, context = output
            return hidden + residual.to(hidden.dtype), context

        return add_features

    def image_embeddings(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
                         image_grid_thw: Optional[torch.Tensor], packed_seq_params=None) -> torch.Tensor:
        """The decoder's input on the first stage: token embeddings with the image features at the pad tokens,
        written on the whole sequence, then split as the decoder expects it (this CP rank's chunks of a packed
        batch, this TP rank's share under sequence parallelism)."""
        self._deepstack = []
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        pad_tokens = bool((input_ids == self.image_token_id).any())
        cp = self.pg_collection.cp.size() if self.pg_collection.cp is not None else 1
        if pixel_values is None and not pad_tokens and cp == 1:
            return embeddings
        if pad_tokens and (pixel_values is None or image_grid_thw is None):
            raise_missing_images(input_ids, self.image_token_id)
        group = self.embedding.tp_group
        if self.config.sequence_parallel:  # megatron's embedding reduce-scattered the sequence over TP: gather it
            # (every TP rank then holds the same whole embeddings, so the backward of the gather only splits)
            embeddings = tensor_parallel.gather_from_sequence_parallel_region(
                embeddings, tensor_parallel_output_grad=False, group=group)
        if pixel_values is not None and image_grid_thw is not None:
            check_image_tokens(input_ids, image_grid_thw, self.image_token_id, self.spatial_merge_size,
                               "micro-batch", pixel_rows=int(pixel_values.shape[0]),
                               pixel_shape=tuple(pixel_values.shape), patch_dim=self.patch_dim)
            out = self.vision(pixel_values.to(embeddings.dtype), grid_thw=image_grid_thw)
            embeddings = scatter_image_features(embeddings, input_ids, out.pooler_output, self.image_token_id,
                                                "micro-batch")
            # DeepStack: each layer's residual, zeros but at the image tokens, on the whole sequence as well
            self._deepstack = [scatter_image_features(torch.zeros_like(embeddings), input_ids, features,
                                                      self.image_token_id, "micro-batch")
                               for features in (getattr(out, "deepstack_features", None) or [])]

        def split(hidden: torch.Tensor) -> torch.Tensor:  # as the decoder takes its input
            if cp > 1:  # this rank's chunks of every sequence, after the features are in place
                cu = packed_cu_seqlens(packed_seq_params)
                index = cp_utils.cp_local_index(cu, self.pg_collection.cp.rank(), cp)
                hidden = hidden.index_select(0, index.to(hidden.device))
            if self.config.sequence_parallel:
                hidden = tensor_parallel.scatter_to_sequence_parallel_region(hidden, group=group)
            return hidden

        self._deepstack = [split(r) for r in self._deepstack]
        return split(embeddings)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                decoder_input: Optional[torch.Tensor] = None, *args: Any, pixel_values: Optional[torch.Tensor] = None,
                image_grid_thw: Optional[torch.Tensor] = None, packed_seq_params=None, **kwargs: Any):
        """megatron's ``GPTModel.forward`` plus the images. Under context parallelism (a packed THD batch only)
        ``input_ids`` and ``position_ids`` are the WHOLE packed batch, not this rank's share: the features are
        scattered first, then this rank's chunks taken (:meth:`image_embeddings`), and megatron's THD RoPE picks
        each chunk's frequencies from the whole batch's positions."""
        if position_ids is not None and position_ids.dim() == 2:  # text only: the three sections agree
            position_ids = position_ids[None].expand(3, -1, -1)
        cp = self.pg_collection.cp.size() if self.pg_collection.cp is not None else 1
        if cp > 1 and (packed_seq_params is None or packed_seq_params.qkv_format != "thd"):
            raise ConfigError("context parallelism with a vision-language model needs a packed (THD) batch: "
                              "the image features are written into the whole packed sequence before the CP split")
        if self.pre_process and decoder_input is None:
            decoder_input = self.image_embeddings(input_ids, pixel_values, image_grid_thw, packed_seq_params)
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._deepstack = []  # this micro-batch's DeepStack residuals: used by its forward only


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The global padded cu_seqlens of a THD batch (what the CP chunks are cut from)."""
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def raise_missing_images(input_ids: torch.Tensor, image_token_id: int) -> NoReturn:
    n = int((input_ids == image_token_id).sum())
    raise ConfigError(f"micro-batch: {n} image-pad tokens (id {image_token_id}) but no pixel_values / "
                      "image_grid_thw; pass the processor's image inputs with the tokens")
