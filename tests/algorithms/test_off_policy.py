"""Off-policy corrections (--use-tis levels and modes, --use-rs) against hand computations.

Every expected value below is written out from the published formulas with ``math`` on
plain floats, never by calling the code under test: ratio ``r = exp(old - rollout)``
(proximal over behaviour policy), token / sequence (product over loss tokens) /
geometric (per-token geometric mean) level, truncated (``clamp(r, low, cap)``) or masked
(``r`` inside ``[low, cap]``, else 0); rejection sampling keeps a token (1) or not (0).
"""

import math

import pytest
import torch

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss, reduce_metrics
from megatron_rl.algorithms.losses import (
    aggregate, bounded_weights, level_log_ratio, merge_metrics, ppo_clip_per_token, tis_weights)
from megatron_rl.data.packing import LossDenominators
from megatron_rl.errors import ConfigError

E20 = math.exp(20.0)  # the +20 clamp on a log-ratio before exp (verl's SAFETY_BOUND)


def denoms(tokens, samples):
    return LossDenominators(tokens, samples, tokens, samples)


def close(a, b, tol=1e-12):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0)


# Three responses: lengths 3, 2, 1. The middle token of the first is NOT a loss token (a tool
# span) and carries a wild +50 log-ratio that must not enter its sequence's sum; the third is a
# single-token response with log-ratio -50 (exp would underflow/overflow without care).
LENGTHS = [3, 2, 1]
MASK = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
D = [0.2, 50.0, -0.1, 0.3, 0.4, -50.0]  # old - rollout per token
ADV = [1.0, 1.0, 2.0, -1.0, 3.0, 0.5]


def batch(logprobs=None, old=None, mask=MASK, d=D, lengths=LENGTHS, adv=ADV):
    """LossInputs whose ratio exp(logp - old) is 1 unless ``logprobs`` says otherwise: pg = -A per token."""
    old_t = torch.tensor(old if old is not None else [-1.0, -2.0, -0.5, -1.5, -0.7, -3.0], dtype=torch.float64)
    lp = (torch.tensor(logprobs, dtype=torch.float64) if logprobs is not None else old_t.clone()).requires_grad_()
    rollout = old_t - torch.tensor(d, dtype=torch.float64)
    return LossInputs(lp, torch.tensor(adv, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64), lengths,
                      old_logprobs=old_t, rollout_logprobs=rollout)


def loss_of(cfg, x=None):
    x = x if x is not None else batch()
    loss, metrics = compute_policy_loss(x, denoms(int(sum(x.loss_mask.tolist())), len(x.response_lengths)), cfg)
    (grad,) = torch.autograd.grad(loss, x.logprobs)
    return loss.item(), grad, reduce_metrics([metrics])


def expected_loss(weights):
    """token_mean of w_t * (-A_t) over the 5 loss tokens (ratio 1: the PPO term is -A)."""
    return sum(w * -a * m for w, a, m in zip(weights, ADV, MASK)) / 5


# ---- the ratio at each level -------------------------------------------------------------------------------

def test_level_log_ratio_by_hand_excludes_masked_tokens():
    d, m = torch.tensor(D, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)
    assert close(level_log_ratio(d, m, LENGTHS, "token"), D)
    # sequence: sum over loss tokens only (0.2 - 0.1, the +50 tool token left out), broadcast per token
    seq = [0.2 - 0.1] * 3 + [0.3 + 0.4] * 2 + [-50.0]
    assert close(level_log_ratio(d, m, LENGTHS, "sequence"), seq)
    # geometric: that sum over the number of loss tokens (2, 2, 1)
    geo = [(0.2 - 0.1) / 2] * 3 + [(0.3 + 0.4) / 2] * 2 + [-50.0]
    assert close(level_log_ratio(d, m, LENGTHS, "geometric"), geo)


