"""LoRA adapters out of a ``--lora-rank`` run's torch_dist checkpoint: as a HF PEFT directory, or merged.

A LoRA checkpoint holds the base weights, the adapters (``lora.adapters.<linear>.lora_{A,B}.<i>``, the i-th
adapted HF module of that megatron linear) and their optimizer state; its ``COMPLETE.json`` says the
rank, alpha and target modules (``lora``). The adapters' global tensors are PEFT's own: a column-parallel
linear's B is sharded over TP by rows, which megatron's checkpoint stitches back into the HF row order of
that module; a row-parallel linear's A likewise by columns (``megatron_rl/models/lora.py``).

* ``dist-to-peft``: ``adapter_model.safetensors`` + ``adapter_config.json`` (``peft.PeftModel.from_pretrained``
  on the base model loads it; SGLang's ``/load_lora_adapter`` serves it);
* ``dist-to-hf --merge-lora``: the full model with ``W + alpha / r * B A`` folded into each adapted weight
  (PEFT's ``merge_and_unload``), what the run's engine was synced with.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Optional

import torch

from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.convert import common
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_json, publish_dir
from megatron_rl.infra.checkpoint_root import temp_dir_for
from megatron_rl.models import dist_io, get_bridge, model_dir
from megatron_rl.models.hf_checkpoint import weights_digest
from megatron_rl.models.lora import LoraSpec, peft_key
from megatron_rl.models.peft_adapter import SAVED_PREFIX, with_tied_head
from megatron_rl.models.parallel import ParallelLayout
from megatron_rl.models.weights import ParamSlot, canonical_parameters, export_slot

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def lora_spec_of(dist_dir: str, meta: dict) -> Optional[LoraSpec]:
    """The checkpoint's adapters (None: a full fine-tuning checkpoint); refuses adapters without their record."""
    record = meta.get("lora")
    if record is None:
        if dist_io.checkpoint_adapter_tensors(dist_dir):
            raise CheckpointError(f"torch_dist checkpoint {dist_dir} holds LoRA adapter tensors but its COMPLETE.json "
                                  "has no 'lora' record (rank, alpha, targets): it was written by an older version")
        return None
    return LoraSpec(int(record["rank"]), float(record["alpha"]), target_modules=tuple(record["target_modules"]),
                    modules_to_save=tuple(record.get("modules_to_save", ())))


def adapter_only_base(dist_dir: str, meta: dict, given: Optional[str] = None) -> Optional[str]:
    """The HF base of an adapter-only LoRA checkpoint (its ``lora_base`` record: the run's ``--hf-checkpoint`` and
    its weights digest), or None for an older LoRA checkpoint that holds the base itself. ``given``
    (``--lora-base``) replaces the recorded path, e.g. a copy on this machine; either must have the digest."""
    record = meta.get("lora_base")
    if record is None:
        return None
    base = os.path.abspath(given or record["hf_checkpoint"])
    if not os.path.isdir(base):
        raise CheckpointError(f"torch_dist checkpoint {dist_dir} holds LoRA adapters without their frozen base, "
                              f"which was {record['hf_checkpoint']}; {base} does not exist: pass --lora-base DIR, "
                              "a copy of that HF checkpoint")
    if weights_digest(base) != record["weights_digest"]:
        raise CheckpointError(f"--lora-base {base}: its weights are not the base {dist_dir}'s adapters were trained "
                              f"on ({record['hf_checkpoint']}, digest {record['weights_digest'][:12]}...): pass a "
                              "copy of that HF checkpoint")
    return base


def peft_base(dist_dir: str, meta: dict, given: Optional[str] = None) -> tuple[str, Optional[str]]:
    """``base_model_name_or_path`` for the PEFT dir of ``dist_dir``'s adapters, and a note when a loader cannot
    find weights there. The base is the HF dir the adapters were trained on: the ``lora_base`` of
    ``COMPLETE.json`` (the run's ``--hf-checkpoint``, checked by its weights digest when it exists here), or
    ``given`` (``--lora-base``, a copy; checked likewise). Was: the checkpoint's ``hf_config`` folder, which
    holds no weights, so ``AutoPeftModelForCausalLM.from_pretrained(peft_dir)`` failed."""
    record = meta.get("lora_base")
    if record is None:  # an older LoRA checkpoint: it holds the base itself; no HF dir with weights is recorded
        if given:
            return os.path.abspath(given), None
        return "", (f"{dist_dir} records no HF base (an older LoRA checkpoint, which holds its base itself): "
                    "adapter_config.json's base_model_name_or_path is empty; pass --lora-base DIR (the HF dir the "
                    "run started from) so that AutoPeftModelForCausalLM can load the adapters alone")
    if given or os.path.isdir(record["hf_checkpoint"]):
        base = adapter_only_base(dist_dir, meta, given)
        assert base is not None, "a lora_base record gives a base"
        return base, None
    return record["hf_checkpoint"], (f"base_model_name_or_path is the run's --hf-checkpoint {record['hf_checkpoint']} "
                                     "(recorded in COMPLETE.json), which does not exist on this machine: "
                                     "AutoPeftModelForCausalLM loads it from there; pass --lora-base DIR (a copy, "
                                     "checked by its weights digest) to name another path")


