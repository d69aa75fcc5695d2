"""verl's config keys (config/verl_keys.py): one of verl's own Megatron GRPO scripts translates to a valid plan; keys
the table refuses or does not know are refused by name; the page docs/migrating-from-verl.md is the table's."""

from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config import verl_keys
from megatron_rl.errors import ConfigError
from megatron_rl.train import main

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "verl")
SCRIPT = os.path.join(FIXTURES, "run_qwen2-7b_math_megatron.sh")


def _parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"data_source": "openai/gsm8k",
                                          "prompt": [{"role": "user", "content": "1 2 ="}],
                                          "reward_model": {"style": "rule", "ground_truth": "3"}}]), str(path))
    return str(path)


def _script_overrides(tmp_path, *extra):
    """The overrides verl's script passes to ``python3 -m verl.trainer.main_ppo``, as bash expands them (the script
    run unchanged, its ``$HOME/data`` under ``tmp_path``, ``extra`` as its ``$@``; a ``python3`` shell function
    prints its arguments instead of starting verl)."""
    assert hashlib.sha256(open(SCRIPT, "rb").read()).hexdigest() in open(os.path.join(FIXTURES, "SOURCE")).read()
    home = tmp_path / "home"
    for name in ("gsm8k", "math"):
        (home / "data" / name).mkdir(parents=True)
        for split in ("train", "test"):
            _parquet(home / "data" / name / f"{split}.parquet")
    shim = 'python3() { printf "%s\\0" "$@"; }; source "$0" "$@"'
    proc = subprocess.run(["bash", "-c", shim, SCRIPT, *extra], env={"HOME": str(home), "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=60, check=True)
    argv = proc.stdout.split("\0")[:-1]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"] and argv[3] == "--config-name=ppo_megatron_trainer.yaml"
    return argv[4:]


def test_verls_megatron_grpo_example_translates_to_a_valid_plan(tmp_path, tiny_hf_models, capsys):
    """verl's examples/grpo_trainer/run_qwen2-7b_math_megatron.sh, unchanged (its data: gsm8k and math parquet files,
    two of each), is a valid plan: TP 2 x PP 2 x DP 2 on 8 GPUs with SGLang engines of TP 2 colocated."""
    model = tiny_hf_models("qwen2")  # the model path and the run's length as the script's $@ (later keys win)
    overrides = _script_overrides(tmp_path, "trainer.total_training_steps=20", f"actor_rollout_ref.model.path={model}")
    argv = ["--dry-run", "--apply-chat-template", "--rm-type", "verl", "--verl-overrides", *overrides]
    assert main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 -> --tensor-model-parallel-size 2" in out
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256 -> --global-batch-size 1280" in out  # x rollout.n 5
    assert "dry run: configuration valid; training world 8 rank(s), data-parallel 2" in out
    cfg = parse_config(argv)
    p, b, a = cfg.parallel, cfg.batching, cfg.algorithm
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert (b.rollout_batch_size, b.n_samples_per_prompt, b.global_batch_size) == (1024, 5, 1280)
    assert (a.advantage_estimator, a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type) == ("grpo", True, 0.001, "low_var_kl")
    assert (cfg.optimizer.lr, cfg.rollout.num_rollout, cfg.checkpoint.save_interval) == (1e-6, 20, 20)
    assert (cfg.rollout.rollout_backend, cfg.memory.colocate, cfg.rollout.rollout_num_gpus_per_engine) == (
        "sglang", True, 2)
    data = tmp_path / "home" / "data"
    assert cfg.data.prompt_files == (str(data / "gsm8k" / "train.parquet"), str(data / "math" / "train.parquet"))
    assert cfg.data.eval_sets == (("gsm8k_test", str(data / "gsm8k" / "test.parquet")),
                                  ("math_test", str(data / "math" / "test.parquet")))
    # a flag on the command line wins over the translation
    assert parse_config([*argv, "--lr", "3e-6"]).optimizer.lr == 3e-6


@pytest.mark.parametrize("override, says", [
    ("trainer.total_epochs=15", r"trainer.total_epochs=15 is refused: a run's length here is --num-rollout"),
    ("actor_rollout_ref.rollout.name=trtllm", r"rollout.name='trtllm' is refused: 'trtllm' is not an engine here"),
    ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=True", r"is refused: the initial weights load from"),
    ("actor_rollout_ref.actor.kl_loss_type=abs", r"kl_loss_type='abs' is refused: 'abs' is not built here"),
    ("algorithm.use_kl_in_reward=True", r"use_kl_in_reward=True is refused: a KL penalty in the reward"),
    ("trainer.no_such_key=1", r"verl key 'trainer.no_such_key' is not in the translation table"),
    ("~trainer.logger", r"deleting a key \(~\) has no meaning here"),
])
def test_a_refused_or_unknown_verl_key_is_refused_by_name(override, says):
    with pytest.raises(ConfigError, match=r"^--verl-overrides.*" + says):
        parse_config(["--dry-run", "--verl-overrides", override])


def test_verl_overrides_without_a_value_is_one_error_line():
    with pytest.raises(ConfigError, match=r"^argument --verl-overrides: expected at least one argument: --verl-overrides "
                                          r"takes verl's KEY=VALUE overrides"):
        parse_config(["--verl-overrides", "--dry-run"])


def test_a_verl_yaml_translates_as_the_overrides_and_they_win(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  actor:\n    optim: {lr: 2.0e-6}\n  rollout: {n: 4}\n"
                    "data: {train_batch_size: 8}\n")
    cfg = parse_config(["--dry-run", "--verl-config", str(path), "--verl-overrides", "actor_rollout_ref.rollout.n=2"],
                       validate=False)
    assert (cfg.optimizer.lr, cfg.batching.n_samples_per_prompt, cfg.batching.rollout_batch_size) == (2e-6, 2, 8)


def test_the_verl_page_is_the_tables():
    assert verl_keys.DOC_PATH.read_text() == verl_keys.render(), \
        "docs/migrating-from-verl.md is stale: run python -m megatron_rl.config.docs"
    for key in verl_keys.VERL_KEYS:
        assert f"`{key}`" in verl_keys.DOC_PATH.read_text()
