"""benchmarks/gpu_steps.py --dry-run: the GPU training checks of scripts/gpu_check.sh start and finish on CPU.

Why in CI: the GPU machine is lent to few sessions and for minutes; a check that broke since the
last one would waste them. The dry run is the same code at a tiny size (one torchrun process, ~12 s):
every backend variant the GPU run measures trains, the offload run's grad norms follow the plain
run's, the fp16 run takes its steps at the given loss scale, sleep/wake leave a trainable backend.
"""

import json
import os

import pytest

from _util import REPO, torchrun

pytestmark = pytest.mark.dist


def test_gpu_steps_dry_run(tmp_path):
    out = tmp_path / "gpu_steps.json"
    torchrun(os.path.join(REPO, "benchmarks", "gpu_steps.py"), 1, ["--dry-run", "--json", str(out)], timeout=300)
    res = json.loads(out.read_text())
    checks = ("train_step", "optimizer_cpu_offload", "sleep_wake", "fsdp", "fp8", "memory_saver", "lora",
              "ppo_critic")
    assert {k: res[k]["status"] for k in checks} == \
        {"train_step": "ok", "optimizer_cpu_offload": "ok", "sleep_wake": "ok", "fsdp": "ok", "fp8": "skipped",
         "memory_saver": "skipped", "lora": "ok", "ppo_critic": "ok"}
    for name in ("megatron", "fsdp"):
        ppo = res["ppo_critic"][name]
        assert ppo["values_finite"] and ppo["all_finite"] and all(m["critic/grad_norm"] > 0 for m in ppo["steps"])
        assert ppo["sleep_wake"]["step_after_wake_finite"]
    assert res["lora"]["moved_tensors"] > 0 and res["lora"]["lora_over_full_step_s"] > 0
    assert "FP8 needs a GPU" in res["fp8"]["why"] or "transformer-engine does not import" in res["fp8"]["why"]
    assert "it needs a GPU" in res["memory_saver"]["why"] or "does not import" in res["memory_saver"]["why"]
    assert res["train_step"]["ratio_step_to_bare"] > 0 and res["train_step"]["bare_megatron_core"]["micro_batches"] >= 1
    assert res["optimizer_cpu_offload"]["grad_norm_rel_diff"] < 1e-3
    assert res["sleep_wake"]["step_after_wake_finite"] and res["fsdp"]["sleep_wake"]["step_after_wake_finite"]
    assert res["fsdp"]["fp16_steps_taken"] == len(res["fsdp"]["fp16"]["steps"]) > 0
    teacher = res["fsdp"]["opd_teacher"]  # a larger teacher: a model of its own, which sleep/wake carries along
    assert teacher["kind"] == "FSDPFrozenModel" and teacher["sleep_wake"]["step_after_wake_finite"]
    assert all(m["train/loss_scale"] == 4096.0 for m in res["fsdp"]["fp16"]["steps"])
