"""A fresh start (``--no-auto-resume``) into a ``--save`` root that holds an earlier run's checkpoints.

Validation (``config.validate._check_paths``) refuses such a start unless
``--existing-save`` says what to do with them, because the new run would overwrite
the old ``iter_*`` dirs, prune them and leave a root whose newest dir belongs to
another run. :func:`clear_save_root` carries the choice out on rank 0 before the
run reads or writes the root (the other ranks never read it on a fresh start):

- ``archive``: every checkpoint entry is renamed into ``ROOT/archive_<UTC time>/``
  (renames within one file system: nothing is copied, nothing can be half-copied);
  the pointers (``resume_state.json``, ``latest_checkpointed_iteration.txt``) go
  first, so a crash part-way leaves no pointer to an archived dir, and re-running
  the command archives the rest into another ``archive_*``;
- ``discard``: the entries are renamed into one hidden ``.discard_<time>.deleting``
  dir (never loaded) and that is deleted.

Only checkpoint entries move (``config.validate.save_root_checkpoint_entries``);
other files under ``--save`` stay where they are.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

from megatron_rl.config.validate import save_root_checkpoint_entries
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import fsync_dir

log = logging.getLogger(__name__)

_POINTERS = ("resume_state.json", "latest_checkpointed_iteration.txt")


def _unique(path: str) -> str:
    n, out = 1, path
    while os.path.lexists(out):
        n += 1
        out = f"{path}_{n}"
    return out


def clear_save_root(root: str, mode: str, now: Optional[float] = None) -> Optional[str]:
    """Archive or discard the checkpoint entries under ``root``; returns the archive dir (or None)."""
    if mode not in ("archive", "discard"):
        raise CheckpointError(f"--existing-save {mode!r}: choose archive or discard")
    entries = save_root_checkpoint_entries(root)
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest = _unique(os.path.join(root, f"archive_{stamp}" if mode == "archive" else f".discard_{stamp}.deleting"))
    entries.sort(key=lambda n: (not n.lstrip(".").startswith(_POINTERS), n))  # pointers first
    try:
        os.makedirs(dest)
        for name in entries:
            os.rename(os.path.join(root, name), os.path.join(dest, name))
        fsync_dir(root)
        fsync_dir(dest)
    except OSError as exc:
        raise CheckpointError(f"--existing-save {mode}: could not move the earlier run's checkpoints in {root} into "
                              f"{dest} ({exc}); free or fix {root}, or choose another --save") from None
    if mode == "archive":
        log.warning("--existing-save archive: moved the earlier run's %s to %s", ", ".join(entries), dest)
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    log.warning("--existing-save discard: deleted the earlier run's %s from %s", ", ".join(entries), root)
    return None
