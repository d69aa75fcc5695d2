"""One bridge per HF family: only what differs from the Llama baseline."""

import dataclasses
import functools
import re
from typing import Any, Optional

from megatron_rl.models import weight_maps
from megatron_rl.models.bridge import Bridge, ParamRule
from megatron_rl.models.spec import layer_spec_flavour, local_layer_spec


class LlamaBridge(Bridge):
    family = "llama"
    model_types = ("llama",)


class Qwen2Bridge(Bridge):
    """Qwen2: q/k/v projections always carry a bias; o_proj and the MLP do not."""

    family = "qwen2"
    model_types = ("qwen2",)
    qkv_bias = True
    sliding_window_gated = True


class Qwen3Bridge(Bridge):
    """Qwen3: per-head RMSNorm on q and k before RoPE (megatron ``qk_layernorm``)."""

    family = "qwen3"
    model_types = ("qwen3",)
    qk_norm = True
    sliding_window_gated = True


class Qwen3MoeBridge(Bridge):
    """Qwen3-MoE: Qwen3 attention, top-k softmax router (``mlp.gate``), no shared expert."""

    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    qk_norm = True
    moe = True
    sliding_window_gated = True


class MixtralBridge(Bridge):
    """Mixtral: Llama attention; every layer MoE, softmax over all experts then the top-k
    renormalised (== megatron's softmax over the top-k logits). Checkpoint names keep the
    original ``block_sparse_moe`` / ``w1 w3 w2`` (transformers 5 renames and fuses them only
    in memory); the experts' size is ``intermediate_size``."""

    family = "mixtral"
    model_types = ("mixtral",)
    moe = True
    moe_ffn_key = "intermediate_size"
    hf_moe_block = "block_sparse_moe"
    hf_expert_projs = ("w1", "w3", "w2")

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        jitter = float(self.cfg("router_jitter_noise", 0.0))
        if jitter:  # HF scales the experts' input too, megatron's moe_input_jitter_eps only the router's
            problems.append(f"router_jitter_noise={jitter} (HF multiplies the MoE input by the noise; megatron "
                            "jitters only the router input)")
        return problems


class SigmoidRouterMoeBridge(Bridge):
    """DeepSeek-style MoE, shared by GLM-4.5 and DeepSeek-V3: ``first_k_dense_replace`` dense layers,
    then MoE layers with ``n_shared_experts`` x ``moe_intermediate_size`` always-on shared experts and a
    sigmoid router: experts are chosen on sigmoid + ``e_score_correction_bias`` (megatron
    ``expert_bias``, used for selection only), within the ``topk_group`` best of ``n_group`` groups,
    weighted by the unbiased sigmoid renormalised over the top-k, times ``routed_scaling_factor``.

    The bias stays what the checkpoint says (``moe_router_bias_update_rate`` 0, as HF keeps it);
    a training override may turn megatron's aux-loss-free update on. The multi-token-prediction
    layers such a checkpoint holds after the decoder (``num_nextn_predict_layers``) are not part
    of the HF causal LM: skipped on load, as transformers does, unless the bridge is built with
    ``mtp_num_layers`` (megatron's MTP block, :mod:`megatron_rl.models.mtp`).
    """

    moe = True
    router_expert_bias = True

    @property
    def shared_expert_size(self) -> int:
        return self.moe_ffn_hidden_size * int(self.cfg("n_shared_experts", 0))

    @property
    def _groups(self) -> tuple[int, int]:
        return int(self.cfg("n_group", 1)), int(self.cfg("topk_group", 1))

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= int(self.cfg("first_k_dense_replace", 0))

    def router_config(self) -> dict[str, Any]:
        n_group, topk_group = self._groups
        grouped = n_group > 1  # one group: group selection keeps every expert
        return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.0,
                    moe_router_topk_scaling_factor=float(self.cfg("routed_scaling_factor", 1.0)),
                    moe_router_num_groups=n_group if grouped else None,
                    moe_router_group_topk=topk_group if grouped else None)

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        topk, (n_group, topk_group) = int(self.cfg("num_experts_per_tok", 1)), self._groups
        if bool(self.cfg("norm_topk_prob", True)) != (topk > 1):  # megatron: sigmoid top-k renormalised iff k > 1
            problems.append(f"norm_topk_prob={self.cfg('norm_topk_prob', True)} with num_experts_per_tok={topk} "
                            "(megatron's sigmoid router renormalises the top-k weights exactly when k > 1)")
        if n_group > 1:
            if self.num_experts % n_group or self.num_experts // n_group < 2:
                problems.append(f"n_group={n_group} does not split n_routed_experts={self.num_experts} into groups "
                                "of at least 2")
            if topk_group < 1 or topk % topk_group or topk // topk_group != 2:
                problems.append(f"n_group={n_group} with topk_group={topk_group} and num_experts_per_tok={topk}: HF "
                                "scores a group by its top-2 experts, megatron by its top-(num_experts_per_tok / "
                                "topk_group); they agree only when num_experts_per_tok == 2 x topk_group")
        return problems

    def is_ignorable_hf_name(self, name: str) -> bool:
        """Also every tensor of the multi-token-prediction layers after the decoder the model does not build."""
        parts = name.split(".")
        mtp = range(self.num_layers + self.mtp_num_layers, self.num_layers + self.checkpoint_mtp_layers)
        return super().is_ignorable_hf_name(name) or (
            parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit() and int(parts[2]) in mtp)


class Glm4MoeBridge(SigmoidRouterMoeBridge):
    """GLM-4.5 (``glm4_moe``): partial RoPE on the first ``head_dim x partial_rotary_factor`` dims
    (rotate-half, as megatron's ``rotary_percent``), q/k/v bias from ``attention_bias``, optional
    q/k RMSNorm (``use_qk_norm``); the MoE of :class:`SigmoidRouterMoeBridge`."""

    family = "glm4_moe"
    model_types = ("glm4_moe",)
    partial_rotary = True

    @property
    def qkv_bias(self) -> bool:  # type: ignore[override]  # read from config.json
        return bool(self.cfg("attention_bias", False))

    @property
    def qk_norm(self) -> bool:  # type: ignore[override]  # read from config.json
        return bool(self.cfg("use_qk_norm", False))


class DeepseekV3Bridge(SigmoidRouterMoeBridge):
    """DeepSeek-V3 / Kimi-K2 (``deepseek_v3``): multi-latent attention (megatron ``MLASelfAttention``)
    and the MoE of :class:`SigmoidRouterMoeBridge`.

    MLA: q = ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` when ``q_lora_rank`` is
    null), ``kv_a_proj_with_mqa`` -> [latent (``kv_lora_rank``), shared RoPE key
    (``qk_rope_head_dim``)], ``kv_b_proj(kv_a_layernorm(latent))`` -> per head [no-RoPE key
    (``qk_nope_head_dim``), value (``v_head_dim``)]; every projection maps 1:1 (megatron's
    ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``,
    ``linear_q_proj``) in the same row order. HF's ``rope_interleave`` RoPE (rotate pairs (x0, x1),
    (x2, x3), ...) is what megatron's MLA computes (it de-interleaves, then rotates halves). YaRN:
    megatron's ``YarnRotaryEmbedding`` (same inverse frequencies, correction range rounded as
    HF's ``truncate``, cos/sin times mscale / mscale_all_dim) and softmax scale times
    mscale_all_dim's mscale squared, as HF.
    """

    family = "deepseek_v3"
    model_types: tuple[str, ...] = ("deepseek_v3", "kimi_k2")  # Kimi-K2: DeepSeek-V3's architecture under its own name
    mla = True
    qk_norm = True  # MLA's q / kv latent RMSNorms (q_a_layernorm, kv_a_layernorm)
    rope_types = ("default", "yarn")

    @property
    def _q_lora_rank(self) -> Any:
        return self.hf_config.get("q_lora_rank")  # null: q_proj, no q latent

    def attention_config(self) -> dict[str, Any]:
        rope = self._rope
        kw: dict[str, Any] = dict(
            q_lora_rank=self._q_lora_rank, kv_lora_rank=int(self.cfg("kv_lora_rank")),
            qk_head_dim=int(self.cfg("qk_nope_head_dim")), qk_pos_emb_head_dim=int(self.cfg("qk_rope_head_dim")),
            v_head_dim=int(self.cfg("v_head_dim")), num_query_groups=self.num_heads,
            kv_channels=int(self.cfg("v_head_dim")),  # as Megatron-LM's MLA recipes (--kv-channels = v_head_dim)
            rotary_base=self.rope_theta, rotary_percent=1.0)
        if rope.get("rope_type", rope.get("type")) == "yarn":
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            kw.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                      # HF: mscale ratio only when both are set (unsupported() refuses mscale_all_dim alone)
                      mscale=float(mscale or 1.0), mscale_all_dim=float(mscale_all_dim or 0.0))
        else:  # rotary_scaling_factor 1: softmax scale 1 / sqrt(qk_head_dim), no mscale
            kw.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        return kw

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.num_query_groups != self.num_heads:  # HF repeats MLA's per-head keys by heads / kv heads
            problems.append(f"num_key_value_heads={self.num_query_groups} != num_attention_heads={self.num_heads} "
                            "(MLA has one key per head; HF would repeat them)")
        if not self.cfg("rope_interleave", True):
            problems.append("rope_interleave=false (megatron's MLA always rotates interleaved pairs, as "
                            "DeepSeek's checkpoints are laid out)")
        rope = self._rope
        if rope.get("rope_type", rope.get("type")) == "yarn":
            problems += self._yarn_problems("mscale / mscale_all_dim")
            if not rope.get("truncate", True):
                problems.append("yarn truncate=false (megatron's MLA YaRN rounds the correction range)")
            if rope.get("mscale_all_dim") and not rope.get("mscale"):
                problems.append(f"yarn mscale_all_dim={rope['mscale_all_dim']} without mscale (HF then scales "
                                "cos/sin by mscale(factor) alone, megatron by the mscale ratio)")
        return problems

    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        h, nh, q_rank, kv_rank, nope, rope, v = self._mla_dims
        shapes = {attn + "kv_a_proj_with_mqa.weight": (kv_rank + rope, h), attn + "kv_a_layernorm.weight": (kv_rank,),
                  attn + "kv_b_proj.weight": (nh * (nope + v), kv_rank), attn + "o_proj.weight": (h, nh * v)}
        if q_rank is None:
            return {attn + "q_proj.weight": (nh * (nope + rope), h), **shapes}
        return {attn + "q_a_proj.weight": (q_rank, h), attn + "q_a_layernorm.weight": (q_rank,),
                attn + "q_b_proj.weight": (nh * (nope + rope), q_rank), **shapes}

    def megatron_attention_shapes(self, names) -> dict[str, tuple[int, ...]]:
        h, nh, q_rank, kv_rank, nope, rope, v = self._mla_dims
        a = "self_attention."
        shapes = {names.mla_input_norm: (h,), a + "linear_kv_down_proj.weight": (kv_rank + rope, h),
                  names.mla_kv_norm: (kv_rank,), a + "linear_kv_up_proj.weight": (nh * (nope + v), kv_rank),
                  a + "linear_proj.weight": (h, nh * v)}
        if q_rank is None:
            return {**shapes, a + "linear_q_proj.weight": (nh * (nope + rope), h)}
        return {**shapes, a + "linear_q_down_proj.weight": (q_rank, h), names.mla_q_norm: (q_rank,),
                a + "linear_q_up_proj.weight": (nh * (nope + rope), q_rank)}

    def attention_rules(self, attn: str) -> dict[str, tuple[str, tuple[str, ...]]]:
        a = "self_attention."
        rules: dict[str, tuple[str, tuple[str, ...]]] = {
                 a + "linear_q_proj.weight": ("copy", (attn + "q_proj.weight",)),
                 a + "linear_q_down_proj.weight": ("copy", (attn + "q_a_proj.weight",)),
                 a + "linear_q_up_proj.weight": ("copy", (attn + "q_b_proj.weight",)),
                 a + "linear_kv_down_proj.weight": ("copy", (attn + "kv_a_proj_with_mqa.weight",)),
                 a + "linear_kv_up_proj.weight": ("copy", (attn + "kv_b_proj.weight",)),
                 a + "linear_proj.weight": ("copy", (attn + "o_proj.weight",))}
        for names in weight_maps.LAYER_SPEC_NAMES.values():  # the latent norms sit where each layer spec puts them
            rules[names.mla_q_norm] = ("copy", (attn + "q_a_layernorm.weight",))
            rules[names.mla_kv_norm] = ("copy", (attn + "kv_a_layernorm.weight",))
        return rules

    @property
    def _mla_dims(self) -> tuple:
        q_rank = self._q_lora_rank
        return (self.hidden_size, self.num_heads, None if q_rank is None else int(q_rank),
                int(self.cfg("kv_lora_rank")), int(self.cfg("qk_nope_head_dim")), int(self.cfg("qk_rope_head_dim")),
                int(self.cfg("v_head_dim")))


