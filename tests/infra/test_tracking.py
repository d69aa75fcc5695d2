"""The tracker: JSONL, TensorBoard, W&B (offline), console selection and the curves plot."""

import os
import subprocess
import sys

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.infra.tracking import Tracker, final_lineage, format_metrics, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_default_plot_shows_the_multi_turn_metrics_only_when_logged(tmp_path):
    from megatron_rl.infra.plot import DEFAULT_KEYS, plot_metrics

    plain = [{"step": s, "rollout/reward_mean": 0.1 * s} for s in range(3)]
    agent = [{**r, "rollout/tool_calls_mean": 0.5, "rollout/turns_mean": 1.5, "rollout/tool_error_frac": 0.0}
             for r in plain]
    assert plot_metrics(plain, DEFAULT_KEYS, str(tmp_path / "a.png")) == ["rollout/reward_mean"]
    assert plot_metrics(agent, DEFAULT_KEYS, str(tmp_path / "b.png")) == [
        "rollout/reward_mean", "rollout/tool_calls_mean", "rollout/turns_mean", "rollout/tool_error_frac"]


def _attempt(run, tb, start: int, steps, base: float) -> None:
    """One launch of the loop as train.run logs it: the start record (weight sync at ``start``), then a record
    per trained step."""
    tr = Tracker(str(run), tensorboard_dir=str(tb))
    tr.begin_attempt(start)
    tr.log(start, {"sync/weight_version": float(start)}, attempt_start=True)
    for step in steps:
        tr.log(step, {"rollout/reward_mean": base + step})
    tr.close()


def test_a_resumed_run_marks_the_rolled_back_records_superseded_and_tensorboard_hides_them(tmp_path):
    """Was: metrics.jsonl kept the rolled-back steps of a crash-resume twice (steps 7, 8, 10-12 with two values
    each in a full-async run), TensorBoard showed both. Three launches: 1 trains 1-5 (checkpoint at 2, killed
    mid-write of a record), 2 resumes at 2 and trains 3-4 (killed), 3 resumes at 2 again and trains 3-6."""
    run, tb = tmp_path / "run", tmp_path / "tb"
    _attempt(run, tb, 0, range(1, 6), 0.0)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "ti')  # SIGKILL mid-write
    _attempt(run, tb, 2, (3, 4), 10.0)
    _attempt(run, tb, 2, (3, 4, 5, 6), 100.0)

    recs = read_jsonl(str(run / "metrics.jsonl"))
    assert [r["attempt"] for r in recs] == [1] * 6 + [2] * 3 + [3] * 5  # the torn line dropped
    live = [r for r in recs if not r.get("superseded")]  # jq 'select(.superseded | not)'
    assert live == final_lineage(recs)
    assert [(r["attempt"], r["step"]) for r in live] == [(1, 0), (1, 1), (1, 2), (3, 2), (3, 3), (3, 4), (3, 5),
                                                         (3, 6)]
    trained = [(r["step"], r["rollout/reward_mean"]) for r in live if "rollout/reward_mean" in r]
    assert trained == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0), (6, 106.0)]  # one record a step
    gone = [(r["attempt"], r["step"]) for r in recs if r.get("superseded")]
    assert gone == [(1, 3), (1, 4), (1, 5), (2, 2), (2, 3), (2, 4)]  # attempt 2's start record at 2 too
    assert not [n for n in os.listdir(run) if n != "metrics.jsonl"]  # rewritten in place: no temp file left

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]  # float32: these are exact
    assert shown == trained  # the final lineage: the purged events of steps 3-5 hidden

    proc = subprocess.run([sys.executable, "tools/plot_run.py", str(run / "metrics.jsonl"), "--out",
                           str(tmp_path / "c.png")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "left out 6 superseded record(s)" in proc.stdout, proc.stdout + proc.stderr


def test_a_fresh_start_over_an_earlier_run_supersedes_all_of_it(tmp_path):
    """--no-auto-resume (or a root with no checkpoint yet) in an output dir with records: attempt 2 starts at 0."""
    run, tb = tmp_path / "run", tmp_path / "tb"
    _attempt(run, tb, 0, (1, 2), 0.0)
    _attempt(run, tb, 0, (1,), 10.0)
    recs = read_jsonl(str(run / "metrics.jsonl"))
    assert [(r["attempt"], r["step"]) for r in final_lineage(recs)] == [(2, 0), (2, 1)]