def hf_base_tensors(base_dir: str, shapes_only: bool = False):
    """``(HF name, tensor)`` of every weight of the HF dir ``base_dir``, one at a time (the adapters' file
    skipped); ``shapes_only``: empty tensors of the stored shapes and dtypes (headers only)."""
    for fname in sorted(f for f in os.listdir(base_dir) if f.endswith(".safetensors") and f != ADAPTER_WEIGHTS):
        with safe_open(os.path.join(base_dir, fname), framework="pt") as fh:
            for name in fh.keys():
                if shapes_only:
                    sl = fh.get_slice(name)
                    dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
                        sl.get_dtype(), "float32"))
                    yield name, torch.empty(sl.get_shape(), dtype=dtype, device="meta")
                else:
                    yield name, fh.get_tensor(name)


def read_peft_tensors(bridge, dist_dir: str, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the checkpoint under its PEFT key (full tensors; one process). Collective-free:
    call after ``dist_io.setup`` of a one-rank layout."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # lazy: megatron

    keys = dist_io.checkpoint_adapter_tensors(dist_dir)
    if not keys:
        raise CheckpointError(f"torch_dist checkpoint {dist_dir} holds no LoRA adapter tensors")
    dc = dist_io.dist_checkpointing()
    md = dc.load_tensors_metadata(dist_dir)
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(md[k].global_shape), dtype=md[k].dtype),
                                                  replica_id=0) for k in keys}
    try:
        loaded = dc.load(request, dist_dir, validate_access_integrity=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"reading the LoRA adapters of {dist_dir} failed ({type(e).__name__}: {e})") from e
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        head, which, index = key[len("lora.adapters."):].rsplit(".", 2)  # decoder/layers/0/..., lora_A, 0
        canonical = head.replace("/", ".")
        modules = [n[: -len(".weight")] for n in bridge.rule_for(canonical + ".weight").hf_names]
        targeted = [m for m in modules if spec.targets(m)]
        if int(index) >= len(targeted):
            raise CheckpointError(f"{dist_dir}: adapter tensor {key} has no HF module among {targeted} (the "
                                  f"checkpoint's --lora-target-modules {list(spec.target_modules)})")
        tensor = loaded[key]
        out[peft_key(targeted[int(index)], which[-1])] = tensor.data if hasattr(tensor, "data") else tensor
    return out


def read_saved_tensors(bridge, dist_dir: str, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """HF weight name -> full tensor of every weight of the checkpoint's modules to save (``--lora-modules-to-save``:
    the base parameters an adapter-only checkpoint holds beside the adapters). Which parameter a stored key is, and
    its layer along a stacked key's first axis, come from a one-rank model on the ``meta`` device (its
    ``sharded_state_dict``, as the training checkpoint wrote it); each value goes to HF through the bridge's export.
    Call after ``dist_io.setup`` of a one-rank layout."""
    if not spec.modules_to_save:
        return {}
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # lazy: megatron

    stored = dist_io.checkpoint_model_tensors(dist_dir)
    dc = dist_io.dist_checkpointing()
    md = dc.load_tensors_metadata(dist_dir)
    chunks = dist_io.build_meta_model(bridge, ParallelLayout(), md[next(iter(stored))].dtype) if stored else []
    slots = {id(slot.param): slot for chunk in chunks for slot in canonical_parameters(chunk)}
    wanted: dict[str, list] = {}  # stored key -> [(slot, index along the stacked axis or None)]
    for model_sd in dist_io.model_sharded_state_dict(chunks).values():
        for entry in model_sd.values():
            if isinstance(entry, ShardedTensor) and entry.key in stored and id(entry.data) in slots:
                at = entry.global_offset[0] if entry.prepend_axis_num else None
                wanted.setdefault(entry.key, []).append((slots[id(entry.data)], at))
    unknown = sorted(set(stored) - set(wanted))
    if unknown:
        raise CheckpointError(f"{dist_dir}: stored model tensors {unknown[:5]} are none of the model's parameters")
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(tuple(md[k].global_shape), dtype=md[k].dtype),
                                                  replica_id=0) for k in wanted}
    try:
        loaded = dc.load(request, dist_dir, validate_access_integrity=False) if request else {}
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"reading the modules to save of {dist_dir} failed ({type(e).__name__}: {e})") from e
    out: dict[str, torch.Tensor] = {}
    for key, places in wanted.items():
        full = loaded[key]
        full = full.data if hasattr(full, "data") else full
        for slot, at in places:
            value = full[at] if at is not None else full
            names = list(bridge.exported_names(slot.canonical_name))
            if names:
                one = ParamSlot(slot.canonical_name, value, False, None, slot.layer)
                out.update((n, t.clone()) for n, t in export_slot(bridge, one, names, copy=True))
    return out


