"""Worker for tests/dist/test_routing_replay.py: MoE routing replay (--use-routing-replay) under several layouts.

Job ``routing`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR LAYOUT [LAYOUT ...]
(LAYOUT: a comma list of extra flags, as backend_worker.py). Per layout, on a tiny qwen3_moe:

1. the old-log-prob pass records each sample's routes; every rank writes what it recorded
   (global layer number -> [tokens, topk]) for the samples it owns;
2. a training step replays them: the trainer's own router must agree everywhere (route_agreement 1);
3. the records are replaced by forced routes (every token to experts 0 and 1): a forward pass and a
   training step replay those; the log-probs, the step's metrics and, per expert, whether its weights
   got a gradient are recorded. Forced routes are layout-independent, so every layout must give the
   single process's numbers, and no expert other than 0 and 1 may get a gradient;
4. R3 (--use-rollout-routing-replay's path): the samples carry routes as an engine returns them
   (``Sample.routed_experts`` over every MoE layer of the model, ``total_length - 1`` tokens): experts
   2 and 3 for every token; every pass replays those (no recording), so the forward, the step and the
   experts with gradients are again layout-independent.
"""

import json
import os

import numpy as np
import torch

from backend_worker import make_samples  # noqa: E402  (the backend tests' batch: agentic masks included)
from fsdp_worker import flags_of  # noqa: E402  (the backend tests' flags)

FORCED = (0, 1)
ENGINE = (2, 3)  # the R3 phase's engine routes


def expert_grads(backend) -> dict:
    """Which experts' weights got a gradient in the last step (main_grad holds it until the next step)."""
    import torch.distributed as dist

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
    return merged


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
        rec["expert_has_grad"] = expert_grads(backend)
        # 4. R3: the engine's routes, carried by the samples (every MoE layer, the last token excluded)
        from megatron_rl.backends.megatron.routing_replay import moe_pattern
        from megatron_rl.data.types import RoutedExperts

        pattern = moe_pattern(backend.model_config)
        for s in samples:
            engine = np.broadcast_to(np.array(ENGINE, np.uint8), (s.total_length - 1, sum(pattern), len(ENGINE)))
            s.routed_experts = RoutedExperts(engine.copy())
        replay.use_rollout_routes(pattern)
        rec["r3_logprobs"] = [t.tolist() for t in backend.forward_only(samples, plan=plan.forward)]
        old = backend.forward_only(samples, plan=plan.forward, owned_only=True)
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, plan=step))
        rec["r3_metrics"] = {k: v for k, v in m.items() if k not in ("train/step_time_s",)}
        rec["r3_expert_has_grad"] = expert_grads(backend)
        results[layout or "base"] = rec
        destroy_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, f"results_w{world}.json"), "w") as f:
            json.dump(results, f)

