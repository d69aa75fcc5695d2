"""Micro-batch planning (dynamic / fixed), THD packing, response-aligned gather, loss denominators."""


import pytest
import torch

from megatron_rl.data.packing import (
    LossDenominators, compute_loss_denominators, micro_batch_tokens, pack_plan_rank, pack_samples,
    pad_multiple_for, padded_length, plan_dynamic_micro_batches, plan_fixed_micro_batches,
    plan_loss_denominators, plan_owner_aligned)
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError


def _all_indices(plan):
    return sorted(i for mbs in plan.micro_batches for mb in mbs for i in mb)


# ------------------------------------------------------------------ dynamic planning

def test_dynamic_plan_covers_budget_and_equalises_counts():
    lengths = [900, 850, 700, 400, 300, 300, 200, 120, 100, 90, 60, 50, 40, 30]
    plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=1000)
    assert plan.dp_size == 2 and plan.token_budget == 1000
    assert _all_indices(plan) == list(range(len(lengths)))
    assert all(len(mbs) == plan.num_micro_batches for mbs in plan.micro_batches)
    toks = micro_batch_tokens(plan, lengths)
    assert all(t <= 1000 for rank in toks for t in rank)
    per_rank = [sum(r) for r in toks]
    assert per_rank[0] + per_rank[1] == sum(lengths)
    assert max(per_rank) - min(per_rank) <= 100  # KK balance on this mix (total 4140)
    # the minimum possible count is ceil(max rank tokens / budget)
    assert plan.num_micro_batches == max(-(-t // 1000) for t in per_rank)


def test_dynamic_budget_scales_with_cp_and_counts_padding():
    # 3 sequences of 500 -> padded to 512 each with pad 256; cp=2 doubles the budget to 1200.
    plan = plan_dynamic_micro_batches([500, 500, 500], dp_size=1, max_tokens_per_gpu=600,
                                      cp_size=2, pad_to_multiple=256)
    assert plan.token_budget == 1200 and plan.pad_to_multiple == 256
    toks = micro_batch_tokens(plan, [500, 500, 500])
    assert sorted(toks[0]) == [512, 1024]
    plan1 = plan_dynamic_micro_batches([500, 500, 500], dp_size=1, max_tokens_per_gpu=600)
    assert plan1.num_micro_batches == 3  # without cp each 500-token sequence is alone


def test_equalise_splits_heaviest_micro_batch_of_short_rank():
    # KK (equal sizes) puts {1000, 10, 10} and {600, 500, 10}? Whatever the split, every rank
    # must end with the same count and the budget must hold after splitting.
    lengths = [1000, 600, 500, 10, 10, 10]
    plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=1024)
    counts = [len(mbs) for mbs in plan.micro_batches]
    assert counts[0] == counts[1] == plan.num_micro_batches
    assert all(mb for mbs in plan.micro_batches for mb in mbs)  # enough samples: no empty mb
    assert all(t <= 1024 for r in micro_batch_tokens(plan, lengths) for t in r)
    assert _all_indices(plan) == list(range(6))


def test_rank_with_too_few_samples_gets_empty_micro_batch():
    # 3 samples, dp 2: one rank has 2 samples that do not fit together, the other only 1.
    lengths = [900, 900, 900]
    plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=1000)
    assert plan.num_micro_batches == 2
    assert sorted(len(mb) for mbs in plan.micro_batches for mb in mbs) == [0, 1, 1, 1]
    samples = [Sample(0, [1, 2], [3] * 898) for _ in range(3)]
    empty_rank = next(r for r in range(2) if any(len(mb) == 0 for mb in plan.rank(r)))
    packed = pack_plan_rank(samples, plan, empty_rank, pad_to_multiple=4)
    empty = [p for p in packed if p.is_empty][0]
    assert empty.tokens.tolist() == [0, 0, 0, 0] and empty.cu_seqlens.tolist() == [0, 4]
    assert empty.loss_mask.numel() == 0 and empty.response_positions.numel() == 0


def test_dynamic_plan_is_deterministic():
    lengths = [(i * 7919) % 1500 + 20 for i in range(200)]
    a = plan_dynamic_micro_batches(lengths, dp_size=4, max_tokens_per_gpu=4096, pad_to_multiple=8)
    b = plan_dynamic_micro_batches(list(lengths), dp_size=4, max_tokens_per_gpu=4096, pad_to_multiple=8)
    assert a == b


def test_over_long_sequence_error_names_flag_length_and_fix():
    with pytest.raises(ConfigError) as e:
        plan_dynamic_micro_batches([100, 5000, 30], dp_size=2, max_tokens_per_gpu=2048, cp_size=2)
    msg = str(e.value)
    assert "--max-tokens-per-gpu 2048" in msg and "rollout sample 1" in msg and "5000 tokens" in msg
    assert "at least 2500" in msg and "--context-parallel-size" in msg


