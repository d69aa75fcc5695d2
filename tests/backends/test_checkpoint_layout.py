"""Checkpoint root bookkeeping and checkpoint-dir validation, without torch.distributed.

The validation in ``load_checkpoint`` runs before any collective, so it is tested
here on hand-made dirs; the real torch_dist round trips are in
tests/dist/test_checkpoint_resume.py.
"""

import io
import json
import os
import time
import zlib
from types import SimpleNamespace

import pytest

from megatron_rl.backends.megatron import checkpoint as ck
from megatron_rl.models.finite import is_non_finite
from megatron_rl.errors import CheckpointError
from megatron_rl.infra import checkpoint_root as cr


def _fake_ckpt(root, step, files=None, marker=True, model=None):
    path = cr.iter_dir(str(root), step)
    os.makedirs(path)
    files = files if files is not None else {"common.pt": b"abc", "__0_0.distcp": b"x" * 10}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    if marker:
        meta = {"format": ck.FORMAT, "model": model or _fingerprint(),
                "files": [{"path": n, "bytes": len(d)} for n, d in sorted(files.items())]}
        with open(os.path.join(path, cr.MARKER_NAME), "w") as f:
            json.dump(meta, f)
    return path


def _fingerprint(**over):
    fp = {"hidden_size": 64, "num_layers": 4, "num_attention_heads": 4, "num_query_groups": 2,
          "ffn_hidden_size": 128, "vocab_size": 250}
    fp.update(over)
    return fp


def _backend(**over):
    fp = _fingerprint(**over)
    cfg = SimpleNamespace(**{k: v for k, v in fp.items() if k != "vocab_size"})
    return SimpleNamespace(model_config=cfg, vocab_size=fp["vocab_size"])


def test_iter_dir_naming(tmp_path):
    assert cr.iter_dir(str(tmp_path), 3) == os.path.join(str(tmp_path), "iter_0000003")
    assert cr.temp_dir_for(cr.iter_dir("/r", 12)) == "/r/.iter_0000012.tmp"
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(CheckpointError):
            cr.iter_dir(str(tmp_path), bad)


def test_find_latest_complete_skips_incomplete_and_temp(tmp_path):
    assert cr.find_latest_complete(str(tmp_path / "absent")) is None
    assert cr.find_latest_complete(str(tmp_path)) is None
    _fake_ckpt(tmp_path, 2)
    _fake_ckpt(tmp_path, 5)
    _fake_ckpt(tmp_path, 7, marker=False)                 # published but incomplete
    os.makedirs(tmp_path / ".iter_0000009.tmp")           # save in progress
    (tmp_path / ".iter_0000009.tmp" / cr.MARKER_NAME).write_text("{}")
    os.makedirs(tmp_path / "iter_0000011.old")            # publish_dir's trash name
    (tmp_path / "notes.txt").write_text("x")
    assert cr.list_iterations(str(tmp_path)) == [2, 5, 7]
    assert cr.find_latest_complete(str(tmp_path)) == 5
    assert not cr.is_complete(str(tmp_path / ".iter_0000009.tmp"))


def test_latest_tracker_roundtrip_and_malformed(tmp_path):
    assert cr.read_latest(str(tmp_path)) is None
    cr.write_latest(str(tmp_path), 6)
    assert (tmp_path / cr.TRACKER_NAME).read_text() == "6\n"
    assert cr.read_latest(str(tmp_path)) == 6
    cr.write_latest(str(tmp_path), 12)
    assert cr.read_latest(str(tmp_path)) == 12
    (tmp_path / cr.TRACKER_NAME).write_text("release\n")
    with pytest.raises(CheckpointError, match=cr.TRACKER_NAME):
        cr.read_latest(str(tmp_path))


