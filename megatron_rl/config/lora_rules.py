"""``--lora-modules-to-save``: the names PEFT's ``modules_to_save`` rule gives, checked against the checkpoint.

PEFT trains a module in full beside the adapters when its name ends with one of the names (``norm`` picks every
norm, ``embed_tokens`` the embedding). Checked before any worker starts, from ``--hf-checkpoint``'s weight names
(the safetensors index or headers: stdlib only), so every pipeline stage's modules are known: a name that picks
nothing, a name that picks a linear LoRA adapts (a target, not a module to save), and ``lm_head`` on a model whose
output layer is its embedding (``tie_word_embeddings``: name ``embed_tokens``, which trains both, as PEFT's
``ensure_weight_tying``).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

from .architecture import TIED_BY_DEFAULT_TYPES, read_hf_config, text_config
from .schema import Config

LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def hf_weight_names(hf_dir: str) -> Optional[list[str]]:
    """The tensor names of a HF checkpoint dir (its ``*.safetensors.index.json``, else each ``*.safetensors``
    file's header), None when there is none to read."""
    try:
        files = sorted(os.listdir(hf_dir))
    except OSError:
        return None
    for f in files:
        if f.endswith(".safetensors.index.json"):
            try:
                with open(os.path.join(hf_dir, f), encoding="utf-8") as fh:
                    return list(json.load(fh).get("weight_map", {}))
            except (OSError, ValueError):
                return None
    names: list[str] = []
    for f in files:
        if f.endswith(".safetensors"):
            try:
                with open(os.path.join(hf_dir, f), "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    names.extend(k for k in json.loads(fh.read(n)) if k != "__metadata__")
            except (OSError, ValueError, struct.error):
                return None
    return names or None


def _tied(hf_dir: str) -> bool:
    try:
        c = text_config(read_hf_config(hf_dir))
    except (OSError, ValueError):
        return False
    return bool(c.get("tie_word_embeddings", c.get("model_type") in TIED_BY_DEFAULT_TYPES))


def modules_to_save_errors(cfg: Config) -> list[str]:
    """What ``--lora-modules-to-save`` cannot be, one line each naming the value and the fix."""
    names = list(cfg.lora.lora_modules_to_save)
    if not names:
        return []
    errors = []
    hf_dir = cfg.model.hf_checkpoint
    weights = hf_weight_names(hf_dir) if hf_dir else None
    modules = sorted({w.rsplit(".", 1)[0] for w in weights or ()})
    tied = _tied(hf_dir) if hf_dir else False
    if tied and "lm_head" not in modules:
        modules.append("lm_head")  # the tied output layer: a module of the model, its weight the embedding's
    for name in names:
        picked = [m for m in modules if m.endswith(name)]
        linears = sorted({m.rsplit(".", 1)[-1] for m in picked} & set(LORA_LINEARS))
        if name.rsplit(".", 1)[-1] in LORA_LINEARS or linears:
            errors.append(f"--lora-modules-to-save {name}: picks the linear(s) {', '.join(linears or [name])}, which "
                          "LoRA adapts (--lora-target-modules); name non-linear modules (embed_tokens, lm_head, norm)")
        elif weights is not None and not picked:
            errors.append(f"--lora-modules-to-save {name}: picks no module of {hf_dir} (PEFT's rule: a module whose "
                          "name ends with it; e.g. embed_tokens, lm_head, norm, input_layernorm)")
        elif tied and any(m.endswith("lm_head") for m in picked) and not any(
                m.endswith("embed_tokens") for n in names for m in modules if m.endswith(n)):
            errors.append(f"--lora-modules-to-save {name}: this model's output layer is its embedding "
                          "(tie_word_embeddings); name embed_tokens, which trains both as one weight (PEFT's "
                          "ensure_weight_tying)")
    return errors
