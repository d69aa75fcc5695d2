"""The disk transport (``DiskSynchronizer``) into the real ``EmbeddedEngine`` on a tiny model.

The trainer side is the bucketed ``FakeBackend`` of test_weight_sync; the engine loads what
the transport published (``update_weights_from_disk``), so "the weights landed" is the
engine's own answer. Checked: generations change after a sync and come back with the old
weights, each version is published complete (``v<version>/`` shards of one bucket + index + config) and
pruned to two, a writer that fails mid-write publishes nothing loadable and leaves no
temporary dir while the export still runs to the end, the metrics, the check-equal path.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.errors import SyncError
from megatron_rl.infra.disk_space import SyncDiskFull
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.weight_dir import VersionedWeightDir
from megatron_rl.weight_sync.disk import DiskSynchronizer

from test_weight_sync import FakeBackend, checkpoint_tensors, nbytes  # tests/weight_sync is on sys.path (rootdir)

METRIC_KEYS = {"sync/time_s", "sync/bytes", "sync/buckets", "sync/weight_version", "sync/write_s", "sync/load_s"}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]


@pytest.fixture
def setup(tiny_hf_models, tmp_path):
    hf = tiny_hf_models("qwen2")
    engine = EmbeddedEngine(hf)
    sync = DiskSynchronizer(bucket_bytes=64 * 1024, disk_dir=str(tmp_path / "weights"), hf_checkpoint=hf)
    return engine, sync, checkpoint_tensors(hf), checkpoint_tensors(tiny_hf_models("qwen2", seed=1)), tmp_path


def tokens(engine):
    return [s.response_ids for s in engine.generate(REQUESTS, GREEDY)]


def test_sync_publishes_versions_the_engine_loads_and_prunes(setup):
    engine, sync, old, new, tmp = setup
    before = tokens(engine)
    backend = FakeBackend(new)
    metrics = sync.sync(backend, engine, version=1)

    assert backend.finished and backend.asked_bucket_bytes == [64 * 1024]
    assert set(metrics) == METRIC_KEYS
    assert metrics["sync/bytes"] == float(sum(nbytes(t) for t in new.values()))
    assert metrics["sync/buckets"] == float(len(backend.buckets)) > 1 and metrics["sync/weight_version"] == 1.0
    assert metrics["sync/write_s"] > 0 and metrics["sync/load_s"] > 0
    assert metrics["sync/time_s"] >= metrics["sync/write_s"] + metrics["sync/load_s"]
    assert engine.weight_version == 1 and tokens(engine) != before
    live = dict(engine.named_weights())
    assert all(torch.equal(live[n], t) for n, t in new.items())
    v1 = tmp / "weights" / "v1"
    # an HF dir, sharded by the bucket size: the driver never held more than one shard (plus one tensor)
    files = sorted(os.listdir(v1))
    shards = [f for f in files if f.startswith("model-")]
    assert files == ["config.json", "generation_config.json", *shards, "model.safetensors.index.json"]
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    index = json.loads((v1 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(new) and index["metadata"]["total_size"] == metrics["sync/bytes"]
    for shard in shards:
        held = load_file(v1 / shard)
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(held)
        assert len(held) == 1 or sum(nbytes(t) for t in held.values()) <= 64 * 1024
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(v1), dtype=torch.float32)
    assert all(torch.equal(p, new[n]) for n, p in hf_model.state_dict().items() if n in new)  # HF reads the layout

    sync.sync(FakeBackend(old), engine, version=2)
    assert tokens(engine) == before and engine.weight_version == 2  # the old weights: the old generations
    sync.sync(FakeBackend(new), engine, version=3)
    assert sorted(os.listdir(tmp / "weights")) == ["v2", "v3"]  # pruned to two, no temporary dirs
    samples = engine.generate(REQUESTS, GREEDY)
    assert {s.weight_version for s in samples} == {3}
    with pytest.raises(SyncError, match="older than the engine's weight_version 3"):
        sync.sync(FakeBackend(new), engine, version=2)


def test_a_crash_mid_write_publishes_nothing_and_finishes_the_export(setup, monkeypatch):
    engine, sync, old, new, tmp = setup
    sync.sync(FakeBackend(new), engine, version=1)
    import safetensors.torch

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:  # a truncated file, as a full disk or a kill would leave it
            fh.write(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_written)
    backend = FakeBackend(old)
    with pytest.raises(SyncDiskFull, match="writing .*/v2 failed: its filesystem is full .*No space left"):
        sync.sync(backend, engine, version=2)
    assert backend.finished  # the driver still ran the collective export to its end
    assert sorted(os.listdir(tmp / "weights")) == ["v1"]  # no v2, no .v2.*.tmp
    assert engine.weight_version == 1 and engine.health().ok
    monkeypatch.undo()

    # an exception inside the stream (the backend's export) leaves nothing either
    class Failing(FakeBackend):
        def export_weights(self, bucket_bytes):
            for i, bucket in enumerate(super().export_weights(bucket_bytes)):
                if i == 2:
                    raise RuntimeError("gather failed")
                yield bucket

    with pytest.raises(RuntimeError, match="gather failed"):
        sync.sync(Failing(old), engine, version=2)
    assert sorted(os.listdir(tmp / "weights")) == ["v1"] and engine.weight_version == 1
    sync.sync(FakeBackend(old), engine, version=2)  # and the next sync works
    assert engine.weight_version == 2


def test_engine_refuses_a_dir_without_weights_and_bad_names(setup):
    engine, sync, old, new, tmp = setup
    (tmp / "empty").mkdir()
    with pytest.raises(SyncError, match=f"no \\*.safetensors in {tmp / 'empty'}"):
        engine.update_weights_from_disk(str(tmp / "empty"), 1)
    path = VersionedWeightDir(str(tmp / "bad")).write({"model.not_a_tensor": torch.zeros(2)}.items(), 1)
    with pytest.raises(SyncError, match="1 unknown name"):  # the same checks as update_weights
        engine.update_weights_from_disk(path, 1)
    assert engine.weight_version == 0


def test_rank_without_engine_runs_the_export_and_writes_nothing(setup):
    engine, sync, old, new, tmp = setup
    backend = FakeBackend(new)
    metrics = sync.sync(backend, None, version=1)
    assert backend.finished and set(metrics) == METRIC_KEYS and metrics["sync/write_s"] == 0.0
    assert not (tmp / "weights").exists() and engine.weight_version == 0


def test_check_equal_with_the_embedded_engine(setup):
    engine, _, old, new, tmp = setup
    sync = DiskSynchronizer(bucket_bytes=1 << 20, check_equal=True, disk_dir=str(tmp / "w"))
    metrics = sync.sync(FakeBackend(new), engine, version=1)
    assert metrics["sync/checked_tensors"] == float(len(new))