def test_prune_keeps_newest_complete(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_ckpt(tmp_path, s)
    _fake_ckpt(tmp_path, 0, marker=False)   # old incomplete: never resumable, goes
    _fake_ckpt(tmp_path, 9, marker=False)   # newer than every complete one: left for a human
    os.makedirs(tmp_path / ".iter_0000010.tmp")
    assert cr.prune(str(tmp_path), None) == [] and cr.prune(str(tmp_path), 0) == []
    assert cr.prune(str(tmp_path), 2) == [0, 1, 2]
    assert cr.list_iterations(str(tmp_path)) == [3, 4, 9]
    assert os.path.isdir(tmp_path / ".iter_0000010.tmp")
    assert cr.find_latest_complete(str(tmp_path)) == 4
    assert cr.prune(str(tmp_path), 5) == []


def test_prune_killed_mid_delete_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """A prune killed while deleting must not leave an iter_N dir that holds its marker but
    lacks shards (seen in the SIGKILL e2e test): the dir is renamed out of sight first."""
    for s in (1, 2, 3):
        _fake_ckpt(tmp_path, s)
    real_rmtree = cr.shutil.rmtree

    def dies_after_first_file(path, ignore_errors=False):
        if os.path.isfile(os.path.join(path, "__0_0.distcp")):  # deleting a checkpoint's files
            os.remove(os.path.join(path, "__0_0.distcp"))
            raise KeyboardInterrupt("killed mid-delete")  # the process dies here
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(cr.shutil, "rmtree", dies_after_first_file)
    with pytest.raises(KeyboardInterrupt):
        cr.prune(str(tmp_path), 2)
    monkeypatch.undo()
    assert cr.list_iterations(str(tmp_path)) == [2, 3]  # iter_1 vanished in one rename
    trash = tmp_path / ".iter_0000001.deleting"
    assert (trash / cr.MARKER_NAME).is_file()  # the half-deleted dir still holds its marker ...
    assert cr.is_temp_dir(str(trash)) and not cr.is_complete(str(trash))  # ... and is never loaded
    with pytest.raises(CheckpointError, match="unpublished temp dir of an interrupted write or prune"):
        ck.read_checkpoint_metadata(str(trash))
    for s in (2, 3):
        ck.read_checkpoint_metadata(cr.iter_dir(str(tmp_path), s))  # every visible one is whole
    cr.prune(str(tmp_path), 1)  # a later prune also clears the leftover trash of the killed one
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003"]


def test_resume_state_roundtrip(tmp_path):
    root = str(tmp_path / "root")
    assert cr.read_resume_state(root) is None
    state = {"rollout_id": 7, "data": {"epoch": 1, "offset": 96}, "wandb_run_id": "abc"}
    cr.write_resume_state(root, state)
    assert cr.read_resume_state(root) == state
    assert [f for f in os.listdir(root) if f != cr.RESUME_STATE_NAME] == []  # no temp files left behind
    with pytest.raises(CheckpointError, match="JSON"):
        cr.write_resume_state(root, {"bad": object()})
    assert cr.read_resume_state(root) == state  # a failed write leaves the old state
    (tmp_path / "root" / cr.RESUME_STATE_NAME).write_text("{trunc")
    with pytest.raises(CheckpointError, match="resume_state.json"):
        cr.read_resume_state(root)


def test_metadata_refuses_missing_temp_root_unmarked(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.read_checkpoint_metadata(str(tmp_path / "iter_0000001"))
    good = _fake_ckpt(tmp_path, 1)
    assert ck.read_checkpoint_metadata(good)["format"] == ck.FORMAT
    temp = tmp_path / ".iter_0000002.tmp"
    os.makedirs(temp)
    with pytest.raises(CheckpointError, match="unpublished temp dir") as e:
        ck.read_checkpoint_metadata(str(temp))
    assert str(temp) in str(e.value)
    with pytest.raises(CheckpointError, match="checkpoint root"):
        ck.read_checkpoint_metadata(str(tmp_path))
    unmarked = _fake_ckpt(tmp_path, 3, marker=False)
    with pytest.raises(CheckpointError, match="no COMPLETE.json") as e:
        ck.read_checkpoint_metadata(unmarked)
    assert unmarked in str(e.value)


def test_metadata_refuses_missing_or_resized_files_and_bad_marker(tmp_path):
    p = _fake_ckpt(tmp_path, 1)
    os.remove(os.path.join(p, "common.pt"))
    with pytest.raises(CheckpointError, match="common.pt missing"):
        ck.read_checkpoint_metadata(p)
    p = _fake_ckpt(tmp_path, 2)
    with open(os.path.join(p, "__0_0.distcp"), "ab") as f:
        f.write(b"more")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has 14 bytes, COMPLETE.json says 10"):
        ck.read_checkpoint_metadata(p)
    p = _fake_ckpt(tmp_path, 3)
    with open(os.path.join(p, cr.MARKER_NAME), "w") as f:
        f.write("{")
    with pytest.raises(CheckpointError, match="corrupt"):
        ck.read_checkpoint_metadata(p)
    p = _fake_ckpt(tmp_path, 4)
    meta = json.load(open(os.path.join(p, cr.MARKER_NAME)))
    meta["format"] = "megatron.legacy"
    json.dump(meta, open(os.path.join(p, cr.MARKER_NAME), "w"))
    with pytest.raises(CheckpointError, match="format"):
        ck.read_checkpoint_metadata(p)


@pytest.mark.parametrize("field,value", [("hidden_size", 32), ("num_layers", 2), ("vocab_size", 300)])
def test_load_refuses_other_model_before_any_collective(tmp_path, field, value):
    p = _fake_ckpt(tmp_path, 1)
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(_backend(**{field: value}), p)  # a fake backend: no process group needed
    msg = str(e.value)
    assert p in msg and field in msg and "--hf-checkpoint" in msg
    ck.check_model_matches(p, ck.read_checkpoint_metadata(p), _backend())  # the same model passes


def test_save_refuses_temp_path_and_unserialisable_extra_state(tmp_path):
    with pytest.raises(CheckpointError, match="temp-dir"):
        ck.save_checkpoint(_backend(), str(tmp_path / ".iter_0000001.tmp"), {})
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        ck.save_checkpoint(_backend(), str(tmp_path / "iter_0000001"), {"x": object()})
    assert os.listdir(tmp_path) == []


# ---- checksums, one fallback rule, resume_state.json ---------------------------------------


def _sealed_ckpt(root, step, files=None, extra=None):
    """A checkpoint whose marker lists every file with size and CRC-32, as save_checkpoint writes it."""
    files = dict(files if files is not None else {"common.pt": b"abc", "__0_0.distcp": bytes(range(200))})
    files[ck.EXTRA_STATE_NAME] = json.dumps(extra or {"rollout_id": step}).encode()
    path = _fake_ckpt(root, step, files=files, marker=False)
    meta = {"format": ck.FORMAT, "model": _fingerprint(), "files": cr.file_list(path)}
    with open(os.path.join(path, cr.MARKER_NAME), "w") as f:
        json.dump(meta, f)
    return path


def _flip_byte(path, offset=100):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_marker_records_crc32_and_same_size_damage_is_refused_by_name(tmp_path):
    p = _sealed_ckpt(tmp_path, 1)
    entry = {e["path"]: e for e in json.load(open(os.path.join(p, cr.MARKER_NAME)))["files"]}["__0_0.distcp"]
    assert entry == {"path": "__0_0.distcp", "bytes": 200, "crc32": f"{zlib.crc32(bytes(range(200))):08x}"}
    ck.read_checkpoint_metadata(p)
    _flip_byte(os.path.join(p, "__0_0.distcp"))  # same size, other bytes: what a size check cannot see
    with pytest.raises(cr.CorruptCheckpoint, match=r"__0_0.distcp has CRC-32 [0-9a-f]{8}, COMPLETE.json says "
                                                   + entry["crc32"]) as e:
        ck.read_checkpoint_metadata(p)
    assert p in str(e.value) and "--load ROOT/iter_NNNNNNN" in str(e.value)
    assert isinstance(e.value, CheckpointError)


def test_file_list_takes_checksums_computed_while_writing(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(b"hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"world")
    read_back = []
    real = cr.file_crc32
    monkeypatch.setattr(cr, "file_crc32", lambda path: read_back.append(os.path.basename(path)) or real(path))
    listed = cr.file_list(str(tmp_path), known_checksums={"a.bin": "0000abcd"})
    assert listed == [{"path": "a.bin", "bytes": 5, "crc32": "0000abcd"},
                      {"path": os.path.join("sub", "b.bin"), "bytes": 5, "crc32": f"{zlib.crc32(b'world'):08x}"}]
    assert read_back == ["b.bin"]  # the known one is not read again
    buf = io.BytesIO()
    w = cr.Crc32Writer(buf)
    w.write(b"hel")
    w.write(memoryview(b"lo"))
    assert buf.getvalue() == b"hello" and w.hexdigest == real(str(tmp_path / "a.bin"))


def test_old_marker_without_checksums_loads_with_a_warning(tmp_path, caplog):
    p = _fake_ckpt(tmp_path, 1)  # sizes only, as markers were written before checksums
    with caplog.at_level("WARNING"):
        assert ck.read_checkpoint_metadata(p)["format"] == ck.FORMAT
    assert f"{p} was written without checksums" in caplog.text


def test_every_failed_check_is_a_corrupt_checkpoint(tmp_path):
    """The one rule needs one exception: missing marker, corrupt marker, missing file, wrong size, checksum."""
    damage = {
        "unmarked": lambda p: os.remove(os.path.join(p, cr.MARKER_NAME)),
        "marker": lambda p: open(os.path.join(p, cr.MARKER_NAME), "w").write("{\"files\": 3}"),
        "missing": lambda p: os.remove(os.path.join(p, "common.pt")),
        "size": lambda p: open(os.path.join(p, "common.pt"), "ab").write(b"x"),
        "checksum": lambda p: _flip_byte(os.path.join(p, "__0_0.distcp")),
    }
    for i, (kind, hurt) in enumerate(damage.items(), start=1):
        p = _sealed_ckpt(tmp_path, i)
        hurt(p)
        with pytest.raises(cr.CorruptCheckpoint) as e:
            ck.read_checkpoint_metadata(p)
        assert p in str(e.value), kind
    with pytest.raises(CheckpointError) as e:  # a wrong argument is not "corrupt": no fallback hides it
        ck.read_checkpoint_metadata(str(tmp_path))
    assert not isinstance(e.value, cr.CorruptCheckpoint)


def _pointer(root, step, age_s=0.0):
    cr.write_resume_state(str(root), {"rollout_id": step, "checkpoint": cr.iter_dir(str(root), step)})
    t = time.time() - age_s
    os.utime(os.path.join(str(root), cr.RESUME_STATE_NAME), (t, t))


def _age(path, age_s):
    t = time.time() - age_s
    os.utime(os.path.join(path, cr.MARKER_NAME), (t, t))


def test_resume_candidates_follow_resume_state(tmp_path, caplog):
    root = str(tmp_path)
    for s in (2, 4, 6):
        _age(_sealed_ckpt(tmp_path, s), 100)
    assert cr.resume_candidates(root) == [6, 4, 2]  # no pointer: newest first
    _pointer(tmp_path, 4, age_s=50)  # iter_6 was written before the pointer: an earlier run's leftover
    with caplog.at_level("WARNING"):
        assert cr.resume_candidates(root) == [4, 2]
    assert f"{cr.iter_dir(root, 6)} is newer than {cr.iter_dir(root, 4)}" in caplog.text
    _age(cr.iter_dir(root, 6), 10)  # published after the pointer (killed before it was updated): this run's
    assert cr.resume_candidates(root) == [6, 4, 2]
    _pointer(tmp_path, 5)  # names a dir that is gone: the previous complete ones
    with caplog.at_level("WARNING"):
        assert cr.resume_candidates(root) == [4, 2]
    assert f"names {cr.iter_dir(root, 5)}, which is missing" in caplog.text
    # the pointer is matched by dir name, so a moved root keeps its order
    cr.write_resume_state(root, {"rollout_id": 9, "checkpoint": "/elsewhere/old_root/iter_0000002"})
    assert cr.resume_candidates(root) == [2]


def test_prune_never_deletes_the_checkpoint_resume_state_names(tmp_path):
    for s in (1, 2, 3, 4):
        _sealed_ckpt(tmp_path, s)
    _pointer(tmp_path, 1)  # e.g. the run went on from --load ROOT/iter_0000001
    assert cr.prune(str(tmp_path), 2) == [2]
    assert cr.list_iterations(str(tmp_path)) == [1, 3, 4]


def test_iteration_of_names_one_iteration_dir():
    assert cr.iteration_of("/r/iter_0000012") == 12 and cr.iteration_of("/r/iter_0000012/") == 12
    assert cr.iteration_of("/r") is None and cr.iteration_of("/r/.iter_0000012.tmp") is None


def test_is_non_finite_finds_inf_and_nan_in_every_float_dtype():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(64).to(dtype)
        assert not is_non_finite(t) and not is_non_finite(t[:0])
        for bad in (float("inf"), float("-inf"), float("nan")):
            u = t.clone()
            u[17] = bad
            assert is_non_finite(u), (dtype, bad)


def test_many_files_hash_in_parallel_to_the_same_checksums(tmp_path):
    blobs = {f"__0_{i}.distcp": os.urandom(70_000 + i) for i in range(6)}
    p = _fake_ckpt(tmp_path, 1, files=blobs, marker=False)
    listed = {e["path"]: e["crc32"] for e in cr.file_list(p)}
    assert listed == {n: f"{zlib.crc32(b):08x}" for n, b in blobs.items()}
    meta = {"files": cr.file_list(p)}
    _flip_byte(os.path.join(p, "__0_3.distcp"))
    _flip_byte(os.path.join(p, "__0_5.distcp"))
    bad = cr.listed_file_problems(p, meta)
    assert [b.split(" ")[0] for b in bad] == ["__0_3.distcp", "__0_5.distcp"]


def test_load_checks_checksums_before_anything_else(tmp_path):
    """load_checkpoint's own check (rank 0 sizes, then CRC-32 spread over the ranks; here one process)."""
    p = _sealed_ckpt(tmp_path, 1)
    assert ck._spread_checksums(p) == {e["path"]: e["crc32"] for e in cr.file_list(p)}
    _flip_byte(os.path.join(p, "__0_0.distcp"))
    with pytest.raises(cr.CorruptCheckpoint, match=r"iter_0000001 is corrupt: __0_0.distcp has CRC-32"):
        ck.load_checkpoint(_backend(), p)  # a fake backend: refused before the model is looked at
