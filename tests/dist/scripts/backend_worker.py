"""Worker for tests/dist/test_backend.py: train a few steps under several layouts.

Job ``backend`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR LAYOUT [LAYOUT ...]
LAYOUT is a comma list of extra flags, e.g. "--tensor-model-parallel-size=2".
For each layout it records: no-grad log-probs of a fixed batch, then per step the
loss metrics, grad norm and the exported HF weights after the step.
"""

import json
import os

import torch


def make_samples(vocab: int, n: int = 6, seed: int = 0):
    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        # every other sample carries an agentic trajectory's loss mask: a span of tool-observation tokens
        # (mask 0) inside the response, so every layout's packing, TP, CP and PP must drop exactly those
        mask = [1] * r if i % 2 or r < 3 else [1] + [0] * (r - 2) + [1]
        samples.append(Sample(group_index=i // 3, prompt_ids=ids[:p], response_ids=ids[p:],
                              reward=float(torch.rand(1, generator=g)),
                              rollout_logprobs=[-1.0] * r, loss_mask=mask))
    return samples


def ppo_epochs(backend, spec, samples, epochs: int, train_actor: bool):
    """One PPO step as the runner takes it (runner/step.py): old log-probs, the critic's values, the estimator's
    advantages and returns, then ``epochs`` train_steps on them (actor + critic, or the critic only).
    Returns (values, returns, each epoch's metrics without their wall times)."""
    from megatron_rl.backends.base import TrainBatch

    old = backend.forward_only(samples)
    values = backend.compute_values(samples)
    adv, returns = spec.compute_advantages_and_returns(samples, old_logprobs=old, values=values)
    metrics = []
    for _ in range(epochs):  # PPO epochs over the batch: the clip engages from the second one
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, old_values=values, returns=returns,
                                          train_actor=train_actor))
        m.pop("train/step_time_s", None)
        m.pop("critic/step_time_s", None)
        metrics.append(m)
    return values, returns, metrics


def mtp_after_training(backend, hf_dir, out_dir, layout):
    """--mtp-num-layers: after the training steps the full export (collective) still holds the checkpoint's MTP
    tensors bit for bit (frozen), its MTP copies of the embedding / head equal the trained main ones, and no MTP
    parameter has a gradient buffer; a training checkpoint saves and loads back the same export."""
    from safetensors.torch import load_file

    exported = {n: t.clone() for n, t in backend.bridge.export_hf_weights(backend.chunks)}
    ckpt = os.path.join(out_dir, "mtp_iter_0000003")
    backend.save(ckpt, {})
    with torch.no_grad():
        for c in backend.chunks:
            for p in c.parameters():
                p.add_(1.0)  # the load must put every value back (MTP layers included)
    backend.load(ckpt)
    reloaded = {n: t.clone() for n, t in backend.bridge.export_hf_weights(backend.chunks)}
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    layer = f"model.layers.{backend.bridge.num_layers}."
    own = [n for n in source if n.startswith(layer) and not n.endswith(("embed_tokens.weight", "shared_head.head.weight"))]
    if torch.distributed.get_rank() == 0:  # the MTP layer's own tensors after training (--enable-mtp-training compares)
        torch.save({n: exported[n] for n in own}, os.path.join(out_dir, f"{layout}_mtp.pt".replace("/", "_")))
    return {"names_equal": set(exported) == set(source), "own_tensors": len(own),
            "checkpoint_round_trip": all(torch.equal(reloaded[n], t) for n, t in exported.items()),
            "own_unchanged": all(torch.equal(exported[n], source[n]) for n in own),
            "copies_follow_main": torch.equal(exported[layer + "embed_tokens.weight"], exported["model.embed_tokens.weight"])
            and torch.equal(exported[layer + "shared_head.head.weight"], exported["lm_head.weight"]),
            "main_moved": not torch.equal(exported["model.embed_tokens.weight"], source["model.embed_tokens.weight"]),
            "mtp_grads": sum(getattr(p, "main_grad", None) is not None or p.requires_grad
                             for c in backend.chunks for n, p in c.named_parameters() if n.startswith("mtp."))}


def mtp_reference_loss(hf_dir, samples):
    """--enable-mtp-training's MTP loss of ``samples`` at the checkpoint's weights, from tests/_mtp_reference.py
    (transformers' modules): depth 0 at position t scores token t + 2; cross-entropy summed over the loss-masked
    response tokens, divided by their count."""
    from _mtp_reference import MtpReference

    ref = MtpReference(hf_dir)
    total, count = 0.0, 0
    for s in samples:
        seq = torch.tensor(s.prompt_ids + s.response_ids)
        logits = ref.logits(seq).double()
        p = len(s.prompt_ids)
        for j, m in enumerate(s.loss_mask):
            count += m != 0
            if m != 0 and p + j - 2 >= 0:
                row = logits[p + j - 2]
                total += float(m) * (torch.logsumexp(row, 0) - row[s.response_ids[j]]).item()
    return total / count


