"""Which roles have a model of their own, and whether their shapes fit the layout they get (stdlib only: the
validation and ``--dry-run`` answer before torch is imported).

A frozen role (reference, teacher) whose ``config.json`` gives the actor's shapes is a weight tag of the actor's
parameters; one of other shapes (a larger teacher) is a model of its own (``backends/roles.py``). A critic with its
own ``--critic-hf-checkpoint`` (or ``--critic-load``'s recorded ``hf_config/``) is built from that config: it may be
smaller than the actor or of another family. Each such model must split over its layout (heads and KV heads over
its TP, layers over its PP) and read the student's tokens (``vocab_problem``).
"""

from __future__ import annotations

import json
import os
from typing import Optional

#: the config.json fields that decide whether two models' parameters have the same names and shapes (a weight
#: tag is a copy of the actor's shards: it fits only a model whose every parameter has the actor's shape)
SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "head_dim", "moe_intermediate_size", "num_experts",
                "n_routed_experts", "num_local_experts", "tie_word_embeddings", "kv_lora_rank", "q_lora_rank")

HF_CONFIG_SUBDIR = "hf_config"  # where a torch_dist model dir keeps its source's config (models/model_dir.py)


def config_dir(path: Optional[str]) -> Optional[str]:
    """The dir holding the ``config.json`` of the model at ``path``: an HF dir itself, a torch_dist model dir's
    ``hf_config/``; None when neither has one (a training checkpoint root: the actor's shapes by definition)."""
    if not path:
        return None
    for d in (path, os.path.join(path, HF_CONFIG_SUBDIR)):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    return None


def shape_facts(d: str) -> dict:
    """The ``SHAPE_FIELDS`` of ``d/config.json`` (a multimodal config's text model's where it has one)."""
    with open(os.path.join(d, "config.json")) as f:
        raw = json.load(f)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    merged = {**raw, **text}
    return {k: merged.get(k) for k in SHAPE_FIELDS}


def shape_differences(policy_dir: str, other_dir: str) -> list[str]:
    """``"field: policy X vs other Y"`` for each shape field in which the two configs differ (empty: a tag fits)."""
    a, b = shape_facts(policy_dir), shape_facts(other_dir)
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in SHAPE_FIELDS if a[k] != b[k]]


def own_model_dir(policy_dir: Optional[str], path: Optional[str]) -> Optional[str]:
    """The config dir of the model at ``path`` when its shapes differ from the policy's, else None."""
    other = config_dir(path)
    if other is None or policy_dir is None or not os.path.isfile(os.path.join(policy_dir, "config.json")):
        return None
    try:
        return other if shape_differences(policy_dir, other) else None
    except (OSError, ValueError):
        return None


def vocab_problem(flag: str, path: Optional[str], mine, policy, policy_dir: str) -> Optional[str]:
    """Why a model of its own cannot read the policy's tokens, or None. Its vocabulary must hold every id of the
    policy's (the same tokenizer; a larger model's embedding is often padded further: Qwen2.5-7B has 152064 rows
    where 0.5B has 151936, and its log-softmax is over its own rows, as its HF model and an engine compute it)."""
    if mine is None or policy is None or int(mine) >= int(policy):
        return None
    return (f"{flag} {path}: its vocabulary has {mine} entries, fewer than the policy's {policy} (--hf-checkpoint "
            f"{policy_dir}); it scores the student's tokens, so it needs the student's tokenizer")


def fit_errors(flag: str, path: Optional[str], d: str, policy_dir: str, *, tp: int, pp: int, tp_flag: str,
               pp_flag: str) -> list[str]:
    """Why the model of its own at ``path`` (config in ``d``) cannot run at TP ``tp`` / PP ``pp``, or read the
    policy's tokens: each reason names the flag and the fix."""
    try:
        mine, policy = shape_facts(d), shape_facts(policy_dir)
    except (OSError, ValueError) as e:
        return [f"{flag} {path}: its config.json cannot be read ({e})"]
    errors = []
    problem = vocab_problem(flag, path, mine["vocab_size"], policy["vocab_size"], policy_dir)
    if problem:
        errors.append(problem)
    for what in ("num_attention_heads", "num_key_value_heads"):
        n = mine[what] if what != "num_key_value_heads" else (mine[what] or mine["num_attention_heads"])
        if n and tp > 1 and int(n) % tp:
            errors.append(f"{flag} {path}: its {what}={n} does not split over TP {tp} ({tp_flag}); choose a TP "
                          f"dividing {n}")
    layers = mine["num_hidden_layers"]
    if layers and pp > 1 and int(layers) % pp:
        errors.append(f"{flag} {path}: its {layers} layers do not split into {pp} pipeline stages ({pp_flag}); "
                      f"choose a divisor of {layers}")
    return errors
