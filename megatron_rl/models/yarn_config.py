"""``TransformerConfig`` with the YaRN fields megatron-core's GPT model reads for a non-MLA model.

megatron-core 0.16.1 builds ``YarnRotaryEmbedding`` for ``position_embedding_type="yarn"`` from
``config.yarn_*`` attributes that only ``MLATransformerConfig`` has under other names; ``Attention``
multiplies q and k by the YaRN concentration factor (HF's ``attention_scaling``) read from the same
fields. This dataclass adds exactly those fields, so a GQA model (gpt-oss) gets HF's YaRN cos/sin and
attention scaling from megatron's own code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer import TransformerConfig


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """YaRN RoPE for a non-MLA model (field names as megatron-core's ``gpt_model.py`` reads them)."""

    yarn_rotary_scaling_factor: float = 1.0
    """HF ``rope_parameters.factor``."""

    yarn_original_max_position_embeddings: int = 4096
    """HF ``rope_parameters.original_max_position_embeddings``."""

    yarn_beta_fast: float = 32.0
    """HF ``rope_parameters.beta_fast``."""

    yarn_beta_slow: float = 1.0
    """HF ``rope_parameters.beta_slow``."""

    yarn_mscale: Optional[float] = None
    """HF ``rope_parameters.mscale``; None (with ``yarn_mscale_all_dim`` None): the concentration factor is
    ``0.1 ln(factor) + 1``, as HF without mscale."""

    yarn_mscale_all_dim: Optional[float] = None
    """HF ``rope_parameters.mscale_all_dim``."""

    yarn_correction_range_round_to_int: bool = True
    """HF ``rope_parameters.truncate`` (gpt-oss: false)."""
