"""Atomic files and whole-directory publishes: a reader sees the old or the new content, never half."""

import json
import os

import pytest

from megatron_rl.infra.atomic import atomic_write_json, atomic_write_text, publish_dir


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "state.json"
    atomic_write_json(str(p), {"step": 1})
    atomic_write_json(str(p), {"step": 2})
    assert json.loads(p.read_text()) == {"step": 2}
    assert os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_failure_keeps_old_content(tmp_path, monkeypatch):
    p = tmp_path / "f.txt"
    atomic_write_text(str(p), "old")

    def crash(*_):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)  # die after the temp file is fully written
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_text(str(p), "new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_publish_dir_replaces_whole(tmp_path):
    final = tmp_path / "iter_0000001"
    for content in ("a", "b"):
        tmp = tmp_path / ".iter_tmp"
        tmp.mkdir()
        (tmp / "x").write_text(content)
        publish_dir(str(tmp), str(final))
    assert (final / "x").read_text() == "b"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001"]


def test_publish_dir_swaps_in_one_step(tmp_path, monkeypatch):
    """Replacing an existing dir never renames it away first (renameat2 RENAME_EXCHANGE)."""
    from megatron_rl.infra import atomic

    final = tmp_path / "iter_0000002"
    final.mkdir()
    (final / "x").write_text("old")
    tmp = tmp_path / ".iter_0000002.tmp"
    tmp.mkdir()
    (tmp / "x").write_text("new")
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b)))
    atomic.publish_dir(str(tmp), str(final))
    assert (final / "x").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002"]
    assert renames == []  # one exchange, no two-step replace
    # the fallback (no renameat2) still replaces the whole dir
    monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)
    tmp.mkdir()
    (tmp / "y").write_text("newer")
    atomic.publish_dir(str(tmp), str(final))
    assert sorted(os.listdir(final)) == ["y"] and len(renames) == 2
