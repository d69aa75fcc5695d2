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

A failure anywhere raises on every rank and leaves only the temp dir (which loaders
refuse and the next write clears); ``final`` is untouched.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

from megatron_rl.infra.atomic import atomic_write_json, publish_dir
from megatron_rl.infra.checkpoint_root import MARKER_NAME, file_list, temp_dir_for
from megatron_rl.infra.dist import all_ranks_ok, barrier, rank0_do


def publish_collectively(final_dir: str, write: Callable[[str], Optional[dict[str, str]]],
                         seal: Callable[[str], dict], verify: Optional[Callable[[str], None]] = None) -> None:
    """Collective (every rank calls it with the same ``final_dir``): write ``final_dir`` atomically.

    ``write(tmp)`` runs on every rank and fills the temp dir; it may return the CRC-32s it
    already knows (relative path -> hex; rank 0's are used), so those files are not read back.
    If it raises on any rank, every rank raises (a rank its own exception, the others a
    CheckpointError with its message). ``verify(tmp)``: optional collective check before
    anything is published. ``seal(tmp)`` runs on rank 0 and returns the marker dict; its
    ``files`` entry is added here (the dict is updated in place) and it is written as
    ``COMPLETE.json``, then the dir is renamed into place. Errors of rank 0's steps are
    raised on every rank (:func:`~megatron_rl.infra.dist.rank0_do`).
    """
    tmp = temp_dir_for(final_dir)

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted write
        os.makedirs(tmp)

    rank0_do(prepare, f"creating {tmp}")
    known, error = None, None
    try:
        known = write(tmp)
    except BaseException as e:  # noqa: BLE001 - torch DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        error = e
    all_ranks_ok(error, reraise_own=True)  # also the barrier: every rank's part is on disk
    if verify is not None:
        verify(tmp)

    def publish() -> None:
        meta = seal(tmp)
        meta["files"] = file_list(tmp, known_checksums=known)
        atomic_write_json(os.path.join(tmp, MARKER_NAME), meta)
        publish_dir(tmp, final_dir)

    rank0_do(publish, f"publishing {final_dir}")
    barrier()
