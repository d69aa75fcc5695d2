"""Worker for tests/dist/test_routing_replay.py: MoE routing replay (--use-routing-replay) under several layouts.

Usage (under torchrun): routing_worker.py HF_DIR OUT_DIR LAYOUT [LAYOUT ...]
(LAYOUT: a comma list of extra flags, as backend_worker.py). Per layout, on a tiny qwen3_moe:

1. the old-log-prob pass records each sample's routes; every rank writes what it recorded
   (global layer number -> [tokens, topk]) for the samples it owns;
2. a training step replays them: the trainer's own router must agree everywhere (route_agreement 1);
3. the records are replaced by forced routes (every token to experts 0 and 1): a forward pass and a
   training step replay those; the log-probs, the step's metrics and, per expert, whether its weights
   got a gradient are recorded. Forced routes are layout-independent, so every layout must give the
   single process's numbers, and no expert other than 0 and 1 may get a gradient.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from backend_worker import make_samples  # noqa: E402  (the backend tests' batch: agentic masks included)
from fsdp_worker import flags_of  # noqa: E402  (the backend tests' flags)

FORCED = (0, 1)


def main():
    import torch.distributed as dist

    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    hf_dir, out_dir, layouts = sys.argv[1], sys.argv[2], sys.argv[3:]
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for layout in layouts:
        flags = [f for f in layout.split(",") if f]
        cfg = parse_config(flags_of(hf_dir, world, flags + ["--weight-decay=0", "--use-routing-replay"]))
        spec = PolicyGradientSpec(PolicyGradientConfig())  # PPO clip alone: no reference pass needed
        backend = MegatronBackend()
        backend.initialize(cfg, spec)
        replay = backend.routing
        samples = make_samples(backend.vocab_size)
        plan = backend.plan_rollout(samples, len(samples))
        rec = {}
        old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
        layer_of = {r.ordinal: int(r.router.layer_number) for r in replay.routers}
        mine = {}
        for i, s in enumerate(samples):
            routes = replay.records.get(id(s))
            if routes is not None and old[i] is not None:
                mine[i] = {layer_of[o]: routes[:, o].tolist() for o in range(routes.shape[1])}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        routes: dict = {}
        for part in gathered:
            for i, by_layer in part.items():
                for layer, r in by_layer.items():
                    have = routes.setdefault(str(i), {}).setdefault(str(layer), r)
                    assert have == r, f"two ranks recorded different routes for sample {i} layer {layer}"
        rec["routes"] = routes
        adv = spec.compute_advantages(samples)
        step = plan.steps[0][1]
        natural = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, plan=step))
        rec["natural_agreement"] = natural.get("train/route_agreement")
        for s in samples:  # force every token through experts 0 and 1 in every MoE layer
            routes_s = replay.records.get(id(s))
            if routes_s is not None:
                forced = torch.tensor(FORCED, dtype=routes_s.dtype).expand_as(routes_s).clone()
                replay.records[id(s)] = forced
        full = backend.forward_only(samples, plan=plan.forward)
        rec["forced_logprobs"] = [t.tolist() for t in full]
        old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, plan=step))
        rec["forced_metrics"] = {k: v for k, v in m.items() if k not in ("train/step_time_s",)}
        # which experts' weights got a gradient in the forced step (main_grad holds it until the next step)
        ep_rank = backend.ps.get_expert_model_parallel_rank()
        grads: dict = {}
        for chunk in backend.model:
            for name, p in chunk.named_parameters():
                if ".local_experts." not in name:
                    continue
                n_local = backend.model_config.num_moe_experts // backend.ps.get_expert_model_parallel_world_size()
                j = int(name.split(".local_experts.")[1].split(".")[0])
                expert = ep_rank * n_local + j
                g = getattr(p, "main_grad", None)
                got = bool(g is not None and g.abs().sum() > 0)
                grads[expert] = grads.get(expert, False) or got
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, grads)
        merged: dict = {}
        for part in every:
            for e, got in part.items():
                merged[str(e)] = merged.get(str(e), False) or got
        rec["expert_has_grad"] = merged
        results[layout or "base"] = rec
        destroy_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"results_w{world}.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
