"""Whether a frozen role's weights fit the policy's parameters, from the two ``config.json`` files alone.

Why here, in ``config`` (stdlib only): validation decides with it before any worker starts (a teacher of
another vocabulary is refused by flag; ``--lora-rank`` with a teacher of its own model is allowed), and the
backends decide with the same rule when they load the weights (``backends/roles.py`` ``needs_own_model``
adds where a torch_dist dir keeps its ``config.json``). One rule, one home.

A weight tag is a copy of the actor's parameter shards: it fits only a model whose every parameter has the
actor's name and shape, which the fields of :data:`SHAPE_FIELDS` decide. Any difference there (a larger
teacher: other hidden size, depth or heads) needs a model of its own; a different ``vocab_size`` is refused
outright, since a teacher or reference scores the student's tokens.
"""

from __future__ import annotations

import json
import os

from megatron_rl.errors import ConfigError

#: the config.json fields that decide whether two models' parameters have the same names and shapes (a weight
#: tag is a copy of the actor's shards: it fits only a model whose every parameter has the actor's shape)
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "head_dim", "moe_intermediate_size", "num_experts",
                "n_routed_experts", "num_local_experts", "tie_word_embeddings", "kv_lora_rank", "q_lora_rank")


def shape_facts(config_dir: str) -> dict:
    """The :data:`SHAPE_FIELDS` of the ``config.json`` in ``config_dir`` (a multimodal config's text model's)."""
    with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    merged = {**raw, **text}
    return {k: merged.get(k) for k in SHAPE_FIELDS}


def shape_differences(policy_dir: str, other_dir: str) -> list[str]:
    """``"field: policy X vs other Y"`` for each shape field in which the two configs differ (empty: a tag fits)."""
    a, b = shape_facts(policy_dir), shape_facts(other_dir)
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in SHAPE_FIELDS if a[k] != b[k]]


def other_shapes(policy_dir: str, other_config_dir: str, path: str, flag: str) -> bool:
    """True when the model whose ``config.json`` is in ``other_config_dir`` (given as ``flag path``) has other
    shapes than the policy's (``--hf-checkpoint policy_dir``); refuses, by flag, one of another vocabulary."""
    if not shape_differences(policy_dir, other_config_dir):
        return False
    a, b = shape_facts(policy_dir), shape_facts(other_config_dir)
    if a["vocab_size"] != b["vocab_size"]:
        raise ConfigError(f"{flag} {path}: its vocabulary has {b['vocab_size']} entries, the policy's "
                          f"{a['vocab_size']} (--hf-checkpoint {policy_dir}); a teacher or reference scores the "
                          "student's tokens, so it needs the student's tokenizer and vocabulary size")
    return True
