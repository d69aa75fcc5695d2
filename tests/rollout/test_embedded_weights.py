"""Embedded engine weight updates (HF checkpoint names, strict, versioned) and release/resume."""

import glob

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams, make_engine

REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42, 7, 8], 1)]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4, n=2, ignore_eos=True)


def checkpoint_tensors(path):
    tensors = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def buckets(tensors, per_bucket=5):
    """Stream like a trainer's bucketed export: a generator, consumed once."""
    items = list(tensors.items())
    for start in range(0, len(items), per_bucket):
        yield from items[start:start + per_bucket]


def outputs(samples):
    return [(s.response_ids, s.rollout_logprobs) for s in samples]


def assert_same_outputs(a, b):
    """Same tokens; log-probs equal up to fp32 rounding (fresh allocations may take other BLAS paths)."""
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    torch.testing.assert_close(torch.tensor([s.rollout_logprobs for s in a]),
                               torch.tensor([s.rollout_logprobs for s in b]), atol=1e-6, rtol=0)


def test_named_weights_are_the_checkpoint(tiny_hf_models, family):
    path = tiny_hf_models(family)
    engine = EmbeddedEngine(path)
    on_disk = checkpoint_tensors(path)
    live = dict(engine.named_weights())
    assert set(live) == set(on_disk)  # qwen3_moe: per-expert names although transformers fuses experts
    for name, tensor in on_disk.items():
        assert torch.equal(live[name], tensor), name


def test_update_weights_makes_engine_equal_to_the_new_checkpoint(tiny_hf_models, family):
    engine = EmbeddedEngine(tiny_hf_models(family))
    new_path = tiny_hf_models(family, seed=1)  # seed override: other random weights, same shapes
    before = engine.generate(REQUESTS, SAMPLING)
    engine.update_weights(buckets(checkpoint_tensors(new_path)), version=3)
    assert engine.weight_version == 3 and engine.health().ok
    after = engine.generate(REQUESTS, SAMPLING)
    assert all(s.weight_version == 3 for s in after)
    assert_same_outputs(after, EmbeddedEngine(new_path).generate(REQUESTS, SAMPLING))
    assert outputs(after) != outputs(before)


def test_update_casts_dtype_and_accepts_partial_updates(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("qwen2"))
    name = "model.layers.1.mlp.up_proj.weight"
    sent = torch.randn(dict(engine.named_weights())[name].shape).to(torch.bfloat16)
    engine.update_weights([(name, sent)], version=1)
    assert torch.equal(dict(engine.named_weights())[name], sent.float())
    assert engine.weight_version == 1


def test_bad_update_names_the_tensors_keeps_version_and_blocks_generation(tiny_hf_models):
    path = tiny_hf_models("qwen3_moe")
    engine = EmbeddedEngine(path)
    good = checkpoint_tensors(path)
    bad = dict(good)
    bad["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(32, 64)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(SyncError) as err:
        engine.update_weights(iter(bad.items()), version=1)
    message = str(err.value)
    assert "model.layers.0.mlp.experts.9.up_proj.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight (sent (3, 3), engine has (64, 64))" in message
    assert "stays at version 0" in message
    assert engine.weight_version == 0 and not engine.health().ok
    with pytest.raises(EngineError, match="weights incomplete"):
        engine.generate(REQUESTS, SAMPLING)
    # a partial update cannot repair a mixed state; a complete one can
    with pytest.raises(SyncError, match="lacks 86 tensor"):
        engine.update_weights([("lm_head.weight", good["lm_head.weight"])], version=1)
    engine.update_weights(good.items(), version=1)
    assert engine.health().ok and engine.weight_version == 1
    assert_same_outputs(engine.generate(REQUESTS, SAMPLING), EmbeddedEngine(path).generate(REQUESTS, SAMPLING))
    with pytest.raises(SyncError, match="older than the engine's weight_version 1"):
        engine.update_weights(good.items(), version=0)


def test_failing_stream_marks_weights_incomplete(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("llama"))

    def broken():
        yield "model.norm.weight", torch.ones(64)
        raise RuntimeError("trainer died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        engine.update_weights(broken(), version=1)
    assert engine.weight_version == 0 and not engine.health().weights_loaded


def test_release_without_backup_frees_weights_and_needs_a_full_update(tiny_hf_models):
    path = tiny_hf_models("qwen2")
    engine = EmbeddedEngine(path)
    expected = engine.generate(REQUESTS, SAMPLING)
    engine.release()
    assert all(p.numel() == 0 for p in engine.model.parameters())
    health = engine.health()
    assert health.released and not health.ok
    with pytest.raises(EngineError, match="released: call resume"):
        engine.generate(REQUESTS, SAMPLING)
    with pytest.raises(EngineError, match="released"):
        engine.update_weights([], version=1)
    engine.resume()
    assert not engine.health().weights_loaded
    with pytest.raises(EngineError, match="weights incomplete"):
        engine.generate(REQUESTS, SAMPLING)
    on_disk = checkpoint_tensors(path)
    engine.update_weights(buckets(on_disk), version=1)
    assert all(torch.equal(t, on_disk[n]) for n, t in engine.named_weights())
    assert_same_outputs(engine.generate(REQUESTS, SAMPLING), expected)


def test_release_with_backup_restores_weights(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("qwen3"), weight_backup=True)
    expected = outputs(engine.generate(REQUESTS, SAMPLING))
    engine.release()
    engine.release()  # idempotent
    assert all(p.numel() == 0 for p in engine.model.parameters())
    engine.resume()
    assert engine.health().ok
    assert outputs(engine.generate(REQUESTS, SAMPLING)) == expected


def test_make_engine(tiny_hf_models):
    engine = make_engine("embedded", hf_checkpoint=tiny_hf_models("qwen2"), max_batch_size=4)
    assert isinstance(engine, EmbeddedEngine) and engine.max_batch_size == 4
    with pytest.raises(ConfigError, match="--rollout-backend='vllm' is not a known rollout engine; choose one of"):
        make_engine("vllm")
