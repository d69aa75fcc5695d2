"""The distributed transport (``DistributedSynchronizer``) into SGLang stand-in servers over gloo.

Real parts: our ``SGLangEngine`` / ``SGLangClient`` over HTTP, the trainer's end of the group
(``weight_sync.update_group``), and the protocol-exact stand-in (tests/rollout/sglang_standin.py),
which joins the group the way SGLang 0.5.23 does (torch's own group helper, a non-default group)
and receives every broadcast into its embedded engine, so "the weights landed" is the engine's
generations. One server runs in this process, a second one in its own process, so the broadcasts
really cross processes and the rank offsets of two servers are exercised. The trainer side is
the bucketed ``FakeBackend`` of test_weight_sync.

Checked: a sync changes generations and back, versions follow (engine, /model_info, samples), the
last bucket alone carries the version, each bucket is one flattened broadcast (servers at 0.5.19+,
asked for; mixed dtypes laid out so SGLang's receive can view every slice) or one broadcast per
tensor (older servers; gloo groups by default), the group is made once and destroyed at shutdown on every
server, a server that dies mid-bucket is named and leaves the engine refusing to generate until a
complete update (which makes a fresh group), a server that never joins the group is named within
the timeout (no hang), and the embedded engine is refused with a reason.
"""

import os
import select
import subprocess
import sys

import pytest
import torch

from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.weight_sync import make_synchronizer
from megatron_rl.weight_sync.distributed import DistributedSynchronizer, flatten_bucket

from test_weight_sync import FakeBackend, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn, flattened_receive  # noqa: E402 - tests/rollout, put on sys.path above

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]
BUCKET = 64 * 1024
METRIC_KEYS = {"sync/time_s", "sync/bytes", "sync/buckets", "sync/weight_version", "sync/connect_s",
               "sync/broadcast_s"}


class ProcessStandIn:
    """A stand-in server in its own process (``python tests/rollout/sglang_standin.py``)."""

    def __init__(self, hf: str, log_path):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "rollout", "sglang_standin.py"),
                                      "--model", hf, "--group-timeout-s", "30"], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)  # a hang bound (a busy start: torch import)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("URL "):
            self.stop()
            raise AssertionError(f"hung: the stand-in process did not start within 300 s: {line!r}; its log "
                                 f"{log_path}: {open(log_path).read()[-2000:]}")
        self.url = line.split()[1]

    def stop(self):
        self.proc.kill()
        self.proc.wait(120)  # a hang bound on reaping it
        self.log.close()


