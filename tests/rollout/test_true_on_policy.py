"""--true-on-policy-mode end to end in one process: the embedded engine's rollout log-probs are the megatron
trainer's old log-probs bit for bit, every token, with the engine's batch (group size 3, chunks of 4 rows,
left-padded prompts, KV-cache decode) unlike the trainer's (packed THD micro-batches of 3 for the old
log-probs, of 4 and 2 for the train step); the first train step's ratio is exactly 1 and its mismatch metrics
exactly 0 (docs/on-policy.md)."""

import dataclasses

import pytest
import torch

from megatron_rl.data.packing import plan_fixed_micro_batches
from megatron_rl.rollout.base import GenerateRequest, SamplingParams


def _differing(old, samples) -> tuple[int, float]:
    diffs = [(o - torch.tensor(s.rollout_logprobs, dtype=torch.float32)).abs() for o, s in zip(old, samples)]
    return sum(int((d != 0).sum()) for d in diffs), max(float(d.max()) for d in diffs)


def test_rollout_logprobs_equal_the_trainers_old_logprobs_bitwise(tmp_path, tiny_hf_models, tp1_world):
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.rollout.embedded import EmbeddedEngine

    path = tiny_hf_models("qwen3")
    cfg = parse_config(["--hf-checkpoint", path, "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                        "--micro-batch-size", "3", "--lr", "1e-3", "--true-on-policy-mode",
                        "--output-dir", str(tmp_path)])
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)

    engine = EmbeddedEngine.from_config(cfg)
    assert engine.batch_invariant
    engine.max_batch_size = 4  # two chunks: 4 rows, then 2
    g = torch.Generator().manual_seed(0)
    requests = [GenerateRequest(prompt_ids=torch.randint(0, 100, (n,), generator=g).tolist(), group_index=i)
                for i, n in enumerate((5, 9))]
    samples = engine.generate(requests, SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=1))
    assert sum(s.response_length for s in samples) == 36

    old = backend.forward_only(samples)
    assert _differing(old, samples) == (0, 0.0)

    advantages = spec.compute_advantages(samples, old_logprobs=old)
    train_plan = plan_fixed_micro_batches(6, dp_size=1, micro_batch_size=4, ragged=True)  # not the forward's 3
    metrics = backend.train_step(TrainBatch(samples, advantages, old_logprobs=old, plan=train_plan))
    assert metrics["train/mismatch_logprob_diff_frac"] == 0.0
    assert metrics["train/mismatch_abs_logprob_max"] == 0.0
    assert metrics["train/mismatch_k3_kl"] == 0.0
    assert metrics["train/ratio"] == 1.0 and metrics["train/ratio_abs_dev"] == 0.0  # the first minibatch's ratio
    assert metrics["train/ppo_kl"] == 0.0

    # the same trainer without the mode computes other last bits for most tokens: the check above is not vacuous
    backend.cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, true_on_policy_mode=False))
    count, largest = _differing(backend.forward_only(samples), samples)
    assert count > 0 and 0 < largest < 1e-4


# (group size, engine chunk rows, forward micro-batch, train micro-batch) of each step
STEPS = ((3, 4, 3, 4), (2, 3, 1, 3))


@pytest.mark.parametrize("family,experts,steps", [
    ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3), STEPS),
    ("mixtral", dict(num_local_experts=5, num_experts_per_tok=3), STEPS[:1]),  # its router and experts: one step
])
def test_moe_with_rollout_routing_replay_is_bitwise_over_steps(tmp_path, tiny_hf_models, tp1_world, family, experts,
                                                               steps):
    """A MoE model (top-3: a combine of three addends, a renormalised weight sum of three) with the engine's
    experts replayed in the trainer (R3): qwen3_moe two steps, each a rollout, the old log-probs, a train step and
    the weight sync into the engine (mixtral the first); the group size, the engine's chunk rows and the
    trainer's forward and train micro-batches differ between the steps and from each other; the second step's
    rollout comes over SGLang's protocol from the engine served as ``--embedded-engine-ranks process`` serves it
    (log-probs and routes through JSON). Every token bitwise, every step."""
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.rollout.embedded_server import EmbeddedServer
    from megatron_rl.rollout.routes import RouteLayout
    from megatron_rl.rollout.sglang.engine import SGLangEngine

    path = tiny_hf_models(family, **experts)
    cfg = parse_config(["--hf-checkpoint", path, "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                        "--micro-batch-size", "3", "--lr", "1e-2", "--true-on-policy-mode",
                        "--use-rollout-routing-replay", "--output-dir", str(tmp_path)])
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    engine = EmbeddedEngine.from_config(cfg)
    assert engine.batch_invariant and engine.route_capture is not None

    g = torch.Generator().manual_seed(1)
    for step, (n, rows, forward_mbs, train_mbs) in enumerate(steps, start=1):
        engine.max_batch_size = rows
        requests = [GenerateRequest(prompt_ids=torch.randint(0, 100, (k,), generator=g).tolist(), group_index=i)
                    for i, k in enumerate((4, 11))]
        sampling = SamplingParams(max_new_tokens=4, temperature=1.0, n=n, seed=step)
        if step == 1:
            samples = engine.generate(requests, sampling)
        else:  # the same engine (its weights synced) behind the embedded server, read by the SGLang client
            server = EmbeddedServer(engine, model_path=path).start()
            client = SGLangEngine([server.url], releases_memory=False, health_interval_s=0,
                                  route_layout=RouteLayout.of_checkpoint(path))
            try:
                samples = client.generate(requests, sampling)
            finally:
                client.close()
                server.stop()
        assert all(s.routed_experts is not None for s in samples)
        forward_plan = plan_fixed_micro_batches(len(samples), dp_size=1, micro_batch_size=forward_mbs, ragged=True)
        old = backend.forward_only(samples, forward_plan)
        assert _differing(old, samples) == (0, 0.0), f"step {step}"

        advantages = spec.compute_advantages(samples, old_logprobs=old)
        train_plan = plan_fixed_micro_batches(len(samples), dp_size=1, micro_batch_size=train_mbs, ragged=True)
        metrics = backend.train_step(TrainBatch(samples, advantages, old_logprobs=old, plan=train_plan))
        assert metrics["train/mismatch_logprob_diff_frac"] == 0.0 and metrics["train/mismatch_k3_kl"] == 0.0
        assert metrics["train/ratio"] == 1.0 and metrics["train/ratio_abs_dev"] == 0.0
        assert metrics["train/route_agreement"] == 1.0  # the trainer's own router picks the engine's experts
        engine.update_weights([(name, t) for bucket in backend.export_weights(1 << 40) for name, t in bucket],
                              version=step)