class DeepseekV32Bridge(DeepseekV3Bridge):
    """DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 (MLA with a q latent, the sigmoid-router MoE) with
    DeepSeek Sparse Attention: each layer's lightning indexer (``self_attn.indexer.wq_b / wk / k_norm /
    weights_proj``) picks the ``index_topk`` keys every query attends to (:mod:`megatron_rl.models.dsa`:
    megatron-core's ``DSAIndexer`` parameters with HF's scoring, in the MLA ``core_attention`` slot; megatron's
    ``experimental_attention_variant="dsa"`` hands it ``x`` and the normed q latent). The indexer's rows map
    1:1 (HF's order: RoPE on the first ``qk_rope_head_dim`` channels). The indexer is frozen (HF computes it
    under ``no_grad``; ``dsa_indexer_loss_coeff`` 0): see docs/parity.md."""

    family = "deepseek_v32"
    model_types = ("deepseek_v32",)
    attention_layer_types = ("indexed_attention",)  # every layer DSA
    indexer_rope_interleaved = False  # DeepSeek-V3.2's indexer: rotate-half (its MLA: interleaved)
    _INDEXER = {"linear_wq_b.weight": "wq_b.weight", "linear_wk.weight": "wk.weight",
                "k_norm.weight": "k_norm.weight", "k_norm.bias": "k_norm.bias",
                "linear_weights_proj.weight": "weights_proj.weight"}

    @property
    def _indexer_dims(self) -> tuple[int, int, int]:
        return int(self.cfg("index_n_heads")), int(self.cfg("index_head_dim")), int(self.cfg("index_topk"))

    def attention_config(self) -> dict[str, Any]:
        heads, head_dim, topk = self._indexer_dims
        return {**super().attention_config(), "experimental_attention_variant": "dsa",
                "dsa_indexer_n_heads": heads, "dsa_indexer_head_dim": head_dim, "dsa_indexer_topk": topk,
                "dsa_indexer_loss_coeff": 0.0, "dsa_indexer_use_sparse_loss": False}

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self._q_lora_rank is None:
            problems.append("q_lora_rank=null (the indexer reads the q latent; transformers' DeepSeek-V3.2 "
                            "always has one)")
        _, head_dim, _ = self._indexer_dims
        if head_dim < int(self.cfg("qk_rope_head_dim")):
            problems.append(f"index_head_dim={head_dim} < qk_rope_head_dim={self.cfg('qk_rope_head_dim')} "
                            "(the indexer rotates its first qk_rope_head_dim channels)")
        dense = int(self.cfg("first_k_dense_replace", 0))
        pattern = self.cfg("mlp_layer_types", None)
        if pattern is not None and list(pattern) != ["dense" if i < dense else "sparse"
                                                     for i in range(self.num_layers)]:
            problems.append(f"mlp_layer_types={list(pattern)} (the bridge places MoE layers from "
                            f"first_k_dense_replace={dense})")
        return problems

    def unsupported_layout(self, layout) -> list[str]:
        problems = super().unsupported_layout(layout)
        if layout.cp > 1:
            problems.append(f"--context-parallel-size {layout.cp} (DeepSeek Sparse Attention's indexer scores "
                            "every earlier key of a sequence, which megatron-core 0.16.1's DSA keeps on one rank: "
                            "it refuses context parallelism); pass --context-parallel-size 1")
        return problems

    def layer_spec(self, config, moe: Optional[bool] = None):
        from megatron_rl.models.dsa import sparse_attention_spec  # lazy: imports megatron-core

        # the TE MLA spec fuses q_a_layernorm into linear_q_up_proj: the indexer would read the un-normed latent
        self._local_spec_only(layer_spec_flavour())
        spec = super().layer_spec(config, moe=moe)
        attn = dataclasses.replace(spec.submodules.self_attention.submodules,
                                   core_attention=sparse_attention_spec(self.indexer_rope_interleaved))
        self_attention = dataclasses.replace(spec.submodules.self_attention, submodules=attn)
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                        self_attention=self_attention))

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        self._local_spec_only(flavour)
        return super().megatron_param_shapes(flavour, tp_size)

    def rule_for(self, name: str) -> ParamRule:
        m = self._LAYER.match(name)
        if m and m.group(2).endswith(".layer_norm_weight"):  # a transformer-engine fused norm
            self._local_spec_only("transformer_engine")
        return super().rule_for(name)

    def _indexer_shapes(self) -> dict[str, tuple[int, ...]]:
        heads, head_dim, _ = self._indexer_dims
        q_rank = int(self._q_lora_rank)
        return {"wq_b.weight": (heads * head_dim, q_rank), "wk.weight": (head_dim, self.hidden_size),
                "k_norm.weight": (head_dim,), "k_norm.bias": (head_dim,), "weights_proj.weight": (heads, self.hidden_size)}

    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        return {**super().hf_attention_shapes(attn),
                **{f"{attn}indexer.{k}": v for k, v in self._indexer_shapes().items()}}

    def megatron_attention_shapes(self, names) -> dict[str, tuple[int, ...]]:
        hf = self._indexer_shapes()
        return {**super().megatron_attention_shapes(names),
                **{f"self_attention.core_attention.indexer.{m}": hf[h] for m, h in self._INDEXER.items()}}

    def attention_rules(self, attn: str) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {**super().attention_rules(attn),
                **{f"self_attention.core_attention.indexer.{m}": ("copy", (f"{attn}indexer.{h}",))
                   for m, h in self._INDEXER.items()}}


class GlmMoeDsaBridge(DeepseekV32Bridge):
    """GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's layers (MLA, the lightning indexer, the sigmoid-router MoE) with the
    indexer's RoPE on interleaved pairs, as its MLA's. Its cross-layer top-k sharing (``indexer_types`` "shared":
    a layer without an indexer reusing the previous full layer's selection) is refused: megatron-core 0.16.1's
    DSA has no way to hand a layer's top-k to the next (across pipeline stages either)."""

    family = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    indexer_rope_interleaved = True

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        types = list(self.cfg("indexer_types", None) or [])
        shared = [i for i, t in enumerate(types) if t != "full"]
        if shared:
            problems.append(f"indexer_types with {len(shared)} 'shared' layers (first: layer {shared[0]}; cross-layer "
                            "top-k sharing: megatron-core 0.16.1's sparse attention runs an indexer in every layer)")
        return problems


