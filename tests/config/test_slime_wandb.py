"""slime's W&B flags: aliases of ours with the same behaviour (offline mode, resume id).

slime: ``--use-wandb --wandb-project P --wandb-group G --wandb-team T --wandb-host URL --wandb-key K``
(and ``--wandb-run-id``). Here W&B logging is on when --wandb-project is given; the others are
passed to ``wandb.init`` / ``wandb.login`` by ``infra.tracking.Tracker``. Offline runs are real
wandb offline runs (no network); the login is observed, not replaced, by a spy that refuses
to be called.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError
from megatron_rl.infra.tracking import Tracker, redact_secrets


@pytest.fixture
def hf(tmp_path):
    from megatron_rl.models.hf_tiny import tiny_config

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config("qwen2").to_dict()))
    return str(d)


def test_slime_wandb_flags_parse_into_ours(hf):
    cfg = parse_config(["--hf-checkpoint", hf, "--use-wandb", "--wandb-project", "slime-dev", "--wandb-group", "g",
                        "--wandb-team", "glm-zero", "--wandb-host", "https://wandb.ai/", "--wandb-key", "k" * 40,
                        "--wandb-run-id", "abc123"])
    rt = cfg.runtime
    assert (rt.use_wandb, rt.wandb_project, rt.wandb_group, rt.wandb_team, rt.wandb_host, rt.wandb_resume_id) == (
        True, "slime-dev", "g", "glm-zero", "https://wandb.ai/", "abc123")
    assert redact_secrets(cfg.to_dict())["runtime"]["wandb_key"] == "<redacted>"


@pytest.mark.parametrize("flag", [["--use-wandb"], ["--wandb-team", "t"], ["--wandb-host", "https://h"],
                                  ["--wandb-key", "secret-key"]])
def test_wandb_flags_without_a_project_are_refused(hf, flag):
    with pytest.raises(ConfigError, match=f"{flag[0]}.*add --wandb-project NAME") as exc:
        parse_config(["--hf-checkpoint", hf, *flag])
    assert "secret-key" not in str(exc.value)  # a key is never echoed


def test_offline_run_with_team_host_and_key_resumes_and_never_logs_in(tmp_path, monkeypatch):
    """Same behaviour as --wandb-project alone: offline needs no network (no login, as slime),
    the entity is recorded, and --wandb-run-id continues the run; the key is not in the config."""
    import wandb

    def no_login(*a, **k):
        raise AssertionError("wandb.login called in offline mode")

    monkeypatch.setattr(wandb, "login", no_login)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    run_dir = str(tmp_path / "run")
    kw = dict(wandb_project="slime-dev", wandb_mode="offline", wandb_entity="glm-zero",
              wandb_host="https://wandb.example.com", wandb_key="k" * 40)
    first = Tracker(run_dir, config={"runtime": {"wandb_key": "k" * 40, "lr": 1e-6}}, **kw)
    run_id = first.wandb_run_id
    assert first._wandb.entity == "glm-zero"
    assert first._wandb.config["runtime"]["wandb_key"] == "<redacted>"
    first.log(1, {"rollout/reward_mean": 0.5})
    first.close()
    again = Tracker(run_dir, wandb_resume_id=run_id, **kw)
    again.close()
    assert again.wandb_run_id == run_id
    assert any(r.endswith(run_id) for r in os.listdir(os.path.join(run_dir, "wandb")))


def test_online_key_logs_in_with_host_before_init(tmp_path, monkeypatch):
    """Online: wandb.login(key, host) first; its failure (bad key, no network) is a start-up
    ConfigError naming the flag, not a traceback."""
    import wandb

    calls = []

    def failing_login(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("API key must be 40 characters long")

    monkeypatch.setattr(wandb, "login", failing_login)
    with pytest.raises(ConfigError, match="--wandb-project slime-dev: wandb.init failed"):
        Tracker(str(tmp_path / "run"), wandb_project="slime-dev", wandb_key="short", wandb_host="https://h.example")
    assert calls == [{"key": "short", "host": "https://h.example"}]
