"""What wraps a megatron model chunk (DDP, ``Float16Module``) and how to reach the chunk inside.

A module of its own, below ``weights.py`` and ``lora.py``: both read through the wrappers, and ``weights.py``
imports ``lora.py`` (which parameters are adapters).
"""

from __future__ import annotations

import torch


def unwrap(model):
    """Strip DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model