class MiniMaxM2Bridge(Bridge):
    """MiniMax-M2 (``minimax_m2``): every layer MoE with a sigmoid router (experts chosen on sigmoid +
    ``e_score_correction_bias``, megatron's router ``expert_bias``, kept as the checkpoint says; weights the
    unbiased sigmoid renormalised over the top-k; no groups, no scaling), experts of ``intermediate_size``; GQA
    attention with partial RoPE (``partial_rotary_factor``, or released configs' ``rotary_dim``: rotate-half on
    the first dims, megatron ``rotary_percent``) and q / k RMSNorm over all heads of a token at once
    (``q_norm.weight`` ``[heads x head_dim]``: :class:`~megatron_rl.models.minimax.AllHeadsRMSNorm` in the
    ``q_layernorm`` / ``k_layernorm`` slots). The checkpoint keeps the original names: ``block_sparse_moe``,
    experts ``w1 w3 w2``, ``block_sparse_moe.e_score_correction_bias``."""

    family = "minimax_m2"
    model_types = ("minimax_m2",)
    moe = True
    qk_norm = True
    partial_rotary = True
    router_expert_bias = True
    moe_ffn_key = "intermediate_size"
    hf_moe_block = "block_sparse_moe"
    hf_expert_projs = ("w1", "w3", "w2")

    @property
    def rotary_percent(self) -> float:  # released config.json files state rotary_dim, as transformers reads it
        rope = self._rope
        if "partial_rotary_factor" in rope or self.cfg("rotary_dim", None) is None:
            return super().rotary_percent
        return float(self.cfg("rotary_dim")) / self.head_dim

    def router_config(self) -> dict[str, Any]:
        return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.0)

    def architecture_config(self) -> dict[str, Any]:
        # megatron's qk_layernorm off: the norms come from the layer spec, and with it on finalize_model_grads sums
        # every "q_layernorm" / "k_layernorm" gradient over TP (right for a gain shared by all heads, wrong for these
        # TP-sharded gains: measured 0.23 max |dgrad| at TP2 x EP2 + SP)
        return dict(qk_layernorm=False)

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        topk = int(self.cfg("num_experts_per_tok", 1))
        if topk < 2:  # HF divides the top-k weights by their sum always; megatron's sigmoid router only for k > 1
            problems.append(f"num_experts_per_tok={topk} (HF renormalises a single expert's weight to 1, "
                            "megatron's sigmoid router keeps its sigmoid score)")
        jitter = float(self.cfg("router_jitter_noise", 0.0))
        if jitter:
            problems.append(f"router_jitter_noise={jitter} (HF multiplies the MoE input by the noise; megatron "
                            "jitters only the router input)")
        # fields of the released config.json that transformers' module ignores but the checkpoint's own code reads
        if self.cfg("scoring_func", "sigmoid") != "sigmoid":
            problems.append(f"scoring_func={self.cfg('scoring_func')!r} (transformers' MiniMax-M2 router is sigmoid)")
        if not self.cfg("use_qk_norm", True) or self.cfg("qk_norm_type", "per_layer") != "per_layer":
            problems.append(f"use_qk_norm={self.cfg('use_qk_norm', True)} qk_norm_type="
                            f"{self.cfg('qk_norm_type', 'per_layer')!r} (transformers' MiniMax-M2 normalises q and "
                            "k over all heads of a layer: per_layer)")
        if int(self.cfg("shared_intermediate_size", 0)):
            problems.append(f"shared_intermediate_size={self.cfg('shared_intermediate_size')} (transformers' "
                            "MiniMax-M2 has no shared expert)")
        return problems

    def unsupported_layout(self, layout) -> list[str]:
        if layout.tp > self.num_query_groups:
            return [f"--tensor-model-parallel-size {layout.tp} > num_key_value_heads={self.num_query_groups} (the "
                    "key norm over all key heads would count each replicated key head once per copy); pass "
                    f"--tensor-model-parallel-size <= {self.num_query_groups}"]
        return []

    # -------------------------------------------------------------------- spec
    def layer_spec(self, config, moe: Optional[bool] = None):
        from megatron.core.transformer.spec_utils import ModuleSpec  # lazy: megatron-core

        from megatron_rl.models.minimax import AllHeadsRMSNorm  # lazy: imports megatron-core

        spec = super().layer_spec(config, moe=moe)
        attn = dataclasses.replace(
            spec.submodules.self_attention.submodules,
            q_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"heads": self.num_heads}),
            k_layernorm=ModuleSpec(module=AllHeadsRMSNorm, params={"heads": self.num_query_groups}))
        self_attention = dataclasses.replace(spec.submodules.self_attention, submodules=attn)
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                        self_attention=self_attention))

    # ---------------------------------------------------------------- name maps
    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        return {**super().hf_attention_shapes(attn), attn + "q_norm.weight": (self.num_heads * self.head_dim,),
                attn + "k_norm.weight": (self.num_query_groups * self.head_dim,)}

    def megatron_attention_shapes(self, names) -> dict[str, tuple[int, ...]]:
        return {**super().megatron_attention_shapes(names),
                "self_attention.q_layernorm.weight": (self.num_heads * self.head_dim,),
                "self_attention.k_layernorm.weight": (self.num_query_groups * self.head_dim,)}

    def hf_router_expert_shapes(self, moe: str) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_router_expert_shapes(moe)
        shapes[moe + "e_score_correction_bias"] = shapes.pop(moe + "gate.e_score_correction_bias")
        return shapes

    def rule_for(self, name: str) -> ParamRule:
        m = self._LAYER.match(name)
        if m and m.group(2) == "mlp.router.expert_bias":
            return ParamRule("copy", (f"model.layers.{int(m.group(1))}.{self.hf_moe_block}.e_score_correction_bias",))
        return super().rule_for(name)


