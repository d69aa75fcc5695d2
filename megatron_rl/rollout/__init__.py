"""Rollout: the engine boundary (``base``), the embedded torch engine, sampling and rewards.

Importing this package does not import ``transformers``; ``EmbeddedEngine`` is
loaded on first use. ``GenerateRequest`` and ``SamplingParams`` live in
``data.types`` (the prompt data builds requests without importing rollout) and
are re-exported here.
"""

from megatron_rl.rollout.base import (
    ENGINES,
    EngineHealth,
    GenerateRequest,
    RolloutEngine,
    SamplingParams,
    make_engine,
    register_engine,
)

__all__ = ["ENGINES", "EngineHealth", "GenerateRequest", "RolloutEngine", "SamplingParams", "make_engine",
           "register_engine", "EmbeddedEngine"]


def __getattr__(name: str):
    if name == "EmbeddedEngine":
        from megatron_rl.rollout.embedded import EmbeddedEngine  # lazy: the embedded engine loads transformers

        return EmbeddedEngine
    raise AttributeError(f"module 'megatron_rl.rollout' has no attribute {name!r}")
