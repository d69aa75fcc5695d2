"""Worker for tests/e2e/test_save_root.py: ``megatron_rl.train`` whose rank 0 finds the disk full in
the second checkpoint save, at the step that used to hang the run.

The failure, as the issue's run met it: torch's zip writer fails on rank 0's ``common.pt`` (the
first file of megatron's torch_dist save, written by rank 0 alone before the collective shard
write) with its errno-less ``unexpected pos 704 vs 598``, and from then on the filesystem reports
no room (``statvfs`` stand-in). Rank 1 goes on into the save; before the fix rank 0 raised there
alone and the two ranks waited in different collectives until the launcher was killed.

Usage: under ``megatron_rl.infra.launch`` like ``-m megatron_rl.train`` (same flags).
"""

import os
import sys

import megatron_rl.compat  # noqa: F401  (first: megatron-core's cheap first import)
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

from megatron_rl.infra import disk_space
from megatron_rl.train import main

FULL_AT_SAVE = 2  # the first save succeeds: a complete checkpoint to resume from
saves = [0]
real_save_common, real_free_bytes = TorchCommonSaveStrategy.save_common, disk_space.free_bytes


def save_common(self, common_state_dict, checkpoint_dir):
    saves[0] += 1
    if saves[0] < FULL_AT_SAVE:
        return real_save_common(self, common_state_dict, checkpoint_dir)
    with open(os.path.join(checkpoint_dir, "common.pt"), "wb") as f:
        f.write(b"PK\x03\x04" + bytes(594))  # what a short write leaves
    raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598")


def free_bytes(path):
    return 0 if saves[0] >= FULL_AT_SAVE else real_free_bytes(path)


if os.environ.get("RANK") == "0":
    TorchCommonSaveStrategy.save_common = save_common
    disk_space.free_bytes = free_bytes

if __name__ == "__main__":
    sys.exit(main())
