"""One bridge per HF family: only what differs from the Llama baseline."""

from typing import Any

from megatron_rl.models.bridge import Bridge


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


class Glm4MoeBridge(Bridge):
    """GLM-4.5 (``glm4_moe``): partial RoPE on the first ``head_dim x partial_rotary_factor`` dims
    (rotate-half, as megatron's ``rotary_percent``), q/k/v bias from ``attention_bias``, optional
    q/k RMSNorm (``use_qk_norm``), ``first_k_dense_replace`` dense layers, then MoE layers with
    ``n_shared_experts`` x ``moe_intermediate_size`` always-on shared experts and a sigmoid router:
    experts are chosen on sigmoid + ``e_score_correction_bias`` (megatron ``expert_bias``, used
    for selection only), within the ``topk_group`` best of ``n_group`` groups, weighted by the
    unbiased sigmoid renormalised over the top-k, times ``routed_scaling_factor``.

    The bias stays what the checkpoint says (``moe_router_bias_update_rate`` 0, as HF keeps it);
    a training override may turn megatron's aux-loss-free update on. The multi-token-prediction
    layers a GLM-4.5 checkpoint holds after the decoder (``num_nextn_predict_layers``) are not
    part of the HF causal LM and are skipped on load, as transformers does.
    """

    family = "glm4_moe"
    model_types = ("glm4_moe",)
    moe = True
    partial_rotary = True
    router_expert_bias = True

    @property
    def qkv_bias(self) -> bool:  # type: ignore[override]  # read from config.json
        return bool(self.cfg("attention_bias", False))

    @property
    def qk_norm(self) -> bool:  # type: ignore[override]  # read from config.json
        return bool(self.cfg("use_qk_norm", False))

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
        """Also every tensor of the multi-token-prediction layers after the decoder."""
        parts = name.split(".")
        mtp = range(self.num_layers, self.num_layers + int(self.cfg("num_nextn_predict_layers", 0)))
        return super().is_ignorable_hf_name(name) or (
            parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit() and int(parts[2]) in mtp)


BRIDGES = {cls.family: cls for cls in (LlamaBridge, Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge, MixtralBridge,
                                       Glm4MoeBridge)}
