"""The host's random number generators, captured and restored for exact resume.

Both training backends checkpoint this per rank (``random``, numpy, torch CPU and, when
present, the current CUDA device's generator) so that a resumed run draws the same numbers
as the run it continues; megatron's backend adds its tensor-parallel RNG tracker on top.
Plain ints / lists / tensors, so the state loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random

import torch


def host_rng_state() -> dict:
    """This process's RNG states: ``{"random", "numpy", "torch", "cuda"}`` (``cuda`` None without CUDA)."""
    import numpy as np

    state = np.random.get_state()
    assert isinstance(state, tuple), "the global RandomState is MT19937, whose legacy state is a tuple"
    kind, keys, pos, has_gauss, cached = state
    return {"random": random.getstate(), "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def restore_host_rng_state(state: dict) -> None:
    """Inverse of ``host_rng_state`` (extra keys, such as megatron's tracker, are the caller's)."""
    import numpy as np

    r = state["random"]
    random.setstate((r[0], tuple(r[1]), r[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
