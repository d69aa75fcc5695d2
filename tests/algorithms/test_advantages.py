"""Advantage estimators against values worked out by hand."""

import math

import pytest
import torch

from megatron_rl.algorithms.advantages import (broadcast_to_tokens, discounted_returns, gae_advantages,
                                               grpo_advantages, reinforce_plus_plus_advantages, rloo_advantages)


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol)


def test_grpo_group_normalised_with_degenerate_groups():
    # group 0: {1, 0} mean .5, unbiased std sqrt(.5); group 1 all equal; groups 2 and 3 have one sample.
    adv = grpo_advantages([1.0, 0.0, 1.0, 1.0, 5.0, 2.0], [0, 0, 1, 1, 2, 3], eps=0.0)
    s = math.sqrt(0.5)
    assert close(adv, [0.5 / s, -0.5 / s, 0, 0, 0, 0])
    assert not torch.isnan(adv).any()


def test_grpo_non_contiguous_groups_and_eps():
    adv = grpo_advantages([1.0, 2.0, 3.0, 6.0], [7, 9, 7, 9], eps=1e-6)
    assert close(adv, [-1 / (math.sqrt(2) + 1e-6), -2 / (math.sqrt(8) + 1e-6),
                       1 / (math.sqrt(2) + 1e-6), 2 / (math.sqrt(8) + 1e-6)])


def test_dr_grpo_skips_std():
    adv = grpo_advantages([1.0, 2.0, 3.0, 6.0, 4.0], [7, 9, 7, 9, 5], normalize_std=False)
    assert close(adv, [-1, -2, 1, 2, 0])


def test_grpo_batch_std_is_trl_scale_rewards_batch():
    # TRL's GRPOTrainer with scale_rewards="batch", restated: (r - mean_group) / (std(all rewards, Bessel) + eps).
    # Group 5 has one sample and group 3 no contrast: 0, as TRL's r - mean_group gives there.
    r = [1.0, 2.0, 3.0, 6.0, 4.0, 0.5, 0.5]
    g = [7, 9, 7, 9, 5, 3, 3]
    n, mean = len(r), sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (n - 1))
    adv = grpo_advantages(r, g, eps=1e-6, std_level="batch")
    assert close(adv, [-1 / (std + 1e-6), -2 / (std + 1e-6), 1 / (std + 1e-6), 2 / (std + 1e-6), 0, 0, 0], 1e-7)
    # group level on the same rewards differs (each group's own spread), the baseline does not
    assert not close(grpo_advantages(r, g, eps=1e-6), adv, 1e-3)
    # edges: every reward equal, a single reward, an empty batch -> 0 / empty, never nan
    assert torch.equal(grpo_advantages([0.3] * 4, [0, 0, 1, 1], std_level="batch"), torch.zeros(4))
    assert torch.equal(grpo_advantages([0.3], [0], std_level="batch"), torch.zeros(1))
    assert grpo_advantages([], [], std_level="batch").numel() == 0
    with pytest.raises(ValueError, match="std_level 'global'"):
        grpo_advantages(r, g, std_level="global")


def test_rloo_leave_one_out_baseline():
    adv = rloo_advantages([1.0, 0.0, 2.0, 3.0, 3.0, 9.0], [0, 0, 0, 1, 1, 2])
    assert close(adv, [1 - 1.0, 0 - 1.5, 2 - 0.5, 0, 0, 0])
    assert rloo_advantages([], []).numel() == 0


def test_broadcast_masks_tokens_and_handles_empty_responses():
    out = broadcast_to_tokens(torch.tensor([2.0, 5.0, -1.0]), [2, 0, 3], torch.tensor([1.0, 0, 1, 1, 0]))
    assert close(out, [2, 0, -1, -1, 0])


def test_reinforce_plus_plus_kl_in_reward_and_whitening():
    # lengths [2, 3]; last token of sample 1 is masked so its reward lands on token 3.
    mask = torch.tensor([1.0, 1, 1, 1, 0])
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    adv = reinforce_plus_plus_advantages([1.0, 0.0], [2, 3], mask, kl=kl, kl_coef=0.1)
    # token rewards: [-.01, .98 | -.03, -.04, 0]; returns (gamma 1): [.97, .98 | -.07, -.04, 0]
    returns = [0.97, 0.98, -0.07, -0.04]
    mean = sum(returns) / 4
    var = sum((r - mean) ** 2 for r in returns) / 3  # Bessel (n-1), eps inside the sqrt, as verl/slime
    assert close(adv, [(r - mean) / math.sqrt(var + 1e-8) for r in returns] + [0.0])


