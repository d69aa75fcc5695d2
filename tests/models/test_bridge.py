"""Bridges in one process: each family loads and matches HF logits; export round-trips
bit-exactly; unsupported configs and mismatched checkpoints are refused by name."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.errors import BridgeError, CheckpointError, ConfigError
from megatron_rl.models import get_bridge, weight_maps


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


def test_each_family_matches_hf_and_round_trips(single_rank, tiny_hf_models, family):
    import transformers

    path = tiny_hf_models(family)
    bridge = get_bridge(path)
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, path)
    model = chunks[0].eval()
    ids = torch.randint(0, bridge.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, torch.arange(13).expand(2, 13), attention_mask=None)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
    assert logits.shape[-1] == bridge.padded_vocab_size(1) and logits.shape[-1] % 128 == 0
    assert (logits[..., :bridge.vocab_size] - ref).abs().max().item() <= 1e-5
    exported = dict(bridge.export_hf_weights(chunks))
    original = load_file(os.path.join(path, "model.safetensors"))
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


def test_fused_maps_invert():
    q, k, v = torch.randn(8 * 4, 5), torch.randn(2 * 4, 5), torch.randn(2 * 4, 5)
    fused = weight_maps.fuse_qkv(q, k, v, num_query_groups=2)
    # group 0 = 4 query heads of dim 4... here 4 heads/group * 4 dims, then k, v
    assert torch.equal(fused[:16], q[:16]) and torch.equal(fused[16:20], k[:4]) and torch.equal(fused[20:24], v[:4])
    for a, b in zip(weight_maps.split_qkv(fused, 2, 4, 4), (q, k, v)):
        assert torch.equal(a, b)
    g, u = torch.randn(6, 3), torch.randn(6, 3)
    assert all(torch.equal(a, b) for a, b in zip(weight_maps.split_gate_up(weight_maps.fuse_gate_up(g, u)), (g, u)))
    assert weight_maps.padded_vocab_size(250, 2) == 256 and weight_maps.padded_vocab_size(257, 1) == 384


@pytest.mark.parametrize("overrides, needle", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope scaling type 'yarn'"),
    (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(mlp_bias=True), "mlp_bias=true"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_config_is_refused_with_a_list(tiny_hf_models, overrides, needle):
    from megatron_rl.models.hf_tiny import tiny_config

    family = "qwen3" if "attention_bias" in overrides or "use_sliding_window" in overrides else "llama"
    config = tiny_config(family, **overrides).to_dict()
    with pytest.raises(BridgeError, match="unsupported") as err:
        get_bridge(config)
    assert needle in str(err.value)


def test_unknown_model_type_names_supported_ones():
    with pytest.raises(BridgeError, match="deepseek_v3, deepseek_v32, gemma3_text, gemma4_text, glm4_moe, glm_moe_dsa, gpt_oss, kimi_k2, llama, minimax_m2, mixtral, qwen2, qwen2_5_vl, qwen3, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next"):
        get_bridge({"model_type": "gpt2"})


_DS_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 1.0, "mscale_all_dim": 0.8}


_GEMMA_YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("family, overrides, needle", [
    ("mixtral", dict(sliding_window=4096), "sliding_window=4096"),
    ("mixtral", dict(router_jitter_noise=0.01), "router_jitter_noise=0.01"),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5 (only full rotary)"),
    ("glm4_moe", dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=2"),
    ("glm4_moe", dict(n_group=2, topk_group=2), "topk_group=2 and num_experts_per_tok=2"),
    ("glm4_moe", dict(n_group=4, topk_group=1), "n_group=4 does not split n_routed_experts=4"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}),
     "partial_rotary_factor=0.3 (head_dim 16 x factor"),
    ("glm4_moe", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                       "partial_rotary_factor": 0.5}), "rope scaling type 'yarn'"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=false"),
    ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias=true"),
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=2"),
    ("deepseek_v3", dict(n_group=2, topk_group=2), "topk_group=2 and num_experts_per_tok=2"),
    ("deepseek_v3", dict(rope_parameters={**_DS_YARN, "truncate": False}), "yarn truncate=false"),
    ("deepseek_v3", dict(rope_parameters={**_DS_YARN, "attention_factor": 1.2}), "yarn attention_factor=1.2"),
    ("deepseek_v3", dict(rope_parameters={**_DS_YARN, "mscale": 0.0}), "yarn mscale_all_dim=0.8 without mscale"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "rope scaling type 'linear' (only default / yarn RoPE)"),
    ("gpt_oss", dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    ("gpt_oss", dict(attention_bias=False), "attention_bias=false"),
    ("gpt_oss", dict(sliding_window=None), "sliding_attention but no sliding_window"),
    ("gpt_oss", dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types ['chunked_attention']"),
    ("gpt_oss", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.2,
                                      "original_max_position_embeddings": 128}), "yarn attention_factor=1.2"),
    ("gpt_oss", dict(quantization_config={"quant_method": "mxfp4"}), "mxfp4"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3_text", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    ("gemma3_text", dict(sliding_window=None), "sliding_attention but no sliding_window"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": _GEMMA_YARN}), "rope scaling type 'yarn'"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": _GEMMA_YARN,
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "sliding_attention rope_type 'yarn'"),
    ("minimax_m2", dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
    ("minimax_m2", dict(router_jitter_noise=0.01), "router_jitter_noise=0.01"),
    ("minimax_m2", dict(qk_norm_type="per_head"), "qk_norm_type='per_head'"),
    ("minimax_m2", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("minimax_m2", dict(shared_intermediate_size=64), "shared_intermediate_size=64"),
    ("minimax_m2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                         "partial_rotary_factor": 0.5}), "rope scaling type 'yarn'"),
    ("gemma4_text", dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input=8 (per-layer embeddings"),
    ("gemma4_text", dict(num_kv_shared_layers=2), "num_kv_shared_layers=2"),
    ("gemma4_text", dict(attention_k_eq_v=True), "attention_k_eq_v=true"),
    ("gemma4_text", dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     "enable_moe_block=true"),
    ("gemma4_text", dict(global_head_dim=32), "per_layer_config[1].head_dim=32 (not 16)"),
    ("gemma4_text", dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    ("gemma4_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": _GEMMA_YARN}), "rope scaling type 'yarn'"),
    ("qwen3_next", dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types ['sliding_attention']"),
    ("deepseek_v32", dict(index_head_dim=4), "index_head_dim=4 < qk_rope_head_dim=8"),
    ("deepseek_v32", dict(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]), "mlp_layer_types=['sparse', 'dense'"),
    ("glm_moe_dsa", dict(index_topk_freq=2), "indexer_types with 1 'shared' layers (first: layer 2"),
    ("qwen3_next", dict(attention_bias=True), "attention_bias=true"),
    ("qwen3_next", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3_next", dict(linear_num_value_heads=3), "linear_num_value_heads=3 not a multiple of linear_num_key_heads=2"),
])
def test_moe_family_features_megatron_cannot_express_are_refused(family, overrides, needle):
    """Each refused by name in Bridge.unsupported(), never approximated."""
    from megatron_rl.models.hf_tiny import tiny_config

    with pytest.raises(BridgeError, match="unsupported") as err:
        get_bridge(tiny_config(family, **overrides).to_dict())
    assert needle in str(err.value)


def test_glm4_moe_maps_every_switch_to_megatron():
    """The tiny GLM config turns every switch on; the megatron config carries each of them."""
    from megatron_rl.models.hf_tiny import tiny_config
    from megatron_rl.models.parallel import ParallelLayout

    bridge = get_bridge(tiny_config("glm4_moe").to_dict())
    tc = bridge.transformer_config(ParallelLayout())
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_bias_update_rate) == (
        "sigmoid", True, 0.0)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor) == (2, 1, 1.5)
    assert tc.moe_shared_expert_intermediate_size == 32 and tc.moe_layer_freq == [0, 1, 1, 1]
    assert tc.add_qkv_bias and tc.qk_layernorm and not tc.add_bias_linear
    assert bridge.rotary_percent == 0.5
    one_group = get_bridge(tiny_config("glm4_moe", n_group=1, topk_group=1).to_dict())
    assert one_group.router_config()["moe_router_num_groups"] is None  # one group selects every expert
    mixtral = get_bridge(tiny_config("mixtral").to_dict()).transformer_config(ParallelLayout())
    assert (mixtral.moe_router_score_function, mixtral.moe_ffn_hidden_size, mixtral.moe_layer_freq) == (
        "softmax", 32, [1, 1, 1, 1])


def test_gpt_oss_maps_every_switch_to_megatron(single_rank, tiny_hf_models):
    """The tiny gpt-oss turns every switch on; the megatron config carries each, and megatron's YaRN
    equals HF's: cos/sin (HF scales them by attention_scaling; megatron scales q and k by the same
    concentration factor) within 1e-6, the factor itself exactly."""
    import torch.nn.functional as F
    import transformers
    from megatron.core.activations import quick_gelu
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config)

    from megatron_rl.models.yarn_config import YarnTransformerConfig

    path = tiny_hf_models("gpt_oss")
    bridge = get_bridge(path)
    tc = bridge.transformer_config(single_rank)
    assert isinstance(tc, YarnTransformerConfig) and bridge.position_embedding_type == "yarn"
    assert (tc.yarn_rotary_scaling_factor, tc.yarn_original_max_position_embeddings, tc.yarn_beta_fast,
            tc.yarn_beta_slow, tc.yarn_correction_range_round_to_int) == (4.0, 128, 32.0, 1.0, False)
    assert tc.window_size == (3, 0) and tc.window_attn_skip_freq == [1, 0, 1, 0] and tc.softmax_type == "learnable"
    assert tc.add_bias_linear and tc.add_qkv_bias and tc.activation_func is quick_gelu
    assert (tc.glu_linear_offset, tc.activation_func_clamp_value, tc.moe_router_pre_softmax) == (1.0, 1.0, False)
    assert tc.moe_layer_freq == [1, 1, 1, 1] and tc.moe_ffn_hidden_size == 32
    model = bridge.build_model(single_rank)[0]
    emb = model.rotary_pos_emb(40)[0].squeeze(1).squeeze(1)  # [40, head_dim]: the halves repeat
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.rotary_emb
    cos, sin = hf(torch.zeros(1), torch.arange(40)[None])
    mscale = _yarn_get_concentration_factor_from_config(tc)
    assert mscale == hf.attention_scaling and mscale > 1.1
    half = emb[:, :bridge.head_dim // 2]
    assert (half.cos() * mscale - cos[0]).abs().max().item() <= 1e-6
    assert (half.sin() * mscale - sin[0]).abs().max().item() <= 1e-6
    assert F.silu is not tc.activation_func
    from megatron_rl.models.parallel import ParallelLayout

    for layout in (ParallelLayout(tp=2), ParallelLayout(tp=2, etp=2)):  # ETP defaults to TP
        with pytest.raises(BridgeError, match="--expert-tensor-parallel-size 1"):
            bridge.transformer_config(layout)


def test_gemma3_text_maps_every_switch_to_megatron(single_rank):
    """The tiny gemma3_text turns every switch on; the megatron config and layer spec carry each."""
    import functools

    import torch.nn.functional as F

    from megatron_rl.models import gemma
    from megatron_rl.models.hf_tiny import tiny_config

    bridge = get_bridge(tiny_config("gemma3_text").to_dict())
    tc = bridge.transformer_config(single_rank)
    assert tc.softmax_scale == 24 ** -0.5 and tc.window_size == (3, 0) and tc.window_attn_skip_freq == [1, 0, 1, 0]
    assert isinstance(tc.activation_func, functools.partial) and tc.activation_func.func is F.gelu
    assert tc.activation_func.keywords == {"approximate": "tanh"} and tc.gated_linear_unit and tc.qk_layernorm
    assert bridge.tie_word_embeddings and bridge.rope_theta == 500.0
    layer = bridge.layer_spec(tc).submodules
    assert layer.self_attention.params["rope"] == {"sliding": (10000.0, None), "full": (500.0, 2.0)}
    assert layer.input_layernorm is gemma.GemmaRMSNorm and layer.pre_mlp_layernorm is gemma.GemmaRMSNorm
    assert layer.self_attn_bda.module is gemma.PostNormBiasDropoutAdd
    assert layer.mlp_bda.module is gemma.PostNormBiasDropoutAdd
    assert bridge.rule_for("decoder.layers.2.self_attn_bda.weight").hf_names == (
        "model.layers.2.post_attention_layernorm.weight",)
    assert bridge.rule_for("decoder.layers.2.pre_mlp_layernorm.weight").hf_names == (
        "model.layers.2.pre_feedforward_layernorm.weight",)
    # transformers' older spelling: rope_theta / rope_scaling for full layers, rope_local_base_freq for sliding
    legacy = {k: v for k, v in tiny_config("gemma3_text").to_dict().items() if k != "rope_parameters"}
    old = get_bridge({**legacy, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                      "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert old._layer_rope() == {"sliding": (1e4, None), "full": (1e6, 8.0)}
    # no layer_types: every sliding_window_pattern-th layer full, as transformers derives them; bases default
    import transformers

    bare = {k: v for k, v in legacy.items() if k not in ("layer_types", "_sliding_window_pattern")}
    for pattern in (2, 3):
        hf = transformers.Gemma3TextConfig(**bare, sliding_window_pattern=pattern)
        ours = get_bridge({**bare, "sliding_window_pattern": pattern})
        assert ours._layer_types == hf.layer_types and "full_attention" in hf.layer_types
        assert ours._layer_rope() == {kind: (hf.rope_parameters[f"{kind}_attention"]["rope_theta"], None)
                                      for kind in ("sliding", "full")} == {"sliding": (1e4, None), "full": (1e6, None)}


def test_qwen3_next_maps_every_switch_to_megatron(single_rank):
    """The tiny qwen3_next turns every switch on; the megatron config, the per-layer specs and the name map
    carry each; context parallelism is refused by name (the gated delta-net state is not handed over)."""
    import transformers

    from megatron_rl.models import gated_delta, gemma
    from megatron_rl.models.hf_tiny import tiny_config
    from megatron_rl.models.parallel import ParallelLayout

    bridge = get_bridge(tiny_config("qwen3_next").to_dict())
    tc = bridge.transformer_config(single_rank)
    assert tc.attention_output_gate and tc.moe_shared_expert_gate and tc.qk_layernorm
    assert tc.moe_shared_expert_intermediate_size == 48 and tc.moe_layer_freq == [0, 1, 1, 1]
    assert bridge.rotary_percent == 0.25 and tc.moe_router_score_function == "softmax"
    block = bridge.block_spec(tc).layer_specs
    assert [s.submodules.self_attention.module is gated_delta.PackedGatedDeltaNet for s in block] == [
        True, False, True, False]
    assert block[1].submodules.self_attention.submodules.q_layernorm is gemma.GemmaRMSNorm
    assert block[0].submodules.self_attention.params["gdn"] == (2, 4, 8, 12, 4)
    assert all(s.submodules.input_layernorm is gemma.GemmaRMSNorm for s in block)
    assert bridge.rule_for("decoder.layers.1.self_attention.linear_qkv.weight").kind == "qkv_gated"
    assert bridge.rule_for("decoder.layers.0.self_attention.conv_weight").hf_names == (
        "model.layers.0.linear_attn.conv1d.weight",)
    assert bridge.rule_for("decoder.layers.1.mlp.shared_experts.gate_weight").hf_names == (
        "model.layers.1.mlp.shared_expert_gate.weight",)
    with pytest.raises(BridgeError, match="--context-parallel-size 1"):
        bridge.transformer_config(ParallelLayout(cp=2))
    # no layer_types: every full_attention_interval-th layer full, as transformers derives them
    bare = {k: v for k, v in tiny_config("qwen3_next").to_dict().items() if k != "layer_types"}
    for interval in (2, 3):
        hf = transformers.Qwen3NextConfig(**{k: v for k, v in bare.items() if k not in ("model_type",
                                                                                       "transformers_version")},
                                          full_attention_interval=interval)
        assert get_bridge({**bare, "full_attention_interval": interval})._layer_types == hf.layer_types
    # Qwen3-Next-80B-A3B's config.json (transformers' defaults): no layer_types, partial_rotary_factor nor
    # rope_parameters; rope_theta at the top level
    hub = {k: v for k, v in transformers.Qwen3NextConfig().to_dict().items() if k not in ("layer_types",
                                                                                          "rope_parameters")}
    big = get_bridge({**hub, "rope_theta": 1e7, "full_attention_interval": 4})
    assert big.unsupported() == [] and big.rotary_percent == 0.25 and big.rope_theta == 1e7
    assert big._layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"] and big.shared_expert_size == 512
    assert big.gdn_dims == (16, 32, 128, 128, 4)


def test_qwen3_next_mtp_weights_are_skipped_as_transformers_does(single_rank, tiny_hf_models, tmp_path):
    """A Qwen3-Next checkpoint holds its multi-token-prediction module under mtp.*; the HF causal LM ignores
    it, so does the bridge (and the export leaves it out)."""
    path = tiny_hf_models("qwen3_next")
    bridge = get_bridge(path)
    chunks = bridge.build_model(single_rank)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mtp = _copy(path, tmp_path / "mtp")
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64)},
              os.path.join(mtp, "model.safetensors"))
    bridge.load_hf_weights(chunks, mtp)
    assert set(dict(bridge.export_hf_weights(chunks))) == set(tensors)


def test_qwen3_5_text_models_map_every_switch_to_megatron(single_rank):
    """Qwen3.5's text models: Qwen3-Next's hybrid layers with the delta-net's projections stored apart (rule kinds
    gdn_qkvz / gdn_ba onto PackedGatedDeltaNet's per-key-head in_proj_qkvz / in_proj_ba), a dense MLP in every
    layer (qwen3_5_text) or a MoE block with the gated shared expert in every layer (qwen3_5_moe_text); CP is
    refused by name; the hub config's defaults (multimodal RoPE sections) map."""
    import transformers

    from megatron_rl.models import gated_delta
    from megatron_rl.models.bridge import ParamRule
    from megatron_rl.models.hf_tiny import tiny_config
    from megatron_rl.models.parallel import ParallelLayout

    dense = get_bridge(tiny_config("qwen3_5_text").to_dict())
    tc = dense.transformer_config(single_rank)
    assert tc.attention_output_gate and tc.qk_layernorm and not tc.num_moe_experts and dense.rotary_percent == 0.25
    block = dense.block_spec(tc).layer_specs
    assert [s.submodules.self_attention.module is gated_delta.PackedGatedDeltaNet for s in block] == [
        True, False, True, False]
    p = "model.layers.2.linear_attn."
    assert dense.rule_for("decoder.layers.2.self_attention.in_proj_qkvz.weight") == ParamRule(
        "gdn_qkvz", (p + "in_proj_qkv.weight", p + "in_proj_z.weight"))
    assert dense.rule_for("decoder.layers.2.self_attention.in_proj_ba.weight") == ParamRule(
        "gdn_ba", (p + "in_proj_b.weight", p + "in_proj_a.weight"))
    assert dense.rule_for("decoder.layers.1.mlp.linear_fc1.weight").hf_names == (
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight")
    moe = get_bridge(tiny_config("qwen3_5_moe_text").to_dict())
    tc = moe.transformer_config(single_rank)
    assert tc.moe_layer_freq == [1, 1, 1, 1] and tc.moe_shared_expert_gate and not tc.moe_router_pre_softmax
    assert tc.moe_shared_expert_intermediate_size == 48 and tc.num_moe_experts == 4
    for bridge in (dense, moe):
        with pytest.raises(BridgeError, match="--context-parallel-size 1"):
            bridge.transformer_config(ParallelLayout(cp=2))
    # a gdn rule's pieces: HF's part-after-part tensors <-> megatron's per-key-head groups, inverse both ways
    dims = dense.gdn_dims
    qkv, z = torch.randn(2 * 2 * 8 + 4 * 12, 3), torch.randn(4 * 12, 3)
    fused = weight_maps.fuse_gdn("gdn_qkvz", [qkv, z], dims)
    assert torch.equal(fused[:8], qkv[:8]) and torch.equal(fused[40:64], z[:24])  # key head 0: q, k, 2 v, 2 z
    back = weight_maps.join_gdn("gdn_qkvz", weight_maps.split_gdn("gdn_qkvz", fused, 2, dims), dims)
    assert torch.equal(back[0], qkv) and torch.equal(back[1], z)
    # Qwen3.5's hub text configs (transformers' defaults, the multimodal RoPE sections, rope_theta 1e7)
    for cls in (transformers.Qwen3_5TextConfig, transformers.Qwen3_5MoeTextConfig):
        hub = cls().to_dict()
        hub["rope_parameters"] = {**hub["rope_parameters"], "rope_theta": 1e7, "mrope_section": [11, 11, 10],
                                  "mrope_interleaved": True}
        big = get_bridge(hub)
        assert big.unsupported() == [] and big.rotary_percent == 0.25 and big.rope_theta == 1e7
        assert big._layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


def test_multimodal_qwen3_5_checkpoint_is_refused_with_the_text_recipe(single_rank, tmp_path):
    """A multimodal Qwen3.5 checkpoint (model.language_model.*, model.visual.*) is refused by name with the fix;
    the fix (transformers' causal LM loads the text part; save_pretrained writes a qwen3_5_text checkpoint without
    the vision weights) gives a checkpoint the bridge loads."""
    import transformers

    from megatron_rl.models.hf_tiny import tiny_config

    text = tiny_config("qwen3_5_text").to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision)).save_pretrained(tmp_path / "mm")
    with pytest.raises(BridgeError, match=r"model_type='qwen3_5' is a multimodal checkpoint.*AutoModelForCausalLM") as err:
        get_bridge(tmp_path / "mm")
    # the recipe the message gives, run as written
    recipe = str(err.value).split("with transformers, ")[1].split(" (model_type")[0]
    exec(recipe, {"AutoModelForCausalLM": transformers.AutoModelForCausalLM, "dir": str(tmp_path / "mm"),
                  "text_dir": str(tmp_path / "text")})
    bridge = get_bridge(tmp_path / "text")
    assert bridge.family == "qwen3_5_text"
    assert not any("visual" in n for n in load_file(os.path.join(tmp_path / "text", "model.safetensors")))
    bridge.load_hf_weights(bridge.build_model(single_rank), tmp_path / "text")


