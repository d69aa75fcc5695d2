"""megatron-core torch_dist (a converted dir or a training ``iter_NNNNNNN`` dir) -> HF safetensors.

Steps (every rank, one process or under torchrun):

1. resolve the input (a checkpoint ROOT -> the ``iter_*`` its ``resume_state.json``
   names, else its newest complete one) and refuse incomplete, temp or corrupt dirs
   (``COMPLETE.json`` and its file list: every size and CRC-32, naming a damaged file);
2. read the HF config (``<input>/hf_config`` as the converter wrote it, or
   ``--hf-config DIR``), refuse a fingerprint (hidden size, layers, heads, vocab...)
   that differs from the checkpoint's;
3. compare the stored tensor keys and global shapes with the model's at the
   checkpoint's dtype (refusal names missing, extra and mis-shaped tensors);
   optimizer/RNG entries of a training checkpoint are never read;
4. one process: stream (:mod:`megatron_rl.convert.streaming_load`) a bucket of
   parameters (``--bucket-size``) at a time into HF tensors; under torchrun:
   every rank loads its model shard and ``Bridge.export_hf_weights`` gathers
   (collective, every rank gets full HF tensors). Rank 0 writes
   ``--max-shard-size`` shards as they fill (:class:`ShardedSafetensorsWriter`);
   every tensor the config needs must come out, and none may hold inf/NaN (checked on
   the exported values before they are written, and after a ``--dtype`` cast);
5. ``--verify`` re-exports and compares every tensor with the written files; then
   config/tokenizer files are copied (``dtype`` in config.json updated only when
   ``--dtype`` changes it), ``COMPLETE.json`` (format ``model_dir.HF_FORMAT``) lists
   every file with size and CRC-32 (the shards' computed as they were written), and
   the temp dir is renamed into place
   (:func:`~megatron_rl.infra.publish.publish_collectively`).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from megatron_rl.convert import common, file_views, input_digest, lora_export, streaming_load
from megatron_rl.convert.safetensors_writer import ShardedSafetensorsWriter, parse_size
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.dist import all_ranks_ok, rank, rank0_do
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.models import dist_io, get_bridge, model_dir
from megatron_rl.models.hf_checkpoint import HFCheckpoint, check_finite
from megatron_rl.models.parallel import ParallelLayout

DEFAULT_BUCKET_BYTES = 10**9
NON_FINITE_FIX = ("such weights are no model to publish (a run whose weights diverged, or damage the checksums "
                  "cannot see): convert an earlier iter_NNNNNNN dir of the run, or re-create this dir from a sound "
                  "source")


def convert_dist_to_hf(dist_dir: str, out_dir: str, hf_config_dir: Optional[str] = None, layout=None,
                       dtype: Optional[torch.dtype] = None, max_shard_size: str | int = "5GB",
                       verify: bool = False, overwrite: bool = False, show_progress: bool = True,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, merge_lora: bool = False,
                       lora_base: Optional[str] = None) -> dict:
    """Convert a torch_dist dir to an HF dir ``out_dir``; returns a summary dict (rank 0's is complete)."""
    t0 = time.time()
    layout = layout or ParallelLayout()
    max_shard_bytes = parse_size(max_shard_size)
    given_input = dist_dir
    dist_dir = model_dir.resolve_dist_dir(os.path.abspath(dist_dir))
    common.refuse_other_kind(dist_dir, given_input, "dist-to-hf")  # e.g. an fsdp checkpoint: fsdp-to-hf
    out_dir = os.path.abspath(out_dir)
    common.check_output_dir(out_dir, {"--input": given_input, "--hf-config": hf_config_dir}, overwrite, "hf")
    digest = input_digest.InputDigest(dist_dir, dist_io.MODEL_KEY_ROOTS)  # the input check also digests the chunks
    meta = model_dir.read_marker(dist_dir, crc_of=digest.file_crcs)
    config_dir = os.path.abspath(hf_config_dir or os.path.join(dist_dir, model_dir.HF_CONFIG_SUBDIR))
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise CheckpointError(f"no HF config for {dist_dir}: {config_dir}/config.json does not exist; pass "
                              "--hf-config DIR (the HF dir the model was converted or trained from)")
    bridge = get_bridge(config_dir)
    model_dir.check_fingerprint(dist_dir, meta, bridge, config_dir)
    stored = dist_io.checkpoint_model_tensors(dist_dir)
    mtp_layers = stored_mtp_layers(stored)
    if mtp_layers:  # the checkpoint holds megatron's MTP block (--mtp-num-layers): the export keeps it
        bridge = get_bridge(config_dir, mtp_num_layers=mtp_layers)
    spec = lora_export.lora_spec_of(dist_dir, meta)
    if spec is not None and not merge_lora:
        raise CheckpointError(f"torch_dist checkpoint {dist_dir} is a LoRA run's (--lora-rank {spec.rank}): its base "
                              "weights alone are not the trained model; add --merge-lora for the merged model, or "
                              "use dist-to-peft for the adapters as a PEFT dir")
    if spec is not None and verify:
        raise CheckpointError("--verify compares the output with the checkpoint's weights, which --merge-lora changes "
                              "on purpose: drop --verify")
    if spec is None and merge_lora:
        raise CheckpointError(f"--merge-lora: torch_dist checkpoint {dist_dir} holds no LoRA adapters; drop the flag")
    base_dir = lora_export.adapter_only_base(dist_dir, meta, lora_base) if spec is not None else None
    if base_dir is not None:  # an adapter-only checkpoint: the base's values from the HF dir it was trained on
        stored = {n: (tuple(t.shape), t.dtype) for n, t in lora_export.hf_base_tensors(base_dir, shapes_only=True)}
    if not stored:
        raise CheckpointError(f"torch_dist checkpoint {dist_dir} holds no model tensors (keys under "
                              f"{', '.join(dist_io.MODEL_KEY_ROOTS)})")
    stored_dtype = common.uniform_dtype({k: v[1] for k, v in stored.items()}, f"torch_dist checkpoint {dist_dir}")
    out_dtype = dtype or stored_dtype
    layout.validate(torch.distributed.get_world_size() if torch.distributed.is_initialized()
                    else int(os.environ.get("WORLD_SIZE", "1")), bridge.num_layers)

    streaming = streaming_load.can_stream(layout)
    if not (streaming and streaming_load.one_process_groups_ready()):  # rebuilding the same groups: ~0.25 s
        dist_io.setup(layout)
    deltas = {} if spec is None else lora_export.merged_deltas(
        lora_export.read_peft_tensors(bridge, dist_dir, spec), spec)  # HF weight -> alpha/r B A
    # --lora-modules-to-save: an adapter-only checkpoint holds their trained weights, which replace the base's
    saved = lora_export.read_saved_tensors(bridge, dist_dir, spec) if base_dir is not None and spec else {}
    # one process: read a bucket of parameters at a time; torchrun: every rank loads its shard, the
    # export gathers (collective)
    if base_dir is not None:
        chunks, exported = None, lora_export.hf_base_tensors(base_dir)
    else:
        chunks, exported = streaming_load.hf_tensors_of(bridge, dist_dir, layout, stored_dtype, config_dir,
                                                        streaming, bucket_bytes, stored, rows_as_ranges=True)
    expected = bridge.hf_param_shapes()
    summary: dict = {}

    def write(tmp: str) -> Optional[dict[str, str]]:
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes, range_crc=digest.crc) if rank() == 0 else None
        error: Optional[Exception] = None
        seen: set[str] = set()
        bar = dist_io.progress(len(expected), "torch_dist->hf", show_progress)
        for name, tensor in exported:
            if error is not None and streaming:
                break  # one process: nothing to keep in step with
            if writer is None or error is not None:
                continue  # keep draining: the export is collective
            try:
                if name not in expected or tuple(tensor.shape) != tuple(expected[name]):
                    raise CheckpointError(f"export produced {name} {tuple(tensor.shape)}, which "
                                          f"{config_dir}/config.json does not have with that shape (expects "
                                          f"{expected.get(name)})")
                if name in saved:  # a module to save: the run's weights, not the base's
                    tensor = saved[name].to(tensor.dtype)
                if name in deltas:  # --merge-lora: PEFT's merge_and_unload, in float32
                    tensor = (values(tensor).float() + deltas[name]).to(tensor.dtype)
                if not digest.finite(tensor):  # else: its chunks' values were checked by the input check's pass
                    tensor = values(tensor)
                    check_finite(name, tensor, f"torch_dist checkpoint {dist_dir}", fix=NON_FINITE_FIX)
                if tensor.dtype != out_dtype:
                    tensor = values(tensor)
                writer.add(name, common.cast_checked(name, tensor, out_dtype))
                seen.add(name)
                bar.update(1)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = e
            del tensor  # not held while the export reads the next bucket
        bar.close()
        if writer is not None and error is None and set(expected) - seen:
            error = CheckpointError(f"HF tensors left unfilled by the export: {sorted(set(expected) - seen)}; the "
                                    f"checkpoint {dist_dir} lacks parameters {config_dir}/config.json needs")
        all_ranks_ok(error)
        if chunks is not None:  # None: streamed, nothing held
            dist_io.free(chunks)

        def finish() -> None:
            assert writer is not None, "finish runs on rank 0 only, which holds the writer"
            index = writer.finish()
            summary.update(files=len(set(index["weight_map"].values())), total_bytes=index["metadata"]["total_size"],
                           peak_pending_bytes=writer.peak_pending_bytes)

        rank0_do(finish, f"writing {tmp}")
        return writer.checksums if writer is not None else None

    def check(tmp: str) -> None:
        verify_hf_against_dist(bridge, tmp, dist_dir, layout, stored_dtype, dtype, show_progress,
                               streaming_bucket_bytes=bucket_bytes if streaming else None)

    def seal(tmp: str) -> dict:
        update = {"dtype": common.dtype_name(out_dtype)} if dtype is not None else None
        model_dir.copy_aux_files(config_dir, tmp, update)
        return {"format": model_dir.HF_FORMAT, "source": {"kind": "torch_dist", "path": dist_dir},
                "dtype": common.dtype_name(out_dtype)}

    publish_collectively(out_dir, write, seal, verify=check if verify else None)
    summary.update(output=out_dir, source=dist_dir, dtype=common.dtype_name(out_dtype),
                   tensors=len(expected), seconds=round(time.time() - t0, 3), verified=bool(verify),
                   mtp_layers=mtp_layers)
    if bridge.checkpoint_mtp_layers and not mtp_layers:
        summary["note"] = (f"{config_dir}/config.json has num_nextn_predict_layers={bridge.checkpoint_mtp_layers} "
                           f"but {dist_dir} holds no MTP layers (converted or trained without --mtp-num-layers): "
                           f"{out_dir} has none either, so SGLang's EAGLE/NextN speculative decoding has no draft "
                           f"head in it. Convert the HF checkpoint with hf-to-dist --mtp-num-layers "
                           f"{bridge.checkpoint_mtp_layers} (and train with it) to keep them")
    return summary


