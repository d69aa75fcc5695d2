"""Tiny HF models with random weights, built locally.

There is no model hub on CI machines, so tests, the CPU demo and the benchmarks
build small models from a ``transformers`` config and ``save_pretrained`` them.
Only ``transformers`` is imported here (no megatron-core), so this is cheap.

The defaults are chosen so every parallel layout we test divides them: 4 query
heads and 2 KV groups (TP 1/2), 4 layers (PP 2, VPP 2), 4 experts (EP 2/4), and
a vocab that is *not* a multiple of 128 so vocab padding is exercised. Each family
turns on every architecture switch its bridge maps (glm4_moe: dense first layer,
shared expert, grouped sigmoid router with a selection bias, partial RoPE, ...).
"""

from __future__ import annotations

import os
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss", "gemma3_text",
            "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "minimax_m2",
            "gemma4_text", "deepseek_v32", "glm_moe_dsa")

_COMMON: dict[str, Any] = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    dtype="float32",
)

# the sigmoid-router MoE switches glm4_moe and deepseek_v3 share: 1 dense layer then MoE, a shared expert,
# 2 expert groups (top-1 group of 2 experts)
_SIGMOID_MOE: dict[str, Any] = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                                    norm_topk_prob=True, output_router_logits=False)
# DeepSeek Sparse Attention's families (deepseek_v32, glm_moe_dsa): MLA with a q latent, the sigmoid-router MoE and
# the lightning indexer (8 heads of 16 channels, top-4 keys: shorter than the test sequences, so attention is
# sparse); each adds its own RoPE
_DSA: dict[str, Any] = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    **_SIGMOID_MOE, routed_scaling_factor=2.5, attention_bias=False, index_n_heads=8, index_head_dim=16, index_topk=4,
    bos_token_id=None,  # transformers' defaults (0, 1) lie inside the tiny vocab: HF's generate would stop there
    eos_token_id=None)

_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=10000.0, attention_bias=False, mlp_bias=False),
    "qwen2": dict(rope_theta=10000.0),
    "qwen3": dict(rope_theta=10000.0, head_dim=16, attention_bias=False),
    "qwen3_moe": dict(
        rope_theta=10000.0,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    ),
    # every layer MoE; the experts' size is intermediate_size
    "mixtral": dict(rope_theta=10000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    output_router_logits=False, router_aux_loss_coef=0.0, sliding_window=None),
    # every switch on: 1 dense layer then MoE, a shared expert, 2 expert groups (top-1 group of 2
    # experts), q/k norm, half-rotary RoPE, q/k/v bias, a routed scaling factor != 1
    "glm4_moe": dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        **_SIGMOID_MOE,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # every switch on: MLA with a q latent (q_lora_rank), value heads (12) narrower than query/key
    # heads (16 no-RoPE + 8 RoPE), YaRN with both mscales (cos/sin and softmax scale change), then
    # the glm4_moe MoE switches (dense first layer, shared expert, 2 groups, biased sigmoid router)
    "deepseek_v3": dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 0.8},
        rope_interleave=True,
        **_SIGMOID_MOE,
        routed_scaling_factor=2.5,
        attention_bias=False,
    ),
    # DeepSeek-V3's switches (MLA with a q latent, YaRN with both mscales, the sigmoid-router MoE) plus the
    # lightning indexer: 8 heads of 16 channels (8 rotated, 8 not), top-4 keys (shorter than the test
    # sequences, so attention is sparse)
    "deepseek_v32": dict(
        **_DSA,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 0.8},
    ),
    # GLM-5: DeepSeek-V3.2's switches with default RoPE (GLM-5's) and the indexer's RoPE on interleaved pairs;
    # every layer runs its indexer (cross-layer top-k sharing is refused)
    "glm_moe_dsa": dict(**_DSA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # every switch on: every layer MoE (experts of intermediate_size) with a sigmoid router and a random
    # selection bias, q/k norms over all heads of a token, half-rotary RoPE; token ids inside the vocab
    "minimax_m2": dict(
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # every switch on: layers alternating a 4-key sliding window (shorter than the test sequences) and
    # full attention, random per-head sinks, YaRN (factor 4, truncate false: cos/sin and the q/k scale
    # change), q/k/v/o biases, biased router and experts, and a SwiGLU clamp (swiglu_limit) low enough
    # that random activations reach it
    "gpt_oss": dict(
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
        attention_bias=True,
        swiglu_limit=1.0,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    ),
    # every switch on: layers alternating a 4-key sliding window and full attention, each layer type with
    # its own RoPE (sliding: base 10000; full: base 500 with linear scaling 2), a softmax scale from
    # query_pre_attn_scalar (24, not head_dim), final logit soft-capping, tied embeddings (scaled by
    # sqrt(hidden)), four zero-centred norms per layer and q/k norms, GeGLU (tanh GELU)
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    # every switch the bridge maps on: Gemma 3's (alternating 4-key sliding window / full layers, each layer type with
    # its own RoPE, final soft-capping, tied scaled embeddings, four norms per layer, q/k norms, tanh GeGLU) with
    # plain-gain norms, the value norm, softmax scale 1, proportional RoPE on the full layers (half the frequencies,
    # base 500) and random layer scalars; the switches the bridge refuses off (per-layer embeddings, shared
    # KV, k = v, the MoE block, a wider full-layer head: global_head_dim = head_dim)
    "gemma4_text": dict(
        head_dim=16,
        global_head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 500.0,
                                            "partial_rotary_factor": 0.5}},
        final_logit_softcapping=5.0,
        hidden_activation="gelu_pytorch_tanh",
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        attention_k_eq_v=False,
        enable_moe_block=False,
        tie_word_embeddings=True,
    ),
    # every switch on: gated delta-net layers (2 key heads of 8 dims, 4 value heads of 12: 2 value heads per
    # key head) then gated full attention with q/k norms and partial RoPE (0.25 of the 16 dims), alternating;
    # a dense first layer, then MoE with a shared expert and its sigmoid gate; zero-centred norms
    "qwen3_next": dict(
        head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    ),
}
# Qwen3.5's text models: Qwen3-Next's hybrid layers (the delta-net's projections stored apart), the multimodal
# RoPE sections (a text model's positions make them plain partial RoPE); dense: an MLP in every layer; MoE: a
# MoE block in every layer with the gated shared expert
_QWEN3_5_HYBRID = {k: v for k, v in _FAMILY_DEFAULTS["qwen3_next"].items()
                   if k in ("head_dim", "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")}
