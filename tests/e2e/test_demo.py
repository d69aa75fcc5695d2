"""The CPU RL demo end to end (shortened), plus rollout-only -> train-only and auto-resume.

Real parts throughout: torchrun with 2 gloo ranks, megatron-core training, the
embedded engine, in-process weight sync checked tensor-for-tensor after every
sync (--check-weight-update-equal raises on any difference).
"""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from _metrics_doc import check_mode_keys
from _util import seed_demo_dir
from megatron_rl.infra.ports import free_port

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_demo(out, num_rollout, *extra, timeout=900):
    seed_demo_dir(out)
    env = {**os.environ, "OUT": str(out), "NUM_ROLLOUT": str(num_rollout), "PY": sys.executable,
           "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(["bash", "scripts/run_demo_cpu.sh", *extra], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


# slime's scripts/models/*.sh way of stating the model: Megatron architecture flags matching
# the demo's tiny Qwen2 (megatron_rl/data/synthetic.py), checked against its config.json at start-up
SLIME_MODEL_ARGS = ["--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                    "--kv-channels", "16", "--use-rotary-position-embeddings", "--disable-bias-linear",
                    "--add-qkv-bias", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
                    "--rotary-base", "10000", "--vocab-size", "32"]


def test_demo_learns_and_engine_weights_track_trainer(tmp_path):
    out = tmp_path / "demo"
    # the full demo runs 300 rollouts at lr 1e-3 (reward ~0.04 -> ~0.9); CI runs 50 at lr 3e-3,
    # launched with slime-style MODEL_ARGS (they change nothing: the HF config builds the model)
    run_demo(out, 50, "--lr", "3e-3", "--save-interval", "25", "--eval-interval", "25", *SLIME_MODEL_ARGS)
    recs = metrics(out)
    train = [r for r in recs if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 51))
    first = sum(r["rollout/reward_mean"] for r in train[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in train[-5:]) / 5
    assert first < 0.2, first  # random init is near chance (~0.03)
    assert last > first + 0.12, (first, last)
    syncs = [r for r in recs if "sync/checked_tensors" in r]
    assert len(syncs) == 51 and all(r["sync/checked_tensors"] == 26 for r in syncs)  # initial + one per step
    # engine and trainer agree on the sampled tokens' log-probs (same weights, fp32)
    assert max(r["train/mismatch_abs_logprob"] for r in train) < 1e-5
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(out / "ckpt")) == [".megatron_rl.lock", "iter_0000025", "iter_0000050",
                                                "latest_checkpointed_iteration.txt", "resume_state.json", "rollout_ckpts"]
    # the rollout generated right after iter_0000025 (none follows the final checkpoint)
    assert os.listdir(out / "ckpt" / "rollout_ckpts") == ["rollout_25.pt"]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    _exported_checkpoint_reproduces_the_policy(out, recs)


