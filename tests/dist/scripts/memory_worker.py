"""Worker for tests/dist/test_static_memory.py: the static-memory estimate (plan/memory.py) against the bytes a
real backend holds.

Job ``memory`` of tests/dist/harness.py: argv = OUT_DIR RUN_JSON [RUN_JSON ...]; a run is
``{"name": ..., "hf": HF_DIR, "flags": [...]}``. For each run, on every rank: build the backend (megatron's
``MegatronBackend`` or fsdp's), take one training step as the loop does (old log-probs, the reference's when a
KL term is on, the critic's values and returns under ppo), then count what this rank holds, by kind:

* parameters: every distinct storage under the role's parameters (with the distributed optimizer the trainable
  ones are views of DDP's padded param buffer, so its storage is what is held), split trainable / frozen;
* gradient buffers: DDP's ``grad_data`` of every dense and expert buffer (fsdp: the sharded ``.grad``);
* optimizer state: every distinct storage reachable from the optimizer (the inner optimizer's state and
  parameter groups, the fp32 main shards, the hybrid CPU optimizer's host copies and gradient copies) that is
  not a parameter's or a gradient buffer's;
* weight tags: ``WeightManager.nbytes`` of each tag (the reference and the actor's kept copy).

and the estimator's figures for the same rank (``config.static_memory.memory_report`` of the same config).
Writes ``{name}_rank{r}.json``.
"""

import json
import os

import torch


def _storage(t):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(obj):
    """Every tensor in nested dicts / lists / tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def measure_megatron_role(role) -> dict:
    """Bytes of one RoleModel on this rank, by kind."""
    params: dict = {}
    frozen: dict = {}
    for chunk in role.chunks:
        for p in chunk.parameters():
            ptr, n = _storage(p)
            (params if p.requires_grad else frozen)[ptr] = n
    grads: dict = {}
    if role.optimizer is not None:
        for m in role.model:
            for buf in list(m.buffers) + list(m.expert_parallel_buffers):
                ptr, n = _storage(buf.grad_data)
                grads[ptr] = n
    seen = set(params) | set(frozen) | set(grads)
    optim: dict = {}
    for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer]) if role.optimizer else []:
        inner = opt.optimizer
        found = list(_tensors(dict(inner.state)))
        found += list(_tensors([g["params"] for g in inner.param_groups]))
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            found += list(_tensors(getattr(opt, attr, [])))
        for attr in ("gpu_params_map_cpu_copy", "cpu_copy_map_grad", "param_to_fp32_param"):  # the hybrid optimizer
            found += list(_tensors(dict(getattr(inner, attr, {}))))
        for sub in getattr(inner, "sub_optimizers", []):
            found += list(_tensors(dict(sub.state)))
        for t in found:
            ptr, n = _storage(t)
            if ptr not in seen and n:
                optim[ptr] = n
    return {"params": sum(params.values()), "frozen": sum(frozen.values()), "grads": sum(grads.values()),
            "optimizer": sum(optim.values()),
            "param_elements": sum(p.numel() for c in role.chunks for p in c.parameters())}


def fsdp_grad_bytes(model) -> int:
    """The sharded gradients' bytes (FSDP2 frees them at ``zero_grad(set_to_none=True)`` after each step, so they
    are counted when the optimizer step starts: a step pre-hook)."""
    return sum(dict(_storage(_local(p.grad)) for p in model.parameters() if p.grad is not None).values())


def measure_fsdp(backend, grad_bytes: int) -> dict:
    params = {}
    for p in backend.model.parameters():
        ptr, n = _storage(_local(p))
        params[ptr] = n
    grads: dict = {}
    optim = {}
    for t in _tensors(dict(backend.optimizer.state)):
        ptr, n = _storage(_local(t))
        if ptr not in params and ptr not in grads:
            optim[ptr] = n
    return {"params": sum(params.values()), "frozen": 0, "grads": grad_bytes, "optimizer": sum(optim.values()),
            "param_elements": sum(_local(p).numel() for p in backend.model.parameters())}


def estimate_for_rank(cfg, rank: int) -> dict:
    """The estimator's figures for ``rank``, by component and kind (device + host bytes)."""
    from megatron_rl.config.static_memory import memory_report

    report, source = memory_report(cfg)
    assert report is not None, source
    out = {}
    for comp in report.components:
        stage = comp.for_rank(rank)
        kinds = {}
        for row in stage.rows:
            k = ("params" if row.kind.startswith("parameters, trainable") or row.kind.startswith("parameters (fp32")
                 else "frozen" if row.kind.startswith("parameters") else "grads" if row.kind.startswith("grad")
                 else "optimizer" if row.kind.startswith("optimizer") else "tags" if row.kind.startswith("weight tags")
                 else row.kind)
            kinds[k] = kinds.get(k, 0.0) + row.device + row.host
        kinds["param_elements"] = stage.params
        out[comp.name] = kinds
    return out


