"""Worker for tests/dist/test_fsdp_backend.py: train a few steps with the FSDP (and megatron) backend.

Job ``fsdp`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR RUN [RUN ...]
RUN is ``BACKEND`` or ``BACKEND:FLAGS`` with FLAGS a comma list of extra flags, e.g.
``fsdp:--use-dynamic-batch-size,--max-tokens-per-gpu=24``; ``+save=DIR`` saves a checkpoint
after 3 steps and trains a 4th, ``+load=DIR`` loads that checkpoint and trains only the 4th,
``+hf=DIR`` trains another model than HF_DIR, ``+as=NAME`` files the run's record and weights under NAME
(a LoRA run's flags hold a path). Every run takes the batch and
the flags of tests/dist/scripts/backend_worker.py (the megatron layout test), so the two
backends are compared on the same model, batch and hyper-parameters. Per run it records:
no-grad log-probs, the owner-aligned forward checks, then per step the metrics and the
exported HF weights; FSDP runs also check the weight tags (the snapshot taken before
training and an HF ``--ref-load`` of the initial checkpoint give the initial log-probs back; a LoRA run's tags
hold the adapters only, so it records the snapshot check, its optimizer's parameters and whether every
frozen base shard is bitwise unchanged after training).

Job ``fsdp_teacher`` (function ``teacher``, tests/dist/test_fsdp_teacher.py): on-policy distillation with a larger
teacher (a frozen model of its own) and a same-shape one (a weight tag); its usage is in its docstring.
"""

import json
import os

import torch

from backend_worker import make_samples  # noqa: E402  (the megatron layout test's batch)


def flags_of(hf_dir: str, world: int, flags: list[str]) -> list[str]:
    """backend_worker.py's flags (keep in step with it) plus the run's own."""
    dynamic = any(f.startswith("--max-tokens-per-gpu") for f in flags)
    argv = ["--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", str(world), "--lr", "1e-2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--grad-clip", "1.0",
            "--kl-loss-coef", "0.1", "--use-kl-loss", "--seed", "7", "--adam-eps", "1e-4"]
    argv += [] if dynamic else ["--micro-batch-size", "1"]
    return argv + sum((f.split("=", 1) for f in flags), [])


