"""Worker for tests/dist/test_fsdp_critic.py: PPO's critic on an FSDPBackend (and, to compare, a MegatronBackend).

Job ``fsdp_critic`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR JOB_JSON [JOB_JSON ...]

Each job (run in order in this process; a megatron job's parallel state is torn down after it):

  tag      output name
  backend  "fsdp" (default) or "megatron"
  flags    extra CLI flags
  load     checkpoint dir to load after building (optional)
  steps    a list of booleans, one per step: train the actor too (False: critic only)
  save     checkpoint dir to save after the steps (optional)
  hf       the actor's --hf-checkpoint (default HF_DIR)
  refuse   [DIR_NO_CRITIC, DIR_CRITIC]: instead of steps, save a checkpoint of a run without a critic into the first
           dir, then record the errors of loading it into this (ppo) run and of loading the second (a critic's
           checkpoint) into a run without a critic

One step is what the runner does (runner/step.py): old log-probs, the critic's values, the ppo estimator's
advantages and returns, then EPOCHS train_steps on them (actor + critic, or the critic only); the batch of step g
is make_samples(vocab, seed=100 + g). The flags are tests/dist/scripts/critic_worker.py's (the megatron critic
test), so the two backends' critics are compared on the same model, batch and hyper-parameters.

OUT_DIR/{tag}.json (rank 0): per step the values of every sample, each epoch's metrics, whether every actor
parameter (this rank's shard) and the actor's step count stayed the same on every rank; the values of fixed samples
at the start and the end; the critic's step count and LR; the value head's initial weight; (megatron) the critic's
init_method_std. OUT_DIR/{tag}_critic_opt_rank{r}.pt: every rank's critic optimizer state (fsdp).
"""

import json
import os

import torch

EPOCHS = 2  # optimizer steps per batch (--num-steps-per-rollout-updates): the value clip engages in the second


def base_flags(hf_dir: str, world: int) -> list[str]:
    """critic_worker.py's flags (keep in step with it) without the critic's: a run without one."""
    return ["--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", str(world), "--lr", "1e-2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--grad-clip", "1.0", "--seed", "7",
            "--adam-eps", "1e-4", "--micro-batch-size", "1", "--num-rollout", "10", "--normalize-advantages",
            "--weight-decay", "0.1"]


def critic_flags(hf_dir: str, world: int) -> list[str]:
    """critic_worker.py's flags."""
    return base_flags(hf_dir, world) + [
        "--critic-lr", "5e-3", "--critic-lr-warmup-iters", "1", "--advantage-estimator", "ppo", "--gamma", "0.9",
        "--lambd", "0.8", "--value-clip", "0.1"]


def _build(name: str, argv: list[str]):
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config

    cfg = parse_config(argv + ["--train-backend", name])
    spec = spec_from_config(cfg)
    backend = make_backend(name)
    backend.initialize(cfg, spec)
    return backend, spec


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _critic_frozen(backend, name: str) -> list[torch.Tensor]:
    """The critic's frozen parameters (its trunk under --lora-rank; none otherwise), this rank's shards."""
    params = (backend.critic.model.parameters() if name == "fsdp"
              else (p for c in backend.critic.chunks for p in c.parameters()))
    return [_local(p) for p in params if not p.requires_grad]


def _actor_params(backend, name: str) -> list[torch.Tensor]:
    params = backend.model.parameters() if name == "fsdp" else (p for c in backend.chunks for p in c.parameters())
    return [_local(p).clone() for p in params]


