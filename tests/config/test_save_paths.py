"""Output paths checked at validation, and the fresh-start guard on a --save that holds checkpoints.

``--no-auto-resume`` into a root with an earlier run's checkpoints overwrote and pruned
them silently; ``--save`` / ``--output-dir`` that were files or unusable failed at the first save
(after a save interval of work) or with a traceback. All of these are now refused by
``parse_config`` (every rank, before any worker or step), and ``--existing-save`` says what to do
with the old checkpoints (``runner.fresh_start``, run by ``RunContext.create`` on rank 0).
Tests run as root, so "not writable" is tested as a path under a file (chmod does not stop root).
"""

from __future__ import annotations

import os
import signal

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError
from megatron_rl.runner.fresh_start import clear_save_root


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def _old_run(root):
    """A root as an earlier run leaves it, plus a file that is not a checkpoint."""
    for it in ("iter_0000002", "iter_0000004"):
        (root / it).mkdir(parents=True)
        (root / it / "COMPLETE.json").write_text("{}")
        (root / it / "__0_0.distcp").write_bytes(it.encode())
    (root / ".iter_0000006.tmp").mkdir()
    (root / "resume_state.json").write_text('{"rollout_id": 4}')
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    (root / "notes.txt").write_text("mine")
    return root


def _tree(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def test_fresh_start_into_a_root_with_checkpoints_is_refused_unless_told(hf_dir, tmp_path):
    root = _old_run(tmp_path / "ckpt")
    before = _tree(root)
    argv = ["--hf-checkpoint", hf_dir, "--save", str(root), "--output-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError) as exc:
        parse_config(argv + ["--no-auto-resume"])
    msg = str(exc.value)
    assert f"--no-auto-resume with --save {root}, which already holds checkpoints" in msg
    assert ".iter_0000006.tmp, iter_0000002, iter_0000004, latest_checkpointed_iteration.txt, ..." in msg
    assert "--existing-save archive" in msg and "--existing-save discard" in msg
    assert _tree(root) == before  # validation only looks
    assert parse_config(argv)  # auto-resume from the same root is fine
    assert parse_config(argv + ["--no-auto-resume", "--existing-save", "archive"])
    assert parse_config(["--hf-checkpoint", hf_dir, "--save", str(tmp_path / "new"), "--no-auto-resume"])
    (tmp_path / "only_notes").mkdir()
    (tmp_path / "only_notes" / "notes.txt").write_text("x")  # not a checkpoint: no guard
    assert parse_config(["--hf-checkpoint", hf_dir, "--save", str(tmp_path / "only_notes"), "--no-auto-resume"])
    with pytest.raises(ConfigError, match="--existing-save discard only applies to a fresh start: add "
                                          "--no-auto-resume"):
        parse_config(argv + ["--existing-save", "discard"])
    with pytest.raises(ConfigError, match="--existing-save archive needs --save ROOT"):
        parse_config(["--hf-checkpoint", hf_dir, "--no-auto-resume", "--existing-save", "archive"])
    with pytest.raises(ConfigError, match=r"--ref-load .*iter_0000002 lies in the old checkpoints under --save .* "
                                          "that --existing-save discard would delete"):
        parse_config(argv + ["--no-auto-resume", "--existing-save", "discard", "--ref-load",
                             str(root / "iter_0000002")])


def test_existing_save_archive_and_discard(tmp_path):
    root = _old_run(tmp_path / "a")
    before = _tree(root)
    dest = clear_save_root(str(root), "archive", now=0)
    assert os.path.basename(dest) == "archive_19700101T000000Z"
    assert sorted(os.listdir(root)) == ["archive_19700101T000000Z", "notes.txt"]
    assert _tree(dest) == {k: v for k, v in before.items() if k != "notes.txt"}
    assert clear_save_root(str(root), "archive", now=0) is None  # nothing left to move
    _old_run(tmp_path / "b")
    root_b = tmp_path / "b"
    assert clear_save_root(str(root_b), "discard") is None
    assert os.listdir(root_b) == ["notes.txt"]


def test_run_context_applies_existing_save_before_the_run(hf_dir, tmp_path, monkeypatch):
    from megatron_rl.runner.context import RunContext

    root = _old_run(tmp_path / "ckpt")
    cfg = parse_config(["--hf-checkpoint", hf_dir, "--save", str(root), "--output-dir", str(tmp_path / "run"),
                        "--no-auto-resume", "--existing-save", "archive"])
    monkeypatch.setenv("RANK", "0")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ctx = RunContext.create(cfg)
        ctx.tracker.close()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert sorted(n for n in os.listdir(root) if not n.startswith("archive_")) == [".megatron_rl.lock", "notes.txt"]
    assert ctx.resume_state == {}


@pytest.mark.parametrize("flag", ["--save", "--output-dir", "--tensorboard-dir", "--save-debug-rollout-data"])
def test_unusable_output_paths_are_refused_at_validation(flag, hf_dir, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    under = str(afile / "sub" / "r_{rollout_id}.pt") if flag == "--save-debug-rollout-data" else str(afile / "sub")
    base = ["--hf-checkpoint", hf_dir, "--output-dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=f"cannot be created: {afile} is a file, not a directory"):
        parse_config(base + [flag, under])
    if flag != "--save-debug-rollout-data":
        with pytest.raises(ConfigError, match=f"{flag} {afile} exists and is not a directory"):
            parse_config(base + [flag, str(afile)])
    ok = str(tmp_path / "new" / "deep" / ("r_{rollout_id}.pt" if flag == "--save-debug-rollout-data" else ""))
    assert parse_config(base + [flag, ok])


def test_unwritable_parent_is_refused(hf_dir, tmp_path, monkeypatch):
    """Root ignores permission bits, so the unwritable case is simulated: os.access answers False for
    one directory (a test double for a read-only mount), everything else is real."""
    ro = tmp_path / "readonly"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(ro)
                        else real_access(p, mode, **kw))
    with pytest.raises(ConfigError, match=f"--save {ro}/ckpt cannot be created: {ro} is not writable by this user"):
        parse_config(["--hf-checkpoint", hf_dir, "--output-dir", str(tmp_path / "run"), "--save", str(ro / "ckpt")])
    with pytest.raises(ConfigError, match=f"--output-dir {ro} is a directory this user cannot write to"):
        parse_config(["--hf-checkpoint", hf_dir, "--output-dir", str(ro)])
