"""Publish a directory that every rank writes into: whole, or not at all.

The one sequence the training save and both converters follow
(:func:`publish_collectively`)::

    final/ -> .final.tmp/   rank 0 clears and creates the hidden temp sibling
              write(tmp)    every rank writes its part (collective)
              verify(tmp)   optional, every rank (collective): e.g. reload and compare
              seal(tmp)     rank 0: the last files (config, extra state); returns the marker
              COMPLETE.json rank 0: the marker, listing every file with size and CRC-32
              publish_dir   rank 0: fsync the tree, rename it into place (replacing ``final``)
              barrier

A failure anywhere raises on every rank (agreed: no rank goes on into a collective the others
left) and leaves only the temp dir (which loaders refuse and the next write clears); ``final`` is
untouched. A full disk or quota is named (:class:`~megatron_rl.infra.disk_space.CheckpointDiskFull`:
the path, the bytes free and needed, the fix) on every rank, whichever rank's write hit it, and its
temp dir is removed (its partial files hold the room the next write needs); with ``needed_bytes``
(the size of the previous checkpoint) a filesystem without that much room is refused before
anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator, Optional

from megatron_rl.infra.atomic import atomic_write_json, publish_dir
from megatron_rl.infra.checkpoint_root import MARKER_NAME, file_list, temp_dir_for
from megatron_rl.infra.disk_space import CheckpointDiskFull, check_free_space, disk_full_problem
from megatron_rl.infra.dist import all_ranks_ok, barrier, rank, rank0_do
from megatron_rl.infra.pause_points import pause_point

DISK_FULL_FIX = ("Free space there (delete old checkpoints, lower --save-max-to-keep) or write to a filesystem "
                 "with room")


def named_disk_full(exc: BaseException, path: str, needed: Optional[int] = None) -> BaseException:
    """``exc`` as a :class:`CheckpointDiskFull` naming ``path`` when it was a full disk/quota, else ``exc``."""
    if isinstance(exc, CheckpointDiskFull):
        return exc
    problem = disk_full_problem(exc, path, needed)
    if problem is None:
        return exc
    err = CheckpointDiskFull(f"{problem}. {DISK_FULL_FIX}")
    err.__cause__ = exc
    return err


@contextlib.contextmanager
def _disk_full_named(path: str, needed: Optional[int]) -> Iterator[None]:
    """A rank-0 step's full disk raised as :class:`CheckpointDiskFull` (other errors unchanged)."""
    try:
        yield
    except Exception as e:
        named = named_disk_full(e, path, needed)
        if named is e:
            raise
        raise named from e


def publish_collectively(final_dir: str, write: Callable[[str], Optional[dict[str, str]]],
                         seal: Callable[[str], dict], verify: Optional[Callable[[str], None]] = None,
                         needed_bytes: Optional[Callable[[], Optional[int]]] = None) -> None:
    """Collective (every rank calls it with the same ``final_dir``): write ``final_dir`` atomically.

    ``write(tmp)`` runs on every rank and fills the temp dir; it may return the CRC-32s it
    already knows (relative path -> hex; rank 0's are used), so those files are not read back.
    If it raises on any rank, every rank raises (a rank its own exception, the others the same
    class where it is ours, else a CheckpointError, with its message). ``write`` must itself keep
    the ranks together until it returns or raises (a rank-local step that can fail is followed by
    an agreement, :func:`~megatron_rl.infra.dist.all_ranks_ok`, before the next collective).
    ``verify(tmp)``: optional collective check before anything is published. ``seal(tmp)`` runs on
    rank 0 and returns the marker dict; its ``files`` entry is added here (the dict is updated in
    place) and it is written as ``COMPLETE.json``, then the dir is renamed into place. Errors of
    rank 0's steps are raised on every rank (:func:`~megatron_rl.infra.dist.rank0_do`).
    ``needed_bytes()`` (rank 0): the size the dir will have, where known; a filesystem with less
    free is refused before the temp dir is made.
    """
    tmp = temp_dir_for(final_dir)

    def prepare() -> Optional[int]:
        needed = needed_bytes() if needed_bytes is not None else None
        short = check_free_space(final_dir, needed, "the checkpoint")
        if short:
            raise CheckpointDiskFull(f"{short}. {DISK_FULL_FIX}")
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
        with _disk_full_named(tmp, None):
            os.makedirs(tmp)
        return needed

    needed = rank0_do(prepare, f"creating {tmp}")
    try:
        known, error = None, None
        try:
            known = write(tmp)
        except BaseException as e:  # noqa: BLE001 - torch DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            error = named_disk_full(e, tmp, needed)
        # also the barrier: every rank's part is on disk; a full disk anywhere is the error everywhere
        all_ranks_ok(error, reraise_own=True, prefer=CheckpointDiskFull)
        pause_point("publish_written", os.path.basename(final_dir))  # tests: kill/signal mid-save, state known
        if verify is not None:
            verify(tmp)

        def publish() -> None:
            with _disk_full_named(tmp, needed):
                meta = seal(tmp)
                meta["files"] = file_list(tmp, known_checksums=known)
                atomic_write_json(os.path.join(tmp, MARKER_NAME), meta)
                pause_point("publish_sealed", os.path.basename(final_dir))  # tests: kill with only the rename left
                publish_dir(tmp, final_dir)

        rank0_do(publish, f"publishing {final_dir}")
        pause_point("published", os.path.basename(final_dir))  # tests: kill right after the rename
    except CheckpointDiskFull:  # agreed (all_ranks_ok, rank0_do): every rank is past its writes
        if rank() == 0:  # its partial files hold the room the next write needs
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
