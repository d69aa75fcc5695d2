"""slime's data-key, external-engine, saving and async flags (slime/utils/arguments.py): --metadata-key and
--tool-key read as slime reads them, --rollout-external-engine-addrs as --rollout-engine-urls, --save-hf and
--keep-old-actor refused naming what to use instead."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_external_engine_addrs_are_the_rollout_engine_urls(tmp_path):
    """slime's host:port form is http://host:port, from the command line (either name) and from YAML."""
    cfg = parse_config(["--rollout-external-engine-addrs", "10.0.0.5:30000", "https://h:1"], validate=False)
    assert cfg.rollout.rollout_engine_urls == ["http://10.0.0.5:30000", "https://h:1"]
    assert cfg.rollout.rollout_backend == "sglang"
    assert parse_config(["--rollout-engine-urls", "h:2"], validate=False).rollout.rollout_engine_urls == ["http://h:2"]
    (tmp_path / "c.yaml").write_text("rollout_engine_urls: ['h:3']\n")
    assert parse_config(["--config", str(tmp_path / "c.yaml")], validate=False).rollout.rollout_engine_urls == [
        "http://h:3"]
    errors = collect_errors(parse_config(["--rollout-external-engine-addrs", "nohost"], validate=False))
    assert any("--rollout-engine-urls http://nohost: not a server address; write http://host:port, "
               "https://host:port or host:port" in e for e in errors), errors


@pytest.mark.parametrize("argv, needle", [
    (["--save-hf", "/out/hf_{rollout_id}"], "--save-hf /out/hf_{rollout_id}: refused; an HF export at every save "
                                            "is not built into the run. Export a saved checkpoint instead: "
                                            "tools/convert_ckpt.py dist-to-hf"),
    (["--keep-old-actor", "--async-mode", "one-step"], "--keep-old-actor: refused; no copy of the weights that "
                                                       "generated a rollout is kept on the trainer. With --async-mode "
                                                       "off the old log-probs already come from those weights; with "
                                                       "--async-mode one-step use --use-rollout-logprobs"),
])
def test_save_hf_and_keep_old_actor_are_refused_naming_the_alternative(argv, needle):
    errors = collect_errors(parse_config(argv, validate=False))
    assert any(needle in e for e in errors), errors


def test_metadata_and_tool_keys_reach_the_requests_of_a_run(tmp_path):
    """The flags as a run builds its prompts (rollout.build) and pre-flights them (runner.preflight)."""
    from megatron_rl.data.synthetic import prepare
    from megatron_rl.rollout.build import build_rollout
    from megatron_rl.runner.preflight import _scan

    prepare(str(tmp_path), num_prompts=4, num_eval=2)
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    data = tmp_path / "with_meta.jsonl"
    data.write_text("".join(json.dumps({**r, "meta": {"task_id": i}, "fns": [{"name": "f"}]}) + "\n"
                            for i, r in enumerate(rows)))
    cfg = parse_config(["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(data),
                        "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward", "--rollout-max-response-len",
                        "4", "--metadata-key", "meta", "--tool-key", "fns"])
    assert _scan(cfg, "--prompt-data", str(data))[1].prompts == 4
    request = next(build_rollout(cfg).prompts).requests[1]
    assert request.metadata["task_id"] == 1 and request.metadata["tools"] == [{"name": "f"}]