def test_masked_tokens_cannot_leak_inf_or_nan_into_a_sequence():
    d = torch.tensor([0.2, math.inf, -0.1, math.nan], dtype=torch.float64)
    m = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert close(level_log_ratio(d, m, [3, 1], "sequence"), [0.1, 0.1, 0.1, 0.0])
    assert close(level_log_ratio(d, m, [3, 1], "geometric"), [0.05, 0.05, 0.05, 0.0])  # no loss token: ratio 1


def test_single_token_response_is_the_same_at_every_level():
    d, m = torch.tensor([0.7], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    for level in ("token", "sequence", "geometric"):
        assert close(level_log_ratio(d, m, [1], level), [0.7])


# ---- truncate and mask -------------------------------------------------------------------------------------

def test_bounded_weights_truncate_and_mask_by_hand_with_extreme_ratios():
    lr = torch.tensor([0.2, 50.0, -50.0, math.log(0.4), 0.0], dtype=torch.float64)
    t = bounded_weights(lr, cap=2.0, low=0.5, mode="truncate")
    assert close(t.weight, [math.exp(0.2), 2.0, 0.5, 0.5, 1.0])
    assert close(t.raw, [math.exp(0.2), E20, math.exp(-50.0), 0.4, 1.0])  # +50 -> exp(20), finite
    assert t.above.tolist() == [False, True, False, False, False]
    assert t.below.tolist() == [False, False, True, True, False]
    mk = bounded_weights(lr, cap=2.0, low=0.5, mode="mask")
    assert close(mk.weight, [math.exp(0.2), 0.0, 0.0, 0.0, 1.0])
    assert mk.masked.tolist() == [False, True, True, True, False]
    # no lower bound: -50 stays a finite, tiny, positive weight
    assert bounded_weights(lr, cap=2.0, low=0.0, mode="mask").weight[2].item() == math.exp(-50.0)
    assert torch.isfinite(t.weight).all() and torch.isfinite(mk.weight).all()


def test_token_truncate_is_the_existing_tis_weight_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(64, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(64, generator=g, dtype=torch.float64)
    w, capped, floored = tis_weights(old, rollout, cap=2.0, low=0.5)
    b = bounded_weights(old - rollout, cap=2.0, low=0.5, mode="truncate")
    assert torch.equal(b.weight, w) and torch.equal(b.above, capped) and torch.equal(b.below, floored)


def test_default_use_tis_loss_and_gradient_are_unchanged_bit_for_bit():
    """The default (token, truncate) path: agg(clamp(exp(old - rollout), low, cap) * ppo) exactly as before."""
    x = batch(logprobs=[-0.7, -2.0, -0.9, -1.2, -0.7, -3.1])
    cfg = PolicyGradientConfig(use_tis=True, tis_clip_low=0.5)
    loss, metrics = compute_policy_loss(x, denoms(5, 3), cfg)
    (grad,) = torch.autograd.grad(loss, x.logprobs)
    lp = x.logprobs.detach().clone().requires_grad_()
    w, capped, _ = tis_weights(x.old_logprobs, x.rollout_logprobs, 2.0, 0.5)
    pg, *_ = ppo_clip_per_token(lp - x.old_logprobs, x.advantages, 0.2, 0.2)
    ref = aggregate(w * pg, x.loss_mask, LENGTHS, "token_mean", denoms(5, 3))
    (ref_grad,) = torch.autograd.grad(ref, lp)
    assert torch.equal(loss.detach(), ref.detach()) and torch.equal(grad, ref_grad)
    m = reduce_metrics([metrics])
    ws = [math.exp(0.2), 2.0, math.exp(-0.1), math.exp(0.3), math.exp(0.4), 0.5]
    assert close(m["tis_weight"], sum(w * k for w, k in zip(ws, MASK)) / 5)
    assert close(m["tis_capped_frac"], 0.0) and close(m["tis_clip_low_frac"], 1 / 5)
    assert close(m["tis_ratio_max"], math.exp(0.4))  # the +50 token is not a loss token


@pytest.mark.parametrize("level,mode,weights,metrics", [
    # token truncate, cap 2: e^.2, [tool], e^-.1, e^.3, e^.4, e^-50 (no lower bound)
    ("token", "truncate", [math.exp(0.2), 2.0, math.exp(-0.1), math.exp(0.3), math.exp(0.4), math.exp(-50)],
     {"tis_capped_frac": 0.0, "tis_ratio_max": math.exp(0.4)}),
    # token mask, cap 1.4: e^.4 = 1.49 > 1.4 is masked; the tool token's exp(20) is masked but not counted
    ("token", "mask", [math.exp(0.2), 0.0, math.exp(-0.1), math.exp(0.3), 0.0, math.exp(-50)],
     {"tis_masked_frac": 1 / 5, "tis_seq_masked_frac": 1 / 3, "tis_ratio_max": math.exp(0.4)}),
    # sequence truncate: e^.1 (the +50 tool token excluded), e^.7 = 2.01 -> 2, e^-50
    ("sequence", "truncate", [math.exp(0.1)] * 3 + [2.0] * 2 + [math.exp(-50)],
     {"tis_capped_frac": 2 / 5, "tis_seq_capped_frac": 1 / 3, "tis_ratio_max": math.exp(0.7)}),
    # sequence mask, cap 1.4: the second response (e^.7) is dropped whole
    ("sequence", "mask", [math.exp(0.1)] * 3 + [0.0] * 2 + [math.exp(-50)],
     {"tis_masked_frac": 2 / 5, "tis_seq_masked_frac": 1 / 3, "tis_ratio_max": math.exp(0.7)}),
    # geometric truncate: e^.05, e^.35 = 1.42 (under 2), e^-50
    ("geometric", "truncate", [math.exp(0.05)] * 3 + [math.exp(0.35)] * 2 + [math.exp(-50)],
     {"tis_capped_frac": 0.0, "tis_seq_capped_frac": 0.0, "tis_ratio_max": math.exp(0.35)}),
    # geometric mask, cap 1.4: 1.419 > 1.4, dropped
    ("geometric", "mask", [math.exp(0.05)] * 3 + [0.0] * 2 + [math.exp(-50)],
     {"tis_masked_frac": 2 / 5, "tis_seq_masked_frac": 1 / 3, "tis_ratio_max": math.exp(0.35)}),
])
def test_tis_levels_and_modes_by_hand(level, mode, weights, metrics):
    cap = 2.0 if mode == "truncate" else 1.4
    loss, grad, m = loss_of(PolicyGradientConfig(use_tis=True, tis_level=level, tis_mode=mode, tis_cap=cap))
    assert math.isclose(loss, expected_loss(weights), rel_tol=0, abs_tol=1e-12)
    # d/dlogp_t of w_t * (-A_t * r_t) / 5 at r = 1: -A_t w_t / 5 on loss tokens, 0 on the tool token
    assert close(grad, [-a * w * k / 5 for a, w, k in zip(ADV, weights, MASK)])
    assert close(m["tis_weight"], sum(w * k for w, k in zip(weights, MASK)) / 5)
    for name, value in metrics.items():
        assert close(m[name], value, 1e-9), (name, m[name], value)


def test_tis_lower_bound_masks_and_truncates_the_single_token_response():
    loss, _, m = loss_of(PolicyGradientConfig(use_tis=True, tis_mode="mask", tis_cap=2.0, tis_clip_low=0.5))
    # e^-50 < 0.5: the single-token response is masked; the others keep their ratio
    w = [math.exp(0.2), 0.0, math.exp(-0.1), math.exp(0.3), math.exp(0.4), 0.0]
    assert math.isclose(loss, expected_loss(w), abs_tol=1e-12)
    assert close(m["tis_masked_frac"], 1 / 5) and close(m["tis_seq_masked_frac"], 1 / 3)
    loss, _, m = loss_of(PolicyGradientConfig(use_tis=True, tis_level="sequence", tis_cap=2.0, tis_clip_low=0.5))
    w = [math.exp(0.1)] * 3 + [2.0] * 2 + [0.5]
    assert math.isclose(loss, expected_loss(w), abs_tol=1e-12)
    assert close(m["tis_clip_low_frac"], 1 / 5) and close(m["tis_seq_clip_low_frac"], 1 / 3)
    assert close(m["tis_seq_capped_frac"], 1 / 3)


def test_areal_decoupled_ppo_by_hand():
    """AReaL's ppo_actor_loss_fn with a behaviour cap: w = exp(prox - behav), masked where w > cap, times
    PPO clip around the proximal policy; masked tokens stay in the denominator (its loss_mask_count)."""
    lp = [-0.7, -2.0, -0.9, -1.2, -0.7, -3.1]
    prox = [-1.0, -2.0, -0.5, -1.5, -0.7, -3.0]
    x = batch(logprobs=lp, old=prox)
    loss, grad, m = loss_of(PolicyGradientConfig(use_tis=True, tis_mode="mask", tis_cap=1.4), x)
    total, g = 0.0, []
    for lpt, pt, dt, a, k in zip(lp, prox, D, ADV, MASK):
        r = math.exp(lpt - pt)
        w = math.exp(dt) if math.exp(dt) <= 1.4 else 0.0
        surr = max(-a * r, -a * min(max(r, 0.8), 1.2))
        total += k * w * surr
        unclipped = -a * r >= -a * min(max(r, 0.8), 1.2)  # the unclipped branch carries the gradient
        g.append(k * w * (-a * r if unclipped else 0.0) / 5)
    assert math.isclose(loss, total / 5, abs_tol=1e-12) and close(grad, g)
    assert close(m["tis_masked_frac"], 1 / 5)  # only e^.4 > 1.4 among loss tokens


# ---- rejection sampling --------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,keep,masked_frac,seq_frac,ratio_max", [
    # bounds [1/1.3, 1.3]: e^.3 = 1.35 and e^.4 = 1.49 out, e^-50 out
    ("token", [1, 0, 1, 0, 0, 0], 3 / 5, 2 / 3, math.exp(0.4)),
    ("sequence", [1, 1, 1, 0, 0, 0], 3 / 5, 2 / 3, math.exp(0.7)),
    ("geometric", [1, 1, 1, 0, 0, 0], 3 / 5, 2 / 3, math.exp(0.35)),  # e^.35 = 1.42 > 1.3
])
def test_rejection_sampling_by_hand(level, keep, masked_frac, seq_frac, ratio_max):
    loss, grad, m = loss_of(PolicyGradientConfig(use_rs=True, rs_level=level, rs_upper_bound=1.3))
    assert math.isclose(loss, expected_loss(keep), abs_tol=1e-12)
    assert close(grad, [-a * w * k / 5 for a, w, k in zip(ADV, keep, MASK)])
    assert close(m["rs_masked_frac"], masked_frac) and close(m["rs_seq_masked_frac"], seq_frac)
    assert close(m["rs_ratio_max"], ratio_max, 1e-9) and "tis_weight" not in m


