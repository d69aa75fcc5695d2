"""Write a torch_dist checkpoint whose tensors are produced one at a time.

``dist_checkpointing.save`` takes a sharded state dict whose ``data`` tensors
already hold the values, so saving a model means holding it. Converting an HF
checkpoint does not need that: each value is a pure function of a few HF
tensors (``weight_maps``). This module keeps megatron's own save path for
everything that decides the *layout* and swaps in a lazy source only for the
*bytes*:

* the model is built on the ``meta`` device (no storage), and its
  ``sharded_state_dict()`` gives exactly the keys, global shapes, offsets,
  replica ids and ``ShardedTensorFactory`` splits (gated ``linear_fc1``) a real
  model would; ``dist_checkpointing.save`` still runs its validation, writes
  ``common.pt`` (with ``content_metadata``) and ``metadata.json``;
* ``StreamingTorchDistSaveStrategy`` is megatron's torch_dist strategy
  (same backend name and version, same key flattening, same
  ``MCoreSavePlanner`` planning and dedup), but it writes synchronously, one
  write item at a time, the records and files torch's ``FileSystemWriter`` writes
  (:class:`_BucketedWriter`: a new ``.distcp`` file every ``bucket_bytes``, each
  value dropped once written; megatron's async writer resolves every tensor up
  front). Bytes an item takes unchanged from the HF files are copied from them
  inside the kernel, and the ``torch.save`` records' CRC-32s come from the pass
  that hashes the file (:mod:`megatron_rl.convert.file_writer`);
* :class:`_LazyPlanner.resolve_data` turns the meta tensor of a write item into
  values: it finds the parameter the meta tensor views (by storage), asks
  ``materialize(param)`` for that parameter's full local value, and takes the
  same view (``as_strided``) of it. One materialised parameter is cached, so the
  two halves of a gated ``linear_fc1`` cost one read.

Peak memory is therefore about one local parameter (plus the mapped pages of the
HF range being written), not the model; ``benchmarks/convert.py`` measures it. The output is what
``dist_checkpointing.load`` reads; the tests compare it byte for byte with a
``dist_checkpointing.save`` of the loaded model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from megatron_rl.convert.file_writer import FileWriter, fsync_later, wait_synced
from megatron_rl.errors import CheckpointError
from megatron_rl.models.weights import named_state_tensors

# a meta parameter or persistent buffer -> its values, or the row blocks (dim 0) they concatenate
Materialize = Callable[[torch.Tensor], "torch.Tensor | list[torch.Tensor]"]

_malloc_trim: Callable[[int], int] | Literal[False] | None = None  # resolved on first use: libc's malloc_trim, or False where there is none


def release_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Why: glibc raises its mmap threshold after large frees, so the next tensors of
    a few MB come from the heap, and freed heap pages stay in the process's RSS.
    Measured on a 200 MB llama: without it the conversion's peak grew by ~50 MB
    of freed-but-kept memory over the run; with it the peak is the largest tensor
    plus one bucket plus a fixed ~20 MB.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def storage_key(t: torch.Tensor) -> int:
    # Why storage identity: views of a meta tensor (detach, chunk, view) share its
    # StorageImpl, and meta tensors have no data pointer to compare.
    return t.untyped_storage()._cdata


class StorageIndex:
    """Meta parameters by storage, plus the one-entry value cache ``resolve`` uses."""

    def __init__(self, params: dict[int, tuple[str, torch.Tensor]], materialize: Materialize):
        self._params = params
        self._materialize = materialize
        self._cached: Optional[tuple[int, list[torch.Tensor]]] = None
        self.materialized = 0  # parameters read (one per cache miss)

    @classmethod
    def for_chunks(cls, chunks, materialize: Materialize) -> "StorageIndex":
        params = {}
        for chunk in chunks:
            for name, p in named_state_tensors(chunk):  # a persistent buffer (router expert_bias) is written too
                if not p.is_meta:
                    raise CheckpointError(f"streaming save needs a model built on the meta device; {name} is on "
                                          f"{p.device}")
                params[storage_key(p)] = (name, p)
        return cls(params, materialize)

    def drop_cached(self) -> None:
        """Let the last value go now: the save's planner and writer hold this index in reference cycles, which
        only a (slow) ``gc.collect`` would break, keeping that value, often the largest tensor, alive."""
        self._cached = None

    def resolve(self, view: torch.Tensor) -> torch.Tensor:
        """Values for ``view`` (a meta tensor that views one model parameter)."""
        key = storage_key(view)
        if key not in self._params:
            raise CheckpointError(f"streaming save: a {tuple(view.shape)} tensor of the sharded state dict views no "
                                  "model parameter (a buffer?); it cannot be produced from the HF checkpoint")
        name, param = self._params[key]
        if self._cached is None or self._cached[0] != key:
            self._cached = None  # drop the previous value before reading the next
            release_free_memory()
            value = self._materialize(param)
            blocks = [b.contiguous() for b in (value if isinstance(value, list) else [value])]
            shape = (sum(b.shape[0] for b in blocks), *blocks[0].shape[1:]) if blocks[0].dim() else ()
            if any(b.shape[1:] != blocks[0].shape[1:] or b.dtype != param.dtype for b in blocks) or \
                    shape != tuple(param.shape):
                built = tuple(blocks[0].shape) if len(blocks) == 1 else [tuple(b.shape) for b in blocks]
                raise CheckpointError(f"streaming save: {name} was built as {built} {blocks[0].dtype}, the model "
                                      f"parameter is {tuple(param.shape)} {param.dtype}")
            self._cached = (key, blocks)
            self.materialized += 1
        blocks = self._cached[1]
        offset = view.storage_offset() - param.storage_offset()
        start = 0
        for block in blocks:  # a view that is exactly one block (half of a gated linear_fc1) is that block
            if len(blocks) > 1 and start == offset and block.numel() == view.numel() and view.is_contiguous():
                return block.view(view.size())
            start += block.numel()
        if len(blocks) > 1:  # any other view of a concatenation: build it once
            blocks[:] = [torch.cat(blocks)]
        value = blocks[0]
        return value.as_strided(view.size(), view.stride(), value.storage_offset() + offset)


def _lazy_planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    class _LazyPlanner(MCoreSavePlanner):
        """``MCoreSavePlanner`` whose meta tensors are produced on demand by ``index``."""

        def __init__(self, index: StorageIndex, **kwargs):
            super().__init__(**kwargs)
            self._index = index

        def resolve_data(self, write_item):
            obj = super().resolve_data(write_item)
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                return self._index.resolve(obj)
            return obj

    return _LazyPlanner


def _item_bytes(item) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for size in item.tensor_data.chunk.sizes:
        n *= int(size)
    return n * item.tensor_data.properties.dtype.itemsize


def split_into_buckets(items: list, bucket_bytes: int) -> list[list]:
    """Consecutive write items in files of at most ``bucket_bytes`` of tensor data (an item
    larger than that gets a file of its own); the small byte items go with the first file."""
    byte_items = [i for i in items if i.tensor_data is None]
    buckets: list[list] = [list(byte_items)]
    size = 0
    for item in (i for i in items if i.tensor_data is not None):
        n = _item_bytes(item)
        if size and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += n
    return [b for b in buckets if b]


def _bucketed_writer_class():
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    class _BucketedWriter(FileSystemWriter):
        """``FileSystemWriter``'s ``.distcp`` files (same names, same records, same metadata) written one item
        at a time by this process, a new file every ``bucket_bytes``, through :class:`FileWriter`: bytes
        that are an input file's moved inside the kernel, each tensor's ``torch.save`` record CRC-32s
        computed in the pass that hashes the file (``torch_archive``), every file fsynced, its CRC-32
        into ``checksums``. Each value is dropped once written, so what is held is the item being written."""

        def __init__(self, path, bucket_bytes: int, checksums: dict[str, str]):
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
            self.bucket_bytes = bucket_bytes
            self.checksums = checksums

        def write_data(self, plan, planner):
            results = []
            synced: list = []  # each file's fsync runs in the background while the next file is written
            for i, bucket in enumerate(split_into_buckets(plan.items, self.bucket_bytes)):
                # the same naming as FileSystemWriter.write_data: __{rank}_{file}.distcp
                name = f"{plan.storage_data.prefix}{i}.distcp"
                with FileWriter(os.fspath(self.fs.concat_path(self.path, name))) as stream:
                    for item in bucket:  # byte items first, as torch writes them (split_into_buckets)
                        data = planner.resolve_data(item)
                        if item.type == WriteItemType.BYTE_IO:
                            results.append(_write_item(self.transforms, stream, data, item, name,
                                                       self.serialization_format))
                            continue
                        data = data.detach()
                        if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                            data = data.clone()  # torch saves a tensor's whole storage: as torch's writer does
                        with stream.torch_archive():
                            results.append(_write_item(self.transforms, stream, data, item, name,
                                                       self.serialization_format))
                        del data
                synced.append(fsync_later(stream.path))
                self.checksums[name] = stream.hexdigest
            wait_synced(synced)  # every .distcp on disk before torch writes .metadata
            done: Future = Future()
            done.set_result(results)
            return done

    return _BucketedWriter


def streaming_strategy(index: StorageIndex, bucket_bytes: int = 10**9, checksums: Optional[dict[str, str]] = None):
    """A ``SaveShardedStrategy`` writing the torch_dist format (backend ``torch_dist``, version 1)
    in files of about ``bucket_bytes``; the CRC-32 of every ``.distcp`` file this rank writes goes into
    ``checksums`` (file name -> hex) as it is written."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save as dcp_save

    planner_cls = _lazy_planner_class()
    writer_cls = _bucketed_writer_class()

    class StreamingTorchDistSaveStrategy(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir: Path):
            # The same translation megatron's TorchDistSaveShardedStrategy.async_save does
            # (keep_only_main_replica=True, its default), so keys and chunks are identical.
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
            writer = writer_cls(checkpoint_dir, bucket_bytes, {} if checksums is None else checksums)
            # One planner per save: the DCP planner keeps per-call state.
            planner = planner_cls(index, dedup_replicated_tensors=False, flatten_state_dict=False,
                                  can_run_decentralized_global_plan=False)
            dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)

    return StreamingTorchDistSaveStrategy()
