"""What moving the rollout batch and the per-token results costs: object collectives vs flat tensors.

For the demo's batch (256 samples = 32 prompts x 8, ~10-token responses, dynamic
micro-batches of <= 4096 tokens) it measures, in one run, at DP1, DP2, TP2 and
TP2xDP2 (ranks laid out as megatron does: tp fastest; only TP-rank-0 ranks hold
per-sample results, as in ``MegatronBackend``):

* gather: every rank gets every sample's log-probs from the holders.
  ``before`` = the old ``_gather_per_sample`` (``all_gather_object`` of a
  ``{sample: tensor}`` dict, also at world size 1, kept here only as the baseline);
  ``after`` = ``backends.per_sample.gather_per_sample`` (one ``broadcast`` per
  holder of its flat values, nothing at world size 1); ``all_gather`` = the
  alternative of ONE all_gather of padded flat rows, measured to choose between them,
  whole calls and the collectives alone (``bcast only`` / ``ag only``).
* batch: every rank gets the driver's samples. ``before`` = ``broadcast_object_list``
  of the ``Sample`` list (the old ``broadcast_samples``); ``after`` = the current
  ``broadcast_samples`` (``data.sample_codec`` buffer, encode and decode included).
* own rows, what the loop does now that each DP rank keeps what it trains on:
  ``gather>own`` = ``before``: ``gather_per_sample`` (every sample to every rank),
  ``after``: ``share_with_peers`` (a DP rank's samples to its TP peers only);
  ``batch>own`` = ``before``: ``broadcast_samples``, ``after``:
  ``rollout_shards.distribute_rollout`` (headers of all samples to every rank, each DP
  rank's share whole to its ranks; plan of 2 training steps of 128). ``after`` includes
  planning the whole step (``plan_rollout``: the forward plan and both training steps'),
  which the loop used to do later, once per forward pass and once per training step.

"bytes" = what one rank receives (the collective's output buffer; for the object
collectives the padded pickles). Times are the median per call of ``--repeat``
calls, the slowest rank's. Each variant's result is checked equal to the
baseline's (tensors bitwise). It launches itself under torchrun once per rank count:

    python benchmarks/data_movement.py [--repeat 30] [--samples 256]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_rl.infra.ports import free_port  # noqa: E402 - after the repo is on sys.path

LAYOUTS = [("DP1", 1, 1), ("DP2", 2, 1), ("TP2", 2, 2), ("TP2xDP2", 4, 2)]  # name, ranks, tp


def demo_batch(n: int):
    """Demo-sized samples: prompts of 8-16 tokens, responses of 5-15 (mean 10), rollout log-probs, rewards."""
    import torch

    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p, r = int(torch.randint(8, 17, (1,), generator=g)), int(torch.randint(5, 16, (1,), generator=g))
        out.append(Sample(group_index=i // 8, prompt_ids=torch.randint(0, 1000, (p,), generator=g).tolist(),
                          response_ids=torch.randint(0, 1000, (r,), generator=g).tolist(),
                          rollout_logprobs=(-torch.rand(r, generator=g, dtype=torch.float64)).tolist(),
                          reward=float(torch.rand(1, generator=g) > 0.5), finish_reason="stop",
                          label="13579", prompt_text="add one to each digit: 02468", response_text="13579"))
    return out


# ---- the old object-collective paths (baseline only) -------------------------------------------

def old_gather(local, is_holder: bool, num_samples: int):
    import torch.distributed as dist

    holders = local if is_holder else {}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v.cpu() for k, v in holders.items()})
    merged = {}
    for part in gathered:
        merged.update(part)
    return [merged[i] for i in range(num_samples)]


def old_broadcast(samples, src: int = 0):
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return list(samples)
    box = [samples if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return list(box[0])


def allgather_gather(local, holdings, slot, lengths):
    """The alternative to one broadcast per holder: ONE all_gather of equal-length rows
    ``[slot, values..., padding]`` (-1 on ranks that hold nothing)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return [local[i] for i in range(len(lengths))]
    width = 1 + max(sum(lengths[i] for i in h) for h in holdings)
    row = torch.zeros(width)
    row[0] = -1 if slot is None else slot
    if slot is not None:
        held = holdings[slot]
        row[1:1 + sum(lengths[i] for i in held)] = torch.cat([local[i] for i in held])
    rows = torch.empty(world * width)
    dist.all_gather_single(rows, row)
    rows = rows.view(world, width)
    out = [None] * len(lengths)
    for r, s in enumerate(rows[:, 0].tolist()):
        if s >= 0:
            held = holdings[int(s)]
            for i, piece in zip(held, torch.split(rows[r, 1:1 + sum(lengths[i] for i in held)],
                                                  [lengths[i] for i in held])):
                out[i] = piece
    return out


