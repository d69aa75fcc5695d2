"""A binary output file that moves bulk bytes into the page cache inside the kernel, with CRC-32.

Why: the converters' output is written once from bytes that exist already: most of them are an
input file's bytes unchanged (an HF tensor as a torch_dist chunk, a chunk as an HF tensor), the rest
a tensor in memory (a fused QKV). Measured on the 2-core VM the benchmarks run on (a nested,
paravirtualised guest), a plain ``write()`` of a 131 MB tensor into a new file took 0.3-1.2 s
while ``shutil.copy`` of the same bytes took 0.07 s: filling *new* page-cache pages from a user
buffer is what is slow there, a copy inside the kernel is not. So:

* a buffer that is a mapped input range (:mod:`megatron_rl.convert.file_views`), or a range handed
  over with :meth:`FileWriter.copy_range`, is moved with ``copy_file_range`` from the input file:
  one kernel copy, what ``cp`` does;
* any other large buffer goes through a pipe (whose few pages are reused) that is ``splice``-d into
  the file, which makes the page-cache fill a kernel copy (0.08 s for the 131 MB, run after run);
  where ``splice`` is missing (not Linux, a filesystem without ``splice_write``) ``write()``.

Every byte goes into a running CRC-32 (:attr:`FileWriter.hexdigest`, :mod:`megatron_rl.infra.crc32`),
so the output's ``COMPLETE.json`` lists the file's checksum without reading it back.

:meth:`FileWriter.torch_archive` (torch_dist ``.distcp`` files): a ``torch.save`` inside it is written with
torch's own record CRC-32 turned off (``torch.serialization.set_crc32_options``: torch's zip writer hashes
at ~1.2 GB/s, as long as moving the bytes takes). The writer follows the archive's zip structures as
they stream through and fills in every record's CRC-32 (its data descriptor and central-directory
entry) from the pass that hashes the file anyway, so the archive is byte for byte what torch writes
with its CRC on.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional

import torch

from megatron_rl.convert import file_views
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import crc32_hex
from megatron_rl.infra.crc32 import crc32, crc32_combine

PIPE_BYTES = 1 << 20  # bytes moved per splice: a pipe of this size (the unprivileged maximum by default)
SMALL_WRITE = 1 << 16  # writes below this are gathered in memory (zip/pickle headers) and written in one go
_F_SETPIPE_SZ = 1031  # fcntl.h (Linux); not exported by Python's fcntl before 3.10 on every build
COPY_RANGE_BYTES = 1 << 30  # bytes per copy_file_range call


class FileWriter(io.RawIOBase):
    """``open(path, "wb")`` for large writes: ``write``, ``tell``, ``flush``, ``fileno``, ``close``
    (and a context manager), :meth:`copy_range`, plus the CRC-32 of everything written (``hexdigest``).

    ``fileno()`` flushes first, so ``os.fsync(f.fileno())`` syncs every byte written so far."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._pipe: Optional[tuple[int, int]] = None
        self._splice_ok = hasattr(os, "splice")
        self._copy_ok = hasattr(os, "copy_file_range")
        self._small = bytearray()
        self._pos = 0
        self.crc = 0
        self.copied_bytes = 0  # moved from input files with copy_file_range
        self._zip: Optional[_ZipCrcs] = None  # inside torch_archive()

    # -- io.RawIOBase protocol --
    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        self.flush()
        return self._fd

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < SMALL_WRITE:
            at = len(self._small)
            self._small += view
            if self._zip is not None:
                self._zip.small(self._small, at)
            if len(self._small) >= PIPE_BYTES:
                self.flush()
        elif self._zip is not None:  # a record's data: its CRC (from 0) goes into the archive, then into the file's
            value = crc32(view)
            self._zip.large(n, value)
            self.flush()
            self._move(view, file_views.file_range_of(file_views.buffer_address(view), n))
            self.crc = crc32_combine(self.crc, value, n)
        else:
            self.flush()
            source = file_views.file_range_of(file_views.buffer_address(view), n)
            file_crc = _crc_thread().submit(crc32, view, self.crc)  # on another core while the bytes move
            try:
                self._move(view, source)
            finally:
                self.crc = file_crc.result()  # before returning: the caller may free ``data`` then
        self._pos += n
        return n

    @contextlib.contextmanager
    def torch_archive(self) -> Iterator[None]:
        """Within: one ``torch.save(..., this writer)``, its record CRC-32s computed here (see the module doc)."""
        previous = torch.serialization.get_crc32_options()
        self._zip = _ZipCrcs()
        torch.serialization.set_crc32_options(False)
        try:
            yield
            self._zip.finish()
        finally:
            torch.serialization.set_crc32_options(previous)
            self._zip = None

    def copy_range(self, src: file_views.FileRange, crc: int) -> None:
        """Append ``src.nbytes`` at ``src.offset`` of ``src.path`` (whose CRC-32 is ``crc``) without reading them."""
        if self._zip is not None:
            raise CheckpointError("FileWriter.copy_range cannot append to a zip-record stream")
        self.flush()
        self._copy_file(src)
        self.crc = crc32_combine(self.crc, crc, src.nbytes)
        self._pos += src.nbytes

    def flush(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self.crc = crc32(small, self.crc)
            self._move(memoryview(small), None)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        finally:
            fds = [self._fd, *(self._pipe or ())]
            self._pipe = None
            super().close()
            for fd in fds:
                os.close(fd)

    @property
    def hexdigest(self) -> str:
        return crc32_hex(self.crc)

    # -- the bytes --
    def _move(self, view: memoryview, source: Optional[file_views.FileRange]) -> None:
        if source is not None and self._copy_ok:
            self._copy_file(source)
            return
        offset, n = 0, view.nbytes
        while offset < n:
            chunk = view[offset:offset + PIPE_BYTES]
            offset += self._splice(chunk) if self._splice_ok else os.write(self._fd, chunk)

    def _copy_file(self, src: file_views.FileRange) -> None:
        src_fd = os.open(src.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            if self._copy_ok:
                try:
                    while done < src.nbytes:
                        moved = os.copy_file_range(src_fd, self._fd, min(src.nbytes - done, COPY_RANGE_BYTES),
                                                   src.offset + done)
                        if not moved:
                            raise CheckpointError(f"{src.path} ended before byte {src.offset + src.nbytes}")
                        done += moved
                except OSError:  # across filesystems on old kernels, or unsupported: read and write the rest
                    self._copy_ok = False
            while done < src.nbytes:
                data = os.pread(src_fd, min(src.nbytes - done, PIPE_BYTES), src.offset + done)
                if not data:
                    raise CheckpointError(f"{src.path} ended before byte {src.offset + src.nbytes}")
                self._move(memoryview(data), None)
                done += len(data)
        finally:
            os.close(src_fd)
        self.copied_bytes += src.nbytes

    def _splice(self, chunk: memoryview) -> int:
        """Move (a prefix of) ``chunk`` into the file through the pipe; returns the bytes moved."""
        if self._pipe is None:
            self._pipe = os.pipe()
            try:
                import fcntl

                fcntl.fcntl(self._pipe[1], _F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:  # a lower pipe-max-size: the default 64 KiB pipe still works, in more steps
                pass
        r, w = self._pipe
        queued = os.write(w, chunk)
        left = queued
        while left:
            try:
                moved = os.splice(r, self._fd, left)
            except OSError:  # no splice_write on this filesystem: drain the pipe by hand, then write() from now on
                self._splice_ok = False
                while left:
                    data = os.read(r, left)
                    _write_all(self._fd, memoryview(data))
                    left -= len(data)
                return queued
            left -= moved
        return queued


_LOCAL, _CENTRAL, _DESCRIPTOR, _END = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08", b"PK\x05\x06"
_FIXED = (_LOCAL, _CENTRAL, b"PK\x06\x06", b"PK\x06\x07", _END)  # the zip64 end record and locator carry no CRC


class _ZipCrcs:
    """Follows one ``torch.save`` archive written in streaming mode (torch's writer cannot seek: each record is
    a local header, its name and padding, its data in one write, then a data descriptor; an empty record has
    neither data nor descriptor) and puts each record's CRC-32 into its data descriptor and its
    central-directory entry as those arrive (they follow the data, so nothing waits)."""

    def __init__(self):
        self.state = "structure"  # structure | name | data? | descriptor | done
        self._name_left = 0
        self._name = bytearray()
        self._name_len = 0
        self._descriptor = True
        self._data: Optional[tuple[int, int]] = None  # (length, crc) of the current record's data
        self._crcs: dict[str, int] = {}

    def small(self, buf: bytearray, at: int) -> None:
        """A write of ``buf[at:]`` (appended to the writer's pending buffer, where it is patched)."""
        raw = bytes(buf[at:])  # small (< SMALL_WRITE): a copy holds no export of the growing buffer
        if self.state == "name":
            take = min(self._name_left, len(raw))
            self._name += raw[:take]
            self._name_left -= take
            if take < len(raw):
                raise CheckpointError("zip stream: a record's name and its data in one write")
            if not self._name_left and self._descriptor:
                self.state = "data?"
            elif not self._name_left:
                self._record(0)
                self.state = "structure"
        elif self.state == "data?":  # the record's data in one write (or, for no data, straight its descriptor)
            if self._is_descriptor(raw, 0):
                self._record(0)
                self.state = "structure"
            else:
                self._data, self.state = (len(raw), crc32(raw)), "descriptor"
        elif self.state == "descriptor":
            assert self._data is not None, "a descriptor is expected only after a record's data"
            if not self._is_descriptor(raw, self._data[0]):
                raise CheckpointError(f"zip stream: a {len(raw)}-byte write where a data descriptor was expected")
            struct.pack_into("<I", buf, at + 4, self._data[1])
            self._record(self._data[1])
            self.state = "structure"
        else:
            self._structure(buf, at, raw)

    def large(self, n: int, value: int) -> None:
        """A record's data written directly (``n`` bytes, CRC-32 ``value``)."""
        if self.state != "data?":
            raise CheckpointError(f"zip stream: a {n}-byte write where the archive expects {self.state}")
        self._data, self.state = (n, value), "descriptor"

    def finish(self) -> None:
        if self.state != "done":
            raise CheckpointError(f"zip stream: the torch.save archive ended in state {self.state!r}")

    @staticmethod
    def _is_descriptor(raw: bytes, length: int) -> bool:
        if len(raw) == 16 and raw[:4] == _DESCRIPTOR:
            return struct.unpack_from("<II", raw, 8) == (length, length)
        if len(raw) == 24 and raw[:4] == _DESCRIPTOR:
            return struct.unpack_from("<QQ", raw, 8) == (length, length)
        return False

    def _record(self, value: int) -> None:
        self._crcs[bytes(self._name[:self._name_len]).decode("utf-8", "replace")] = value
        self._data = None

    def _structure(self, buf: bytearray, at: int, raw: bytes) -> None:
        sig = raw[:4]
        if self.state != "structure" or sig not in _FIXED:
            raise CheckpointError(f"zip stream: unexpected bytes {sig!r} where a torch.save structure starts")
        if sig == _LOCAL:
            if len(raw) != 30:
                raise CheckpointError("zip stream: a local header not written on its own")
            flags, method = struct.unpack_from("<HH", raw, 6)
            (size,) = struct.unpack_from("<I", raw, 22)
            name_len, extra_len = struct.unpack_from("<HH", raw, 26)
            if method != 0 or not (flags & 0x8 or size == 0):
                raise CheckpointError("zip stream: a compressed torch.save record, or one whose CRC-32 precedes it")
            self._name, self._name_len = bytearray(), name_len
            self._name_left, self.state = name_len + extra_len, "name"
            self._descriptor = bool(flags & 0x8)  # without: an empty record, its CRC-32 (0) in its header already
            return
        if sig == _CENTRAL:  # every entry of the directory, in one write
            pos = 0
            while pos < len(raw):
                if raw[pos:pos + 4] != _CENTRAL:
                    raise CheckpointError("zip stream: a central directory split across writes")
                name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, pos + 28)
                name = raw[pos + 46:pos + 46 + name_len].decode("utf-8", "replace")
                if name not in self._crcs:
                    raise CheckpointError(f"zip stream: the central directory names {name!r}, which no record had")
                struct.pack_into("<I", buf, at + pos + 16, self._crcs[name])
                pos += 46 + name_len + extra_len + comment_len
            return
        if sig == _END:
            self.state = "done"


_crc_pool: Optional[ThreadPoolExecutor] = None
_sync_pool: Optional[ThreadPoolExecutor] = None


def fsync_later(path: str) -> Future:
    """``fsync`` the written file ``path`` on a background thread; wait with :func:`wait_synced` before the
    output is published.

    Why: ``fsync`` waits for the disk, not for a core; a converter that syncs each file as it closes it
    spends that wait idle (~0.3 s of a 447 MB conversion here), while the next file could be produced
    meanwhile. What is published is the same: every file is synced before the output's rename."""
    global _sync_pool
    if _sync_pool is None:
        _sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-writer-fsync")

    def sync() -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    return _sync_pool.submit(sync)


def wait_synced(pending: list[Future]) -> None:
    """Wait for every :func:`fsync_later` of ``pending`` (raising the first error), then empty it."""
    try:
        for f in pending:
            f.result()
    finally:
        pending.clear()


def _crc_thread() -> ThreadPoolExecutor:
    """One thread for the CRC-32 of large writes (the CRC, ``splice`` and ``copy_file_range`` release the
    GIL), so hashing a buffer overlaps moving it on a host with a spare core."""
    global _crc_pool
    if _crc_pool is None:
        _crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="file-writer-crc32")
    return _crc_pool


def _write_all(fd: int, view: memoryview) -> None:
    offset = 0
    while offset < view.nbytes:
        offset += os.write(fd, view[offset:])
