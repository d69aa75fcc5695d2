"""The SGLang tensor transport (``weight_sync.sglang_tensor``), in one process.

The wire format first: a bucket of mixed dtypes becomes one flattened bucket per dtype, pickled
as SGLang's ``MultiprocessingSerializer`` does, and the stand-in's deserialiser (SGLang's
allowlisted unpickler rules, ``FlattenedTensorBucket.reconstruct_tensors``) gets every tensor
back bit for bit, the trainer's own tensors untouched; a payload SGLang would refuse is refused.
Then whole syncs into a stand-in server in this process (tests/rollout/sglang_standin.py, the
embedded engine behind SGLang's HTTP protocol) through our ``SGLangEngine``: a push changes the
generations to exactly what the pushed weights give (zero ``lm_head`` -> every log-prob is
-ln(V)), one request per dtype per bucket with only the last carrying the version, sessions
around the sync (skipped on a legacy server), the plain route, a server answering 400 named
with its bucket and the engine left refusing to generate until a complete update, and the
placements and engines the transport refuses. Across processes and ranks:
tests/dist/test_sglang_tensor_ranks.py.
"""

import math
import os
import pickle
import sys
import types

import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.plan.engines import EnginePlacement, EngineSlot
from megatron_rl.weight_sync import make_synchronizer, make_synchronizer_from_config
from megatron_rl.weight_sync.base import ENGINE_TRANSPORTS, transport_class
from megatron_rl.weight_sync.in_process import InProcessSynchronizer
from megatron_rl.weight_sync.sglang_tensor import (FLATTENED_BUCKET, SGLangTensorSynchronizer, _bucket_entries,
                                                   flatten_tensors, serialize_for_sglang)

from test_weight_sync import FakeBackend, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn, _deserialize, _reconstruct_flattened  # noqa: E402 - put on sys.path above

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]
BUCKET = 64 * 1024


def placement(url, ranks=(0,), colocated=True):
    return EnginePlacement((EngineSlot(0, url, 0, (), tuple(ranks), "/tmp/engine0.log"),), colocated=colocated)


def mixed_bucket():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 5, generator=g)
    return [("a.weight", torch.randn(4, 3, generator=g)),
            ("b.weight", torch.randn(3, generator=g).to(torch.bfloat16)),  # odd bf16 count: 6 bytes
            ("c.weight", big.t()),  # not contiguous
            ("d.scale", torch.tensor(1.5, dtype=torch.bfloat16)),  # 0-dim
            ("e.bias", torch.randn(7, generator=g)),
            ("f.empty", torch.empty(0, 3, dtype=torch.bfloat16))]


def raw_bytes(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------------------- wire format
def test_flattened_buckets_round_trip_bit_exact_per_dtype():
    bucket = mixed_bucket()
    entries, buffers = _bucket_entries(bucket, FLATTENED_BUCKET)
    assert [(e.dtype, e.names) for e in entries] == [("float32", ("a.weight", "c.weight", "e.bias")),
                                                    ("bfloat16", ("b.weight", "d.scale", "f.empty"))]
    assert [e.nbytes for e in entries] == [(12 + 30 + 7) * 4, (3 + 1) * 2]
    assert all(b.is_shared() and b.dtype == torch.uint8 for b in buffers)  # handles, not bytes, cross HTTP
    assert not any(t.is_shared() for _, t in bucket)  # the trainer's tensors were copied, never moved
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    got = {}
    for entry in entries:
        payload = _deserialize(entry.payload)  # what SGLang's MultiprocessingSerializer.deserialize returns
        assert set(payload) == {"flattened_tensor", "metadata"}
        assert [m.start_idx for m in payload["metadata"]][0] == 0
        got.update(_reconstruct_flattened(payload))
    for name, want in bucket:
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(raw_bytes(got[name]), raw_bytes(want)), name  # bit for bit


def test_flatten_layout_is_sglangs():
    """Records as SGLang's FlattenedTensorBucket writes them: byte offsets, numel = bytes."""
    buffer, records = flatten_tensors([("x", torch.ones(2, 3)), ("y", torch.zeros(5))])
    assert buffer.dtype == torch.uint8 and buffer.numel() == 44
    assert [(r.name, tuple(r.shape), r.dtype, r.start_idx, r.end_idx, r.numel) for r in records] == [
        ("x", (2, 3), torch.float32, 0, 24, 24), ("y", (5,), torch.float32, 24, 44, 20)]
    assert all(isinstance(r, types.SimpleNamespace) for r in records)  # in SGLang's unpickling allowlist


def test_plain_route_round_trip():
    bucket = mixed_bucket()
    entries, buffers = _bucket_entries(bucket, None)
    got = dict(pair for e in entries for pair in _deserialize(e.payload))
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in bucket)
    assert len(buffers) == len(bucket)


