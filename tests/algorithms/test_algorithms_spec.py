"""The Spec hooks end to end on Samples: advantages -> prepare_batch -> model output -> loss."""

import math

import pytest
import torch

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, PolicyGradientSpec, Spec, get_spec
from megatron_rl.data.packing import compute_loss_denominators
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.ops import naive_logprobs


def _samples():
    return [
        Sample(group_index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=1.0, loss_mask=[1, 0, 1],
               rollout_logprobs=[-1.0, -2.0, -0.5]),
        Sample(group_index=0, prompt_ids=[1, 2], response_ids=[6, 7], reward=0.0, rollout_logprobs=[-0.3, -0.1]),
        Sample(group_index=1, prompt_ids=[9], response_ids=[], reward=0.5),
        Sample(group_index=1, prompt_ids=[9], response_ids=[8], reward=0.5, rollout_logprobs=[-2.0]),
    ]


def test_registry_and_abc():
    spec = get_spec("policy_gradient", PolicyGradientConfig())
    assert isinstance(spec, Spec) and isinstance(spec, PolicyGradientSpec)
    with pytest.raises(ConfigError, match="--algorithm 'ppo_critic' is not registered"):
        get_spec("ppo_critic", PolicyGradientConfig())
    with pytest.raises(ConfigError, match="needs a PolicyGradientConfig"):
        get_spec("policy_gradient", {"eps_clip": 0.2})
    with pytest.raises(TypeError):
        Spec()


def test_grpo_advantages_per_sample_and_masked():
    spec = get_spec("policy_gradient", PolicyGradientConfig(advantage_eps=0.0))
    adv = spec.compute_advantages(_samples())
    a = 0.5 / math.sqrt(0.5)
    assert [len(t) for t in adv] == [3, 2, 0, 1]
    assert torch.cat(adv).tolist() == pytest.approx([a, 0.0, a, -a, -a, 0.0], abs=1e-6)
    bad = _samples()
    bad[0].loss_mask = [1, 1]
    with pytest.raises(ValueError, match="sample 0 .* 2 loss_mask entries for 3 response tokens"):
        spec.compute_advantages(bad)
    rloo = get_spec("policy_gradient", PolicyGradientConfig(advantage_estimator="rloo")).compute_advantages(
        _samples())
    assert [t.tolist() for t in rloo] == [[1.0, 0.0, 1.0], [-1.0, -1.0], [], [0.0]]
    # --grpo-std-level batch: the same baselines over the std of all four rewards {1, 0, .5, .5} (Bessel: 1/6)
    batch = get_spec("policy_gradient", PolicyGradientConfig(advantage_eps=0.0, grpo_std_level="batch"))
    b = 0.5 / math.sqrt(1 / 6)
    assert torch.cat(batch.compute_advantages(_samples())).tolist() == pytest.approx([b, 0.0, b, -b, -b, 0.0],
                                                                                       abs=1e-6)


def test_prepare_batch_requirements_and_sample_validation():
    spec = get_spec("policy_gradient", PolicyGradientConfig(kl_loss_coef=0.1, use_tis=True, opd_coef=0.5))
    req = spec.prepare_batch(_samples())
    assert req.old_logprobs and req.ref_logprobs and req.teacher_logprobs and req.rollout_logprobs
    assert req.entropy and not req.advantages_need_logprobs
    bad = _samples()
    bad[1].rollout_logprobs = [-0.3]
    with pytest.raises(ConfigError, match="--use-tis needs rollout log-probs .* sample 1"):
        spec.prepare_batch(bad)
    rpp = get_spec("policy_gradient", PolicyGradientConfig(advantage_estimator="reinforce_plus_plus",
                                                           kl_coef=0.05))
    assert rpp.prepare_batch(_samples()).advantages_need_logprobs
    with pytest.raises(ConfigError, match="compute old and ref log-probs before compute_advantages"):
        rpp.compute_advantages(_samples())
    old = [torch.tensor(s.rollout_logprobs) for s in _samples()]
    ref = [t - 0.1 for t in old]
    adv = rpp.compute_advantages(_samples(), old_logprobs=old, ref_logprobs=ref)
    assert [len(t) for t in adv] == [3, 2, 0, 1] and adv[0][1] == 0.0
    masked = torch.cat(adv)[torch.tensor([1.0, 0, 1, 1, 1, 1]) > 0]
    assert abs(masked.mean()) < 1e-6  # whitened over loss tokens


