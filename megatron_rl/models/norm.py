"""RMSNorm for the local (no transformer-engine) layer spec.

megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``. Under sequence
parallelism each TP rank normalises only its own sequence slice, so the norm
weight's gradient is partial per rank and must be summed over TP; megatron's
``finalize_model_grads`` does that for parameters carrying
``sequence_parallel=True``. This module is torch's RMSNorm plus that attribute,
with the constructor signature megatron's specs use, so it drops into a
``ModuleSpec`` unchanged (works the same with or without SP).
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError(f"megatron_rl RMSNorm got normalization={normalization!r}, "
                             f"zero_centered_gamma={zero_centered_gamma}; only plain RMSNorm is supported")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))  # megatron's tag on a Parameter
