"""HF safetensors (sharded with an index, or one file) -> megatron-core torch_dist.

Steps (every rank, one process or under torchrun):

1. refuse before any collective, naming tensors: configs the bridge cannot map,
   checkpoint tensors no megatron parameter takes, tensors the config needs that
   are missing, shapes that differ from ``config.json``
   (:func:`megatron_rl.models.weights.check_checkpoint_names`), mixed dtypes
   without ``--dtype``;
2. build this rank's ``GPTModel`` chunks for the layout on the ``meta`` device
   (shapes and sharding, no storage);
3. ``dist_checkpointing.save`` of ``model`` into a hidden temp dir with the
   streaming strategy (:mod:`megatron_rl.convert.streaming_save`): each write item
   is produced from the safetensors when the writer reaches it (each rank reads
   only its slices, as views of the files' pages: :mod:`megatron_rl.convert.mapped_checkpoint`),
   in ``.distcp`` files of ``bucket_bytes``;
4. ``--verify``: reload the temp dir (one process: streamed a bucket at a time by
   :mod:`megatron_rl.convert.streaming_load`; torchrun: into each rank's model
   shard), export it back to HF tensors and compare every one with the source
   (bit-exact; with ``--dtype``, with the source cast to it);
5. rank 0 copies config/tokenizer files to ``hf_config/``, writes ``COMPLETE.json``
   (every file with size and CRC-32; rank 0's ``.distcp`` checksums are computed as its
   writer writes them, :mod:`megatron_rl.convert.file_writer`, other ranks' files are read
   back once) and renames the temp dir into place, so the output exists only when complete.

An input written by ``dist-to-hf`` carries its own ``COMPLETE.json``; its sizes and
checksums are checked first (``model_dir.check_hf_marker``). Every value is checked for
inf/NaN as step 3 reads it (``HFCheckpoint.read``) and after a ``--dtype`` cast (a value out of
the target's range): the refusal names the tensor and file, and nothing is published.

Memory: about the largest local parameter plus one bucket (measured in
``docs/convert.md``); under torchrun ``--verify`` holds the rank's model shard.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from megatron_rl.convert import common, streaming_load, streaming_save
from megatron_rl.convert.mapped_checkpoint import MappedHFCheckpoint
from megatron_rl.errors import BridgeError, CheckpointError, MegatronRLError
from megatron_rl.infra.dist import all_ranks_ok, rank
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.models import dist_io, get_bridge, model_dir
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.parallel import ParallelLayout
from megatron_rl.models.weights import canonical_parameters, check_checkpoint_names, local_row_blocks, local_value


def convert_hf_to_dist(hf_dir: str, out_dir: str, layout=None, dtype: Optional[torch.dtype] = None,
                       verify: bool = False, overwrite: bool = False, show_progress: bool = True,
                       bucket_bytes: int = 10**9, mtp_num_layers: int = 0) -> dict:
    """Convert ``hf_dir`` to a torch_dist dir ``out_dir``; returns the ``COMPLETE.json`` dict.

    Collective when ``torch.distributed`` is initialised (every rank calls it with
    the same arguments). ``layout``: a ``ParallelLayout`` (default: all 1). ``mtp_num_layers``:
    as the training flag ``--mtp-num-layers`` (the checkpoint's MTP layers as megatron's MTP block;
    0: skipped, as transformers does).
    """
    t0 = time.time()
    layout = layout or ParallelLayout()
    given_input = hf_dir
    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    common.refuse_other_kind(hf_dir, given_input, "hf-to-dist")  # a training checkpoint is not an HF dir
    common.check_output_dir(out_dir, {"--input": hf_dir}, overwrite, "torch_dist")
    model_dir.check_hf_marker_once(hf_dir, f"checking {hf_dir}")  # a dist-to-hf output
    bridge = get_bridge(hf_dir, mtp_num_layers=mtp_num_layers)
    ckpt = HFCheckpoint(hf_dir)
    try:
        check_checkpoint_names(bridge, ckpt)
        dtypes = {n: dt for n, dt in common.safetensors_dtypes(ckpt).items() if n in bridge.hf_param_shapes()}
        source_dtype = common.uniform_dtype(dtypes, f"HF checkpoint {hf_dir}") if dtype is None else None
    finally:
        ckpt.close()
    target = dtype or source_dtype
    assert target is not None, "the checkpoint's own dtype is read whenever --dtype is not given"
    layout.validate(torch.distributed.get_world_size() if torch.distributed.is_initialized()
                    else int(os.environ.get("WORLD_SIZE", "1")), bridge.num_layers)

    dist_io.setup(layout)
    chunks = dist_io.build_meta_model(bridge, layout, target)  # the values are streamed in by the writer
    slots = {id(s.param): s for chunk in chunks for s in canonical_parameters(chunk)}
    unmapped = []
    for slot in slots.values():
        try:
            bridge.rule_for(slot.canonical_name)
        except BridgeError:
            unmapped.append(slot.canonical_name)
    all_ranks_ok(CheckpointError(f"model parameters no HF tensor fills: {sorted(unmapped)}; the bridge does "
                                 "not map this config") if unmapped else None)

    def write(tmp: str) -> dict[str, str]:
        bar = dist_io.progress(len(slots), "hf->torch_dist", show_progress, unit="param")
        checksums: dict[str, str] = {}  # .distcp file -> CRC-32, computed as written (not read back)
        ckpt = MappedHFCheckpoint(hf_dir)  # tensors as views of the files' pages: an unchanged one is never copied
        refused: list[MegatronRLError] = []

        def materialize(param: torch.Tensor) -> list[torch.Tensor]:
            try:
                name = slots[id(param)].canonical_name
                slot = slots[id(param)]  # inf/NaN refused as read; [gate; up] kept as its two blocks
                blocks = local_row_blocks(bridge, slot, ckpt) or [local_value(bridge, slot, ckpt)]
                # the parameter's own dtype: `target`, or float32 for a buffer megatron keeps so (expert_bias)
                return [common.cast_checked(name, b, param.dtype) for b in blocks]
            except MegatronRLError as e:
                refused.append(e)
                raise
            finally:
                ckpt.close()  # unmap the shard files: their pages would otherwise stay in this process's RSS
                bar.update(1)

        index = streaming_save.StorageIndex.for_chunks(chunks, materialize)
        try:
            dist_io.dist_checkpointing().save(dist_io.model_sharded_state_dict(chunks), tmp,
                                              sharded_strategy=streaming_save.streaming_strategy(index, bucket_bytes, checksums),
                                              content_metadata={"megatron_rl_format": model_dir.FORMAT})
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if refused and not isinstance(e, MegatronRLError):
                raise refused[0] from e  # torch's writer wraps it in a CheckpointException (a traceback as text)
            raise
        finally:
            index.drop_cached()
            ckpt.close()
            bar.close()
        chunks.clear()  # a meta model: no storage to free, so no gc.collect (~0.2 s with megatron imported)
        return checksums

    def check(tmp: str) -> None:
        verify_dist_against_hf(bridge, tmp, hf_dir, layout, target, cast=dtype, show_progress=show_progress,
                               streaming_bucket_bytes=bucket_bytes if streaming_load.can_stream(layout) else None)

    meta = {"format": model_dir.FORMAT, "source": {"kind": "hf", "path": hf_dir},
            "model_type": bridge.cfg("model_type"), "family": bridge.family, "dtype": common.dtype_name(target),
            "layout": layout.describe(), "model": model_dir.fingerprint(bridge), "mtp_num_layers": bridge.mtp_num_layers,
            "megatron_core": dist_io.mcore_version(), "torch": torch.__version__, "verified": bool(verify)}

    def seal(tmp: str) -> dict:
        update = {"dtype": common.dtype_name(target)} if dtype is not None else None
        model_dir.copy_aux_files(hf_dir, os.path.join(tmp, model_dir.HF_CONFIG_SUBDIR), update)
        return meta

    publish_collectively(out_dir, write, seal, verify=check if verify else None)
    meta["seconds"] = round(time.time() - t0, 3)
    return meta


def verify_dist_against_hf(bridge, dist_dir: str, hf_dir: str, layout, model_dtype: torch.dtype,
                           cast: Optional[torch.dtype], show_progress: bool = True,
                           streaming_bucket_bytes: Optional[int] = None) -> None:
    """Collective: load ``dist_dir`` into a fresh model, export, compare with ``hf_dir`` tensor by tensor.
    With ``streaming_bucket_bytes`` (one process) the reload streams a bucket at a time instead."""
    chunks, source = streaming_load.hf_tensors_of(bridge, dist_dir, layout, model_dtype, hf_dir,
                                                  streaming_bucket_bytes is not None, streaming_bucket_bytes)
    ref = HFCheckpoint(hf_dir) if rank() == 0 else None
    try:
        err = dist_io.compare_stream(source, ref, bridge.hf_param_shapes(),
                                     cast, "HF source", show_progress, compare=rank() == 0)
    finally:
        if ref is not None:
            ref.close()
        if chunks is not None:  # None: streamed, nothing held
            dist_io.free(chunks)
    all_ranks_ok(CheckpointError(f"--verify: torch_dist {dist_dir} reloaded differs from {hf_dir}: {err}")
                 if err else None)
