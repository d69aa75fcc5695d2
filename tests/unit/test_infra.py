import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.infra.atomic import atomic_write_json, atomic_write_text, publish_dir
from megatron_rl.infra.tracking import Tracker, format_metrics, read_jsonl
from megatron_rl.infra.wall_time import WallClock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_wall_clock_reserve_and_eval_gate():
    clock = WallClock(limit_s=100.0, reserve_s=10.0, elapsed_before_s=85.0)
    assert not clock.should_stop() and not clock.can_eval()  # 15 s left: < 2 reserves
    clock = WallClock(limit_s=100.0, reserve_s=10.0, elapsed_before_s=91.0)
    assert clock.should_stop() and "under --wall-time-reserve" in clock.stop_reason()
    assert not WallClock(None, 600).should_stop()


def test_wall_clock_sigterm():
    clock = WallClock(None, 1.0)
    old = signal.getsignal(signal.SIGTERM)
    try:
        clock.install_signal_handlers()
        clock.stop_at_next_step_on_signal()  # the loop is ready to save: a signal only asks for a stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert clock.should_stop() and "SIGTERM" in clock.stop_reason()
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, signal.default_int_handler)


STARTUP_HANG = """
import sys, time
from megatron_rl.infra.wall_time import WallClock
WallClock(None, 1.0).install_signal_handlers()
print("ready", flush=True)
time.sleep(60)  # a start-up that hangs (an import that blocks)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_startup_ends_the_process(sig):
    """Before the loop can save, SIGTERM/SIGINT end the process at once (they used to only set a flag)."""
    proc = subprocess.Popen([sys.executable, "-c", STARTUP_HANG], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
    assert rc == -sig and time.monotonic() - t0 < 20


def test_tracker_jsonl_tensorboard_and_plot(tmp_path, capsys):
    tb = tmp_path / "tb"
    tr = Tracker(str(tmp_path / "run"), tensorboard_dir=str(tb))
    for step in range(3):
        tr.log(step, {"rollout/reward_mean": 0.1 * step, "train/kl": 0.01, "nan_metric": float("nan"), "s": "x"})
    tr.close()
    recs = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["rollout/reward_mean"] for r in recs] == pytest.approx([0.0, 0.1, 0.2])
    assert "nan_metric" not in recs[0] and "s" not in recs[0]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    assert "step 2: rollout/reward_mean=0.2" in capsys.readouterr().out
    out = tmp_path / "c.png"
    proc = subprocess.run([sys.executable, "tools/plot_run.py", str(tmp_path / "run" / "metrics.jsonl"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tracker_disabled_on_non_driver(tmp_path):
    tr = Tracker(str(tmp_path / "run"), enabled=False)
    tr.log(0, {"a": 1})
    assert not (tmp_path / "run").exists()


def test_wandb_missing_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="--wandb-project needs the wandb package"):
        Tracker(str(tmp_path), wandb_project="p")


def test_format_metrics_selects_keys():
    assert format_metrics(4, {"a": 1.0, "b": 2.0}, ["b"]) == "step 4: b=2"


def test_wandb_offline_run_and_resume_id(tmp_path, monkeypatch):
    """--wandb-mode offline needs no network; --wandb-resume-id continues the same run id."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    first = Tracker(str(tmp_path / "run"), wandb_project="demo", wandb_mode="offline", config={"lr": 1e-3})
    run_id = first.wandb_run_id
    first.log(1, {"rollout/reward_mean": 0.1})
    first.close()
    again = Tracker(str(tmp_path / "run"), wandb_project="demo", wandb_mode="offline", wandb_resume_id=run_id)
    again.log(2, {"rollout/reward_mean": 0.2})
    again.close()
    assert again.wandb_run_id == run_id
    runs = sorted(os.listdir(tmp_path / "run" / "wandb"))
    assert any(r.startswith("offline-run-") and r.endswith(run_id) for r in runs)


class _RecordingBackend:
    """Stands in for a backend in RunContext.resume_or_init (which only calls these)."""

    def __init__(self):
        self.calls = []

        class _Weights:
            def backup(inner, tag):
                self.calls.append(("backup", tag))

        self.weights = _Weights()

    def load_frozen_weights(self, tag, path):
        self.calls.append(("frozen", tag, path))

    def load(self, path):
        self.calls.append(("load", path))
        return {"rollout_id": 7}


def test_resume_or_init_with_a_model_only_load(tmp_path, tiny_hf_models):
    """--load of a converted model dir is the initial weights (backend.initialize reads it), so
    resume_or_init neither loads it as a checkpoint nor refuses it; resuming is from --save."""
    from megatron_rl.config import parse_config
    from megatron_rl.convert import common
    from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
    from megatron_rl.infra.run import RunContext

    hf = tiny_hf_models("llama")
    model_dir, save = tmp_path / "converted", tmp_path / "save"
    model_dir.mkdir()
    (model_dir / MARKER_NAME).write_text(json.dumps({"format": common.FORMAT, "files": []}))
    assert common.is_model_dir(str(model_dir)) and not common.is_model_dir(str(save))

    def ctx(*flags):
        cfg = parse_config(["--hf-checkpoint", hf, "--use-kl-loss", "--kl-loss-coef", "0.01", *flags])
        return RunContext(cfg, tracker=None, clock=None, colocation=None, is_driver=True)

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
    from megatron_rl.infra.run import RunContext

    hf = tiny_hf_models("llama")
    save = tmp_path / "save"
    good, bad = _checked_ckpt(save, 2), _checked_ckpt(save, 4)
    if _DAMAGE[damage]:
        _DAMAGE[damage](bad)
    backend = _CheckingBackend(non_finite=[bad] if damage == "non_finite" else [])
    cfg = parse_config(["--hf-checkpoint", hf, "--save", str(save)])
    with caplog.at_level("WARNING"):
        step = RunContext(cfg, tracker=None, clock=None, colocation=None, is_driver=True).resume_or_init(backend, None)
    assert step == 2
    loads = [c[1] for c in backend.calls if c[0] == "load"]
    assert loads == ([good] if damage == "no_marker" else [bad, good])
    assert bad in caplog.text and ("no COMPLETE.json" if damage == "no_marker" else "not resuming from") in caplog.text


def test_load_of_a_named_iteration_loads_exactly_it(tmp_path, tiny_hf_models):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.infra.checkpoint_root import CorruptCheckpoint
    from megatron_rl.infra.run import RunContext

    hf = tiny_hf_models("llama")
    root = tmp_path / "ckpt"
    older, newer, broken = _checked_ckpt(root, 2), _checked_ckpt(root, 4), _checked_ckpt(root, 6)
    _DAMAGE["checksum"](broken)

    def resume(*flags):
        backend = _CheckingBackend()
        cfg = parse_config(["--hf-checkpoint", hf, *flags])
        step = RunContext(cfg, tracker=None, clock=None, colocation=None, is_driver=True).resume_or_init(backend,
                                                                                                          None)
        return step, [c[1] for c in backend.calls if c[0] == "load"]

    assert resume("--load", older, "--save", str(root)) == (2, [older])  # not the newer iter_4
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
    from megatron_rl.infra.run import RunContext

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
        step = RunContext(cfg, tracker=None, clock=None, colocation=None, is_driver=True).resume_or_init(backend,
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