def test_reinforce_plus_plus_baseline_gamma_and_empty():
    mask = torch.tensor([1.0, 1, 1])
    # REINFORCE++-baseline: group mean subtracted first: rewards {3, 1} -> {1, -1}; empty sample ignored.
    adv = reinforce_plus_plus_advantages([3.0, 7.0, 1.0], [2, 0, 1], mask, gamma=0.5, group_index=[0, 1, 0])
    returns = [0.5, 1.0, -1.0]  # sample 0: reward 1 on token 1, discounted .5 to token 0
    mean = sum(returns) / 3
    var = sum((r - mean) ** 2 for r in returns) / 2
    assert close(adv, [(r - mean) / math.sqrt(var + 1e-8) for r in returns])
    # All-equal returns: whitening gives 0, not NaN. No loss tokens at all: zeros.
    assert close(reinforce_plus_plus_advantages([1.0, 1.0], [1, 1], torch.ones(2)), [0, 0])
    assert close(reinforce_plus_plus_advantages([1.0], [2], torch.zeros(2)), [0, 0])


def test_discounted_returns_per_sample():
    out = discounted_returns(torch.tensor([1.0, 2, 3, 4, 5, 6]), [2, 0, 4], gamma=0.5)
    assert close(out, [2, 2, 7, 8, 8, 6])


def test_gae_hand_values_and_monte_carlo_limit():
    rewards = torch.tensor([0.0, 1, 0, 0, 2])
    values = torch.tensor([0.5, 0.5, 0.1, 0.2, 0.3])
    adv, ret = gae_advantages(rewards, values, [2, 0, 3], gamma=0.9, lam=0.8)
    # sample 0: A1 = 1 - .5 = .5; A0 = (.9*.5 - .5) + .72*.5 = .31
    # sample 2: A2 = 2 - .3 = 1.7; A1 = (.9*.3 - .2) + .72*1.7 = 1.294; A0 = (.9*.2 - .1) + .72*1.294
    a0 = 0.08 + 0.72 * 1.294
    assert close(adv, [0.31, 0.5, a0, 1.294, 1.7])
    assert close(ret, adv + values)
    # gamma = lam = 1: A = Monte-Carlo return - V.
    adv1, _ = gae_advantages(rewards, values, [2, 3], gamma=1.0, lam=1.0)
    assert close(adv1, discounted_returns(rewards, [2, 3]) - values)


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages])
def test_all_equal_rewards_give_zero(fn):
    adv = fn([0.1] * 3 + [0.7] * 5, [0] * 3 + [1] * 5)
    assert (adv == 0).all()  # exactly 0, although float means of 0.1s are not exactly 0.1


def test_reinforce_plus_plus_constant_rewards_whiten_to_exactly_zero():
    # six samples rewarded 0.1 gave -0.427 on every token (float32 mean 1 ulp off / (1e-8 + eps)).
    lengths = [3, 1, 4, 2, 5, 2]
    mask = torch.ones(sum(lengths))
    assert (reinforce_plus_plus_advantages([0.1] * 6, lengths, mask) == 0).all()
    g = torch.Generator().manual_seed(0)
    for _ in range(54):
        n = int(torch.randint(2, 12, (1,), generator=g))
        lengths = torch.randint(1, 6, (n,), generator=g).tolist()
        value = float(torch.randn((), generator=g)) * 10 ** int(torch.randint(-3, 3, (1,), generator=g))
        adv = reinforce_plus_plus_advantages([value] * n, lengths, torch.ones(sum(lengths)))
        assert (adv == 0).all(), value
    # One loss token in the whole batch: no variance to divide by, so 0 (not NaN, not the raw return).
    assert (reinforce_plus_plus_advantages([2.0], [3], torch.tensor([0.0, 1, 0])) == 0).all()


def test_gae_skips_masked_spans():
    # turn 1 (2 tokens), a tool observation (2 masked tokens), turn 2 (1 token) with the reward.
    rewards = torch.tensor([0.0, 0, 5.0, 5.0, 1.0])  # rewards on masked tokens are dropped (verl)
    values = torch.tensor([0.2, 0.4, 9.0, 9.0, 0.5])
    mask = torch.tensor([1.0, 1, 0, 0, 1])
    adv, ret = gae_advantages(rewards, values, [5], loss_mask=mask, gamma=0.9, lam=0.8)
    # over the unmasked tokens only: V = [.2, .4, .5], r = [0, 0, 1]
    a2 = 1.0 - 0.5
    a1 = (0.9 * 0.5 - 0.4) + 0.72 * a2
    a0 = (0.9 * 0.4 - 0.2) + 0.72 * a1
    assert close(adv, [a0, a1, 0, 0, a2])
    assert close(ret, [a0 + 0.2, a1 + 0.4, 0, 0, a2 + 0.5])
    # equals GAE on the sample with the masked span cut out
    cut, _ = gae_advantages(rewards[[0, 1, 4]], values[[0, 1, 4]], [3], gamma=0.9, lam=0.8)
    assert close(adv[[0, 1, 4]], cut)