def values(t: "torch.Tensor | file_views.FileRows") -> torch.Tensor:
    """The tensor itself; a :class:`~megatron_rl.convert.file_views.FileRows` (rows written from their file)
    built where its values are needed."""
    return t.build() if isinstance(t, file_views.FileRows) else t


def stored_mtp_layers(stored: dict) -> int:
    """How many MTP layers (megatron ``mtp.layers.{i}.``) a torch_dist checkpoint's model tensors hold."""
    depths = {int(k.split(".")[2]) for k in stored if k.startswith("mtp.layers.") and k.split(".")[2].isdigit()}
    return max(depths) + 1 if depths else 0


def verify_hf_against_dist(bridge, hf_dir: str, dist_dir: str, layout, model_dtype: torch.dtype,
                           cast: Optional[torch.dtype], show_progress: bool = True,
                           streaming_bucket_bytes: Optional[int] = None) -> None:
    """Collective: reload ``dist_dir``, export again, compare every tensor with the files in ``hf_dir``.
    With ``streaming_bucket_bytes`` (one process) the reload streams too."""
    chunks, source = streaming_load.hf_tensors_of(bridge, dist_dir, layout, model_dtype, hf_dir,
                                                  streaming_bucket_bytes is not None, streaming_bucket_bytes)
    ref = HFCheckpoint(hf_dir) if rank() == 0 else None
    try:
        err = None
        if ref is not None:
            names = ref.names()
            expected = set(bridge.hf_param_shapes())
            if names != expected:
                err = (f"written names differ: missing {sorted(expected - names)}, extra {sorted(names - expected)}")
        exported = ((n, t.to(cast) if cast is not None else t) for n, t in source)
        err2 = dist_io.compare_stream(exported, ref, bridge.hf_param_shapes(), None, "written HF",
                                      show_progress, compare=ref is not None)
        err = "; ".join(e for e in (err, err2) if e) or None
    finally:
        if ref is not None:
            ref.close()
        if chunks is not None:  # None: streamed, nothing held
            dist_io.free(chunks)
    all_ranks_ok(CheckpointError(f"--verify: written {hf_dir} differs from {dist_dir}: {err}") if err else None)
