"""A trajectory split into branches (an agent session whose chat template is not append-only) counts once in every
advantage estimator: it trains as the same trajectory unsplit would.

The check: one batch where a session is two samples (``Sample.branch`` 0 and 1, consecutive) and the same batch
with that session as one sample (the branches' responses and loss masks concatenated in branch order, one
reward). Every estimator's flat token advantages must be equal: the group estimators give each branch its
session's advantage, ReMax its session's reward minus the prompt's greedy baseline, REINFORCE++ runs its returns
over the session's branches in order (the reward once, at its last loss token; the KL penalties after a token in
its return) and its group mean over sessions, and a custom function's pre-shaped ``rewards`` count the session once.
Without the rule a split session weighs twice in its group's mean and std (or its reward is added twice to the
returns' whitening).
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.spec import PolicyGradientSpec
from megatron_rl.data.types import Sample


def _sample(group: int, response: int, reward: float, *, branch: int = 0, masked: tuple = (), baseline=0.25):
    mask = [0 if k in masked else 1 for k in range(response)]
    return Sample(group_index=group, prompt_ids=[1, 2], response_ids=list(range(3, 3 + response)), reward=reward,
                  loss_mask=mask, branch=branch, reward_baseline=baseline)


def _batches():
    """(branched, merged, per-sample log-probs of each): group 0 holds session A split in two branches (reward 1)
    and two whole sessions; group 1 three whole sessions. In ``merged`` A is one sample."""
    a0, a1 = _sample(0, 4, 1.0, masked=(2,)), _sample(0, 3, 1.0, branch=1, masked=(0,))
    rest0 = [_sample(0, 5, 0.0), _sample(0, 2, 0.5)]
    group1 = [_sample(1, 3, 1.0, baseline=0.5), _sample(1, 4, 0.0, baseline=0.5), _sample(1, 2, 0.0, baseline=0.5)]
    merged_a = Sample(group_index=0, prompt_ids=[1, 2], response_ids=a0.response_ids + a1.response_ids, reward=1.0,
                      loss_mask=a0.loss_mask + a1.loss_mask, reward_baseline=0.25)
    branched = [a0, a1, *rest0, *group1]
    merged = [merged_a, *rest0, *group1]
    gen = torch.Generator().manual_seed(0)
    old = [torch.randn(s.response_length, generator=gen) * 0.1 for s in branched]
    ref = [o + torch.randn(o.shape, generator=gen) * 0.05 for o in old]
    merge = lambda xs: [torch.cat(xs[:2]), *xs[2:]]  # noqa: E731 - A's two branches as one sample
    return branched, merged, (old, ref), (merge(old), merge(ref))


def _flat(advantages) -> torch.Tensor:
    return torch.cat([a.reshape(-1) for a in advantages])


CASES = [
    ("grpo", {}), ("rloo", {}), ("gpg", {}), ("opo", {}), ("remax", {}), ("remax", {"normalize_advantages": True}),
    ("reinforce_plus_plus", {}), ("reinforce_plus_plus_baseline", {}),
    ("reinforce_plus_plus", {"kl_coef": 0.1, "gamma": 0.9}),
    ("reinforce_plus_plus", {"kl_coef": 0.1, "gamma": 0.95, "kl_ctrl_type": "adaptive", "kl_target": 0.01,
                             "kl_horizon": 100}),
    ("reinforce_plus_plus_baseline", {"gamma": 0.9}),
]


@pytest.mark.parametrize("estimator,extra", CASES, ids=[f"{e}{'-' + '-'.join(x) if x else ''}" for e, x in CASES])
def test_a_session_split_into_branches_gets_the_advantages_of_the_session_unsplit(estimator, extra):
    branched, merged, (old, ref), (m_old, m_ref) = _batches()
    cfg = PolicyGradientConfig(advantage_estimator=estimator, **extra)
    split_spec, whole_spec = PolicyGradientSpec(cfg), PolicyGradientSpec(cfg)
    got = _flat(split_spec.compute_advantages(branched, old_logprobs=old, ref_logprobs=ref))
    want = _flat(whole_spec.compute_advantages(merged, old_logprobs=m_old, ref_logprobs=m_ref))
    assert torch.equal(got, want), (got, want)
    assert got.abs().sum() > 0  # not a vacuous equality
    # the rule matters: each branch as a sample of its own (the session weighing twice in its group's statistics,
    # its reward on both branches' last tokens) agrees with the unsplit session only where no statistic or return
    # mixes samples: ReMax, OPO (its baseline weighs each sample by its loss tokens: the branches' add up to the
    # session's) and REINFORCE++ without a KL penalty at gamma 1 (every return is the reward)
    alone = [Sample(**{**vars(s), "branch": 0}) for s in branched]
    as_samples = _flat(PolicyGradientSpec(cfg).compute_advantages(alone, old_logprobs=old, ref_logprobs=ref))
    same = estimator in ("remax", "opo") or (estimator == "reinforce_plus_plus" and not extra)
    assert torch.equal(as_samples, want) == same
    if extra.get("kl_ctrl_type") == "adaptive":  # the controller moved by the same step: sessions, not samples
        assert split_spec.kl_ctrl.value == whole_spec.kl_ctrl.value != cfg.kl_coef


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus_baseline", "reinforce_plus_plus"])
def test_a_custom_advantage_function_sees_a_split_session_once(estimator):
    """--custom-advantage-function-path: ``rollout_data['rewards']`` (pre-shaped as slime's) is the session's for each
    of its branches, shaped over the group's sessions; ``trajectory_index`` numbers the batch's trajectories so the
    function can count each once. A function returning its rewards per token trains the split session as the
    whole one."""
    seen = []

    def reward_per_token(args, rollout_data):
        seen.append({k: rollout_data[k] for k in ("rewards", "trajectory_index")})
        rollout_data["advantages"] = [torch.full((n,), r) for r, n in zip(rollout_data["rewards"],
                                                                         rollout_data["response_lengths"])]

    branched, merged, _, _ = _batches()
    cfg = PolicyGradientConfig(advantage_estimator=estimator)
    spec = PolicyGradientSpec(cfg, custom_advantage_fn=reward_per_token, args=types.SimpleNamespace())
    got, want = _flat(spec.compute_advantages(branched)), _flat(spec.compute_advantages(merged))
    assert torch.equal(got, want)
    split, whole = seen
    assert split["trajectory_index"] == [0, 0, 1, 2, 3, 4, 5] and whole["trajectory_index"] == list(range(6))
    assert split["rewards"][:2] == [whole["rewards"][0]] * 2 and split["rewards"][2:] == whole["rewards"][1:]


def test_reordered_branches_are_refused_by_every_estimator():
    """A branch must follow its trajectory's previous one (the batch keeps them consecutive); the per-token
    estimators now rely on it too and name the sample instead of mixing two trajectories' tokens."""
    branched, _, _, _ = _batches()
    shuffled = [branched[1], branched[0], *branched[2:]]
    for estimator in ("reinforce_plus_plus", "remax"):
        with pytest.raises(ValueError, match="sample 0 .* is branch 1 of a trajectory"):
            PolicyGradientSpec(PolicyGradientConfig(advantage_estimator=estimator)).compute_advantages(shuffled)
