"""--policy-loss-type (cispo, gpg, geo_mean, sapo) and the gpg / opo estimators: flags reach the Spec, refusals
name the flag before any worker starts, and only the vanilla PPO surrogate may come from a fused kernel.

The numbers themselves are checked against verl's formulas in test_estimator_vectors.py
(vectors/policy_loss_types.json, gpg.json, opo.json).
"""

import pytest
import torch

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss, reduce_metrics
from megatron_rl.algorithms import advantages as A
from megatron_rl.algorithms import losses as L
from megatron_rl.algorithms.spec import PolicyGradientSpec
from megatron_rl.data.packing import compute_loss_denominators
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def _inputs(dtype=torch.float32):
    lengths = [3, 2]
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])
    lp = torch.tensor([-0.5, -1.0, -2.0, -0.3, -1.5], dtype=dtype).requires_grad_()
    x = LossInputs(lp, torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5], dtype=dtype), mask, lengths,
                   old_logprobs=torch.tensor([-0.6, -1.0, -1.5, -0.2, -1.6], dtype=dtype))
    return x, compute_loss_denominators(torch.split(mask, lengths))


@pytest.mark.parametrize("kind", ["cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov"])
def test_non_vanilla_losses_never_ask_the_kernels_for_the_ppo_surrogate(monkeypatch, kind):
    """The fused kernels implement the vanilla PPO surrogate only: compute_policy_loss must ask the ops dispatch
    for ppo=False (KL/TIS terms only) and form the policy term itself, on any device."""
    seen = []
    real = L.policy_loss_terms

    def recording(*args, **kwargs):
        seen.append(args[3].ppo)
        return real(*args, **kwargs)

    monkeypatch.setattr(L, "policy_loss_terms", recording)
    x, d = _inputs()
    loss, m = compute_policy_loss(x, d, PolicyGradientConfig(policy_loss_type=kind))
    loss.backward()
    assert seen == [False] and torch.isfinite(x.logprobs.grad).all()
    assert ("clip_frac" in m) == (kind in ("cispo", "geo_mean", "clip_cov")) and "dual_clip_frac" not in m
    assert ("cov_selected_frac" in m) == (kind in ("clip_cov", "kl_cov"))
    seen.clear()
    compute_policy_loss(*_inputs(), PolicyGradientConfig())
    assert seen == [True]


@pytest.mark.parametrize("kind", ["cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov"])
def test_bf16_logprobs_are_computed_in_float32(kind):
    x32, d = _inputs()
    x16, _ = _inputs(torch.bfloat16)
    cfg = PolicyGradientConfig(policy_loss_type=kind)
    l32, _ = compute_policy_loss(x32, d, cfg)
    l16, _ = compute_policy_loss(x16, d, cfg)
    l16.backward()
    assert l16.dtype == torch.float32 and x16.logprobs.grad.dtype == torch.bfloat16
    assert abs(l16.item() - l32.item()) < 2e-2  # bf16 inputs (8 mantissa bits), float32 arithmetic


def test_cispo_at_ratio_one_is_the_policy_gradient():
    """On-policy (old = logp) CISPO's gradient is -A grad logp, GPG's; their values differ only by nothing."""
    x, d = _inputs()
    x.old_logprobs = x.logprobs.detach().clone()
    grads = []
    for kind in ("cispo", "gpg"):
        x.logprobs.grad = None
        loss, _ = compute_policy_loss(x, d, PolicyGradientConfig(policy_loss_type=kind))
        loss.backward()
        grads.append(x.logprobs.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_gpg_and_opo_estimators_through_the_spec():
    samples = [Sample(group_index=g, prompt_ids=[1], response_ids=[2] * n, reward=r, loss_mask=m)
               for g, n, r, m in ((0, 3, 1.0, [1, 1, 0]), (0, 2, 0.0, []), (1, 1, 0.5, []), (1, 4, 0.0, [1, 0, 0, 1]))]
    for name, per_seq in (("gpg", A.gpg_advantages([1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1])),
                          ("opo", A.opo_advantages([1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1], [2, 2, 1, 2]))):
        got = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator=name)).compute_advantages(samples)
        want = [per_seq[i] * torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
                for i, s in enumerate(samples)]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    assert A.gpg_advantages([1.0, 0.0, 0.5, 0.0], [0, 0, 1, 1]).tolist() == [1.0, -1.0, 0.5, -0.5]  # alpha 2
    assert A.opo_advantages([1.0, 0.0], [0, 0], [3, 1]).tolist() == [0.25, -0.75]


