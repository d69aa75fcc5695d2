"""Weight sync (``InProcessSynchronizer`` into a real ``EmbeddedEngine``), and the name -> implementation tables.

The trainer side is a small fake backend: ``export_weights(bucket_bytes)`` yields
buckets of ``(hf_name, tensor)`` by the real backends' rule (``backends.base.bucketed``:
a bucket closes once it holds at least ``bucket_bytes``, so a tensor larger than that
is a bucket of its own), and records what the synchronizer asked for and whether the
export ran to the end. The real megatron and FSDP backends' own exports are checked
against that rule too (one rank, built in this process). The engine side is the real
embedded engine on a tiny random HF model, so "the version lands" and "the weights
land" are the engine's own answers.

Also here: the ``--rollout-backend`` table (``rollout.base.ENGINES``) and the
driver's rollout builder (``rollout.build.build_rollout``), which share the
registry pattern with ``--update-weight-transport`` (``weight_sync.base.TRANSPORTS``).
"""

import glob
import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.backends.base import bucketed
from megatron_rl.models.fused_loads import load_units
from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, SyncError
from megatron_rl.rollout import ENGINES, EmbeddedEngine, GenerateRequest, SamplingParams, make_engine
from megatron_rl.rollout.build import build_rollout
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.weight_sync import TRANSPORTS, WeightSynchronizer, make_synchronizer, make_synchronizer_from_config
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.weight_sync.disk import DiskSynchronizer
from megatron_rl.weight_sync.distributed import DistributedSynchronizer
from megatron_rl.weight_sync.in_process import InProcessSynchronizer

METRIC_KEYS = {"sync/time_s", "sync/bytes", "sync/buckets", "sync/weight_version"}
NO_URLS = ("--rollout-backend sglang needs servers: the engines this run launches, or --rollout-engine-urls of "
           "running servers")


def checkpoint_tensors(path):
    tensors = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def nbytes(tensor):
    return tensor.numel() * tensor.element_size()


def check_bucket_rule(buckets, bucket_bytes):
    """``--update-weight-buffer-size``'s rule (``backends.base.bucketed``): a bucket closes with the load unit
    (a tensor, or the tensors the engine fuses: ``models.fused_loads``) that brings it to ``bucket_bytes`` or
    past, never earlier; only the last may stay below."""
    sizes = [[sum(nbytes(t) for _, t in unit) for unit in load_units(bucket)] for bucket in buckets]
    assert sizes and all(sizes), "an empty export or an empty bucket"
    for k, bucket in enumerate(sizes):
        assert sum(bucket) - bucket[-1] < bucket_bytes, f"bucket {k} reached the budget before its last unit"
        if k < len(sizes) - 1:
            assert sum(bucket) >= bucket_bytes, f"bucket {k} closed below the budget ({sum(bucket)} B)"


class FakeBackend:
    """The trainer side of a sync: exports ``tensors`` in buckets of at least ``bucket_bytes`` (the last
    excepted), as the real backends do (``backends.base.bucketed``)."""

    def __init__(self, tensors):
        self.tensors = dict(tensors)
        self.asked_bucket_bytes = []
        self.buckets = []  # the buckets of the last export, as lists of names
        self.finished = False

    def export_weights(self, bucket_bytes):
        self.asked_bucket_bytes.append(bucket_bytes)
        self.buckets, self.finished = [], False
        for bucket in bucketed(iter(self.tensors.items()), bucket_bytes):
            self.buckets.append([n for n, _ in bucket])
            yield bucket
        self.finished = True


class TamperingEngine:
    """Speaks the engine protocol over a real engine, but alters or drops tensors on the way in."""

    def __init__(self, inner, alter=(), drop=()):
        self.inner, self.alter, self.drop = inner, set(alter), set(drop)

    def update_weights(self, named_tensors, version):
        self.inner.update_weights(((n, t + 1.0 if n in self.alter else t) for n, t in named_tensors
                                   if n not in self.drop), version)

    def named_weights(self):
        return self.inner.named_weights()

    @property
    def weight_version(self):
        return self.inner.weight_version


@pytest.fixture
def models(tiny_hf_models):
    """(engine on the seed-0 checkpoint, tensors of the seed-1 checkpoint: other values, same names/shapes)."""
    return EmbeddedEngine(tiny_hf_models("qwen2")), checkpoint_tensors(tiny_hf_models("qwen2", seed=1))


# ---------------------------------------------------------------- the real backends' buckets