def test_hooks_end_to_end_match_reference_loss_and_logit_grads():
    """extract_model_output + compute_loss through the op == the same loss through log_softmax."""
    samples = _samples()
    cfg = PolicyGradientConfig(temperature=0.8, entropy_coef=0.01, use_tis=True, kl_loss_coef=0.05)
    spec = get_spec("policy_gradient", cfg)
    adv = torch.cat(spec.compute_advantages(samples))
    lengths = [s.response_length for s in samples]
    target = torch.tensor([t for s in samples for t in s.response_ids])
    mask = torch.tensor([v for s in samples for v in s.effective_loss_mask()], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(target), 16, generator=g)
    old = torch.randn(len(target), generator=g) * 0.1 - 2.0
    ref = old - 0.05
    rollout = torch.tensor([v for s in samples for v in s.rollout_logprobs])
    d = compute_loss_denominators(s.effective_loss_mask() for s in samples)

    def run(logprobs, entropy):
        return spec.compute_loss(LossInputs(logprobs, adv, mask, lengths, old_logprobs=old, ref_logprobs=ref,
                                            rollout_logprobs=rollout, entropy=entropy), d)

    x = logits.clone().requires_grad_()
    out = spec.extract_model_output(x, target)
    loss, _ = run(out.logprobs, out.entropy)
    loss.backward()
    y = logits.double().requires_grad_()
    lp, h = naive_logprobs(y, target, temperature=0.8, with_entropy=True)
    ref_loss, _ = run(lp, h)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert torch.allclose(x.grad.double(), y.grad, atol=1e-7)


def test_packed_micro_batches_equal_whole_batch_through_the_hooks():
    """pack_samples -> gather_response -> extract_model_output -> LossInputs.from_packed_batch -> compute_loss,
    summed over two uneven micro-batches, equals the per-sample reference loss and its gradient.

    The "model" is a bigram table (logits at a position = row of the token there), so the
    reference can be computed per sample without packing.
    """
    from megatron_rl.data.packing import pack_samples

    # data.packing rejects a micro-batch mixing an empty response (no rollout log-probs) with
    # non-empty ones, so the empty sample gets one token here.
    samples = _samples()
    samples[2].response_ids, samples[2].rollout_logprobs = [11], [-1.5]
    cfg = PolicyGradientConfig(advantage_estimator="rloo", loss_agg_mode="seq_mean_token_mean", use_tis=True,
                               temperature=0.7, entropy_coef=0.02)
    spec = get_spec("policy_gradient", cfg)
    adv = spec.compute_advantages(samples)
    old = [torch.tensor(s.rollout_logprobs) + 0.05 for s in samples]
    g = torch.Generator().manual_seed(5)
    table0 = torch.randn(16, 16, generator=g)
    d = compute_loss_denominators(s.effective_loss_mask() for s in samples)

    table = table0.clone().requires_grad_()
    total = 0.0
    for mb in ([3, 0], [2, 1]):
        batch = pack_samples(samples, mb, pad_to_multiple=4, advantages=adv, old_logprobs=old)
        logits = batch.gather_response(table[batch.tokens])  # [R, V]
        out = spec.extract_model_output(logits, batch.response_target_ids)
        loss, _ = spec.compute_loss(LossInputs.from_packed_batch(batch, out.logprobs, out.entropy), d)
        loss.backward()
        total += loss.item()

    ref_table = table0.double().requires_grad_()
    lps, hs = [], []
    for s in samples:
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        p = len(s.prompt_ids)
        lp, h = naive_logprobs(ref_table[ids][p - 1:p - 1 + s.response_length], torch.tensor(s.response_ids,
                               dtype=torch.long), temperature=0.7, with_entropy=True)
        lps.append(lp)
        hs.append(h)
    ref = LossInputs(torch.cat(lps), torch.cat(adv).double(),
                     torch.tensor([v for s in samples for v in s.effective_loss_mask()], dtype=torch.float64),
                     [s.response_length for s in samples], old_logprobs=torch.cat(old).double(),
                     rollout_logprobs=torch.tensor([v for s in samples for v in s.rollout_logprobs]).double(),
                     entropy=torch.cat(hs))
    ref_loss, _ = spec.compute_loss(ref, d)
    ref_loss.backward()
    assert abs(total - ref_loss.item()) < 1e-6
    assert torch.allclose(table.grad.double(), ref_table.grad, atol=1e-7)


