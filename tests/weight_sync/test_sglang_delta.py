"""``--update-weight-mode delta`` into SGLang servers through the host checkpoint (``rollout/sglang/host_checkpoint.py``).

SGLang cannot patch its weights in place; the driver keeps the servers' weights as safetensors on their host, patches
them with each delta the disk transport publishes and has the servers reload the changed tensors
(``/update_weights_from_disk``, which replaces exactly the tensors in the dir it is given). Here against CI's
protocol stand-in (``tests/rollout/sglang_standin.py``, the same endpoints and replies as SGLang 0.5.23; real SGLang:
``scripts/test_sglang_real.sh --steps delta_sync``): after N delta syncs the served weights equal the trainer's bit for
bit (what a full sync loads), each verified by the servers' checksums; a delta on another base is refused before
anything is written and a full sync follows; a patch interrupted mid-write is never loaded and the checkpoint stays
at its version.
"""

import glob
import logging
import os
import sys

import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError
from megatron_rl.plan.engines import EnginePlacement, EngineSlot
from megatron_rl.plan.sglang_weights import read_hf_config
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.host_checkpoint import HostCheckpoint
from megatron_rl.rollout.weight_delta import DeltaBaseMismatch, DeltaHeader, disk_entries, encode
from megatron_rl.rollout.weight_dir import VersionedWeightDir
from megatron_rl.weight_sync.delta import EngineUpdates
from megatron_rl.weight_sync.disk import DiskSynchronizer
from megatron_rl.weight_sync.sglang_verify import SGLangVerifier

from test_weight_sync import FakeBackend, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn  # noqa: E402 - on sys.path above

BUCKET = 64 * 1024


def _steps(start, n, seed=0):
    """``n`` successive trainer states: each moves a few elements of most tensors and leaves some tensors alone."""
    g = torch.Generator().manual_seed(seed)
    states, cur = [], {k: v.clone() for k, v in start.items()}
    for step in range(n):
        cur = {k: v.clone() for k, v in cur.items()}
        for i, t in enumerate(cur.values()):
            if (i + step) % 5 == 0:
                continue  # untouched this step: not sent
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
            flat[idx] += 0.01 * torch.randn(idx.numel(), generator=g)
        states.append(cur)
    return states


def _held(server):
    return {n: p.detach().clone() for n, p in server.engine.model.named_parameters()}


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.int32),
                                                                   b.reshape(-1).view(torch.int32))