@pytest.mark.parametrize("kwargs,flag", [
    (dict(dp_size=0, max_tokens_per_gpu=10), "data-parallel size"),
    (dict(dp_size=1, max_tokens_per_gpu=0), "--max-tokens-per-gpu"),
    (dict(dp_size=1, max_tokens_per_gpu=10, cp_size=0), "--context-parallel-size"),
    (dict(dp_size=1, max_tokens_per_gpu=2.5), r"--max-tokens-per-gpu must be a positive integer, got max_tokens_per_gpu=2\.5"),
    (dict(dp_size=True, max_tokens_per_gpu=10), "data-parallel size"),
])
def test_dynamic_rejects_bad_sizes(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        plan_dynamic_micro_batches([5], **kwargs)


def test_pad_multiple_for_parallelism():
    assert pad_multiple_for() == 1
    assert pad_multiple_for(tp_size=4) == 1  # no SP: TP does not shard tokens
    assert pad_multiple_for(tp_size=4, sequence_parallel=True) == 4
    assert pad_multiple_for(cp_size=2) == 4
    assert pad_multiple_for(tp_size=2, cp_size=2, sequence_parallel=True) == 8
    assert padded_length(9, 4) == 12 and padded_length(8, 4) == 8


# ------------------------------------------------------------------ fixed planning

def test_fixed_plan_shards_like_megatron_sampler():
    plan = plan_fixed_micro_batches(12, dp_size=2, micro_batch_size=3, global_batch_size=12)
    assert plan.token_budget is None and plan.num_micro_batches == 2
    assert plan.rank(0) == ((0, 1, 2), (6, 7, 8))
    assert plan.rank(1) == ((3, 4, 5), (9, 10, 11))


def test_fixed_plan_errors_name_flags():
    with pytest.raises(ConfigError) as e:
        plan_fixed_micro_batches(10, dp_size=2, micro_batch_size=4)
    msg = str(e.value)
    assert "--global-batch-size 10" in msg and "--micro-batch-size 4" in msg and "data-parallel size 2" in msg
    assert "multiple of 8" in msg
    with pytest.raises(ConfigError, match="--global-batch-size is 16"):
        plan_fixed_micro_batches(8, dp_size=2, micro_batch_size=2, global_batch_size=16)


# ------------------------------------------------------------------ packed layout

def _two_samples():
    a = Sample(0, prompt_ids=[11, 12, 13], response_ids=[21, 22], rollout_logprobs=[-0.1, -0.2],
               loss_mask=[1, 0])
    b = Sample(1, prompt_ids=[31], response_ids=[41, 42, 43], rollout_logprobs=[-1.0, -2.0, -3.0])
    return [a, b]


def test_pack_layout_without_padding():
    samples = _two_samples()
    pb = pack_samples(samples, [1, 0], advantages=[[0.5, 0.5], [1.0, 2.0, 3.0]])
    assert pb.tokens.tolist() == [31, 41, 42, 43, 11, 12, 13, 21, 22]
    assert pb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert pb.cu_seqlens.dtype == torch.int32 and pb.cu_seqlens.tolist() == [0, 4, 9]
    assert pb.cu_seqlens_unpadded.tolist() == [0, 4, 9] and pb.max_seqlen == 5
    assert pb.sample_indices.tolist() == [1, 0]
    assert pb.prompt_lengths.tolist() == [1, 3] and pb.response_lengths.tolist() == [3, 2]
    # position t predicts token t+1: sample 1's response starts after its 1-token prompt
    assert pb.response_positions.tolist() == [0, 1, 2, 6, 7]
    assert pb.response_target_ids.tolist() == [41, 42, 43, 21, 22]
    assert pb.response_target_ids.tolist() == pb.tokens[pb.response_positions + 1].tolist()
    assert pb.loss_mask.tolist() == [1, 1, 1, 1, 0]
    assert pb.advantages.tolist() == [1.0, 2.0, 3.0, 0.5, 0.5]
    assert torch.allclose(pb.rollout_logprobs, torch.tensor([-1.0, -2.0, -3.0, -0.1, -0.2]))
    assert pb.old_logprobs is None and pb.ref_logprobs is None and pb.teacher_logprobs is None


def test_pack_layout_with_padding_keeps_response_positions():
    samples = _two_samples()
    pb = pack_samples(samples, [0, 1], pad_to_multiple=4, pad_token_id=-7)
    # sample 0: 5 tokens -> 8, sample 1: 4 tokens -> 4
    assert pb.tokens.tolist() == [11, 12, 13, 21, 22, -7, -7, -7, 31, 41, 42, 43]
    assert pb.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert pb.cu_seqlens.tolist() == [0, 8, 12]
    assert pb.cu_seqlens_unpadded.tolist() == [0, 5, 9]
    assert pb.max_seqlen == 8
    assert pb.response_positions.tolist() == [2, 3, 8, 9, 10]
    assert pb.response_target_ids.tolist() == pb.tokens[pb.response_positions + 1].tolist()
    assert pb.loss_mask.numel() == 5  # pad tokens are never loss tokens
    params = pb.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    assert params.cu_seqlens_q.tolist() == [0, 5, 9] and params.max_seqlen_q == 8


def test_gather_response_from_model_outputs():
    samples = _two_samples()
    pb = pack_samples(samples, [0, 1], pad_to_multiple=4)
    T = pb.num_tokens
    # fake per-position outputs: value = 100 * position, with a trailing vocab-like dim
    out = (torch.arange(T, dtype=torch.float32) * 100).unsqueeze(-1).repeat(1, 3)
    got = pb.gather_response(out)
    assert got.shape == (5, 3) and got[:, 0].tolist() == [200, 300, 800, 900, 1000]
    # megatron's [1, T] batch-of-one layout is accepted
    assert pb.gather_response(out[:, 0].unsqueeze(0)).tolist() == [200, 300, 800, 900, 1000]
    # per-token log-probs of the targets from logits, gathered then split per sample
    logits = torch.randn(T, 64)
    lp = torch.log_softmax(pb.gather_response(logits), -1).gather(
        -1, pb.response_target_ids.unsqueeze(-1)).squeeze(-1)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(lp[2], ref[8, 41])
    pieces = pb.split_response(lp)
    assert [p.numel() for p in pieces] == [2, 3]
    with pytest.raises(ValueError, match=f"expects {T} positions"):
        pb.gather_response(torch.zeros(T - 1))


def test_pack_errors_name_sample_and_field():
    samples = _two_samples()
    with pytest.raises(ValueError, match="advantages of rollout sample 0 has 3 entries but its response has 2"):
        pack_samples(samples, [0], advantages=[[1, 2, 3], [1, 2, 3]])
    with pytest.raises(ConfigError, match="rollout sample 0 has an empty prompt"):
        pack_samples([Sample(0, [], [5, 6])], [0])
    mixed = [Sample(0, [1], [2], rollout_logprobs=[-1.0]), Sample(0, [1], [2])]
    with pytest.raises(ValueError, match=r"rollout samples \[1\] have no rollout_logprobs"):
        pack_samples(mixed, [0, 1])


def test_pack_plan_rank_round_trips_every_token():
    samples = [Sample(i, [1] * (3 + i % 5), [2] * (1 + (i * 13) % 40)) for i in range(30)]
    lengths = [s.total_length for s in samples]
    plan = plan_dynamic_micro_batches(lengths, dp_size=3, max_tokens_per_gpu=128, pad_to_multiple=4)
    seen = []
    for r in range(3):
        for pb in pack_plan_rank(samples, plan, r):
            assert pb.num_tokens <= 128 and pb.num_tokens % 4 == 0
            assert int(pb.cu_seqlens[-1]) == pb.num_tokens
            assert pb.response_target_ids.tolist() == pb.tokens[pb.response_positions + 1].tolist()
            seen.extend(pb.sample_indices.tolist())
    assert sorted(seen) == list(range(30))


# ------------------------------------------------------------------ loss denominators

def test_loss_denominators_independent_of_packing():
    samples = [Sample(0, [1], [2] * n, loss_mask=[1] * (n - 1) + [0]) for n in (3, 5, 8, 13, 2, 7)]
    samples.append(Sample(1, [1], [2, 2], loss_mask=[0, 0]))  # no loss tokens, still a sample
    lengths = [s.total_length for s in samples]
    want_tokens = sum(n - 1 for n in (3, 5, 8, 13, 2, 7))
    for budget in (16, 32, 64):
        plan = plan_dynamic_micro_batches(lengths, dp_size=2, max_tokens_per_gpu=budget)
        dens = plan_loss_denominators(samples, plan)
        assert all(d.global_tokens == want_tokens and d.global_samples == 7 for d in dens)
        assert sum(d.local_tokens for d in dens) == want_tokens
        assert sum(d.local_samples for d in dens) == 7
        # the packed loss masks agree with the counted denominators
        packed = sum(float(pb.loss_mask.sum()) for r in range(2) for pb in pack_plan_rank(samples, plan, r))
        assert packed == want_tokens


def test_compute_loss_denominators_local_and_tensor_masks():
    d = compute_loss_denominators([[1, 1, 0], torch.tensor([0, 0]), torch.tensor([1.0, 0.5])])
    assert d == LossDenominators(local_tokens=4, local_samples=3, global_tokens=4, global_samples=3)


# ------------------------------------------------------------------ owner-aligned forward plans

LENGTHS = [90, 850, 700, 400, 300, 300, 200, 120, 100, 900, 60, 50, 40, 30, 12, 700]


def _steps(lengths, gbs, dp, budget):
    return [(start, plan_dynamic_micro_batches(lengths[start:start + gbs], dp_size=dp, max_tokens_per_gpu=budget))
            for start in range(0, len(lengths), gbs)]


def _cut(lengths, dp, budget):
    return lambda parts: plan_dynamic_micro_batches(lengths, dp_size=dp, max_tokens_per_gpu=budget, rank_parts=parts)


@pytest.mark.parametrize("dp,gbs", [(2, 8), (2, 16), (4, 8), (3, 16)])
def test_owner_aligned_forward_gives_each_rank_the_samples_it_trains_on(dp, gbs):
    steps = _steps(LENGTHS, gbs, dp, 1024)
    plan = plan_owner_aligned(steps, len(LENGTHS), _cut(LENGTHS, dp, 1024))
    for d in range(dp):
        trained = sorted(off + i for off, p in steps for i in p.rank_samples(d))
        assert plan.rank_samples(d) == trained
    assert _all_indices(plan) == list(range(len(LENGTHS)))
    assert all(len(mbs) == plan.num_micro_batches for mbs in plan.micro_batches)
    assert all(t <= 1024 for r in micro_batch_tokens(plan, LENGTHS) for t in r)


def test_owner_aligned_forward_at_one_rank_is_the_whole_batch_plan():
    """DP1: the same micro-batches as planning the whole batch directly (numerics unchanged)."""
    for gbs in (4, 8, 16):
        plan = plan_owner_aligned(_steps(LENGTHS, gbs, 1, 1500), len(LENGTHS), _cut(LENGTHS, 1, 1500))
        assert plan == plan_dynamic_micro_batches(LENGTHS, dp_size=1, max_tokens_per_gpu=1500)


def test_owner_aligned_refuses_steps_that_miss_or_repeat_samples():
    steps = _steps(LENGTHS[:8], 8, 2, 1024)
    with pytest.raises(ValueError, match="cover 8 of 16 samples"):
        plan_owner_aligned(steps, 16, _cut(LENGTHS, 2, 1024))
    with pytest.raises(ValueError, match="rank_parts must split samples 0..3 over 2 DP ranks, each once"):
        plan_dynamic_micro_batches([5, 5, 5, 5], dp_size=2, max_tokens_per_gpu=10, rank_parts=[[0, 1], [1, 2]])


def test_branched_rollouts_cut_steps_by_trajectory_and_plan_ragged_steps():
    """Agent sessions split into branches (Sample.branch): a step holds --global-batch-size trajectories with all
    their branches, and a step whose count is no multiple of micro-batch x DP gets contiguous shares, an empty
    micro-batch where a rank has none."""
    from types import SimpleNamespace

    from megatron_rl.data.packing import step_bounds

    plain = [SimpleNamespace(branch=0)] * 6
    assert step_bounds(plain, 4) == [(0, 4), (4, 6)]
    branched = [SimpleNamespace(branch=b) for b in (0, 1, 2, 0, 0, 1, 0)]
    assert step_bounds(branched, 2) == [(0, 4), (4, 7)]
    plan = plan_fixed_micro_batches(7, dp_size=2, micro_batch_size=2, ragged=True)
    assert plan.micro_batches == (((0, 1), (4, 5)), ((2, 3), (6,)))
    plan = plan_fixed_micro_batches(1, dp_size=2, micro_batch_size=1, ragged=True)
    assert plan.micro_batches == (((0,),), ((),))
    with pytest.raises(ConfigError, match="not a positive multiple"):
        plan_fixed_micro_batches(7, dp_size=2, micro_batch_size=2)


def test_a_branched_rollout_plans_every_sample_once_with_equal_micro_batch_counts():
    from types import SimpleNamespace

    from megatron_rl.backends.base import DataParallelShare

    share = DataParallelShare()
    share.cfg = SimpleNamespace(batching=SimpleNamespace(use_dynamic_batch_size=False, micro_batch_size=2),
                                parallel=SimpleNamespace(context_parallel_size=1))
    share.dp_size, share.dp_rank, share.pad_to_multiple, share.holds_results = 2, 0, 1, True
    samples = [Sample(group_index=g, prompt_ids=[1], response_ids=[2], branch=b)
               for g, b in ((0, 0), (0, 1), (0, 2), (0, 0), (1, 0), (1, 1), (1, 0))]
    plan = share.plan_rollout(samples, 2)
    assert [start for start, _ in plan.steps] == [0, 4]
    for _, step in plan.steps:
        assert len({len(step.rank(d)) for d in range(2)}) == 1
    forward = [i for d in range(2) for mb in plan.forward.rank(d) for i in mb]
    assert sorted(forward) == list(range(7)) and len({len(plan.forward.rank(d)) for d in range(2)}) == 1
