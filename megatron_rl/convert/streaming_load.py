"""Read a torch_dist model one bucket of parameters at a time and export it to HF.

The single-process ``dist-to-hf`` path. Like the streaming writer
(:mod:`megatron_rl.convert.streaming_save`), the model is built on the ``meta``
device so its ``sharded_state_dict()`` names every key, chunk and
``ShardedTensorFactory`` exactly as megatron-core would, without storage. Then,
for each bucket of consecutive parameters (export order, at most
``bucket_bytes``):

1. read each parameter straight from the chunks its state-dict entries name
   (plain, non-prepended ShardedTensors; the two halves of a gated
   ``linear_fc1`` included) in the ``.metadata`` of the dir
   (:class:`~megatron_rl.convert.distcp_reader.ChunkFiles`): a parameter that is
   one saved chunk *is* that chunk's mapped pages, no copy; one of several chunks
   is assembled from them, unless each of its HF tensors is one of its chunks
   (gate and up of a gated ``linear_fc1``): those chunks are then the HF tensors;
2. a chunk saved at another layout (the checkpoint was written at TP2, say) is
   not one of those: that bucket goes through ``dist_checkpointing.load`` of
   the same entries into real tensors (access validation off, the subset is
   deliberate), which reshards;
3. export those parameters to full HF tensors with the bridge's maps
   (``weights.export_slot``) and hand them to the caller; free the bucket.

Memory: one bucket of parameters (mapped pages, or tensors where assembled)
plus the HF tensors made from them, not the model; an HF tensor that is a
chunk's bytes, or known rows of one (q/k/v split from a fused QKV, handed on as
a :class:`~megatron_rl.convert.file_views.FileRows` without copying them), is
written from the ``.distcp`` file by the shard writer. Under torchrun with a parallel layout ``dist_to_hf`` keeps loading
each rank's whole shard (the collective export needs every rank's model).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Optional, cast

import torch

from megatron_rl.convert import distcp_reader, file_views
from megatron_rl.convert.streaming_save import release_free_memory, storage_key
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.crc32 import crc32
from megatron_rl.models import dist_io
from megatron_rl.models.parallel import ParallelLayout
from megatron_rl.models.weights import export_items, export_rows, export_slot, stack_expert_pieces, with_mtp_copies


def can_stream(layout) -> bool:
    """One process at TP=PP=EP=1: the streaming reader applies (under torchrun the
    collective in-memory export is used)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() \
        else int(os.environ.get("WORLD_SIZE", "1"))
    return world == 1 and layout.tp == layout.pp == layout.ep == 1 and layout.vpp is None


def one_process_groups_ready() -> bool:
    """megatron's groups are set up already at TP=PP=EP=1 (the caller's ``dist_io.setup``): setting them up
    again would tear down and rebuild every group (~0.3 s) for the same layout."""
    from megatron.core import parallel_state

    return bool(parallel_state.model_parallel_is_initialized()) and \
        parallel_state.get_tensor_model_parallel_world_size() == 1 and \
        parallel_state.get_pipeline_model_parallel_world_size() == 1 and \
        parallel_state.get_expert_model_parallel_world_size() == 1 and \
        parallel_state.get_virtual_pipeline_model_parallel_world_size() is None


