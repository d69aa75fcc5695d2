"""Resumer.resume_or_init: which checkpoint a start continues from, and what it refuses."""

import json
import os

import pytest

from megatron_rl.errors import ConfigError


class _RecordingBackend:
    """Stands in for a backend in Resumer.resume_or_init (which only calls these)."""

    def __init__(self):
        self.calls = []

    def snapshot_weights(self, tag):
        self.calls.append(("backup", tag))

    def load_frozen_weights(self, tag, path):
        self.calls.append(("frozen", tag, path))

    def load(self, path):
        self.calls.append(("load", path))
        return {"rollout_id": 7}


def test_resume_or_init_with_a_model_only_load(tmp_path, tiny_hf_models):
    """--load of a converted model dir is the initial weights (backend.initialize reads it), so
    resume_or_init neither loads it as a checkpoint nor refuses it; resuming is from --save."""
    from megatron_rl.config import parse_config
    from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
    from megatron_rl.models.model_dir import FORMAT, is_model_dir
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    hf = tiny_hf_models("llama")
    model_dir, save = tmp_path / "converted", tmp_path / "save"
    model_dir.mkdir()
    (model_dir / MARKER_NAME).write_text(json.dumps({"format": FORMAT, "files": []}))
    assert is_model_dir(str(model_dir)) and not is_model_dir(str(save))

    def ctx(*flags):
        cfg = parse_config(["--hf-checkpoint", hf, "--use-kl-loss", "--kl-loss-coef", "0.01", *flags])
        return Resumer(cfg, CheckpointCursor())

    backend = _RecordingBackend()
    assert ctx("--load", str(model_dir), "--save", str(save)).resume_or_init(backend, None) == 0
    assert backend.calls == [("backup", "ref")]  # the KL reference = the loaded initial weights

    done = iter_dir(str(save), 7)
    os.makedirs(done)
    (tmp_path / "save" / os.path.basename(done) / MARKER_NAME).write_text("{}")
    backend = _RecordingBackend()
    assert ctx("--load", str(model_dir), "--save", str(save)).resume_or_init(backend, None) == 7
    assert backend.calls == [("backup", "ref"), ("load", done)]

    with pytest.raises(ConfigError, match="no complete checkpoint there"):  # a root with nothing in it
        ctx("--load", str(tmp_path / "empty_root")).resume_or_init(_RecordingBackend(), None)


class _CheckingBackend(_RecordingBackend):
    """A backend whose ``load`` runs the real checkpoint checks (marker, files, sizes, CRC-32) and
    returns extra_state.json; ``non_finite`` paths fail as load_checkpoint's inf/NaN check does."""

    def __init__(self, non_finite=()):
        super().__init__()
        self.non_finite = set(non_finite)

    def load(self, path):
        from megatron_rl.backends.megatron import checkpoint as ck
        from megatron_rl.infra.checkpoint_root import CorruptCheckpoint

        self.calls.append(("load", path))
        ck.read_checkpoint_metadata(path)
        if path in self.non_finite:
            raise CorruptCheckpoint(f"checkpoint {path} holds non-finite (inf/NaN) weights in 1 tensor(s): w")
        with open(os.path.join(path, ck.EXTRA_STATE_NAME)) as f:
            return json.load(f)


def _checked_ckpt(root, step, rollout_id=None):
    """A checkpoint dir as save_checkpoint publishes it (marker with sizes and CRC-32 of every file)."""
    from megatron_rl.backends.megatron import checkpoint as ck
    from megatron_rl.infra import checkpoint_root as cr

    path = cr.iter_dir(str(root), step)
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(bytes(range(256)) * 4)
    with open(os.path.join(path, ck.EXTRA_STATE_NAME), "w") as f:
        json.dump({"rollout_id": step if rollout_id is None else rollout_id}, f)
    meta = {"format": ck.FORMAT, "files": cr.file_list(path)}
    with open(os.path.join(path, cr.MARKER_NAME), "w") as f:
        json.dump(meta, f)
    return path


_DAMAGE = {
    "no_marker": lambda p: os.remove(os.path.join(p, "COMPLETE.json")),
    "corrupt_marker": lambda p: open(os.path.join(p, "COMPLETE.json"), "w").write("{trunc"),
    "missing_file": lambda p: os.remove(os.path.join(p, "__0_0.distcp")),
    "wrong_size": lambda p: open(os.path.join(p, "__0_0.distcp"), "ab").write(b"x"),
    "checksum": lambda p: open(os.path.join(p, "__0_0.distcp"), "r+b").write(b"\xff\xfe"),
    "non_finite": None,
}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_auto_resume_skips_any_failed_check_to_the_previous_checkpoint(tmp_path, tiny_hf_models, caplog, damage):
    """One rule for every failed check: warn naming the reason, resume from the previous complete one."""
    from megatron_rl.config import parse_config
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    hf = tiny_hf_models("llama")
    save = tmp_path / "save"
    good, bad = _checked_ckpt(save, 2), _checked_ckpt(save, 4)
    if _DAMAGE[damage]:
        _DAMAGE[damage](bad)
    backend = _CheckingBackend(non_finite=[bad] if damage == "non_finite" else [])
    cfg = parse_config(["--hf-checkpoint", hf, "--save", str(save)])
    with caplog.at_level("WARNING"):
        step = Resumer(cfg, CheckpointCursor()).resume_or_init(backend, None)
    assert step == 2
    loads = [c[1] for c in backend.calls if c[0] == "load"]
    assert loads == ([good] if damage == "no_marker" else [bad, good])
    assert bad in caplog.text and ("no COMPLETE.json" if damage == "no_marker" else "not resuming from") in caplog.text


