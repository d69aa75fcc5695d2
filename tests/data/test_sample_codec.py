"""The flat rollout-batch encoding that ``broadcast_samples`` sends: exact round trips."""

from dataclasses import fields

import pickle

import numpy as np
import pytest
import torch

from megatron_rl.data import sample_codec
from megatron_rl.data.types import HeldElsewhereError, Sample


def _same(a: list[Sample], b: list[Sample]) -> None:
    """Equal values AND equal types, field by field (== alone would accept 1 == 1.0)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for f in fields(Sample):
            u, v = getattr(x, f.name), getattr(y, f.name)
            assert type(u) is type(v), (f.name, u, v)
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v), f.name
            elif isinstance(u, list):
                assert [type(e) for e in u] == [type(e) for e in v], f.name
                assert u == v, f.name
            else:
                assert u == v, f.name


def _roundtrip(samples):
    sizes, buffer = sample_codec.encode(samples)
    assert sizes.dtype == torch.int64 and buffer.dtype == torch.uint8 and int(sizes.sum()) == buffer.numel()
    # what a receiving rank has: fresh tensors of the same bytes
    return sample_codec.decode(sizes.clone(), buffer.clone())


def test_every_field_round_trips_bitwise():
    s = Sample(group_index=7, prompt_ids=[5, 6, 151_935], response_ids=[9, 2**40],
               rollout_logprobs=[-0.1234567890123, -1e-300], loss_mask=[1, 0], reward=0.30000000000000004,
               finish_reason="stop", weight_version=12, label={"answer": [1, 2]}, prompt_text="p é",
               response_text="r", metadata={"turns": 2, "tool": None}, token_versions=[12, 13])
    out = _roundtrip([s])
    _same([s], out)
    assert out[0] == s


def test_empty_responses_defaults_and_empty_batch():
    samples = [Sample(group_index=0, prompt_ids=[1, 2], response_ids=[]),
               Sample(group_index=0, prompt_ids=[3], response_ids=[4], rollout_logprobs=[-0.5]),
               Sample(group_index=1, prompt_ids=[], response_ids=[], reward=-1.0, finish_reason="abort")]
    _same(samples, _roundtrip(samples))
    assert _roundtrip([]) == []


def test_multi_turn_loss_masks_and_many_samples():
    rng = np.random.default_rng(0)
    samples = []
    for i in range(300):
        n = int(rng.integers(0, 12))
        mask = [int(m) for m in rng.integers(0, 2, n)] if i % 3 else []  # tool-output spans masked out
        # every fifth sample continued across an update half-way (per-token versions), the rest did not
        versions = [i % 4] * (n // 2) + [i % 4 + 1] * (n - n // 2) if i % 5 == 0 and n > 1 else []
        samples.append(Sample(group_index=i // 8, prompt_ids=[int(t) for t in rng.integers(0, 1000, 20)],
                              response_ids=[int(t) for t in rng.integers(0, 1000, n)],
                              rollout_logprobs=[float(x) for x in -rng.random(n)], loss_mask=mask,
                              reward=float(rng.random()), weight_version=i % 4, token_versions=versions))
    _same(samples, _roundtrip(samples))


def test_values_off_the_flat_layout_keep_their_type():
    """Non-plain numbers travel in the pickled header: nothing is cast on the way."""
    s = Sample(group_index=np.int64(3), prompt_ids=[1, True], response_ids=torch.tensor([4, 5]),
               rollout_logprobs=[np.float32(-0.5), -0.25], loss_mask=[1.0, 0.0], reward=1, weight_version=2,
               token_versions=[np.int64(2), 3])
    out = _roundtrip([s, Sample(group_index=1, prompt_ids=[1], response_ids=[2], reward=True)])
    _same([s], out[:1])
    assert out[1].reward is True
    big = [Sample(group_index=0, prompt_ids=[2**70], response_ids=[2**40, -1])]  # beyond int64 / int32
    _same(big, _roundtrip(big))


def test_per_token_weight_versions_travel_as_a_flat_column():
    """Partial rollouts continued across updates carry every token's version; the rest carry none (all
    ``weight_version``). Both come back exactly, in the flat blocks, never pickled."""
    samples = [Sample(group_index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], weight_version=4,
                      token_versions=[4, 4, 6]),
               Sample(group_index=0, prompt_ids=[1, 2], response_ids=[6], weight_version=6),
               Sample(group_index=1, prompt_ids=[7], response_ids=[8, 9], weight_version=2**40,
                      token_versions=[2**40, 2**40 + 1]),  # beyond int32: the int64 block
               Sample(group_index=1, prompt_ids=[7], response_ids=[], weight_version=5)]
    sizes, buffer = sample_codec.encode(samples)
    n_payload = int(sizes[0])
    _, schema, pickled = pickle.loads(buffer.numpy()[n_payload:].tobytes())
    assert "token_versions" not in pickled
    assert [(name, count) for name, _, count in schema if name.startswith("token_versions")] == \
        [("token_versions#len", 4), ("token_versions", 5)]
    out = sample_codec.decode(sizes.clone(), buffer.clone())
    _same(samples, out)
    assert [s.effective_token_versions() for s in out] == [[4, 4, 6], [6], [2**40, 2**40 + 1], []]
    assert [s.staleness(7) for s in out[:2]] == [3, 1]


def test_stubs_do_not_carry_token_versions():
    """A rank that does not train on a sample never reads its per-token versions: the stub raises."""
    samples = [Sample(group_index=3, prompt_ids=[1], response_ids=[2, 3], token_versions=[1, 2])]
    stub, = sample_codec.decode_headers(*sample_codec.encode_headers(samples), owners=[1])
    assert stub.response_length == 2 and stub.group_index == 3
    with pytest.raises(HeldElsewhereError, match="token_versions"):
        _ = stub.token_versions