def test_a_payload_sglang_would_refuse_is_refused():
    """Our own classes are not in SGLang's allowlist: pickling one would make every server refuse."""
    entry = serialize_for_sglang({"flattened_tensor": torch.zeros(1, dtype=torch.uint8),
                                  "metadata": [EngineSlot(0, "", 0, (), (), "")]})
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(megatron_rl.plan.engines.EngineSlot\)"):
        _deserialize(entry)
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(posix.system\)"):
        import base64
        _deserialize(base64.b64encode(b"cposix\nsystem\n(S'true'\ntR.").decode())
    assert pickle.loads(pickle.dumps(1)) == 1


# ------------------------------------------------------------------------------- syncs into a stand-in
@pytest.fixture(scope="module")
def models(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    old = checkpoint_tensors(hf)
    g = torch.Generator().manual_seed(1)
    return hf, old, {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in old.items()}  # other weights


@pytest.fixture(scope="module")
def server(models):
    standin = SGLangStandIn(models[0]).start()
    engine = SGLangEngine([standin.url], timeout_s=30, update_timeout_s=30, connect_retries=0)
    yield standin, engine
    engine.close()
    standin.stop()


def synchronizer(url, **kw):
    return make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=BUCKET, engines=placement(url),
                             timeout_s=30, connect_retries=0, **kw)


def logprobs(engine):
    return [s.rollout_logprobs for s in engine.generate(REQUESTS, GREEDY)]


def test_push_lands_exactly_and_versions_follow(models, server):
    hf, old, new = models
    standin, engine = server
    sync = synchronizer(standin.url)
    assert isinstance(sync, SGLangTensorSynchronizer) and sync.load_format == FLATTENED_BUCKET
    served = engine.generate(REQUESTS, GREEDY)  # the model the server started with
    vocab = old["lm_head.weight"].shape[0]
    zero = {**new, "lm_head.weight": torch.zeros_like(new["lm_head.weight"]).to(torch.bfloat16),
            "model.norm.weight": new["model.norm.weight"].to(torch.bfloat16)}  # two dtypes in one bucket
    backend = FakeBackend(zero)
    v = engine.weight_version + 1
    standin.tensor_updates.clear()
    metrics = sync.sync(backend, engine, version=v)
    assert backend.finished and metrics["sync/buckets"] == float(len(backend.buckets)) > 1
    assert metrics["sync/weight_version"] == float(v) and metrics["sync/post_s"] > 0
    # one request per dtype of each bucket, dtypes in order of first appearance in the bucket, tensors in
    # export order; only the last names the version
    want = []
    for names in backend.buckets:
        for dtype in dict.fromkeys(zero[n].dtype for n in names):
            want.append([n for n in names if zero[n].dtype == dtype])
    assert [names for _, _, names in standin.tensor_updates] == want
    assert metrics["sync/requests"] == float(len(want))
    assert [ver for ver, _, _ in standin.tensor_updates] == [None] * (len(want) - 1) + [str(v)]
    assert {fmt for _, fmt, _ in standin.tensor_updates} == {FLATTENED_BUCKET}
    assert not standin.in_session  # begin ... end around the sync
    live = dict(standin.engine.named_weights())
    assert all(torch.equal(live[n], t.float()) for n, t in zero.items())  # bit for bit in the server
    want_lp = -math.log(vocab)
    assert all(abs(lp - want_lp) < 1e-5 for row in logprobs(engine) for lp in row)  # zero lm_head -> uniform
    assert engine.weight_version == v and engine.clients[0].weight_version() == str(v)
    assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {v}

    metrics = sync.sync(FakeBackend(old), engine, version=v + 1)  # back to the served model
    again = engine.generate(REQUESTS, GREEDY)
    assert [(s.response_ids, s.rollout_logprobs) for s in again] == \
        [(s.response_ids, s.rollout_logprobs) for s in served]
    assert engine.weight_version == v + 1
    sync.shutdown()
    sync.shutdown()  # safe to repeat; a later sync reopens its client
    sync.sync(FakeBackend(old), engine, version=v + 2)
    assert engine.weight_version == v + 2