def test_rejection_sampling_combines_with_truncated_is():
    """verl's decoupled geo-RS + token-TIS: w = clamp(r_t, 0, 2) * 1[geometric ratio in [0.5, 1.5]]."""
    loss, _, m = loss_of(PolicyGradientConfig(use_tis=True, use_rs=True, rs_level="geometric", rs_upper_bound=1.5,
                                              rs_lower_bound=0.5))
    w = [math.exp(0.2), 2.0, math.exp(-0.1), math.exp(0.3), math.exp(0.4), 0.0]  # e^-50 < 0.5: rejected
    assert math.isclose(loss, expected_loss(w), abs_tol=1e-12)
    assert close(m["rs_masked_frac"], 1 / 5) and close(m["rs_seq_masked_frac"], 1 / 3)
    assert close(m["tis_weight"], (math.exp(0.2) + math.exp(-0.1) + math.exp(0.3) + math.exp(0.4) + math.exp(-50)) / 5)


def test_fully_masked_response_adds_nothing_and_is_not_counted():
    mask = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]  # the second response has no loss token
    x = batch(mask=mask)
    cfg = PolicyGradientConfig(use_tis=True, tis_level="sequence", tis_mode="mask", tis_cap=1.4, tis_clip_low=0.5,
                               use_rs=True, rs_level="sequence", rs_upper_bound=1.3)
    loss, metrics = compute_policy_loss(x, denoms(3, 3), cfg)
    m = reduce_metrics([metrics])
    # sequence 0 keeps e^.1; the single-token response is masked by both (e^-50 < 0.5 and < 1/1.3)
    assert math.isclose(loss.item(), (math.exp(0.1) * (-1.0) + math.exp(0.1) * (-2.0)) / 3, abs_tol=1e-12)
    assert close(m["tis_seq_masked_frac"], 1 / 2) and close(m["rs_seq_masked_frac"], 1 / 2)  # of 2 responses
    assert close(m["tis_masked_frac"], 1 / 3) and close(m["rs_masked_frac"], 1 / 3)
    assert close(m["tis_ratio_max"], math.exp(0.1))


