"""One bridge per HF family: only what differs from the Llama baseline."""

from megatron_rl.models.bridge import Bridge


class LlamaBridge(Bridge):
    family = "llama"
    model_types = ("llama",)


class Qwen2Bridge(Bridge):
    """Qwen2: q/k/v projections always carry a bias; o_proj and the MLP do not."""

    family = "qwen2"
    model_types = ("qwen2",)
    qkv_bias = True


class Qwen3Bridge(Bridge):
    """Qwen3: per-head RMSNorm on q and k before RoPE (megatron ``qk_layernorm``)."""

    family = "qwen3"
    model_types = ("qwen3",)
    qk_norm = True


class Qwen3MoeBridge(Bridge):
    """Qwen3-MoE: Qwen3 attention, top-k softmax router (``mlp.gate``), no shared expert."""

    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    qk_norm = True
    moe = True


BRIDGES = {cls.family: cls for cls in (LlamaBridge, Qwen2Bridge, Qwen3Bridge, Qwen3MoeBridge)}
