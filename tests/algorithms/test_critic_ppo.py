"""PPO with a critic, the algorithm half: the clipped value loss against verl's ``compute_value_loss`` written out
in plain Python, the ``ppo`` estimator's GAE (--gamma, --lambd, reward on the last loss token, --kl-coef folded in,
--normalize-advantages), and the flags' validation. The megatron critic itself: tests/dist/test_critic.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.losses import kl_estimate
from megatron_rl.algorithms.spec import PolicyGradientSpec
from megatron_rl.data.packing import LossDenominators
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError


def _verl_value_loss(vpreds, values, returns, mask, clip, mode, lengths):
    """verl's compute_value_loss (core_algos.py) in plain float64 Python: vpredclipped = clamp(vpreds, values -+ c),
    0.5 * agg(max((vpreds - R)^2, (vpredclipped - R)^2)), clipfrac = masked mean of (clipped err > unclipped err)."""
    errs, fracs = [], []
    for v, o, r in zip(vpreds, values, returns):
        vc = min(max(v, o - clip), o + clip)
        e1, e2 = (v - r) ** 2, (vc - r) ** 2
        errs.append(max(e1, e2))
        fracs.append(1.0 if e2 > e1 else 0.0)
    n = sum(mask)
    if mode == "token_mean":
        agg = sum(e * m for e, m in zip(errs, mask)) / n
    else:  # seq-mean-token-mean
        seqs, i = [], 0
        for L in lengths:
            m = sum(mask[i:i + L])
            seqs.append(sum(e * k for e, k in zip(errs[i:i + L], mask[i:i + L])) / max(m, 1))
            i += L
        agg = sum(seqs) / len(seqs)
    return 0.5 * agg, sum(f * m for f, m in zip(fracs, mask)) / n


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_value_loss_equals_verls_formula(mode):
    vpreds = [0.10, 0.90, -0.40, 0.35, 1.70, 0.00, 0.25]
    old = [0.00, 0.50, -0.30, 0.30, 1.00, 0.20, 0.60]
    returns = [0.50, 0.20, -1.00, 0.30, 0.80, 1.00, 0.10]
    mask = [1, 1, 0, 1, 1, 1, 1]
    lengths = [3, 4]
    want_loss, want_frac = _verl_value_loss(vpreds, old, returns, mask, 0.2, mode, lengths)
    spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", value_clip=0.2, loss_agg_mode=mode))
    v = torch.tensor(vpreds, dtype=torch.float64, requires_grad=True)
    denoms = LossDenominators(local_tokens=sum(mask), local_samples=2, global_tokens=sum(mask), global_samples=2)
    loss, metrics = spec.compute_value_loss(v, torch.tensor(old, dtype=torch.float64),
                                            torch.tensor(returns, dtype=torch.float64),
                                            torch.tensor(mask, dtype=torch.float32), torch.tensor(lengths), denoms)
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-12)
    s, c = metrics["vf_clipfrac"]
    assert float(s / c) == pytest.approx(want_frac, abs=1e-12)
    assert want_frac > 0  # the case exercises the clipped branch (tokens 1, 4, 6 move more than 0.2)
    loss.backward()
    assert v.grad is not None and float(v.grad[2]) == 0.0  # the masked token gets no gradient
    # token 6: V 0.25 left old 0.6 by more than 0.2 and the clipped error (0.4 - 0.1)^2 is the larger: flat in V
    assert float(v.grad[6]) == 0.0 and float(v.grad[4]) != 0.0
    if mode == "token_mean":  # value_loss metric is verl's vf_loss under token_mean
        s, c = metrics["value_loss"]
        assert float(s / c) == pytest.approx(want_loss, abs=1e-12)


def _gae(rewards, values, gamma, lam):
    """Plain-Python GAE of one sample with every token live (verl's compute_gae_advantage_return, no whitening)."""
    adv, nxt_v, run = [0.0] * len(rewards), 0.0, 0.0
    for t in range(len(rewards) - 1, -1, -1):
        delta = rewards[t] + gamma * nxt_v - values[t]
        run = delta + gamma * lam * run
        adv[t] = run
        nxt_v = values[t]
    return adv, [a + v for a, v in zip(adv, values)]


def _samples():
    return [Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=1.0, group_index=0),
            Sample(prompt_ids=[1], response_ids=[6, 7], reward=0.25, group_index=0),
            Sample(prompt_ids=[2, 2], response_ids=[3, 3, 3, 3], reward=0.0, group_index=1, loss_mask=[1, 1, 1, 0])]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_ppo_estimator_is_gae_with_gamma_and_lambd(gamma, lam):
    samples = _samples()
    values = [torch.tensor([0.2, 0.5, 0.7]), torch.tensor([0.1, -0.3]), torch.tensor([0.4, 0.0, 0.3, 9.0])]
    spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", gamma=gamma, lambd=lam))
    assert spec.prepare_batch(samples).values and spec.needs_whole_batch()
    adv, ret = spec.compute_advantages_and_returns(samples, values=values)
    for i, (want_len, reward) in enumerate(((3, 1.0), (2, 0.25), (3, 0.0))):  # sample 2's last token is masked
        r = [0.0] * want_len
        r[-1] = reward
        wa, wr = _gae(r, values[i][:want_len].tolist(), gamma, lam)
        assert adv[i][:want_len].tolist() == pytest.approx(wa, abs=1e-6)
        assert ret[i][:want_len].tolist() == pytest.approx(wr, abs=1e-6)
    assert float(adv[2][3]) == 0.0 and float(ret[2][3]) == 0.0  # masked: nothing, whatever its value (9.0)
    with pytest.raises(ConfigError, match="critic's values"):
        spec.compute_advantages(samples)


