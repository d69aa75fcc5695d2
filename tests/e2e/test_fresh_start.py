"""``--no-auto-resume --existing-save archive`` under torchrun (2 gloo ranks, the CPU demo script).

a fresh start into a --save that held an earlier run's checkpoints overwrote and pruned
them silently. Here the root holds an earlier run's iter dir and pointers; the fresh run archives
them on rank 0 before it starts (the other rank never reads the root), trains, and saves into the
now-clean root. The refusal without --existing-save is unit-tested (tests/config/test_save_paths.py).
"""

import json
import os

import pytest

from test_demo import run_demo

pytestmark = pytest.mark.e2e


def test_fresh_start_archives_the_earlier_run(tmp_path):
    out = tmp_path / "demo"
    old = out / "ckpt" / "iter_0000005"
    old.mkdir(parents=True)
    (old / "COMPLETE.json").write_text('{"format": "earlier run"}')
    (out / "ckpt" / "resume_state.json").write_text('{"rollout_id": 5}')
    (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    run_demo(out, 1, "--no-auto-resume", "--existing-save", "archive")
    root = out / "ckpt"
    archives = [n for n in os.listdir(root) if n.startswith("archive_")]
    assert len(archives) == 1, os.listdir(root)
    assert sorted(os.listdir(root / archives[0])) == ["iter_0000005", "latest_checkpointed_iteration.txt",
                                                      "resume_state.json"]
    assert (root / archives[0] / "iter_0000005" / "COMPLETE.json").read_text() == '{"format": "earlier run"}'
    assert sorted(n for n in os.listdir(root) if n not in archives) == [
        ".megatron_rl.lock", "iter_0000001", "latest_checkpointed_iteration.txt", "resume_state.json"]
    assert json.loads((root / "resume_state.json").read_text())["rollout_id"] == 1