def test_extreme_ratios_keep_loss_gradient_and_metrics_finite():
    d = [50.0, -50.0, 50.0, -50.0, 50.0, -50.0]
    for cfg in (PolicyGradientConfig(use_tis=True), PolicyGradientConfig(use_tis=True, tis_level="sequence"),
                PolicyGradientConfig(use_tis=True, tis_level="geometric", tis_mode="mask"),
                PolicyGradientConfig(use_rs=True, rs_level="sequence")):
        x = batch(d=d, mask=[1.0] * 6)
        loss, metrics = compute_policy_loss(x, denoms(6, 3), cfg)
        (grad,) = torch.autograd.grad(loss, x.logprobs)
        m = reduce_metrics([metrics])
        assert math.isfinite(loss.item()) and torch.isfinite(grad).all() and all(map(math.isfinite, m.values()))
    # sequence of +50, -50, +50: sum +50 -> weight capped at 2, raw max exp(20)
    _, _, m = loss_of(PolicyGradientConfig(use_tis=True, tis_level="sequence"), batch(d=d, mask=[1.0] * 6))
    assert m["tis_ratio_max"] == E20 and close(m["tis_seq_capped_frac"], 1 / 3)


# ---- max metrics reduce with max -----------------------------------------------------------------------------

def test_max_metrics_take_the_max_over_micro_batches_and_ignore_empty_ones():
    cfg = PolicyGradientConfig(use_tis=True, tis_level="geometric")
    parts = []
    for idx in ([0, 1, 2], [3, 4], [5]):
        t = torch.tensor(idx)
        lengths = [len(idx)]
        x = LossInputs(torch.zeros(len(idx), dtype=torch.float64), torch.ones(len(idx), dtype=torch.float64),
                       torch.tensor(MASK, dtype=torch.float64)[t] * (0.0 if idx == [5] else 1.0), lengths,
                       old_logprobs=torch.zeros(len(idx), dtype=torch.float64),
                       rollout_logprobs=-torch.tensor(D, dtype=torch.float64)[t])
        parts.append(compute_policy_loss(x, denoms(4, 3), cfg)[1])
    m = reduce_metrics(parts)
    assert close(m["tis_ratio_max"], math.exp(0.35))  # the fully masked micro-batch (e^-50 -> 0) never wins
    assert merge_metrics(parts)["tis_ratio_max"][1].item() == 4.0  # counts still add up