@pytest.fixture(scope="module")
def real_backends(tiny_hf_models):
    """The megatron and FSDP backends, one rank each, built in this process on the tiny qwen2 (a private
    one-rank gloo group, torn down after the module if made here; ~5 s for both)."""
    import torch.distributed as dist

    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.models.parallel import destroy_parallel

    hf = tiny_hf_models("qwen2")
    made = not dist.is_initialized()
    built = {}
    try:
        for kind in ("megatron", "fsdp"):  # megatron first: its initialize makes the group, FSDP joins it
            cfg = parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "1", "--train-backend", kind,
                                "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                                "--micro-batch-size", "1"])
            backend = make_backend(kind)
            backend.initialize(cfg, PolicyGradientSpec(PolicyGradientConfig()))
            built[kind] = backend
        yield hf, built
    finally:
        destroy_parallel()
        if made and dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["megatron", "fsdp"])
def test_the_real_backends_close_a_bucket_only_after_it_passes_the_budget(real_backends, kind):
    """``--update-weight-buffer-size`` in the backends' own ``export_weights`` (not a fake's): each bucket
    closes with the tensor that brings it to the budget or past it, no tensor is split or repeated, and the
    buckets are the one-bucket export cut in order, bit for bit; the synchronizer streams them as they are."""
    hf, backends = real_backends
    backend = backends[kind]
    whole = [(n, t.clone()) for bucket in backend.export_weights(1 << 40) for n, t in bucket]
    assert len(list(backend.export_weights(1 << 40))) == 1
    total = sum(nbytes(t) for _, t in whole)
    budget = total // 5
    buckets = list(backend.export_weights(budget))
    assert 4 <= len(buckets) <= 6
    check_bucket_rule(buckets, budget)
    flat = [(n, t) for bucket in buckets for n, t in bucket]
    assert [n for n, _ in flat] == [n for n, _ in whole]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(flat, whole))
    one_byte = list(backend.export_weights(1))  # every load unit passes a 1-byte budget: a bucket each
    assert [len(list(load_units(b))) for b in one_byte] == [1] * len(one_byte)
    assert sum(len(b) for b in one_byte) == len(whole)
    # through the synchronizer into a real engine: the same buckets, the weights land
    engine = EmbeddedEngine(hf)
    metrics = InProcessSynchronizer(bucket_bytes=budget).sync(backend, engine, version=1)
    assert metrics["sync/buckets"] == float(len(buckets)) and metrics["sync/bytes"] == float(total)
    live = dict(engine.named_weights())
    assert all(torch.equal(live[n], t) for n, t in whole)


# ---------------------------------------------------------------- InProcessSynchronizer


@pytest.mark.parametrize("bucket_bytes", [1, 64 * 1024, 1 << 40])
def test_sync_streams_every_bucket_into_the_engine(models, bucket_bytes):
    engine, new = models
    backend = FakeBackend(new)
    metrics = InProcessSynchronizer(bucket_bytes=bucket_bytes).sync(backend, engine, version=1)

    assert backend.asked_bucket_bytes == [bucket_bytes] and backend.finished
    assert set(metrics) == METRIC_KEYS and metrics["sync/time_s"] >= 0.0
    total = sum(nbytes(t) for t in new.values())
    assert metrics["sync/bytes"] == float(total)
    assert metrics["sync/buckets"] == float(len(backend.buckets))
    assert [n for b in backend.buckets for n in b] == list(new)  # every tensor, once, in export order
    if bucket_bytes == 1:  # every load unit (a tensor, or q/k/v ...: models.fused_loads) passes it: a bucket each
        assert len(backend.buckets) == len(list(load_units(new.items())))
    elif bucket_bytes == 1 << 40:
        assert len(backend.buckets) == 1
    else:  # each bucket closes with the load unit that passes the budget
        assert 1 < len(backend.buckets) <= total / bucket_bytes + 1
        check_bucket_rule([[(n, new[n]) for n in names] for names in backend.buckets], bucket_bytes)
    assert metrics["sync/weight_version"] == 1.0 and engine.weight_version == 1
    live = dict(engine.named_weights())
    assert set(live) == set(new)
    assert all(torch.equal(live[n], t) for n, t in new.items())


def test_versions_move_forward_and_land_on_the_engine(models):
    engine, new = models
    sync = InProcessSynchronizer(bucket_bytes=1 << 20)
    old = {n: t.clone() for n, t in engine.named_weights()}
    assert sync.sync(FakeBackend(new), engine, version=1)["sync/weight_version"] == 1.0
    assert sync.sync(FakeBackend(old), engine, version=2)["sync/weight_version"] == 2.0
    assert engine.weight_version == 2 and engine.health().ok
    samples = engine.generate([GenerateRequest([5, 17, 3], 0)], SamplingParams(max_new_tokens=3, seed=0, n=2))
    assert [s.weight_version for s in samples] == [2, 2]
    with pytest.raises(SyncError, match="older than the engine's weight_version 2"):
        sync.sync(FakeBackend(new), engine, version=1)
    assert engine.weight_version == 2


