"""Worker for tests/dist/test_engine_replicas.py: the embedded engine replicated on every rank.

Job ``replicas`` of tests/dist/harness.py (3 ranks). Every rank builds the same engine from ``argv[0]`` (an
HF checkpoint); rank 0 wraps its own in ``ReplicatedEngine``, the others serve as ``ReplicaWorker``. Each rank writes what it saw to
``argv[1]/rank<r>.json``.
"""

import dataclasses
import json
import os
import random

import torch
import torch.distributed as dist

from megatron_rl.errors import EngineError
from megatron_rl.rollout.base import GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.replicas import ReplicatedEngine, ReplicaWorker, part_bounds


def exact(value):
    """JSON-able with floats as their hex (every bit) and the type named."""
    if isinstance(value, float):
        return ["float", value.hex()]
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [exact(v) for v in value]]
    if isinstance(value, dict):
        return {str(k): exact(v) for k, v in value.items()}
    return [type(value).__name__, value]


def digest(samples):
    return [exact(dataclasses.asdict(s)) for s in samples]  # every field of every sample


def main(argv):
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = EmbeddedEngine(argv[0])
    out = {"rank": rank}

    rng = random.Random(0)
    ragged = [GenerateRequest(prompt_ids=[rng.randrange(engine.vocab_size) for _ in range(rng.randint(2, 12))],
                              group_index=i, label=str(i), metadata={"i": i}) for i in range(7)]
    CALLS = [  # (requests, sampling): ragged prompts, top-k/top-p, fewer requests than ranks, stop tokens
        (ragged, SamplingParams(temperature=1.0, max_new_tokens=9, seed=11, n=3)),
        (ragged, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=14, seed=3, n=2, ignore_eos=True)),
        (ragged[:2], SamplingParams(temperature=1.0, max_new_tokens=5, seed=5, n=4)),
    ]

    if rank == 0:
        replicated = ReplicatedEngine(engine, rank=0, world_size=world)
        out["one_engine"] = [digest(engine.generate(reqs, sp)) for reqs, sp in CALLS]
        # what each replica is asked to draw, drawn here part by part (the same rows per model call)
        parts = []
        for reqs, sp in CALLS:
            bounds, pad_to = part_bounds(len(reqs), world), max(len(r.prompt_ids) for r in reqs)
            parts.append(digest([s for lo, hi in zip(bounds, bounds[1:]) if hi > lo
                                 for s in engine.generate_part(reqs[lo:hi], sp, first_request=lo, pad_to=pad_to)]))
        out["parts_on_one_engine"] = parts
        with replicated.serving():
            out["replicated"] = [digest(replicated.generate(reqs, sp)) for reqs, sp in CALLS]
            unseeded = replicated.generate(ragged, SamplingParams(temperature=1.0, max_new_tokens=6, seed=None, n=2))
            out["unseeded"] = [s.group_index for s in unseeded]
        # outside serving() (evaluation): the driver's replica alone, no command reaches the others
        out["local_only"] = digest(replicated.generate(*CALLS[0]))
        # a replica that fails: the driver names its rank and message; every rank then raises
        try:
            with replicated.serving():
                replicated.generate(*CALLS[0])
        except EngineError as exc:
            out["error"] = str(exc)
        # the driver's own part fails: it still reads every reply (no worker left blocked in its send), then raises
        engine.release()
        try:
            with replicated.serving():
                replicated.generate(*CALLS[0])
        except EngineError as exc:
            out["own_error"] = str(exc)
    else:
        worker = ReplicaWorker(engine, rank=rank, world_size=world)
        out["served"] = worker.serve()
        if rank == world - 1:
            engine.release()  # without a backup: generate refuses, naming why
        try:
            worker.serve()
        except EngineError as exc:
            out["error"] = str(exc)
        try:  # (rank 2 is still released: its part fails too; the driver's own error is the one raised)
            worker.serve()
        except EngineError as exc:
            out["own_error"] = str(exc)
    with open(os.path.join(argv[1], f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
