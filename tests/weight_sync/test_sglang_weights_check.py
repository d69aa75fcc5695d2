"""``--check-weight-update-equal`` with SGLang: the update to version 0 compared inside the servers.

SGLang cannot hand its weights back for most model classes, but since 0.5.19 it can check them
itself (``/weights_checker``): the engine snapshots every server's own load of the checkpoint,
scrambles the live weights (``reset_tensors``), lets the transport push the trainer's initial
weights, and asks each server to compare. Exercised here through the real client and engine
against the protocol-exact stand-in, over the disk route and the distributed transport; the
same check runs against real SGLang 0.5.23 in ``scripts/test_sglang_real.sh``.
"""

import os
import sys

import pytest
import torch

from megatron_rl.errors import EngineError, SyncError
from megatron_rl.rollout import GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.weight_sync.distributed import DistributedSynchronizer

from test_weight_sync import FakeBackend, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn  # noqa: E402 - tests/rollout, put on sys.path above

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]


@pytest.fixture
def fresh(tiny_hf_models, tmp_path):
    """A server that loaded the checkpoint itself, and an engine on it (nothing pushed yet)."""
    hf = tiny_hf_models("qwen2")
    with SGLangStandIn(hf, group_timeout_s=30) as server:
        engine = SGLangEngine([server.url], weight_dir=str(tmp_path / "weights"), hf_checkpoint=hf, timeout_s=30,
                              update_timeout_s=30, connect_retries=0, health_interval_s=0)
        try:
            yield hf, server, engine
        finally:
            engine.close()


def checker_calls(server):
    return list(server.weights_checker_actions)


def test_the_initial_update_is_compared_with_the_servers_own_load_over_disk(fresh):
    hf, server, engine = fresh
    engine.check_first_update = True
    before = [s.response_ids for s in engine.generate(REQUESTS, GREEDY)]
    engine.update_weights(checkpoint_tensors(hf).items(), 0)
    assert checker_calls(server) == ["snapshot", "reset_tensors", "compare"]
    assert [s.response_ids for s in engine.generate(REQUESTS, GREEDY)] == before  # the checkpoint, restored
    engine.update_weights(checkpoint_tensors(hf).items(), 1)  # later updates are not compared
    assert checker_calls(server) == ["snapshot", "reset_tensors", "compare"]


def test_a_tensor_that_does_not_come_back_is_named_and_the_engine_refuses(fresh):
    hf, server, engine = fresh
    weights = checkpoint_tensors(hf)
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2  # a conversion error, say
    sync = DistributedSynchronizer(bucket_bytes=64 * 1024, check_equal=True, timeout_s=30)
    try:
        with pytest.raises(SyncError) as err:
            sync.sync(FakeBackend(weights), engine, version=0)
    finally:
        sync.shutdown()
    text = str(err.value)
    assert "--check-weight-update-equal: the weights SGLang holds after the update to version 0 differ" in text
    assert "name=model.norm.weight" in text and server.url in text
    assert "name=model.layers.0" not in text  # only what differs is named
    with pytest.raises(EngineError, match="SGLang engine cannot generate"):
        engine.generate(REQUESTS, GREEDY)  # the servers hold what was pushed: refused until a complete update


def test_the_distributed_transport_arms_the_check_and_passes_the_checkpoint(fresh):
    hf, server, engine = fresh
    assert not engine.check_first_update
    sync = DistributedSynchronizer(bucket_bytes=64 * 1024, check_equal=True, timeout_s=30)
    try:
        sync.sync(FakeBackend(checkpoint_tensors(hf)), engine, version=0)
    finally:
        sync.shutdown()
    assert engine.check_first_update and checker_calls(server) == ["snapshot", "reset_tensors", "compare"]
    assert engine.weight_version == 0 and len(engine.generate(REQUESTS, GREEDY)) == 2
    live = dict(server.engine.named_weights())
    assert all(torch.equal(live[n], t) for n, t in checkpoint_tensors(hf).items())
