"""Read torch_dist chunks from mapped ``.distcp`` pages instead of copies of them.

Why: torch's ``FileSystemReader`` reads each saved chunk (a ``torch.save`` zip inside a
``.distcp`` file) into new memory, deserialises it into a second new tensor, and then copies
that into the target: three passes over fresh memory for every byte, which is most of what
``dist-to-hf`` did besides writing. :class:`MappedFileSystemReader` maps the chunk's byte range
(private copy-on-write pages, unmapped once it is copied) and gives torch's own unpickler (``weights_only``) a storage over the
mapped record, the way ``torch.load(..., mmap=True)`` does for a whole file; the only copy
left is into the target tensor. Items it cannot read that way (byte items, stream transforms,
anything the zip reader refuses) are read exactly as torch reads them.

:func:`mapped_reads` puts it under megatron-core's torch_dist load strategy for the
duration of a ``dist_checkpointing.load`` (the strategy builds its reader through one module
function; everything else, the planner, key translation and validation, is megatron's), and
keeps the parsed ``.metadata`` across the many loads of a streaming conversion.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from typing import IO, Iterator, cast

import torch
from torch.futures import Future

from megatron_rl.convert import file_views

_MISSING = object()


class _Window(io.RawIOBase):
    """``length`` bytes of ``file`` from ``offset``, as a seekable file (what torch's zip reader reads)."""

    def __init__(self, file, offset: int, length: int):
        super().__init__()
        self._file, self._start, self._length, self._pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(view.nbytes, self._length - self._pos))
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n]) if n else 0
        self._pos += got
        return got


def record_reader(file, offset: int, length: int):
    """torch's zip reader (``PyTorchFileReader``) over the ``torch.save`` record at ``[offset, offset + length)``
    of ``file`` (an open binary file)."""
    return torch._C.PyTorchFileReader(cast(IO[bytes], _Window(file, offset, length)))


def _mapped_tensor(file, offset: int, length: int) -> torch.Tensor:
    """The tensor ``torch.save`` wrote at ``[offset, offset + length)`` of ``file``, its storage viewing a
    private mapping of just that range (unmapped when the tensor goes: a mapped page counts in the RSS)."""
    from torch import _weights_only_unpickler
    from torch.serialization import _load

    reader = record_reader(file, offset, length)
    storage = file_views.map_range(file.name, offset, length).untyped_storage()  # known to the output writer
    return _load(reader, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8")


class ChunkFiles:
    """Where each saved chunk of a torch_dist dir is (its ``.metadata``), read as a view of the file's pages.

    Why: the one-process ``dist-to-hf`` needs a parameter's bytes, which a chunk holds as they are saved;
    reading it through ``dist_checkpointing.load`` plans a load per bucket and copies every chunk into a
    new tensor. :meth:`read` returns the chunk itself, mapped (:mod:`megatron_rl.convert.file_views`),
    so an HF tensor that is a whole chunk is written from the ``.distcp`` file inside the kernel."""

    def __init__(self, dist_dir: str, cache: dict):
        from torch.distributed.checkpoint import FileSystemReader

        metadata = cache.get("metadata", _MISSING)
        if metadata is _MISSING:
            metadata = cache["metadata"] = FileSystemReader(dist_dir).read_metadata()
        self._where: dict[tuple, tuple[str, int, int]] = {}
        for index, info in metadata.storage_data.items():
            if index.offset is not None and not getattr(info, "transform_descriptors", None):
                self._where[(index.fqn, tuple(index.offset))] = (os.path.join(dist_dir, info.relative_path),
                                                                 info.offset, info.length)
        self._sizes = {(key, tuple(chunk.offsets)): tuple(chunk.sizes)
                       for key, md in metadata.state_dict_metadata.items() for chunk in getattr(md, "chunks", ())}

    def read(self, key: str, offsets, shape, dtype: torch.dtype) -> "torch.Tensor | None":
        """The saved chunk of ``key`` at global ``offsets`` as a ``shape`` tensor over mapped pages; None when no
        chunk is exactly that (another layout's chunks: the caller loads through megatron instead)."""
        where = (key, tuple(int(o) for o in offsets))
        if where not in self._where or self._sizes.get(where) != tuple(int(s) for s in shape):
            return None
        path, offset, length = self._where[where]
        with open(path, "rb") as file:
            tensor = _mapped_tensor(file, offset, length)
        if tensor.dtype != dtype or tensor.numel() != math.prod(shape) or not tensor.is_contiguous():
            return None
        return tensor.view(tuple(shape))


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.utils import _create_file_view

    try:
        from torch.distributed._shard._utils import narrow_tensor_by_index
    except ImportError:  # older layouts of torch
        from torch.distributed.checkpoint.utils import narrow_tensor_by_index

    class MappedFileSystemReader(FileSystemReader):
        """``FileSystemReader`` that reads tensor chunks from mapped pages (one copy, into the target)."""

        def __init__(self, path, cache: dict):
            super().__init__(path)
            self._cache = cache

        def read_metadata(self):
            metadata = self._cache.get("metadata", _MISSING)
            if metadata is _MISSING:
                metadata = self._cache["metadata"] = super().read_metadata()
            return metadata

        def read_data(self, plan, planner) -> Future:
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, items in per_file.items():
                path = os.fspath(self.fs.concat_path(self.path, relative_path))
                with open(path, "rb") as file:
                    for item in items:
                        info = self.storage_data[item.storage_index]
                        def stream_bytes() -> io.BytesIO:  # torch's own read of the item
                            stream = self.transforms.transform_load_stream(
                                item, info.transform_descriptors or (),
                                cast(IO[bytes], _create_file_view(file, info.offset, info.length)))
                            return io.BytesIO(stream.read(-1))

                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, stream_bytes())
                            continue
                        tensor = None
                        if info.length and not info.transform_descriptors:
                            try:
                                tensor = _mapped_tensor(file, info.offset, info.length)
                            except Exception:  # noqa: BLE001 - read it torch's way below, which names real damage
                                tensor = None
                        if tensor is None:
                            tensor = torch.load(stream_bytes(), map_location="cpu", weights_only=True)
                        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        if target.size() != tensor.size():
                            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs "
                                                 f"{tensor.size()}")
                        target.copy_(tensor)
                        planner.commit_tensor(item, target)
                        del tensor
            done: Future = Future()
            done.set_result(None)
            return done

    return MappedFileSystemReader


@contextlib.contextmanager
def mapped_reads(cache: dict) -> Iterator[None]:
    """Within: megatron-core's torch_dist loads read through :class:`MappedFileSystemReader`, sharing ``cache``
    (the parsed ``.metadata`` of one checkpoint dir: pass a new dict per dir)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    reader_cls = _reader_class()
    original = mcore_torch._get_filesystem_reader

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        return reader_cls(checkpoint_dir, cache)

    mcore_torch._get_filesystem_reader = get_reader
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = original