class GptOssBridge(Bridge):
    """gpt-oss (``gpt_oss``): every layer MoE; attention with q/k/v and o_proj biases, a learned
    sink logit per head (``sinks`` -> megatron ``softmax_type="learnable"``'s
    ``core_attention.softmax_offset``) and ``layer_types`` alternating sliding-window (``sliding_window``
    keys, megatron ``window_size=(sliding_window - 1, 0)`` on the layers ``window_attn_skip_freq`` marks)
    and full attention; YaRN RoPE (megatron's ``YarnRotaryEmbedding`` through
    :class:`~megatron_rl.models.yarn_config.YarnTransformerConfig`; ``truncate`` -> the correction
    range's rounding, q and k scaled by the YaRN concentration factor as HF scales cos/sin).

    MoE: the router is a linear with bias, top-k of its logits, softmax over the top-k (megatron's
    softmax router without pre-softmax); experts carry biases on both projections and apply the
    clamped SwiGLU ``(clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g)``, ``g = clamp(gate, max=limit)``
    (megatron ``quick_gelu`` with ``glu_linear_offset=1`` and ``activation_func_clamp_value=limit``).
    The checkpoint stacks a layer's experts: ``experts.gate_up_proj`` ``[E, hidden, 2 ffn]`` with gate
    and up interleaved in the columns, ``experts.down_proj`` ``[E, ffn, hidden]`` (``x @ W``), their
    biases ``[E, 2 ffn]`` / ``[E, hidden]``; each megatron expert's fc1 / fc2 is one slice of them.
    """

    family = "gpt_oss"
    model_types = ("gpt_oss",)
    moe = True
    qkv_bias = True
    moe_ffn_key = "intermediate_size"
    sliding_window_layers = True
    rope_types = ("default", "yarn")

    _QUICK_GELU_ALPHA = 1.702  # megatron's quick_gelu: x * sigmoid(1.702 x), the gain fixed

    @property
    def _yarn(self) -> bool:
        rope = self._rope
        return rope.get("rope_type", rope.get("type")) == "yarn"

    @property
    def position_embedding_type(self) -> str:  # type: ignore[override]  # read from config.json
        return "yarn" if self._yarn else "rope"

    @property
    def _layer_types(self) -> list[str]:
        return list(self.cfg("layer_types", None) or ["full_attention"] * self.num_layers)

    def router_config(self) -> dict[str, Any]:
        return dict(moe_router_pre_softmax=False, moe_router_score_function="softmax")

    def architecture_config(self) -> dict[str, Any]:
        from megatron.core.activations import quick_gelu  # lazy: megatron-core

        kw: dict[str, Any] = dict(add_bias_linear=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                                  activation_func_clamp_value=float(self.cfg("swiglu_limit", 7.0)),
                                  softmax_type="learnable")
        sliding = [1 if t == "sliding_attention" else 0 for t in self._layer_types]
        if any(sliding):
            kw.update(window_size=(int(self.cfg("sliding_window")) - 1, 0), window_attn_skip_freq=sliding)
        if self._yarn:
            rope = self._rope
            both = bool(rope.get("mscale")) and bool(rope.get("mscale_all_dim"))  # HF: the ratio only with both
            kw.update(yarn_rotary_scaling_factor=float(rope["factor"]),
                      yarn_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
                      yarn_mscale=float(rope["mscale"]) if both else None,
                      yarn_mscale_all_dim=float(rope["mscale_all_dim"]) if both else None,
                      yarn_correction_range_round_to_int=bool(rope.get("truncate", True)))
        return kw

    def unsupported_layout(self, layout) -> list[str]:
        if layout.expert_tp > 1:  # megatron-core 0.16.1: each expert-TP rank adds the fc2 bias to its partial sum
            return [f"expert tensor parallelism {layout.expert_tp} (the experts' fc2 bias would be added once per "
                    "expert-TP rank before their partial outputs are summed); pass --expert-tensor-parallel-size 1 "
                    "(its default is --tensor-model-parallel-size)"]
        return []

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        alpha = float(self.cfg("swiglu_alpha", self._QUICK_GELU_ALPHA))
        if alpha != self._QUICK_GELU_ALPHA:
            problems.append(f"swiglu_alpha={alpha} (megatron's quick_gelu has the gain 1.702 built in)")
        if not self.cfg("attention_bias", True):
            problems.append("attention_bias=false (megatron's add_bias_linear, which the experts' biases need, "
                            "also gives o_proj a bias)")
        if len(self._layer_types) != self.num_layers:
            problems.append(f"layer_types has {len(self._layer_types)} entries for {self.num_layers} layers")
        if "sliding_attention" in self._layer_types and not self.cfg("sliding_window", None):
            problems.append("layer_types with sliding_attention but no sliding_window")
        if self._yarn:
            problems += self._yarn_problems("factor / mscale / mscale_all_dim")
        return problems

    # ---------------------------------------------------------------- name maps
    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        return {**super().hf_attention_shapes(attn), attn + "o_proj.bias": (self.hidden_size,),
                attn + "sinks": (self.num_heads,)}

    def megatron_attention_shapes(self, names) -> dict[str, tuple[int, ...]]:
        return {**super().megatron_attention_shapes(names), "self_attention.linear_proj.bias": (self.hidden_size,),
                "self_attention.core_attention.softmax_offset": (self.num_heads,)}

    def attention_rules(self, attn: str) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {**super().attention_rules(attn),
                "self_attention.linear_proj.bias": ("copy", (attn + "o_proj.bias",)),
                "self_attention.core_attention.softmax_offset": ("copy", (attn + "sinks",))}

    def hf_router_expert_shapes(self, moe: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hidden_size, self.moe_ffn_hidden_size, self.num_experts
        return {moe + "router.weight": (n, h), moe + "router.bias": (n,),
                moe + "experts.gate_up_proj": (n, h, 2 * f), moe + "experts.gate_up_proj_bias": (n, 2 * f),
                moe + "experts.down_proj": (n, f, h), moe + "experts.down_proj_bias": (n, h)}

    def megatron_router_expert_shapes(self, layer: str) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden_size, self.moe_ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {layer + "mlp.router.weight": (self.num_experts, h),
                                              layer + "mlp.router.bias": (self.num_experts,)}
        for e in range(self.num_experts):
            x = f"{layer}mlp.experts.local_experts.{e}."
            shapes.update({x + "linear_fc1.weight": (2 * f, h), x + "linear_fc1.bias": (2 * f,),
                           x + "linear_fc2.weight": (h, f), x + "linear_fc2.bias": (h,)})
        return shapes

    _ROUTER_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.(?:router\.(weight|bias)|"
                                r"experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias))$")

    def rule_for(self, name: str) -> ParamRule:
        m = self._ROUTER_EXPERT.match(name)
        if not m:
            return super().rule_for(name)
        moe = f"model.layers.{int(m.group(1))}.mlp."
        if m.group(2):
            return ParamRule("copy", (f"{moe}router.{m.group(2)}",))
        expert, linear, kind = int(m.group(3)), m.group(4), m.group(5)
        stacked = moe + ("experts.gate_up_proj" if linear == "linear_fc1" else "experts.down_proj")
        if kind == "bias":
            return ParamRule("expert_gate_up" if linear == "linear_fc1" else "expert_row", (stacked + "_bias",),
                             expert)
        return ParamRule("expert_gate_up" if linear == "linear_fc1" else "expert_down", (stacked,), expert)



class Gemma3TextBridge(Bridge):
    """Gemma 3 text (``gemma3_text``): embeddings times ``sqrt(hidden_size)``; every RMSNorm zero-centred
    (``(1 + w)``, float32); four norms per layer (``input_layernorm`` and ``pre_feedforward_layernorm``
    before attention / MLP, ``post_attention_layernorm`` and ``post_feedforward_layernorm`` on their
    outputs before the residual add: megatron ``self_attn_bda.weight`` / ``mlp_bda.weight``, see
    :mod:`megatron_rl.models.gemma`); q/k RMSNorm; GeGLU with the tanh GELU; softmax scale
    ``query_pre_attn_scalar ** -0.5``; ``layer_types`` alternating sliding-window (``sliding_window`` keys)
    and full attention, each with its own RoPE (``rope_parameters`` per layer type: sliding layers
    ``rope_local_base_freq``, full layers ``rope_theta``; ``default`` or ``linear`` scaling);
    ``final_logit_softcapping`` when set; tied embeddings by default. Local layer spec only (the
    transformer-engine spec has no post-norms)."""

    family = "gemma3_text"
    model_types = ("gemma3_text",)
    qk_norm = True
    sliding_window_layers = True
    rope_types = ("default", "linear")

    @property
    def tie_word_embeddings(self) -> bool:  # Gemma's default is tied
        return bool(self.cfg("tie_word_embeddings", True))

    @property
    def _layer_types(self) -> list[str]:
        """``layer_types``, or (older configs) every ``sliding_window_pattern``-th layer full, as transformers
        derives them (pattern 6 when neither is given)."""
        types = self.cfg("layer_types", None)
        if types:
            return list(types)
        pattern = int(self.cfg("sliding_window_pattern", self.cfg("_sliding_window_pattern", 6)))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.num_layers)]

    def _rope_of(self, layer_type: str) -> dict[str, Any]:
        """RoPE of one layer type as transformers reads it: ``rope_parameters[layer_type]`` (transformers 5),
        ``rope_scaling`` merged into the full layers'; a missing base is ``rope_theta`` (default 1e6) for
        full layers and ``rope_local_base_freq`` (default 1e4) for sliding ones."""
        params = self.cfg("rope_parameters", {}) or {}
        rope = dict(params.get(layer_type) or {"rope_type": "default"})
        if layer_type == "full_attention":
            rope.update(self.cfg("rope_scaling", {}) or {})
            rope.setdefault("rope_theta", float(self.cfg("rope_theta", 1000000.0)))
        else:
            rope.setdefault("rope_theta", float(self.cfg("rope_local_base_freq", 10000.0)))
        return rope

    @property
    def _rope(self) -> dict[str, Any]:  # the full-attention layers' (what the base checks and GPTModel gets)
        return self._rope_of("full_attention")

    @property
    def rope_theta(self) -> float:  # the full-attention layers' (sliding layers: _layer_rope)
        return float(self._rope["rope_theta"])

    def _layer_rope(self) -> dict[str, tuple[float, Any]]:
        out = {}
        for kind, layer_type in (("sliding", "sliding_attention"), ("full", "full_attention")):
            rope = self._rope_of(layer_type)
            linear = rope.get("rope_type", rope.get("type", "default")) == "linear"
            out[kind] = (float(rope["rope_theta"]), float(rope["factor"]) if linear else None)
        return out

    def architecture_config(self) -> dict[str, Any]:
        import torch.nn.functional as F  # lazy: as the base's transformer_config

        kw: dict[str, Any] = dict(activation_func=functools.partial(F.gelu, approximate="tanh"),
                                  bias_activation_fusion=False,
                                  softmax_scale=float(self.cfg("query_pre_attn_scalar")) ** -0.5)
        sliding = [1 if t == "sliding_attention" else 0 for t in self._layer_types]
        if any(sliding):
            kw.update(window_size=(int(self.cfg("sliding_window")) - 1, 0), window_attn_skip_freq=sliding)
        return kw

    def unsupported(self) -> list[str]:
        problems = [p for p in super().unsupported() if not p.startswith("hidden_act=")]
        act = self.cfg("hidden_activation", self.cfg("hidden_act", "gelu_pytorch_tanh"))
        if act != "gelu_pytorch_tanh":
            problems.append(f"hidden_activation={act!r} (only 'gelu_pytorch_tanh' GeGLU)")
        if self.cfg("attn_logit_softcapping", None):
            problems.append(f"attn_logit_softcapping={self.cfg('attn_logit_softcapping')} (megatron's attention "
                            "has no score soft-capping)")
        if self.cfg("use_bidirectional_attention", False):
            problems.append("use_bidirectional_attention=true (causal attention only)")
        if len(self._layer_types) != self.num_layers:
            problems.append(f"layer_types has {len(self._layer_types)} entries for {self.num_layers} layers")
        if "sliding_attention" in self._layer_types and not self.cfg("sliding_window", None):
            problems.append("layer_types with sliding_attention but no sliding_window")
        for layer_type in ("sliding_attention", "full_attention"):
            rope = self._rope_of(layer_type)
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in self.rope_types:
                if layer_type == "sliding_attention":  # the full layers' is the base class's check
                    problems.append(f"{layer_type} rope_type {kind!r} (only {' / '.join(self.rope_types)} RoPE)")
            elif kind == "linear" and not rope.get("factor"):
                problems.append(f"{layer_type} linear rope_parameters without factor")
        return problems

    # -------------------------------------------------------------------- spec
    def layer_spec(self, config, moe: Optional[bool] = None):
        from megatron.core.transformer.spec_utils import ModuleSpec  # lazy: megatron-core

        from megatron_rl.models import gemma  # lazy: imports megatron-core

        self._local_spec_only(layer_spec_flavour())
        spec = local_layer_spec(num_experts=None, qk_layernorm=True)
        layer = spec.submodules
        attn = dataclasses.replace(layer.self_attention.submodules, q_layernorm=gemma.GemmaRMSNorm,
                                   k_layernorm=gemma.GemmaRMSNorm)
        self_attention = ModuleSpec(module=gemma.LayerRopeSelfAttention,
                                    params={**layer.self_attention.params, "rope": self._layer_rope()},
                                    submodules=attn)
        eps = float(self.cfg("rms_norm_eps", 1e-6))
        post_norm = ModuleSpec(module=gemma.PostNormBiasDropoutAdd,
                               params=dict(config=config, hidden_size=self.hidden_size, eps=eps))
        layer = dataclasses.replace(layer, input_layernorm=gemma.GemmaRMSNorm, pre_mlp_layernorm=gemma.GemmaRMSNorm,
                                    self_attention=self_attention, self_attn_bda=post_norm, mlp_bda=post_norm)
        return dataclasses.replace(spec, submodules=layer)

    def final_norm(self):
        from megatron_rl.models.gemma import GemmaRMSNorm  # lazy: imports megatron-core

        return GemmaRMSNorm

    def finish_model(self, model) -> None:
        from megatron_rl.models.gemma import attach_model_hooks  # lazy: imports megatron-core

        attach_model_hooks(model, self.hidden_size, self.cfg("final_logit_softcapping", None))

    # ---------------------------------------------------------------- name maps
    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_param_shapes()
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "pre_feedforward_layernorm.weight"] = (self.hidden_size,)
            shapes[p + "post_feedforward_layernorm.weight"] = (self.hidden_size,)
        return shapes

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        self._local_spec_only(flavour)
        shapes = super().megatron_param_shapes(flavour, tp_size)
        for i in range(self.num_layers):
            shapes[f"decoder.layers.{i}.self_attn_bda.weight"] = (self.hidden_size,)
            shapes[f"decoder.layers.{i}.mlp_bda.weight"] = (self.hidden_size,)
        return shapes

    _NORMS = {"self_attn_bda.weight": "post_attention_layernorm.weight",
              "mlp_bda.weight": "post_feedforward_layernorm.weight",
              "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight"}

    def rule_for(self, name: str) -> ParamRule:
        m = self._LAYER.match(name)
        if m and m.group(2) in self._NORMS:
            return ParamRule("copy", (f"model.layers.{int(m.group(1))}.{self._NORMS[m.group(2)]}",))
        if m and m.group(2).endswith(".layer_norm_weight"):  # a transformer-engine fused norm
            self._local_spec_only("transformer_engine")
        return super().rule_for(name)