_QWEN3_5_HYBRID["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                      "mrope_section": [1, 1, 0], "mrope_interleaved": True}
_FAMILY_DEFAULTS["qwen3_5_text"] = dict(_QWEN3_5_HYBRID)
_FAMILY_DEFAULTS["qwen3_5_moe_text"] = dict(_QWEN3_5_HYBRID, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                            output_router_logits=False, router_aux_loss_coef=0.0)
# vision-language families: a config with text_config / vision_config, saved as the hub does (LM under model.*,
# the vision tower under visual.*); kept apart from FAMILIES, whose text-only tests (weight sync, the memory
# planner, ...) do not apply to them yet (docs/vlm.md)
VL_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# every switch on: a Qwen2 language model (q/k/v bias) with M-RoPE sections [2, 3, 3] of head_dim 16; a 2-block
# vision tower (patch 2, temporal patch 2) with windowed attention in block 0 (window 8 pixels: 2x2 merged
# patches) and full attention in block 1, a 2x2 merger into the text hidden size; image/video/vision-start/end
# token ids inside the vocab
_VL_TEXT: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
    # Qwen3 attention (q/k RMSNorm, no bias), interleaved M-RoPE sections [2, 3, 3] of head_dim 16
    "qwen3_vl": dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
}
# Qwen3-VL-MoE: the same with 4 experts (top-2) of width 24 in every layer (2 x 24 != hidden 64, so the checkpoint's
# stacked expert tensors are not square and their layout is unambiguous)
_VL_TEXT["qwen3_vl_moe"] = dict(_VL_TEXT["qwen3_vl"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                output_router_logits=False, router_aux_loss_coef=0.0)
_VL_VISION: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, window_size=8,
                       fullatt_block_indexes=[1], tokens_per_second=2),
    # 3 blocks, DeepStack features taken after blocks 0 and 1 (added after decoder layers 0 and 1), a 4x4 learned
    # position grid (bilinearly resampled to each image's grid)
    "qwen3_vl": dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                     deepstack_visual_indexes=[0, 1]),
}
_VL_VISION["qwen3_vl_moe"] = dict(_VL_VISION["qwen3_vl"])
VL_TOKENS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243),
    "qwen3_vl": dict(image_token_id=240, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243),
}
VL_TOKENS["qwen3_vl_moe"] = dict(VL_TOKENS["qwen3_vl"])
# the image processor a tiny VL model's directory holds (preprocessor_config.json, as a hub checkpoint's): the
# tower's patch / temporal patch / merge sizes, and pixel bounds that keep an image between one merged token
# (4x4 pixels) and 16 (16x16 pixels), so test prompts stay short
VL_IMAGE_PROCESSOR: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(patch_size=2, temporal_patch_size=2, merge_size=2,
                       size={"shortest_edge": 4 * 4, "longest_edge": 16 * 16}),
    "qwen3_vl": dict(patch_size=2, temporal_patch_size=2, merge_size=2,
                     size={"shortest_edge": 4 * 4, "longest_edge": 16 * 16}),
}
VL_IMAGE_PROCESSOR["qwen3_vl_moe"] = dict(VL_IMAGE_PROCESSOR["qwen3_vl"])
_ZERO_CENTRED = ("gemma3_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


# the hybrid qwen3_next amplifies fp32 rounding more than the others: at 0.08 HF's own fp32 logits differ from
# its fp64 ones by ~5e-6 (half the parity tolerance), at 0.05 by ~1.5e-6
_MATRIX_STD = {"qwen3_next": 0.05, "qwen3_5_text": 0.05, "qwen3_5_moe_text": 0.05}
# Gemma 4 attends with softmax scale 1 on RMS-normalised q and k: q/k gains around 1 give attention logits up to the
# head dim, and the sharp softmax makes HF's own fp32 logits differ from its fp64 ones by ~1.1e-5 (above the parity
# tolerance); gains around 0.5 by ~2e-6
_QK_GAIN = {"gemma4_text": (0.4, 0.6)}


def tiny_config(family: str, **overrides: Any):
    """Return a ``transformers`` config object for a tiny model of ``family``."""
    import transformers

    if family in VL_FAMILIES:
        return _vl_config(family, **overrides)
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES + VL_FAMILIES)}")
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "glm4_moe": transformers.Glm4MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
        "gpt_oss": transformers.GptOssConfig,
        "gemma3_text": transformers.Gemma3TextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_text": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig,
        "minimax_m2": transformers.MiniMaxM2Config,
        "deepseek_v32": transformers.DeepseekV32Config,
        "glm_moe_dsa": transformers.GlmMoeDsaConfig,
        "gemma4_text": transformers.Gemma4TextConfig,
    }[family]
    kwargs = {**_COMMON, **_FAMILY_DEFAULTS[family], **overrides}
    return cls(**kwargs)