# ---- worker ------------------------------------------------------------------------------------

def _timed(fns: dict, repeat: int, warmup: int = 3) -> tuple[dict, dict]:
    """Median seconds per call of each fn, calls interleaved in rotating order (A B C, B C A, ...)
    so that drifting machine load and warm-up hit every variant alike; plus each fn's last result."""
    import torch.distributed as dist

    times: dict = {k: [] for k in fns}
    results: dict = {}
    for it in range(warmup + repeat):
        names = list(fns)
        for name in names[it % len(names):] + names[:it % len(names)]:  # rotate: no variant always follows another
            fn = fns[name]
            dist.barrier()
            t0 = time.perf_counter()
            results[name] = fn()
            if it >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, results


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from types import SimpleNamespace

    from megatron_rl.backends.base import TrainBackend, broadcast_samples, data_parallel_peers
    from megatron_rl.backends.per_sample import find_holder_ranks, gather_per_sample, share_with_peers
    from megatron_rl.backends.rollout_shards import distribute_rollout
    from megatron_rl.data import sample_codec
    from megatron_rl.data.packing import plan_dynamic_micro_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world, tp = dist.get_rank(), dist.get_world_size(), args.tp
    dp_size, dp, holder = world // tp, rank // tp, rank % tp == 0
    samples = demo_batch(args.samples)
    lengths = [s.response_length for s in samples]
    plan = plan_dynamic_micro_batches([s.total_length for s in samples], dp_size=dp_size, max_tokens_per_gpu=4096)
    holdings = [[i for mb in plan.rank(d) for i in mb] for d in range(dp_size)]
    # as forward() has them: views of one flat float32 tensor per micro-batch, split per sample
    gen = torch.Generator().manual_seed(1)
    local = {}
    for mb in plan.rank(dp):
        flat = torch.randn(sum(lengths[i] for i in mb), generator=gen)
        local.update(zip(mb, torch.split(flat, [lengths[i] for i in mb])))

    slot = dp if holder else None
    holder_ranks = find_holder_ranks(slot, dp_size)  # once per layout in the backend
    width = 1 + max(sum(lengths[i] for i in h) for h in holdings)
    bufs = [torch.zeros(1 + sum(lengths[i] for i in h)) for h in holdings]
    row, rows = torch.zeros(width), torch.empty(world * width)

    def bcast_only():  # the collectives alone, buffers preallocated: which collective is cheaper
        for buf, src in zip(bufs, holder_ranks):
            dist.broadcast(buf, src=src) if world > 1 else None

    def allgather_only():
        dist.all_gather_single(rows, row) if world > 1 else None

    leaders, peers = data_parallel_peers(dp, dp_size)
    res, out = _timed({"gather_before": lambda: old_gather(local, holder, len(samples)),
                       "gather_after": lambda: gather_per_sample(local, holdings, holder_ranks, lengths),
                       "gather_allgather": lambda: allgather_gather(local, holdings, slot, lengths),
                       "coll_bcast": lambda: bcast_only(), "coll_allgather": lambda: allgather_only(),
                       "gather_own_after": lambda: share_with_peers(local, holdings[dp], holder_ranks[dp], lengths,
                                                                    group=peers)},
                      args.repeat)
    res["gather_own_before"] = res["gather_after"]
    ref, new, alt = out["gather_before"], out["gather_after"], out["gather_allgather"]
    assert all(t is None or torch.equal(t, a) for t, a in zip(out["gather_own_after"], new)), "own gather differs"
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ref, new, alt)), "gather differs"
    width = 1 + max(sum(lengths[i] for i in h) for h in holdings)
    own = len(pickle.dumps({k: v.cpu() for k, v in local.items()} if holder else {}))  # what old_gather sent
    res["gather_bytes_before"] = world * (own + 8) if world > 1 else 0  # max over ranks below: padded to the largest
    res["gather_bytes_after"] = 4 * (sum(lengths) + dp_size) if world > 1 else 0
    res["gather_bytes_allgather"] = world * width * 4 if world > 1 else 0

    class Planner:  # the shared planning machinery of every backend, nothing else
        plan_micro_batches = TrainBackend.plan_micro_batches
        plan_rollout = TrainBackend.plan_rollout
        data_parallel_peers = TrainBackend.data_parallel_peers

    planner = Planner()
    planner.dp_rank, planner.dp_size, planner.pad_to_multiple, planner._dp_peers = dp, dp_size, 1, (leaders, peers)
    planner.cfg = SimpleNamespace(batching=SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=4096),
                                  parallel=SimpleNamespace(context_parallel_size=1))
    batch = samples if rank == 0 else None
    batch_times, out = _timed({"batch_before": lambda: old_broadcast(batch),
                               "batch_after": lambda: broadcast_samples(batch),
                               "batch_own_after": lambda: distribute_rollout(batch, planner, 128)}, args.repeat)
    res.update(batch_times)
    ref_b, new_b = out["batch_before"], out["batch_after"]
    assert ref_b == new_b == samples, "batch differs"
    sizes, _ = sample_codec.encode(samples)
    res["batch_bytes_before"] = len(pickle.dumps(samples)) + 8 if world > 1 else 0
    res["batch_bytes_after"] = int(sizes.sum()) + 24 if world > 1 else 0

    res["batch_own_before"] = res["batch_after"]
    got, rollout_plan = out["batch_own_after"]
    mine = set(rollout_plan.forward.rank_samples(dp)) if rollout_plan else set(range(len(samples)))
    assert all(got[i] == samples[i] for i in mine), "own batch differs"
    hsizes, _ = sample_codec.encode_headers(samples)
    shard = sample_codec.encode([samples[i] for i in sorted(mine)])[0]
    res["gather_own_bytes_before"] = res["gather_bytes_after"]
    res["gather_own_bytes_after"] = 4 * (sum(lengths[i] for i in holdings[dp]) + 1) if tp > 1 else 0
    res["batch_own_bytes_before"] = res["batch_bytes_after"]
    res["batch_own_bytes_after"] = int(hsizes.sum()) + int(shard.sum()) + 48 if world > 1 else 0
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        sample_codec.decode(*sample_codec.encode(samples))
    res["codec_s"] = (time.perf_counter() - t0) / args.repeat

    every: list = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        slowest = {k: max(r[k] for r in every) for k in res}
        with open(args.out, "w") as f:
            json.dump(slowest, f)
    dist.destroy_process_group()


