"""The cluster launch scripts must pass flag validation and the planner on CPU (--dry-run)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3_4B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=True)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     norm_topk_prob=True, tie_word_embeddings=False)


def _model_dir(tmp_path, cfg):
    d = tmp_path / cfg["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _run(script, env, *args):
    return subprocess.run(["bash", f"scripts/{script}", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": sys.executable, **env}, timeout=300)


NO_LAUNCHER = ("--rollout-backend sglang without --rollout-engine-urls: launching SGLang engines is not built yet "
               "(issue 14); give --rollout-engine-urls of running servers (docs/sglang.md), or use "
               "--rollout-backend embedded")


@pytest.mark.parametrize("script,cfg,extra_env,refused", [
    ("run_qwen3_4b_grpo.sh", QWEN3_4B, {}, [NO_LAUNCHER]),
    ("run_qwen3_30b_a3b_grpo.sh", QWEN3_30B_A3B, {"NNODES": "4", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"},
     [NO_LAUNCHER]),  # its --update-weight-transport distributed to SGLang servers exists (issue 14)
])
def test_script_dry_run_validates(tmp_path, script, cfg, extra_env, refused):
    """The scripts launch SGLang engines, which this version refuses (only servers given by
    --rollout-engine-urls run): their dry run prints the checked plan, then exits 2 naming only that
    refusal as what a real run refuses, so every other flag and the planner's check of their layout passed
    (with a layout error the refusal is reported with it; see test_script_dry_run_refuses_bad_layout)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, cfg), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "save"), **extra_env}
    proc = _run(script, env, "--dry-run")
    assert proc.returncode == 2, proc.stderr + proc.stdout
    errors = [line.strip().removeprefix("error: ").removeprefix("- ") for line in proc.stderr.splitlines()]
    errors = [e for e in errors if e and e != "invalid configuration:"]
    assert errors == [f"a real run refuses: {r}" for r in refused], proc.stderr
    assert "dry run: configuration valid" not in proc.stdout
    assert "total GPU demand" in proc.stdout and "dry run: the plan above holds" in proc.stdout
    assert not (tmp_path / "save").exists()


def test_script_dry_run_refuses_bad_layout(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "label": "y"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, QWEN3_4B), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "s")}
    proc = _run("run_qwen3_4b_grpo.sh", env, "--dry-run", "--tensor-model-parallel-size", "3")
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size" in proc.stderr or "TP" in proc.stderr
    assert NO_LAUNCHER in proc.stderr  # reported together with the layout error


@pytest.mark.slow
def test_refusal_under_torchrun_is_one_error_line_and_exit_2(tmp_path):
    """A refusal inside the workers (both ranks refuse): one ``error:`` line and exit 2, not every rank's
    line plus torchrun's ChildFailedError traceback and exit 1."""
    from _util import free_port

    env = {"OUT": str(tmp_path / "demo"), "NUM_ROLLOUT": "2", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    proc = _run("run_demo_cpu.sh", env, "--tensor-model-parallel-size", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TP x PP x CP = 3 x 1 x 1" in errors[0], output[-4000:]
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-4000:]


def test_launcher_without_run_dir_is_refused():
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.infra.launch", "--nproc-per-node", "2", "x.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: usage: python -m megatron_rl.infra.launch")