def test_ppo_kl_in_reward_and_whitening():
    samples = _samples()[:2]
    values = [torch.tensor([0.2, 0.5, 0.7]), torch.tensor([0.1, -0.3])]
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-0.7, -1.2])]
    ref = [torch.tensor([-1.1, -1.5, -0.5]), torch.tensor([-0.9, -1.2])]
    spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.95, kl_coef=0.1,
                                                   kl_loss_type="k1"))
    assert spec.prepare_batch(samples).ref_logprobs
    adv, ret = spec.compute_advantages_and_returns(samples, old_logprobs=old, ref_logprobs=ref, values=values)
    for i, reward in enumerate((1.0, 0.25)):
        kl = kl_estimate(old[i], ref[i], "k1").tolist()
        r = [-0.1 * k for k in kl]
        r[-1] += reward
        wa, wr = _gae(r, values[i].tolist(), 0.9, 0.95)
        assert adv[i].tolist() == pytest.approx(wa, abs=1e-6) and ret[i].tolist() == pytest.approx(wr, abs=1e-6)
    white = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.95, kl_coef=0.1,
                                                    kl_loss_type="k1", normalize_advantages=True))
    wadv, wret = white.compute_advantages_and_returns(samples, old_logprobs=old, ref_logprobs=ref, values=values)
    flat = torch.cat(adv).double()
    want = (flat - flat.mean()) / math.sqrt(float(flat.var()) + 1e-8)  # Bessel, eps inside the root
    assert torch.cat(wadv).double().tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert torch.equal(torch.cat(wret), torch.cat(ret))  # the returns are never whitened


def _parse(tmp_path, *flags):
    from megatron_rl.config import parse_config
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    hf = tmp_path / "hf"
    if not hf.exists():
        build_tiny_hf_model("qwen2", hf)
    return parse_config(["--hf-checkpoint", str(hf), *flags])


@pytest.mark.parametrize("flags,match", [
    (["--critic-num-nodes", "1"], "--critic-num-nodes 1: a critic on its own nodes"),
    (["--critic-num-gpus-per-node", "2"], "--critic-num-gpus-per-node 2: a critic on its own"),
    (["--critic-load", "/x"], "--critic-load /x: no COMPLETE.json there"),
    (["--critic-hf-checkpoint", "/x"], "--critic-hf-checkpoint /x: no config.json there"),
    (["--critic-load", "/x", "--critic-hf-checkpoint", "/y"], "both give the critic's initial weights"),
    (["--critic-save", "/x"], "--critic-save /x: not built yet"),
    (["--train-backend", "fsdp", "--critic-load", "/x"],
     "--critic-load /x with --train-backend fsdp: .*convert it .*dist-to-hf.* --critic-hf-checkpoint"),
    (["--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"], "--context-parallel-size > 1"),
    (["--lora-rank", "4"], "--lora-rank"),
    (["--use-rollout-logprobs"], "--use-rollout-logprobs"),
])
def test_ppo_refusals_name_the_flag(tmp_path, monkeypatch, flags, match):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=match):
        _parse(tmp_path, "--advantage-estimator", "ppo", *flags)


def test_ppo_on_the_fsdp_backend_is_accepted(tmp_path, monkeypatch):
    """The fsdp backend builds a critic too (backends/fsdp/critic.py), from HF weights."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", "--train-backend", "fsdp")
    assert cfg.precision.train_backend == "fsdp" and cfg.algorithm.advantage_estimator == "ppo"


@pytest.mark.parametrize("flags,match", [
    (["--lambd", "0.9"], "--lambd 0.9 configures the critic"),
    (["--value-clip", "0.5"], "--value-clip 0.5 configures the critic"),
    (["--num-critic-only-steps", "2"], "--num-critic-only-steps 2 configures the critic"),
    (["--critic-lr", "1e-5"], "--critic-lr 1e-05 configures the critic"),
    (["--critic-load", "/x"], "--critic-load /x configures the critic"),
    (["--gamma", "0.9"], "--gamma 0.9 discounts token rewards"),
])
def test_critic_flags_without_ppo_are_refused(tmp_path, monkeypatch, flags, match):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=match):
        _parse(tmp_path, *flags)


def test_gamma_and_lambd_reach_a_custom_advantage_function(tmp_path, monkeypatch):
    """slime's custom estimators read args.gamma / args.lambd: accepted with one (the namespace carries them)."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "my_adv.py").write_text("def compute(args, rollout_data):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _parse(tmp_path, "--custom-advantage-function-path", "my_adv:compute", "--gamma", "0.9", "--lambd", "0.7")
    from megatron_rl.algorithms.from_config import flag_namespace

    args = flag_namespace(cfg)
    assert (args.gamma, args.lambd) == (0.9, 0.7)


def test_ppo_flags_parse(tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", "--gamma", "0.99", "--lambd", "0.95", "--value-clip",
                 "0.3", "--critic-lr", "1e-5", "--num-critic-only-steps", "2", "--kl-coef", "0.01")
    from megatron_rl.algorithms.from_config import spec_from_config

    spec = spec_from_config(cfg)
    assert (spec.cfg.advantage_estimator, spec.cfg.gamma, spec.cfg.lambd, spec.cfg.value_clip) == ("ppo", 0.99, 0.95,
                                                                                                   0.3)
    assert cfg.optimizer.critic_lr == 1e-5 and cfg.algorithm.num_critic_only_steps == 2
    from megatron_rl.runner.dry_run import print_plan

    print_plan(cfg)  # --dry-run names the critic (a second model's memory on every rank)
    assert "critic: a second model of this architecture with a value head" in capsys.readouterr().out
