"""Policy losses against hand-computed values, and exact global normalisation."""

import math

import pytest
import torch

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss, reduce_metrics
from megatron_rl.algorithms.losses import aggregate, kl_estimate, ppo_clip_per_token, tis_weights
from megatron_rl.data.packing import LossDenominators, compute_loss_denominators
from megatron_rl.errors import ConfigError


def denoms(tokens, samples):
    return LossDenominators(tokens, samples, tokens, samples)


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol)


def test_aggregation_modes():
    x = torch.tensor([1.0, 2, 3, 4, 10])
    mask = torch.tensor([1.0, 1, 1, 1, 1])
    d = denoms(5, 2)
    assert close(aggregate(x, mask, [3, 2], "token_mean", d), 20 / 5)
    assert close(aggregate(x, mask, [3, 2], "seq_mean_token_mean", d), (2 + 7) / 2)
    assert close(aggregate(x, mask, [3, 2], "seq_mean_token_sum_norm", d, max_response_length=4), 20 / (2 * 4))
    # Masks, an empty response and a fully masked one: they add nothing but still count as samples.
    mask = torch.tensor([1.0, 0, 1, 0, 0])
    d = denoms(2, 4)
    assert close(aggregate(x, mask, [3, 0, 2, 0], "token_mean", d), 4 / 2)
    assert close(aggregate(x, mask, [3, 0, 2, 0], "seq_mean_token_mean", d), 2 / 4)


def test_ppo_clip_with_clip_higher_and_dual_clip():
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 4.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    log_ratio = ratio.log().requires_grad_()
    loss, r, clipped, dual = ppo_clip_per_token(log_ratio, adv, 0.2, 0.28, dual_clip_c=3.0)
    # max(-A r, -A clip(r, .8, 1.28)); A<0 capped at -A*3
    assert close(loss, [-1.28, -0.5, 0.8, 1.5, 3.0])
    assert clipped.tolist() == [True, False, True, False, False]  # token 4: only the dual clip acts
    assert dual.tolist() == [False, False, False, False, True]
    loss.sum().backward()
    # d/dlog_ratio of -A r is -A r where unclipped, 0 where the clip or dual-clip is active
    assert close(log_ratio.grad, [0, -0.5, 0, 1.5, 0])


def _inputs(seed=0, lengths=(3, 0, 4, 2, 5, 1), requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    logprobs = (-torch.rand(n, generator=g, dtype=torch.float64) * 2).requires_grad_(requires_grad)
    mask = (torch.rand(n, generator=g) > 0.2).double()
    mask[-1] = 0.0  # the last sample (length 1) is fully masked
    return dict(
        logprobs=logprobs,
        advantages=torch.randn(n, generator=g, dtype=torch.float64),
        loss_mask=mask,
        response_lengths=list(lengths),
        old_logprobs=logprobs.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64),
        ref_logprobs=logprobs.detach() + 0.2 * torch.randn(n, generator=g, dtype=torch.float64),
        rollout_logprobs=logprobs.detach() + 0.4 * torch.randn(n, generator=g, dtype=torch.float64),
        teacher_logprobs=logprobs.detach() + 0.5 * torch.randn(n, generator=g, dtype=torch.float64),
        entropy=(torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_(requires_grad),
    )


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert close(kl_estimate(lp, ref, "k1"), [0.5])
    assert close(kl_estimate(lp, ref, "k2"), [0.125])
    assert close(kl_estimate(lp, ref, "k3"), [math.exp(-0.5) - 1 + 0.5])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_full_loss_hand_values_and_grads():
    """Two samples, every term on; expected loss and d loss / d logprobs written out per token."""
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -2.0, -0.2], dtype=torch.float64)
    rollout = torch.tensor([-1.1 - math.log(3.0), -2.0 + 0.1, -0.2], dtype=torch.float64)
    ref = torch.tensor([-1.2, -2.0, -0.5], dtype=torch.float64)
    teacher = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    ent = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    cfg = PolicyGradientConfig(eps_clip=0.2, eps_clip_high=0.28, kl_loss_coef=0.5, kl_loss_type="k1",
                               entropy_coef=0.01, use_tis=True, tis_cap=2.0, opd_coef=0.1)
    inputs = LossInputs(lp, adv, mask, [2, 1], old_logprobs=old, ref_logprobs=ref, rollout_logprobs=rollout,
                        teacher_logprobs=teacher, entropy=ent)
    loss, metrics = compute_policy_loss(inputs, denoms(3, 2), cfg)
    r = [math.exp(0.1), 1.0, math.exp(-0.3)]
    w = [2.0, math.exp(-0.1), 1.0]  # exp(old - rollout) = 3 capped at 2
    pg = [-r[0], -r[1], 2 * max(r[2], 0.8)]  # token 2: A<0, r=.741 < .8 -> clipped at .8
    kl = [0.2, 0.0, 0.0]
    rkl = [0.5, -1.0, 0.0]
    opd = [rkl[i] * r[i] for i in range(3)]
    expect = sum(w[i] * pg[i] + 0.5 * kl[i] - 0.01 * [1, 2, 3][i] + 0.1 * w[i] * opd[i] for i in range(3)) / 3
    assert close(loss, expect)
    loss.backward()
    dpg = [-r[0], -r[1], 0.0]  # clipped token has no gradient
    expect_grad = [(w[i] * dpg[i] + 0.5 + 0.1 * w[i] * rkl[i] * r[i]) / 3 for i in range(3)]
    assert close(lp.grad, expect_grad)
    assert close(ent.grad, [-0.01 / 3] * 3)
    m = reduce_metrics([metrics])
    assert close(m["clip_frac"], 1 / 3) and close(m["tis_capped_frac"], 1 / 3)
    assert close(m["tis_weight"], sum(w) / 3) and close(m["kl"], 0.2 / 3) and close(m["entropy"], 2.0)
    assert close(m["ratio"], sum(r) / 3) and close(m["opd_reverse_kl"], -0.5 / 3)
    assert close(m["mismatch_abs_logprob"], (math.log(3) + 0.1) / 3)
    k3 = [3 - 1 - math.log(3), math.exp(-0.1) - 1 + 0.1, 0.0]
    assert close(m["mismatch_k3_kl"], sum(k3) / 3)
    assert m["loss_tokens"] == 3