def test_load_of_a_named_iteration_loads_exactly_it(tmp_path, tiny_hf_models):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.infra.checkpoint_root import CorruptCheckpoint
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    hf = tiny_hf_models("llama")
    root = tmp_path / "ckpt"
    older, newer, broken = _checked_ckpt(root, 2), _checked_ckpt(root, 4), _checked_ckpt(root, 6)
    _DAMAGE["checksum"](broken)

    def resume(*flags):
        backend = _CheckingBackend()
        cfg = parse_config(["--hf-checkpoint", hf, *flags])
        step = Resumer(cfg, CheckpointCursor()).resume_or_init(backend,
                                                                                                          None)
        return step, [c[1] for c in backend.calls if c[0] == "load"]

    assert resume("--load", older) == (2, [older])  # not the newer iter_4 (with --save ROOT: test_resume_older.py)
    assert resume("--load", str(root)) == (4, [broken, newer])  # the root: auto-resume's rule
    with pytest.raises(CheckpointError) as e:  # named by the user: refused by name, no fallback
        resume("--load", broken, "--save", str(root))
    assert f"--load {broken}" in str(e.value) and "__0_0.distcp has CRC-32" in str(e.value)
    assert not isinstance(e.value, CorruptCheckpoint)  # nothing above may fall back from it
    with pytest.raises(CheckpointError, match="does not exist"):
        resume("--load", str(root / "iter_0000003"))


def test_auto_resume_follows_resume_state_not_a_newer_leftover(tmp_path, tiny_hf_models, caplog):
    """resume_state.json (written at each save) names the run's checkpoint; a newer-numbered iter dir
    written before it is an earlier run's leftover and is not resumed from."""
    import time

    from megatron_rl.config import parse_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.infra.checkpoint_root import RESUME_STATE_NAME, write_resume_state
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    hf = tiny_hf_models("llama")
    save = tmp_path / "save"
    one, two, old_run = _checked_ckpt(save, 1), _checked_ckpt(save, 2), _checked_ckpt(save, 8)
    past = time.time() - 100
    for p in (one, two, old_run):
        os.utime(os.path.join(p, "COMPLETE.json"), (past, past))
    write_resume_state(str(save), {"rollout_id": 2, "checkpoint": two})

    def resume():
        backend = _CheckingBackend()
        cfg = parse_config(["--hf-checkpoint", hf, "--save", str(save)])
        step = Resumer(cfg, CheckpointCursor()).resume_or_init(backend,
                                                                                                          None)
        return step, [c[1] for c in backend.calls if c[0] == "load"]

    with caplog.at_level("WARNING"):
        assert resume() == (2, [two])
    assert f"{old_run} is newer than {two}" in caplog.text
    _DAMAGE["wrong_size"](two)  # the named one is bad: the one rule, back to iter_1 (never to the leftover)
    assert resume() == (1, [two, one])
    _DAMAGE["missing_file"](one)
    with pytest.raises(CheckpointError, match="no checkpoint under .* passes its checks"):
        resume()
    assert os.path.isfile(save / RESUME_STATE_NAME)


def test_a_full_async_checkpoint_with_untrained_prompts_is_not_resumed_by_another_mode(tmp_path, tiny_hf_models):
    """Its prompt position is after every prompt the producer drew; only --async-mode full reads the buffer
    file that holds the untrained ones, so another mode would skip them: refused, naming the fix."""
    from megatron_rl.config import parse_config
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    save = tmp_path / "save"
    path = _checked_ckpt(save, 2)

    class Full(_RecordingBackend):
        def load(self, p):
            self.calls.append(("load", p))
            return {"rollout_id": 2, "async_buffer": {"file": "buffer_2.pt", "groups": 1, "pending": 3}}

    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("llama"), "--save", str(save)])
    with pytest.raises(ConfigError, match=r"saved by --async-mode full with 1 finished and 3 unfinished prompt "
                                          r"group\(s\).*Relaunch with --async-mode full"):
        Resumer(cfg, CheckpointCursor()).resume_or_init(Full(), None)
    assert os.path.isdir(path)  # refused, nothing moved or deleted