def main(argv):
    import torch.distributed as dist

    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config

    hf_dir, out_dir, runs = argv[0], argv[1], argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for run in runs:
        name, _, flag_list = run.partition(":")
        flags = [f for f in flag_list.split(",") if f and not f.startswith("+")]
        ckpt = dict(f[1:].split("=", 1) for f in flag_list.split(",") if f.startswith("+"))  # +save=DIR, +load=DIR
        run = ckpt.get("as", run)
        lora_run = any(f.startswith("--lora-rank") for f in flags)
        cfg = parse_config(flags_of(ckpt.get("hf", hf_dir), world, flags) + ["--train-backend", name])
        spec = PolicyGradientSpec(PolicyGradientConfig(kl_loss_coef=0.1, entropy_coef=0.01))
        backend = make_backend(name)
        backend.initialize(cfg, spec)
        backend.snapshot_weights("ref")
        base0 = {}
        if name == "fsdp" and lora_run:  # every frozen shard, to check it never moves
            base0 = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                     for n, p in backend.model.named_parameters() if not p.requires_grad}
        samples = make_samples(backend.vocab_size)
        rec = {"logprobs": [t.tolist() for t in backend.forward_only(samples)], "steps": []}
        if name == "fsdp":  # FSDP2's own record of the offload policy, per sharded parameter (private API)
            from torch.distributed.fsdp import FSDPModule

            rec["offload_to_cpu"] = sorted({fp.offload_to_cpu for m in backend.model.modules()
                                            if isinstance(m, FSDPModule)
                                            for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params})
        plan = backend.plan_rollout(samples, len(samples))
        owned = set(plan.steps[0][1].rank_samples(backend.dp_rank))
        full = backend.forward_only(samples, plan=plan.forward)
        mine = backend.forward_only(samples, plan=plan.forward, owned_only=True)
        rec["owned"] = {"dp_rank": backend.dp_rank, "samples": sorted(owned),
                        "bitwise_equal_to_full_gather": all(
                            (t is not None and torch.equal(t, f)) if i in owned else t is None
                            for i, (t, f) in enumerate(zip(mine, full)))}
        checks = [None] * dist.get_world_size()
        dist.all_gather_object(checks, rec["owned"])
        rec["owned"] = checks
        def train(step):
            old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
            ref = backend.maybe_compute_ref_log_probs(samples, True, plan=plan.forward, owned_only=True)
            adv = spec.compute_advantages(samples)
            calls = []  # forward calls of the first MLP in the step: x2 with recompute
            hook = backend.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1)) \
                if name == "fsdp" else None
            m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, ref_logprobs=ref))
            if hook is not None:
                hook.remove()
                m["mlp0_forwards"] = float(len(calls))
            weights = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
            rec["steps"].append({"metrics": m})
            if dist.get_rank() == 0:
                torch.save(weights, os.path.join(out_dir, f"{run}_step{step}.pt".replace("/", "_")))

        if "load" in ckpt:  # resume: the saved run's 4th step from its checkpoint after 3
            rec["extra_state"] = backend.load(os.path.join(ckpt["load"], "iter_0000003"))
            train(3)
            results[run] = rec
            continue
        for step in range(3):
            train(step)
        if "save" in ckpt:  # checkpoint after 3 steps, then the uninterrupted 4th step
            backend.save(os.path.join(ckpt["save"], "iter_0000003"), {"rollout_id": 3})
            train(3)
        if lora_run:  # --lora-sync adapter: the adapters, merged as the engine merges them, are the merged export
            from megatron_rl.models.peft_adapter import merged_weight

            adapter = backend.export_adapters()
            base = {n: t.clone() for b in backend.export_weights(1 << 20, merge_adapters=False) for n, t in b}
            merged = {n: t.clone() for b in backend.export_weights(1 << 20) for n, t in b}
            adapted = {f"{m}.weight": ab for m, ab in adapter.modules().items()}
            rec["adapter_sync"] = {
                "merge_max_diff": max((merged[n] - merged_weight(base[n], a, b, adapter.scaling)).abs().max().item()
                                      for n, (a, b) in adapted.items()),
                "others_are_base": set(merged) == set(base) and all(torch.equal(merged[n], base[n])
                                                                    for n in merged if n not in adapted),
                "keys": sorted(adapter.tensors), "r_alpha": [adapter.rank, adapter.alpha]}
            if dist.get_rank() == 0:
                torch.save(adapter.tensors, os.path.join(out_dir, f"{run}_adapter.pt"))
        if name == "fsdp" and lora_run:
            initial = [torch.tensor(x) for x in rec["logprobs"]]
            snap = backend.maybe_compute_ref_log_probs(samples, True)
            params = dict(backend.model.named_parameters())
            rec["lora"] = {
                "snapshot_vs_initial": max((a - b).abs().max().item() for a, b in zip(snap, initial)),
                "tag_tensors": sorted(backend.weights._tags["ref"]),
                "optimizer_params": sorted(n for n, p in params.items()
                                           if any(p is q for g in backend.optimizer.param_groups for q in g["params"])),
                "optimizer_state_params": len(backend.optimizer.state),
                "adapters": sorted(n for n, p in params.items() if p.requires_grad),
                "frozen": len(base0),
                "base_unchanged": all(torch.equal((params[n].to_local() if hasattr(params[n], "to_local")
                                                   else params[n]).detach(), t) for n, t in base0.items()),
            }
        elif name == "fsdp":
            initial = [torch.tensor(x) for x in rec["logprobs"]]
            snap = backend.maybe_compute_ref_log_probs(samples, True)
            backend.load_frozen_weights("hf_ref", ckpt.get("hf", hf_dir))
            with backend.switch_weights("hf_ref"):
                loaded = backend.forward_only(samples)
            after = backend.forward_only(samples)  # the actor is back: trained weights, not the initial ones
            rec["tags"] = {
                "snapshot_vs_initial": max((a - b).abs().max().item() for a, b in zip(snap, initial)),
                "hf_load_vs_initial": max((a - b).abs().max().item() for a, b in zip(loaded, initial)),
                "actor_after_vs_initial": max((a - b).abs().max().item() for a, b in zip(after, initial)),
            }
        else:
            from megatron_rl.models.parallel import destroy_parallel

            destroy_parallel()
        results[run] = rec
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"results_w{world}.json"), "w") as f:
            json.dump(results, f)
    # every rank then waits for rank 0's results in the harness's barrier (tests/dist/harness.py)