class Gemma4TextBridge(Gemma3TextBridge):
    """Gemma 4 text (``gemma4_text``): Gemma 3's layout (tied embeddings times ``sqrt(hidden_size)``, four norms
    per layer, q/k norms, tanh GeGLU, sliding-window / full layers each with its own RoPE, final soft-capping)
    with plain-gain RMSNorms (:class:`~megatron_rl.models.gemma4.Gemma4RMSNorm`), a gain-free RMSNorm on each
    value head (``v_norm``), softmax scale 1, ``proportional`` RoPE on the full layers (the first
    ``partial_rotary_factor`` of the frequencies, exponents over the whole head; the other channel pairs
    unrotated) and each layer's output times its ``layer_scalar`` buffer.

    Refused by name (:meth:`unsupported`), as megatron-core 0.16.1's block has no place for them: per-layer
    embeddings (``hidden_size_per_layer_input``), key/value sharing across layers (``num_kv_shared_layers``),
    keys reused as values (``attention_k_eq_v``), the parallel MoE block (``enable_moe_block``) and full layers
    whose head size or key-value heads differ from the sliding layers' (``global_head_dim``,
    ``num_global_key_value_heads``, ``per_layer_config``). Local layer spec only."""

    family = "gemma4_text"
    model_types = ("gemma4_text",)
    rope_types = ("default", "proportional")

    @property
    def rotary_percent(self) -> float:  # megatron's shared table only carries positions: each layer rotates itself
        return 1.0

    def _rope_of(self, layer_type: str) -> dict[str, Any]:
        params = self.cfg("rope_parameters", {}) or {}
        rope = dict(params.get(layer_type) or {"rope_type": "default"})
        rope.setdefault("rope_theta", 1000000.0 if layer_type == "full_attention" else 10000.0)
        return rope

    def _layer_rope(self) -> dict[str, tuple[float, Any, Any]]:  # type: ignore[override]
        out = {}
        for kind, layer_type in (("sliding", "sliding_attention"), ("full", "full_attention")):
            rope = self._rope_of(layer_type)
            proportional = rope.get("rope_type", "default") == "proportional"
            factor = float(rope.get("factor", 1.0)) if proportional else None
            out[kind] = (float(rope["rope_theta"]), factor if factor != 1.0 else None,
                         float(rope.get("partial_rotary_factor", 1.0)) if proportional else None)
        return out

    def architecture_config(self) -> dict[str, Any]:
        import torch.nn.functional as F  # lazy: as the base's transformer_config

        kw: dict[str, Any] = dict(activation_func=functools.partial(F.gelu, approximate="tanh"),
                                  bias_activation_fusion=False, softmax_scale=1.0)
        sliding = [1 if t == "sliding_attention" else 0 for t in self._layer_types]
        if any(sliding):
            kw.update(window_size=(int(self.cfg("sliding_window")) - 1, 0), window_attn_skip_freq=sliding)
        return kw

    def _full_layer_dims(self) -> list[str]:
        """Where a full-attention layer's head size / key-value heads differ from the sliding layers'."""
        odd = []
        per_layer = self.cfg("per_layer_config", {}) or {}
        for layer, fields in sorted(per_layer.items(), key=lambda kv: str(kv[0])):
            for key, mine in (("head_dim", self.head_dim), ("num_key_value_heads", self.num_query_groups)):
                if key in (fields or {}) and fields[key] is not None and int(fields[key]) != mine:
                    odd.append(f"per_layer_config[{layer}].{key}={fields[key]} (not {mine})")
        if not per_layer:  # a config.json with the fields transformers derives per_layer_config from
            for key, mine in (("global_head_dim", self.head_dim), ("num_global_key_value_heads", self.num_query_groups)):
                value = self.cfg(key, None)
                if value is not None and int(value) != mine and "full_attention" in self._layer_types:
                    odd.append(f"{key}={value} (not {mine})")
        return odd

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if int(self.cfg("hidden_size_per_layer_input", 0)):
            problems.append(f"hidden_size_per_layer_input={self.cfg('hidden_size_per_layer_input')} (per-layer "
                            "embeddings: a second token embedding feeding every layer, which megatron's block has no "
                            "input for)")
        if int(self.cfg("num_kv_shared_layers", 0)):
            problems.append(f"num_kv_shared_layers={self.cfg('num_kv_shared_layers')} (later layers reuse earlier "
                            "layers' keys and values; megatron's layers each project their own)")
        if self.cfg("attention_k_eq_v", False):
            problems.append("attention_k_eq_v=true (full layers use their keys as values: one projection feeding "
                            "two of megatron's fused q/k/v rows)")
        if self.cfg("enable_moe_block", False):
            problems.append("enable_moe_block=true (a dense MLP and a MoE block side by side, each with its own "
                            "norms, and a router with its own norm and per-expert scales)")
        odd = self._full_layer_dims()
        if odd:
            problems.append("full-attention layers with their own attention shape: " + ", ".join(odd)
                            + " (megatron's layers share one kv_channels / num_query_groups)")
        return problems

    # -------------------------------------------------------------------- spec
    def layer_spec(self, config, moe: Optional[bool] = None):
        from megatron.core.transformer.spec_utils import ModuleSpec  # lazy: megatron-core

        from megatron_rl.models import gemma4  # lazy: imports megatron-core

        self._local_spec_only(layer_spec_flavour())
        spec = local_layer_spec(num_experts=None, qk_layernorm=True)
        layer = spec.submodules
        attn = dataclasses.replace(layer.self_attention.submodules, q_layernorm=gemma4.Gemma4RMSNorm,
                                   k_layernorm=gemma4.Gemma4RMSNorm)
        self_attention = ModuleSpec(module=gemma4.Gemma4SelfAttention,
                                    params={**layer.self_attention.params, "rope": self._layer_rope()},
                                    submodules=attn)
        norm = dict(config=config, hidden_size=self.hidden_size, eps=float(self.cfg("rms_norm_eps", 1e-6)))
        layer = dataclasses.replace(
            layer, input_layernorm=gemma4.Gemma4RMSNorm, pre_mlp_layernorm=gemma4.Gemma4RMSNorm,
            self_attention=self_attention, self_attn_bda=ModuleSpec(module=gemma4.Gemma4PostNormBda, params=norm),
            mlp_bda=ModuleSpec(module=gemma4.Gemma4PostNormBda, params={**norm, "scaled": True}))
        return dataclasses.replace(spec, submodules=layer)

    def final_norm(self):
        from megatron_rl.models.gemma4 import Gemma4RMSNorm  # lazy: imports megatron-core

        return Gemma4RMSNorm

    # ---------------------------------------------------------------- name maps
    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_param_shapes()
        shapes.update({f"model.layers.{i}.layer_scalar": (1,) for i in range(self.num_layers)})
        return shapes

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        shapes = super().megatron_param_shapes(flavour, tp_size)
        shapes.update({f"decoder.layers.{i}.mlp_bda.layer_scalar": (1,) for i in range(self.num_layers)})
        return shapes

    def rule_for(self, name: str) -> ParamRule:
        m = self._LAYER.match(name)
        if m and m.group(2) == "mlp_bda.layer_scalar":
            return ParamRule("copy", (f"model.layers.{int(m.group(1))}.layer_scalar",))
        return super().rule_for(name)


