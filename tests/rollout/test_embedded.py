"""The embedded engine against a recomputing full forward pass of the same HF model."""

import os
import shutil

import pytest
import torch
import transformers

from megatron_rl.errors import CheckpointError, ConfigError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams

PROMPT_LENGTHS = [3, 9, 1, 6, 5]


def ragged_requests(lengths=PROMPT_LENGTHS, vocab=250, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [GenerateRequest(prompt_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(), group_index=i,
                            label=f"label{i}", metadata={"k": i}) for i, n in enumerate(lengths)]


def reference_logits(model, sample):
    """Full forward over prompt + response, no cache, no padding: logits predicting each response token."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(sample.prompt_ids) - 1:-1]


def reference_logprobs(model, sample, temperature):
    logits = reference_logits(model, sample)
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)


@pytest.fixture
def hf_model():
    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load


def test_logprobs_match_recomputed_forward_ragged_batch(tiny_hf_models, family, hf_model):
    path = tiny_hf_models(family)
    engine = EmbeddedEngine(path, max_batch_size=7)  # 10 rows -> two chunks, prompts split across them
    requests = ragged_requests()
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=10, seed=3, n=2,
                              ignore_eos=True)
    samples = engine.generate(requests, sampling)
    assert len(samples) == 10
    reference = hf_model(path)
    for k, s in enumerate(samples):
        req = requests[k // 2]
        assert s.group_index == req.group_index and s.prompt_ids == req.prompt_ids and s.label == req.label
        assert s.metadata == req.metadata and s.metadata is not req.metadata
        assert len(s.response_ids) == len(s.rollout_logprobs) == 10 and s.finish_reason == "length"
        assert s.weight_version == 0
        expected = reference_logprobs(reference, s, 0.7)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected, atol=1e-5, rtol=0)
    # the two samples of a prompt are different draws
    assert samples[0].response_ids != samples[1].response_ids


def test_greedy_is_argmax_and_equals_hf_generate(tiny_hf_models, family, hf_model):
    path = tiny_hf_models(family)
    engine = EmbeddedEngine(path)
    requests = ragged_requests()
    samples = engine.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    reference = hf_model(path)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, req in enumerate(requests):
        ids[r, width - len(req.prompt_ids):] = torch.tensor(req.prompt_ids)
        mask[r, width - len(req.prompt_ids):] = 1
    hf_out = reference.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                                pad_token_id=0)
    for r, s in enumerate(samples):
        logits = reference_logits(reference, s)
        assert s.response_ids == logits.argmax(-1).tolist()
        # greedy reports temperature-1 log-probs of the argmax token
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs),
                                   torch.log_softmax(logits, -1).max(-1).values, atol=1e-5, rtol=0)
        assert s.response_ids == hf_out[r, width:].tolist()


def test_seed_determinism_and_batch_invariance(tiny_hf_models):
    path = tiny_hf_models("qwen2")
    requests = ragged_requests()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, n=3, ignore_eos=True)
    a = EmbeddedEngine(path).generate(requests, sampling)
    b = EmbeddedEngine(path, max_batch_size=2).generate(requests, sampling)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    torch.testing.assert_close(torch.tensor([s.rollout_logprobs for s in a]),
                               torch.tensor([s.rollout_logprobs for s in b]), atol=1e-5, rtol=0)
    other = EmbeddedEngine(path).generate(requests, SamplingParams(
        temperature=1.0, max_new_tokens=12, seed=8, n=3, ignore_eos=True))
    assert sum(x.response_ids != y.response_ids for x, y in zip(a, other)) >= len(a) - 1
    # a shorter max_new_tokens gives a prefix of the longer response
    short = EmbeddedEngine(path).generate(requests, SamplingParams(
        temperature=1.0, max_new_tokens=5, seed=7, n=3, ignore_eos=True))
    for s, full in zip(short, a):
        assert s.response_ids == full.response_ids[:5] and s.finish_reason == "length"


def test_stop_tokens_end_responses_and_are_kept(tiny_hf_models):
    path = tiny_hf_models("llama")
    engine = EmbeddedEngine(path)
    requests = ragged_requests()
    free = engine.generate(requests, SamplingParams(max_new_tokens=16, seed=1, n=2, ignore_eos=True))
    stop = free[0].response_ids[4]
    stopped = engine.generate(requests, SamplingParams(max_new_tokens=16, seed=1, n=2, ignore_eos=True,
                                                       stop_token_ids=[stop]))
    hits = 0
    for f, s in zip(free, stopped):
        if stop in f.response_ids:
            end = f.response_ids.index(stop) + 1
            assert s.response_ids == f.response_ids[:end] and s.finish_reason == "stop"
            torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(f.rollout_logprobs[:end]),
                                       atol=1e-5, rtol=0)
            hits += 1
        else:
            assert s.response_ids == f.response_ids and s.finish_reason == "length"
    assert hits >= 1 and len(stopped[0].response_ids) <= 5


def test_model_eos_stops_unless_ignored(tiny_hf_models, hf_model):
    probe = EmbeddedEngine(tiny_hf_models("qwen3"))
    requests = ragged_requests()
    free = probe.generate(requests, SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))
    eos = free[1].response_ids[2]
    path = tiny_hf_models("qwen3", eos_token_id=eos)
    engine = EmbeddedEngine(path)
    assert engine.eos_token_ids == [eos]
    stopped = engine.generate(requests, SamplingParams(max_new_tokens=12, seed=2))
    assert stopped[1].response_ids == free[1].response_ids[:free[1].response_ids.index(eos) + 1]
    assert stopped[1].finish_reason == "stop"
    ignored = engine.generate(requests, SamplingParams(max_new_tokens=12, seed=2, ignore_eos=True))
    assert [s.response_ids for s in ignored] == [s.response_ids for s in free]
    assert all(s.finish_reason == "length" and len(s.response_ids) == 12 for s in ignored)


def test_sampling_distribution_and_filters(tiny_hf_models, hf_model):
    """One step, 4000 draws: empirical frequencies follow the (filtered) distribution at temperature."""
    path = tiny_hf_models("qwen2")
    engine = EmbeddedEngine(path, max_batch_size=4000)
    request = ragged_requests([6])
    logits = hf_model(path)(torch.tensor([request[0].prompt_ids])).logits[0, -1].detach()
    probs = torch.softmax(logits / 0.5, -1)
    sorted_probs, order = probs.sort(descending=True)

    def frequencies(**kw):
        samples = engine.generate(request, SamplingParams(temperature=0.5, max_new_tokens=1, n=4000, seed=11,
                                                          ignore_eos=True, **kw))
        tokens = torch.tensor([s.response_ids[0] for s in samples])
        # reported log-probs are the unfiltered temperature-0.5 distribution
        torch.testing.assert_close(torch.tensor([s.rollout_logprobs[0] for s in samples]),
                                   probs.log()[tokens], atol=1e-5, rtol=0)
        return torch.bincount(tokens, minlength=probs.numel()).double() / len(samples)

    def chi_square(freq, expected):  # Pearson statistic over the support of ``expected``
        support = expected > 0
        return (4000 * (freq[support] - expected[support]) ** 2 / expected[support]).sum().item()

    full = frequencies()
    # 249 degrees of freedom: mean 249, sd 22; the wrong temperature is far off
    assert chi_square(full, probs.double()) < 249 + 5 * 22
    assert chi_square(full, torch.softmax(logits, -1).double()) > 249 + 20 * 22
    top5 = frequencies(top_k=5)
    expected = torch.zeros_like(probs, dtype=torch.float64)
    expected[order[:5]] = sorted_probs[:5].double() / sorted_probs[:5].sum()
    assert set(top5.nonzero().flatten().tolist()) <= set(order[:5].tolist())
    assert chi_square(top5, expected) < 4 + 5 * 3  # 4 degrees of freedom: mean 4, sd 2.8
    nucleus = frequencies(top_p=0.6)
    kept = order[(sorted_probs.cumsum(0) - sorted_probs) <= 0.6]
    assert set(nucleus.nonzero().flatten().tolist()) <= set(kept.tolist())
    assert 0 < len(kept) < probs.numel()


def test_bad_requests_and_params_name_the_fix(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("qwen2"))
    with pytest.raises(ConfigError, match="token id 250 outside the model's vocab"):
        engine.generate([GenerateRequest([1, 250], 0)], SamplingParams())
    with pytest.raises(ConfigError, match="empty prompt_ids"):
        GenerateRequest([], 3)
    with pytest.raises(ConfigError, match=r"--rollout-top-p=1.5 is invalid"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ConfigError, match=r"--rollout-top-k=0 is invalid"):
        SamplingParams(top_k=0)
    with pytest.raises(ConfigError, match=r"--rollout-temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match=r"--n-samples-per-prompt=0"):
        SamplingParams(n=0)
    with pytest.raises(ConfigError, match="--hf-checkpoint /nonexistent: no config.json"):
        EmbeddedEngine("/nonexistent")
    assert engine.generate([], SamplingParams()) == []


def test_preallocated_kv_cache_layers(tiny_hf_models, family):
    from transformers import AutoConfig

    from megatron_rl.rollout.kv_cache import PreallocatedLayer, joinable, make_kv_cache

    config = AutoConfig.from_pretrained(tiny_hf_models(family))
    cache = make_kv_cache(config, capacity=5)
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):  # gpt-oss: transformers' own layers
        assert len(cache.layers) == 4 and not any(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
        assert not joinable(cache)  # batches statically: a sliding window's state does not shift with padding
        return
    if "linear_attention" in (getattr(config, "layer_types", None) or []):  # qwen3_next: transformers' own layers
        assert len(cache.layers) == 4 and not any(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
        assert not joinable(cache)  # a recurrent state does not shift with padding either
        linear = cache.layers[0]  # the engine's row selection on a gated delta-net's conv / recurrent state
        linear.lazy_initialization(conv_states=torch.randn(3, 5, 4), recurrent_states=torch.randn(3, 2, 4, 4))
        conv, state = torch.randn(3, 5, 4), torch.randn(3, 2, 4, 4)
        linear.conv_states[0].copy_(conv)
        linear.recurrent_states[0].copy_(state)
        cache.batch_select_indices(torch.tensor([2, 2, 0]))
        assert torch.equal(linear.conv_states[0], conv[[2, 2, 0]])
        assert torch.equal(linear.recurrent_states[0], state[[2, 2, 0]])
        cache.batch_repeat_interleave(2)
        assert torch.equal(linear.conv_states[0], conv[[2, 2, 2, 2, 0, 0]])
        return
    if "indexed_attention" in (getattr(config, "layer_types", None) or []):  # deepseek_v32: transformers' own layers
        assert len(cache.layers) == 4 and not any(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
        assert not joinable(cache)  # batches statically: the indexer's key cache is not preallocated
        indexed = cache.layers[0]  # the engine's row selection carries the indexer's keys with the latents
        indexed.update(torch.randn(3, 1, 4, 16), torch.randn(3, 1, 4, 8))
        keys = torch.randn(3, 4, 16)
        indexed.update_indexer(keys)
        cache.batch_select_indices(torch.tensor([2, 2, 0]))
        assert torch.equal(indexed.indexer_keys, keys[[2, 2, 0]])
        return
    assert len(cache.layers) == 4 and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    layer = cache.layers[0]
    k = torch.randn(3, 2, 4, 16)
    keys, values = layer.update(k, -k)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    layer.batch_select_indices(torch.tensor([2, 2, 0]))
    keys, _ = layer.update(torch.ones(3, 2, 1, 16), torch.ones(3, 2, 1, 16))
    assert torch.equal(keys[:, :, :4], k[[2, 2, 0]]) and layer.get_seq_length() == 5
    with pytest.raises(RuntimeError, match="KV cache capacity 5 exceeded"):
        layer.update(k[:, :, :1], k[:, :, :1])


def test_context_length_caps_responses(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("llama", max_position_embeddings=16))
    requests = ragged_requests([12, 3])
    samples = engine.generate(requests, SamplingParams(max_new_tokens=10, seed=0, ignore_eos=True))
    assert [len(s.response_ids) for s in samples] == [4, 10]  # 12 + 4 = the 16 positions the model has
    assert all(s.finish_reason == "length" for s in samples)
    with pytest.raises(ConfigError, match="has 16 tokens, not below the model's context length 16; lower "
                                          "--rollout-max-prompt-len"):
        engine.generate(ragged_requests([16]), SamplingParams())


def test_inverse_cdf_edges():
    from megatron_rl.rollout.sampling import inverse_cdf

    weights = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]])
    assert inverse_cdf(weights, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert inverse_cdf(weights, torch.tensor([0.2499, 0.4999])).tolist() == [1, 0]
    assert inverse_cdf(weights, torch.tensor([0.25, 0.5])).tolist() == [3, 1]
    # u = 1 can only arise from rounding; it must still land on a token with positive weight
    assert inverse_cdf(weights, torch.tensor([1.0, 1.0])).tolist() == [3, 1]


def test_banned_tokens_are_never_drawn_and_keep_the_full_distributions_logprobs():
    """A vision-language engine's vision tokens (sampling.py ``banned``): never sampled, greedy or not, while the
    reported log-probs stay those of the whole distribution (what the trainer computes for the same tokens)."""
    from megatron_rl.rollout.sampling import sample_next_tokens

    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5], [3.0, 0.0, 2.9, 0.0]])
    uniforms = torch.linspace(0.0, 0.999, 64, dtype=torch.float64)
    full = torch.log_softmax(logits / 0.7, dim=-1)
    for u in uniforms:
        tokens, logprobs = sample_next_tokens(logits, SamplingParams(temperature=0.7), u.expand(2), banned=(1, 0))
        assert not set(tokens.tolist()) & {0, 1}
        assert torch.equal(logprobs, full.gather(-1, tokens[:, None])[:, 0])
    tokens, _ = sample_next_tokens(logits, SamplingParams(temperature=0.0), torch.zeros(2), banned=(1, 0))
    assert tokens.tolist() == [2, 2]


def test_truncated_shard_is_named_by_the_engine(tmp_path, tiny_hf_models):
    """Rollout-only runs build only this engine: a truncated shard raised a SafetensorError traceback
    from inside transformers (training start-up already named it through the backend)."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("qwen2"), hf)
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        EmbeddedEngine(str(hf))
