"""A full disk while writing a checkpoint or a disk weight update: named, the temp dir removed, and
refused before writing when the room is known to be short (``infra.disk_space``, ``infra.publish``).

The failure is simulated by a write that raises what the kernel raises (``OSError(ENOSPC)``) or what
the libraries say when they keep no errno (safetensors' ``IoError(Os { code: 28 ...})``, torch's zip
writer ``unexpected pos``), and by a stand-in for ``statvfs``; one real two-rank launch that hits it
mid-save is tests/e2e/test_save_root.py.
"""

from __future__ import annotations

import errno
import os

import pytest

from megatron_rl.infra import disk_space
from megatron_rl.infra.disk_space import (CheckpointDiskFull, SyncDiskFull, check_free_space, disk_full_errno,
                                          disk_full_problem)
from megatron_rl.infra.publish import publish_collectively

GiB = 1 << 30


def _enospc(path="x"):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class _DcpLike(BaseException):
    """torch DCP's CheckpointException: a BaseException holding each rank's (exception, traceback)."""

    def __init__(self, failures):
        super().__init__("write failed")
        self.failures = failures


def test_disk_full_is_recognised_however_the_writer_says_it():
    wrapped = RuntimeError("Worker failure: ...")
    wrapped.__cause__ = _enospc()
    assert disk_full_errno(_enospc()) == errno.ENOSPC
    assert disk_full_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    assert disk_full_errno(wrapped) == errno.ENOSPC
    assert disk_full_errno(_DcpLike({1: (_enospc(), "tb")})) == errno.ENOSPC
    assert disk_full_errno(Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                     'message: "No space left on device" })')) == errno.ENOSPC
    assert disk_full_errno(Exception("IoError(Os { code: 122, kind: FilesystemQuotaExceeded })")) == errno.EDQUOT
    for other in (OSError(errno.EACCES, "Permission denied"), ValueError("bad shape"),
                  _DcpLike({0: (KeyError("k"), "")})):
        assert disk_full_errno(other) is None


def test_an_errno_less_write_failure_is_a_full_disk_only_when_the_filesystem_is_full():
    """torch's zip writer keeps no errno ('unexpected pos 704 vs 598', what the issue's save died with):
    the filesystem decides."""
    torn = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 704 vs 598")
    problem = disk_full_problem(torn, "/ckpt/.iter_0000002.tmp", needed=3 * GiB, free=lambda p: 4096)
    assert problem is not None and "/ckpt/.iter_0000002.tmp" in problem and "its filesystem is full" in problem
    assert "4.0 KiB free" in problem and "needs about 3.0 GiB" in problem and "unexpected pos" in problem
    assert disk_full_problem(torn, "/ckpt/x", free=lambda p: 50 * GiB) is None
    assert disk_full_problem(ValueError("not a write"), "/ckpt/x", free=lambda p: 0) is None
    quota = disk_full_problem(OSError(errno.EDQUOT, "Disk quota exceeded"), "/ckpt/x", free=lambda p: 50 * GiB)
    assert "disk quota of this user is exhausted" in quota


def test_check_free_space():
    assert check_free_space("/ckpt", 2 * GiB, "the checkpoint", free=lambda p: GiB).startswith(
        "not writing /ckpt: its filesystem has 1.0 GiB free and the checkpoint needs about 2.0 GiB")
    assert check_free_space("/ckpt", GiB, "x", free=lambda p: 2 * GiB) is None
    assert check_free_space("/ckpt", None, "x", free=lambda p: 0) is None  # size unknown: the write decides


def _seal(tmp):
    return {"format": "test"}


def test_publish_names_a_full_disk_removes_the_temp_dir_and_keeps_the_final_dir(tmp_path):
    final = tmp_path / "iter_0000004"
    final.mkdir()
    (final / "old").write_text("previous content")

    def write(tmp):
        with open(os.path.join(tmp, "shard"), "wb") as f:
            f.write(b"partial")
        raise _enospc(os.path.join(tmp, "shard"))

    with pytest.raises(CheckpointDiskFull) as info:
        publish_collectively(str(final), write, _seal)
    msg = str(info.value)
    assert f"writing {tmp_path}/.iter_0000004.tmp failed: its filesystem is full" in msg
    assert "Free space there" in msg and info.value.exit_code == 2
    assert isinstance(info.value.__cause__, OSError)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004"]  # no .tmp left
    assert (final / "old").read_text() == "previous content"


def test_publish_names_a_full_disk_in_rank0s_own_steps(tmp_path, monkeypatch):
    """The marker, the extra state, the rename: rank 0's steps after the collective write."""
    import megatron_rl.infra.publish as publish

    def full(path, obj):
        raise _enospc(path)

    monkeypatch.setattr(publish, "atomic_write_json", full)
    with pytest.raises(CheckpointDiskFull, match="its filesystem is full"):
        publish_collectively(str(tmp_path / "iter_0000001"), lambda tmp: None, _seal)
    assert os.listdir(tmp_path) == []


def test_publish_refuses_before_writing_when_the_previous_checkpoints_size_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space, "free_bytes", lambda p: 10)
    wrote = []
    with pytest.raises(CheckpointDiskFull, match=r"has 10 B free and the checkpoint needs about 1.0 KiB"):
        publish_collectively(str(tmp_path / "iter_0000002"), wrote.append, _seal, needed_bytes=lambda: 1024)
    assert wrote == [] and os.listdir(tmp_path) == []


def test_publish_keeps_other_errors_and_their_temp_dir_as_they_are(tmp_path):
    def write(tmp):
        raise ValueError("a bug, not the disk")

    with pytest.raises(ValueError, match="a bug"):
        publish_collectively(str(tmp_path / "iter_0000001"), write, _seal)
    assert os.listdir(tmp_path) == [".iter_0000001.tmp"]  # kept for a look; the next write clears it


def test_the_disk_transport_names_a_full_disk_and_says_what_a_relaunch_resumes_from(tmp_path, monkeypatch):
    """--update-weight-transport disk on a full filesystem: a SafetensorError (exit 143 before), now a
    SyncDiskFull naming the dir and the fix, exit code 3 when --save holds a complete checkpoint."""
    import torch

    from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
    from megatron_rl.weight_sync.disk import DiskSynchronizer

    class Backend:
        def export_weights(self, bucket_bytes):
            yield [("w", torch.ones(4))]

    class Engine:
        def update_weights_from_disk(self, path, version):
            raise AssertionError("nothing may be loaded after a failed write")

    def full_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                        '"No space left on device" })')

    monkeypatch.setattr("safetensors.torch.save_file", full_save)
    save = tmp_path / "ckpt"
    for root, expect_code in ((None, 2), (str(save), 3)):
        if root:
            os.makedirs(iter_dir(root, 2))
            open(os.path.join(iter_dir(root, 2), MARKER_NAME), "w").write("{}")
        sync = DiskSynchronizer(1 << 20, disk_dir=str(tmp_path / "weights"), checkpoint_root=root)
        with pytest.raises(SyncDiskFull) as info:
            sync.sync(Backend(), Engine(), version=5)
        msg = str(info.value)
        assert f"writing {tmp_path}/weights/v5 failed: its filesystem is full" in msg
        assert "--update-weight-disk-dir" in msg and info.value.exit_code == expect_code
        assert (f"{iter_dir(root, 2)} is complete: relaunch" in msg) if root else ("a relaunch starts over" in msg)
        assert os.listdir(tmp_path / "weights") == []  # the version's temp dir is gone
