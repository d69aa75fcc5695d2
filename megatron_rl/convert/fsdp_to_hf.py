"""An fsdp training checkpoint (``--train-backend fsdp``, DCP) -> HF safetensors dir.

Steps (one process, no process group; megatron-core is not imported):

1. resolve the input (a checkpoint ROOT -> the ``iter_*`` auto-resume would load:
   ``resume_state.json``'s, else the newest complete one), refuse a megatron torch_dist
   checkpoint or an HF dir by its marker, naming the direction that reads it, and refuse
   incomplete, temp or corrupt dirs (``COMPLETE.json`` with format ``DCP_FORMAT``, every
   file's size and CRC-32, naming a damaged file);
2. read the HF config (``<input>/hf_config``, which the save copied from
   ``--hf-checkpoint``, or ``--hf-config DIR``), build the module on the ``meta`` device
   and refuse a fingerprint (model type, hidden size, layers, heads, vocab) or a tensor
   set / shape that differs from the checkpoint's ``model`` entries;
3. read a ``--bucket-size`` of parameters at a time as full tensors
   (:mod:`megatron_rl.convert.dcp_model`: DCP's offline load reassembles the shards any
   DP size wrote), give each decoder layer's tensors the HF checkpoint's names
   (:func:`~megatron_rl.models.hf_module.hf_checkpoint_names`: transformers' own reverse
   conversion, so a qwen3_moe gets its per-expert names back; tied weights once) and
   write ``--max-shard-size`` shards as they fill; non-finite weights are refused;
4. ``--verify`` reads the checkpoint again and compares every tensor with the written
   files bit for bit; config/tokenizer files are copied (``dtype`` in config.json changed
   only by ``--dtype``), ``COMPLETE.json`` (format ``model_dir.HF_FORMAT``) lists every
   file with size and CRC-32, and the temp dir is renamed into place
   (:func:`~megatron_rl.infra.publish.publish_collectively`).

The values are the sharded fp32 parameters the run trained (with ``--bf16`` too: they are
the master weights), so the output is bit-exact to the model the run held; ``--dtype
bfloat16`` gives what the run exported to its rollout engine.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from megatron_rl.convert import common, dcp_model
from megatron_rl.convert.safetensors_writer import ShardedSafetensorsWriter, parse_size
from megatron_rl.convert.streaming_save import release_free_memory
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import publish_dir
from megatron_rl.infra.checkpoint_root import CorruptCheckpoint, read_complete_marker, temp_dir_for
from megatron_rl.infra.dist import rank0_do
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.models import hf_module, model_dir
from megatron_rl.models.hf_checkpoint import HFCheckpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_BUCKET_BYTES = 10**9


def convert_fsdp_to_hf(ckpt_dir: str, out_dir: str, hf_config_dir: Optional[str] = None,
                       dtype: Optional[torch.dtype] = None, max_shard_size: str | int = "5GB",
                       verify: bool = False, overwrite: bool = False, show_progress: bool = True,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Convert an fsdp checkpoint (an ``iter_NNNNNNN`` dir or its root) to an HF dir ``out_dir``;
    returns a summary dict."""
    t0 = time.time()
    _refuse_torchrun()
    max_shard_bytes = parse_size(max_shard_size)
    given_input = ckpt_dir
    ckpt_dir = model_dir.resolve_dist_dir(os.path.abspath(ckpt_dir))
    common.refuse_other_kind(ckpt_dir, given_input, "fsdp-to-hf")
    out_dir = os.path.abspath(out_dir)
    common.check_output_dir(out_dir, {"--input": given_input, "--hf-config": hf_config_dir}, overwrite, "hf")
    meta = read_marker(ckpt_dir)
    if meta.get("lora"):
        r = meta["lora"]
        raise CheckpointError(f"fsdp checkpoint {ckpt_dir} is a LoRA run's (--lora-rank {r['rank']}): its model "
                              "tensors are the frozen base plus PEFT adapters; export the adapters with "
                              "tools/convert_ckpt.py fsdp-to-peft (peft merges them onto the base: "
                              "PeftModel.from_pretrained(base, DIR).merge_and_unload())")
    config_dir = os.path.abspath(hf_config_dir or os.path.join(ckpt_dir, model_dir.HF_CONFIG_SUBDIR))
    model = hf_module.meta_model(config_dir)
    _check_fingerprint(ckpt_dir, meta, model.config, config_dir)
    specs = dcp_model.model_tensor_specs(ckpt_dir)
    _check_tensors(ckpt_dir, specs, model, config_dir)
    params = [name for name, _ in hf_module.checkpoint_tensors(model)]  # tied weights once, buffers too
    stored_dtype = common.uniform_dtype({n: specs[n][1] for n in params}, f"fsdp checkpoint {ckpt_dir}")
    out_dtype = dtype or stored_dtype
    summary: dict = {}

    def write(tmp: str) -> dict[str, str]:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        bar = _progress(len(params), "fsdp->hf", show_progress)
        count = 0
        try:
            for name, tensor in hf_tensors(ckpt_dir, model, specs, params, bucket_bytes, bar):
                writer.add(name, common.cast_checked(name, tensor, out_dtype))
                count += 1
        finally:
            bar.close()
        index = writer.finish()
        summary.update(tensors=count, files=len(set(index["weight_map"].values())),
                       total_bytes=index["metadata"]["total_size"], peak_pending_bytes=writer.peak_pending_bytes)
        return writer.checksums

    def check(tmp: str) -> None:
        verify_hf_against_fsdp(tmp, ckpt_dir, model, specs, params, dtype, bucket_bytes, show_progress)

    def seal(tmp: str) -> dict:
        update = {"dtype": common.dtype_name(out_dtype)} if dtype is not None else None
        model_dir.copy_aux_files(config_dir, tmp, update)
        return {"format": model_dir.HF_FORMAT, "source": {"kind": "fsdp_dcp", "path": ckpt_dir,
                                                          "optimizer_steps": meta.get("optimizer_steps")},
                "dtype": common.dtype_name(out_dtype)}

    publish_collectively(out_dir, write, seal, verify=check if verify else None)
    summary.update(format=model_dir.HF_FORMAT, output=out_dir, source=ckpt_dir, dtype=common.dtype_name(out_dtype),
                   seconds=round(time.time() - t0, 3), verified=bool(verify))
    return summary


