"""A vision-language model in megatron-core: megatron's ``GPTModel`` with multimodal RoPE for the language
model, and the checkpoint's own HF vision tower and merger in front of it.

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
from megatron.core.models.gpt import GPTModel

from megatron_rl.errors import ConfigError
from megatron_rl.models import cp_utils
from megatron_rl.models.mrope import check_image_tokens, scatter_image_features


def build_vision_tower(vision_config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The HF vision tower + merger of a Qwen2.5-VL config (``vision_config``), on the current default device
    (``meta`` under the streaming converters' ``torch.device("meta")``)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf  # lazy: transformers (~seconds)
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    config = Qwen2_5_VLVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    return hf.Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)


class VisionLanguageGPTModel(GPTModel):
    """``GPTModel`` (``position_embedding_type="mrope"``) with a ``vision`` tower on the first stage, set by
    :meth:`attach_vision` after construction, and the image token facts on every stage (:meth:`set_image_tokens`)."""

    image_token_id: int = -1
    spatial_merge_size: int = 1

    def set_image_tokens(self, image_token_id: int, spatial_merge_size: int) -> None:
        """Which token id the processor writes per merged image patch, and the merger's patch side (every stage:
        the positions are computed from them)."""
        self.image_token_id = int(image_token_id)
        self.spatial_merge_size = int(spatial_merge_size)

    def attach_vision(self, vision: torch.nn.Module, patch_dim: int) -> None:
        """The tower, and the width of one pixel patch it takes (channels x temporal patch x patch^2)."""
        self.vision = vision
        self.patch_dim = int(patch_dim)

    def image_embeddings(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor],
                         image_grid_thw: Optional[torch.Tensor], packed_seq_params=None) -> torch.Tensor:
        """The decoder's input on the first stage: token embeddings with the image features at the pad tokens,
        written on the whole sequence, then split as the decoder expects it (this CP rank's chunks of a packed
        batch, this TP rank's share under sequence parallelism)."""
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
            features = self.vision(pixel_values.to(embeddings.dtype), grid_thw=image_grid_thw).pooler_output
            embeddings = scatter_image_features(embeddings, input_ids, features, self.image_token_id, "micro-batch")
        if cp > 1:  # this rank's chunks of every sequence, after the features are in place
            cu = packed_cu_seqlens(packed_seq_params)
            index = cp_utils.cp_local_index(cu, self.pg_collection.cp.rank(), cp)
            embeddings = embeddings.index_select(0, index.to(embeddings.device))
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=group)
        return embeddings

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
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args,
                               packed_seq_params=packed_seq_params, **kwargs)


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The global padded cu_seqlens of a THD batch (what the CP chunks are cut from)."""
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def raise_missing_images(input_ids: torch.Tensor, image_token_id: int) -> NoReturn:
    n = int((input_ids == image_token_id).sum())
    raise ConfigError(f"micro-batch: {n} image-pad tokens (id {image_token_id}) but no pixel_values / "
                      "image_grid_thw; pass the processor's image inputs with the tokens")