def main(argv):
    import torch.distributed as dist

    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    hf_dir, out_dir, layouts = argv[0], argv[1], argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for layout in layouts:
        flags = [f for f in layout.split(",") if f]
        dynamic = any(f.startswith("--max-tokens-per-gpu") for f in flags)
        argv = ["--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", str(world), "--lr", "1e-2",
                "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--grad-clip", "1.0",
                "--kl-loss-coef", "0.1", "--use-kl-loss", "--seed", "7", "--adam-eps", "1e-4"]
        argv += [] if dynamic else ["--micro-batch-size", "1"]
        argv += sum((f.split("=", 1) for f in flags), [])
        cfg = parse_config(argv)
        spec = PolicyGradientSpec(PolicyGradientConfig(kl_loss_coef=0.1, entropy_coef=0.01))
        backend = MegatronBackend()
        backend.initialize(cfg, spec)
        backend.snapshot_weights("ref")
        samples = make_samples(backend.vocab_size)
        # which passes ask the log-prob op for entropy (the forward-only ones must not: extra vocab pass)
        # and whether they come from the output projection fused into the op (ops/linear_logprob.py)
        asked, phase, projected = {"forward": set(), "train": set()}, ["forward"], set()

        def recording(extract, fused):
            def recording_extract(*args, with_entropy=True, **kwargs):
                asked[phase[0]].add(with_entropy)
                projected.add(fused)
                return extract(*args, with_entropy=with_entropy, **kwargs)
            return recording_extract

        spec.extract_model_output = recording(spec.extract_model_output, False)
        spec.extract_model_output_from_hidden = recording(spec.extract_model_output_from_hidden, True)
        rec = {"logprobs": [t.tolist() for t in backend.forward_only(samples)], "steps": []}
        if cfg.megatron.enable_mtp_training:
            rec["mtp_reference_loss"] = mtp_reference_loss(cfg.model.hf_checkpoint, samples)
        # the loop's path (runner/step.py): each DP rank computes and keeps the log-probs of the
        # samples it trains on; checked against the full gather of the same plan on every rank
        plan = backend.plan_rollout(samples, len(samples))
        owned = set(plan.steps[0][1].rank_samples(backend.dp_rank))
        rec["owned"] = {"rank": dist.get_rank(), "dp_rank": backend.dp_rank, "samples": sorted(owned),
                        "forward_plan_follows_steps": sorted(plan.forward.rank_samples(backend.dp_rank)) == sorted(owned)}
        full = backend.forward_only(samples, plan=plan.forward)
        mine = backend.forward_only(samples, plan=plan.forward, owned_only=True)
        rec["owned"]["bitwise_equal_to_full_gather"] = all(
            (t is not None and torch.equal(t, f)) if i in owned else t is None
            for i, (t, f) in enumerate(zip(mine, full)))
        owned_checks = [None] * dist.get_world_size()
        dist.all_gather_object(owned_checks, rec["owned"])
        rec["owned"] = owned_checks
        groups = "--offload-train-groups" in layout
        if groups:
            rec["groups"] = []
        for step in range(3):
            if groups:  # as the loop does around a generation (runner/colocation.py)
                cycle = {"destroyed": backend.release_comm_groups()}
                try:
                    ps = backend.ps
                    dist.all_reduce(torch.ones(1), group=ps.get_tensor_model_parallel_group())
                    cycle["error"] = None
                except RuntimeError as e:
                    cycle["error"] = str(e)
                dist.barrier()
                cycle["rebuilt"] = backend.restore_comm_groups()
                rec["groups"].append(cycle)
            old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
            ref = backend.maybe_compute_ref_log_probs(samples, True, plan=plan.forward, owned_only=True)
            adv = spec.compute_advantages(samples)
            phase[0] = "train"
            m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, ref_logprobs=ref))
            phase[0] = "forward"
            weights = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
            if step == 0:  # per-stage export: this rank's stage's tensors, bit for bit the whole export's
                scope = backend.export_scope()
                mine = {n: t.clone() for bucket in backend.export_weights(1 << 20, stage_only=True) for n, t in bucket}
                names = [None] * dist.get_world_size()
                equal = all(torch.equal(t, weights[n]) for n, t in mine.items())
                dist.all_gather_object(names, (scope.stage, sorted(mine), equal))
                equal = all(e for _, _, e in names)
                names = [(stage, ns) for stage, ns, _ in names]
                by_stage = {}
                for stage, ns in names:
                    by_stage.setdefault(stage, ns)
                rec["stage_export"] = {
                    "stages": scope.stages, "sources": list(scope.sources),
                    "equal": equal,
                    "same_within_stage": all(ns == by_stage[stage] for stage, ns in names),
                    "partition": sorted(n for ns in by_stage.values() for n in ns) == sorted(weights)}
            rec["steps"].append({"metrics": m})
            if dist.get_rank() == 0:
                torch.save(weights, os.path.join(out_dir, f"{layout or 'base'}_step{step}.pt".replace("/", "_")))
        if cfg.megatron.mtp_num_layers:
            rec["mtp"] = mtp_after_training(backend, cfg.model.hf_checkpoint, out_dir, layout)
        rec["entropy_asked"] = {k: sorted(v) for k, v in asked.items()}
        rec["projected"] = sorted(projected)
        results[layout or "base"] = rec
        destroy_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"results_w{world}.json"), "w") as f:
            json.dump(results, f)

