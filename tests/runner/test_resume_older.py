"""``--load ROOT/iter_2 --save ROOT`` while ``iter_4`` exists: refused, or (``--allow-resume-older``)
the newer iterations are moved aside into ``ROOT/superseded/``, never overwritten or deleted.

The issue: such a resume overwrote iteration 4 with the new branch's iteration 4, without a word.
"""

from __future__ import annotations

import os

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError
from megatron_rl.infra.checkpoint_root import MARKER_NAME, SUPERSEDED_DIR, iter_dir, move_aside
from megatron_rl.runner.checkpoints import CheckpointCursor
from megatron_rl.runner.resume import Resumer


def _root(tmp_path):
    root = tmp_path / "save"
    for step in (2, 4, 6):
        os.makedirs(iter_dir(str(root), step))
        (root / f"iter_{step:07d}" / MARKER_NAME).write_text("{}")
        (root / f"iter_{step:07d}" / "shard").write_text(f"step {step}")
    (root / "rollout_ckpts").mkdir()
    for step in (2, 4):
        (root / "rollout_ckpts" / f"rollout_{step}.pt").write_text(f"rollout {step}")
    return root


class _Backend:
    def __init__(self):
        self.loaded = []

    def load(self, path):
        self.loaded.append(path)
        return {"rollout_id": 2}


def test_resuming_an_older_iteration_into_a_root_with_newer_ones_is_refused(tmp_path, tiny_hf_models):
    hf, root = tiny_hf_models("qwen2"), _root(tmp_path)
    flags = ["--hf-checkpoint", hf, "--load", iter_dir(str(root), 2), "--save", str(root)]
    with pytest.raises(ConfigError) as info:
        parse_config(flags)
    msg = str(info.value)
    assert f"--load {iter_dir(str(root), 2)} resumes iteration 2" in msg
    assert "iter_0000004, iter_0000006" in msg and "--allow-resume-older" in msg
    parse_config(flags + ["--allow-resume-older"])
    parse_config(["--hf-checkpoint", hf, "--load", iter_dir(str(root), 6), "--save", str(root)])  # the newest: fine
    parse_config(["--hf-checkpoint", hf, "--save", str(root)])  # auto-resume: not this rule


def test_allow_resume_older_moves_the_newer_ones_aside_and_loads_the_named_one(tmp_path, tiny_hf_models):
    root = _root(tmp_path)
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--load", iter_dir(str(root), 2),
                        "--save", str(root), "--allow-resume-older"])
    backend = _Backend()
    assert Resumer(cfg, CheckpointCursor()).resume_or_init(backend, None) == 2
    assert backend.loaded == [iter_dir(str(root), 2)]
    assert sorted(os.listdir(root)) == ["iter_0000002", "rollout_ckpts", SUPERSEDED_DIR]
    assert os.listdir(root / "rollout_ckpts") == ["rollout_2.pt"]
    aside = sorted(os.listdir(root / SUPERSEDED_DIR))
    assert [n.split(".")[0] for n in aside] == ["iter_0000004", "iter_0000006", "rollout_4"]
    assert (root / SUPERSEDED_DIR / aside[0] / "shard").read_text() == "step 4"  # moved, not rewritten


def test_move_aside_never_replaces_an_earlier_move(tmp_path):
    root = _root(tmp_path)
    first = move_aside(str(root), [4], now=0)
    os.makedirs(iter_dir(str(root), 4))
    second = move_aside(str(root), [4], now=0)  # the same second: another name
    assert first != second and all(os.path.isdir(p) for p in first + second)