class Qwen3NextBridge(Bridge):
    """Qwen3-Next (``qwen3_next``): hybrid layers, ``layer_types`` (or every ``full_attention_interval``-th
    layer full) choosing a gated delta-net (``linear_attention``: ``linear_attn.*``,
    :class:`~megatron_rl.models.gated_delta.PackedGatedDeltaNet` in the layer's ``self_attention`` slot) or
    gated full attention (``q_proj`` rows per head ``[query; gate]``, output times ``sigmoid(gate)``:
    megatron ``attention_output_gate``, whose ``linear_qkv`` holds per query group ``[q heads, gate heads,
    k, v]``); q/k RMSNorm; partial RoPE (``partial_rotary_factor``, rotate-half on the first dims); every
    RMSNorm zero-centred (``(1 + w)``, :class:`~megatron_rl.models.gemma.GemmaRMSNorm`) except the gated
    delta-net's output norm (plain gain); MoE layers with a softmax top-k router, a shared expert
    (``shared_expert``) and its sigmoid gate (``shared_expert_gate``: megatron ``moe_shared_expert_gate``,
    ``mlp.shared_experts.gate_weight``). The multi-token-prediction weights a checkpoint holds (``mtp.*``)
    are skipped on load as transformers skips them. Local layer spec only; no context parallelism."""

    family = "qwen3_next"
    model_types = ("qwen3_next",)
    qk_norm = True
    partial_rotary = True

    @property
    def moe(self) -> bool:  # type: ignore[override]  # num_experts 0: every layer a dense MLP, as transformers builds it
        return self.num_experts > 0

    @property
    def rotary_percent(self) -> float:  # transformers' default for Qwen3-Next is 0.25
        rope = self._rope
        return float(rope.get("partial_rotary_factor", self.cfg("partial_rotary_factor", 0.25)))

    @property
    def shared_expert_size(self) -> int:
        return int(self.cfg("shared_expert_intermediate_size", 0))

    @property
    def _layer_types(self) -> list[str]:
        types = self.cfg("layer_types", None)
        if types:
            return list(types)
        interval = int(self.cfg("full_attention_interval", 4))
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(self.num_layers)]

    def is_linear_layer(self, layer: int) -> bool:
        return self._layer_types[layer] == "linear_attention"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and super().is_moe_layer(layer)

    @property
    def gdn_dims(self) -> tuple[int, int, int, int, int]:
        """(linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
        linear_conv_kernel_dim)."""
        return (int(self.cfg("linear_num_key_heads")), int(self.cfg("linear_num_value_heads")),
                int(self.cfg("linear_key_head_dim")), int(self.cfg("linear_value_head_dim")),
                int(self.cfg("linear_conv_kernel_dim", 4)))

    def architecture_config(self) -> dict[str, Any]:
        # hetereogenous_dist_checkpoint (megatron's spelling): the checkpoint keys each layer by its own index, as
        # the delta-net and attention layers hold different parameters (megatron-core stacks same-named
        # parameters of all layers otherwise, and refuses the save when a layer lacks one); a MoE list
        # moe_layer_freq already did this, a dense model needs it said
        return dict(attention_output_gate=True, moe_shared_expert_gate=bool(self.shared_expert_size),
                    hetereogenous_dist_checkpoint=True)

    def unsupported_layout(self, layout) -> list[str]:
        problems = []
        if layout.cp > 1:
            problems.append(f"context parallelism {layout.cp} (a gated delta-net layer's recurrent state and "
                            "convolution window would have to be handed from one CP rank to the next, which is "
                            "not built); pass --context-parallel-size 1")
        nk = self.gdn_dims[0]
        if nk % layout.tp:
            problems.append(f"linear_num_key_heads={nk} is not divisible by --tensor-model-parallel-size "
                            f"{layout.tp} (each TP rank holds whole key-head groups of the gated delta-net)")
        return problems

    def unsupported(self) -> list[str]:
        problems = [p for p in super().unsupported() if not p.startswith("layer_types [")]
        types = self._layer_types
        odd = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
        if odd:
            problems.append(f"layer_types {odd} (only linear_attention / full_attention)")
        if len(types) != self.num_layers:
            problems.append(f"layer_types has {len(types)} entries for {self.num_layers} layers")
        nk, nv = int(self.cfg("linear_num_key_heads", 1)), int(self.cfg("linear_num_value_heads", 1))
        if nv % nk:
            problems.append(f"linear_num_value_heads={nv} not a multiple of linear_num_key_heads={nk}")
        return problems

    # -------------------------------------------------------------------- spec
    def layer_spec(self, config, moe: Optional[bool] = None, linear: bool = False):
        from megatron.core.transformer.spec_utils import ModuleSpec  # lazy: megatron-core

        from megatron_rl.models import gated_delta  # lazy: imports megatron-core
        from megatron_rl.models.gemma import GemmaRMSNorm  # lazy: imports megatron-core

        self._local_spec_only(layer_spec_flavour())
        moe = self.moe if moe is None else moe
        spec = local_layer_spec(num_experts=config.num_moe_experts if moe else None, qk_layernorm=True)
        layer = spec.submodules
        if linear:
            self_attention = ModuleSpec(module=gated_delta.PackedGatedDeltaNet, params={"gdn": self.gdn_dims})
        else:
            attn = dataclasses.replace(layer.self_attention.submodules, q_layernorm=GemmaRMSNorm,
                                       k_layernorm=GemmaRMSNorm)
            self_attention = dataclasses.replace(layer.self_attention, submodules=attn)
        layer = dataclasses.replace(layer, input_layernorm=GemmaRMSNorm, pre_mlp_layernorm=GemmaRMSNorm,
                                    self_attention=self_attention)
        return dataclasses.replace(spec, submodules=layer)

    def block_spec(self, config, vp_stage: Optional[int] = None):
        from megatron.core.transformer.transformer_block import (  # lazy: megatron-core
            TransformerBlockSubmodules, get_num_layers_to_build)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset  # lazy: megatron-core

        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        kinds = [(self.is_moe_layer(offset + i), self.is_linear_layer(offset + i)) for i in range(n)]
        specs = {kind: self.layer_spec(config, moe=kind[0], linear=kind[1]) for kind in set(kinds)}
        return TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in kinds], layer_norm=self.final_norm())

    def final_norm(self):
        from megatron_rl.models.gemma import GemmaRMSNorm  # lazy: imports megatron-core

        return GemmaRMSNorm

    # ---------------------------------------------------------------- name maps
    _GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv_weight", "A_log", "dt_bias", "out_norm.weight",
            "out_proj.weight")
    _GDN_HF = {"conv_weight": "conv1d.weight", "out_norm.weight": "norm.weight"}
    #: megatron parameters made of several HF tensors: name -> (rule kind, HF names under ``linear_attn.``)
    _GDN_SPLIT: dict[str, tuple[str, tuple[str, ...]]] = {}

    def _gdn_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF-relative name under ``linear_attn.`` -> shape."""
        h, (nk, nv, dk, dv, kernel) = self.hidden_size, self.gdn_dims
        return {"in_proj_qkvz.weight": (2 * nk * dk + 2 * nv * dv, h), "in_proj_ba.weight": (2 * nv, h),
                "conv1d.weight": (2 * nk * dk + nv * dv, 1, kernel), "A_log": (nv,), "dt_bias": (nv,),
                "norm.weight": (dv,), "out_proj.weight": (h, nv * dv)}

    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        shapes = super().hf_attention_shapes(attn)
        shapes[attn + "q_proj.weight"] = (2 * self.num_heads * self.head_dim, self.hidden_size)
        return shapes

    def megatron_attention_shapes(self, names) -> dict[str, tuple[int, ...]]:
        shapes = super().megatron_attention_shapes(names)
        nh, ng, d = self.num_heads, self.num_query_groups, self.head_dim
        shapes["self_attention.linear_qkv.weight"] = ((2 * nh + 2 * ng) * d, self.hidden_size)
        return shapes

    def _rename_shared(self, shapes: dict[str, tuple[int, ...]], hf: bool) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes.items():
            m = re.match(r"^(model\.layers\.(\d+)\.)(self_attn\.|mlp\.shared_experts\.)(.*)$" if hf else
                         r"^(decoder\.layers\.(\d+)\.)(self_attention\.|input_layernorm\.)(.*)$", name)
            if m and hf and m.group(3) == "mlp.shared_experts.":
                out[f"{m.group(1)}mlp.shared_expert.{m.group(4)}"] = shape
            elif m and self.is_linear_layer(int(m.group(2))) and m.group(3) in ("self_attn.", "self_attention."):
                continue
            else:
                out[name] = shape
        return out

    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self._rename_shared(super().hf_param_shapes(), hf=True)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            if self.is_linear_layer(i):
                shapes.update({p + "linear_attn." + n: s for n, s in self._gdn_shapes().items()})
            if self.is_moe_layer(i) and self.shared_expert_size:
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, self.hidden_size)
        return shapes

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        self._local_spec_only(flavour)
        shapes = self._rename_shared(super().megatron_param_shapes(flavour, tp_size), hf=False)
        hf_layout = Qwen3NextBridge._gdn_shapes(self)  # Qwen3-Next's HF tensors are megatron's, parameter for parameter
        gdn = {n: hf_layout[Qwen3NextBridge._GDN_HF.get(n, n)] for n in self._GDN}
        for i in range(self.num_layers):
            p = f"decoder.layers.{i}."
            if self.is_linear_layer(i):
                shapes[p + "input_layernorm.weight"] = (self.hidden_size,)
                shapes.update({p + "self_attention." + n: s for n, s in gdn.items()})
            if self.is_moe_layer(i) and self.shared_expert_size:
                shapes[p + "mlp.shared_experts.gate_weight"] = (1, self.hidden_size)
        return shapes

    def rule_for(self, name: str) -> ParamRule:
        m = self._LAYER.match(name)
        if m:
            layer, rest = int(m.group(1)), m.group(2)
            p = f"model.layers.{layer}."
            if rest.startswith("self_attention.") and self.is_linear_layer(layer):
                local = rest[len("self_attention."):]
                if local in self._GDN_SPLIT:
                    kind, names = self._GDN_SPLIT[local]
                    return ParamRule(kind, tuple(p + "linear_attn." + n for n in names))
                if local in self._GDN:
                    kind = "gdn_conv" if local == "conv_weight" else "copy"
                    return ParamRule(kind, (p + "linear_attn." + self._GDN_HF.get(local, local),))
            if rest == "self_attention.linear_qkv.weight" and not self.is_linear_layer(layer):
                return ParamRule("qkv_gated", tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
            shared = p + "mlp.shared_expert."
            if rest == "mlp.shared_experts.linear_fc1.weight":
                return ParamRule("gate_up", (shared + "gate_proj.weight", shared + "up_proj.weight"))
            if rest == "mlp.shared_experts.linear_fc2.weight":
                return ParamRule("copy", (shared + "down_proj.weight",))
            if rest == "mlp.shared_experts.gate_weight":
                return ParamRule("copy", (p + "mlp.shared_expert_gate.weight",))
            if rest.endswith(".layer_norm_weight"):  # a transformer-engine fused norm
                self._local_spec_only("transformer_engine")
        return super().rule_for(name)

    def is_ignorable_hf_name(self, name: str) -> bool:
        """Also the multi-token-prediction weights (``mtp.*``), which transformers skips on load."""
        return super().is_ignorable_hf_name(name) or name.startswith("mtp.")


class Qwen3_5TextBridge(Qwen3NextBridge):
    """Qwen3.5's text model (``qwen3_5_text``, transformers' ``Qwen3_5ForCausalLM``): Qwen3-Next's hybrid
    layers (gated delta-net / gated full attention, zero-centred norms, partial RoPE) with a dense MLP in every
    layer, and the delta-net's input projections stored apart: ``in_proj_qkv`` (all q, all k, all v rows),
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (value head after value head). They load into
    :class:`~megatron_rl.models.gated_delta.PackedGatedDeltaNet`'s per-key-head ``in_proj_qkvz`` /
    ``in_proj_ba`` (rule kinds ``gdn_qkvz`` / ``gdn_ba``) and export back apart. ``rope_parameters``'
    ``mrope_section`` / ``mrope_interleaved`` split the rotary frequencies between the multimodal model's
    temporal / height / width positions; a text model's three position ids are equal, so its RoPE is plain
    partial RoPE. The multimodal checkpoints (``qwen3_5`` / ``qwen3_5_moe``) are refused by name by
    :func:`~megatron_rl.models.get_bridge`; ``mtp.*`` weights are skipped as transformers skips them."""

    family = "qwen3_5_text"
    model_types = ("qwen3_5_text",)

    _GDN_SPLIT = {"in_proj_qkvz.weight": ("gdn_qkvz", ("in_proj_qkv.weight", "in_proj_z.weight")),
                  "in_proj_ba.weight": ("gdn_ba", ("in_proj_b.weight", "in_proj_a.weight"))}

    def _gdn_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {n: s for n, s in super()._gdn_shapes().items() if n not in ("in_proj_qkvz.weight", "in_proj_ba.weight")}
        h, (nk, nv, dk, dv, _) = self.hidden_size, self.gdn_dims
        shapes.update({"in_proj_qkv.weight": (2 * nk * dk + nv * dv, h), "in_proj_z.weight": (nv * dv, h),
                       "in_proj_b.weight": (nv, h), "in_proj_a.weight": (nv, h)})
        return shapes


class Qwen3_5MoeTextBridge(Qwen3_5TextBridge):
    """Qwen3.5-MoE's text model (``qwen3_5_moe_text``): :class:`Qwen3_5TextBridge` with a MoE block in every
    layer: a softmax router whose top-k weights are always renormalised, the experts, one shared expert and its
    sigmoid gate (``shared_expert_gate``), as in Qwen3-Next."""

    family = "qwen3_5_moe_text"
    model_types = ("qwen3_5_moe_text",)

    def router_config(self) -> dict[str, Any]:  # transformers renormalises the top-k (no norm_topk_prob field)
        return dict(moe_router_pre_softmax=False, moe_router_score_function="softmax")


class VisionLanguageBridge(Bridge):
    """What the vision-language families share (mixed in before their text family's bridge): config.json keeps the
    language model under ``text_config`` (read here as the bridge's own config) and the vision tower under
    ``vision_config``; the language model is megatron's ``GPTModel`` with ``position_embedding_type="mrope"``
    (:class:`~megatron_rl.models.vision_language.VisionLanguageGPTModel`), the tower the checkpoint's own HF module
    on the first pipeline stage, replicated across TP (:mod:`megatron_rl.models.vision_language`), its tensors
    mapped 1:1 (``vision.X`` <-> ``HF_VISION_PREFIX + X``).

    A family sets ``HF_VISION_PREFIX``, ``HF_TEXT_PREFIX`` (where its checkpoint keeps the language model's
    ``model.*`` tensors), :meth:`vision_shapes` and :meth:`vision_classes`. Virtual pipelines are refused by
    :meth:`unsupported_layout`."""

    position_embedding_type = "mrope"
    vision_language = True
    rope_types = ("default", "mrope")  # older configs spell the multimodal RoPE rope_type "mrope"
    VISION_PREFIX, HF_VISION_PREFIX = "vision.", "visual."
    HF_TEXT_PREFIX = "model."  # the checkpoint's prefix of the language model's ``model.*`` tensors

    def __init__(self, hf_config: dict, mtp_num_layers: int = 0):
        full = dict(hf_config)
        text = dict(full.get("text_config") or {k: v for k, v in full.items() if k != "vision_config"})
        text["model_type"] = full.get("model_type")
        if "tie_word_embeddings" in full:  # the wrapper's value is the one transformers ties by
            text["tie_word_embeddings"] = full["tie_word_embeddings"]
        self.vl_config = full
        self.vision_config = dict(full.get("vision_config") or {})
        super().__init__(text, mtp_num_layers=mtp_num_layers)

    def vcfg(self, key: str, default: Any = None) -> Any:
        value = self.vision_config.get(key)
        return default if value is None else value

    @property
    def image_token_id(self) -> int:
        return int(self.vl_config.get("image_token_id", self.cfg("image_token_id", 151655)))

    @property
    def spatial_merge_size(self) -> int:
        return int(self.vcfg("spatial_merge_size", 2))

    @property
    def mrope_section(self) -> list[int]:
        return [int(x) for x in (self._rope.get("mrope_section") or [])]

    @property
    def mrope_interleaved(self) -> bool:
        """Whether the rotary channels take their position row round-robin (t, h, w, t, h, w, ...: Qwen3-VL) rather
        than in three contiguous sections (Qwen2.5-VL)."""
        return False

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers after which the tower's DeepStack features are added at the image tokens (Qwen3-VL)."""
        return 0

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        section = self.mrope_section
        if not section:
            problems.append(f"rope_parameters without mrope_section (a {self.family} language model needs its "
                            "temporal / height / width RoPE sections)")
        elif len(section) != 3 or sum(section) != self.head_dim // 2:
            problems.append(f"mrope_section {section} (three sections summing to head_dim / 2 = {self.head_dim // 2})")
        if not self.vision_config:
            problems.append(f"no vision_config (a {self.family} checkpoint holds its vision tower)")
        elif int(self.vcfg("out_hidden_size", self.hidden_size)) != self.hidden_size:
            problems.append(f"vision_config.out_hidden_size={self.vcfg('out_hidden_size')} != text hidden_size "
                            f"{self.hidden_size} (the merger's features replace token embeddings)")
        return problems

    def unsupported_layout(self, layout) -> list[str]:
        problems = super().unsupported_layout(layout)
        if (layout.vpp or 1) > 1:
            problems.append(f"virtual pipeline parallelism {layout.vpp} with a vision-language model (not proven "
                            "yet; docs/vlm.md); drop --virtual-pipeline-model-parallel-size")
        first_stage = self.num_layers // max(layout.pp, 1)
        if self.deepstack_layers > first_stage:
            problems.append(f"--pipeline-model-parallel-size {layout.pp}: the first stage holds {first_stage} "
                            f"decoder layer(s) but the vision tower's DeepStack features go into the first "
                            f"{self.deepstack_layers} (they are computed on the first stage and not sent on); pass "
                            f"--pipeline-model-parallel-size <= {max(1, self.num_layers // self.deepstack_layers)}")
        return problems

    def architecture_config(self) -> dict[str, Any]:
        return dict(super().architecture_config(), mrope_section=self.mrope_section)

    # ------------------------------------------------------------------ model
    def gpt_model_class(self):
        from megatron_rl.models.vision_language import VisionLanguageGPTModel  # lazy: imports megatron-core

        return VisionLanguageGPTModel

    def vision_classes(self) -> tuple[str, str, str]:
        """(transformers module, vision config class, vision model class) of the family's tower."""
        raise NotImplementedError

    def finish_model(self, model) -> None:
        """The HF vision tower on the first stage (the stage that embeds the tokens); the multimodal RoPE's layout."""
        from megatron_rl.models import vision_language  # lazy: imports megatron-core

        model.set_image_tokens(self.image_token_id, self.spatial_merge_size)
        # the M-RoPE frequencies of the whole packed batch: megatron's THD RoPE takes each CP rank's chunks of them
        # (by each sequence's offset); the embedding's own CP slice is for SBHD batches, which CP does not take here
        model.rotary_pos_emb.cp_group = None
        if self.mrope_interleaved:
            model.rotary_pos_emb = vision_language.InterleavedMultimodalRotaryEmbedding(model.rotary_pos_emb)
        if model.pre_process:
            patch_dim = (int(self.vcfg("in_channels", 3)) * int(self.vcfg("temporal_patch_size", 2))
                         * int(self.vcfg("patch_size", 14)) ** 2)
            tower = vision_language.build_vision_tower(self.vision_classes(), self.vision_config,
                                                       model.config.params_dtype)
            model.attach_vision(tower, patch_dim, self.deepstack_layers)

    # -------------------------------------------------------------- name maps
    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the vision tower and merger(s) (names relative to it) with its shape."""
        raise NotImplementedError

    def _checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of a language-model tensor the text bridge calls ``name`` (``model.*``)."""
        if self.HF_TEXT_PREFIX != "model." and name.startswith("model."):
            return self.HF_TEXT_PREFIX + name[len("model."):]
        return name

    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {self._checkpoint_name(n): s for n, s in super().hf_param_shapes().items()}
        shapes.update({self.HF_VISION_PREFIX + n: s for n, s in self.vision_shapes().items()})
        return shapes

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        shapes = super().megatron_param_shapes(flavour, tp_size)
        shapes.update({self.VISION_PREFIX + n: s for n, s in self.vision_shapes().items()})
        return shapes

    def rule_for(self, name: str) -> ParamRule:
        if name.startswith(self.VISION_PREFIX):
            local = name[len(self.VISION_PREFIX):]
            if local in self.vision_shapes():
                return ParamRule("copy", (self.HF_VISION_PREFIX + local,))
        rule = super().rule_for(name)
        if self.HF_TEXT_PREFIX == "model.":
            return rule
        return dataclasses.replace(rule, hf_names=tuple(self._checkpoint_name(n) for n in rule.hf_names))


class Qwen2_5_VLBridge(VisionLanguageBridge, Qwen2Bridge):
    """Qwen2.5-VL (``qwen2_5_vl``): a Qwen2 language model (q/k/v bias) with multimodal RoPE, and a vision tower
    plus merger (``visual.*`` in the checkpoint, the language model under ``model.*``) whose features replace the
    image-pad tokens' embeddings.

    megatron-core's ``MultimodalRotaryEmbedding`` takes the rotary frequencies of each channel section from the
    temporal / height / width position row of ``rope_parameters.mrope_section`` (the sections repeated for the two
    rotate-half halves), as HF's ``apply_multimodal_rotary_pos_emb``.

    Proven layouts (docs/vlm.md), packed THD micro-batches with images: one process, DP2, TP2, TP2 + sequence
    parallelism, PP2 (the tower on the first stage), CP2 (the features written into the whole packed batch
    before the CP split).
    """

    family = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)

    def unsupported(self) -> list[str]:
        problems = super().unsupported()
        if self.vision_config and self.vcfg("hidden_act", "silu") != "silu":
            problems.append(f"vision_config.hidden_act={self.vcfg('hidden_act')!r} (only 'silu')")
        return problems

    def vision_classes(self) -> tuple[str, str, str]:
        return ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLVisionConfig",
                "Qwen2_5_VisionTransformerPretrainedModel")

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = int(self.vcfg("hidden_size")), int(self.vcfg("intermediate_size"))
        m, p, tp = self.spatial_merge_size, int(self.vcfg("patch_size", 14)), int(self.vcfg("temporal_patch_size", 2))
        merged = h * m * m
        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, int(self.vcfg("in_channels", 3)), tp, p, p),
            "merger.ln_q.weight": (h,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
            "merger.mlp.2.weight": (self.hidden_size, merged), "merger.mlp.2.bias": (self.hidden_size,)}
        for i in range(int(self.vcfg("depth"))):
            b = f"blocks.{i}."
            shapes.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,), b + "attn.qkv.weight": (3 * h, h),
                           b + "attn.qkv.bias": (3 * h,), b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                           b + "mlp.gate_proj.weight": (f, h), b + "mlp.gate_proj.bias": (f,),
                           b + "mlp.up_proj.weight": (f, h), b + "mlp.up_proj.bias": (f,),
                           b + "mlp.down_proj.weight": (h, f), b + "mlp.down_proj.bias": (h,)})
        return shapes