def test_deepseek_v3_maps_every_switch_to_megatron():
    """The tiny DeepSeek-V3 config turns every switch on (MLA with a q latent, YaRN with both mscales,
    the GLM-style MoE); the megatron MLA config carries each of them."""
    from megatron.core.transformer import MLATransformerConfig

    from megatron_rl.models.hf_tiny import tiny_config
    from megatron_rl.models.parallel import ParallelLayout

    tc = get_bridge(tiny_config("deepseek_v3").to_dict()).transformer_config(ParallelLayout())
    assert isinstance(tc, MLATransformerConfig) and tc.multi_latent_attention and tc.qk_layernorm
    assert (tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim) == (32, 16, 16, 8, 12)
    assert (tc.rope_type, tc.rotary_scaling_factor, tc.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert (tc.mscale, tc.mscale_all_dim, tc.beta_fast, tc.beta_slow, tc.rotary_base) == (1.0, 0.8, 32.0, 1.0, 1e4)
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_bias_update_rate) == (
        "sigmoid", True, 0.0)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk, tc.moe_router_topk_scaling_factor) == (2, 1, 2.5)
    assert tc.moe_shared_expert_intermediate_size == 32 and tc.moe_layer_freq == [0, 1, 1, 1]
    plain = get_bridge(tiny_config("deepseek_v3", q_lora_rank=None,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}).to_dict())
    tc = plain.transformer_config(ParallelLayout())
    assert tc.q_lora_rank is None and (tc.rope_type, tc.rotary_scaling_factor, tc.mscale_all_dim) == ("rope", 1.0, 0.0)
    assert "model.layers.0.self_attn.q_proj.weight" in plain.hf_param_shapes()


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe", "deepseek_v3"])
def test_unmapped_hf_tensor_of_a_moe_family_is_refused_by_name(single_rank, tiny_hf_models, tmp_path, family):
    path = tiny_hf_models(family)
    bridge = get_bridge(path)
    chunks = bridge.build_model(single_rank)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    moe = "block_sparse_moe" if family == "mixtral" else "mlp"
    stray = f"model.layers.1.{moe}.experts.4.{'w1' if family == 'mixtral' else 'gate_proj'}.weight"  # 5th of 4
    extra = _copy(path, tmp_path / "extra")
    save_file({**tensors, stray: torch.zeros(32, 64)}, os.path.join(extra, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"map to no megatron parameter: \['" + re.escape(stray) + r"'\]"):
        bridge.load_hf_weights(chunks, extra)


def test_gpt_oss_stacked_experts_of_another_count_are_refused_by_name(single_rank, tiny_hf_models, tmp_path):
    """gpt-oss stacks a layer's experts in one tensor: a checkpoint stacking 5 where config.json says 4 is
    named with both shapes, not loaded as a prefix."""
    path = tiny_hf_models("gpt_oss")
    bridge = get_bridge(path)
    chunks = bridge.build_model(single_rank)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad = _copy(path, tmp_path / "five")
    save_file({**tensors, name: torch.zeros(5, 64, 64)}, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(f"{name}: checkpoint (5, 64, 64) vs config (4, 64, 64)")):
        bridge.load_hf_weights(chunks, bad)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_mtp_layers_are_skipped_as_transformers_does(single_rank, tiny_hf_models, tmp_path, family):
    """GLM-4.5 and DeepSeek-V3 checkpoints hold num_nextn_predict_layers MTP layers after the decoder;
    the HF causal LM ignores them, so does the bridge. A layer beyond those is still refused."""
    path = tiny_hf_models(family)
    bridge = get_bridge(path)
    assert bridge.cfg("num_nextn_predict_layers") == 1
    chunks = bridge.build_model(single_rank)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mtp = _copy(path, tmp_path / "mtp")
    save_file({**tensors, "model.layers.4.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.4.mlp.gate.e_score_correction_bias": torch.zeros(4)},
              os.path.join(mtp, "model.safetensors"))
    bridge.load_hf_weights(chunks, mtp)
    assert set(dict(bridge.export_hf_weights(chunks))) == set(tensors)
    beyond = _copy(path, tmp_path / "beyond")
    save_file({**tensors, "model.layers.5.eh_proj.weight": torch.zeros(64, 128)},
              os.path.join(beyond, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.5\.eh_proj\.weight"):
        bridge.load_hf_weights(chunks, beyond)


def test_kimi_k2_config_is_read_as_deepseek_v3(single_rank, tiny_hf_models, tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2 (with auto_map to DeepSeek-V3's remote code, which
    transformers has no class for): the bridge, the meta model and the HF model all read it as
    deepseek_v3, so the megatron model loads it and HF gives the same logits from it."""
    from megatron_rl.models.hf_module import meta_model
    from megatron_rl.models.parity import load_hf_model

    path = tiny_hf_models("deepseek_v3")
    kimi = _copy(path, tmp_path / "kimi")
    with open(os.path.join(kimi, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    with open(os.path.join(kimi, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    bridge = get_bridge(kimi)
    assert bridge.family == "deepseek_v3" and not bridge.unsupported()
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, kimi)
    assert set(dict(bridge.export_hf_weights(chunks))) == set(load_file(os.path.join(path, "model.safetensors")))
    assert {n for n, _ in meta_model(kimi).named_parameters()} == {n for n, _ in meta_model(path).named_parameters()}
    ids = torch.arange(12).unsqueeze(0)
    assert torch.equal(load_hf_model(kimi)(ids).logits, load_hf_model(path)(ids).logits)


def _copy(path, dst):
    shutil.copytree(path, dst)
    return str(dst)


def test_checkpoint_with_extra_or_missing_tensor_is_refused(single_rank, tiny_hf_models, tmp_path):
    path = tiny_hf_models("qwen2")
    bridge = get_bridge(path)
    chunks = bridge.build_model(single_rank)
    tensors = load_file(os.path.join(path, "model.safetensors"))

    extra = _copy(path, tmp_path / "extra")
    save_file({**tensors, "model.layers.0.mlp.surprise.weight": torch.zeros(2)},
              os.path.join(extra, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.surprise\.weight"):
        bridge.load_hf_weights(chunks, extra)

    missing = _copy(path, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.self_attn.k_proj.bias"},
              os.path.join(missing, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: \['model\.layers\.3\.self_attn\.k_proj\.bias'\]"):
        bridge.load_hf_weights(chunks, missing)

    wrong = _copy(path, tmp_path / "wrong")
    save_file({**tensors, "model.norm.weight": torch.ones(32)}, os.path.join(wrong, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: checkpoint \(32,\) vs config \(64,\)"):
        bridge.load_hf_weights(chunks, wrong)


def test_sharded_checkpoint_with_index_loads(single_rank, tiny_hf_models, tmp_path):
    path = tiny_hf_models("llama")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    shard_dir = _copy(path, tmp_path / "sharded")
    os.remove(os.path.join(shard_dir, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(shard_dir, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    bridge = get_bridge(shard_dir)
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, shard_dir)
    exported = dict(bridge.export_hf_weights(chunks))
    assert all(torch.equal(exported[n], tensors[n]) for n in names)


def test_impossible_layout_refused_before_any_collective():
    from megatron_rl.models.parallel import ParallelLayout

    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        ParallelLayout(tp=3).validate(world_size=4)
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        ParallelLayout(sequence_parallel=True).validate(world_size=1)
    with pytest.raises(ConfigError, match="num_hidden_layers=4"):
        ParallelLayout(pp=2, vpp=4).validate(world_size=2, num_layers=4)
    assert ParallelLayout(tp=2, pp=2).data_parallel_size(8) == 2
