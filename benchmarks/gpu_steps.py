"""The training checks only a GPU can answer, for scripts/gpu_check.sh.

Run under ``torchrun --nproc-per-node 1`` (one process; every backend in turn). Each check
writes its figures into one JSON (``--json``); a check that fails records the error and the
rest still run. On a CPU machine ``--dry-run`` runs every check at a tiny size with the same
code (memory figures are then None: host memory is the only memory), so the script is known
to start before it runs on a GPU.

Checks:
  train_step    megatron backend, --bf16: RL train steps (PPO loss over packed, dynamically
                batched micro-batches) in tokens/s, against a bare megatron-core step on the
                same model and micro-batches (GPTModel forward with labels -> its own fused
                cross-entropy, backward, optimizer step): the framework's ratio to the floor.
  optimizer_cpu_offload
                megatron with --optimizer-cpu-offload --use-precision-aware-optimizer: peak
                device memory and step time against train_step's; losses and grad norms of the
                same steps close to train_step's (bf16).
  sleep_wake    megatron backend with --offload-train: torch.cuda.memory_allocated before sleep(),
                after it, after wake(); the step after wake is finite; then the process groups
                destroyed and rebuilt (--offload-train-groups on: auto keeps them until this check
                has run on NCCL): free device
                memory before / after the release, the rebuild's time, a finite step after it.
  fsdp          FSDP backend, --bf16: tokens/s; --optimizer-cpu-offload: peak device memory
                against it; --fp16: steps taken at a loss scale that fits; sleep()/wake()
                memory; an --opd-teacher-load of twice the hidden size (a frozen model of its own,
                backends/fsdp/teacher.py): its log-prob pass's time, and sleep()/wake() with it.
  fp8           megatron with --fp8-format hybrid when transformer-engine imports, else the reason.
  memory_saver  torch_memory_saver (the design's tier 1, not built: backends/sleep_tiers.py says what it
                takes), the figures that tier would be built on: a 1 GiB tensor and then a whole megatron
                backend (built and trained inside its region, in-process "torch" hook mode) paused with
                a host backup and resumed: device memory freed, pause/resume seconds, every parameter
                the same bits after the resume (and the host backup equal while paused), a finite step
                after it. Skipped with the reason where it does not import or there is no GPU.
  routing_replay
                megatron with --use-routing-replay on a Qwen3-MoE of the same body (bf16, full recompute):
                route agreement per step, step time against the same steps without replay.
  lora          megatron with --lora-rank 16 (bf16) against full fine-tuning: finite adapter grad norms,
                step time and peak memory ratios, the merged export moving only the adapted projections.
                Skipped where transformer-engine is installed (LoRA runs on the local layer spec only).
  ppo_critic    --advantage-estimator ppo in bf16 on each backend: the critic's values, actor + critic
                steps (time, peak memory, finite losses and grad norms), sleep/wake with a critic.

A check fails when it raises; its figures are what to read otherwise.

    torchrun --nproc-per-node 1 benchmarks/gpu_steps.py --json OUT.json [--dry-run] [--checks a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECKS = ("train_step", "optimizer_cpu_offload", "sleep_wake", "fsdp", "fp8", "memory_saver", "routing_replay",
          "lora", "ppo_critic")
# a Qwen2-shaped model that fits one 80 GB GPU many times over: the vocab is Qwen's (the [tokens, vocab] logits are
# what RL steps spend memory on), the body is small so the check takes seconds
GPU_MODEL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
GPU_BATCH = dict(samples=64, group=8, prompt=256, response=256, max_tokens=8192, steps=4)
DRY_MODEL = dict(vocab_size=4099, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
DRY_BATCH = dict(samples=8, group=4, prompt=8, response=8, max_tokens=64, steps=2)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _mem() -> dict:
    if not torch.cuda.is_available():
        return {"allocated_gib": None, "peak_gib": None}
    return {"allocated_gib": torch.cuda.memory_allocated() / 2 ** 30,
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def _reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def make_samples(vocab: int, batch: dict, seed: int = 0):
    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch["samples"]):
        ids = torch.randint(0, vocab, (batch["prompt"] + batch["response"],), generator=g).tolist()
        out.append(Sample(group_index=i // batch["group"], prompt_ids=ids[:batch["prompt"]],
                          response_ids=ids[batch["prompt"]:], reward=float(torch.rand(1, generator=g)),
                          rollout_logprobs=[-1.0] * batch["response"]))
    return out


class Run:
    """One backend built from flags, on the shared model and batch."""

    def __init__(self, backend_name: str, hf: str, batch: dict, flags: list[str]):
        from megatron_rl.algorithms.config import PolicyGradientConfig
        from megatron_rl.algorithms.spec import PolicyGradientSpec
        from megatron_rl.backends.factory import make_backend
        from megatron_rl.config import parse_config

        argv = ["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "1", "--train-backend", backend_name,
                "--rollout-batch-size", str(batch["samples"] // batch["group"]),
                "--n-samples-per-prompt", str(batch["group"]), "--use-dynamic-batch-size",
                "--max-tokens-per-gpu", str(batch["max_tokens"]), "--lr", "1e-5", "--seed", "1",
                "--rollout-max-prompt-len", str(batch["prompt"]),
                "--rollout-max-response-len", str(batch["response"]), *flags]
        self.cfg = parse_config(argv)
        self.spec = PolicyGradientSpec(PolicyGradientConfig())
        self.backend = make_backend(backend_name)
        self.backend.initialize(self.cfg, self.spec)
        self.name = backend_name
        self.samples = make_samples(self.backend.vocab_size, batch)
        self.tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in self.samples)

    def train(self, steps: int) -> dict:
        """``steps`` RL train steps (old log-probs by a forward pass first); per-step metrics and tokens/s."""
        from megatron_rl.backends.base import TrainBatch

        adv = self.spec.compute_advantages(self.samples)
        old = self.backend.forward_only(self.samples)
        batch = TrainBatch(self.samples, adv, old_logprobs=old)
        self.backend.train_step(batch)  # warm-up (allocator, kernels, autotuning)
        _reset_peak()
        _sync()
        t0 = time.perf_counter()
        metrics = []
        for _ in range(steps):
            m = self.backend.train_step(batch)
            metrics.append({k: m[k] for k in ("train/pg_loss", "train/grad_norm", "train/update_skipped",
                                              "train/loss_scale", "train/route_agreement") if k in m})
        _sync()
        dt = (time.perf_counter() - t0) / steps
        return {"step_s": dt, "tokens_per_s": self.tokens / dt, "steps": metrics, **_mem()}

    def close(self):
        if self.name == "megatron":
            from megatron_rl.models.parallel import destroy_parallel

            destroy_parallel()
        self.backend = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def bare_megatron_step(run: Run, steps: int) -> dict:
    """The floor: megatron-core alone on the backend's own model, optimizer and packed micro-batches
    (GPTModel forward with labels = its fused cross-entropy, backward, distributed-optimizer step)."""
    backend = run.backend
    _, mbs, _ = backend.preprocess_rollout_data(run.samples)
    model = backend.model[0]
    device = next(model.parameters()).device
    mbs = [mb.to(device) for mb in mbs]

    def once():
        model.zero_grad_buffer()
        backend.optimizer.zero_grad()
        for mb in mbs:
            labels = torch.roll(mb.tokens, -1)[None]
            loss = model(mb.tokens[None], mb.position_ids[None], None, labels=labels,
                         packed_seq_params=mb.packed_seq_params())
            loss.float().sum().backward()
        backend.optimizer.step()

    once()
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        once()
    _sync()
    dt = (time.perf_counter() - t0) / steps
    return {"step_s": dt, "tokens_per_s": run.tokens / dt, "micro_batches": len(mbs)}


def check_routing_replay(hf, batch, dry):
    """--use-routing-replay on a Qwen3-MoE of the same body (16 experts, top-2, bf16, full activation recompute,
    so the backward's re-run forward replays from megatron's FIFO on the device): each step's route agreement and
    the step time against the same steps without replay."""
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    body = DRY_MODEL if dry else GPU_MODEL
    with tempfile.TemporaryDirectory(prefix="gpu_moe_") as tmp:
        moe = build_tiny_hf_model("qwen3_moe", os.path.join(tmp, "moe"), **body,
                                  head_dim=body["hidden_size"] // body["num_attention_heads"], num_experts=16,
                                  num_experts_per_tok=2, moe_intermediate_size=body["intermediate_size"] // 4)
        out: dict = {}
        for name, extra in (("none", []), ("r2", ["--use-routing-replay"])):
            run = Run("megatron", moe, batch, ["--bf16", "--recompute-granularity", "full", *extra])
            try:
                out[name] = run.train(batch["steps"])
            finally:
                run.close()
    agreement = [m.get("train/route_agreement") for m in out["r2"]["steps"]]
    if not agreement or any(a is None or not 0.0 < a <= 1.0 for a in agreement):
        raise RuntimeError(f"routing replay reported no or impossible route agreement: {agreement}")
    return {**out, "route_agreement": agreement, "r2_over_none_step_s": out["r2"]["step_s"] / out["none"]["step_s"]}


def check_lora(hf, batch, dry):
    """--lora-rank 16 (bf16, all-linear) against full fine-tuning on the same model and batch: the adapters train
    (finite grad norms, the loss moves), the step time and peak memory as ratios, and the merged export the engine
    gets differs from the base only in the adapted weights. Megatron's local layer spec: skipped where
    transformer-engine is installed (validation refuses LoRA there)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return {"status": "skipped", "why": "transformer-engine is installed: LoRA runs on the local layer spec only"}
    out: dict = {}
    for name, extra in (("full", []), ("lora", ["--lora-rank", "16", "--lora-alpha", "32"])):
        run = Run("megatron", hf, batch, ["--bf16", *extra])
        try:
            out[name] = run.train(batch["steps"])
            if name == "lora":
                merged = {n: t for bucket in run.backend.export_weights(1 << 28) for n, t in bucket}
                with contextlib.ExitStack() as off:
                    for adapters in run.backend.lora:
                        off.enter_context(adapters_off(adapters))
                    base = {n: t for bucket in run.backend.export_weights(1 << 28) for n, t in bucket}
                moved = sorted(n for n in merged if not torch.equal(merged[n], base[n]))
                out["moved_tensors"] = len(moved)
                if not moved or any(not n.endswith("_proj.weight") for n in moved):
                    raise RuntimeError(f"the merged export moved {moved[:6]}: expected the adapted projections only")
        finally:
            run.close()
    norms = [m["train/grad_norm"] for m in out["lora"]["steps"]]
    if not all(math.isfinite(g) and g > 0 for g in norms):
        raise RuntimeError(f"LoRA grad norms {norms}")
    return {**out, "lora_over_full_step_s": out["lora"]["step_s"] / out["full"]["step_s"],
            "lora_over_full_peak": (out["lora"]["peak_gib"] / out["full"]["peak_gib"]
                                    if out["full"]["peak_gib"] else None)}