class Qwen3VLBridge(VisionLanguageBridge, Qwen3Bridge):
    """Qwen3-VL (``qwen3_vl``): a Qwen3 language model (q/k RMSNorm, no bias) with *interleaved* multimodal RoPE
    (rotary channel ``j`` takes the height row when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width row
    when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, the temporal row otherwise: transformers'
    ``Qwen3VLTextRotaryEmbedding``), a vision tower with a learned position grid, a merger, and DeepStack: the
    tower's features after blocks ``deepstack_visual_indexes``, each through its own merger, are added to the
    hidden states at the image tokens after decoder layers ``0 .. len(deepstack_visual_indexes) - 1``
    (:class:`~megatron_rl.models.vision_language.VisionLanguageGPTModel`, a residual add after those layers on the
    first stage). The checkpoint keeps the language model under ``model.language_model.*`` and the tower under
    ``model.visual.*`` (``lm_head.weight`` at the top)."""

    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    HF_VISION_PREFIX = "model.visual."
    HF_TEXT_PREFIX = "model.language_model."

    @property
    def mrope_interleaved(self) -> bool:
        return True  # transformers' Qwen3-VL text rotary embedding is interleaved whatever the config says

    @property
    def deepstack_layers(self) -> int:
        return len(self.vcfg("deepstack_visual_indexes", []) or [])

    def vision_classes(self) -> tuple[str, str, str]:
        return ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel")

    def vision_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f = int(self.vcfg("hidden_size")), int(self.vcfg("intermediate_size"))
        m, p, tp = self.spatial_merge_size, int(self.vcfg("patch_size", 16)), int(self.vcfg("temporal_patch_size", 2))
        merged, out = h * m * m, self.hidden_size

        def merger(prefix: str, norm: int) -> dict[str, tuple[int, ...]]:
            return {prefix + "norm.weight": (norm,), prefix + "norm.bias": (norm,),
                    prefix + "linear_fc1.weight": (merged, merged), prefix + "linear_fc1.bias": (merged,),
                    prefix + "linear_fc2.weight": (out, merged), prefix + "linear_fc2.bias": (out,)}

        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, int(self.vcfg("in_channels", 3)), tp, p, p), "patch_embed.proj.bias": (h,),
            "pos_embed.weight": (int(self.vcfg("num_position_embeddings")), h), **merger("merger.", h)}
        for k in range(self.deepstack_layers):  # the post-shuffle norm: over the merged width
            shapes.update(merger(f"deepstack_merger_list.{k}.", merged))
        for i in range(int(self.vcfg("depth"))):
            b = f"blocks.{i}."
            shapes.update({b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,),
                           b + "norm2.bias": (h,), b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                           b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                           b + "mlp.linear_fc1.weight": (f, h), b + "mlp.linear_fc1.bias": (f,),
                           b + "mlp.linear_fc2.weight": (h, f), b + "mlp.linear_fc2.bias": (h,)})
        return shapes