def convert_fsdp_to_peft(ckpt_dir: str, out_dir: str, overwrite: bool = False) -> dict:
    """A ``--train-backend fsdp --lora-rank`` run's checkpoint -> its adapters as a HF PEFT dir ``out_dir``
    (``adapter_model.safetensors`` under PEFT's saved keys + ``adapter_config.json``; written whole or not at
    all). The checkpoint holds PEFT's own modules (``<module>.lora_A.default.weight``), read in one process."""
    from megatron_rl.models.peft_adapter import AdapterExport  # lazy: the LoRA route only

    t0 = time.time()
    _refuse_torchrun()
    given = ckpt_dir
    ckpt_dir = model_dir.resolve_dist_dir(os.path.abspath(ckpt_dir))
    common.refuse_other_kind(ckpt_dir, given, "fsdp-to-hf")  # the same checkpoint kinds as fsdp-to-hf
    out_dir = os.path.abspath(out_dir)
    common.check_output_dir(out_dir, {"--input": given}, overwrite, "peft")
    meta = read_marker(ckpt_dir)
    record = meta.get("lora")
    if not record:
        raise CheckpointError(f"fsdp checkpoint {ckpt_dir} holds no LoRA adapters (a full fine-tuning run's): use "
                              "fsdp-to-hf")
    saved = tuple(record.get("modules_to_save", ()))  # --lora-modules-to-save: trained in full, exported whole

    def wanted(n: str) -> bool:  # PEFT's rules: an adapter tensor, or a weight of a module to save
        module = n.rsplit(".", 1)[0]
        return ".lora_" in n or (".base_layer" not in n and any(module.endswith(t) for t in saved))

    specs = {n: spec for n, spec in dcp_model.model_tensor_specs(ckpt_dir).items() if wanted(n)}
    if not any(".lora_" in n for n in specs):
        raise CheckpointError(f"fsdp checkpoint {ckpt_dir} records --lora-rank {record['rank']} but holds no "
                              "adapter tensors (<module>.lora_A/B.default.weight)")
    tensors = {"base_model.model." + n.replace(".default.weight", ".weight"): t
               for n, t in dcp_model.read_tensors(ckpt_dir, specs).items()}
    config_dir = os.path.join(ckpt_dir, model_dir.HF_CONFIG_SUBDIR)
    tied = False
    if saved and os.path.isfile(os.path.join(config_dir, "config.json")):
        with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as fh:
            tied = bool(json.load(fh).get("tie_word_embeddings", False))
    adapter = AdapterExport(tensors, int(record["rank"]), float(record["alpha"]), saved, tied)
    adapter.modules()  # every module has its A and B of rank r: refused naming the module otherwise
    tmp = temp_dir_for(out_dir)
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)  # a killed earlier run's leftovers (never loaded: hidden, unpublished)
    os.makedirs(tmp)
    adapter.save(tmp, base_model=config_dir if os.path.isdir(config_dir) else "")
    publish_dir(tmp, out_dir)
    return {"output": out_dir, "format": "peft", "tensors": len(tensors), "rank": adapter.rank,
            "alpha": adapter.alpha, "dtype": common.dtype_name(next(iter(tensors.values())).dtype),
            "seconds": round(time.time() - t0, 3)}


def read_marker(path: str) -> dict:
    """``COMPLETE.json`` of an fsdp checkpoint; refuses incomplete / temp / corrupt dirs by name."""
    return rank0_do(lambda: read_complete_marker(path, (hf_module.DCP_FORMAT,), "fsdp checkpoint", {
        "temp": "convert a published iter_NNNNNNN dir",
        "root": "pass the root itself (the iter_* auto-resume would load is used) or one iter_NNNNNNN dir",
        "unmarked": "Convert an older complete iter_NNNNNNN dir",
        "json": "convert another iter_NNNNNNN dir",
        "format": f"fsdp-to-hf reads {hf_module.DCP_FORMAT!r} checkpoints",
        "files": "Restore the files or convert another iter_NNNNNNN dir"}), f"reading {path}")


