"""An HF causal LM held as the transformers module itself: the names its checkpoint uses,
and what an FSDP (DCP) training checkpoint of it is.

Two readers need the same facts: the fsdp backend (``backends/fsdp``), which trains the
module and exports its weights to the rollout engine, and the converter
(``convert/fsdp_to_hf.py``), which turns the backend's DCP checkpoints into HF dirs
without the backend (and without megatron-core). Both sit above ``models`` and may not
import each other, so the shared knowledge lives here:

* module names vs checkpoint names: transformers 5 converts some checkpoint tensors when
  it loads them (a qwen3_moe layer's per-expert ``experts.N.gate_proj.weight`` ... become
  one fused ``experts.gate_up_proj``); :func:`hf_checkpoint_names` applies transformers'
  own reverse conversion (what ``save_pretrained`` does), one decoder layer at a time
  (:func:`layer_units`: a conversion never spans layers);
* tied weights appear once, as in the checkpoint: ``named_parameters()`` deduplicates,
  while a module ``state_dict()`` (and so a DCP checkpoint) holds both names;
* the DCP checkpoint's format name, the state-dict key its model lives under and the
  model fingerprint its ``COMPLETE.json`` records (:func:`fingerprint`).

Only ``torch`` and ``transformers`` are imported (lazily for the latter).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from megatron_rl.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DCP_FORMAT = "megatron_rl.fsdp_dcp.v1"  # COMPLETE.json format of a --train-backend fsdp iter_NNNNNNN dir
DCP_MODEL_KEY = "model"  # the DCP state dict is {"model": module state dict, "optimizer": ..., ...}
FINGERPRINT_FIELDS = ("model_type", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                      "vocab_size")


def fingerprint(config) -> dict:
    """The model-shape facts an fsdp checkpoint records, from a transformers config."""
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "vocab_size": int(config.vocab_size)}


def hf_checkpoint_names(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (module names, one decoder layer or one run of other parameters) under the
    HF checkpoint's names: transformers' own ``revert_weight_conversion``; identity where the
    model has no load-time conversion, or on a transformers without them (4.x).

    ``model`` only supplies the conversion mapping (its class and config), so a ``meta``
    model (:func:`meta_model`) gives the same names as the loaded one."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    return revert_weight_conversion(model, tensors)


def layer_of(name: str) -> str | None:
    """``"model.layers.7"`` for a parameter of decoder layer 7, None for any other parameter."""
    parts = name.split(".")
    at = parts.index("layers") if "layers" in parts[:-2] else None
    return ".".join(parts[:at + 2]) if at is not None else None


def checkpoint_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's tensors an HF checkpoint holds, in ``named_parameters`` order: every parameter
    once (tied weights once, as in the checkpoint) plus the persistent buffers, each placed after
    the last tensor of its decoder layer so :func:`layer_units` keeps a layer in one run.

    Why the buffers: GLM-4.5's router ``e_score_correction_bias`` is a buffer that the checkpoint
    holds (fixed during training); an export of parameters alone would drop it, and a loader would
    then start it at zeros."""
    items: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    for prefix, module in model.named_modules():
        for short, tensor in module._buffers.items():
            if tensor is None or short in module._non_persistent_buffers_set:
                continue
            name = f"{prefix}.{short}" if prefix else short
            key = layer_of(name)
            at = max((i for i, (n, _) in enumerate(items) if layer_of(n) == key), default=len(items) - 1)
            items.insert(at + 1, (name, tensor))
    return items


def layer_units(names: Iterable[str]) -> Iterator[list[str]]:
    """``names`` (in ``named_parameters`` order) cut into runs: one per decoder layer, one per
    run of other parameters between them. :func:`hf_checkpoint_names` converts one run at a time."""
    unit: list[str] = []
    key = None
    for name in names:
        here = layer_of(name)
        if unit and here != key:
            yield unit
            unit = []
        key = here
        unit.append(name)
    if unit:
        yield unit


#: config.json model types transformers has no class for, read as the architecture they are: Kimi-K2
#: checkpoints say ``kimi_k2`` (their remote code is DeepSeek-V3's; transformers' own kimi_k25 maps its
#: kimi_k2 text config to deepseek_v3 the same way)
HF_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def hf_config(config_dir: str):
    """``transformers.AutoConfig`` of ``config_dir``, with :data:`HF_MODEL_TYPE_ALIASES` applied."""
    import transformers

    with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as fh:
        raw = json.load(fh)
    alias = HF_MODEL_TYPE_ALIASES.get(raw.get("model_type"))
    if alias is None:
        return transformers.AutoConfig.from_pretrained(config_dir)
    raw = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}  # no remote code to run
    return transformers.AutoConfig.for_model(alias, **raw)


def meta_model(config_dir: str) -> PreTrainedModel:
    """The ``AutoModelForCausalLM`` of ``config_dir/config.json`` on the ``meta`` device: every
    name, shape, tied weight and conversion mapping of the real module, no storage."""
    import transformers

    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise CheckpointError(f"no HF config: {config_dir}/config.json does not exist; pass --hf-config DIR (the "
                              "HF dir the model was trained from)")
    try:
        config = hf_config(config_dir)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise CheckpointError(f"{config_dir}/config.json does not build a transformers causal LM "
                              f"({type(e).__name__}: {e}); pass --hf-config with the config the model was trained "
                              "from") from e
