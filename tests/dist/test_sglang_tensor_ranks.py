"""The SGLang tensor transport across two gloo trainer ranks and server processes (one torchrun launch).

This file is both the test and, run under torchrun, the worker. Each rank hosts stand-in servers
(tests/rollout/sglang_standin.py: SGLang's protocol over the embedded engine) for the *other*
rank, so every flattened bucket crosses a process boundary as it does into SGLang (file-system
shared memory, CPU), and rank 0 holds the loop's ``SGLangEngine`` over them:

* one engine per rank (the realistic CPU case): engine 0 is fed by rank 0 and served in rank 1's
  process, engine 1 the reverse. A push of a zero ``lm_head`` (it and the norms bf16, the rest
  fp32: two requests for a mixed bucket) makes every greedy log-prob of both servers exactly -ln(V); restoring the weights
  gives the first generations back; versions adopted by the engine, ``/model_info`` and samples;
* a server answering 400 (rank 1's copy has a wrong shape): the same ``SyncError`` naming engine
  1, its URL and the bucket on both ranks, no rank sending after that bucket, the engine refusing
  to generate until a complete update;
* exports with different bucket counts on the two ranks: the same ``SyncError`` on both;
* a dead server (stopped by the rank hosting it): named on both ranks by its refused connection;
* one engine of two TP ranks (trainer ranks 0 and 1, served in rank 0's process): rank 1's entries
  are gathered to rank 0 and opened by the server, each TP rank its own, bit-identical.
"""

import json
import math
import os
import sys
import time

import pytest

pytestmark = pytest.mark.dist

BUCKET = 64 * 1024