def merged_deltas(peft: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """HF weight name -> ``alpha / r * B A`` (float32) for every adapted module."""
    deltas: dict[str, torch.Tensor] = {}
    for key, a in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len("base_model.model."): -len(".lora_A.weight")]
        b = peft[peft_key(module, "B")]
        deltas[module + ".weight"] = (b.float() @ a.float()) * spec.scaling
    return deltas


def adapter_config(spec: LoraSpec, peft: dict[str, torch.Tensor], base: str, tied: bool = False) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters (plain LoRA: no rsLoRA, DoRA or bias); with modules to save,
    their names (``modules_to_save``) and, on a model whose output layer is its embedding (``tied``), PEFT's
    ``ensure_weight_tying``, so that PEFT's trained embedding is its output layer too, as in the run."""
    modules = sorted({k[len("base_model.model."):].split(".lora_")[0].rsplit(".", 1)[-1] for k in peft
                      if ".lora_" in k})
    saved = list(spec.modules_to_save) or None
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": saved,
            "ensure_weight_tying": bool(saved) and tied, "base_model_name_or_path": base, "inference_mode": True}


def convert_dist_to_peft(dist_dir: str, out_dir: str, hf_config_dir: Optional[str] = None,
                         overwrite: bool = False, lora_base: Optional[str] = None) -> dict:
    """A LoRA run's torch_dist checkpoint -> a PEFT adapter directory ``out_dir`` (written whole or not at all);
    its ``base_model_name_or_path`` is the HF base the adapters were trained on (:func:`peft_base`)."""
    t0 = time.time()
    given = dist_dir
    dist_dir = model_dir.resolve_dist_dir(os.path.abspath(dist_dir))
    common.refuse_other_kind(dist_dir, given, "dist-to-hf")  # the same checkpoint kinds as dist-to-hf
    out_dir = os.path.abspath(out_dir)
    common.check_output_dir(out_dir, {"--input": given, "--hf-config": hf_config_dir}, overwrite, "peft")
    meta = model_dir.read_marker(dist_dir)
    spec = lora_spec_of(dist_dir, meta)
    if spec is None:
        raise CheckpointError(f"torch_dist checkpoint {dist_dir} holds no LoRA adapters (a full fine-tuning run's): "
                              "use dist-to-hf")
    config_dir = os.path.abspath(hf_config_dir or os.path.join(dist_dir, model_dir.HF_CONFIG_SUBDIR))
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise CheckpointError(f"no HF config for {dist_dir}: {config_dir}/config.json does not exist; pass "
                              "--hf-config DIR (the HF dir the model was trained from)")
    base, note = peft_base(dist_dir, meta, lora_base)
    bridge = get_bridge(config_dir)
    dist_io.setup(ParallelLayout())
    peft = read_peft_tensors(bridge, dist_dir, spec)
    saved = read_saved_tensors(bridge, dist_dir, spec)  # PEFT saves a module to save whole, under its weight names
    peft = with_tied_head({**peft, **{SAVED_PREFIX + name: t for name, t in saved.items()}},
                          bool(bridge.tie_word_embeddings))
    tmp = temp_dir_for(out_dir)
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)  # a killed earlier run's leftovers (never loaded: hidden, unpublished)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in peft.items()}, os.path.join(tmp, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    atomic_write_json(os.path.join(tmp, ADAPTER_CONFIG),
                      adapter_config(spec, peft, base, tied=bool(bridge.tie_word_embeddings)))
    publish_dir(tmp, out_dir)
    return {"output": out_dir, "format": "peft", "tensors": len(peft),
            "dtype": common.dtype_name(next(iter(peft.values())).dtype), "rank": spec.rank, "alpha": spec.alpha,
            "target_modules": list(spec.target_modules), "base_model_name_or_path": base,
            **({"modules_to_save": list(spec.modules_to_save)} if spec.modules_to_save else {}),
            "seconds": round(time.time() - t0, 3), **({"note": note} if note else {})}