def _vl_config(family: str, **overrides: Any):
    """A vision-language config: the text model's fields (``_COMMON`` and the family's) under ``text_config``,
    the tower under ``vision_config``; ``overrides`` go to the text config, ``vision_config=`` to the tower, the
    vision token ids (``VL_TOKENS``' keys: a smaller vocab needs them lower) to the config itself."""
    import transformers

    tokens = {**VL_TOKENS[family], **{k: overrides.pop(k) for k in list(overrides) if k in VL_TOKENS[family]}}
    vision = {**_VL_VISION[family], **overrides.pop("vision_config", {})}
    text = {k: v for k, v in {**_COMMON, **_VL_TEXT[family], **overrides}.items() if k != "dtype"}
    text.update(bos_token_id=None, eos_token_id=None)  # transformers' defaults (151643, ...) lie outside the tiny vocab
    tie = text.pop("tie_word_embeddings")
    cls = {"qwen2_5_vl": transformers.Qwen2_5_VLConfig, "qwen3_vl": transformers.Qwen3VLConfig,
           "qwen3_vl_moe": transformers.Qwen3VLMoeConfig}[family]
    return cls(text_config=text, vision_config=vision, tie_word_embeddings=tie, **tokens)


def _model_class(family: str):
    """The transformers class a tiny model of ``family`` is built and loaded with."""
    import transformers

    if family in VL_FAMILIES:
        return {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
                "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
                "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration}[family]
    return transformers.AutoModelForCausalLM


def build_tiny_hf_model(family: str, path: str | os.PathLike, seed: int = 0, mtp: bool = False,
                        **overrides: Any) -> str:
    """Create a random-weight tiny HF model of ``family`` and save it to ``path``.

    Returns ``path`` as a string. Weights are written as safetensors with a
    ``config.json`` beside them, exactly as a hub checkpoint would be.

    ``mtp`` (glm4_moe, deepseek_v3): also write the ``num_nextn_predict_layers`` multi-token-prediction
    layers after the decoder, as DeepSeek-V3 / GLM-4.5 checkpoints hold them (transformers builds no
    MTP module, so the model is built with those extra decoder layers, which become the MTP layers'
    own, plus random ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm`` and copies of the
    embedding and output head).
    """
    import torch
    import transformers

    config = tiny_config(family, **overrides)
    depths = int(getattr(config, "num_nextn_predict_layers", 0) or 0) if mtp else 0
    if mtp and not depths:
        raise ValueError(f"mtp=True needs a {family} config with num_nextn_predict_layers > 0")
    if depths:
        main_layers = config.num_hidden_layers
        config.num_hidden_layers = main_layers + depths
    torch.manual_seed(seed)
    cls = _model_class(family)
    build = cls.from_config if cls is transformers.AutoModelForCausalLM else cls._from_config
    model = build(config, dtype=torch.float32)
    _randomize(model, family)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if family in VL_FAMILIES:
        _save_image_processor(family, str(path))
    if family == "qwen3_vl_moe":
        _hub_expert_layout(str(path))
    if depths:
        _add_mtp_tensors(str(path), main_layers, depths, config.hidden_size)
    return str(path)


def _hub_expert_layout(path: str) -> None:
    """Qwen3-VL-MoE's stacked experts as the hub checkpoints hold them: transformers keeps ``gate_up_proj``
    ``[E, 2f, h]`` and ``down_proj`` ``[E, h, f]`` in memory and saves them so, while the hub's (what it transposes
    on load) are ``[E, h, 2f]`` and ``[E, f, h]``."""
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})


