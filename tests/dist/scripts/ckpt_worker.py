"""Worker for tests/dist/test_checkpoint_resume.py: train / save / load a MegatronBackend.

Job ``ckpt`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR JOB_JSON [JOB_JSON ...]

Each job is a JSON object run in order in this process (parallel state is torn
down between jobs, as in backend_worker.py):

  tag     name used for the output files
  flags   extra CLI flags, e.g. ["--tensor-model-parallel-size", "2"]
  load    checkpoint dir to load after building (optional)
  steps   optimizer steps to run (after the load)
  save    checkpoint dir to save after the steps (optional)
  refuse  checkpoint dirs whose load must raise CheckpointError (messages recorded)
  poison  a parameter-name substring: after the steps, global rank 0 sets element 0 of that
          parameter to +inf (so the save holds a non-finite weight on one rank's shard only)
  resume  a list of flag lists: each runs Resumer.resume_or_init with the base flags plus
          these (e.g. ["--save", ROOT] or ["--load", ROOT/iter_N]); every rank's outcome and
          the warnings logged are recorded

The batch of global step g is make_samples(vocab, seed=100 + g), so a resumed run
sees the same data as an uninterrupted one. Each step also draws from every RNG
(python, numpy, torch, megatron's tracker) as a data pipeline would, so the final
``rng_probe`` only matches an uninterrupted run if the RNG states were restored.

Outputs: OUT_DIR/{tag}.json (rank 0: metrics, log-probs, extra state, probe),
OUT_DIR/{tag}_weights.pt (rank 0: exported HF weights),
OUT_DIR/{tag}_opt_rank{r}.pt (every rank: its optimizer state in param order).
"""

import contextlib
import json
import os
import random

import numpy as np
import torch



def draw_rng():
    from megatron.core import tensor_parallel

    vals = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    with tensor_parallel.get_cuda_rng_tracker().fork():
        vals.append(torch.rand(1).item())
    return vals


def optimizer_dump(optimizer):
    out = []
    steps_ids = set()
    n_states = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p, {})
                entry = {"param": p.detach().clone()}
                entry.update({k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()})
                out.append(entry)
                if "step" in st:
                    steps_ids.add(id(st["step"]))
                    n_states += 1
    return {"tensors": out, "distinct_step_tensors": len(steps_ids), "num_states": n_states}


@contextlib.contextmanager
def warnings_logged():
    """The messages megatron_rl logs at WARNING and above inside the block (a list, filled as they come)."""
    import logging

    seen = []

    class _Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = _Keep(level=logging.WARNING)
    logging.getLogger("megatron_rl").addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger("megatron_rl").removeHandler(handler)


def resume_outcome(argv, flags, backend, rank, world):
    """Resumer.resume_or_init under ``argv + flags``: {"step" | "error", "warnings"} of every rank."""
    import torch.distributed as dist

    from megatron_rl.config import parse_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.runner.checkpoints import CheckpointCursor
    from megatron_rl.runner.resume import Resumer

    with warnings_logged() as seen:
        try:
            resumer = Resumer(parse_config(argv + flags), CheckpointCursor())
            out = {"step": resumer.resume_or_init(backend, None), "optimizer_steps": backend.optimizer_steps}
        except CheckpointError as e:
            out = {"error": str(e), "class": type(e).__name__}
    out["warnings"] = seen
    every = [None] * world
    dist.all_gather_object(every, out)
    return every


def run_job(hf_dir, out_dir, job):
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.errors import CheckpointError
    from megatron_rl.models.parallel import destroy_parallel

    world = int(os.environ["WORLD_SIZE"])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    argv = ["--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", str(world), "--lr", "1e-2",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--grad-clip", "1.0",
            "--kl-loss-coef", "0.1", "--use-kl-loss", "--seed", "7", "--adam-eps", "1e-4",
            "--micro-batch-size", "1", "--num-rollout", "10", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--weight-decay", "0.1", *job.get("flags", [])]
    cfg = parse_config(argv)
    spec = PolicyGradientSpec(PolicyGradientConfig(kl_loss_coef=0.1, entropy_coef=0.01))
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    np.random.seed(1234)  # initialize_parallel seeds python/torch/megatron; a data pipeline seeds numpy
    backend.snapshot_weights("ref")
    rec = {"refusals": {}, "steps": []}
    for bad in job.get("refuse", []):
        try:
            backend.load(bad)
        except CheckpointError as e:
            rec["refusals"][bad] = str(e)
        else:
            rec["refusals"][bad] = None
    rec["resume"] = [resume_outcome(argv, flags, backend, rank, world) for flags in job.get("resume", [])]
    with warnings_logged() as rec["load_warnings"]:
        rec["extra_state"] = backend.load(job["load"]) if job.get("load") else None
    rec["start_step"] = backend.optimizer_steps
    fixed = make_samples(backend.vocab_size, seed=999)
    rec["logprobs_start"] = [t.tolist() for t in backend.forward_only(fixed)]
    for _ in range(job.get("steps", 0)):
        g = backend.optimizer_steps
        samples = make_samples(backend.vocab_size, seed=100 + g)
        draw_rng()  # a data pipeline's use of the RNGs
        old = backend.forward_only(samples)
        ref = backend.maybe_compute_ref_log_probs(samples, True)
        adv = spec.compute_advantages(samples)
        m = backend.train_step(TrainBatch(samples, adv, old_logprobs=old, ref_logprobs=ref))
        m.pop("train/step_time_s", None)
        rec["steps"].append({"global_step": g, "metrics": m})
    if job.get("poison"):
        with torch.no_grad():
            name, param = next((n, p) for n, p in backend.chunks[0].named_parameters() if job["poison"] in n)
            if rank == 0:
                param.view(-1)[0] = float("inf")
            rec["poisoned"] = name
    if job.get("save"):
        backend.save(job["save"], {"next_step": backend.optimizer_steps, "rollout_id": backend.optimizer_steps - 1,
                                   "data": {"epoch": 0, "offset": 6 * backend.optimizer_steps}})
    rec["end_step"] = backend.optimizer_steps
    rec["lr"] = backend.optimizer.param_groups[0]["lr"]
    rec["scheduler"] = backend.scheduler.state_dict()
    rec["logprobs_end"] = [t.tolist() for t in backend.forward_only(fixed)]
    rec["rng_probe"] = draw_rng()
    weights = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    torch.save(optimizer_dump(backend.optimizer), os.path.join(out_dir, f"{job['tag']}_opt_rank{rank}.pt"))
    # every rank's probe: RNG restore is per rank
    probes = [None] * world
    dist.all_gather_object(probes, rec["rng_probe"])
    rec["rng_probes"] = probes
    if rank == 0:
        torch.save(weights, os.path.join(out_dir, f"{job['tag']}_weights.pt"))
        with open(os.path.join(out_dir, f"{job['tag']}.json"), "w") as f:
            json.dump(rec, f)
    destroy_parallel()


def main(argv):
    hf_dir, out_dir, jobs = argv[0], argv[1], [json.loads(j) for j in argv[2:]]
    for job in jobs:
        run_job(hf_dir, out_dir, job)

