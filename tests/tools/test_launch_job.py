"""tools/launch_job.py: the Slurm batch script and the Kubernetes JobSet it writes, without a scheduler.

The batch script is run here too, by bash, with stand-ins for ``srun`` and ``scontrol`` on PATH and a stand-in
interpreter as ``PY``: what reaches the launcher (every training flag, quoted as given; the node rank and the
rendezvous from the SLURM variables), what the script does with each exit code (requeue on 3 only, and only a
running job) and the time-limit signal (USR1 to the batch shell -> SIGTERM to node 0's launcher). Against a
real Slurm: scripts/test_slurm_real.sh (tests/e2e/test_slurm_real.py). The JobSet is checked against the JobSet
v1alpha2 API models of ``kubeflow-trainer-api`` (a test extra) and against our exit-code rules.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import launch_job  # noqa: E402 - tools/, put on sys.path above
from launch_job import (JobError, K8sOptions, RunShape, SlurmOptions, jobset_manifest,  # noqa: E402
                        jobset_rule_problems, jobset_schema_problems, render, slurm_script, slurm_time_seconds)

AWKWARD = ["--wandb-project", "it's a \"test\" $HOME `date` $(id) \\n;|&", "--wandb-group", "two  spaces\tand tab",
           "--tensorboard-dir", "*", "--wandb-run-name=--looks-like-a-flag"]
SHAPE = RunShape(train_args=("--hf-checkpoint", "/m", "--save", "/ckpt", *AWKWARD), nnodes=2, nproc_per_node=4,
                 run_dir="/runs/r 1", save="/ckpt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("job")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
        max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True)))
    (d / "prompts.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    return d


def train_flags(d: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(d / "model"), "--prompt-data", str(d / "prompts.jsonl"), "--actor-num-nodes",
            "2", "--actor-num-gpus-per-node", "4", "--save", str(d / "ckpt"), "--output-dir", str(d / "run"), *extra]


def directives(text: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]


# ---------------------------------------------------------------------------------------------- Slurm text

def test_sbatch_directives_from_the_run_flags(model_dir):
    text, out = render(["slurm", "--time", "4:00:00", "--signal-lead", "600", "--partition", "gpu", "--account",
                        "rl", "--sbatch=--exclusive", "-m", "megatron_rl.train", *train_flags(model_dir)])
    assert out is None
    d = directives(text)
    assert d[:4] == ["--job-name=megatron-rl", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4"]
    for want in ("--time=4:00:00", "--signal=B:USR1@600", "--requeue", "--open-mode=append", "--partition=gpu",
                 "--account=rl", "--exclusive", f"--chdir={os.getcwd()}", "--output=%x-%j.out"):
        assert want in d, (want, d)
    assert text.index("#SBATCH") > text.index("#!/bin/bash") and "NPROC_PER_NODE=4" in text
    assert f"RUN_DIR={model_dir / 'run'}" in text


def test_gpus_per_node_zero_asks_no_gpus_and_cpus_per_task_is_passed(model_dir):
    text, _ = render(["slurm", "--time", "30", "--signal-lead", "60", "--gpus-per-node", "0", "--cpus-per-task", "2",
                      "--", *train_flags(model_dir)])
    d = directives(text)
    assert not any(x.startswith("--gpus") for x in d) and "--cpus-per-task=2" in d


def test_the_srun_line_runs_our_launcher_one_task_per_node():
    text = slurm_script(SHAPE, SlurmOptions(time="60", python="/venv/bin/python", workdir="/w"))
    srun = text[text.index("\nsrun "):text.index("srun_pid=")]
    for want in ("--ntasks-per-node=1", "--kill-on-bad-exit=0", "--export=ALL", "-m megatron_rl.infra.launch",
                 '--nnodes "$SLURM_NNODES"', '--node-rank "$SLURM_NODEID"', '--master-addr "$MASTER_ADDR"',
                 '-m megatron_rl.train "$@"', '"${TRAIN_ARGS[@]}" &'):
        assert want in srun, want
    assert 'MASTER_ADDR=$(head -n 1 <<<"$nodes")' in text and 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text


def test_the_script_parses_with_bash_n(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(slurm_script(SHAPE, SlurmOptions(time="1-00:00:00", python="/venv/bin/python", workdir="/w",
                                                     env=(("NCCL_DEBUG", "INFO $x"),))))
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("1-0", 86400),
                                          ("2-03", 183600), ("1-02:03", 93780), ("1-02:03:04", 93784)])
def test_slurm_time_formats(text, seconds):
    assert slurm_time_seconds(text) == seconds


@pytest.mark.parametrize("opts,says", [
    (dict(time="1h"), "is not a Slurm time"),
    (dict(time="3", signal_lead_s=150), "does not fit in --time 3"),
    (dict(time="60", signal_lead_s=0), "use 1 to 65535"),
    (dict(time="60", env=(("BAD-NAME", "1"),)), "not a shell variable name"),
    (dict(time="60", sbatch=("exclusive",)), "one sbatch option per --sbatch"),
    (dict(time="60", job_name="my job"), "white space"),
    (dict(time="60", max_requeues=-1), "--max-requeues"),
])
def test_refusals_name_the_flag(opts, says):
    with pytest.raises(JobError, match=says.replace("(", r"\(")):
        slurm_script(SHAPE, SlurmOptions(**opts))


def test_a_run_without_save_or_with_dry_run_is_refused(model_dir):
    flags = [f for f in train_flags(model_dir)]
    i = flags.index("--save")
    with pytest.raises(JobError, match="no --save"):
        render(["slurm", "--time", "60", "--", *(flags[:i] + flags[i + 2:])])
    with pytest.raises(JobError, match="--dry-run"):
        render(["slurm", "--time", "60", "--", *flags, "--dry-run"])
    with pytest.raises(JobError, match="no training command"):
        render(["slurm", "--time", "60", *flags])


def test_invalid_training_flags_exit_2_with_the_runs_own_error(model_dir, capsys):
    code = launch_job.main(["slurm", "--time", "60", "--", *train_flags(model_dir), "--num-rollout", "-3"])
    assert code == 2
    assert "error:" in capsys.readouterr().err
    code = launch_job.main(["slurm", "--time", "60", "--no-validate", "--out", os.devnull, "--",
                            "--hf-checkpoint", "/not/here", "--save", "/ckpt"])
    assert code == 0  # --no-validate: a submit host that cannot see the cluster's paths


# ------------------------------------------------------------------- the script run with a stand-in Slurm

FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
case "$1 $2" in
  "show hostnames") printf 'node-a\\nnode-b\\n' ;;
  "show job") echo "JobId=$3 JobState=${FAKE_JOB_STATE:-RUNNING} Restarts=${SLURM_RESTART_COUNT:-0}" ;;
  "requeue "*) exit 0 ;;
esac
"""
# srun: runs its command as node 0 would (the real one: on every node, SLURM_NODEID 0..N-1)
FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
while [ "${1#--}" != "$1" ]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
# the launcher: records its argv, then exits FAKE_EXIT, or on SIGTERM with 3 (what ours does after the save)
FAKE_PY = """#!/usr/bin/env python3
import json, os, signal, sys, time
json.dump(sys.argv[1:], open(os.environ["FAKE_ARGV"], "w"))
if os.environ.get("FAKE_WAIT_FOR_TERM"):
    signal.signal(signal.SIGTERM, lambda *_: (open(os.environ["FAKE_LOG"], "a").write("launcher got TERM\\n"),
                                               sys.exit(3)))
    open(os.environ["FAKE_READY"], "w").close()
    for _ in range(600):
        time.sleep(0.1)
    sys.exit(1)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def _stand_ins(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN), ("python", FAKE_PY)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "calls.log"),
            "FAKE_ARGV": str(tmp_path / "argv.json"), "FAKE_READY": str(tmp_path / "ready"),
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
            "TMPDIR": str(tmp_path)}


def _script(tmp_path: Path, **opts) -> Path:
    path = tmp_path / "job.sbatch"
    path.write_text(slurm_script(SHAPE, SlurmOptions(time="60", python=str(tmp_path / "bin" / "python"),
                                                     workdir=str(tmp_path), **opts)))
    return path


def test_every_training_flag_reaches_the_launcher_as_given(tmp_path):
    env = _stand_ins(tmp_path)
    proc = subprocess.run(["bash", str(_script(tmp_path))], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    port = str(20000 + (4242 * 16) % 12000)
    assert argv == ["-m", "megatron_rl.infra.launch", "--run-dir", "/runs/r 1", "--nnodes", "2", "--node-rank", "0",
                    "--nproc-per-node", "4", "--master-addr", "node-a", "--master-port", port,
                    "-m", "megatron_rl.train", *SHAPE.train_args]
    assert "finished (exit 0)" in proc.stdout


@pytest.mark.parametrize("launcher_exit,state,restarts,requeued,line", [
    (0, "RUNNING", 0, False, "finished (exit 0)"),
    (3, "RUNNING", 0, True, "stopped early and saved (exit 3): requeued"),
    (3, "COMPLETING", 0, False, "not requeued: the job is COMPLETING"),  # scancel: the user's decision
    (3, "RUNNING", 2, False, "not requeued: 2 requeues already"),
    (2, "RUNNING", 0, False, "refused (exit 2): not requeued"),
    (1, "RUNNING", 0, False, "ended with exit 1: not requeued"),
    (143, "RUNNING", 0, False, "ended with exit 143: not requeued"),
])
def test_exit_codes_and_requeue(tmp_path, launcher_exit, state, restarts, requeued, line):
    env = {**_stand_ins(tmp_path), "FAKE_EXIT": str(launcher_exit), "FAKE_JOB_STATE": state,
           "SLURM_RESTART_COUNT": str(restarts)}
    proc = subprocess.run(["bash", str(_script(tmp_path, max_requeues=2))], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == launcher_exit, proc.stdout + proc.stderr
    assert line in proc.stdout, proc.stdout
    assert f"attempt {restarts + 1}:" in proc.stdout
    calls = (tmp_path / "calls.log").read_text()
    assert ("scontrol requeue 4242" in calls) == requeued, calls


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_the_time_limit_signal_stops_the_launcher_and_requeues(tmp_path, sig):
    """USR1 (--signal=B:USR1@lead) or TERM to the batch shell: SIGTERM to node 0's launcher only, whose exit 3 then
    requeues the job."""
    env = {**_stand_ins(tmp_path), "FAKE_WAIT_FOR_TERM": "1"}
    proc = subprocess.Popen(["bash", str(_script(tmp_path))], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60  # a hang bound: the stand-in launcher starts in well under a second
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in launcher never started"
            time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, out
    assert f"got {sig.name}: asking the run to finish its step, save and exit 3" in out
    calls = (tmp_path / "calls.log").read_text()
    assert "launcher got TERM" in calls and "scontrol requeue 4242" in calls, calls
    assert not (tmp_path / "megatron_rl.4242.launcher.pid").exists()


def test_a_site_template_keeps_its_own_lines_and_must_hold_every_block(tmp_path):
    site = tmp_path / "site.sbatch"
    site.write_text("#!/bin/bash\n# {{header}}\n{{directives}}\n#SBATCH --constraint=h100\nmodule load cuda\n"
                    "{{settings}}\n")
    text = slurm_script(SHAPE, SlurmOptions(time="60"), template=str(site))
    assert "#SBATCH --constraint=h100\nmodule load cuda\n" in text and "#SBATCH --nodes=2" in text
    site.write_text("#!/bin/bash\n{{directives}}\n")
    with pytest.raises(JobError, match="0 {{header}} blocks"):
        slurm_script(SHAPE, SlurmOptions(time="60"), template=str(site))


# --------------------------------------------------------------------------------------------- Kubernetes

def test_jobset_fields_from_the_run_flags(model_dir):
    text, _ = render(["k8s", "--image", "reg/mrl:1", "--name", "grpo", "--namespace", "rl", "--volume",
                      "ckpt:/mnt/ckpt", "--env", "NCCL_DEBUG=INFO", "--grace-seconds", "600", "--max-restarts", "5",
                      "-m", "megatron_rl.train", *train_flags(model_dir, "--wandb-project", "a$(HOME)b")])
    assert text.startswith("# Written by tools/launch_job.py k8s (checked against the JobSet v1alpha2 API")
    m = yaml.safe_load(text)
    assert (m["apiVersion"], m["kind"], m["metadata"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet",
                                                          {"name": "grpo", "namespace": "rl"})
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    assert m["spec"]["failurePolicy"]["maxRestarts"] == 5 and pod["terminationGracePeriodSeconds"] == 600
    assert c["command"][:15] == ["python", "-m", "megatron_rl.infra.launch", "--run-dir", str(model_dir / "run"),
                                 "--nnodes", "2", "--node-rank", "$(NODE_RANK)", "--nproc-per-node", "4",
                                 "--master-addr", "grpo-node-0-0.grpo", "--master-port", "29500"]
    assert c["command"][15:17] == ["-m", "megatron_rl.train"]
    assert c["command"][-1] == "a$$(HOME)b"  # Kubernetes would expand $(HOME); $$ is its literal $
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
    assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert {"name": "run-storage-0", "mountPath": "/mnt/ckpt"} in c["volumeMounts"]
    assert {"name": "run-storage-0", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["volumes"]


def _manifest(**opts) -> dict:
    return jobset_manifest(SHAPE, K8sOptions(image="reg/mrl:1", **opts))


def test_jobset_restart_rules_follow_the_exit_codes():
    """2 fails the JobSet, 3 and a disruption restart it uncounted, anything else restarts it counted."""
    m = _manifest()
    assert jobset_rule_problems(m) == []
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod_rules = job["podFailurePolicy"]["rules"]
    assert [r["action"] for r in pod_rules] == ["FailJob"] * 3
    assert [r.get("onExitCodes", {}).get("values") for r in pod_rules] == [[2], [3], None]
    assert pod_rules[2]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    rules = {r["name"]: r for r in m["spec"]["failurePolicy"]["rules"]}
    assert rules["refused"]["action"] == "FailJobSet"
    assert rules["refused"]["onJobFailureMessagePatterns"] == ["matching FailJob rule at index 0$"]
    assert rules["resumable"]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    pod_rules[0], pod_rules[1] = pod_rules[1], pod_rules[0]  # a template whose two lists drifted apart
    assert any("rule 0 must be FailJob on exit code 2" in p for p in jobset_rule_problems(m))


def test_jobset_matches_the_api_schema():
    pytest.importorskip("kubeflow_trainer_api", reason="kubeflow-trainer-api (a test extra: pip install -e .[test])")
    m = _manifest(volumes=(("ckpt", "/ckpt"),), env=(("A", "1"),), workdir="/work")
    assert jobset_schema_problems(m) == []
    job = m["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["backofLimit"] = job.pop("backoffLimit")  # misspelled: dropped by the models, so named by the round trip
    job["parallelism"] = "2"
    problems = jobset_schema_problems(m)
    assert problems is not None and any("parallelism" in p and "integer" in p for p in problems), problems
    job["parallelism"] = 2
    problems = jobset_schema_problems(m)
    assert problems == [".spec.replicatedJobs[0].template.spec.backofLimit: not a field of the API (misspelled?)"]


@pytest.mark.parametrize("opts,says", [(dict(name="Bad_Name"), "--name"), (dict(grace_s=0), "--grace-seconds"),
                                       (dict(max_restarts=-1), "--max-restarts")])
def test_jobset_refusals(opts, says):
    with pytest.raises(JobError, match=says):
        _manifest(**opts)
