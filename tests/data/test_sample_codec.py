"""The flat rollout-batch encoding that ``broadcast_samples`` sends: exact round trips."""

from dataclasses import fields

import numpy as np
import torch

from megatron_rl.data import sample_codec
from megatron_rl.data.types import Sample


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
               response_text="r", metadata={"turns": 2, "tool": None})
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
        samples.append(Sample(group_index=i // 8, prompt_ids=[int(t) for t in rng.integers(0, 1000, 20)],
                              response_ids=[int(t) for t in rng.integers(0, 1000, n)],
                              rollout_logprobs=[float(x) for x in -rng.random(n)], loss_mask=mask,
                              reward=float(rng.random()), weight_version=i % 4))
    _same(samples, _roundtrip(samples))


def test_values_off_the_flat_layout_keep_their_type():
    """Non-plain numbers travel in the pickled header: nothing is cast on the way."""
    s = Sample(group_index=np.int64(3), prompt_ids=[1, True], response_ids=torch.tensor([4, 5]),
               rollout_logprobs=[np.float32(-0.5), -0.25], loss_mask=[1.0, 0.0], reward=1, weight_version=2)
    out = _roundtrip([s, Sample(group_index=1, prompt_ids=[1], response_ids=[2], reward=True)])
    _same([s], out[:1])
    assert out[1].reward is True
    big = [Sample(group_index=0, prompt_ids=[2**70], response_ids=[2**40, -1])]  # beyond int64 / int32
    _same(big, _roundtrip(big))
