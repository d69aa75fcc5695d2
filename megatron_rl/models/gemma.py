"""Gemma 3 pieces megatron-core 0.16.1 has no switch for, as layer-spec submodules and model hooks.

* :class:`GemmaRMSNorm`: RMSNorm with a zero-centred gain, ``x / rms(x) * (1 + w)`` computed in float32
  and cast back (HF ``Gemma3RMSNorm``); the stored weight is HF's ``w`` (megatron's
  ``layernorm_zero_centered_gamma`` convention). Used for every norm of the model, q/k norms included.
* :class:`PostNormBiasDropoutAdd`: the ``self_attn_bda`` / ``mlp_bda`` submodule of a layer that
  normalises the attention (MLP) output before the residual add (HF ``post_attention_layernorm`` /
  ``post_feedforward_layernorm``); its parameter is that norm's weight.
* :class:`LayerRopeSelfAttention`: megatron's ``SelfAttention`` with its own RoPE per layer type
  (sliding layers: ``rope_local_base_freq``; full layers: ``rope_theta``, optionally HF ``linear``
  scaling). The model's shared rotary table is built with ``inv_freq[0] = 1`` and no interpolation,
  so its first column is the token positions exactly; each layer recomputes ``position x inv_freq``
  with its own frequencies (HF's formula), after whatever slicing megatron did for CP / packing.
* :func:`attach_model_hooks`: embeddings times ``sqrt(hidden)`` rounded to the embedding dtype (HF
  ``Gemma3TextScaledWordEmbedding``) and, when configured, ``final_logit_softcapping``
  (``tanh(logits / c) * c``) on the output layer.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = True, normalization: str = "RMSNorm"):
        super().__init__()
        if normalization != "RMSNorm":
            raise ValueError(f"GemmaRMSNorm got normalization={normalization!r}; only RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))  # megatron's SP grad tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class PostNormBiasDropoutAdd(GemmaRMSNorm):
    """A layer's bias-dropout-add with the output normalised first: ``residual + dropout(norm(out + bias))``.
    Called as megatron calls a bda: ``bda(training, fused)((out, bias), residual, prob)``."""

    def forward(self, training: bool, fused: bool):  # type: ignore[override]  # megatron's bda protocol
        add = get_bias_dropout_add(training, False)

        def post_norm_bda(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
            out, bias = x_with_bias
            if bias is not None:
                out = out + bias
            return add((GemmaRMSNorm.forward(self, out), None), residual, prob)

        return post_norm_bda


def rope_inv_freq(dim: int, base: float, linear_factor: Optional[float],
                  proportion: Optional[float] = None) -> torch.Tensor:
    """HF's default (and ``linear``: divided by the factor) RoPE inverse frequencies, float32. ``proportion``
    (HF ``proportional`` RoPE, Gemma 4): only the first ``int(proportion x dim // 2)`` frequencies, with the
    exponents still over the whole ``dim``; the rest are 0 (those channel pairs are not rotated)."""
    if proportion is None:
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    else:
        angles = int(proportion * dim // 2)
        rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        inv = torch.cat((rotated, torch.zeros(dim // 2 - angles, dtype=torch.float32)))
    return inv / linear_factor if linear_factor else inv


class LayerRopeSelfAttention(SelfAttention):
    """``SelfAttention`` whose RoPE frequencies depend on whether the layer is a sliding-window one.
    ``rope``: ``{"sliding": (base, linear factor or None[, proportion or None]), "full": (...)}``."""

    def __init__(self, config, submodules, layer_number: int, *args, rope: dict, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        kind = ("sliding" if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                        layer_number) else "full")
        self.register_buffer("rope_inv_freq", rope_inv_freq(config.kv_channels, *rope[kind]), persistent=False)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if isinstance(rotary_pos_emb, torch.Tensor):
            positions = rotary_pos_emb[..., :1].float()  # [s, 1, 1, 1]: the shared table's inv_freq[0] is 1
            freqs = positions * self.rope_inv_freq.to(positions.device)
            rotary_pos_emb = torch.cat((freqs, freqs), dim=-1).to(rotary_pos_emb.dtype)
        elif rotary_pos_emb is not None:
            raise NotImplementedError("LayerRopeSelfAttention takes one rotary table (no separate q / k tables)")
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def attach_model_hooks(model, hidden_size: int, final_logit_softcapping: Optional[float]) -> None:
    """Embedding scale on the first stage's embedding, logit soft-capping on the last stage's output layer."""
    embedding = getattr(model, "embedding", None)
    if embedding is not None and getattr(model, "pre_process", True):
        scale = torch.tensor(hidden_size ** 0.5, dtype=torch.float32)

        def scale_embeddings(module, inputs, output):
            return output * scale.to(device=output.device, dtype=output.dtype)

        embedding.register_forward_hook(scale_embeddings)
    output_layer = getattr(model, "output_layer", None)
    if final_logit_softcapping and output_layer is not None and getattr(model, "post_process", True):
        cap = float(final_logit_softcapping)

        def softcap(module, inputs, output):
            logits, bias = output
            return torch.tanh(logits / cap) * cap, bias

        output_layer.register_forward_hook(softcap)