def test_check_equal_passes_when_the_engine_holds_what_was_sent(models):
    engine, new = models
    metrics = InProcessSynchronizer(bucket_bytes=1 << 20, check_equal=True).sync(FakeBackend(new), engine, version=1)
    assert set(metrics) == METRIC_KEYS | {"sync/checked_tensors"}
    assert metrics["sync/checked_tensors"] == float(len(new))


def test_check_equal_names_altered_dropped_and_unsent_tensors(models):
    engine, new = models
    altered, dropped, unsent = "model.norm.weight", "model.layers.2.mlp.down_proj.weight", "lm_head.weight"
    backend = FakeBackend({n: t for n, t in new.items() if n != unsent})
    tampering = TamperingEngine(engine, alter=[altered], drop=[dropped])
    with pytest.raises(SyncError) as err:
        InProcessSynchronizer(bucket_bytes=1 << 20, check_equal=True).sync(backend, tampering, version=1)
    message = str(err.value)
    assert "--check-weight-update-equal" in message
    assert "differs from the trainer in 2 tensor(s)" in message and altered in message and dropped in message
    assert f"was not sent 1 ['{unsent}']" in message
    assert engine.weight_version == 1  # the engine took the (partial) update; the check is what caught it


def test_check_equal_ignores_dtype_of_the_export_but_not_values(models):
    engine, new = models
    exact = {n: t.to(torch.bfloat16) for n, t in new.items()}  # the engine casts to fp32: bf16 values survive
    metrics = InProcessSynchronizer(bucket_bytes=1 << 20, check_equal=True).sync(FakeBackend(exact), engine, 1)
    assert metrics["sync/checked_tensors"] == float(len(new))


def test_rank_without_engine_still_runs_the_whole_export(models):
    engine, new = models
    backend = FakeBackend(new)
    metrics = InProcessSynchronizer(bucket_bytes=64 * 1024, check_equal=True).sync(backend, None, version=3)
    assert backend.finished and metrics["sync/buckets"] == float(len(backend.buckets)) > 1
    assert metrics["sync/bytes"] == float(sum(nbytes(t) for t in new.values()))
    assert set(metrics) == METRIC_KEYS  # nothing to check without an engine
    assert engine.weight_version == 0  # untouched


# ---------------------------------------------------------------- --update-weight-transport table


def test_transport_table():
    sync = make_synchronizer("tensor", bucket_bytes=123, check_equal=True, driver_rank=2)
    assert isinstance(sync, InProcessSynchronizer) and isinstance(sync, WeightSynchronizer)
    assert (sync.bucket_bytes, sync.check_equal, sync.driver_rank) == (123, True, 2)
    assert TRANSPORTS.available() == ["disk", "distributed", "tensor"]
    assert TRANSPORTS.get("disk") is DiskSynchronizer
    assert TRANSPORTS.get("distributed") is DistributedSynchronizer
    with pytest.raises(ConfigError, match="--update-weight-disk-dir"):  # disk without its directory
        make_synchronizer("disk", bucket_bytes=1)
    distributed = make_synchronizer("distributed", bucket_bytes=77)
    assert isinstance(distributed, DistributedSynchronizer) and distributed.bucket_bytes == 77
    assert make_synchronizer("distributed", bucket_bytes=1, check_equal=True).check_equal  # SGLang compares inside
    with pytest.raises(ConfigError) as err:
        make_synchronizer("nccl", bucket_bytes=1)
    assert str(err.value) == ("--update-weight-transport='nccl' is not a known weight-sync transport; choose one "
                              "of disk, distributed, tensor")


def test_synchronizer_from_config_maps_the_flags(tiny_hf_models, tmp_path):
    hf = tiny_hf_models("qwen2")
    sync = make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf, "--update-weight-buffer-size", "4096",
                                                       "--check-weight-update-equal"]))
    assert isinstance(sync, InProcessSynchronizer)
    assert (sync.bucket_bytes, sync.check_equal, sync.driver_rank) == (4096, True, 0)
    default = make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf]))
    assert (default.bucket_bytes, default.check_equal) == (512 * 1024 * 1024, False)
    disk = make_synchronizer_from_config(parse_config(["--hf-checkpoint", hf, "--update-weight-transport", "disk",
                                                       "--update-weight-disk-dir", str(tmp_path / "w"),
                                                       "--update-weight-buffer-size", "4096"]))
    assert isinstance(disk, DiskSynchronizer) and disk.bucket_bytes == 4096
    assert (disk.weights.root, disk.weights.hf_checkpoint, disk.weights.keep_versions) == (str(tmp_path / "w"), hf, 2)
    # validation refuses distributed with the embedded engine; a config that skipped validation gets the
    # synchronizer, which refuses the embedded engine at the first sync (tests/weight_sync/test_distributed_transport)
    cfg = parse_config(["--hf-checkpoint", hf, "--update-weight-transport", "distributed",
                        "--update-weight-buffer-size", "4096"], validate=False)
    distributed = make_synchronizer_from_config(cfg)
    assert isinstance(distributed, DistributedSynchronizer) and distributed.bucket_bytes == 4096


