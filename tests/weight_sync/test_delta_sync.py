"""``--update-weight-mode delta`` and ``--update-weight-verify checksum`` into the real embedded engine.

The trainer side is the fake backend of test_weight_sync (HF-named float32 tensors in buckets); the engine
is the real ``EmbeddedEngine`` on a tiny random qwen2 (float32, and bfloat16 where the engine's dtype
matters). A run of training is imitated by a sequence of weight states: each step changes a few elements of
some tensors, every element of one, and leaves the others alone; a float32 step small enough to leave a
bf16 engine's value as it was is among them.
"""

import json

import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, SyncError
from megatron_rl.rollout import EmbeddedEngine
from megatron_rl.rollout.weight_delta import (
    DeltaBaseMismatch,
    TensorDelta,
    WeightChecksumMismatch,
    encode,
    tensor_checksum,
)
from megatron_rl.weight_sync import make_synchronizer_from_config
from megatron_rl.weight_sync.delta import EngineUpdates
from megatron_rl.weight_sync.disk import DiskSynchronizer
from megatron_rl.weight_sync.in_process import InProcessSynchronizer

from test_weight_sync import FakeBackend, TamperingEngine, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

BUCKET = 64 * 1024


def steps(start, n, seed=0):
    """``n`` weight states after ``start``: per step, a few elements of every other tensor move, one tensor
    moves everywhere, one moves by less than a bf16 ulp (float32 sees it, bf16 does not)."""
    g = torch.Generator().manual_seed(seed)
    names = list(start)
    state = {k: v.clone() for k, v in start.items()}
    out = []
    for i in range(n):
        for j, name in enumerate(names):
            t = state[name]
            if j % 2 == i % 2:
                flat = t.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
                flat[idx] += torch.randn(idx.numel(), generator=g)
        dense = names[(3 * i) % len(names)]
        state[dense] = state[dense] + 0.01 * torch.randn(state[dense].shape, generator=g)
        tiny = names[(3 * i + 1) % len(names)]
        state[tiny] = state[tiny] * (1 + 1e-5)  # below bf16's resolution: a bf16 engine keeps its bits
        out.append({k: v.clone() for k, v in state.items()})
    return out


def make_sync(transport, tmp_path, hf, **updates):
    updates = EngineUpdates(**updates)
    if transport == "disk":
        return DiskSynchronizer(bucket_bytes=BUCKET, disk_dir=str(tmp_path / "w"), hf_checkpoint=hf, updates=updates)
    return InProcessSynchronizer(bucket_bytes=BUCKET, updates=updates)


def live(engine):
    return {n: t.clone() for n, t in engine.named_weights()}


@pytest.mark.parametrize("transport,encoding,dtype,verify", [
    ("tensor", "xor", torch.float32, True), ("tensor", "overwrite", torch.bfloat16, True),
    ("disk", "xor", torch.bfloat16, True), ("disk", "overwrite", torch.float32, False)])
def test_n_delta_syncs_leave_the_engine_bit_for_bit_as_a_full_sync(tiny_hf_models, tmp_path, transport, encoding,
                                                                   dtype, verify):
    hf = tiny_hf_models("qwen2")
    start = checkpoint_tensors(hf)
    states = steps(start, 4)
    engine = EmbeddedEngine(hf, dtype=dtype)
    sync = make_sync(transport, tmp_path, hf, mode="delta", encoding=encoding, verify=verify)
    full_bytes = None
    for version, state in enumerate([start] + states):
        m = sync.sync(FakeBackend(state), engine, version=version)
        assert engine.weight_version == version and engine.health().ok
        assert m.get("sync/verified_tensors") == (len(start) if verify else None)
        if version == 0:  # no copy of the engine's weights yet: every tensor
            assert m["sync/delta"] == 0.0 and m["sync/delta_fallbacks"] == 0.0
            full_bytes = m["sync/full_bytes"]
        else:
            assert m["sync/delta"] == 1.0 and m["sync/bytes"] < 0.5 * full_bytes
            assert m["sync/delta_fraction"] == m["sync/bytes"] / full_bytes
    reference = EmbeddedEngine(hf, dtype=dtype)
    InProcessSynchronizer(bucket_bytes=BUCKET).sync(FakeBackend(states[-1]), reference, version=4)
    got, want = live(engine), live(reference)
    assert set(got) == set(want)
    assert all(torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)) for n in want)
    if transport == "disk":  # the published version is a delta: delta.json beside the patches, with the checksums
        header = json.loads((tmp_path / "w" / "v4" / "delta.json").read_text())  # the engine checks (none: verified)
        assert (header["base_version"], header["version"], header["checksum"]) == (3, 4, "" if verify else "xxh3-128")