def test_plain_route_and_a_legacy_server(models):
    hf, old, new = models
    with SGLangStandIn(hf, legacy=True) as standin:
        engine = SGLangEngine([standin.url], timeout_s=30, connect_retries=0)
        sync = synchronizer(standin.url, load_format=None)
        sync.sync(FakeBackend(new), engine, version=1)
        assert sync._client.has_update_session is False  # 404 on /begin_weight_update: skipped, as SGLang < 0.5.21
        assert {fmt for _, fmt, _ in standin.tensor_updates} == {None}
        live = dict(standin.engine.named_weights())
        assert all(torch.equal(live[n], t) for n, t in new.items())
        assert standin.weight_version == "1" and engine.weight_version == 1
        engine.close()


def test_a_refusing_server_is_named_and_the_engine_refuses_to_generate(models, server):
    hf, old, new = models
    standin, engine = server
    sync = synchronizer(standin.url)
    v = engine.weight_version + 1
    bad = {**new, "model.bogus.weight": torch.zeros(3)}  # the server's model has no such tensor: 400
    with pytest.raises(SyncError) as err:
        sync.sync(FakeBackend(bad), engine, version=v)
    msg = str(err.value)
    assert f"SGLang engine 0 ({standin.url}, node 0, CPU, log /tmp/engine0.log)" in msg
    assert "bucket " in msg and "HTTP 400" in msg and "model.bogus.weight" in msg
    assert not standin.in_session  # the session was closed after the failure
    with pytest.raises(EngineError, match=f"the tensor update to version {v} failed on an engine"):
        engine.generate(REQUESTS, GREEDY)
    assert engine.weight_version == v - 1
    sync.sync(FakeBackend(old), engine, version=v)  # a complete update makes it serve again
    assert engine.weight_version == v and engine.generate(REQUESTS, GREEDY)


def test_a_refused_start_sends_nothing(models, server):
    hf, old, new = models
    standin, engine = server
    sync = synchronizer(standin.url)
    n = len(standin.tensor_updates)
    backend = FakeBackend(new)
    with pytest.raises(SyncError, match="older than the engine's weight_version"):
        sync.sync(backend, engine, version=engine.weight_version - 1)
    assert backend.finished and len(standin.tensor_updates) == n  # the export ran to its end, nothing was sent
    standin.begin({})  # a session left open by an interrupted sync is closed and reopened
    sync.sync(FakeBackend(old), engine, version=engine.weight_version + 1)
    assert not standin.in_session