# fsdp: in scripts/test_extended.sh, not the suite (its 30 rollouts cost ~45 s of a 25-min budget, and its critic's
# numbers are pinned to the megatron critic's by tests/dist/test_fsdp_critic.py)
@pytest.mark.parametrize("train_backend", ["megatron", pytest.param("fsdp", marks=pytest.mark.extended)])
def test_ppo_demo_with_a_critic_learns(tmp_path, train_backend):
    """--advantage-estimator ppo (a critic beside the actor, GAE, --normalize-advantages), on either backend; on
    megatron the critic in a layout of its own (TP2 over the 2 ranks where the actor is DP2:
    --critic-tensor-model-parallel-size): the first two rollouts train the critic only (--num-critic-only-steps 2:
    no train/*; the actor's parameters staying bitwise unchanged there is checked in tests/dist/test_critic.py
    and test_fsdp_critic.py); then the reward rises and the critic's error falls from far above the returns'
    variance to about it. 30 rollouts, ~30 s (megatron), ~45 s (fsdp: reward 0.044 -> 0.22, explained variance
    -1.9 -> ~0.005, measured 2026-12-05)."""
    out = tmp_path / "demo_ppo"
    own = ["--critic-tensor-model-parallel-size", "2"] if train_backend == "megatron" else []
    proc = run_demo(out, 30, "--advantage-estimator", "ppo", "--normalize-advantages", "--num-critic-only-steps",
                    "2", "--lr", "3e-3", "--critic-lr", "3e-3", "--save-interval", "30", "--eval-interval", "30",
                    "--train-backend", train_backend, *own)
    if own:
        assert "layout its own (TP 2, PP 1, DP 1)" in proc.stdout + proc.stderr
    train = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    for r in train[:2]:  # critic only
        assert not [k for k in r if k.startswith("train/")] and r["critic/grad_norm"] > 0, r
    assert all("train/pg_loss" in r and "critic/value_loss" in r for r in train[2:])
    first = sum(r["rollout/reward_mean"] for r in train[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in train[-5:]) / 5
    assert first < 0.1 and last > first + 0.08, (first, last)
    # the fresh value head's error is far above the returns' variance (explained variance ~ -1.9 measured); the
    # critic then tracks them (~0: their mean, as the reward moves; per-token prediction takes longer)
    ev = [r["critic/vf_explained_var"] for r in train]
    assert ev[0] < -0.5 and min(ev[-10:]) > -0.05, ev


def test_fsdp_demo_learns_and_its_checkpoint_exports(tmp_path):
    """The same demo on --train-backend fsdp (FSDP2 over the 2 gloo ranks, HF-native model): it learns,
    the engine's weights equal the trainer's after every sync, and the final DCP checkpoint exported with
    `convert_ckpt.py fsdp-to-hf` is the trained policy (~25 s). The seed scenario of the FSDP design: a
    training-only fsdp run (no rollout backend at all) on three rollouts the demo saved trains exactly the
    steps the demo trained on them (~12 s)."""
    out = tmp_path / "demo_fsdp"
    pattern = str(tmp_path / "rollouts" / "r_{rollout_id}.pt")
    # --update-weight-mode delta: the engine replica on each rank is patched (the demo's Adam steps move every
    # weight, so every tensor goes dense), checked equal tensor for tensor and verified by checksum every sync
    run_demo(out, 50, "--lr", "3e-3", "--train-backend", "fsdp", "--save-interval", "25", "--eval-interval", "25",
             "--save-debug-rollout-data", pattern, "--update-weight-mode", "delta")
    recs = metrics(out)
    train = [r for r in recs if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 51))
    first = sum(r["rollout/reward_mean"] for r in train[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in train[-5:]) / 5
    assert first < 0.2 and last > first + 0.12, (first, last)  # measured 0.053 -> 0.248
    syncs = [r for r in recs if "sync/checked_tensors" in r]
    assert len(syncs) == 51 and all(r["sync/checked_tensors"] == r["sync/verified_tensors"] == 26 for r in syncs)
    assert [r["sync/delta"] for r in syncs] == [0.0] + [1.0] * 50 and syncs[-1]["sync/delta_fallbacks"] == 0.0
    assert max(r["train/mismatch_abs_logprob"] for r in train) < 1e-5
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    _exported_checkpoint_reproduces_the_policy(out, recs, command="fsdp-to-hf")
    replay = tmp_path / "train_only_fsdp"
    run_demo(replay, 3, "--lr", "3e-3", "--train-backend", "fsdp", "--load-debug-rollout-data", pattern)
    again = [r for r in metrics(replay) if "train/pg_loss" in r]
    assert [r["step"] for r in again] == [1, 2, 3] and not any("sync/weight_version" in r for r in metrics(replay))
    for old, new in zip(train[:3], again):
        keys = {k for k in old if k.startswith("train/") and not k.endswith("_time_s")}
        assert keys and {k: new[k] for k in keys} == {k: old[k] for k in keys}, old["step"]


def _peaked_larger_teacher(path) -> str:
    """A teacher of the demo's vocabulary and tokenizer with twice the hidden size and one more layer, its final
    norm's gain x8: random weights, but a peaked next-token distribution (the student starts ~3 nats of reverse KL
    away from it), so the distillation term's pull shows within a few rollouts without training a teacher first."""
    import torch
    import transformers

    from megatron_rl.data import synthetic

    synthetic.build_demo_model(str(path), seed=1, num_layers=3, hidden=128)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return str(path)


# extended: 12 rollouts (~20 s); the numerics (teacher log-probs and the OPD term equal plain HF at DP2 and in one
# process, the frozen model, its resume) are in the suite: tests/dist/test_fsdp_teacher.py
@pytest.mark.extended
def test_fsdp_demo_distils_from_a_larger_teacher(tmp_path):
    """--opd-kl-coef 1 --opd-teacher-load of a larger teacher (a frozen model of its own on --train-backend fsdp)
    beside GRPO on the demo: the student's reverse KL to the teacher, measured on its own samples, falls
    (measured 3.05 -> 0.68 over 13 rollouts, 0.19 at 20). With a teacher trained on the task the same pull and the
    rewards: docs/algorithms.md, "On-policy distillation"."""
    out = tmp_path / "demo_opd"
    teacher = _peaked_larger_teacher(tmp_path / "teacher")
    run_demo(out, 12, "--lr", "3e-3", "--train-backend", "fsdp", "--save-interval", "12", "--eval-interval", "12",
             "--opd-kl-coef", "1.0", "--opd-teacher-load", teacher)
    train = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    kl = [r["train/opd_reverse_kl"] for r in train]
    assert sum(kl[:3]) / 3 > 2.0 and sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    assert all(r["perf/teacher_logprob_s"] > 0 for r in train)


def _exported_checkpoint_reproduces_the_policy(out, recs, command="dist-to-hf"):
    """The final training checkpoint, exported to HF with tools/convert_ckpt.py (no --hf-config: the
    checkpoint carries it), behaves exactly like the trained policy: greedy eval with a fresh
    engine on the exported files gives the eval reward the run logged at that step."""
    from megatron_rl.data import synthetic
    from megatron_rl.data.prompts import PromptDataset
    from megatron_rl.rollout.base import GenerateRequest, SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine

    hf_out = out / "exported_hf"
    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", command, "--input", str(out / "ckpt"),
                           "--output", str(hf_out), "--no-progress"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = EmbeddedEngine(str(hf_out))
    data = PromptDataset(str(out / "eval.jsonl"), tokenizer=engine.tokenizer)
    requests = [GenerateRequest(prompt_ids=list(p.prompt_ids), group_index=i, label=p.label)
                for i, p in enumerate(data.prompts)]
    samples = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=6, seed=42))
    reward = sum(synthetic.score(engine.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.label)
                 for s in samples) / len(samples)
    logged = next(r["eval/reward_mean"] for r in recs if r["step"] == 50 and "eval/reward_mean" in r)
    assert reward == pytest.approx(logged, abs=1e-12)


