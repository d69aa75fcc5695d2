"""LoRA on the FSDP backend: HF PEFT's own adapters injected into the HF model before it is sharded.

The megatron backend writes its adapters on megatron-core's parallel linears (``models/lora.py``); this
backend trains the HF model itself, so PEFT's ``inject_adapter_in_model`` is the adapter: the same modules,
initialisation, dropout and names a verl or TRL user gets (``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``), the model class unchanged, the base frozen (``requires_grad`` False:
no gradient, no optimizer state; FSDP2 shards frozen and trainable parameters alike). What the rest of the
backend needs from it:

* the weight tags (the KL reference) keep the adapters only (and ``--lora-modules-to-save``'s modules, trained in
  full): the base never moves, so the initial adapters are the whole difference to the initial policy;
* the engine gets merged weights under the plain HF names (``merge_unit``: ``W + alpha / r * B A`` in
  float32, then the run's dtype), as the megatron backend's ``LoraAdapters.merged()``;
* ``--lora-load DIR`` copies a PEFT adapter dir (``adapter_model.safetensors``, keys as PEFT saves them)
  into the adapters; every adapter must get a tensor and every tensor must find its adapter.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.errors import CheckpointError

ADAPTER = "default"  # PEFT's adapter name, in every parameter name it injects
_SAVED_PREFIX = "base_model.model."  # how PEFT's save_pretrained prefixes the adapter keys


def attach(model: torch.nn.Module, lo) -> None:
    """Inject ``--lora-*``'s adapters into ``model`` (in place) and freeze the rest."""
    from peft import LoraConfig, inject_adapter_in_model  # lazy: peft, only a --lora-rank run imports it

    targets: Any = "all-linear" if list(lo.lora_target_modules) == ["all-linear"] else list(lo.lora_target_modules)
    # PEFT annotates lora_alpha as int, and computes alpha / r in float: a fractional alpha works as written
    config = LoraConfig(r=int(lo.lora_rank), lora_alpha=float(lo.lora_alpha),  # type: ignore[arg-type]
                        lora_dropout=float(lo.lora_dropout), target_modules=targets)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)  # in place: the same module comes back
    saved = tuple(getattr(lo, "lora_modules_to_save", ()))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or is_saved(name, saved))
    if lo.lora_load:
        load_peft_dir(model, lo.lora_load)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_saved(name: str, modules_to_save: tuple[str, ...]) -> bool:
    """Whether parameter ``name`` belongs to a module trained in full beside the adapters (``--lora-modules-to-save``,
    PEFT's ``modules_to_save`` rule: the module's name ends with one of the names). A tied output layer is the
    embedding's parameter itself (``named_parameters`` lists it once, as ``model.embed_tokens.weight``), so it trains
    with it, as PEFT's ``ensure_weight_tying``."""
    module = name.rsplit(".", 1)[0]
    return not is_adapter(name) and ".base_layer" not in name and any(module.endswith(t) for t in modules_to_save)


def load_peft_dir(model: torch.nn.Module, path: str) -> None:
    """Copy a PEFT adapter dir's tensors into the injected adapters (names and shapes checked both ways)."""
    from megatron_rl.models.peft_adapter import read_adapter_tensors  # lazy: only a --lora-load run reads one

    saved = read_adapter_tensors(path, "--lora-load")  # inf/NaN refused naming the tensor and file
    params = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    got: set[str] = set()
    for key, tensor in saved.items():
        name = key[len(_SAVED_PREFIX):] if key.startswith(_SAVED_PREFIX) else key
        name = name.replace(".lora_A.weight", f".lora_A.{ADAPTER}.weight").replace(
            ".lora_B.weight", f".lora_B.{ADAPTER}.weight")
        p = params.get(name)
        if p is None or tuple(p.shape) != tuple(tensor.shape):
            why = "no such adapter" if p is None else f"shape {tuple(tensor.shape)} vs {tuple(p.shape)}"
            raise CheckpointError(f"--lora-load {path}: tensor {key} does not fit this model's adapters ({why}); "
                                  "the adapter dir must be for this model with the run's --lora-* flags")
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
        got.add(name)
    missing = sorted(set(params) - got)
    if missing:
        raise CheckpointError(f"--lora-load {path}: no tensor for {len(missing)} adapter(s) of this model (first: "
                              f"{missing[0]}); pass the --lora-target-modules the adapter dir was trained with")


def saved_key(name: str) -> str:
    """An injected adapter parameter's key in PEFT's ``adapter_model.safetensors``
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj
    .lora_A.weight``)."""
    return _SAVED_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def merge_unit(unit: dict[str, torch.Tensor], scaling: float, merge: bool = True) -> dict[str, torch.Tensor]:
    """One layer's full float32 tensors with the adapters folded in, under the plain HF names:
    ``x.base_layer.weight`` + ``scaling * x.lora_B @ x.lora_A`` -> ``x.weight``; ``x.base_layer.bias`` ->
    ``x.bias``; the adapter tensors themselves dropped. ``merge`` False: the base weights under those names."""
    out: dict[str, torch.Tensor] = {}
    for name, t in unit.items():
        if is_adapter(name):
            continue
        prefix, sep, leaf = name.partition(".base_layer.")
        if not sep:
            out[name] = t
            continue
        if leaf == "weight" and merge:
            a, b = unit[f"{prefix}.lora_A.{ADAPTER}.weight"], unit[f"{prefix}.lora_B.{ADAPTER}.weight"]
            t = t + (b.float() @ a.float()).mul_(scaling).to(t.dtype)
        out[f"{prefix}.{leaf}"] = t
    return out
