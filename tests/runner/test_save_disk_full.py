"""The run's save on a full disk: a CheckpointDiskFull that says what a relaunch resumes from, with exit
code 3 when that is a complete checkpoint (2 when there is none), in the backend's write and in the
driver's pointer writes after it (``runner.checkpoints.CheckpointSaver``); and megatron's torch_dist
write (``save_torch_dist``) keeps the coordinator's ``.metadata`` failure until after the broadcast
the other ranks wait in. The two-rank launch: tests/e2e/test_save_root.py.
"""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest

from megatron_rl.config import parse_config
from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
from megatron_rl.infra.disk_space import CheckpointDiskFull
from megatron_rl.infra.wall_time import WallClock
from megatron_rl.runner.checkpoints import CheckpointCursor, CheckpointSaver


def _saver(hf, root):
    cfg = parse_config(["--hf-checkpoint", hf, "--save", str(root), "--save-interval", "1"])
    return CheckpointSaver(cfg, CheckpointCursor(), WallClock(None, 0.0), SimpleNamespace(wandb_run_id=None), True)


class _Backend:
    def __init__(self, full: bool):
        self.full = full

    def save(self, path, extra):
        if self.full:
            raise CheckpointDiskFull(f"writing {path}.tmp failed: its filesystem is full (0 B free)")
        os.makedirs(path)
        open(os.path.join(path, MARKER_NAME), "w").write("{}")


def test_a_full_disk_during_the_write_names_the_checkpoint_to_resume_from(tmp_path, tiny_hf_models):
    hf, root = tiny_hf_models("qwen2"), tmp_path / "save"
    with pytest.raises(CheckpointDiskFull) as first:
        _saver(hf, root).save(_Backend(full=True), None, 1)
    assert first.value.exit_code == 2 and "Nothing was saved under --save" in str(first.value)

    _saver(hf, root).save(_Backend(full=False), None, 1)
    with pytest.raises(CheckpointDiskFull) as later:
        _saver(hf, root).save(_Backend(full=True), None, 2)
    msg = str(later.value)
    assert later.value.exit_code == 3
    assert f"{iter_dir(str(root), 2)} was not saved; {iter_dir(str(root), 1)} is complete: relaunch" in msg


def test_a_full_disk_while_writing_the_pointers_after_publishing(tmp_path, tiny_hf_models, monkeypatch):
    import megatron_rl.infra.checkpoint_root as ckpt

    def full(root, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(root, ckpt.TRACKER_NAME))

    monkeypatch.setattr(ckpt, "write_latest", full)
    root = tmp_path / "save"
    with pytest.raises(CheckpointDiskFull) as info:
        _saver(tiny_hf_models("qwen2"), root).save(_Backend(full=False), None, 3)
    assert info.value.exit_code == 3
    assert f"{iter_dir(str(root), 3)} was published; its pointers were not written" in str(info.value)


def test_the_coordinators_metadata_failure_is_raised_after_the_broadcast(tmp_path, tp1_world, monkeypatch):
    """megatron's finalize: the coordinator writes .metadata, then broadcasts whether any rank failed;
    raised before that broadcast (as dc.save does) it left the other ranks waiting in it."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    from megatron_rl.backends.megatron.checkpoint import save_torch_dist
    from megatron_rl.models.dist_io import dist_checkpointing

    dc = dist_checkpointing()
    events = []
    real_broadcast = state_dict_saver.torch.distributed.broadcast

    def broadcast(*args, **kwargs):
        events.append("broadcast")
        return real_broadcast(*args, **kwargs)

    def full(self, *args, **kwargs):
        events.append("finish")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), ".metadata")

    monkeypatch.setattr(state_dict_saver.torch.distributed, "broadcast", broadcast)
    monkeypatch.setattr(filesystem_async.FileSystemWriterAsync, "finish", full)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    with pytest.raises(OSError) as info:
        save_torch_dist(dc, sd, str(tmp_path), {"megatron_rl_format": "test"})
    assert info.value.errno == errno.ENOSPC
    assert events == ["finish", "broadcast"]
    assert not os.path.exists(tmp_path / "metadata.json")  # the save stopped at the agreement


def test_an_engine_lost_mid_run_exits_3_where_a_checkpoint_resumes_it_as_a_full_disk_does(tmp_path, tiny_hf_models):
    """The class: a mid-run failure of what the run depends on outside the trainer (the disk above, an engine
    here) exits 3 ("relaunch to resume") when a complete checkpoint is under --save, and names it; 2 otherwise.
    Was: an engine killed mid-run in full async mode exited 2 (the code of a refusal) beside a resumable
    checkpoint. ``train.engine_failure`` is what train.run raises for an EngineError (or a SyncError whose
    engine died); train.main exits with its exit_code."""
    from megatron_rl.errors import EngineError
    from megatron_rl.infra.wall_time import EXIT_WALL_TIME
    from megatron_rl.train import engine_failure

    hf, root = tiny_hf_models("qwen2"), tmp_path / "save"
    cfg = parse_config(["--hf-checkpoint", hf, "--save", str(root), "--async-mode", "full", "--rollout-backend",
                        "sglang", "--rollout-engine-urls", "http://127.0.0.1:1", "--max-staleness", "1"])
    dead = EngineError("SGLang server http://127.0.0.1:1: connection refused")
    assert engine_failure(cfg, dead, mid_run=True) is dead  # nothing saved yet: a relaunch starts over (2)
    _saver(hf, root).save(_Backend(full=False), None, 2)
    out = engine_failure(cfg, dead, mid_run=True)
    assert isinstance(out, EngineError) and out.exit_code == EXIT_WALL_TIME == 3
    assert str(out).startswith(f"{dead}; {iter_dir(str(root), 2)} is complete: relaunch the same command")
    assert engine_failure(cfg, dead, mid_run=False) is dead  # at start-up: a refusal, whatever is on disk
    # full async: the producer's failure reaches the trainer wrapped; an engine's is resumable, a bug's is not
    from megatron_rl.runner.producer import ProducerError

    for cause, code in ((dead, 3), (KeyError("label"), 2)):
        wrapped = ProducerError(f"rollout producer failed: {cause}")
        wrapped.__cause__ = cause
        assert getattr(engine_failure(cfg, wrapped, mid_run=True), "exit_code", 2) == code, cause