@pytest.fixture(scope="module")
def models(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    return hf, checkpoint_tensors(hf), checkpoint_tensors(tiny_hf_models("qwen2", seed=1))


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    """Two servers for the module (the process one takes ~10 s to start); tests push versions above the
    engine's current one and leave the engine complete."""
    hf = models[0]
    local = SGLangStandIn(hf, group_timeout_s=30).start()
    remote = ProcessStandIn(hf, tmp_path_factory.mktemp("standin") / "standin.log")
    engine = SGLangEngine([local.url, remote.url], timeout_s=30, update_timeout_s=30, connect_retries=0)
    yield local, remote, engine
    engine.close()
    local.stop()
    remote.stop()


def tokens(engine):
    return [s.response_ids for s in engine.generate(REQUESTS, GREEDY)]


def test_sync_broadcasts_into_every_server_and_versions_follow(models, servers):
    hf, old, new = models
    local, remote, engine = servers
    v = engine.weight_version + 1
    sync = make_synchronizer("distributed", bucket_bytes=BUCKET)
    assert isinstance(sync, DistributedSynchronizer) and sync.flattened is None
    sync.flattened = True  # what NCCL groups get by default; gloo ones send per tensor (the next tests)
    before = tokens(engine)
    backend = FakeBackend(new)
    metrics = sync.sync(backend, engine, version=v)
    try:
        assert set(metrics) == METRIC_KEYS and backend.finished
        assert metrics["sync/buckets"] == float(len(backend.buckets)) > 1 and metrics["sync/weight_version"] == float(v)
        assert metrics["sync/connect_s"] > 0 and metrics["sync/broadcast_s"] > 0
        group = sync.group_name
        assert list(local.groups) == [group]  # the in-process server joined as rank 1 (the remote one as 2)
        # every bucket went over HTTP + broadcast, only the last one carried the version
        assert [v for v, _ in local.distributed_updates] == [None] * (len(backend.buckets) - 1) + [str(v)]
        assert [names for _, names in local.distributed_updates] == backend.buckets  # one dtype: the export order
        # both servers report 0.5.23: one flattened broadcast per bucket
        assert local.distributed_formats[-len(backend.buckets):] == ["flattened_bucket"] * len(backend.buckets)
        live = dict(local.engine.named_weights())
        assert all(torch.equal(live[n], t) for n, t in new.items())  # bit for bit in the in-process server
        assert engine.weight_version == v and [c.weight_version() for c in engine.clients] == [str(v)] * 2
        after = tokens(engine)
        assert after != before  # both servers generate from the new weights: rows alternate between them
        assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {v}

        metrics = sync.sync(FakeBackend(old), engine, version=v + 1)
        assert metrics["sync/connect_s"] == 0.0 and sync.group_name == group  # the group is made once
        assert tokens(engine) == before and engine.weight_version == v + 1
        with pytest.raises(SyncError, match=f"older than the engine's weight_version {v + 1}"):
            sync.sync(FakeBackend(new), engine, version=v)
        assert sync.group_name == group  # a refused version touches nothing
    finally:
        sync.shutdown()
    assert sync.group_name is None and local.groups == {}  # destroyed on the servers
    remote_client = engine.clients[1]
    with pytest.raises(SyncError, match="The group to be destroyed does not exist"):
        remote_client.destroy_weights_update_group(group)  # the process server destroyed it too
    sync.shutdown()  # twice is harmless


@pytest.mark.parametrize("flattened", [None, True], ids=["per_tensor", "flattened"])
def test_a_server_dying_mid_bucket_is_named_and_the_engine_refuses_until_a_complete_update(models, servers,
                                                                                          flattened):
    """(Flattened: the server goes down before the bucket's one broadcast.)"""
    hf, old, new = models
    local, remote, engine = servers
    sync = DistributedSynchronizer(bucket_bytes=BUCKET, timeout_s=30, flattened=flattened)
    v = engine.weight_version + 1
    try:
        sync.sync(FakeBackend(new), engine, version=v)
        first_group = sync.group_name
        local.faults.die_mid_bucket = 2  # receives two tensors of the next bucket, then the server goes down
        backend = FakeBackend(old)
        with pytest.raises(SyncError) as err:
            sync.sync(backend, engine, version=v + 1)
        # named by its failure, not as a server that did not answer in time (was: 'took < 20 s')
        failed = str(err.value).split("no answer within")[0]
        assert local.url in failed and "/update_weights_from_distributed" in failed, str(err.value)
        assert backend.finished  # the export still ran to the end (the other ranks are in it)
        assert sync.group_name is None  # torn down
        with pytest.raises(EngineError, match="last weight update failed"):
            engine.generate(REQUESTS, GREEDY)
        assert not engine.health().ok

        # the server comes back (same port, its weights as they were left); a complete update heals it
        local.start()
        sync.sync(FakeBackend(old), engine, version=v + 1)
        assert sync.group_name not in (None, first_group)  # a fresh group under a fresh name
        assert engine.health().ok and engine.weight_version == v + 1
        assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {v + 1}
        live = dict(local.engine.named_weights())
        assert all(torch.equal(live[n], t) for n, t in old.items())
    finally:
        sync.shutdown()


def test_a_server_that_never_joins_is_named_within_the_timeout(models):
    hf = models[0]
    with SGLangStandIn(hf, group_timeout_s=5) as good, SGLangStandIn(hf, group_timeout_s=5) as silent:
        # takes the request and never joins before the test ends: only the 3 s timeout can end the sync
        # (was also: 'took < 15 s'); a busy machine's good server may miss the 3 s too, and is then named with it
        silent.faults.delay_s["/init_weights_update_group"] = 600.0
        engine = SGLangEngine([good.url, silent.url], timeout_s=30, update_timeout_s=30, connect_retries=0)
        sync = DistributedSynchronizer(bucket_bytes=BUCKET, timeout_s=3)
        backend = FakeBackend(models[2])
        with pytest.raises(SyncError) as err:
            sync.sync(backend, engine, version=1)
        msg = str(err.value)
        assert backend.finished
        assert "making weights-update group" in msg and "no answer within 3 s from SGLang server(s)" in msg, msg
        assert silent.url in msg.split("no answer within 3 s")[1], msg
        assert engine.weight_version == 0 and sync.group_name is None
        engine.close()


def test_refused_where_it_cannot_work(models):
    hf = models[0]
    sync = DistributedSynchronizer(bucket_bytes=BUCKET)
    backend = FakeBackend(models[1])
    with pytest.raises(ConfigError, match="EmbeddedEngine, which has no server process to join a process group"):
        sync.sync(backend, EmbeddedEngine(hf), version=1)
    assert backend.finished


def test_a_flattened_bucket_of_mixed_dtypes_is_rebuilt_bit_for_bit_by_sglangs_receive():
    """The sender's layout (largest element first) against the receive as SGLang 0.5.23 does it (the
    stand-in's ``flattened_receive``, which refuses a misaligned slice as SGLang does): odd sizes of
    1-, 2-, 4- and 8-byte dtypes in an order that would misalign them as given."""
    g = torch.Generator().manual_seed(0)
    given = [("a.norm", torch.randn(3, generator=g).to(torch.bfloat16)), ("b.mask", torch.tensor([True, False, True])),
             ("c.weight", torch.randn(5, 3, generator=g)), ("d.steps", torch.arange(7, dtype=torch.int64)),
             ("e.scale", torch.randn(1, generator=g, dtype=torch.float64)), ("f.q", torch.randint(-8, 8, (5,),
                                                                                                 dtype=torch.int8)),
             ("g.bias", torch.randn(2, 2, generator=g).to(torch.float16))]
    names, tensors = [n for n, _ in given], [t for _, t in given]
    with pytest.raises(ValueError, match="Unaligned received tensor"):  # as given, c.weight would sit at byte 9
        flattened_receive(names, [str(t.dtype).replace("torch.", "") for t in tensors], [list(t.shape) for t in tensors])
    sent_names, sent, flat = flatten_bucket(names, tensors)
    assert sorted(sent_names) == sorted(names) and flat.dtype == torch.uint8
    assert [t.element_size() for t in sent] == sorted((t.element_size() for t in tensors), reverse=True)
    buffer, rebuild = flattened_receive(sent_names, [str(t.dtype).replace("torch.", "") for t in sent],
                                        [list(t.shape) for t in sent])
    buffer.copy_(flat)  # what the broadcast delivers
    got = dict(rebuild())
    assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in given)


@pytest.mark.parametrize("version,flattened", [("0.5.18", True), ("0.5.23", None)])
def test_one_broadcast_per_tensor_for_older_servers_and_gloo_groups(models, version, flattened):
    """Servers older than 0.5.19 have no flattened receive (even when asked for); a gloo group sends per tensor
    unless told (the flattening copy costs more on CPU than it saves: benchmarks/weight_sync.py). One server:
    two in this process cannot join the same group."""
    hf, _, new = models
    with SGLangStandIn(hf, group_timeout_s=30, version=version) as server:
        engine = SGLangEngine([server.url], timeout_s=30, update_timeout_s=30, connect_retries=0)
        sync = DistributedSynchronizer(bucket_bytes=BUCKET, timeout_s=30, flattened=flattened)
        backend = FakeBackend(new)
        try:
            sync.sync(backend, engine, version=1)
            assert server.distributed_formats == [None] * len(backend.buckets) > []
            assert [names for _, names in server.distributed_updates] == backend.buckets
            assert all(torch.equal(dict(server.engine.named_weights())[n], t) for n, t in new.items())
        finally:
            sync.shutdown()
            engine.close()