def _save_image_processor(family: str, path: str) -> None:
    """Write the model's own image processor config (``preprocessor_config.json``) beside its weights, as hub VL
    checkpoints carry it: the data path loads it with ``AutoImageProcessor`` (data/images.py). The PIL backend's
    class: it needs no torchvision, and saves the same config as the torchvision one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(**VL_IMAGE_PROCESSOR[family]).save_pretrained(path)


def build_tiny_vl_processor_dir(family: str, path: str | os.PathLike) -> str:
    """A weightless tiny VL directory: ``config.json`` and the image processor's config, all the prompt data path
    reads (data/images.py); cheaper than ``build_tiny_hf_model`` for tests that never load the model."""
    if family not in VL_FAMILIES:
        raise ValueError(f"{family!r} is not a vision-language family; choose one of {', '.join(VL_FAMILIES)}")
    os.makedirs(path, exist_ok=True)
    tiny_config(family).save_pretrained(str(path))
    _save_image_processor(family, str(path))
    return str(path)


def _randomize(model, family: str) -> None:
    """Random weights of a tiny test model, in place. HF initialises with std=initializer_range (0.02): logits are
    then nearly uniform and parity tests would compare near-constants. A wider init makes every layer matter to the
    output."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, _MATRIX_STD.get(family, 0.08))
            elif name.endswith(("q_norm.weight", "k_norm.weight")) and family in _QK_GAIN:
                p.uniform_(*_QK_GAIN[family])
            elif "norm" in name and family in _ZERO_CENTRED and not name.endswith("linear_attn.norm.weight"):
                p.uniform_(-0.2, 0.2)  # zero-centred gains: the norm scales by 1 + w
            elif name.endswith(("A_log", "dt_bias")):  # gated delta-net decay: keep HF's init (exp(g) in (0, 1))
                continue
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("sinks"):  # gpt-oss: sink logits of the order of the attention scores
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a zero selection bias would not test its mapping
                b.normal_(0.0, 0.05)
            elif name.endswith("layer_scalar"):  # Gemma 4: each layer's output scale (1 would not test it)
                b.uniform_(0.5, 1.5)


def build_tiny_reward_model(family: str, path: str | os.PathLike, seed: int = 0, pad_token_id: int | None = 0,
                            **overrides: Any) -> str:
    """A random-weight tiny ``AutoModelForSequenceClassification`` of ``family`` with one label (a reward model's
    shape: ``--reward-model-path``), saved to ``path`` as a hub RM would be. ``pad_token_id`` None: HF then scores
    one unpadded sequence per forward."""
    import torch
    import transformers

    config = tiny_config(family, num_labels=1, pad_token_id=pad_token_id, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, family)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _add_mtp_tensors(path: str, main_layers: int, depths: int, hidden: int) -> None:
    """Turn the last ``depths`` saved decoder layers into MTP layers: config.json says ``main_layers``, and
    each MTP layer gets its norms, ``eh_proj`` and copies of the embedding and head."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(1234)
    for d in range(depths):
        p = f"model.layers.{main_layers + d}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{p}{norm}.weight"] = torch.rand(hidden, generator=gen) * 0.4 + 0.8
        tensors[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.08
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[p + "shared_head.head.weight"] = tensors.get("lm_head.weight",
                                                             tensors["model.embed_tokens.weight"]).clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = main_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