def test_demo_runs_in_full_async_mode_with_its_engine_in_a_process_of_its_own(tmp_path):
    """--async-mode full --partial-rollout --pause-generation-mode in_place on the demo: the embedded engine
    runs as a server process of its own (started by the driver, synced from disk, its log under engines/),
    generation overlaps training within --max-staleness 1 with nothing dropped, the rows in flight at a sync go
    on in the same call (never resubmitted), and the engine process ends with the run. (That the demo learns in
    both async modes, 300 rollouts each: docs/async.md; the abort mode end to end: tests/e2e/test_async_full.py.)"""
    out = tmp_path / "demo_full"
    run_demo(out, 12, "--async-mode", "full", "--partial-rollout", "--pause-generation-mode", "in_place",
             "--save-interval", "12", "--eval-interval", "12")
    recs = metrics(out)
    train = [r for r in recs if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 13))
    assert max(r["rollout/staleness_max"] for r in train) <= 1 and max(r["rollout/staleness_max"] for r in train[1:]) == 1
    assert sum(r["rollout/dropped_stale"] for r in train) == 0
    assert sum(r["rollout/partial_continued_samples"] for r in train) == 0  # parked across each sync, not cut
    check_mode_keys(recs, "full")  # the keys docs/metrics.md lists for the mode, rollout/time_s and perf/reward_s too
    log = (out / "engines" / "embedded_engine.log").read_text()
    assert "-m megatron_rl.rollout.embedded_server" in log and "serving" in log
    assert sorted(os.listdir(out / "engine_weights")) == ["v11", "v12"]  # the newest two versions kept
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    port = int(re.search(r"serving .* at http://127\.0\.0\.1:(\d+)", log).group(1))
    with socket.socket() as probe:  # the server process ended with the run
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_rollout_only_feeds_train_only_and_resume_continues(tmp_path):
    pattern = str(tmp_path / "rollouts" / "r_{rollout_id}.pt")
    run_demo(tmp_path / "gen", 3, "--debug-rollout-only", "--save-debug-rollout-data", pattern)
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["r_0.pt", "r_1.pt", "r_2.pt"]
    assert not (tmp_path / "gen" / "ckpt").exists()  # nothing trained, nothing saved
    # train-only: no engine at all, rollouts come from disk
    out = tmp_path / "train_only"
    run_demo(out, 2, "--load-debug-rollout-data", pattern, "--save-interval", "1")
    recs = metrics(out)
    assert [r["step"] for r in recs if "train/pg_loss" in r] == [1, 2]
    assert not any("sync/weight_version" in r for r in recs)
    # the same command with one more rollout resumes at step 2 and trains only step 3
    run_demo(out, 3, "--load-debug-rollout-data", pattern, "--save-interval", "1")
    recs = metrics(out)
    assert [r["step"] for r in recs if "train/pg_loss" in r] == [1, 2, 3]
    state = json.loads((out / "ckpt" / "resume_state.json").read_text())
    assert state["rollout_id"] == 3