def test_tis_weight_is_detached_and_capped():
    old = torch.tensor([0.0, -1.0], requires_grad=True)
    w, capped, _ = tis_weights(old, torch.tensor([-5.0, -1.5]), cap=2.0)
    assert close(w, [2.0, math.exp(0.5)]) and capped.tolist() == [True, False] and not w.requires_grad


def test_gspo_matches_sequence_level_objective():
    """GSPO-token under seq_mean_token_mean has the sequence-level GSPO value and gradient."""
    x = _inputs(seed=3)
    lengths, mask = x["response_lengths"], x["loss_mask"]
    noise = torch.randn(len(mask), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x["old_logprobs"] = x["logprobs"].detach() + 0.002 * noise  # seeded: the clip-fraction check needs some clipping
    cfg = PolicyGradientConfig(use_gspo=True, loss_agg_mode="seq_mean_token_mean")
    # sequence-level advantages, as GRPO gives them
    seq_adv = torch.tensor([0.5, 1.0, -1.0, 2.0, -0.3, 0.7], dtype=torch.float64)
    x["advantages"] = seq_adv.repeat_interleave(torch.tensor(lengths))
    inputs = LossInputs(**{k: x[k] for k in ("logprobs", "advantages", "loss_mask", "response_lengths",
                                             "old_logprobs")})
    d = compute_loss_denominators(torch.split(mask, lengths))
    loss, metrics = compute_policy_loss(inputs, d, cfg)
    (g_tok,) = torch.autograd.grad(loss, x["logprobs"])
    # reference: s_i = exp(mean(logp - old)), loss = sum_i max(-A s, -A clip(s)) / num_samples
    lp = x["logprobs"]
    ref = lp.new_zeros(())
    for i, piece in enumerate(zip(torch.split(lp, lengths), torch.split(x["old_logprobs"], lengths),
                                  torch.split(mask, lengths))):
        p, o, m = piece
        if m.sum() == 0:
            continue
        s = torch.exp(((p - o) * m).sum() / m.sum())
        a = seq_adv[i]
        ref = ref + torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4))
    ref = ref / d.global_samples
    (g_ref,) = torch.autograd.grad(ref, lp)
    assert close(loss, ref, 1e-12) and close(g_tok, g_ref, 1e-12)
    assert 0 < reduce_metrics([metrics])["clip_frac"] < 1


def _split_total(cfg, x, parts):
    """Sum of per-micro-batch losses over a partition of samples; grads accumulate into the leaves."""
    lengths = x["response_lengths"]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    d = compute_loss_denominators(torch.split(x["loss_mask"], lengths))
    total, metrics = 0.0, []
    for idx in parts:
        tok = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx]) if idx else torch.zeros(0).long()
        fields = {k: (v[tok] if isinstance(v, torch.Tensor) else v) for k, v in x.items()
                  if k != "response_lengths"}
        inputs = LossInputs(response_lengths=[lengths[i] for i in idx], **fields)
        loss, m = compute_policy_loss(inputs, d, cfg)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    return total, reduce_metrics(metrics)


