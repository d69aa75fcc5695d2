"""Layer specs: megatron's own specs with our swaps, chosen per host.

* With transformer-engine: megatron's TE spec, unchanged.
* Without it (CPU, or GPUs without TE): megatron's local spec with
  - every norm replaced by :class:`megatron_rl.models.norm.RMSNorm` (the torch
    wrapper refuses sequence parallelism), and
  - ``core_attention`` = ``PackedCoreAttention`` from
    :mod:`megatron_rl.models.attention` when that module exists (packed THD
    sequences and context parallelism), megatron's ``DotProductAttention``
    otherwise. :func:`core_attention_module` is the single switch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl import compat  # compat.have_transformer_engine looked up per call (tests swap it)
from megatron_rl.models.norm import RMSNorm


def core_attention_module():
    """PackedCoreAttention when available, else megatron's DotProductAttention."""
    try:
        from megatron_rl.models.attention import PackedCoreAttention  # lazy: imports megatron-core
    except ImportError:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    return PackedCoreAttention


def supports_packed_sequences() -> bool:
    return core_attention_module().__name__ == "PackedCoreAttention"


def final_norm_module():
    if layer_spec_flavour() == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return RMSNorm


def layer_spec_flavour() -> str:
    """``"transformer_engine"`` whenever TE imports (FP8 needs TE modules), else ``"local"``.

    The single switch: the bridge builds the layer spec and names parameters
    (:data:`megatron_rl.models.weight_maps.LAYER_SPEC_NAMES`) by this key.
    """
    return "transformer_engine" if compat.have_transformer_engine() else "local"


def te_layer_spec(num_experts: Optional[int], qk_layernorm: bool, multi_latent_attention: bool = False):
    """megatron's TE spec. With ``multi_latent_attention`` (MLA) ``qk_layernorm`` means MLA's q/kv
    latent norms, fused into ``linear_q_up_proj`` / ``linear_kv_up_proj``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                      qk_layernorm=qk_layernorm,
                                                      multi_latent_attention=multi_latent_attention)


def local_layer_spec(num_experts: Optional[int], qk_layernorm: bool, multi_latent_attention: bool = False):
    """megatron's local spec with our norms and core attention.

    With ``multi_latent_attention`` the attention is ``MLASelfAttention``, ``qk_layernorm`` means its
    q/kv latent norms, and the q/kv down-projections are replicated linears (megatron's
    ``post_training.modelopt.layers.Linear``), as the TE spec's duplicated ``TELinear``: megatron's
    local spec makes them column-parallel, and 0.16.1 then all-gathers the shared RoPE key
    (``k_pos_emb``) over TP with a backward that only splits, dropping the other TP ranks' heads'
    share of its gradient (wrong gradients at TP > 1; the logits are right). Replicated, the key is
    gathered over the sequence under SP, whose backward sums the heads' shares.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
                                    multi_latent_attention=multi_latent_attention, normalization="RMSNorm")
    layer = spec.submodules
    attn = layer.self_attention.submodules
    norms = ("q_layernorm", "kv_layernorm") if multi_latent_attention else ("q_layernorm", "k_layernorm")
    swaps = {n: RMSNorm if qk_layernorm else getattr(attn, n) for n in norms}
    if multi_latent_attention:
        from megatron.core.post_training.modelopt.layers import Linear  # lazy: MLA only

        swaps.update(linear_q_down_proj=Linear, linear_kv_down_proj=Linear)
    attn = dataclasses.replace(attn, core_attention=core_attention_module(), **swaps)
    self_attention = dataclasses.replace(layer.self_attention, submodules=attn)
    layer = dataclasses.replace(layer, self_attention=self_attention, input_layernorm=RMSNorm,
                                pre_mlp_layernorm=RMSNorm)
    return dataclasses.replace(spec, submodules=layer)


LAYER_SPECS = {"transformer_engine": te_layer_spec, "local": local_layer_spec}