class Qwen3VLMoeBridge(Qwen3VLBridge, Qwen3MoeBridge):
    """Qwen3-VL-MoE (``qwen3_vl_moe``): Qwen3-VL (interleaved M-RoPE, DeepStack, the same tower) over a Qwen3-MoE
    language model: every layer a top-k softmax router whose top-k weights are always renormalised (no
    ``norm_topk_prob`` field), no shared expert. The checkpoint stacks each layer's experts, as the hub's
    Qwen3-VL-30B-A3B does: ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * moe_ffn]`` (gate in the first half of
    the last dim, up in the second) and ``mlp.experts.down_proj`` ``[E, moe_ffn, hidden]``, the transposes of
    megatron's ``linear_fc1`` / ``linear_fc2`` (transformers transposes them on load)."""

    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)

    def router_config(self) -> dict[str, Any]:
        return dict(moe_router_pre_softmax=False, moe_router_score_function="softmax")

    def hf_router_expert_shapes(self, moe: str) -> dict[str, tuple[int, ...]]:
        h, f, n = self.hidden_size, self.moe_ffn_hidden_size, self.num_experts
        return {moe + "gate.weight": (n, h), moe + "experts.gate_up_proj": (n, h, 2 * f),
                moe + "experts.down_proj": (n, f, h)}

    _STACKED_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\."
                                 r"(linear_fc1|linear_fc2)\.weight$")

    def rule_for(self, name: str) -> ParamRule:
        m = self._STACKED_EXPERT.match(name)
        if not m:
            return super().rule_for(name)
        moe = f"{self.HF_TEXT_PREFIX}layers.{int(m.group(1))}.mlp.experts."
        if m.group(3) == "linear_fc1":
            return ParamRule("expert_gate_up_cat", (moe + "gate_up_proj",), int(m.group(2)))
        return ParamRule("expert_down", (moe + "down_proj",), int(m.group(2)))


BRIDGES = {cls.family: cls for cls in (LlamaBridge, Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge, MixtralBridge,
                                       Glm4MoeBridge, DeepseekV3Bridge, DeepseekV32Bridge, GlmMoeDsaBridge, MiniMaxM2Bridge, GptOssBridge,
                                       Gemma3TextBridge, Gemma4TextBridge, Qwen3NextBridge, Qwen3_5TextBridge,
                                       Qwen3_5MoeTextBridge, Qwen2_5_VLBridge, Qwen3VLBridge,
                                       Qwen3VLMoeBridge)}
#: config.json model_type -> bridge (a family may answer to several names)
BRIDGES_BY_MODEL_TYPE = {model_type: cls for cls in BRIDGES.values() for model_type in cls.model_types}