# ---- driver ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"{args.samples} samples, median of {args.repeat} calls, slowest rank; ms per call, KiB received per rank")
    print(f"{'layout':>8} {'what':>10} {'before ms':>10} {'after ms':>9} {'ratio':>7} {'before KiB':>11} "
          f"{'after KiB':>10} | {'all_gather ms':>13} {'KiB':>6} | {'bcast only':>10} {'ag only':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, tp in LAYOUTS:
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", os.path.abspath(__file__), "--worker",
                   f"--tp={tp}", f"--out={out}", f"--repeat={args.repeat}", f"--samples={args.samples}"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{name}: worker failed ({proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.load(open(out))
            for what in ("gather", "batch", "gather_own", "batch_own"):
                b, a = r[f"{what}_before"] * 1e3, r[f"{what}_after"] * 1e3
                extra = (f"{r['gather_allgather'] * 1e3:13.3f} {r['gather_bytes_allgather'] / 1024:6.1f} | "
                         f"{r['coll_bcast'] * 1e3:10.3f} {r['coll_allgather'] * 1e3:8.3f}"
                         if what == "gather" else "")
                label = what.replace("_own", ">own")
                print(f"{name:>8} {label:>10} {b:10.3f} {a:9.3f} {b / max(a, 1e-9):6.1f}x "
                      f"{r[f'{what}_bytes_before'] / 1024:11.1f} {r[f'{what}_bytes_after'] / 1024:10.1f} | {extra}")
            if name == "DP1":
                print(f"{'':>8} sample_codec encode+decode of the batch (no wire): {r['codec_s'] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