@pytest.mark.parametrize("cfg", [
    PolicyGradientConfig(loss_agg_mode="token_mean", eps_clip_high=0.28, eps_clip_c=3.0, kl_loss_coef=0.1,
                         entropy_coef=0.01, use_tis=True, opd_coef=0.2),
    PolicyGradientConfig(loss_agg_mode="seq_mean_token_mean", kl_loss_coef=0.1, kl_loss_type="k2"),
    PolicyGradientConfig(loss_agg_mode="seq_mean_token_sum_norm", max_response_length=8, use_tis=True),
    PolicyGradientConfig(loss_agg_mode="seq_mean_token_mean", use_gspo=True, gspo_eps_clip=0.1,
                         gspo_eps_clip_high=0.1),
    PolicyGradientConfig(advantage_estimator="none", opd_coef=1.0),
], ids=["token_mean_all_terms", "seq_mean", "dr_grpo", "gspo", "opd_only"])
def test_global_normalisation_is_partition_invariant(cfg):
    """One big batch == any split into micro-batches and DP ranks: loss, grads and metrics."""
    one = _inputs(seed=7)
    loss_one, m_one = _split_total(cfg, one, [list(range(6))])
    for parts in ([[0, 1], [2], [3, 4, 5]], [[5], [], [0, 3], [1, 2, 4]]):  # e.g. DP0: mb0 mb1 | DP1: ...
        x = _inputs(seed=7)
        loss, m = _split_total(cfg, x, parts)
        assert abs(loss - loss_one) < 1e-12
        assert torch.allclose(x["logprobs"].grad, one["logprobs"].grad, atol=1e-14, rtol=0)
        assert torch.allclose(x["entropy"].grad if x["entropy"].grad is not None else torch.zeros(1),
                              one["entropy"].grad if one["entropy"].grad is not None else torch.zeros(1))
        assert m.keys() == m_one.keys() and all(abs(m[k] - m_one[k]) < 1e-12 for k in m)


