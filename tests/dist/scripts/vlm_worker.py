"""Worker: vision-language parity layouts in one launch (tests/dist/test_vlm_layouts.py).

argv: OUT_JSON HF_DIR then layouts ``name:tp,pp,sp,cp[,ep]``. Per layout, on every rank: the tiny Qwen2.5-VL loaded into
megatron-core (the HF vision tower replicated, the language model TP-sharded), wrapped in megatron's DDP, one
forward + backward of this DP rank's two packed THD micro-batches (images of several grids, one sample without
images; under CP the features written into the whole packed batch before the split) through megatron's schedule; rank 0 writes max |dlogit| vs HF transformers' own model, max |dgrad| vs HF autograd of
the same loss (mean over DP ranks, each with its own samples), the largest HF gradient, and whether every
TP rank holds the same vision-tower gradient.

A layout named ``*_backend_*`` runs the megatron backend instead (``MegatronBackend`` built from flags on the
checkpoint): rollout samples with images (tests/_vlm_samples.py) packed by the backend (dynamic batch sizes, each DP
rank its share, under CP the whole packed batch to every CP rank), their log-probs against HF's, then one GRPO
training step and the log-probs after it (compared across layouts by the test).
"""

import json
import time

import torch

from megatron_rl.models import get_bridge, vlm_parity
from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

# (text tokens, image grids (t, h, w) in patches): windowed and full-attention blocks, two images in a sample,
# a text-only sample beside them
SAMPLES = [(9, [(1, 4, 8)]), (5, [(1, 4, 4), (1, 8, 4)]), (12, [])]


def main(argv):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    out_path, hf_dir, layouts = argv[0], argv[1], argv[2:]
    hf = vlm_parity.load_hf_model(hf_dir)
    results = {}
    for entry in layouts:
        t0 = time.time()
        name, dims = entry.split(":")
        tp, pp, sp, cp, *more = (int(x) for x in dims.split(","))
        ep = more[0] if more else 1
        if "_backend_" in name:
            results[name] = backend_layout(hf, hf_dir, tp, pp, sp, cp, engine=name.startswith("q3vl_") and pp == 1)
            results[name]["seconds"] = round(time.time() - t0, 1)
            continue
        layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp == 1)
        dp = initialize_parallel(layout, seed=0)
        bridge = get_bridge(hf_dir)
        chunks = bridge.build_model(layout)
        bridge.load_hf_weights(chunks, hf_dir)
        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        model = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=False), module=chunks[0])]
        model[0].zero_grad_buffer()
        # two packed THD micro-batches per DP rank: two images + text only, then one image
        per_rank = [vlm_parity.random_samples(bridge, SAMPLES, seed=100 + r) for r in range(dp)]
        per_rank = [[samples[1:], samples[:1]] for samples in per_rank]
        dp_rank = ps.get_data_parallel_rank()
        logits = vlm_parity.megatron_run(model, per_rank[dp_rank], bridge.vocab_size, forward_only=False)
        hf.zero_grad()
        ref: list = []
        vlm_parity.hf_loss(hf, per_rank, bridge.image_token_id, logits_out=ref).backward()
        n = sum(len(mb) for mb in per_rank[0])
        mine = ref[dp_rank * n:(dp_rank + 1) * n]
        vs_hf = torch.tensor(max((a - b).abs().max().item() for a, b in zip(logits, mine)))
        torch.distributed.all_reduce(vs_hf, op=torch.distributed.ReduceOp.MAX)
        want = vlm_parity.hf_grads(hf, bridge.hf_param_shapes())
        got = vlm_parity.exported_grads(bridge, model)
        copies = [torch.zeros(1)]
        if chunks[0].pre_process:  # the tower lives on the first stage
            vision = torch.cat([p.main_grad.flatten() for p in chunks[0].vision.parameters()])
            copies = [torch.empty_like(vision) for _ in range(layout.tp)]
            torch.distributed.all_gather(copies, vision, group=ps.get_tensor_model_parallel_group())
        results[name] = {"dp": dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "ep": layout.ep,
                         "sp": layout.sequence_parallel,
                         "vs_hf": float(vs_hf),
                         "grad_max_abs_diff": vlm_parity.max_diff(got, want),
                         "grad_max_abs": max(g.abs().max().item() for g in want.values()),
                         "vision_grads_equal_across_tp": all(torch.equal(c, copies[0]) for c in copies),
                         "vision_tensors": sum(n.startswith(bridge.HF_VISION_PREFIX) for n in got),
                         "seconds": round(time.time() - t0, 1)}
        del model, chunks
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh)


def backend_layout(hf, hf_dir: str, tp: int, pp: int, sp: int, cp: int, engine: bool = False) -> dict:
    """The megatron backend at one layout on 2 ranks: HF's log-probs vs the backend's forward over samples with
    images, then one training step (the log-probs after it and its grad norm). ``engine``: then the trained weights
    synced into the embedded engine (every rank its own), which generates with the images; its log-probs against
    the backend's at the same tokens (``engine_vs_trainer``)."""
    from _vlm_samples import hf_logprobs, make_vl_backend, vl_samples
    from megatron_rl.backends.base import TrainBatch

    flags = ["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp)]
    backend, spec = make_vl_backend(hf_dir, *flags, *(["--sequence-parallel"] if sp else []))
    samples = vl_samples(hf_dir, seed=1)
    old = backend.forward(samples)
    vs_hf = max((a - hf_logprobs(hf, s, backend.bridge.image_token_id)).abs().max().item()
                for s, a in zip(samples, old))
    adv = spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=None)
    metrics = backend.train_step(TrainBatch(samples, adv, old))
    new = backend.forward(samples)
    out = {"dp": backend.dp_size, "cp": cp, "tp": tp, "pp": pp, "vs_hf": vs_hf, "grad_norm": metrics["train/grad_norm"],
           "after_step": [t.tolist() for t in new],
           "micro_batches": backend.plan_micro_batches(samples).num_micro_batches}
    if engine:
        from megatron_rl.data.types import GenerateRequest, SamplingParams
        from megatron_rl.rollout.embedded import EmbeddedEngine

        rollout = EmbeddedEngine(hf_dir)
        sent = [item for bucket in backend.export_weights(1 << 20) for item in bucket]
        rollout.update_weights(iter(sent), version=1)
        requests = [GenerateRequest(s.prompt_ids, group_index=k, multimodal_inputs=s.multimodal_inputs)
                    for k, s in enumerate(vl_samples(hf_dir, seed=4))]
        generated = rollout.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=7,
                                                              ignore_eos=True))
        trainer = backend.forward(generated)
        out["engine_vs_trainer"] = max((torch.tensor(s.rollout_logprobs) - t).abs().max().item()
                                       for s, t in zip(generated, trainer))
        out["synced_vision_tensors"] = sum(name.startswith(backend.bridge.HF_VISION_PREFIX) for name, _ in sent)
    return out