# ---------------------------------------------------------------- --rollout-backend table and the builder


def test_engine_table(tiny_hf_models):
    assert ENGINES.available() == ["embedded", "sglang"]
    assert ENGINES.rows()["embedded"] == "megatron_rl.rollout.embedded:EmbeddedEngine"  # imported on first use
    assert ENGINES.get("embedded") is EmbeddedEngine
    assert ENGINES.get("sglang") is SGLangEngine
    engine = make_engine("embedded", hf_checkpoint=tiny_hf_models("qwen2"), max_batch_size=3)
    assert isinstance(engine, EmbeddedEngine) and engine.max_batch_size == 3
    sglang = make_engine("sglang", urls=["http://127.0.0.1:1"])
    assert isinstance(sglang, SGLangEngine) and sglang.urls == ["http://127.0.0.1:1"]
    sglang.close()
    with pytest.raises(ConfigError) as err:
        make_engine("vllm")
    assert str(err.value) == "--rollout-backend='vllm' is not a known rollout engine; choose one of embedded, sglang"


@pytest.fixture
def rollout_flags(tiny_hf_models, tmp_path):
    """``flags(*extra, prompt_data=True)``: argv for a small rollout; ``REWARD`` in ``extra`` is a reward file."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n" for i in range(1, 4)))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": [7, 8], "label": "1"}) + "\n")
    reward = tmp_path / "length_reward.py"  # the tiny model has no tokenizer: a reward on token ids
    reward.write_text("def score(sample):\n    return float(len(sample.response_ids))\n")

    def flags(*extra, prompt_data=True):
        data = ["--prompt-data", str(prompts), "--eval-prompt-data", str(evals)] if prompt_data else []
        extra = [e.replace("REWARD", str(reward)) for e in extra]
        return ["--hf-checkpoint", tiny_hf_models("qwen2"), *data, "--rollout-batch-size", "2",
                "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3", *extra]

    return flags


def test_build_rollout_gets_the_engine_from_the_table(rollout_flags, monkeypatch):
    built = []
    real = EmbeddedEngine.from_config.__func__
    monkeypatch.setattr(EmbeddedEngine, "from_config",
                        classmethod(lambda cls, cfg: built.append(cfg) or real(cls, cfg)))
    cfg = parse_config(rollout_flags("--custom-rm-path", "REWARD:score"))
    manager = build_rollout(cfg)
    assert isinstance(manager, RolloutManager) and isinstance(manager.engine, EmbeddedEngine)
    assert built == [cfg]
    assert len(manager.eval_dataset) == 1 and len(manager.prompts.dataset) == 3
    samples, metrics = manager.generate(0)
    assert len(samples) == 4 and [s.group_index for s in samples] == [0, 0, 1, 1]
    assert metrics["rollout/weight_version"] == 0.0 and [s.reward for s in samples] == [3.0] * 4


def test_build_rollout_fails_fast(rollout_flags, monkeypatch):
    def no_engine(cls, cfg):
        raise AssertionError("the engine was built before the flag error was found")

    monkeypatch.setattr(EmbeddedEngine, "from_config", classmethod(no_engine))
    with pytest.raises(ConfigError, match="a rollout needs prompts: give --prompt-data FILE.jsonl"):
        build_rollout(parse_config(rollout_flags("--rm-type", "math", prompt_data=False)))
    with pytest.raises(ConfigError, match="--rm-type: invalid choice: 'nosuch'"):  # now while parsing flags
        build_rollout(parse_config(rollout_flags("--rm-type", "nosuch")))
    with pytest.raises(ConfigError, match="has no 'nosuch'; callables there: score"):
        build_rollout(parse_config(rollout_flags("--custom-rm-path", "REWARD:nosuch")))
    with pytest.raises(ConfigError, match="no reward function"):
        build_rollout(parse_config(rollout_flags()))
    # sglang without servers: refused by validation, and by its from_config for unvalidated configs
    with pytest.raises(ConfigError) as err:
        build_rollout(parse_config(rollout_flags("--rollout-backend", "sglang", "--rm-type", "math"), validate=False))
    assert str(err.value) == NO_URLS
