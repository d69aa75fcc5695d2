"""Worker for tests/dist/test_critic.py: PPO's critic on a MegatronBackend (``--advantage-estimator ppo``).

Job ``critic`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR JOB_JSON [JOB_JSON ...]

Each job (run in order in this process; parallel state torn down between jobs):

  tag     output name
  flags   extra CLI flags (the layout)
  load    checkpoint dir to load after building (optional)
  steps   a list of booleans, one per step: train the actor too (False: critic only)
  save    checkpoint dir to save after the steps (optional)
  hf      the actor's --hf-checkpoint (default HF_DIR)
  convert [HF, DIR]: convert_ckpt.py hf-to-dist of HF into DIR first (for --critic-load DIR)
  epochs  train_steps per batch (default EPOCHS)

One step is what the runner does (runner/step.py): old log-probs, the critic's values, the ppo estimator's
advantages and returns, then EPOCHS train_steps on them (actor + critic, or the critic only). The batch of
step g is make_samples(vocab, seed=100 + g).

OUT_DIR/{tag}.json (rank 0): per step the values of every sample, each epoch's metrics, whether every actor
parameter stayed bitwise the same; the values of fixed samples at the start and the end; the critic's step
count and LR. OUT_DIR/{tag}_critic_opt_rank{r}.pt: every rank's critic optimizer state.
"""

import json
import os

import torch

EPOCHS = 2  # optimizer steps per batch, with the batch's old values and returns (--num-steps-per-rollout-updates)


def run_job(hf_dir, out_dir, job):
    import torch.distributed as dist

    from backend_worker import make_samples, ppo_epochs
    from ckpt_worker import optimizer_dump
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    world = int(os.environ["WORLD_SIZE"])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if job.get("convert"):
        from megatron_rl.convert.hf_to_dist import convert_hf_to_dist

        convert_hf_to_dist(*job["convert"], show_progress=False)
    argv = ["--hf-checkpoint", job.get("hf", hf_dir), "--actor-num-gpus-per-node", str(world), "--lr", "1e-2",
            "--critic-lr", "5e-3", "--critic-lr-warmup-iters", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "3", "--grad-clip", "1.0", "--seed", "7", "--adam-eps", "1e-4",
            "--micro-batch-size", "1", "--num-rollout", "10", "--advantage-estimator", "ppo", "--gamma", "0.9",
            "--lambd", "0.8", "--value-clip", "0.1", "--normalize-advantages", "--weight-decay", "0.1",
            *job.get("flags", [])]
    cfg = parse_config(argv)
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    rec = {"steps": []}
    if job.get("load"):
        backend.load(job["load"])
    fixed = make_samples(backend.vocab_size, seed=999)
    rec["values_start"] = [t.tolist() for t in backend.compute_values(fixed)]
    rec["logprobs_start"] = [t.tolist() for t in backend.forward_only(fixed)]
    for train_actor in job.get("steps", []):
        epochs_per_batch = job.get("epochs", EPOCHS)
        g = backend.critic.optimizer_steps // epochs_per_batch
        samples = make_samples(backend.vocab_size, seed=100 + g)
        before = [p.detach().clone() for c in backend.chunks for p in c.parameters()]
        frozen = [p for c in backend.critic.chunks for p in c.parameters() if not p.requires_grad]
        frozen_before = [p.detach().clone() for p in frozen]
        values, returns, epochs = ppo_epochs(backend, spec, samples, epochs_per_batch, train_actor)
        after = [p.detach() for c in backend.chunks for p in c.parameters()]
        same = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(before, after))),
                             float(all(torch.equal(a, b.detach()) for a, b in zip(frozen_before, frozen)))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        rec["steps"].append({"global_step": g, "train_actor": train_actor, "metrics": epochs,
                             "values": [t.tolist() for t in values], "returns": [t.tolist() for t in returns],
                             "actor_unchanged": bool(same[0].item()), "critic_frozen_unchanged": bool(same[1].item()),
                             "critic_frozen_params": len(frozen)})
    if job.get("save"):
        backend.save(job["save"], {"next_step": backend.critic.optimizer_steps})
    rec["critic_steps"] = backend.critic.optimizer_steps
    rec["critic_lr"] = backend.critic.optimizer.param_groups[0]["lr"]
    rec["values_end"] = [t.tolist() for t in backend.compute_values(fixed)]
    rec["logprobs_end"] = [t.tolist() for t in backend.forward_only(fixed)]
    torch.save(optimizer_dump(backend.critic.optimizer), os.path.join(out_dir, f"{job['tag']}_critic_opt_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, f"{job['tag']}.json"), "w") as f:
            json.dump(rec, f)
    destroy_parallel()


def main(argv):
    hf_dir, out_dir, jobs = argv[0], argv[1], [json.loads(j) for j in argv[2:]]
    for job in jobs:
        run_job(hf_dir, out_dir, job)

