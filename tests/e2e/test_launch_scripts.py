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


@pytest.mark.parametrize("script,cfg,extra_env", [
    ("run_qwen3_4b_grpo.sh", QWEN3_4B, {}),
    ("run_qwen3_30b_a3b_grpo.sh", QWEN3_30B_A3B, {"NNODES": "4", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}),
])
def test_script_dry_run_validates(tmp_path, script, cfg, extra_env):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, cfg), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "save"), **extra_env}
    proc = _run(script, env, "--dry-run")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "dry run: configuration valid" in proc.stdout
    assert "nothing was started" in proc.stdout
    assert not (tmp_path / "save").exists()


def test_script_dry_run_refuses_bad_layout(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "label": "y"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, QWEN3_4B), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "s")}
    proc = _run("run_qwen3_4b_grpo.sh", env, "--dry-run", "--tensor-model-parallel-size", "3")
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size" in proc.stderr or "TP" in proc.stderr
