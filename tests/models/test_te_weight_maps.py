"""HF <-> megatron name/shape maps for both layer specs (local and transformer-engine).

TE is not installed here, so the TE side is checked as a pure name/shape map: the
input norm lives in ``linear_qkv.layer_norm_weight``, the dense pre-MLP norm in
``mlp.linear_fc1.layer_norm_weight`` (MoE layers keep ``pre_mlp_layernorm``), and
``_extra_state`` entries map to nothing. The local side of the same enumeration is
checked against a really built model, so the shared part is not self-referential.
"""

import pytest
import torch

from megatron_rl.errors import BridgeError
from megatron_rl.models import get_bridge, weight_maps
from megatron_rl.models.hf_tiny import FAMILIES, tiny_config
from megatron_rl.models.weights import _split_shard, canonical_parameters

FLAVOURS = tuple(weight_maps.LAYER_SPEC_NAMES)
# dense and MoE layers in one model, and a tied-embedding model
CONFIGS = [(f, {}) for f in FAMILIES] + [("qwen3_moe", {"mlp_only_layers": [1]}),
                                         ("qwen2", {"tie_word_embeddings": True}),
                                         ("deepseek_v3", {"q_lora_rank": None})]
IDS = [f + "".join(f"-{k}" for k in o) for f, o in CONFIGS]
LOCAL_ONLY = {"deepseek_v32", "glm_moe_dsa", "gemma3_text", "gemma4_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}  # post-norms, zero-centred gains: megatron's local spec only
MLA = {"deepseek_v3"}  # multi-latent attention: TE keeps input_layernorm, fuses the q/kv latent norms
GQA_CONFIGS = [c for c in CONFIGS if c[0] not in MLA | LOCAL_ONLY]
MLA_CONFIGS = [c for c in CONFIGS if c[0] in MLA]


# the checkpoint's MTP layer as megatron's MTP block (--mtp-num-layers 1): name maps and the built model
MTP_CONFIGS = [("glm4_moe", {"mtp_num_layers": 1}), ("deepseek_v3", {"mtp_num_layers": 1})]


def _bridge(family, overrides):
    overrides = dict(overrides)
    mtp = overrides.pop("mtp_num_layers", 0)
    return get_bridge(tiny_config(family, **overrides), mtp_num_layers=mtp)


def _fuse(bridge, kind, tensors, padded_rows, expert=None):
    """HF tensors -> one full megatron tensor (TP1), as the loaders build it."""
    if kind in weight_maps.EXPERT_KINDS:  # one expert's slice of a stacked HF tensor (gpt-oss)
        return weight_maps.expert_to_megatron(kind, tensors[0][expert])
    if kind == "vocab":
        return weight_maps.pad_vocab(tensors[0], padded_rows)
    if kind == "qkv":
        return weight_maps.fuse_qkv(*tensors, bridge.num_query_groups)
    if kind == "gate_up":
        return weight_maps.fuse_gate_up(*tensors)
    if kind == "qkv_gated":
        return weight_maps.fuse_gated_qkv(*tensors, bridge.num_query_groups, bridge.head_dim)
    if kind in weight_maps.GDN_KINDS:  # each part head after head -> per key-head group
        return weight_maps.fuse_gdn(kind, list(tensors), bridge.gdn_dims)
    (t,) = tensors
    return t


def _unfuse(bridge, kind, tensor):
    if kind in weight_maps.EXPERT_KINDS:
        return [weight_maps.megatron_to_expert(kind, tensor)]
    if kind == "vocab":
        return [weight_maps.unpad_vocab(tensor, bridge.vocab_size)]
    if kind in weight_maps.GDN_KINDS:
        return weight_maps.join_gdn(kind, _split_shard(bridge, kind, tensor, tp_size=1), bridge.gdn_dims)
    return _split_shard(bridge, kind, tensor, tp_size=1)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("family,overrides", CONFIGS + MTP_CONFIGS, ids=IDS + [f"{f}-mtp" for f, _ in MTP_CONFIGS])
def test_name_and_shape_maps_round_trip(family, overrides, flavour):
    bridge = _bridge(family, overrides)
    if family in LOCAL_ONLY and flavour != "local":
        for refused in (lambda: bridge.megatron_param_shapes(flavour),
                        lambda: bridge.rule_for("decoder.layers.0.mlp.linear_fc1.layer_norm_weight")):
            with pytest.raises(BridgeError, match="local layer spec only"):
                refused()
        return
    meg = bridge.megatron_param_shapes(flavour)
    hf = bridge.hf_param_shapes()
    g = torch.Generator().manual_seed(0)
    hf_values = {n: torch.randn(s, generator=g) for n, s in hf.items()}
    exported: list[str] = []
    for name, shape in meg.items():  # megatron -> HF, values through the real fuse/split transforms
        rule = bridge.rule_for(name)
        assert set(rule.hf_names) <= set(hf), (name, rule.hf_names)
        full = _fuse(bridge, rule.kind, [hf_values[n] for n in rule.hf_names], shape[0], rule.expert)
        assert tuple(full.shape) == shape, name
        for hf_name, back in zip(rule.hf_names, _unfuse(bridge, rule.kind, full)):
            want = hf_values[hf_name] if rule.expert is None else hf_values[hf_name][rule.expert]
            assert torch.equal(back, want), (name, hf_name)
        exported += bridge.exported_names(name)
    # a stacked HF tensor (gpt-oss experts) is exported as one piece per expert, each exactly once
    pieces = [p for p in map(weight_maps.split_expert_piece_name, exported) if p is not None]
    assert len(set(pieces)) == len(pieces)
    stacked = {n for n, _ in pieces}
    assert all(sorted(e for n, e in pieces if n == s) == list(range(bridge.num_experts)) for s in stacked)
    exported = [n for n in exported if weight_maps.split_expert_piece_name(n) is None] + sorted(stacked)
    # an MTP layer's copies of the embedding / head are written from the main tensors (weights.with_mtp_copies)
    copies = set(bridge.mtp_aliases())
    assert all(main in exported for main in bridge.mtp_aliases().values())
    wanted = set(hf) - bridge.ignorable_hf_names() - copies
    assert sorted(exported) == sorted(wanted)  # every HF tensor exported exactly once
    inverse = bridge.hf_to_megatron(flavour)  # HF -> megatron
    assert set(inverse) == set(hf) - copies
    for hf_name, targets in inverse.items():
        assert targets and all(t in meg and hf_name in bridge.rule_for(t).hf_names for t in targets)


@pytest.mark.parametrize("family,overrides", GQA_CONFIGS, ids=[i for i, c in zip(IDS, CONFIGS) if c in GQA_CONFIGS])
def test_te_names_hold_the_fused_norms(family, overrides):
    bridge = _bridge(family, overrides)
    te, local = bridge.megatron_param_shapes("transformer_engine"), bridge.megatron_param_shapes("local")
    inverse = bridge.hf_to_megatron("transformer_engine")
    assert len(te) == len(local)
    for i in range(bridge.num_layers):
        p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        assert f"{p}input_layernorm.weight" not in te
        assert inverse[hp + "input_layernorm.weight"] == (f"{p}self_attention.linear_qkv.layer_norm_weight",)
        pre_mlp = "pre_mlp_layernorm.weight" if bridge.is_moe_layer(i) else "mlp.linear_fc1.layer_norm_weight"
        assert inverse[hp + "post_attention_layernorm.weight"] == (p + pre_mlp,)
        assert bridge.rule_for(p + "mlp.linear_fc1.layer_norm_weight").hf_names == (
            hp + "post_attention_layernorm.weight",)
    extra = ["decoder.layers.0.self_attention.linear_qkv._extra_state",
             "decoder.layers.0.self_attention.core_attention._extra_state",
             "decoder.layers.0.mlp.linear_fc1._extra_state", "output_layer._extra_state"]
    assert all(weight_maps.is_extra_state(n) and bridge.exported_names(n) == () for n in extra)
    assert not any(weight_maps.is_extra_state(n) for n in te)
    with pytest.raises(BridgeError, match="layer_norm_bias"):
        bridge.rule_for("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias")


@pytest.mark.parametrize("family,overrides", MLA_CONFIGS, ids=[i for i, c in zip(IDS, CONFIGS) if c in MLA_CONFIGS])
def test_te_mla_names_hold_the_fused_latent_norms(family, overrides):
    """megatron's TE MLA spec: a separate ``input_layernorm`` (TENorm; the q down-projection is a
    plain TELinear), the q / kv latent norms fused into ``linear_q_up_proj`` / ``linear_kv_up_proj``."""
    bridge = _bridge(family, overrides)
    te, local = bridge.megatron_param_shapes("transformer_engine"), bridge.megatron_param_shapes("local")
    inverse = bridge.hf_to_megatron("transformer_engine")
    assert len(te) == len(local)
    q_latent = overrides.get("q_lora_rank", True) is not None
    for i in range(bridge.num_layers):
        p, hp = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
        assert inverse[f"model.layers.{i}.input_layernorm.weight"] == (f"{p}input_layernorm.weight",)
        assert inverse[hp + "kv_a_layernorm.weight"] == (f"{p}self_attention.linear_kv_up_proj.layer_norm_weight",)
        assert f"{p}self_attention.kv_layernorm.weight" in local and f"{p}self_attention.linear_qkv.weight" not in te
        if q_latent:
            assert inverse[hp + "q_a_layernorm.weight"] == (f"{p}self_attention.linear_q_up_proj.layer_norm_weight",)
        else:
            assert inverse[hp + "q_proj.weight"] == (f"{p}self_attention.linear_q_proj.weight",)
            assert not any("q_layernorm" in n or "linear_q_up_proj" in n for n in te)


def test_layer_spec_is_te_whenever_te_imports(monkeypatch):
    import megatron_rl.compat as compat
    from megatron_rl.models import spec

    assert spec.layer_spec_flavour() == ("transformer_engine" if compat.have_transformer_engine() else "local")
    monkeypatch.setattr(compat, "have_transformer_engine", lambda: True)
    assert spec.layer_spec_flavour() == "transformer_engine"
    built = []
    monkeypatch.setitem(spec.LAYER_SPECS, "transformer_engine", lambda **kw: built.append(kw) or "te-spec")

    class Config:
        num_moe_experts = 4

    assert _bridge("qwen3_moe", {}).layer_spec(Config()) == "te-spec"
    assert built == [dict(num_experts=4, qk_layernorm=True)]
    monkeypatch.setattr(compat, "have_transformer_engine", lambda: False)
    assert spec.layer_spec_flavour() == "local"


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


def test_local_map_matches_built_models(single_rank):
    """The enumeration the TE map shares is what megatron really builds (local spec, TP1)."""
    for family, overrides in CONFIGS + MTP_CONFIGS:
        bridge = _bridge(family, overrides)
        (chunk,) = bridge.build_model(single_rank)
        built = {s.canonical_name: tuple(s.param.shape) for s in canonical_parameters(chunk)}
        assert built == bridge.megatron_param_shapes("local"), family
