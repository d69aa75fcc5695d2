"""The tracker: JSONL, TensorBoard, W&B (offline), console selection and the curves plot."""

import os
import subprocess
import sys

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.infra.tracking import Tracker, format_metrics, read_jsonl

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