def test_a_bf16_engine_is_sent_nothing_for_a_change_below_its_resolution(tiny_hf_models):
    new = torch.ones(64, dtype=torch.bfloat16)
    assert encode("w", new, new.clone(), "xor", "xxh3-128") is None  # no bit changed
    sparse = new.clone()
    sparse[3] = 2.0
    d = encode("w", sparse, new, "xor", "xxh3-128")
    assert d.kind == "xor" and d.indices.tolist() == [3] and d.nbytes == 4 + 2
    dense = encode("w", new * 2, new, "overwrite", "sha256")
    assert dense.kind == "dense" and dense.nbytes == 128  # indices + values would be larger
    target = new.clone()
    d.apply_to(target)
    assert torch.equal(target, sparse) and d.checksum == tensor_checksum(sparse, "xxh3-128")


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_an_engine_at_another_version_gets_a_full_sync(tiny_hf_models, tmp_path, transport):
    hf = tiny_hf_models("qwen2")
    start = checkpoint_tensors(hf)
    s1, s2, s3 = steps(start, 3, seed=1)
    engine = EmbeddedEngine(hf)
    sync = make_sync(transport, tmp_path, hf, mode="delta", verify=True)
    sync.sync(FakeBackend(start), engine, version=0)
    assert sync.sync(FakeBackend(s1), engine, version=1)["sync/delta"] == 1.0
    # someone else moved the engine on (another trainer, a manual load): the copy is no longer its base
    InProcessSynchronizer(bucket_bytes=BUCKET).sync(FakeBackend(s3), engine, version=2)
    m = sync.sync(FakeBackend(s2), engine, version=3)
    assert m["sync/delta"] == 0.0 and m["sync/delta_fallbacks"] == 1.0
    assert all(torch.equal(live(engine)[n], s2[n]) for n in s2)
    # a fresh engine (restarted, replaced) at version 3 is not the one the copy is of: full again
    fresh = EmbeddedEngine(hf)
    fresh._weight_version = 3
    m = sync.sync(FakeBackend(s3), fresh, version=4)
    assert m["sync/delta"] == 0.0 and m["sync/delta_fallbacks"] == 2.0
    assert all(torch.equal(live(fresh)[n], s3[n]) for n in s3)
    assert sync.sync(FakeBackend(s1), fresh, version=5)["sync/delta"] == 1.0


def test_the_engine_refuses_a_delta_on_another_base_before_changing_anything(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("qwen2"))
    before = live(engine)
    name = next(iter(before))
    patch = TensorDelta(name, "dense", tuple(before[name].shape), before[name].dtype, before[name] + 1)
    with pytest.raises(DeltaBaseMismatch, match="based on version 7, but the engine holds version 0"):
        engine.update_weights_delta(iter([patch]), base_version=7, version=8)
    assert engine.weight_version == 0 and engine.health().ok and torch.equal(live(engine)[name], before[name])
    # a delta applied onto other bits than its base: the engine's own check names the tensor
    other_base = before[name] + 1
    target = other_base.clone()
    target.view(-1)[0] += 1.0
    wrong = encode(name, target, other_base, "xor", "xxh3-128")
    assert wrong.kind == "xor"
    with pytest.raises(SyncError, match=f"{name}: after the xor patch its xxh3-128 is not the trainer's"):
        engine.update_weights_delta(iter([wrong]), base_version=0, version=1)
    assert not engine.health().ok  # refuses to generate until a full update


