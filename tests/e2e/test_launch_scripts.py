"""The cluster launch scripts must pass flag validation and the planner on CPU (--dry-run)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

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


@pytest.mark.parametrize("script,cfg,extra_env,engines", [
    ("run_qwen3_4b_grpo.sh", QWEN3_4B, {},
     "rollout: 4 SGLang engine(s) of 2 GPU(s), colocated on the trainer's devices"),
    ("run_qwen3_30b_a3b_grpo.sh", QWEN3_30B_A3B, {"NNODES": "4", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1",
                                                  "ROLLOUT_URLS": "http://10.0.0.5:30000 http://10.0.0.6:30000"},
     "rollout: external SGLang servers, not started or placed by this run: http://10.0.0.5:30000 "
     "http://10.0.0.6:30000; weights reach them by broadcast from the driver rank into every server's TP ranks "
     "(--update-weight-transport distributed"),  # was: "through --update-weight-disk-dir None"
])
def test_script_dry_run_validates(tmp_path, script, cfg, extra_env, engines):
    """Each script's dry run checks every flag and the planner's layout, prints the plan and the SGLang
    engines (launched on the 4B node; the 30B script's servers run on rollout nodes of their own) and
    exits 0 without starting anything."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, cfg), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "save"), **extra_env}
    proc = _run(script, env, "--dry-run")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "total GPU demand" in proc.stdout and "dry run: configuration valid" in proc.stdout
    assert engines in proc.stdout, proc.stdout
    assert "activation peak" in proc.stdout and "verdict: fits H100-80G: 79.6 GiB, headroom" in proc.stdout
    assert " None" not in proc.stdout, proc.stdout  # an unset flag's value is never printed as a route
    assert not (tmp_path / "save").exists()


@pytest.mark.parametrize("scheduler,job_args", [("slurm", "--time 2-00:00:00 --signal-lead 900"),
                                                ("k8s", "--image registry/megatron-rl:1 --volume ckpt:/ckpt")])
def test_script_writes_a_scheduler_job_of_its_run(tmp_path, scheduler, job_args):
    """JOB=slurm|k8s: the 30B script's own flags become a batch script / JobSet for its 4 nodes x 8 GPUs
    (tools/launch_job.py, validated as the real run validates them), and nothing is started."""
    import yaml

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    out = tmp_path / "job"
    env = {"HF_CKPT": _model_dir(tmp_path, QWEN3_30B_A3B), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "save"),
           "ROLLOUT_URLS": "http://10.0.0.5:30000", "JOB": scheduler, "JOB_ARGS": f"{job_args} --out {out}"}
    proc = _run("run_qwen3_30b_a3b_grpo.sh", env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    text = out.read_text()
    if scheduler == "slurm":
        assert "#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n" in text
        assert "NPROC_PER_NODE=8" in text and "  --expert-model-parallel-size 8\n" in text
    else:
        (container,) = yaml.safe_load(text)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"]
        cmd = container["command"]
        assert cmd[cmd.index("--nnodes") + 1] == "4" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
        assert cmd[cmd.index("--expert-model-parallel-size") + 1] == "8"
    assert not (tmp_path / "save").exists()


def test_script_dry_run_refuses_bad_layout(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x", "label": "y"}\n')
    env = {"HF_CKPT": _model_dir(tmp_path, QWEN3_4B), "PROMPTS": str(prompts), "SAVE": str(tmp_path / "s")}
    proc = _run("run_qwen3_4b_grpo.sh", env, "--dry-run", "--tensor-model-parallel-size", "3")
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size" in proc.stderr or "TP" in proc.stderr


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