def test_lora_adapter_sync_colocated(tmp_path):
    """--lora-sync adapter on the demo: the base model goes to the engine once, then only the adapter tensors;
    the engine replicas on both ranks merge them and equal the trainer's merged export after every sync
    (--check-weight-update-equal), across the colocated release and resume of the engine."""
    out = tmp_path / "lora"
    run_demo(out, 3, "--lora-rank", "8", "--lora-alpha", "16", "--lr", "1e-2", "--lora-sync", "adapter",
             "--colocate", "--no-auto-resume", "--eval-interval", "100", "--save-interval", "100")
    syncs = [r for r in metrics(out) if "sync/bytes" in r]
    assert [r["sync/weight_version"] for r in syncs] == [0, 1, 2, 3]
    adapter = syncs[0]["sync/adapter_bytes"]
    assert adapter == 4 * 16384  # 16,384 fp32 adapter parameters (r8 on all-linear of the demo's qwen2)
    assert syncs[0]["sync/bytes"] == adapter + syncs[0]["sync/base_bytes"] == adapter + 305408  # + the base model
    assert all(r["sync/bytes"] == adapter and r["sync/checked_tensors"] == 26 for r in syncs[1:])
    assert max(r["train/mismatch_abs_logprob"] for r in syncs[1:]) < 1e-5


@pytest.fixture(scope="module")
def colocated_runs(tmp_path_factory):
    """Two --colocate runs of 3 rollouts, the second with --offload-train-groups on; the second also starts fresh
    (--no-auto-resume --existing-save archive) into a --save that holds an earlier run's checkpoint and pointers
    (inspected by test_fresh_start_archives_the_earlier_run: one launch less than a run of its own)."""
    base = tmp_path_factory.mktemp("colocated")
    out, groups = base / "colo", base / "colo_groups"
    run_demo(out, 3, "--colocate", "--no-auto-resume")
    old = groups / "ckpt" / "iter_0000005"
    old.mkdir(parents=True)
    (old / "COMPLETE.json").write_text('{"format": "earlier run"}')
    (groups / "ckpt" / "resume_state.json").write_text('{"rollout_id": 5}')
    (groups / "ckpt" / "latest_checkpointed_iteration.txt").write_text("5")
    run_demo(groups, 3, "--colocate", "--no-auto-resume", "--offload-train-groups", "on", "--existing-save", "archive")
    return out, groups


