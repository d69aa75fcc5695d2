"""Property tests: planning invariants over random length mixes (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.data.packing import (
    micro_batch_tokens, pack_plan_rank, padded_length, plan_dynamic_micro_batches)
from megatron_rl.data.types import Sample

BUDGET = 512


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=BUDGET), min_size=0, max_size=60),
    dp_size=st.integers(1, 8),
    cp_size=st.sampled_from([1, 2]),
    pad=st.sampled_from([1, 2, 4, 8]),
)
def test_dynamic_plan_invariants(lengths, dp_size, cp_size, pad):
    max_tokens = BUDGET  # budget for global sequences is BUDGET * cp_size >= every padded length
    lengths = [min(n, BUDGET * cp_size // pad * pad) for n in lengths]
    plan = plan_dynamic_micro_batches(lengths, dp_size=dp_size, max_tokens_per_gpu=max_tokens,
                                      cp_size=cp_size, pad_to_multiple=pad)
    # every sample exactly once
    flat = [i for mbs in plan.micro_batches for mb in mbs for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    # same number of micro-batches on every DP rank
    assert plan.dp_size == dp_size
    assert len({len(mbs) for mbs in plan.micro_batches}) == 1
    # budget respected, counting padding
    toks = micro_batch_tokens(plan, lengths)
    assert all(t <= max_tokens * cp_size for r in toks for t in r)
    # empty micro-batches only when some rank is short of samples
    for mbs in plan.micro_batches:
        if any(len(mb) == 0 for mb in mbs):
            assert sum(len(mb) for mb in mbs) < plan.num_micro_batches
    # DP sample counts differ by at most one (equal-size KK)
    counts = [sum(len(mb) for mb in mbs) for mbs in plan.micro_batches]
    assert max(counts) - min(counts) <= 1
    # the count is within the packing lower bound and the single-sample upper bound
    if lengths:
        per_rank = [sum(r) for r in toks]
        lower = max(-(-t // (max_tokens * cp_size)) for t in per_rank)
        assert lower <= plan.num_micro_batches <= max(counts)
    # deterministic
    assert plan == plan_dynamic_micro_batches(list(lengths), dp_size=dp_size, max_tokens_per_gpu=max_tokens,
                                              cp_size=cp_size, pad_to_multiple=pad)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=20),
    pad=st.sampled_from([1, 4]),
)
def test_packed_layout_invariants(shapes, pad):
    samples = [Sample(i, list(range(100, 100 + p)), [1000 * (i + 1) + j for j in range(r)])
               for i, (p, r) in enumerate(shapes)]
    lengths = [s.total_length for s in samples]
    plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=64, pad_to_multiple=pad)
    for r in range(2):
        for pb in pack_plan_rank(samples, plan, r):
            cu = pb.cu_seqlens.tolist()
            assert cu[-1] == pb.num_tokens
            for k, idx in enumerate(pb.sample_indices.tolist()):
                s = samples[idx]
                assert cu[k + 1] - cu[k] == padded_length(s.total_length, pad)
                assert pb.tokens[cu[k]:cu[k] + s.total_length].tolist() == s.prompt_ids + s.response_ids
                assert pb.position_ids[cu[k]:cu[k + 1]].tolist() == list(range(cu[k + 1] - cu[k]))
            # targets at response positions are exactly the responses, in sample order
            want = [t for idx in pb.sample_indices.tolist() for t in samples[idx].response_ids]
            assert pb.response_target_ids.tolist() == want
            assert pb.tokens[pb.response_positions + 1].tolist() == want
