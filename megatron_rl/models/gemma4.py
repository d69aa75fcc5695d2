"""Gemma 4 text pieces megatron-core 0.16.1 has no switch for, as layer-spec submodules (beside
:mod:`megatron_rl.models.gemma`, whose embedding scale, soft-capping hooks and per-layer-type RoPE it reuses).

* :class:`Gemma4RMSNorm`: HF ``Gemma4RMSNorm``, ``x * (mean(x^2) + eps)^-0.5 * w`` in float32, cast back, with a
  plain gain (Gemma 3's was zero-centred). Every norm of the model, q/k norms included.
* :class:`Gemma4PostNormBda`: the ``self_attn_bda`` / ``mlp_bda`` of a layer that normalises the attention (MLP)
  output before the residual add; the MLP's also multiplies the layer's output by HF's ``layer_scalar`` (a
  checkpoint buffer per layer, kept here as a persistent buffer: loaded, exported, never trained, as HF).
* :class:`Gemma4SelfAttention`: Gemma 3's per-layer-type RoPE (``proportional`` RoPE of the full layers: only the
  first frequencies nonzero) plus HF's ``v_norm``, an RMSNorm of each value head without a gain.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_rl.models.gemma import LayerRopeSelfAttention


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class Gemma4RMSNorm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        super().__init__()
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError(f"Gemma4RMSNorm got normalization={normalization!r}, zero_centered_gamma="
                             f"{zero_centered_gamma}; only a plain-gain RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))  # megatron's SP grad tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms(x, self.eps) * self.weight.float()).type_as(x)


class Gemma4PostNormBda(Gemma4RMSNorm):
    """``(residual + dropout(norm(out + bias))) x layer_scalar`` (``layer_scalar`` only with ``scaled``), called
    as megatron calls a bda: ``bda(training, fused)((out, bias), residual, prob)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, scaled: bool = False, **kwargs):
        super().__init__(config, hidden_size, eps, **kwargs)
        self.scaled = scaled
        if scaled:
            self.register_buffer("layer_scalar", torch.ones(1, dtype=config.params_dtype))

    def forward(self, training: bool, fused: bool):  # type: ignore[override]  # megatron's bda protocol
        add = get_bias_dropout_add(training, False)

        def post_norm_bda(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
            out, bias = x_with_bias
            if bias is not None:
                out = out + bias
            summed = add((Gemma4RMSNorm.forward(self, out), None), residual, prob)
            return summed * self.layer_scalar.to(summed.dtype) if self.scaled else summed

        return post_norm_bda


class Gemma4SelfAttention(LayerRopeSelfAttention):
    """Gemma 3's per-layer-type RoPE attention with each value head RMS-normalised (no gain), as HF's
    ``v_norm``, before attention."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                    split_qkv: bool = True):
        if output_gate or not split_qkv:
            raise NotImplementedError("Gemma4SelfAttention: no output gate, and q / k / v are always split")
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        return query, key, _rms(value, self.config.layernorm_epsilon).type_as(value)