def _loss_token_values(adv):
    return torch.cat(adv)[torch.tensor([1.0, 0, 1, 1, 1, 1]) > 0].double()


def test_reinforce_plus_plus_baseline_and_normalize_advantages():
    # REINFORCE++-baseline: group mean off (group 0: 1, 0 -> +-.5; group 1 all 0.5 -> 0), broadcast, whitened.
    rpp = get_spec("policy_gradient", PolicyGradientConfig(advantage_estimator="reinforce_plus_plus_baseline"))
    adv = rpp.compute_advantages(_samples())
    vals = [0.5, 0.5, -0.5, -0.5, 0.0]  # loss tokens of samples 0, 1, 3 (sample 2 is empty)
    var = sum(v * v for v in vals) / (len(vals) - 1)  # mean 0; Bessel; eps inside the sqrt
    assert _loss_token_values(adv).tolist() == pytest.approx([v / math.sqrt(var + 1e-8) for v in vals], abs=1e-6)
    assert adv[0][1] == 0.0
    # --normalize-advantages on GRPO: whiten the estimator's token advantages over the batch's loss tokens.
    grpo = get_spec("policy_gradient", PolicyGradientConfig(advantage_eps=0.0, normalize_advantages=True))
    a = 0.5 / math.sqrt(0.5)
    vals = [a, a, -a, -a, 0.0]
    var = sum(v * v for v in vals) / (len(vals) - 1)
    assert _loss_token_values(grpo.compute_advantages(_samples())).tolist() == pytest.approx(
        [v / math.sqrt(var + 1e-8) for v in vals], abs=1e-6)
    # A batch without contrast stays exactly 0 through the whitening.
    flat = [Sample(group_index=g, prompt_ids=[1], response_ids=[2, 3], reward=0.1) for g in (0, 0, 1, 1, 2, 2)]
    assert all((t == 0).all() for t in grpo.compute_advantages(flat))


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def _flags_to_algorithm(hf_dir, *flags):
    from megatron_rl.config import parse_config
    from megatron_rl.algorithms import spec_from_config

    return spec_from_config(parse_config(["--hf-checkpoint", hf_dir, *flags])).cfg


def test_peer_named_algorithm_flags_reach_the_spec(hf_dir):
    c = _flags_to_algorithm(hf_dir, "--advantage-estimator", "reinforce_plus_plus_baseline", "--normalize-advantages",
                            "--use-tis", "--tis-clip", "3.0", "--tis-clip-low", "0.5", "--use-kl-loss",
                            "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl", "--use-unbiased-kl")
    assert (c.advantage_estimator, c.normalize_advantages, c.use_tis, c.tis_cap, c.tis_clip_low) == (
        "reinforce_plus_plus_baseline", True, True, 3.0, 0.5)
    assert (c.kl_loss_coef, c.kl_loss_type, c.use_unbiased_kl, c.loss_agg_mode) == (0.1, "low_var_kl", True,
                                                                                      "token_mean")
    g = _flags_to_algorithm(hf_dir, "--advantage-estimator", "gspo")
    assert g.use_gspo and g.loss_agg_mode == "seq_mean_token_mean"  # GSPO paper / verl: sequence mean
    assert _flags_to_algorithm(hf_dir, "--advantage-estimator", "gspo", "--loss-agg-mode",
                               "seq_mean_token_sum_norm").loss_agg_mode == "seq_mean_token_sum_norm"