def test_clip_cov_random_pick_is_a_subset_of_the_candidates_of_the_right_size():
    """The part the vectors cannot fix (verl's torch.randperm when more tokens qualify than may be dropped): the
    pick has exactly max(int(ratio * N), 1) tokens, all candidates, the same whatever the global seed (tensor-
    parallel ranks must agree), and exactly the picked tokens lose their gradient."""
    g = torch.Generator().manual_seed(3)
    n = 400
    lp = (-torch.rand(n, generator=g) * 3).requires_grad_()
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()
    old = lp.detach() + 0.3 * torch.randn(n, generator=g)
    cfg = PolicyGradientConfig(policy_loss_type="clip_cov", clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=50.0)
    picks = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        terms = L.policy_gradient_terms(lp, old, adv, mask, [n], cfg)
        picks.append(terms.cov_selected)
    cov = (adv - adv[mask > 0].mean()) * (lp.detach() - lp.detach()[mask > 0].mean())
    ratio = torch.exp(lp.detach() - old)
    unclipped = -adv * ratio >= -adv * ratio.clamp(0.8, 1.2)
    candidates = (mask > 0) & unclipped & (cov > 0) & (cov < 50)
    assert int(candidates.sum()) > int(0.02 * mask.sum()) > 1  # a real random pick
    assert int(picks[0].sum()) == int(0.02 * mask.sum()) and bool((picks[0] <= candidates).all())
    assert torch.equal(picks[0], picks[1])
    (terms.pg * mask).sum().backward()
    assert bool((lp.grad[picks[1]] == 0).all()) and bool((lp.grad[candidates & ~picks[1]] != 0).all())