def _entries_by_parameter(sharded_state_dict: dict) -> dict[int, list[tuple[str, str, Any]]]:
    """State-dict entries (ShardedTensor / ShardedTensorFactory) grouped by the parameter they view."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out: dict[int, list] = {}
    for top, sub in sharded_state_dict.items():
        for key, entry in sub.items():
            if isinstance(entry, ShardedObject):
                continue  # _extra_state: nothing an HF checkpoint holds
            if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
                raise CheckpointError(f"unexpected {type(entry).__name__} at {top}.{key} in the model's sharded "
                                      "state dict; the streaming reader does not know how to load it")
            out.setdefault(storage_key(entry.data), []).append((top, key, entry))
    return out


def _same_view(value: torch.Tensor, meta_param: torch.Tensor, meta_view: torch.Tensor) -> torch.Tensor:
    """The view of ``value`` that ``meta_view`` is of ``meta_param``."""
    return value.as_strided(meta_view.size(), meta_view.stride(),
                            value.storage_offset() + meta_view.storage_offset() - meta_param.storage_offset())


def _without_prepended_axes(sh):
    """The same chunk as a plain ShardedTensor (``prepend_axis_num`` 0, shape ``[1, ..., *local]``).

    Why: megatron translates a ShardedTensor with prepended (stacked-layer) axes to
    a legacy torch ShardedTensor that must hold every chunk of the key this rank
    owns (all its layers); a bucket holds only some layers. The plain form goes
    through megatron's ``CheckpointableShardedTensor``, which reads any chunk.
    """
    p = sh.prepend_axis_num
    if not p:
        return sh
    local = (1,) * p + tuple(sh.local_shape)
    return dataclasses.replace(sh, data=sh.data.view(local), local_shape=local, prepend_axis_num=0)


def _buckets(items, bucket_bytes: int):
    bucket: list[tuple] = []
    size = 0
    for slot, names in items:
        n = slot.param.numel() * slot.param.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((slot, names))
        size += n
    if bucket:
        yield bucket


def hf_tensor_stream(bridge, dist_dir: str, dtype: torch.dtype, bucket_bytes: int, config_dir: str,
                     stored: Optional[dict] = None, rows_as_ranges: bool = False
                     ) -> Iterator[tuple[str, "torch.Tensor | file_views.FileRows"]]:
    """``(hf_name, tensor)`` for the whole model of ``dist_dir`` (one process, TP=PP=EP=1); with
    ``rows_as_ranges`` q/k/v (rows of the fused QKV's chunk) come as
    :class:`~megatron_rl.convert.file_views.FileRows`, for a caller that writes them from the file.

    Not lazy in its checks: the stored keys and global shapes (``stored`` when the caller read them
    already: :func:`~megatron_rl.models.dist_io.checkpoint_model_tensors`) are compared with the
    model of ``config_dir`` here (refusal names the tensors), before anything is read.
    """
    layout = ParallelLayout()
    if not one_process_groups_ready():
        dist_io.setup(layout)
    chunks = dist_io.build_meta_model(bridge, layout, dtype)
    if stored is None:
        stored = dist_io.checkpoint_model_tensors(dist_dir)
    dist_io.check_checkpoint_matches_model(dist_dir, stored, dist_io.model_tensor_shapes(chunks), config_dir)
    # a FileRows (q/k/v) is never an expert piece nor an MTP alias: both pass it on untouched
    stream = cast(Iterator[tuple[str, torch.Tensor]], _stream(bridge, chunks, dist_dir, bucket_bytes, rows_as_ranges))
    return with_mtp_copies(bridge, stack_expert_pieces(bridge, stream))


def hf_tensors_of(bridge, dist_dir: str, layout, dtype: torch.dtype, config_dir: str, streaming: bool,
                  bucket_bytes: Optional[int] = None, stored: Optional[dict] = None,
                  rows_as_ranges: bool = False) -> tuple[Optional[list], Iterator]:
    """``(chunks, (hf_name, tensor) stream)``: the model of ``dist_dir`` exported to HF tensors.

    ``streaming`` (one process, :func:`can_stream`): a bucket of ``bucket_bytes`` at a time,
    read errors named by :func:`~megatron_rl.models.dist_io.read_guard`; ``chunks`` is None.
    Otherwise every rank loads its shard into a model built at ``layout`` (after the stored keys
    and shapes, ``stored`` when already read, are checked against it) and the export gathers
    (collective, ``bucket_bytes`` per gather); free ``chunks`` when the stream is drained.
    ``rows_as_ranges`` (streaming only): q/k/v come as :class:`~megatron_rl.convert.file_views.FileRows`."""
    if streaming:
        assert bucket_bytes is not None, "every streaming caller passes the bucket size it reads at a time"
        return None, dist_io.read_guard(hf_tensor_stream(bridge, dist_dir, dtype, bucket_bytes, config_dir, stored,
                                                         rows_as_ranges), dist_dir)
    chunks = bridge.build_model(layout, params_dtype=dtype)
    if stored is None:
        stored = dist_io.checkpoint_model_tensors(dist_dir)
    dist_io.check_checkpoint_matches_model(dist_dir, stored, dist_io.model_tensor_shapes(chunks), config_dir)
    dist_io.load_dist_into(chunks, dist_dir)
    return chunks, bridge.export_hf_weights(chunks, bucket_bytes=bucket_bytes)


def _pieces(meta: torch.Tensor, value: torch.Tensor, entries) -> list:
    """The state-dict entries of one parameter as plain ShardedTensors whose data view ``value`` (a factory,
    the gated ``linear_fc1``, split by megatron's own ``build``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out: list[tuple[str, Any]] = []
    for top, key, entry in entries:
        if isinstance(entry, ShardedTensor):
            pieces = [dataclasses.replace(entry, data=_same_view(value, meta, entry.data))]
        else:
            built = dataclasses.replace(entry, data=value).build()
            pieces = [built] if isinstance(built, ShardedTensor) else list(nested_values(built))
        out.extend((f"{top}/{key}/{i}", _without_prepended_axes(p)) for i, p in enumerate(pieces))
    return out


RowSource = tuple[int, int, file_views.FileRange]  # (first row of the parameter, rows, where their bytes are)


def _direct_values(bridge, bucket, entries: dict, files: distcp_reader.ChunkFiles
                   ) -> Optional[tuple[list[Optional[torch.Tensor]], list[list[RowSource]],
                                       list[Optional[list[torch.Tensor]]]]]:
    """The bucket's parameters read straight from their saved chunks: a parameter that is one chunk is that
    chunk's mapped pages (no copy), one of several chunks (a gated ``linear_fc1``) is assembled from them.
    With each, the row blocks of it that are a chunk's bytes in a ``.distcp`` file (empty when unknown), and,
    when each of its HF tensors is exactly one chunk's rows (gate and up of ``linear_fc1``), those chunks:
    the parameter is then not assembled (its value None), its HF tensors are the chunks' mapped pages.
    None when a chunk is not saved as this layout asks (another TP's chunks): megatron's load then reads it."""
    values: list[Optional[torch.Tensor]] = []
    sources: list[list[RowSource]] = []
    ready: list[Optional[list[torch.Tensor]]] = []
    for slot, names in bucket:
        meta = slot.param
        pieces = _pieces(meta, meta, entries.get(storage_key(meta), []))
        read = [files.read(p.key, p.global_offset, p.local_shape, meta.dtype) for _, p in pieces]
        chunks = [t for t in read if t is not None]
        if not pieces or len(chunks) != len(pieces):
            return None
        if len(pieces) == 1 and pieces[0][1].data.numel() == meta.numel():
            value = chunks[0].view(meta.shape)
            whole = file_views.tensor_file_range(value)
            values.append(value)
            sources.append([(0, meta.shape[0], whole)] if whole is not None and meta.dim() else [])
            ready.append(None)
            continue
        blocks: Optional[list[RowSource]] = [] if meta.dim() else None
        row = meta[0].numel() if meta.dim() else 1
        by_rows: dict[tuple[int, int], torch.Tensor] = {}
        for (_, p), t in zip(pieces, chunks):
            view = _same_view(meta, meta, p.data)
            at, where = view.storage_offset() - meta.storage_offset(), file_views.tensor_file_range(t)
            if blocks is not None and where is not None and view.is_contiguous() and not at % row \
                    and not view.numel() % row:
                blocks.append((at // row, view.numel() // row, where))
                by_rows[(at // row, view.numel() // row)] = t
            else:
                blocks = None
        rows = export_rows(bridge, slot.canonical_name, meta.shape[0]) if blocks else None
        spans = [(int(r[0]), len(r)) for r in rows] if rows is not None and len(rows) == len(names) else []
        if spans and all(span in by_rows and torch.equal(r, torch.arange(span[0], span[0] + span[1]))
                         for span, r in zip(spans, rows or [])):
            values.append(None)  # each HF tensor is one chunk: nothing to assemble
            sources.append([])
            ready.append([by_rows[span].view(span[1], *meta.shape[1:]) for span in spans])
            continue
        value = torch.empty(meta.shape, dtype=meta.dtype)
        for (_, p), t in zip(pieces, chunks):
            _same_view(value, meta, p.data).copy_(t.view(p.data.shape))
        values.append(value)
        sources.append(blocks or [])
        ready.append(None)
    return values, sources, ready


def _row_pieces(rows: list[int], blocks: list[RowSource], row_bytes: int
                ) -> Optional[list[tuple[int, int, file_views.FileRange]]]:
    """``(first parameter row, rows, file range)`` holding parameter ``rows`` in that order (runs of consecutive
    rows, split where their blocks do); None when a row is in no block."""
    out: list[tuple[int, int, file_views.FileRange]] = []
    i = 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and rows[j] == rows[j - 1] + 1:
            j += 1
        lo, hi = rows[i], rows[i] + (j - i)
        for first, n, where in blocks:
            a, b = max(lo, first), min(hi, first + n)
            if a < b:
                out.append((a, b - a, file_views.FileRange(where.path, where.offset + (a - first) * row_bytes,
                                                           (b - a) * row_bytes)))
        i = j
    return out if sum(p[1] for p in out) == len(rows) else None


def _file_rows(value: torch.Tensor, rows: torch.Tensor, pieces: list[tuple[int, int, file_views.FileRange]]
               ) -> file_views.FileRows:
    """The HF tensor ``value[rows]`` as the file ranges its rows are (CRC-32s hashed from ``value``'s rows)."""
    crcs = [crc32(value[first:first + n].reshape(-1).view(torch.uint8).numpy()) for first, n, _ in pieces]
    return file_views.FileRows((len(rows), *value.shape[1:]), value.dtype, [p[2] for p in pieces], crcs,
                               lambda: value.index_select(0, rows))


def _export(bridge, slot, value: torch.Tensor, names, blocks: list[RowSource], rows_as_ranges: bool
            ) -> Iterator[tuple[str, "torch.Tensor | file_views.FileRows"]]:
    """``export_slot`` of one parameter. With ``rows_as_ranges``, an HF tensor that regroups rows of the
    parameter whose bytes are known rows of a ``.distcp`` file (q, k, v of a fused QKV) is a
    :class:`~megatron_rl.convert.file_views.FileRows` instead of a copy: the shard writer copies those rows from
    the file."""
    rows = export_rows(bridge, slot.canonical_name, value.shape[0]) if blocks and rows_as_ranges else None
    if rows is None or len(rows) != len(names):
        yield from export_slot(bridge, dataclasses.replace(slot, param=value), names, copy=False)
        return
    row_bytes = value[0].numel() * value.element_size()
    for name, picked in zip(names, rows):
        pieces = _row_pieces(picked.tolist(), blocks, row_bytes)
        yield name, _file_rows(value, picked, pieces) if pieces is not None else value.index_select(0, picked)


def _stream(bridge, chunks, dist_dir: str, bucket_bytes: int, rows_as_ranges: bool
            ) -> Iterator[tuple[str, "torch.Tensor | file_views.FileRows"]]:
    entries = _entries_by_parameter(dist_io.model_sharded_state_dict(chunks))
    dc = dist_io.dist_checkpointing()
    metadata_cache: dict = {}
    files = distcp_reader.ChunkFiles(dist_dir, metadata_cache)
    for bucket in _buckets(export_items(bridge, chunks), bucket_bytes):
        try:
            direct = _direct_values(bridge, bucket, entries, files)
        except Exception:  # noqa: BLE001 - a torn record: megatron's load below names the damage
            direct = None
        values, sources, ready = direct if direct is not None else \
            (_loaded_values(bucket, entries, dc, dist_dir, metadata_cache), [[] for _ in bucket], [None] * len(bucket))
        for (slot, names), value, blocks, hf in zip(bucket, values, sources, ready):
            if hf is not None:  # its HF tensors are chunks as they are saved
                yield from zip(names, hf)
            else:
                assert value is not None, "a parameter is either assembled or its HF tensors are its chunks"
                yield from _export(bridge, slot, value, names, blocks, rows_as_ranges)
        del values, sources, ready, direct, bucket, value, hf  # nothing of this bucket is held while the next is read
        release_free_memory()
    chunks.clear()  # a meta model: no storage to free, so no gc.collect (~0.2 s with megatron imported)


def _loaded_values(bucket, entries: dict, dc, dist_dir: str, metadata_cache: dict) -> list[torch.Tensor]:
    """The bucket's parameters through ``dist_checkpointing.load`` (any saved layout; chunks from mapped pages)."""
    values: list[torch.Tensor] = []
    request: dict[str, Any] = {}
    for slot, _ in bucket:
        meta = slot.param
        value = torch.empty(meta.shape, dtype=meta.dtype)
        values.append(value)
        request.update(_pieces(meta, value, entries.get(storage_key(meta), [])))
    try:
        with distcp_reader.mapped_reads(metadata_cache):  # chunks read from mapped pages, .metadata parsed once
            loaded = dc.load(request, dist_dir, validate_access_integrity=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"loading {[s.canonical_name for s, _ in bucket]} from torch_dist checkpoint "
                              f"{dist_dir} failed ({type(e).__name__}: {e}); the files are corrupt or of "
                              "another model") from e
    for name, sh in request.items():
        if loaded[name].data_ptr() != sh.data.data_ptr():
            sh.data.copy_(loaded[name])  # every piece views its value; fill it if the load did not in place
    return values