class PerturbingEngine:
    """The real engine, but one tensor comes out of every update other than it went in."""

    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def _perturb(self):
        with torch.no_grad():
            self.inner.param_map.view(self.name).view(-1)[0] += 1.0

    def update_weights(self, named_tensors, version):
        self.inner.update_weights(named_tensors, version)
        self._perturb()

    def update_weights_delta(self, deltas, base_version, version):
        self.inner.update_weights_delta(deltas, base_version, version)
        self._perturb()

    def update_weights_from_disk(self, path, version):
        self.inner.update_weights_from_disk(path, version)
        self._perturb()

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


@pytest.mark.parametrize("transport,mode", [("tensor", "full"), ("tensor", "delta"), ("disk", "delta"),
                                            ("disk", "full")])
def test_a_tensor_perturbed_inside_the_engine_is_named_after_the_sync(tiny_hf_models, tmp_path, transport, mode):
    hf = tiny_hf_models("qwen2")
    start = checkpoint_tensors(hf)
    (s1,) = steps(start, 1, seed=2)
    name = "model.layers.0.mlp.down_proj.weight"
    inner = EmbeddedEngine(hf)
    sync = make_sync(transport, tmp_path, hf, mode=mode, verify=True)
    sync.sync(FakeBackend(start), inner, version=0)
    engine = PerturbingEngine(inner, name)
    with pytest.raises(WeightChecksumMismatch, match=rf"version 1 .* 1 of \d+ tensor\(s\): {name} \(bucket \d+\)"):
        sync.sync(FakeBackend(s1), engine, version=1)
    if mode == "delta":  # the next sync does not trust the copy: every tensor, which repairs the engine
        m = sync.sync(FakeBackend(s1), inner, version=2)
        assert m["sync/delta"] == 0.0 and torch.equal(live(inner)[name], s1[name])


def test_a_tensor_changed_between_syncs_is_caught_though_the_delta_leaves_it_out(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    start = checkpoint_tensors(hf)
    engine = EmbeddedEngine(hf)
    sync = InProcessSynchronizer(bucket_bytes=BUCKET, updates=EngineUpdates(mode="delta", verify=True))
    sync.sync(FakeBackend(start), engine, version=0)
    name = "model.norm.weight"
    with torch.no_grad():
        engine.param_map.view(name)[0] += 1.0  # the engine's copy drifts; the trainer's weights do not move
    with pytest.raises(WeightChecksumMismatch, match=f"{name} \\(bucket"):
        sync.sync(FakeBackend(start), engine, version=1)


def test_flags_map_and_refuse(tiny_hf_models, tmp_path):
    hf = tiny_hf_models("qwen2")
    sync = make_synchronizer_from_config(parse_config(
        ["--hf-checkpoint", hf, "--update-weight-mode", "delta", "--update-weight-delta-encoding", "overwrite",
         "--update-weight-delta-checksum", "sha256"]))
    u = sync.updates
    assert (u.mode, u.encoding, u.checksum, u.verify) == ("delta", "overwrite", "sha256", True)
    assert make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf])).updates.verify  # auto: on here
    off = make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf, "--update-weight-verify", "off"]))
    assert not off.updates.active
    with pytest.raises(ConfigError, match="--update-weight-mode delta with SGLang servers on other hosts "
                                          r"\(http://10.0.0.7:1\)"):  # loopback servers: tests/.../test_sglang_delta.py
        parse_config(["--hf-checkpoint", hf, "--rollout-backend", "sglang", "--rollout-engine-urls",
                      "http://10.0.0.7:1", "--update-weight-transport", "disk", "--update-weight-disk-dir",
                      str(tmp_path / "w"), "--update-weight-mode", "delta", "--dry-run"])
    with pytest.raises(ConfigError, match="--update-weight-mode delta with --colocate: the embedded engine gives"):
        parse_config(["--hf-checkpoint", hf, "--update-weight-mode", "delta", "--colocate"])
    with pytest.raises(ConfigError, match="--update-weight-delta-encoding overwrite is only used by"):
        parse_config(["--hf-checkpoint", hf, "--update-weight-delta-encoding", "overwrite"])