def shapes_run(run: dict, rank: int) -> dict:
    """A family's model (no optimizer) built at a layout: this rank's parameter elements (and the sigmoid router's
    fp32 expert-bias buffers) against the estimator's for this rank's stage. Covers the per-rank splits of the
    families the training runs do not (MLA, gated delta-net, gpt-oss's sinks and biases, shared experts, MTP)."""
    from megatron_rl.models import get_bridge
    from megatron_rl.models.parallel import ParallelLayout, destroy_parallel, initialize_parallel
    from megatron_rl.plan.memory import MegatronLayout, ModelArch, stage_tensors

    layout = ParallelLayout(**run["layout"])
    initialize_parallel(layout, seed=0)
    bridge = get_bridge(run["config"], mtp_num_layers=run.get("mtp", 0))
    chunks = bridge.build_model(layout)
    live = sum(p.numel() for c in chunks for p in c.parameters()) + sum(
        b.numel() for c in chunks for n, b in c.named_buffers() if n.endswith("expert_bias"))
    lay = MegatronLayout(world=2, **run["layout"])
    stage = lay.stage_of_rank(rank)
    est = sum(t.elements for c in range(lay.chunks)
              for t in stage_tensors(ModelArch.from_hf_config(run["config"]), lay, stage, c,
                                     mtp_layers=run.get("mtp", 0)))
    del chunks
    destroy_parallel()
    return {"measured": {"model": {"param_elements": live}}, "estimate": {"model": {"param_elements": est}},
            "seconds": 0.0}


def activations_run(run: dict, rank: int) -> dict:
    """One packed micro-batch through a tiny model at ``run["layout"]`` (TP 2 with sequence parallelism): the bytes of
    the unique non-parameter storages its autograd graph keeps on this rank (``saved_tensors_hooks``) against
    plan/activations.py's local-kernel estimate (tests/plan/test_activations.py does TP 1 in one process)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models import get_bridge
    from megatron_rl.models.parallel import ParallelLayout, destroy_parallel, initialize_parallel
    from megatron_rl.plan.activations import ActivationFlags, stage_activations
    from megatron_rl.plan.memory import MegatronLayout, ModelArch

    layout = ParallelLayout(**run["layout"])
    initialize_parallel(layout, seed=0)
    [model] = get_bridge(run["hf"]).build_model(layout, params_dtype=torch.bfloat16)
    seqs, seq_len = 4, 64
    n = seqs * seq_len
    cu = torch.arange(0, n + 1, seq_len, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=seq_len, max_seqlen_kv=seq_len)
    torch.manual_seed(0)  # the same tokens on both TP ranks
    tokens, positions = torch.randint(0, 200, (1, n)), torch.arange(seq_len).repeat(seqs)[None]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, positions, None, packed_seq_params=psp)
    out.float().sum().backward()
    del model, out
    destroy_parallel()
    lay = MegatronLayout(world=2, tp=layout.tp)
    est = stage_activations(ModelArch.from_path(run["hf"]), lay, ActivationFlags(
        tokens=n, kernels="local", sequence_parallel=layout.sequence_parallel), 0)
    return {"measured": sum(seen.values()), "estimate": est.per_microbatch, "seconds": 0.0}


def main(argv):
    import time

    import torch.distributed as dist

    from backend_worker import make_samples, ppo_epochs
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    out_dir, runs = argv[0], [json.loads(a) for a in argv[1:]]
    world, rank = dist.get_world_size(), dist.get_rank()
    for run in runs:
        t0 = time.perf_counter()
        if "config" in run or "activations" in run:
            rec = activations_run(run, rank) if "activations" in run else shapes_run(run, rank)
            rec["seconds"] = time.perf_counter() - t0
            with open(os.path.join(out_dir, f"{run['name']}_rank{rank}.json"), "w") as fh:
                json.dump(rec, fh, indent=1)
            continue
        cfg = parse_config(["--hf-checkpoint", run["hf"], "--actor-num-gpus-per-node", str(world), "--lr", "1e-3",
                            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--micro-batch-size", "1",
                            "--seed", "7", *run["flags"]])
        spec = spec_from_config(cfg)
        backend = make_backend(cfg.precision.train_backend)
        backend.initialize(cfg, spec)
        samples = make_samples(backend.vocab_size, n=4)
        fsdp = cfg.precision.train_backend == "fsdp"
        at_step: list = []
        if fsdp:
            model = backend.model
            backend.optimizer.register_step_pre_hook(lambda opt, args, kwargs: at_step.append(fsdp_grad_bytes(model)))
        needs_ref = cfg.algorithm.use_kl_loss or cfg.algorithm.kl_coef > 0
        if needs_ref:  # the loop's reference: a weight tag, swapped in for its pass (the actor's values kept aside)
            backend.snapshot_weights("ref")
        ref = backend.maybe_compute_ref_log_probs(samples, needs_ref)
        if cfg.algorithm.advantage_estimator == "ppo":
            ppo_epochs(backend, spec, samples, 1, True)
        else:
            old = backend.forward_only(samples)
            backend.train_step(TrainBatch(samples, spec.compute_advantages(samples), old_logprobs=old,
                                          ref_logprobs=ref))
        if fsdp:
            measured = {"actor": measure_fsdp(backend, max(at_step))}
        else:
            measured = {"actor": measure_megatron_role(backend.actor)}
            if backend.critic is not None:
                measured["critic"] = measure_megatron_role(backend.critic.role)
        if backend.weights.tags:
            measured["tags"] = {"tags": sum(backend.weights.nbytes(t) for t in backend.weights.tags),
                                "names": backend.weights.tags}
        rec = {"measured": measured, "estimate": estimate_for_rank(cfg, rank), "seconds": time.perf_counter() - t0}
        with open(os.path.join(out_dir, f"{run['name']}_rank{rank}.json"), "w") as fh:
            json.dump(rec, fh, indent=1)
        if not fsdp:
            destroy_parallel()
        del backend
