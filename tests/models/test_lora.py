"""LoRA in one process (megatron_rl/models/lora.py): what it refuses, by name, and what a fresh adapter is.
Equality with HF PEFT at every layout: tests/dist/test_lora_layouts.py."""

import pytest
import torch

from megatron_rl.errors import BridgeError
from megatron_rl.models import get_bridge, lora


@pytest.fixture(scope="module")
def single_rank(tp1_world):
    from megatron_rl.models.parallel import ParallelLayout

    return ParallelLayout()


def _model(path, layout):
    bridge = get_bridge(path)
    chunks = bridge.build_model(layout)
    bridge.load_hf_weights(chunks, path)
    return bridge, chunks


def test_spec_validation_and_peft_matching():
    with pytest.raises(BridgeError, match="rank 0"):
        lora.LoraSpec(0, 8)
    with pytest.raises(BridgeError, match="dropout 1.0"):
        lora.LoraSpec(4, 8, dropout=1.0)
    spec = lora.LoraSpec(4, 8, target_modules=("q_proj", "mlp.down_proj"))
    assert spec.scaling == 2.0
    assert spec.targets("model.layers.3.self_attn.q_proj") and spec.targets("model.layers.0.mlp.down_proj")
    assert not spec.targets("model.layers.0.self_attn.k_proj") and not spec.targets("model.layers.0.xq_proj")
    assert lora.LoraSpec(4, 8).targets("model.layers.0.mlp.up_proj")  # all-linear by default, as PEFT's
    assert lora.peft_key("model.layers.0.self_attn.q_proj", "A") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_fresh_adapter_is_the_base_model_and_only_adapters_train(single_rank, tiny_hf_models):
    from megatron_rl.models import parity

    path = tiny_hf_models("qwen2")
    bridge, chunks = _model(path, single_rank)
    mbs = parity.random_microbatches(bridge.vocab_size, [7, 5], 1, seed=3)
    with torch.no_grad():
        before = parity.megatron_run(chunks, mbs, bridge.vocab_size, packed=True)
    adapters = lora.attach_lora(bridge, chunks, lora.LoraSpec(8, 16))
    # B starts at zero (PEFT's init): the adapted model is the base model until it trains, bit for bit
    with torch.no_grad():
        after = parity.megatron_run(chunks, mbs, bridge.vocab_size, packed=True)
        with lora.adapters_disabled(adapters):
            base = parity.megatron_run(chunks, mbs, bridge.vocab_size, packed=True)
    assert all(torch.equal(a, b) for a, b in zip(base, after))
    # vs the model before its weights were frozen: within fp32 rounding (megatron's linear takes another GEMM
    # path for a weight without requires_grad: 2.1e-6 here)
    assert max((a - b).abs().max().item() for a, b in zip(before, after)) <= 1e-5
    assert chunks[0].lora is adapters[0]
    trainable = {n for n, p in chunks[0].named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_name(n) for n in trainable)
    # every layer's q, k, v, o, gate, up, down, each an A and a B
    keys = [k for k, *_ in lora.local_adapter_tensors(adapters)]
    assert len(keys) == bridge.num_layers * 7 * 2 and len(set(keys)) == len(keys)
    # A is PEFT's kaiming-uniform bound, drawn from the module's name: the same at every layout
    a = dict((k, t) for k, t, *_ in lora.local_adapter_tensors(adapters))
    q_a = a[lora.peft_key("model.layers.0.self_attn.q_proj", "A")]
    assert q_a.abs().max() <= 1 / bridge.hidden_size ** 0.5 and q_a.std() > 0
    assert not torch.equal(q_a, a[lora.peft_key("model.layers.0.self_attn.k_proj", "A")])
    # the base model's export does not carry the adapters
    assert not any("lora" in name for name, _ in bridge.export_hf_weights(chunks))
    # bad adapter tensors are named
    full = {k: t.detach().clone() for k, t, *_ in lora.local_adapter_tensors(adapters)}
    with pytest.raises(BridgeError, match="no 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'"):
        lora.load_peft_tensors(adapters, {k: v for k, v in full.items() if "layers.0.self_attn.q_proj.lora_A" not in k})
    bad = dict(full)
    bad[lora.peft_key("model.layers.1.mlp.down_proj", "B")] = torch.zeros(3, 8)
    with pytest.raises(BridgeError, match=r"layers.1.mlp.down_proj.lora_B.weight' has shape \(3, 8\)"):
        lora.load_peft_tensors(adapters, bad)


def test_refusals_name_what_is_not_built(single_rank, tiny_hf_models, monkeypatch):
    bridge, chunks = _model(tiny_hf_models("qwen2"), single_rank)
    with pytest.raises(BridgeError, match=r"\['qkv_proj'\] match no linear of this qwen2 model"):
        lora.attach_lora(bridge, chunks, lora.LoraSpec(4, 8, target_modules=("q_proj", "qkv_proj")))
    moe_bridge, moe_chunks = _model(tiny_hf_models("qwen3_moe"), single_rank)
    with pytest.raises(BridgeError, match="MoE expert linears .* is not built: target the attention"):
        lora.attach_lora(moe_bridge, moe_chunks, lora.LoraSpec(4, 8))  # all-linear reaches the experts
    from megatron_rl.models import spec

    bridge, chunks = _model(tiny_hf_models("qwen2"), single_rank)
    monkeypatch.setattr(spec, "layer_spec_flavour", lambda: "transformer_engine")
    with pytest.raises(BridgeError, match="local layer spec; with transformer-engine"):
        lora.attach_lora(bridge, chunks, lora.LoraSpec(4, 8))


def test_merged_export_is_peft_merge_and_the_base_comes_back_bitwise(single_rank, tiny_hf_models):
    """What the engine is synced with (``export_weights`` under ``LoraAdapters.merged()``) equals PEFT's own
    ``merge_and_unload()`` of the same adapter, and the base weights are restored bit for bit afterwards."""
    from peft import LoraConfig, get_peft_model

    from megatron_rl.models import parity

    path = tiny_hf_models("qwen3")
    bridge, chunks = _model(path, single_rank)
    base = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
    targets = ["q_proj", "v_proj", "up_proj", "o_proj"]
    adapters = lora.attach_lora(bridge, chunks, lora.LoraSpec(4, 8, target_modules=tuple(targets)))
    pm = get_peft_model(parity.load_hf_model(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    lora.load_peft_tensors(adapters, {n.replace(".default.weight", ".weight"): p.detach().clone()
                                      for n, p in pm.named_parameters() if "lora_" in n})
    with adapters[0].merged():
        merged = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
    want = pm.merge_and_unload().state_dict()
    assert set(merged) <= set(want)
    worst = max((merged[k] - want[k]).abs().max().item() for k in merged)
    assert worst <= 1e-6, worst
    moved = [k for k in merged if not torch.equal(merged[k], base[k])]
    assert len(moved) == bridge.num_layers * len(targets)  # exactly the adapted HF linears changed
    after = dict(bridge.export_hf_weights(chunks))
    assert all(torch.equal(after[k], base[k]) for k in base)