@contextlib.contextmanager
def adapters_off(adapters):
    """The base model's export: the adapters' B zeroed inside the block (merged() then adds nothing)."""
    saved = [b.detach().clone() for _, a in adapters.items() for b in a.lora_B]
    with torch.no_grad():
        for _, a in adapters.items():
            for b in a.lora_B:
                b.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip((b for _, a in adapters.items() for b in a.lora_B), saved):
                b.copy_(v)


def check_train_step(hf, batch, dry):
    run = Run("megatron", hf, batch, ["--bf16"])
    try:
        ours = run.train(batch["steps"])
        bare = bare_megatron_step(run, batch["steps"])
    finally:
        run.close()
    return {"ours": ours, "bare_megatron_core": bare, "ratio_step_to_bare": ours["step_s"] / bare["step_s"]}


def check_optimizer_cpu_offload(hf, batch, dry, results):
    run = Run("megatron", hf, batch, ["--bf16", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"])
    try:
        got = run.train(batch["steps"])
    finally:
        run.close()
    out = {"offload": got}
    base = results.get("train_step", {}).get("ours")
    if base and "steps" in base:
        out["grad_norm_rel_diff"] = max(abs(a["train/grad_norm"] - b["train/grad_norm"]) / max(abs(b["train/grad_norm"]),
                                                                                             1e-12)
                                        for a, b in zip(got["steps"], base["steps"]))
        if base["peak_gib"] is not None:
            out["peak_ratio_to_train_step"] = got["peak_gib"] / base["peak_gib"]
            out["step_ratio_to_train_step"] = got["step_s"] / base["step_s"]
    return out


def _finite(step: dict) -> bool:
    """Every figure of one step's metrics finite (the skipped-update flag aside)."""
    return all(v == v and abs(v) != float("inf") for k, v in step.items() if k != "train/update_skipped")


def _sleep_wake(run: Run) -> dict:
    _sync()
    before = _mem()["allocated_gib"]
    run.backend.sleep()
    _sync()
    asleep = _mem()["allocated_gib"]
    run.backend.wake()
    _sync()
    awake = _mem()["allocated_gib"]
    after = run.train(1)["steps"][0]
    return {"allocated_gib_before": before, "asleep": asleep, "awake": awake,
            "released_fraction": None if before in (None, 0) else 1 - asleep / before,
            "step_after_wake_finite": _finite(after)}


def _groups_teardown(run: Run) -> dict:
    """The process groups destroyed and rebuilt (--offload-train-groups on; auto keeps them until this ran on a
    GPU): device memory free before, after the release and after the rebuild (NCCL communicators are not tensors:
    torch.cuda.mem_get_info, not memory_allocated), the rebuild's time, a finite step after it."""
    free = (lambda: torch.cuda.mem_get_info()[0] / 2 ** 30 if torch.cuda.is_available() else None)
    _sync()
    before = free()
    destroyed = run.backend.release_comm_groups()
    _sync()
    released = free()
    t0 = time.perf_counter()
    rebuilt = run.backend.restore_comm_groups()
    rebuild_s = time.perf_counter() - t0
    after = run.train(1)["steps"][0]
    return {"plan": run.backend.sleep_plan.describe(), "destroyed": destroyed, "rebuilt": rebuilt,
            "free_gib_before": before, "free_gib_released": released, "free_gib_after_step": free(),
            "freed_gib": None if before is None else released - before, "rebuild_s": rebuild_s,
            "step_after_rebuild_finite": _finite(after)}


def check_sleep_wake(hf, batch, dry):
    from megatron_rl.infra import reloadable_groups

    # --offload-train: the colocated sleep; the groups' teardown forced on: auto keeps them on GPUs until this check
    # has verified it over NCCL (backends/sleep_tiers.py)
    flags = ["--bf16", "--offload-train", "--offload-train-groups", "on"]
    run = Run("megatron", hf, batch, flags)
    try:
        run.train(1)  # optimizer state exists
        out = _sleep_wake(run)
        out["groups"] = _groups_teardown(run)
        return out
    finally:
        run.close()
        reloadable_groups.uninstall()  # the later checks' groups (FSDP2's mesh) are plain ones


def check_fsdp(hf, batch, dry):
    out = {}
    for key, flags in (("bf16", ["--bf16"]), ("bf16_cpu_offload", ["--bf16", "--optimizer-cpu-offload"]),
                       ("fp16", ["--fp16", "--initial-loss-scale", "4096"])):
        run = Run("fsdp", hf, batch, flags)
        try:
            out[key] = run.train(batch["steps"])
            if key == "bf16":
                out["sleep_wake"] = _sleep_wake(run)
        finally:
            run.close()
    if out["bf16"]["peak_gib"] is not None:
        out["offload_peak_ratio"] = out["bf16_cpu_offload"]["peak_gib"] / out["bf16"]["peak_gib"]
    out["fp16_steps_taken"] = sum(1 for m in out["fp16"]["steps"] if m["train/update_skipped"] == 0.0)
    out["opd_teacher"] = _fsdp_larger_teacher(hf, batch, dry)
    return out


def _fsdp_larger_teacher(hf, batch, dry) -> dict:
    """--opd-teacher-load of the same vocabulary and twice the hidden size beside the bf16 actor: a frozen model of
    its own. Its log-prob pass against the actor's (seconds), device memory with it, and a sleep()/wake() that must
    move its parameters with the actor's (released_fraction near the plain run's, not below it)."""
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    body = DRY_MODEL if dry else GPU_MODEL
    with tempfile.TemporaryDirectory(prefix="gpu_teacher_") as tmp:
        teacher = build_tiny_hf_model("qwen2", os.path.join(tmp, "teacher"),
                                      **{**body, "hidden_size": 2 * body["hidden_size"]}, seed=1)
        run = Run("fsdp", hf, batch, ["--bf16", "--opd-teacher-load", teacher, "--opd-kl-coef", "0.5"])
        try:
            run.backend.load_frozen_weights("teacher", teacher)
            kind = type(run.backend.frozen_roles.get("teacher")).__name__
            timed = {}
            for name, call in (("actor", lambda: run.backend.forward_only(run.samples)),
                               ("teacher", lambda: run.backend.maybe_compute_teacher_log_probs(run.samples, True))):
                call()  # warm-up
                _sync()
                t0 = time.perf_counter()
                lps = call()
                _sync()
                timed[f"{name}_logprob_s"] = time.perf_counter() - t0
                timed[f"{name}_finite"] = all(bool(torch.isfinite(t).all()) for t in lps)
            out = {"kind": kind, **timed, **_mem(), "train": run.train(1), "sleep_wake": _sleep_wake(run)}
        finally:
            run.close()
    if kind != "FSDPFrozenModel" or not (out["actor_finite"] and out["teacher_finite"]):
        raise RuntimeError(f"the larger teacher: {kind}, finite log-probs {out['actor_finite']}/{out['teacher_finite']}")
    return out


def check_ppo_critic(hf, batch, dry):
    """--advantage-estimator ppo in bf16 on each backend: the critic's values over the batch, GAE, then actor +
    critic steps (their time, peak memory, finite losses and gradient norms) and a sleep/wake that moves the
    critic's state with the actor's. The first time the critics meet CUDA."""
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch

    out = {}
    for name in ("megatron", "fsdp"):
        run = Run(name, hf, batch, ["--bf16", "--advantage-estimator", "ppo"])
        try:
            spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", normalize_advantages=True))
            old = run.backend.forward_only(run.samples)
            values = run.backend.compute_values(run.samples)
            adv, returns = spec.compute_advantages_and_returns(run.samples, old_logprobs=old, values=values)
            tb = TrainBatch(run.samples, adv, old_logprobs=old, old_values=values, returns=returns)
            run.backend.train_step(tb)  # warm-up
            _reset_peak()
            _sync()
            t0 = time.perf_counter()
            steps = [run.backend.train_step(tb) for _ in range(batch["steps"])]
            _sync()
            dt = (time.perf_counter() - t0) / batch["steps"]
            keys = ("train/pg_loss", "train/grad_norm", "critic/value_loss", "critic/grad_norm",
                    "critic/update_skipped")
            out[name] = {"step_s": dt, "tokens_per_s": run.tokens / dt, **_mem(),
                         "values_finite": all(bool(torch.isfinite(v).all()) for v in values),
                         "steps": [{k: m[k] for k in keys if k in m} for m in steps],
                         "all_finite": all(math.isfinite(m[k]) for m in steps for k in keys if k in m)}
            out[name]["sleep_wake"] = _sleep_wake(run)
        finally:
            run.close()
    return out


def _gpu_package(module: str, label: str, missing: str, no_gpu: str):
    """``(module, None)``, or ``(None, the skip record)`` saying why the check cannot run here."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return None, {"status": "skipped", "why": f"{label} does not import here ({e}); {missing}"}
    if not torch.cuda.is_available():
        return None, {"status": "skipped", "why": no_gpu}
    return mod, None


def check_fp8(hf, batch, dry):
    _, skip = _gpu_package("transformer_engine", "transformer-engine",
                           "its wheels are larger than one device call carries (64 MiB)", "FP8 needs a GPU")
    if skip:
        return skip
    run = Run("megatron", hf, batch, ["--bf16", "--fp8-format", "hybrid"])
    try:
        return {"status": "ran", **run.train(batch["steps"])}
    finally:
        run.close()


def _pause_resume(saver, tag: str, tensors: list) -> dict:
    """Pause ``tag`` with its host backup, then resume: free device memory at each point, the seconds,
    the backups and the resumed tensors compared with host copies taken before."""
    free = (lambda: torch.cuda.mem_get_info()[0] / 2 ** 30)
    before = [t.detach().cpu() for t in tensors]
    _sync()
    free_before = free()
    t0 = time.perf_counter()
    saver.pause(tag)
    _sync()
    pause_s = time.perf_counter() - t0
    free_paused = free()
    backups = [saver.get_cpu_backup(t.detach()) if t.is_contiguous() else None for t in tensors]
    backup_equal = all(b is not None and torch.equal(b, ref) for b, ref in zip(backups, before))
    t0 = time.perf_counter()
    saver.resume(tag)
    _sync()
    resume_s = time.perf_counter() - t0
    return {"bytes_gib": sum(t.numel() * t.element_size() for t in tensors) / 2 ** 30,
            "free_gib_before": free_before, "free_gib_paused": free_paused, "free_gib_resumed": free(),
            "freed_gib": free_paused - free_before, "pause_s": pause_s, "resume_s": resume_s,
            "host_backup_equal": backup_equal,
            "resumed_equal": all(torch.equal(t.detach().cpu(), ref) for t, ref in zip(tensors, before))}


def check_memory_saver(hf, batch, dry):
    torch_memory_saver, skip = _gpu_package("torch_memory_saver", "torch_memory_saver",
                                            "scripts/gpu_wheels.sh carries its wheel",
                                            "torch_memory_saver pauses CUDA memory: it needs a GPU")
    if skip:
        return skip
    saver = torch_memory_saver.TorchMemorySaver()
    saver.hook_mode = "torch"  # in-process (a pluggable allocator); the preload mode needs LD_PRELOAD at start
    from importlib.metadata import version

    out: dict = {"version": version("torch_memory_saver"), "hook_mode": "torch"}
    with saver.region(tag="probe", enable_cpu_backup=True):
        x = torch.randn(2 ** 28, device="cuda")  # 1 GiB
    out["tensor"] = _pause_resume(saver, "probe", [x])
    del x
    # the whole backend inside the region: model, gradient buffers, optimizer state (its first step)
    with saver.region(tag="train", enable_cpu_backup=True):
        run = Run("megatron", hf, batch, ["--bf16"])
        try:
            run.train(1)
            allocated = torch.cuda.memory_allocated() / 2 ** 30
            params = [p for m in run.backend.model for p in m.parameters()]
            out["backend"] = {"allocated_gib": allocated, **_pause_resume(saver, "train", params)}
            after = run.train(1)["steps"][0]
            out["backend"]["step_after_resume_finite"] = _finite(after)
        finally:
            run.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--json", required=True, help="where to write the figures")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU: the same code, known to start")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    args = ap.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        ap.error(f"--checks: unknown {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run with --dry-run on a CPU machine")

    import torch.distributed as dist

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    if not dist.is_initialized():  # one group for every backend; host tensors need gloo next to NCCL
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model, batch = (DRY_MODEL, DRY_BATCH) if args.dry_run else (GPU_MODEL, GPU_BATCH)
    results: dict = {"dry_run": args.dry_run, "model": model, "batch": batch,
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory(prefix="gpu_steps_") as tmp:
        hf = build_tiny_hf_model("qwen2", os.path.join(tmp, "model"), **model)
        for name in checks:
            t0 = time.perf_counter()
            print(f"--- {name}", flush=True)
            fn = globals()[f"check_{name}"]
            try:
                res = fn(hf, batch, args.dry_run, results) if name == "optimizer_cpu_offload" else \
                    fn(hf, batch, args.dry_run)
                results[name] = {"status": "ok", **res} if "status" not in res else res
            except Exception as e:  # noqa: BLE001 - one failing check must not hide the others' figures
                results[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc()[-3000:]}
            results[name]["seconds"] = time.perf_counter() - t0
            print(json.dumps({k: v for k, v in results[name].items() if k != "traceback"}, default=str)[:1500],
                  flush=True)
            with open(args.json, "w") as f:  # after every check: a timeout keeps what finished
                json.dump(results, f, indent=1, default=str)
    failed = [n for n in checks if results[n]["status"] == "failed"]
    print("gpu_steps:", {n: results[n]["status"] for n in checks}, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