def test_tensor_transport_across_ranks(tiny_hf_models, tmp_path):
    from _util import torchrun  # tests/ is on sys.path under pytest only (this file is also the worker)

    hf = tiny_hf_models("qwen2")
    torchrun(os.path.abspath(__file__), 2, [hf, str(tmp_path)], timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    r0, r1 = ranks
    # one engine per rank: the push lands exactly, versions follow, the old weights come back
    assert r0["uniform_max_diff"] < 1e-5 and r0["uniform_rows"] == 4
    assert min(r0["rows_served"]) > 0 and sum(r0["rows_served"]) == 8  # both servers served rows (2 calls x 4)
    assert r0["versions_after_push"] == {"engine": 1, "servers": ["1", "1"], "samples": [1]}
    assert r0["restored_equal_first"] and r0["versions_after_restore"]["engine"] == 2
    assert r0["requests_per_sync"] == r1["requests_per_sync"] > r0["buckets"] > 1  # per dtype per bucket
    # a server answering 400: the same error on both ranks, naming engine 1, its URL and the bucket
    url1 = r0["urls"][1]
    for r in ranks:
        msg = r["refused"]
        assert r["refused_type"] == "SyncError", msg
        assert f"SGLang engine 1 ({url1}" in msg and ": bucket 1, float32" in msg and "HTTP 400" in msg, msg
        assert "shape mismatch" in msg and "lm_head.weight (sent (1, 16000)" in msg, msg
    assert r0["refused"] == r1["refused"]
    assert r1["refused_requests_served"] == 1  # engine 0 got bucket 1, then every rank stopped sending
    assert r0["generate_after_refusal"].startswith("EngineError") and r0["recovered_version"] == 4
    # exports of different lengths: named on both ranks, not a mispaired collective
    for r in ranks:
        assert r["uneven_type"] == "SyncError" and "different bucket counts" in r["uneven"], r["uneven"]
        assert "rank 0: done, rank 1: bucket " in r["uneven"], r["uneven"]
    # a dead server: named on both ranks by its refused connection (no retries configured), not by the 30 s
    # timeout, whose message differs (was also: 'dead_s < 20')
    for r in ranks:
        assert r["dead_type"] == "SyncError" and f"SGLang engine 1 ({url1}" in r["dead"], r["dead"]
        assert "/begin_weight_update failed" in r["dead"] and "within 30 s" not in r["dead"], r
    # one engine of two TP ranks: gathered, each rank's entry opened, bit-identical, loaded
    assert r0["tp2_ok"] and r0["tp2_uniform_max_diff"] < 1e-5 and r0["tp2_version"] == 7
    assert r0["tp2_requests"] > 1


# --------------------------------------------------------------------------------------------- worker
def _worker(hf: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_rl.errors import EngineError
    from megatron_rl.plan.engines import EnginePlacement, EngineSlot
    from megatron_rl.rollout import GenerateRequest, SamplingParams
    from megatron_rl.rollout.sglang import SGLangEngine
    from megatron_rl.weight_sync import make_synchronizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
    from sglang_standin import SGLangStandIn

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    vocab = tensors["lm_head.weight"].shape[0]
    result: dict = {}

    class Backend:
        """Full HF tensors on every rank, in greedy buckets (the backend contract)."""

        def __init__(self, state):
            self.state = state

        def export_weights(self, bucket_bytes):
            bucket, size = [], 0
            for name, t in self.state.items():
                if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.numel() * t.element_size()
            yield bucket

    # rank r serves engine 1 - r (the other rank feeds it); rank 0 also serves the TP-2 engine
    mine = SGLangStandIn(hf).start()
    tp2 = SGLangStandIn(hf, tp_size=2).start() if rank == 0 else None
    urls = [None, None]
    urls[1 - rank] = mine.url
    shared = [None, None]
    dist.all_gather_object(shared, (mine.url, tp2.url if tp2 else None))
    urls = [shared[1][0], shared[0][0]]  # engine 0 served by rank 1, engine 1 by rank 0
    tp2_url = shared[0][1]
    result["urls"] = urls
    per_rank = EnginePlacement((EngineSlot(0, urls[0], 0, (), (0,), "rank1-hosted.log"),
                                EngineSlot(1, urls[1], 0, (), (1,), "rank0-hosted.log")), colocated=True)
    engine = SGLangEngine(urls, timeout_s=30, update_timeout_s=30, connect_retries=0) if rank == 0 else None
    sync = make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=BUCKET, engines=per_rank,
                             timeout_s=30, connect_retries=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    requests = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1),
                GenerateRequest([7, 7], 2), GenerateRequest([11, 200, 3], 3)]

    def attempt(key, fn):
        t = time.monotonic()
        try:
            fn()
            result[key] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded for the parent to check
            result[key], result[key + "_type"] = str(exc), type(exc).__name__
        result[key + "_s"] = time.monotonic() - t

    first = engine.generate(requests, greedy) if rank == 0 else None
    dist.barrier()
    zero = {n: t.to(torch.bfloat16) if n.endswith("norm.weight") else t for n, t in tensors.items()}
    zero["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"], dtype=torch.bfloat16)
    metrics = sync.sync(Backend(zero), engine, 1)
    result["requests_per_sync"], result["buckets"] = metrics["sync/requests"], metrics["sync/buckets"]
    if rank == 0:
        samples = engine.generate(requests, greedy)
        want = -math.log(vocab)
        result["uniform_max_diff"] = max(abs(lp - want) for s in samples for lp in s.rollout_logprobs)
        result["uniform_rows"] = len(samples)
        result["versions_after_push"] = {"engine": engine.weight_version,
                                         "servers": [c.weight_version() for c in engine.clients],
                                         "samples": sorted({s.weight_version for s in samples})}
    dist.barrier()  # rank 0 generated: now count
    served = [None, None]
    dist.all_gather_object(served, len(mine.rids_served))
    result["rows_served"] = [served[1], served[0]]  # engine 0 is served in rank 1, engine 1 in rank 0
    sync.sync(Backend(tensors), engine, 2)
    if rank == 0:
        again = engine.generate(requests, greedy)
        result["restored_equal_first"] = [s.response_ids for s in again] == [s.response_ids for s in first] and \
            [s.rollout_logprobs for s in again] == [s.rollout_logprobs for s in first]
        result["versions_after_restore"] = {"engine": engine.weight_version}
    dist.barrier()
    # rank 1's copy of the first bucket has a wrong shape: engine 1 (served by rank 0) answers 400 at bucket 1,
    # and after that bucket's lockstep rank 0 sends engine 0 nothing more
    bad = dict(tensors)
    if rank == 1:
        bad["lm_head.weight"] = tensors["lm_head.weight"].reshape(1, -1)
    before = len(mine.tensor_updates)
    attempt("refused", lambda: sync.sync(Backend(bad), engine, 3))
    result["refused_requests_served"] = len(mine.tensor_updates) - before
    if rank == 0:
        try:
            engine.generate(requests, greedy)
            result["generate_after_refusal"] = "generated"
        except EngineError as exc:
            result["generate_after_refusal"] = f"EngineError: {exc}"
    dist.barrier()
    sync.sync(Backend(tensors), engine, 4)
    result["recovered_version"] = engine.weight_version if rank == 0 else None
    dist.barrier()

    class Longer(Backend):
        def export_weights(self, bucket_bytes):
            yield from super().export_weights(bucket_bytes)
            yield [("model.norm.weight", tensors["model.norm.weight"])]

    # rank 1 exports one bucket more than rank 0: caught by the lockstep on both ranks
    attempt("uneven", lambda: sync.sync(Longer(tensors) if rank == 1 else Backend(tensors), engine, 5))
    dist.barrier()
    # engine 1's server (in rank 0) goes down
    if rank == 0:
        mine.stop()
    dist.barrier()
    attempt("dead", lambda: sync.sync(Backend(tensors), engine, 6))
    dist.barrier()
    # one engine of two TP ranks (trainer ranks 0 and 1), served in rank 0's process
    tp_place = EnginePlacement((EngineSlot(0, tp2_url, 0, (), (0, 1), "tp2.log"),), colocated=True)
    tp_engine = SGLangEngine([tp2_url], timeout_s=30, update_timeout_s=30, connect_retries=0) if rank == 0 else None
    tp_sync = make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=BUCKET, engines=tp_place,
                                timeout_s=30, connect_retries=0)
    metrics = tp_sync.sync(Backend(zero), tp_engine, 7)
    if rank == 0:
        samples = tp_engine.generate(requests, greedy)
        result["tp2_uniform_max_diff"] = max(abs(lp - -math.log(vocab)) for s in samples for lp in s.rollout_logprobs)
        result["tp2_version"] = tp_engine.weight_version
        result["tp2_requests"] = int(metrics["sync/requests"])
        result["tp2_ok"] = tp2.tp_size == 2 and len(tp2.tensor_updates) == int(metrics["sync/requests"])
        tp_engine.close()
        engine.close()
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    mine.stop()
    if tp2:
        tp2.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