def hf_tensors(ckpt_dir: str, model: PreTrainedModel, specs: dict, params: list[str], bucket_bytes: int,
               bar=None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)`` for every parameter of ``model``, read a bucket of whole decoder
    layers (or runs of other parameters) at a time; a layer larger than the bucket is read alone.
    Non-finite values are refused, naming the tensors: such weights are no model to publish."""
    for bucket in _buckets(hf_module.layer_units(params), specs, bucket_bytes):
        loaded = dcp_model.read_tensors(ckpt_dir, {n: specs[n] for unit in bucket for n in unit})
        bad = [n for n, t in loaded.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise CorruptCheckpoint(f"fsdp checkpoint {ckpt_dir} holds non-finite (inf/NaN) weights in "
                                    f"{', '.join(bad[:5])}; convert an older iter_NNNNNNN dir")
        for unit in bucket:
            for name, tensor in hf_module.hf_checkpoint_names(model, {n: loaded.pop(n) for n in unit}).items():
                yield name, tensor
            if bar is not None:
                bar.update(len(unit))
        del loaded
        release_free_memory()  # glibc keeps freed heap in RSS otherwise (streaming_save.py measured it)


def _buckets(units: Iterator[list[str]], specs: dict, bucket_bytes: int) -> Iterator[list[list[str]]]:
    bucket: list[list[str]] = []
    size = 0
    for unit in units:
        nbytes = sum(_nbytes(specs[n]) for n in unit)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(unit)
        size += nbytes
    if bucket:
        yield bucket


def _nbytes(spec) -> int:
    shape, dtype = spec
    return int(torch.Size(shape).numel()) * dtype.itemsize


def verify_hf_against_fsdp(hf_dir: str, ckpt_dir: str, model: PreTrainedModel, specs: dict, params: list[str],
                           cast: Optional[torch.dtype], bucket_bytes: int, show_progress: bool = True) -> None:
    """Read the checkpoint again and compare every tensor (cast to ``cast`` when given) bit for bit
    with the files in ``hf_dir``, and the name sets."""
    ref = HFCheckpoint(hf_dir)
    diffs, seen = [], set()
    bar = _progress(len(params), "verify fsdp->hf", show_progress)
    try:
        for name, tensor in hf_tensors(ckpt_dir, model, specs, params, bucket_bytes, bar):
            seen.add(name)
            if cast is not None:
                tensor = tensor.to(cast)
            if name not in ref.names():
                diffs.append(f"{name}: not written")
                continue
            got = ref.read(name)
            if got.dtype != tensor.dtype or tuple(got.shape) != tuple(tensor.shape):
                diffs.append(f"{name}: written {tuple(got.shape)} {got.dtype}, checkpoint {tuple(tensor.shape)} "
                             f"{tensor.dtype}")
            elif not torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)):
                diffs.append(f"{name}: values differ")
    finally:
        bar.close()
        ref.close()
    extra = sorted(ref.names() - seen)
    if extra:
        diffs.append(f"written but not in the checkpoint: {extra[:5]}")
    if diffs:
        raise CheckpointError(f"--verify: written {hf_dir} differs from {ckpt_dir}: {'; '.join(diffs[:10])}")


def _check_fingerprint(path: str, meta: dict, config, config_dir: str) -> None:
    saved, current = meta.get("model") or {}, hf_module.fingerprint(config)
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs config {v!r}" for k, v in current.items()
            if k in saved and saved.get(k) != v]
    if diff:
        raise CheckpointError(f"fsdp checkpoint {path} is of a different model than {config_dir}/config.json "
                              f"({'; '.join(diff)}); pass --hf-config with the config it was trained from")


def _check_tensors(path: str, specs: dict, model: torch.nn.Module, config_dir: str) -> None:
    """The checkpoint's model entries are exactly the module's state dict, shape for shape."""
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = sorted(set(want) - set(specs))
    extra = sorted(set(specs) - set(want))
    shaped = [f"{n} {specs[n][0]} (config: {want[n]})" for n in sorted(set(want) & set(specs))
              if tuple(specs[n][0]) != want[n]]
    if not specs:
        raise CheckpointError(f"fsdp checkpoint {path} holds no model tensors (keys under "
                              f"{hf_module.DCP_MODEL_KEY!r} in its .metadata)")
    if missing or extra or shaped:
        parts = [f"{label} {items[:5]}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing", missing), ("not in the model", extra), ("mis-shaped", shaped))
                 if items]
        raise CheckpointError(f"fsdp checkpoint {path} does not match the model of {config_dir}/config.json "
                              f"({'; '.join(parts)}); pass --hf-config with the config it was trained from")


def _refuse_torchrun() -> None:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() \
        else int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise CheckpointError(f"fsdp-to-hf runs in one process (it reads full tensors from the DCP files, whatever "
                              f"DP size wrote them) but was started with {world} ranks: run it with python, "
                              "not torchrun")


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True, leave=False)