# ---- flags ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(use_tis=True, tis_level="seq"), r"--tis-level='seq' is invalid: choose one of \('token', 'sequence'"),
    (dict(use_tis=True, tis_mode="clip"), r"--tis-mode='clip' is invalid: .*truncate with --tis-clip-low"),
    (dict(tis_level="sequence"), r"--tis-level='sequence' is invalid: .*add --use-tis or drop it"),
    (dict(tis_mode="mask"), r"--tis-mode='mask' is invalid: .*add --use-tis"),
    (dict(use_rs=True, rs_level="max"), r"--rs-level='max' is invalid: choose one of"),
    (dict(use_rs=True, rs_upper_bound=0.9), r"--rs-upper-bound=0.9 is invalid: .*use a value >= 1"),
    (dict(use_rs=True, rs_lower_bound=1.5), r"--rs-lower-bound=1.5 is invalid: .*\[0, 1\]"),
    (dict(rs_level="geometric"), r"--rs-level='geometric' is invalid: .*add --use-rs or drop it"),
    (dict(rs_upper_bound=3.0), r"--rs-upper-bound=3.0 is invalid: .*add --use-rs"),
    (dict(rs_lower_bound=0.5), r"--rs-lower-bound=0.5 is invalid: .*add --use-rs"),
    (dict(use_rs=True, use_rollout_logprobs=True), r"--use-rollout-logprobs=True is invalid: with --use-rs"),
    (dict(use_tis=True, tis_mode="mask", tis_cap=0.9), r"--tis-cap=0.9 is invalid: .*>= 1"),
])
def test_off_policy_config_errors_name_flag_value_and_fix(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PolicyGradientConfig(**kwargs)


def test_rs_lower_bound_defaults_to_the_reciprocal_and_rollout_logprobs_are_required():
    assert PolicyGradientConfig(use_rs=True, rs_upper_bound=4.0).rs_low == 0.25
    assert PolicyGradientConfig(use_rs=True, rs_lower_bound=0.1).rs_low == 0.1
    assert PolicyGradientConfig(use_rs=True).needs_rollout_logprobs
    assert not PolicyGradientConfig().needs_rollout_logprobs
    x = batch()
    bare = LossInputs(x.logprobs, x.advantages, x.loss_mask, LENGTHS, old_logprobs=x.old_logprobs)
    with pytest.raises(ValueError, match="rollout_logprobs is None but --use-rs"):
        compute_policy_loss(bare, denoms(5, 3), PolicyGradientConfig(use_rs=True))


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def test_flags_reach_the_spec(hf_dir):
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.config import parse_config

    c = spec_from_config(parse_config([
        "--hf-checkpoint", hf_dir, "--use-tis", "--tis-level", "geometric", "--tis-mode", "mask", "--tis-clip", "1.01",
        "--use-rs", "--rs-level", "sequence", "--rs-upper-bound", "3.0", "--rs-lower-bound", "0.2"])).cfg
    assert (c.use_tis, c.tis_level, c.tis_mode, c.tis_cap) == (True, "geometric", "mask", 1.01)
    assert (c.use_rs, c.rs_level, c.rs_upper_bound, c.rs_lower_bound) == (True, "sequence", 3.0, 0.2)


@pytest.mark.parametrize("flags,match", [
    (["--rs-upper-bound", "0.5"], r"--rs-upper-bound 0.5 is out of range: it must lie in \[1, inf\)"),
    (["--rs-lower-bound", "2"], r"--rs-lower-bound 2 is out of range: it must lie in \[0, 1\]"),
    (["--tis-level", "seq"], r"--tis-level: invalid choice: 'seq' \(choose from 'token', 'sequence', 'geometric'\)"),
    (["--tis-mode", "clip"], r"--tis-mode: invalid choice: 'clip' \(choose from 'truncate', 'mask'\)"),
])
def test_flag_values_are_refused_while_parsing(hf_dir, flags, match):
    from megatron_rl.config import parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(["--hf-checkpoint", hf_dir, *flags])


def test_peer_mapping_table_names_only_flags_that_exist():
    """The migration table (docs/migrating-from-slime.md) must not send a verl/slime/AReaL user to a flag
    that does not parse."""
    import re

    from megatron_rl.config.migration import OFF_POLICY_PEERS
    from megatron_rl.config.schema import flag_name, iter_fields

    known = {n for _, _, f in iter_fields() for n in (flag_name(f), *f.metadata["aliases"])}
    named = {m for _, _, here in OFF_POLICY_PEERS for m in re.findall(r"--[a-z][a-z-]*", here)}
    assert named and named <= known, sorted(named - known)
    assert {"--use-tis", "--tis-level", "--tis-mode", "--use-rs", "--rs-level"} <= named
