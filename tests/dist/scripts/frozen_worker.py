"""Worker for tests/dist/test_frozen_weights.py: --ref-load / --opd-teacher-load tags under TP2.

Job ``frozen`` of tests/dist/harness.py: argv = ACTOR_HF REF_HF TEACHER_DIST OUT.json, or
--init HF MODEL_DIST|- OUT.json (--load of a model-only dir: initial weights; "-": no --load, start from HF), or
--roles ACTOR_HF TEACHER_HF CRITIC_HF LAYOUT OUT.json (models by role: a larger teacher and a smaller critic, each
a model of its own beside the actor, at the actor's layout or their own; LAYOUT: one, tp2, cp2_own).
"""

import json
import os



def main(argv):
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config

    world = os.environ["WORLD_SIZE"]
    if argv[0] == "--init":
        return init_from_model_dir(*argv[1:4])
    if argv[0] == "--roles":
        return roles(*argv[1:6])
    actor, ref, teacher, out = argv[:4]
    cfg = parse_config(["--hf-checkpoint", actor, "--actor-num-gpus-per-node", world,
                        "--tensor-model-parallel-size", world, "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "3", "--micro-batch-size", "1"])
    backend = MegatronBackend()
    backend.initialize(cfg, PolicyGradientSpec(PolicyGradientConfig()))
    backend.load_frozen_weights("ref", ref)
    backend.load_frozen_weights("teacher", teacher)
    samples = make_samples(backend.vocab_size)
    result = {"actor": backend.forward_only(samples),
              "ref": backend.maybe_compute_ref_log_probs(samples, True),
              "teacher": backend.maybe_compute_teacher_log_probs(samples, True),
              "actor_again": backend.forward_only(samples)}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({k: [t.tolist() for t in v] for k, v in result.items()}, fh)


def init_from_model_dir(actor, model_dist, out):
    """--hf-checkpoint ACTOR --load MODEL_DIST: the live weights are MODEL_DIST's, and training
    from them works (the optimizer's master weights were made from them)."""
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config

    world = os.environ["WORLD_SIZE"]
    load = ["--load", model_dist] if model_dist != "-" else []
    cfg = parse_config(["--hf-checkpoint", actor, *load, "--actor-num-gpus-per-node", world,
                        "--tensor-model-parallel-size", world, "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "3", "--micro-batch-size", "1", "--bf16", "--lr", "1e-3"])
    backend = MegatronBackend()
    backend.initialize(cfg, PolicyGradientSpec(PolicyGradientConfig()))
    samples = make_samples(backend.vocab_size)
    before = backend.forward_only(samples)
    import torch

    advantages = [torch.full((len(s.response_ids),), 1.0 if i % 2 else -1.0) for i, s in enumerate(samples)]
    metrics = backend.train_step(TrainBatch(samples, advantages, before, None, None))
    after = backend.forward_only(samples)
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"before": [t.tolist() for t in before], "after": [t.tolist() for t in after],
                       "metrics": metrics}, fh)



# --roles LAYOUT: the actor's flags; the teacher takes the actor's TP/PP without CP (cp2_own: its own layout, DP2)
# and the critic its own TP2 beside an actor at CP2 (two roles at two layouts other than the actor's, interleaved)
ROLE_LAYOUTS = {"one": [], "tp2": ["--tensor-model-parallel-size", "2"],
                "cp2_own": ["--context-parallel-size", "2", "--critic-tensor-model-parallel-size", "2"]}


def roles(actor, teacher, critic, layout, out):
    """A teacher larger than the actor and a critic smaller than it, each its own model: the teacher's log-probs,
    the critic's values, one ppo step with the OPD term (its reverse KL at step 0), then both again (the step moved
    the critic, never the teacher)."""
    import torch
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config

    world = os.environ["WORLD_SIZE"]
    cfg = parse_config(["--hf-checkpoint", actor, "--actor-num-gpus-per-node", world, *ROLE_LAYOUTS[layout],
                        "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--micro-batch-size", "1",
                        "--global-batch-size", "6", "--advantage-estimator", "ppo", "--critic-hf-checkpoint", critic,
                        "--opd-teacher-load", teacher, "--opd-kl-coef", "0.5", "--lr", "1e-3", "--critic-lr", "1e-2"])
    backend = MegatronBackend()
    backend.initialize(cfg, spec_from_config(cfg))
    backend.load_frozen_weights("teacher", teacher)
    groups = {"actor": role_groups(backend.actor), "teacher": role_groups(backend.frozen_roles["teacher"].role),
              "critic": role_groups(backend.critic.role)}
    samples = make_samples(backend.vocab_size)
    teacher_lp = backend.maybe_compute_teacher_log_probs(samples, True)
    old = backend.forward_only(samples)
    values = backend.compute_values(samples)
    returns = [torch.ones_like(v) for v in values]
    advantages = [torch.zeros_like(v) for v in values]
    metrics = backend.train_step(TrainBatch(samples, advantages, old, None, teacher_lp, old_values=values,
                                            returns=returns))
    record = {"teacher": teacher_lp, "actor": old, "values": values,
              "teacher_again": backend.maybe_compute_teacher_log_probs(samples, True),
              "values_again": backend.compute_values(samples)}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({**{k: [t.tolist() for t in v] for k, v in record.items()}, "metrics": metrics,
                       "own_models": sorted(backend.frozen_roles), "tags": backend.weights.tags, "groups": groups,
                       "critic_hidden": int(backend.critic.config.hidden_size),
                       "init_method_std": float(backend.critic.config.init_method_std)}, fh)


def role_groups(role):
    """Which groups a role's modules, DDP and optimizer hold (taken outside any swap, with the actor's parallel_state
    current): the sizes of its collection's groups, and whether each module's group is the collection's own."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models.weights import unwrap

    pg, chunk = role.pg, unwrap(role.chunks[0])
    layer = chunk.decoder.layers[0]
    attention = layer.self_attention
    held = {"linear_qkv": attention.linear_qkv.tp_group is pg.tp, "linear_proj": attention.linear_proj.tp_group is pg.tp,
            "linear_fc1": layer.mlp.linear_fc1.tp_group is pg.tp, "block_pp": chunk.decoder.pg_collection.pp is pg.pp,
            "core_attention_cp": attention.core_attention.cp_group is pg.cp}
    if chunk.pre_process:
        held["embedding"] = chunk.embedding.word_embeddings.tp_group is pg.tp
    if chunk.post_process:
        held["output_layer"] = chunk.output_layer.tp_group is pg.tp  # the policy's output layer, or the value head
    if role.optimizer is not None:
        held["ddp_dp_cp"] = all(m.dp_cp_group is pg.dp_cp and m.tp_group is pg.tp for m in role.model)
        held["optimizer_tp"] = all(o.tp_group is pg.tp for o in getattr(role.optimizer, "chained_optimizers",
                                                                         [role.optimizer]))
    return {"tp": pg.tp.size(), "pp": pg.pp.size(), "cp": pg.cp.size(), "dp": pg.dp.size(),
            "attention_tp": attention.linear_qkv.tp_group.size(), "held": held,
            "globals_tp": ps.get_tensor_model_parallel_world_size(), "globals_cp": ps.get_context_parallel_world_size()}
