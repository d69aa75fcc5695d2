"""The embedded engine's decode step for dense Llama-family models on CPU, without transformers' module plumbing.

Why: at the sizes the embedded engine runs (the suite's and the demos' tiny models, CPU runs), a decode step
of one token per row spends more time in transformers' Python around the ops (module ``__call__``s, output
recording, deprecation and kernel-hub wrappers, config lookups: ~66 module calls a step for 4 layers) than
in the ops themselves. This step makes the same torch calls, with the same arguments, in the same order as
transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` forward does for one new
token per row (the model's own rotary module, transformers' own causal-mask builder, rotary function and
attention function), reading the live parameters; only the Python around them is gone. So its logits are
transformers' bit for bit (``tests/rollout/test_lean_decode.py``: every decode step of a generation, float32
and bfloat16, with left padding, the three families), and a weight update, an adapter merge or
``--true-on-policy-mode``'s invariant ops (a ``TorchFunctionMode``, which sees the same calls) change nothing
about it. On the async benchmark's tiny qwen2 it decodes 1.28x faster (benchmarks/lean_decode.py, docs/benchmarks.md).

Where it is not exactly transformers' computation it is not used (``lean_decoder`` returns None and the engine
calls the model): another family or decoder-layer class, a sliding-window or other non-full attention layer,
any forward hook on the model's modules (routing capture, user hooks), a device other than the CPU (the
kernel hub may swap kernels there, and no GPU run has checked it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

# model_type -> (decoder-layer class, attention class, MLP class, RMSNorm class, whether q/k carry a per-head
# RMSNorm): the classes whose forwards this step reproduces; any other class means another computation
LEAN_FAMILIES: dict[str, tuple[str, str, str, str, bool]] = {
    "llama": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm", False),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm", False),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm", True),
}
_FORWARDS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward`` (and Qwen2's, Qwen3's), op for op."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(input_dtype)


def _why_not(model: Any, device: torch.device) -> Optional[str]:
    config = model.config
    spec = LEAN_FAMILIES.get(getattr(config, "model_type", ""))
    if spec is None or type(model).__name__ not in _FORWARDS:
        return f"model type {getattr(config, 'model_type', '?')} ({type(model).__name__})"
    if device.type != "cpu":
        return f"device {device}"
    layer_cls, attn_cls, mlp_cls, norm_cls, _ = spec
    inner = model.model
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "a layer that is not full attention"
    if len(inner.layers) != config.num_hidden_layers:
        return "layers beyond num_hidden_layers"
    for layer in inner.layers:
        names = (type(layer).__name__, type(layer.self_attn).__name__, type(layer.mlp).__name__,
                 type(layer.input_layernorm).__name__, type(layer.post_attention_layernorm).__name__)
        if names != (layer_cls, attn_cls, mlp_cls, norm_cls, norm_cls):
            return f"a decoder layer of other classes {names}"
    if type(inner.norm).__name__ != norm_cls:
        return "another final norm"
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return "a global forward hook"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a forward hook on the model"
    return None


def lean_decoder(model: Any, device: torch.device) -> Optional[Callable[..., torch.Tensor]]:
    """The lean decode step for ``model`` (module docstring), or None where it would not be transformers' own
    computation. The step: ``(input_ids [b, 1], attention_mask [b, L], position_ids [b, 1], cache) -> logits
    [b, vocab]`` of the one new position, the cache updated as the model's forward updates it."""
    if _why_not(model, device) is not None:
        return None
    from transformers.masking_utils import create_causal_mask  # lazy: transformers' import is heavy
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    inner = model.model
    qk_norm = LEAN_FAMILIES[config.model_type][4]
    module = __import__(type(inner.layers[0].self_attn).__module__, fromlist=["apply_rotary_pos_emb"])
    apply_rotary: Callable = module.apply_rotary_pos_emb  # the family's own (the kernel hub's wrapper included)
    fallback = module.eager_attention_forward

    def step(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
             cache: Any) -> torch.Tensor:
        embed = inner.embed_tokens
        hidden = F.embedding(input_ids, embed.weight, embed.padding_idx, embed.max_norm, embed.norm_type,
                             embed.scale_grad_by_freq, embed.sparse)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, fallback)
        shape = hidden.shape[:-1]
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            residual = hidden
            x = _rms_norm(layer.input_layernorm, hidden)
            heads = (*shape, -1, attn.head_dim)
            q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(heads)
            k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(heads)
            if qk_norm:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(heads).transpose(1, 2)
            q, k = apply_rotary(q, k, cos, sin)
            k, v = cache.update(k, v, attn.layer_idx)
            out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                               sliding_window=getattr(attn, "sliding_window", None))
            out = out.reshape(*shape, -1).contiguous()
            hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            x = F.linear(mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
                         * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight, mlp.down_proj.bias)
            hidden = residual + x
        hidden = _rms_norm(inner.norm, hidden)
        return F.linear(hidden, model.lm_head.weight, model.lm_head.bias)[:, -1, :]

    return step


__all__ = ["LEAN_FAMILIES", "lean_decoder"]