@pytest.mark.parametrize("flags,match", [
    (["--advantage-estimator", "gspo", "--loss-agg-mode", "token_mean"], "gspo with --loss-agg-mode token_mean"),
    (["--tis-clip-low", "0.5"], "--tis-clip-low 0.5 bounds the TIS weight.*add --use-tis"),
    (["--use-tis", "--tis-clip-low", "2.5"], r"--tis-clip-low 2.5 must be in \[0, --tis-cap 2.0\)"),
    (["--use-unbiased-kl"], "--use-unbiased-kl weights the KL loss term"),
])
def test_algorithm_flag_conflicts_are_refused_in_validation(hf_dir, flags, match):
    from megatron_rl.config import parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(["--hf-checkpoint", hf_dir, *flags])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_coef_folds_the_kl_loss_type_estimator_into_the_rewards(kind):
    """slime's compute_advantages_and_returns: kl = compute_approx_kl(old, ref, --kl-loss-type), then
    REINFORCE++'s token rewards -kl_coef * kl (not always k1)."""
    from megatron_rl.algorithms.advantages import flat_loss_mask, reinforce_plus_plus_advantages
    from megatron_rl.algorithms.losses import kl_estimate

    samples = _samples()
    cfg = PolicyGradientConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.2, kl_loss_type=kind)
    old = [torch.tensor(s.rollout_logprobs) for s in samples]
    ref = [t - torch.linspace(-1.5, 2.0, len(t)) for t in old]  # |log r| up to 2: the estimators differ
    adv = torch.cat(get_spec("policy_gradient", cfg).compute_advantages(samples, old_logprobs=old,
                                                                        ref_logprobs=ref))
    kl = kl_estimate(torch.cat(old), torch.cat(ref), kind)
    if kind != "k1":
        assert not torch.allclose(kl, torch.cat(old) - torch.cat(ref))
    mask = flat_loss_mask([s.effective_loss_mask() for s in samples])
    want = reinforce_plus_plus_advantages([float(s.reward) for s in samples], [s.response_length for s in samples],
                                          mask, kl=kl, kl_coef=0.2)
    assert torch.equal(adv, want)


def test_adaptive_kl_controller_is_verls_and_its_state_round_trips():
    """verl's AdaptiveKLController: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon. Numbers for
    beta 0.05, target 0.1, horizon 100, n 8: kl 0.3 -> x1.016, kl 0.11 -> x1.008, kl 0.05 -> x0.984."""
    from megatron_rl.algorithms.kl_control import KLController, mean_sequence_kl

    ctrl = KLController(0.05, target=0.1, horizon=100)
    ctrl.update(0.3, n_steps=8)
    assert ctrl.value == pytest.approx(0.05 * 1.016, rel=1e-15)
    ctrl.update(0.11, n_steps=8)
    assert ctrl.value == pytest.approx(0.05 * 1.016 * 1.008, rel=1e-14)
    ctrl.update(0.05, n_steps=8)
    assert ctrl.value == pytest.approx(0.05 * 1.016 * 1.008 * 0.984, rel=1e-14)
    fixed = KLController(0.05)
    fixed.update(0.3, n_steps=8)
    assert fixed.value == 0.05 and fixed.state_dict() == {}
    # verl's current_kl: the mean over responses of each one's mean over its loss tokens
    kl = torch.tensor([1.0, 3.0, 9.0, 2.0, 4.0, 6.0])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    assert mean_sequence_kl(kl, mask, [3, 3]) == pytest.approx((2.0 + 4.0) / 2)


def test_adaptive_kl_coefficient_moves_between_batches_and_resumes():
    samples = _samples()
    cfg = PolicyGradientConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.2, kl_loss_type="k3",
                               kl_ctrl_type="adaptive", kl_target=0.01, kl_horizon=4)
    spec = get_spec("policy_gradient", cfg)
    old = [torch.tensor(s.rollout_logprobs) for s in samples]
    ref = [t - torch.linspace(-1.5, 2.0, len(t)) for t in old]
    first = torch.cat(spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=ref))
    m = spec.advantage_metrics()
    assert m["reward_kl_coef"] == 0.2 and m["reward_kl"] > 0.01  # far above target: beta grows by 1 + 0.2 n / 4
    assert spec.kl_ctrl.value == pytest.approx(0.2 * (1 + 0.2 * len(samples) / 4), rel=1e-15)
    saved = spec.state_dict()
    second = torch.cat(spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=ref))
    assert not torch.equal(first, second)  # a larger beta: a larger penalty
    fresh = get_spec("policy_gradient", cfg)
    fresh.load_state_dict(saved)
    assert torch.equal(torch.cat(fresh.compute_advantages(samples, old_logprobs=old, ref_logprobs=ref)), second)