class LaggingEngine:
    """The real engine, but it reports an older version than it holds (what the trainer sees of an engine that
    moved on between its health report and the update)."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def weight_version(self):
        return self.inner.weight_version - 1

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def test_a_delta_the_engine_refuses_before_reading_it_becomes_a_full_sync(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    start = checkpoint_tensors(hf)
    s1, s2 = steps(start, 2, seed=3)
    inner = EmbeddedEngine(hf)
    sync = InProcessSynchronizer(bucket_bytes=BUCKET, updates=EngineUpdates(mode="delta", verify=True))
    engine = LaggingEngine(inner)
    sync.sync(FakeBackend(start), engine, version=0)
    InProcessSynchronizer(bucket_bytes=BUCKET).sync(FakeBackend(s1), inner, version=1)  # the engine moves on,
    m = sync.sync(FakeBackend(s2), engine, version=2)  # but says version 0: the delta goes, and is refused
    assert m["sync/delta"] == 0.0 and m["sync/delta_fallbacks"] == 1.0 and inner.weight_version == 2
    assert all(torch.equal(live(inner)[n], s2[n]) for n in s2)


def test_auto_verification_leaves_out_an_engine_that_reports_no_checksums(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    engine = TamperingEngine(EmbeddedEngine(hf))  # speaks update_weights / named_weights only
    sync = InProcessSynchronizer(bucket_bytes=BUCKET, updates=EngineUpdates(verify=True, verify_auto=True))
    assert "sync/verified_tensors" not in sync.sync(FakeBackend(checkpoint_tensors(hf)), engine, version=1)
    assert EmbeddedEngine(hf).reports_weight_checksums()


class InProcessServer:
    """The embedded engine server run in this process, as ``ServedEmbeddedEngine`` holds its process: its url and
    log, and ``stop``. The protocol is the real server's; only the process around it is not started."""

    def __init__(self, server):
        self.server, self.url, self.log_path = server, server.url, "(in process)"

    def stop(self, grace_s):
        self.server.stop()


def test_the_served_embedded_engine_is_verified_after_each_sync(tiny_hf_models, tmp_path):
    """--embedded-engine-ranks process (async modes' engine): the server answers each tensor's checksum, so the
    trainer's post-apply check runs against it (auto: on), and a tensor it holds wrong is named."""
    from megatron_rl.rollout.embedded_process import ServedEmbeddedEngine
    from megatron_rl.rollout.embedded_server import EmbeddedServer

    hf = tiny_hf_models("qwen2")
    cfg = parse_config(["--hf-checkpoint", hf, "--async-mode", "one-step", "--update-weight-transport", "disk",
                        "--update-weight-disk-dir", str(tmp_path / "w")])
    assert cfg.embedded_placement == "process" and cfg.weight_update_verify == "checksum"
    sync = make_synchronizer_from_config(cfg)
    assert sync.updates.verify
    inner = EmbeddedEngine(hf)
    engine = ServedEmbeddedEngine(InProcessServer(EmbeddedServer(inner, model_path=hf).start()),
                                  weight_dir=str(tmp_path / "w"), hf_checkpoint=hf, releases_memory=False)
    try:
        start = checkpoint_tensors(hf)
        s1, s2 = steps(start, 2, seed=3)
        metrics = sync.sync(FakeBackend(s1), engine, version=1)
        assert metrics["sync/verified_tensors"] == len(start)
        assert all(torch.equal(t, s1[n]) for n, t in live(inner).items())
        name = "model.layers.1.self_attn.q_proj.weight"
        with pytest.raises(WeightChecksumMismatch, match=rf"version 2 .* {name} \(bucket \d+\)"):
            sync.sync(FakeBackend(s2), _PerturbServed(engine, inner, name), version=2)
    finally:
        engine.close()


class _PerturbServed:
    """The served engine, but one tensor inside its server comes out of the disk load other than it went in."""

    def __init__(self, engine, inner, name):
        self.engine, self.inner, self.name = engine, inner, name

    def update_weights_from_disk(self, path, version):
        self.engine.update_weights_from_disk(path, version)
        with torch.no_grad():
            self.inner.param_map.view(self.name).view(-1)[0] += 1.0

    def __getattr__(self, attr):
        return getattr(self.engine, attr)