def test_missing_inputs_and_shape_errors_name_the_fix():
    x = _inputs()
    with pytest.raises(ValueError, match="ref_logprobs is None but --kl-loss-coef"):
        compute_policy_loss(LossInputs(x["logprobs"], x["advantages"], x["loss_mask"], x["response_lengths"]),
                            denoms(10, 6), PolicyGradientConfig(kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logprobs is None but --use-tis"):
        compute_policy_loss(LossInputs(x["logprobs"], x["advantages"], x["loss_mask"], x["response_lengths"]),
                            denoms(10, 6), PolicyGradientConfig(use_tis=True))
    with pytest.raises(ValueError, match=r"LossInputs.advantages has shape \(3,\) but sum\(response_lengths\)"):
        LossInputs(x["logprobs"], torch.zeros(3), x["loss_mask"], x["response_lengths"])


@pytest.mark.parametrize("kwargs,flag", [
    (dict(advantage_estimator="a2c"), "--advantage-estimator"),
    (dict(loss_agg_mode="sum"), "--loss-agg-mode"),
    (dict(loss_agg_mode="seq_mean_token_sum_norm"), "--rollout-max-response-len"),
    (dict(eps_clip=1.5), "--eps-clip"),
    (dict(eps_clip_c=0.5), "--eps-clip-c"),
    (dict(kl_loss_type="low_var"), "--kl-loss-type"),
    (dict(use_tis=True, tis_cap=0.5), "--tis-cap"),
    (dict(advantage_estimator="none"), "--opd-coef"),
    (dict(kl_coef=0.1), "--kl-loss-coef"),
    (dict(entropy_coef=-1.0), "--entropy-coef"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        PolicyGradientConfig(**kwargs)


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_k3_kl_is_clamped_like_the_peers_low_var_kl(kind):
    """log-prob -100 against reference -1 gave inf and NaN gradients; clamped it gives 10, grads finite."""
    lp = torch.tensor([-100.0, -1.0, -3.5, -0.2], requires_grad=True)
    ref = torch.tensor([-1.0, -1.5, -1.0, -30.0])
    kl = kl_estimate(lp, ref, kind)
    assert torch.isfinite(kl).all() and kl[0] == 10.0
    assert close(kl[1], math.exp(-0.5) - 1 + 0.5)  # ordinary values are untouched
    assert close(kl[2], math.exp(2.5) - 1 - 2.5) and kl[3] == 10.0  # k3 of log ratio 29.8 is ~28.8 -> 10
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0] == 0 and lp.grad[3] == 0
    loss, _ = compute_policy_loss(LossInputs(lp.detach().clone().requires_grad_(), torch.ones(4), torch.ones(4), [4],
                                             ref_logprobs=ref), denoms(4, 1),
                                  PolicyGradientConfig(kl_loss_coef=0.05, kl_loss_type=kind))
    assert torch.isfinite(loss)


def test_gspo_defaults_to_sequence_mean_and_refuses_token_mean():
    assert PolicyGradientConfig(use_gspo=True).loss_agg_mode == "seq_mean_token_mean"
    assert PolicyGradientConfig().loss_agg_mode == "token_mean"
    assert PolicyGradientConfig(use_gspo=True, loss_agg_mode="seq_mean_token_sum_norm",
                                max_response_length=8).loss_agg_mode == "seq_mean_token_sum_norm"
    with pytest.raises(ConfigError, match="--loss-agg-mode='token_mean' .* GSPO's objective is a mean over sequences"):
        PolicyGradientConfig(use_gspo=True, loss_agg_mode="token_mean")


def test_unbiased_kl_ppo_kl_and_tis_lower_bound():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.3, -2.0, -0.1], dtype=torch.float64)
    ref = torch.tensor([-1.2, -2.5, -0.5], dtype=torch.float64)
    rollout = torch.tensor([-1.3 + math.log(10.0), -2.0, -0.1 - 0.1], dtype=torch.float64)  # weights .1, 1, e^.1
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    cfg = PolicyGradientConfig(advantage_estimator="none", opd_coef=0.0 + 1e-30, kl_loss_coef=0.5,
                               kl_loss_type="k1", use_unbiased_kl=True, use_tis=True, tis_clip_low=0.5)
    inputs = LossInputs(lp, torch.zeros(3, dtype=torch.float64), mask, [3], old_logprobs=old, ref_logprobs=ref,
                        rollout_logprobs=rollout, teacher_logprobs=lp.detach())
    loss, metrics = compute_policy_loss(inputs, denoms(2, 1), cfg)
    ratio = [math.exp(0.3), 1.0]
    k1 = [0.2, 0.5]
    assert close(loss, 0.5 * (ratio[0] * k1[0] + ratio[1] * k1[1]) / 2, 1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    # d/dlp [exp(lp - old) (lp - ref)] = r (lp - ref) + r
    assert close(g, [0.5 * (ratio[0] * k1[0] + ratio[0]) / 2, 0.5 * (k1[1] + 1) / 2, 0.0], 1e-12)
    m = reduce_metrics([metrics])
    assert close(m["ppo_kl"], (-0.3 + 0.0) / 2, 1e-12)  # verl: mean(old - new) over loss tokens
    assert close(m["kl"], (ratio[0] * k1[0] + k1[1]) / 2, 1e-12)
    assert close(m["tis_weight"], (0.5 + 1.0) / 2, 1e-12) and close(m["tis_clip_low_frac"], 0.5, 1e-12)
    w, capped, floored = tis_weights(old, rollout, cap=2.0, low=0.5)
    assert close(w, [0.5, 1.0, math.exp(0.1)], 1e-12) and floored.tolist() == [True, False, False]
    assert capped.tolist() == [False, False, False]


@pytest.mark.parametrize("kwargs,flag", [
    (dict(tis_clip_low=0.5), "--tis-clip-low"),
    (dict(use_tis=True, tis_clip_low=2.5), "--tis-clip-low"),
    (dict(use_unbiased_kl=True), "--use-unbiased-kl"),
    (dict(kl_loss_type="k4"), "--kl-loss-type"),
])
def test_new_algorithm_knobs_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        PolicyGradientConfig(**kwargs)


def test_unbiased_low_var_kl_clamps_the_weighted_product_as_slime():
    """slime's compute_approx_kl: kl = clamp(ratio * k3, -10, 10). At ratio e^0.1 and k3 = 9.38 the product is
    10.37: slime gives 10 and a zero gradient (clamping k3 first gave 10.37 and a nonzero one). Inside the bound
    the value and gradient are those of ratio * k3."""
    from megatron_rl.ops import PolicyLossParams
    from megatron_rl.ops.policy_loss import torch_policy_terms

    k3_of = (lambda lr: math.exp(-lr) - 1 + lr)
    # log(p / ref) = -3.15 -> k3 = exp(3.15) - 1 - 3.15 = 19.2 -> (old clamp) 10 * e^0.1 = 11.05;
    # log(p / ref) = -2.45 -> k3 = 8.14, e^0.1 * 8.14 = 9.0 (inside); -2.6 -> k3 = 9.86, * e^0.1 = 10.9 (outside)
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - 0.1
    ref = torch.tensor([2.15, 1.45, 1.6], dtype=torch.float64)
    params = PolicyLossParams(ppo=False, eps_low=0.2, eps_high=0.2, kl_type="low_var_kl", unbiased_kl=True)
    kl = torch_policy_terms(lp, old, torch.zeros(3, dtype=torch.float64), params, ref_logprobs=ref).kl
    r = math.exp(0.1)
    assert kl[0].item() == 10.0 and kl[2].item() == 10.0
    assert close(kl[1], r * k3_of(-2.45), 1e-12)
    assert r * k3_of(-2.6) > 10 and k3_of(-2.6) < 10  # the edge: the old order gave 10.9 here
    (g,) = torch.autograd.grad(kl.sum(), lp)
    # d/dlp [e^(lp-old) k3(lp - ref)] = r k3 + r (1 - exp(-(lp - ref)))
    assert g[0].item() == 0.0 and g[2].item() == 0.0
    assert close(g[1], r * k3_of(-2.45) + r * (1 - math.exp(2.45)), 1e-12)
    # without --use-unbiased-kl the estimate itself is clamped, as before
    plain = torch_policy_terms(lp, old, torch.zeros(3, dtype=torch.float64),
                               PolicyLossParams(ppo=False, eps_low=0.2, eps_high=0.2, kl_type="k3"),
                               ref_logprobs=ref).kl
    assert plain[0].item() == 10.0 and close(plain[2], k3_of(-2.6), 1e-12)


def test_ppo_kl_metric_clamps_the_log_ratio_as_verl():
    """verl: ppo_kl = masked_mean(-clamp(logp - old, -20, 20)); a stale token 50 nats off counts as 20."""
    lp = torch.tensor([-1.0, -60.0, -2.0])
    old = torch.tensor([-1.5, -10.0, -1.0])
    _, metrics = compute_policy_loss(LossInputs(lp, torch.ones(3), torch.tensor([1.0, 1.0, 0.0]), [3],
                                                old_logprobs=old), denoms(2, 1), PolicyGradientConfig())
    assert close(reduce_metrics([metrics])["ppo_kl"], (-0.5 + 20.0) / 2, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_terms_compute_low_precision_inputs_in_float32(dtype):
    """bf16/fp16 log-probs give the float32 result of the upcast inputs, rounded once to the input dtype (what
    the fused kernels store), gradients included; rounding every intermediate to bf16 flipped near-clip tokens."""
    from megatron_rl.ops import PolicyLossParams
    from megatron_rl.ops.policy_loss import torch_policy_terms

    g = torch.Generator().manual_seed(5)
    n = 2000
    lp = (torch.randn(n, generator=g) - 2).to(dtype)
    old = (lp.float() + torch.randn(n, generator=g) * 0.2).to(dtype)  # many ratios near 1 +- eps
    adv, ref, roll = (torch.randn(n, generator=g).to(dtype) for _ in range(3))
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                              tis_cap=2.0, tis_low=0.5)
    g_pg, g_kl = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(x_in, *others):
        x = x_in.clone().requires_grad_()
        t = torch_policy_terms(x, *others[:2], params, ref_logprobs=others[2], rollout_logprobs=others[3])
        # the gradient reaching a low-precision output is rounded to its dtype (as the kernels take it): give
        # the float32 reference the same rounded upstream gradients
        (t.pg.float() * g_pg.to(dtype).float() + t.kl.float() * g_kl.to(dtype).float()).sum().backward()
        return t, x.grad

    low, low_grad = run(lp, old, adv, ref, roll)
    full, full_grad = run(lp.float(), old.float(), adv.float(), ref.float(), roll.float())
    for name in ("ratio", "pg", "kl", "tis_weight"):
        a, b = getattr(low, name), getattr(full, name)
        assert a.dtype == dtype and torch.equal(a, b.to(dtype)), name
    for name in ("clipped", "dual", "tis_capped", "tis_floored"):
        assert torch.equal(getattr(low, name), getattr(full, name)), name
    assert low_grad.dtype == dtype
    # the same float32 backward, rounded once to the input dtype
    assert torch.equal(low_grad, full_grad.to(dtype))