def _head_weight(backend, name: str) -> list[float]:
    if name == "fsdp":
        w = backend.critic.model.value_head.weight
        return (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().float().reshape(-1).tolist()
    return backend.critic.chunks[0].output_layer.weight.detach().float().reshape(-1).tolist()


def _optimizer_dump(optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shard of every parameter and its optimizer state (plain tensors, to compare bitwise)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = {"param": _local(p).clone()}
            entry.update({k: (_local(v).clone() if torch.is_tensor(v) else v)
                          for k, v in optimizer.state.get(p, {}).items()})
            out.append(entry)
    return {"tensors": out, "num_states": len(optimizer.state)}


def _refusals(hf_dir: str, world: int, dirs: list[str], backend) -> dict:
    """The two resumes that mismatch the critic, each refused by name (CheckpointError's message)."""
    from megatron_rl.errors import CheckpointError

    no_critic_dir, critic_dir = dirs
    plain, _ = _build("fsdp", base_flags(hf_dir, world))  # grpo: no critic
    plain.save(no_critic_dir, {"rollout_id": 0})
    errors = {}
    for key, target, path in (("ppo_from_no_critic", backend, no_critic_dir),
                              ("plain_from_critic", plain, critic_dir)):
        try:
            target.load(path)
            errors[key] = None
        except CheckpointError as e:
            errors[key] = str(e)
    return errors


def run_job(hf_dir, out_dir, job):
    import torch.distributed as dist

    from backend_worker import make_samples, ppo_epochs

    world = int(os.environ["WORLD_SIZE"])
    name = job.get("backend", "fsdp")
    backend, spec = _build(name, critic_flags(job.get("hf", hf_dir), world) + job.get("flags", []))
    rank = dist.get_rank()
    rec = {"steps": [], "head_weight": _head_weight(backend, name)}
    if name == "megatron":
        rec["init_method_std"] = float(backend.critic.config.init_method_std)
    if job.get("load"):
        backend.load(job["load"])
    fixed = make_samples(backend.vocab_size, seed=999)
    rec["values_start"] = [t.tolist() for t in backend.compute_values(fixed)]
    rec["logprobs_start"] = [t.tolist() for t in backend.forward_only(fixed)]
    for train_actor in job.get("steps", []):
        g = backend.critic.optimizer_steps // EPOCHS
        samples = make_samples(backend.vocab_size, seed=100 + g)
        before, actor_steps = _actor_params(backend, name), backend.optimizer_steps
        frozen = _critic_frozen(backend, name)
        frozen_before = [p.clone() for p in frozen]
        values, _, epochs = ppo_epochs(backend, spec, samples, EPOCHS, train_actor)
        after = _actor_params(backend, name)
        same = torch.tensor([float(backend.optimizer_steps == actor_steps
                                   and all(torch.equal(a, b) for a, b in zip(before, after))),
                             float(all(torch.equal(a, b) for a, b in zip(frozen_before, frozen)))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        rec["steps"].append({"global_step": g, "train_actor": train_actor, "metrics": epochs,
                             "values": [t.tolist() for t in values], "actor_unchanged": bool(same[0].item()),
                             "critic_frozen_params": len(frozen), "critic_frozen_unchanged": bool(same[1].item())})
    if job.get("save"):
        backend.save(job["save"], {"next_step": backend.critic.optimizer_steps})
    if job.get("refuse"):
        rec["refusals"] = _refusals(hf_dir, world, job["refuse"], backend)
    rec["critic_steps"] = backend.critic.optimizer_steps
    rec["critic_lr"] = backend.critic.optimizer.param_groups[0]["lr"]
    rec["values_end"] = [t.tolist() for t in backend.compute_values(fixed)]
    rec["logprobs_end"] = [t.tolist() for t in backend.forward_only(fixed)]
    if name == "fsdp":
        torch.save(_optimizer_dump(backend.critic.optimizer),
                   os.path.join(out_dir, f"{job['tag']}_critic_opt_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, f"{job['tag']}.json"), "w") as f:
            json.dump(rec, f)
    if name == "megatron":
        from megatron_rl.models.parallel import destroy_parallel

        destroy_parallel()


def main(argv):
    hf_dir, out_dir, jobs = argv[0], argv[1], [json.loads(j) for j in argv[2:]]
    for job in jobs:
        run_job(hf_dir, out_dir, job)

