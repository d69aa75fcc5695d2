"""The embedded engine's lean decode step equals transformers' forward bit for bit (rollout/lean_decode.py).

Why bitwise: the step claims to be the same torch calls as transformers' forward, in the same order; a
tolerance would hide a reordered reduction or a missed op (a bias, a norm) that a small random model shows
only as a small difference. Each decode step of a generation is compared, with left padding (rows of
different prompt lengths), in float32 and bfloat16 (qwen3's), for every family the step covers.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data.types import SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine, EngineRow
from megatron_rl.rollout.kv_cache import make_kv_cache
from megatron_rl.rollout.lean_decode import LEAN_FAMILIES, lean_decoder


@pytest.mark.parametrize("family, dtype", [*((f, torch.float32) for f in sorted(LEAN_FAMILIES)),
                                           ("qwen3", torch.bfloat16)])
def test_every_decode_step_equals_transformers_forward(tiny_hf_models, family, dtype):
    engine = EmbeddedEngine(tiny_hf_models(family), dtype=dtype)
    model, step = engine.model, engine._lean_decode
    assert step is not None
    torch.manual_seed(0)
    rows, width, steps = 5, 6, 8
    ids = torch.randint(3, model.config.vocab_size, (rows, width))
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1, :2] = mask[3, :4] = 0  # left padding: shorter prompts
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [make_kv_cache(model.config, capacity=width + steps) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        tokens, last = ids[:, -1:], positions[:, -1:]
        for _ in range(steps):
            mask, last = torch.cat([mask, mask.new_ones(rows, 1)], dim=1), last + 1
            want = model(input_ids=tokens, attention_mask=mask, position_ids=last, cache=caches[0],
                         use_cache=True).logits[:, -1, :]
            got = step(tokens, mask, last, caches[1])
            assert got.dtype == want.dtype and torch.equal(got, want)
            tokens = want.float().argmax(-1, keepdim=True)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_engine_generates_the_same_tokens_and_logprobs_either_way(tiny_hf_models):
    model = tiny_hf_models("qwen3")
    lean, plain = EmbeddedEngine(model), EmbeddedEngine(model, lean_decode=False)
    assert lean._lean_decode is not None and plain._lean_decode is None
    rows = [EngineRow([3, 4, 5 + i][: 2 + i % 2], seed=7 + i, max_new_tokens=10) for i in range(4)]
    sampling = SamplingParams(max_new_tokens=10, seed=1, ignore_eos=True)
    a, b = lean.generate_rows(rows, sampling), plain.generate_rows(rows, sampling)
    assert [(r.response_ids, r.logprobs) for r in a] == [(r.response_ids, r.logprobs) for r in b]


def test_it_stands_aside_where_it_would_not_be_transformers_computation(tiny_hf_models):
    engine = EmbeddedEngine(tiny_hf_models("qwen2"))
    model = engine.model
    assert lean_decoder(model, torch.device("cpu")) is not None
    assert lean_decoder(model, torch.device("meta")) is None  # another device: unchecked there
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        assert lean_decoder(model, torch.device("cpu")) is None  # a hook sees every forward: only the model's
    finally:
        handle.remove()
    moe = EmbeddedEngine(tiny_hf_models("qwen3_moe"))
    assert moe._lean_decode is None  # another family: its own forward