def test_colocated_mode_releases_and_resyncs_engine(colocated_runs):
    """--colocate: the engine drops its weights before every train step and gets a full,
    verified weight update before the next rollout (the GPU choreography, run on CPU)."""
    out, groups = colocated_runs
    recs = metrics(out)
    train = [r for r in recs if "train/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    check_mode_keys(recs, "off")  # the keys docs/metrics.md lists for the mode
    assert all(r["sync/checked_tensors"] == 26 for r in train)
    assert max(r["train/mismatch_abs_logprob"] for r in train) < 1e-5
    phases = ("generate", "reward", "broadcast", "old_logprob", "ref_logprob", "train", "sync")
    for r in train:  # every step logs its phase timings (benchmarks/rl_step.py reads them)
        assert all(r[f"perf/{p}_s"] >= 0 for p in phases), r
        assert 0 < r["perf/weight_swap_s"] < r["perf/ref_logprob_s"]  # the KL reference is swapped in and out
        assert r["perf/reward_s"] <= r["perf/generate_s"]  # rewards are part of the rollout phase
        assert sum(r[f"perf/{p}_s"] for p in phases if p != "reward") <= r["perf/step_time_s"] + 1e-6
    first = next(r for r in recs if r["step"] == 0)  # start-up phases ride on the initial sync's record
    laps = [v for k, v in first.items() if k.startswith("perf/startup_") and k != "perf/startup_s"]
    assert len(laps) == 8 and all(v >= 0 for v in laps) and sum(laps) <= first["perf/startup_s"] + 1e-6, first
    # the trainer's process groups destroyed for every generation and rebuilt before training
    # (--offload-train-groups on; the GPU default, over gloo here): the same run, number for number (that run
    # also archived an earlier run's checkpoints first: a fresh start's numbers do not depend on them)
    again = metrics(groups)
    assert len(again) == len(recs)
    numbers = (lambda r: {k: v for k, v in r.items() if not k.startswith("perf/") and "time" not in k})
    assert [numbers(r) for r in recs] == [numbers(r) for r in again]
    check_mode_keys(again, "off", present=["perf/groups_rebuild_s"])
    assert all(r["perf/groups_rebuild_s"] > 0 for r in again if "train/pg_loss" in r)


def test_fresh_start_archives_the_earlier_run(colocated_runs):
    """``--no-auto-resume --existing-save archive`` under torchrun (2 gloo ranks, the CPU demo script): a fresh start
    into a --save that held an earlier run's checkpoints overwrote and pruned them silently. Here the root holds an
    earlier run's iter dir and pointers; the fresh run archives them on rank 0 before it starts (the other rank
    never reads the root), trains, and saves into the now-clean root. The refusal without --existing-save is
    unit-tested (tests/config/test_save_paths.py)."""
    _, out = colocated_runs
    root = out / "ckpt"
    archives = [n for n in os.listdir(root) if n.startswith("archive_")]
    assert len(archives) == 1, os.listdir(root)
    assert sorted(os.listdir(root / archives[0])) == ["iter_0000005", "latest_checkpointed_iteration.txt",
                                                      "resume_state.json"]
    assert (root / archives[0] / "iter_0000005" / "COMPLETE.json").read_text() == '{"format": "earlier run"}'
    assert sorted(n for n in os.listdir(root) if n not in archives) == [
        ".megatron_rl.lock", "iter_0000003", "latest_checkpointed_iteration.txt", "resume_state.json"]
    assert json.loads((root / "resume_state.json").read_text())["rollout_id"] == 3