def test_refused_placements_and_engines(models, server):
    standin, engine = server
    with pytest.raises(ConfigError, match="needs the placement of the engines this run launched"):
        make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=1)
    with pytest.raises(ConfigError, match="share\\(s\\) no trainer devices \\(not colocated\\): add --colocate"):
        make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=1,
                          engines=placement(standin.url, ranks=(), colocated=False))
    with pytest.raises(ConfigError, match="beyond this run's world of 1"):
        make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=1,
                          engines=placement(standin.url, ranks=(0, 1))).sync(FakeBackend(models[1]), engine, 99)
    sync = synchronizer(standin.url)
    with pytest.raises(SyncError, match="got a EmbeddedEngine"):
        sync.sync(FakeBackend(models[1]), EmbeddedEngine(models[0]), 1)
    other = SGLangEngine(["http://127.0.0.1:9"], connect_retries=0)
    with pytest.raises(SyncError, match="placement's engines are"):
        sync.sync(FakeBackend(models[1]), other, 1)
    other.close()
    with SGLangStandIn(models[0], tp_size=2) as tp2:  # an engine of two TP ranks, placed with one trainer rank
        tp_engine = SGLangEngine([tp2.url], connect_retries=0)
        with pytest.raises(SyncError, match=r"runs tp_size 2, but the placement gives it 1 trainer rank\(s\) \[0\]"):
            synchronizer(tp2.url).sync(FakeBackend(models[1]), tp_engine, 1)
        assert not tp2.tensor_updates and tp_engine.weight_version == 0  # refused before anything was sent
        tp_engine.close()


def test_the_tensor_row_depends_on_the_engine(models, server):
    standin, _ = server
    hf = models[0]
    assert transport_class("tensor") is InProcessSynchronizer
    assert transport_class("tensor", "embedded") is InProcessSynchronizer
    assert transport_class("tensor", "sglang") is SGLangTensorSynchronizer
    assert ENGINE_TRANSPORTS.rows()["tensor/sglang"] == "megatron_rl.weight_sync.sglang_tensor:SGLangTensorSynchronizer"
    embedded = make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf]))
    assert type(embedded) is InProcessSynchronizer
    cfg = parse_config(["--hf-checkpoint", hf, "--rollout-backend", "sglang", "--update-weight-transport", "tensor",
                        "--update-weight-buffer-size", "4096"], validate=False)  # validation refuses launched engines until the launcher lands
    sync = make_synchronizer_from_config(cfg, driver_rank=0, engines=placement(standin.url))
    assert isinstance(sync, SGLangTensorSynchronizer) and sync.bucket_bytes == 4096
    assert sync.placement.urls == [standin.url]
    with pytest.raises(ConfigError, match="needs the placement"):
        make_synchronizer_from_config(cfg)


def test_cpu_buffers_are_kept_and_rewritten_sync_after_sync_and_dropped_after_a_failure(models, server):
    """The CPU route's flattened buffers live in /dev/shm from one sync to the next (no page faults of a
    new 200 MB buffer per sync); each is rewritten only in the next sync, and the server gets exactly the
    new weights; a failed sync drops them (an engine may not have answered for them)."""
    hf, old, new = models
    standin, engine = server
    sync = synchronizer(standin.url)
    sync.sync(FakeBackend(new), engine, version=engine.weight_version + 1)
    kept = {key: buf.data_ptr() for key, buf in sync._shm._buffers.items()}
    assert len(kept) > 1 and all(buf.is_shared() for buf in sync._shm._buffers.values())
    sync.sync(FakeBackend(old), engine, version=engine.weight_version + 1)
    assert {key: buf.data_ptr() for key, buf in sync._shm._buffers.items()} == kept  # the same memory
    live = dict(standin.engine.named_weights())
    assert all(torch.equal(live[n], t) for n, t in old.items())  # rewritten with the new sync's bytes
    with pytest.raises(SyncError):
        sync.sync(FakeBackend({**new, "model.bogus.weight": torch.zeros(3)}), engine,
                  version=engine.weight_version + 1)
    assert len(sync._shm) == 0
    sync.sync(FakeBackend(old), engine, version=engine.weight_version + 1)
    assert len(sync._shm) == len(kept)
    sync.shutdown()
    assert len(sync._shm) == 0