def test_geo_mean_is_the_mean_over_sequences_whatever_the_split():
    x, _ = _inputs()
    cfg = PolicyGradientConfig(policy_loss_type="geo_mean")
    whole, _ = compute_policy_loss(x, compute_loss_denominators(torch.split(x.loss_mask, [3, 2])), cfg)
    d = compute_loss_denominators(torch.split(x.loss_mask, [3, 2]))
    parts = [compute_policy_loss(LossInputs(x.logprobs[s], x.advantages[s], x.loss_mask[s], [n],
                                            old_logprobs=x.old_logprobs[s]), d, cfg)[0]
             for s, n in ((slice(0, 3), 3), (slice(3, 5), 2))]
    assert torch.allclose(sum(parts), whole, atol=1e-7, rtol=0)
    assert reduce_metrics([compute_policy_loss(x, d, cfg)[1]])["clip_frac"] == pytest.approx(0.25)


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy_loss_type="ppo"), "--policy-loss-type='ppo' is invalid"),
    (dict(policy_loss_type="cispo", use_gspo=True), "--policy-loss-type='cispo'.*gspo is itself a policy loss"),
    (dict(policy_loss_type="gpg", eps_clip_c=3.0), "--eps-clip-c=3.0.*dual clip"),
    (dict(policy_loss_type="sapo", loss_agg_mode="token_mean"), "--loss-agg-mode='token_mean'.*mean over sequences"),
    (dict(policy_loss_type="geo_mean", use_tis=True), "--use-tis=True.*--tis-level geometric"),
    (dict(sapo_tau_pos=2.0), "--sapo-tau-pos/--sapo-tau-neg.*add --policy-loss-type sapo"),
    (dict(policy_loss_type="sapo", sapo_tau_neg=0.0), "must be > 0"),
    (dict(advantage_estimator="vtrace"), "--advantage-estimator='vtrace' is invalid"),
    (dict(clip_cov_ratio=0.1), "--clip-cov-ratio=0.1.*add that or drop it"),
    (dict(policy_loss_type="clip_cov", ppo_kl_coef=1.0), "--ppo-kl-coef=1.0.*--policy-loss-type kl_cov"),
    (dict(policy_loss_type="clip_cov", clip_cov_lb=5.0), "lb < ub"),
    (dict(policy_loss_type="kl_cov", kl_cov_ratio=0.0), "in \\(0, 1\\]"),
])
def test_config_refuses_what_it_cannot_do(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PolicyGradientConfig(**kwargs)


def test_accepted_combinations():
    assert PolicyGradientConfig(policy_loss_type="sapo").loss_agg_mode == "seq_mean_token_mean"
    assert PolicyGradientConfig(policy_loss_type="geo_mean", use_tis=True, tis_level="geometric", use_rs=True,
                                rs_level="sequence").loss_agg_mode == "seq_mean_token_mean"
    assert PolicyGradientConfig(policy_loss_type="cispo").loss_agg_mode == "token_mean"
    assert PolicyGradientConfig(policy_loss_type="gpg", advantage_estimator="gpg",
                                loss_agg_mode="seq_mean_token_sum").loss_agg_mode == "seq_mean_token_sum"


@pytest.mark.parametrize("flags,match", [
    (["--advantage-estimator", "remax", "--async-mode", "full"], "--advantage-estimator remax with --async-mode "
                                                                 "full: ReMax's baseline is one greedy response"),
    (["--policy-loss-type", "cispo", "--advantage-estimator", "gspo"], "--policy-loss-type cispo with "
                                                                       "--advantage-estimator gspo"),
    (["--policy-loss-type", "gpg", "--eps-clip-c", "3"], "--eps-clip-c 3.0: dual clip"),
    (["--policy-loss-type", "geo_mean", "--loss-agg-mode", "token_mean"], "--loss-agg-mode token_mean is refused"),
    (["--policy-loss-type", "geo_mean", "--use-rs"], "--use-rs at token level"),
    (["--sapo-tau-neg", "2"], "--sapo-tau-neg 2.0 shape the SAPO gate"),
    (["--policy-loss-type", "ppo"], "ppo"),
    (["--kl-cov-ratio", "0.01"], "--kl-cov-ratio 0.01 configures --policy-loss-type kl_cov"),
    (["--policy-loss-type", "clip_cov", "--clip-cov-lb", "6"], "--clip-cov-lb 6.0 must be below --clip-cov-ub 5.0"),
])
def test_refused_in_validation_before_workers_start(hf_dir, flags, match):
    from megatron_rl.config import parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(["--hf-checkpoint", hf_dir, *flags])


def test_flags_reach_the_spec(hf_dir):
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.config import parse_config

    cfg = parse_config(["--hf-checkpoint", hf_dir, "--policy-loss-type", "sapo", "--sapo-tau-pos", "1.5",
                        "--sapo-tau-neg", "2.5", "--advantage-estimator", "opo"])
    spec = spec_from_config(cfg).cfg
    assert (spec.policy_loss_type, spec.sapo_tau_pos, spec.sapo_tau_neg, spec.advantage_estimator,
            spec.loss_agg_mode) == ("sapo", 1.5, 2.5, "opo", "seq_mean_token_mean")
    cfg = parse_config(["--hf-checkpoint", hf_dir, "--policy-loss-type", "gpg", "--advantage-estimator", "gpg",
                        "--loss-agg-mode", "seq_mean_token_sum"])
    spec = spec_from_config(cfg).cfg
    assert (spec.policy_loss_type, spec.advantage_estimator, spec.loss_agg_mode) == ("gpg", "gpg",
                                                                                     "seq_mean_token_sum")