@pytest.fixture(scope="module")
def served(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    with SGLangStandIn(hf) as server:
        yield hf, server, checkpoint_tensors(hf)


def _setup(hf, server, tmp_path, verify=True):
    engine = SGLangEngine([server.url], hf_checkpoint=hf, timeout_s=30, update_timeout_s=30, connect_retries=0,
                          health_interval_s=0, host_checkpoint=HostCheckpoint(str(tmp_path / "host"), hf_checkpoint=hf))
    sync = DiskSynchronizer(BUCKET, disk_dir=str(tmp_path / "disk"), hf_checkpoint=hf,
                            updates=EngineUpdates(mode="delta", encoding="xor"))
    if verify:
        sync.sglang_verifier = SGLangVerifier(read_hf_config(hf))
    return engine, sync


def test_n_delta_syncs_leave_the_servers_equal_to_a_full_sync(served, tmp_path):
    hf, server, start = served
    engine, sync = _setup(hf, server, tmp_path)
    states = _steps(start, 5)
    try:
        version = engine.weight_version
        for i, state in enumerate(states):
            version += 1
            loads = len(server.disk_updates)
            metrics = sync.sync(FakeBackend(state), engine, version)
            assert metrics["sync/delta"] == float(i > 0)
            assert metrics["sync/verified_tensors"] == 31.0  # SGLang's checksums of every tensor it holds
            assert engine.host_checkpoint.version == version
            assert len(server.disk_updates) == loads + 1
            loaded = server.disk_updates[-1][1]
            if i:  # the patch dir: exactly the tensors that changed, whole, from the host checkpoint
                assert metrics["sync/delta_fraction"] < 0.15, metrics
                assert loaded == engine.host_checkpoint.patches.path(version)
                changed = {n for n, t in state.items() if not torch.equal(t, states[i - 1][n])}
                assert set(checkpoint_tensors(loaded)) == changed and len(changed) < len(state)
        held = _held(server)
        assert all(_bits_equal(held[n], t) for n, t in states[-1].items())  # what a full sync of it loads
        assert engine.health().ok
    finally:
        engine.close()


def test_a_delta_on_another_base_is_refused_and_a_full_sync_follows(served, tmp_path, caplog):
    hf, server, start = served
    engine, sync = _setup(hf, server, tmp_path, verify=False)
    states = _steps(start, 4, seed=1)
    try:
        v = engine.weight_version
        for state in states[:2]:
            v += 1
            sync.sync(FakeBackend(state), engine, v)
        host = engine.host_checkpoint
        # a delta naming another base: refused by the engine and by the checkpoint before anything is written
        other = DeltaHeader(v - 1, v + 1, "xor", "")
        deltas = [d for d in (encode(n, t, states[0][n], "xor", "") for n, t in states[2].items()) if d is not None]
        bad = VersionedWeightDir(str(tmp_path / "bad")).write(disk_entries(deltas, other), v + 1,
                                                              extra_files=lambda: {"delta.json": other.to_json()})
        loads = len(server.disk_updates)
        with pytest.raises(DeltaBaseMismatch, match=f"based on version {v - 1}; the SGLang servers hold version {v}"):
            engine.update_weights_from_disk(bad, v + 1)
        with pytest.raises(DeltaBaseMismatch, match=f"host checkpoint in .* holds version {v}; it needs a full sync"):
            host.patch(bad)
        assert len(server.disk_updates) == loads and host.version == v and host.patches.versions() == [v]
        # the servers' checkpoint is at another version than the trainer's copy: the next sync is full, then deltas
        host.forget()
        with caplog.at_level(logging.WARNING, logger="megatron_rl.weight_sync.delta"):
            metrics = sync.sync(FakeBackend(states[2]), engine, v + 1)
        assert metrics["sync/delta"] == 0.0 and metrics["sync/delta_fallbacks"] == 1.0
        assert "sending every tensor, not a delta: the servers' host checkpoint" in caplog.text
        assert host.version == v + 1
        assert sync.sync(FakeBackend(states[3]), engine, v + 2)["sync/delta"] == 1.0
        # a server that restarted unseen reports another version: it gets every tensor, never a patch of a few
        engine.clients[0].update_weight_version("default", abort_all_requests=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_rl.weight_sync.delta"):
            assert sync.sync(FakeBackend(states[3]), engine, v + 3)["sync/delta"] == 0.0
        assert "server(s) report weight_version {'%s': 'default'}, not %d" % (server.url, v + 2) in caplog.text
        held = _held(server)
        assert all(_bits_equal(held[n], t) for n, t in states[3].items())
    finally:
        engine.close()


def test_a_patch_interrupted_mid_write_is_never_loaded(served, tmp_path, monkeypatch):
    import safetensors.torch

    hf, server, start = served
    engine, sync = _setup(hf, server, tmp_path, verify=False)
    states = _steps(start, 3, seed=2)
    real_save = safetensors.torch.save_file
    try:
        sync.sync(FakeBackend(states[0]), engine, 1)
        sync.sync(FakeBackend(states[1]), engine, 2)
        host = engine.host_checkpoint

        def dies_mid_write(tensors, path, metadata=None):
            if "/patches/" in path:  # the host checkpoint's patch: half a file, then the process "dies"
                real_save(tensors, path, metadata=metadata)
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)
                raise OSError(28, "No space left on device")
            real_save(tensors, path, metadata=metadata)

        monkeypatch.setattr(safetensors.torch, "save_file", dies_mid_write)
        loads = len(server.disk_updates)
        with pytest.raises(OSError, match="No space left"):
            sync.sync(FakeBackend(states[2]), engine, 3)
        monkeypatch.setattr(safetensors.torch, "save_file", real_save)
        assert len(server.disk_updates) == loads  # nothing was named to the server
        assert host.version == 2 and host.patches.versions() == [2]
        assert not glob.glob(str(tmp_path / "host" / "patches" / ".v3*")), "the half-written patch is removed"
        # a process that died there leaves a temporary state; the checkpoint reopened ignores and removes it
        os.makedirs(tmp_path / "host" / ".state-v3.x.tmp")
        reopened = HostCheckpoint(str(tmp_path / "host"), hf_checkpoint=hf)
        assert reopened.version == 2 and not glob.glob(str(tmp_path / "host" / ".state-v3*"))
        assert engine.health().ok and engine.weight_version == 2  # the servers kept version 2, complete
        metrics = sync.sync(FakeBackend(states[2]), engine, 3)  # the copy is of no version now: full, then deltas
        assert metrics["sync/delta"] == 0.0
        held = _held(server)
        assert all(_bits_equal(held[n], t) for n, t in states[2].items())
    finally:
        engine.close()


def test_validation_allows_servers_on_this_host_through_the_disk_transport(tiny_hf_models, tmp_path):
    hf = tiny_hf_models("qwen2")
    d = str(tmp_path / "w")
    base = ["--hf-checkpoint", hf, "--rollout-backend", "sglang", "--update-weight-mode", "delta", "--dry-run"]
    cfg = parse_config([*base, "--rollout-engine-urls", "http://127.0.0.1:1", "http://localhost:2",
                        "--update-weight-transport", "disk", "--update-weight-disk-dir", d])
    assert cfg.sync.update_weight_mode == "delta" and cfg.weight_update_verify == "off"
    placement = EnginePlacement((EngineSlot(0, "http://127.0.0.1:1", 0, (), (0,), "/tmp/engine0.log"),), colocated=False)
    engine = SGLangEngine.from_config(cfg, placement)  # (a placement: no router looked for at these URLs)
    try:
        assert engine.host_checkpoint is not None and engine.host_checkpoint.root == os.path.join(d, "host_checkpoint")
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="goes through --update-weight-transport disk .* not distributed"):
        parse_config([*base, "--rollout-engine-urls", "http://127.0.0.1:1", "--update-weight-transport",
                      "distributed"])
    with pytest.raises(ConfigError, match=r"servers on other hosts \(http://10\.1\.2\.3:30000\).* not built"):
        parse_config([*base, "--rollout-engine-urls", "http://127.0.0.1:1", "http://10.1.2.3:30000",
                      "--update-weight-transport", "disk", "--update-weight-disk-dir", d])