def teacher(argv):
    """Job ``fsdp_teacher`` (tests/dist/test_fsdp_teacher.py): on-policy distillation on the FSDP backend.

    argv = STUDENT_HF BIG_TEACHER_HF SAME_TEACHER_HF OUT_DIR CKPT_ROOT MODE, MODE ``save`` or ``resume``.
    ``save``: a fresh OPD run with the larger teacher (a model of its own), 3 steps, the checkpoint after 2 under
    CKPT_ROOT; then a run with the same-shape teacher (a weight tag), and a --lora-rank run with the larger teacher
    (one step). ``resume``: the same fresh larger-teacher run
    (3 steps, no save), then a run resumed from CKPT_ROOT through ``Resumer.resume_or_init`` (as the loop starts),
    which trains the 3rd step. The start-up and the steps go through the product's own calls (resume_or_init,
    maybe_compute_*_log_probs with the owner-aligned plan, train_step). Writes ``teacher_<MODE>_w<world>.json``."""
    import torch.distributed as dist

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    hf_dir, big, same, out_dir, ckpt_root, mode = argv
    world = int(os.environ["WORLD_SIZE"])

    def start(teacher_dir, *extra):
        cfg = parse_config(flags_of(hf_dir, world, ["--train-backend=fsdp", f"--opd-teacher-load={teacher_dir}",
                                                    "--opd-kl-coef=0.5", *extra]))
        spec = spec_from_config(cfg)
        backend = make_backend("fsdp")
        backend.initialize(cfg, spec)
        step = Resumer(cfg, CheckpointCursor()).resume_or_init(backend, None)
        return backend, spec, step

    def teacher_logprobs(backend, samples):
        plan = backend.plan_rollout(samples, len(samples))
        full = backend.maybe_compute_teacher_log_probs(samples, True)
        mine = backend.maybe_compute_teacher_log_probs(samples, True, plan=plan.forward, owned_only=True)
        owned = set(plan.steps[0][1].rank_samples(backend.dp_rank))
        owned_ok = all((t is not None and torch.equal(t, f)) if i in owned else t is None
                       for i, (t, f) in enumerate(zip(mine, full)))
        return [t.tolist() for t in full], owned_ok

    def train(backend, spec, samples, rec, save_after=None, until=3):
        for step in range(rec["start_step"], until):
            plan = backend.plan_rollout(samples, len(samples))
            old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
            ref = backend.maybe_compute_ref_log_probs(samples, True, plan=plan.forward, owned_only=True)
            tea = backend.maybe_compute_teacher_log_probs(samples, True, plan=plan.forward, owned_only=True)
            adv = spec.compute_advantages(samples)
            m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, ref_logprobs=ref, teacher_logprobs=tea,
                                              plan=plan.steps[0][1]))
            rec["steps"].append({k: v for k, v in m.items() if not k.endswith("_time_s")})
            if save_after == step:
                backend.save(os.path.join(ckpt_root, f"iter_{step + 1:07d}"), {"rollout_id": step + 1})

    def own_model_record(backend):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        role = backend.frozen_roles["teacher"]
        actor = {id(p) for p in backend.model.parameters()}
        in_optimizer = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
        return {"kind": type(role).__name__, "tags": backend.weights.tags,
                "hidden": [role.model.config.hidden_size, role.model.config.num_hidden_layers],
                "frozen": not any(p.requires_grad for p in role.model.parameters()),
                "in_optimizer": any(id(p) in in_optimizer for p in role.model.parameters()),
                "shares_actor_params": any(id(p) in actor for p in role.model.parameters()),
                "eval_mode": not role.model.training,
                "resident": [m is role.model for m, _ in backend.resident_models()],
                "actor_state_keys": len(get_model_state_dict(backend.model))}

    samples = make_samples(250)
    results = {}
    backend, spec, step0 = start(big)
    rec = {"start_step": step0, "steps": [], "own_model": own_model_record(backend)}
    rec["student_logprobs"] = [t.tolist() for t in backend.forward_only(samples)]
    rec["teacher_logprobs"], rec["owned_ok"] = teacher_logprobs(backend, samples)
    train(backend, spec, samples, rec, save_after=1 if mode == "save" else None)
    rec["teacher_after_training_equal"] = teacher_logprobs(backend, samples)[0] == rec["teacher_logprobs"]
    results["big"] = rec
    if mode == "save":
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(os.path.join(ckpt_root, "iter_0000002")).read_metadata().state_dict_metadata
        rec["ckpt_top_keys"] = sorted({k.split(".", 1)[0] for k in keys})
        rec["ckpt_model_keys"] = sum(k.startswith("model.") for k in keys)
        del backend
        backend, spec, step0 = start(same)
        rec = {"start_step": step0, "frozen_roles": sorted(backend.frozen_roles), "tags": backend.weights.tags}
        rec["teacher_logprobs"], rec["owned_ok"] = teacher_logprobs(backend, samples)
        rec["actor_back"] = [t.tolist() for t in backend.forward_only(samples)] == results["big"]["student_logprobs"]
        results["same"] = rec
        del backend
        backend, spec, step0 = start(big, "--lora-rank=4", "--lora-alpha=8")
        rec = {"start_step": step0, "steps": [], "own_model": own_model_record(backend),
               "teacher_adapters": sum("lora_" in n for n, _ in backend.frozen_roles["teacher"].model.named_parameters()),
               "student_adapters": sum("lora_" in n for n, _ in backend.model.named_parameters())}
        rec["teacher_logprobs"], rec["owned_ok"] = teacher_logprobs(backend, samples)
        train(backend, spec, samples, rec, until=1)
        results["lora"] = rec
    else:
        del backend
        backend, spec, step0 = start(big, f"--load={ckpt_root}")
        rec = {"start_step": step0, "steps": []}
        rec["teacher_logprobs"], rec["owned_ok"] = teacher_logprobs(backend, samples)
        train(backend, spec, samples, rec)
        results["resumed"] = rec
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"teacher_{mode}_w{world}.json"), "w") as f:
            json.dump(results, f)
