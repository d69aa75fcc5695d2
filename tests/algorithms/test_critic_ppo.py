"""PPO with a critic, the algorithm half: the clipped value loss against verl's ``compute_value_loss`` written out
in plain Python, the ``ppo`` estimator's GAE (--gamma, --lambd, reward on the last loss token, --kl-coef folded in,
--normalize-advantages), and the flags' validation. The megatron critic itself: tests/dist/test_critic.py."""

from __future__ import annotations

import math
import re

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
    (["--critic-num-nodes", "2"], "--critic-num-nodes 2: the critic runs on the actor's ranks"),
    (["--critic-num-gpus-per-node", "2"], "--critic-num-gpus-per-node 2: the critic runs on the actor's ranks"),
    (["--critic-tensor-model-parallel-size", "0"], "--critic-tensor-model-parallel-size 0 must be >= 1"),
    (["--critic-tensor-model-parallel-size", "2"], "the critic's layout TP 2 x PP 1 = 2 does not divide "
                                                   "the 1 training ranks"),
    (["--critic-tensor-model-parallel-size", "4", "--actor-num-gpus-per-node", "4"],
     "--critic-tensor-model-parallel-size 4: the model's num_key_value_heads=2 is not divisible"),
    (["--critic-pipeline-model-parallel-size", "3", "--actor-num-gpus-per-node", "3"],
     "--critic-pipeline-model-parallel-size 3: the model's 4 layers do not split"),
    (["--critic-tensor-model-parallel-size", "2", "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2"],
     "--critic-tensor-model-parallel-size 2: --train-backend fsdp has no tensor or pipeline parallelism"),
    (["--critic-load", "/x"], "--critic-load /x: no COMPLETE.json there"),
    (["--critic-hf-checkpoint", "/x"], "--critic-hf-checkpoint /x: no config.json there"),
    (["--critic-load", "/x", "--critic-hf-checkpoint", "/y"], "both give the critic's initial weights"),
    (["--critic-save", "/x"], "--critic-save /x: not built yet"),
    (["--train-backend", "fsdp", "--critic-load", "/x"],
     "--critic-load /x with --train-backend fsdp: .*convert it .*dist-to-hf.* --critic-hf-checkpoint"),
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
    (["--critic-pipeline-model-parallel-size", "2"], "--critic-pipeline-model-parallel-size 2 lays out the critic"),
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


def test_critic_placement_equal_to_the_actors_and_its_own_layout_are_accepted(tmp_path, monkeypatch):
    """slime sets --critic-num-nodes / --critic-num-gpus-per-node to the actor's (its critic shares the actor's
    GPUs): those values pass; the critic's own TP/PP on the same ranks passes where the ranks divide."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "4", "--critic-num-nodes",
                 "1", "--critic-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2",
                 "--critic-tensor-model-parallel-size", "1", "--critic-pipeline-model-parallel-size", "2",
                 "--virtual-pipeline-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert (cfg.parallel.critic_tensor_model_parallel_size, cfg.parallel.critic_pipeline_model_parallel_size) == (1, 2)


def _role_yaml(tmp_path, entries) -> str:
    import yaml

    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump({"megatron": entries}))
    return str(path)


def test_slime_megatron_config_path_sets_the_critic_and_actor_roles(tmp_path, monkeypatch):
    """slime's --megatron-config-path: the critic role's layout and schedule become the critic's own flags, an
    actor role's keys the actor's; as in slime the overrides win over the command line (1e-5 as a YAML string)."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = _role_yaml(tmp_path, [
        {"name": "default", "role": "critic", "overrides": {"lr": "1e-5", "tensor_model_parallel_size": 1,
                                                           "pipeline_model_parallel_size": 2,
                                                           "lr_warmup_iters": 3}},
        {"name": "default", "role": "actor", "overrides": {"lr": "2e-6", "tensor_model_parallel_size": 2}}])
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "4", "--lr", "1e-3",
                 "--megatron-config-path", path)
    assert cfg.optimizer.critic_lr == 1e-5 and cfg.optimizer.critic_lr_warmup_iters == 3
    assert cfg.optimizer.lr == 2e-6 and cfg.parallel.tensor_model_parallel_size == 2
    assert (cfg.parallel.critic_tensor_model_parallel_size, cfg.parallel.critic_pipeline_model_parallel_size) == (1, 2)


@pytest.mark.parametrize("entries,match", [
    ([{"role": "critic", "overrides": {"bf16": True}}], "critic key 'bf16' is not one the critic has of its own"),
    ([{"role": "critic", "overrides": {"num_gpus_per_node": 8}}], "GPU allocation follows the command line"),
    ([{"role": "actor", "overrides": {"tensor_model_paralel_size": 2}}], "did you mean 'tensor_model_parallel_size'"),
    ([{"role": "critic"}, {"role": "critic"}], "more than one entry with role: critic"),
    ([{"role": "reward"}], "needs role: actor or role: critic"),
    ([{"role": "actor", "overrides": {"sequence_parallel": "yes"}}], "must be true or false"),
])
def test_slime_megatron_config_path_refusals_name_the_key(tmp_path, monkeypatch, entries, match):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=match):
        _parse(tmp_path, "--advantage-estimator", "ppo", "--megatron-config-path", _role_yaml(tmp_path, entries))


def test_the_planner_places_the_critic_on_the_actors_gpus(tmp_path, monkeypatch):
    """The plan (what --dry-run prints and checks the model shape against) holds the critic as a training
    component colocated with the actor, in its own layout; a run without a critic plans none."""
    from megatron_rl.config.placement import plan_for_config

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", "--actor-num-gpus-per-node", "4",
                 "--tensor-model-parallel-size", "2", "--critic-tensor-model-parallel-size", "1",
                 "--critic-pipeline-model-parallel-size", "2")
    plan = plan_for_config(cfg)
    critic = next(c for c in plan.components if c.role == "critic")
    assert (critic.dp, critic.tp, critic.pp) == (2, 1, 2)
    assert any(m.role == "actor" for m in plan.colocated_with(critic))
    assert not [c for c in plan_for_config(_parse(tmp_path)).components if c.role == "critic"]


def test_a_custom_advantage_function_with_a_critic_gets_values_and_sets_returns(tmp_path):
    """slime's contract with ppo: rollout_data['values'] holds the critic's values and the function sets both
    rollout_data['advantages'] and rollout_data['returns'] (the critic's targets); masked tokens get 0, the
    advantages (not the returns) are whitened by --normalize-advantages; missing returns are refused by name."""
    import types

    seen = {}

    def td_zero(args, rollout_data):
        seen["values"] = [v.clone() for v in rollout_data["values"]]
        rollout_data["returns"] = [torch.full_like(v, float(r)) for v, r in zip(rollout_data["values"],
                                                                                 rollout_data["raw_reward"])]
        rollout_data["advantages"] = [ret - v for ret, v in zip(rollout_data["returns"], rollout_data["values"])]

    samples = _samples()
    values = [torch.linspace(-1, 1, s.response_length) for s in samples]
    spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo", normalize_advantages=False),
                              custom_advantage_fn=td_zero, args=types.SimpleNamespace())
    advantages, returns = spec.compute_advantages_and_returns(samples, values=values)
    for v, got in zip(values, seen["values"], strict=True):
        assert torch.equal(v.float(), got)
    for s, v, a, r in zip(samples, values, advantages, returns, strict=True):
        m = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
        assert torch.equal(r, torch.full_like(v, float(s.reward)) * m)
        torch.testing.assert_close(a, (float(s.reward) - v) * m)

    def no_returns(args, rollout_data):
        rollout_data["advantages"] = [torch.zeros_like(v) for v in rollout_data["values"]]

    spec = PolicyGradientSpec(PolicyGradientConfig(advantage_estimator="ppo"), custom_advantage_fn=no_returns,
                              args=types.SimpleNamespace())
    with pytest.raises(ConfigError, match=r"rollout_data\['returns'\]"):
        spec.compute_advantages_and_returns(samples, values=values)


@pytest.mark.parametrize("allocation,match", [
    ("megatron[actor]:d2t2+megatron[critic]:d4", "runs on the actor's GPUs, as slime's does; put it in the actor's"),
    ("megatron[actor]:d2t2|megatron[critic]:d2c2", "has no context parallelism"),
    ("megatron[actor]:d2t2|fsdp[critic]:d4", "the critic runs inside the actor's backend: use megatron"),
    ("megatron[actor]:d4|megatron[critic]:d2|megatron[value]:d4", "places 2 critics"),
])
def test_an_allocations_critic_is_refused_where_it_cannot_run(tmp_path, monkeypatch, allocation, match):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=re.escape(match)):
        _parse(tmp_path, "--advantage-estimator", "ppo", "--allocation", allocation, "--debug-train-only",
               "--load-debug-rollout-data", str(tmp_path / "r_{rollout_id}.pt"))


def test_an_allocations_critic_sets_its_layout(tmp_path, monkeypatch):
    """AReaL-style allocations may place the critic: colocated with the actor, its t/p become the critic's own
    layout flags; without ppo such a critic is refused (it would not be trained)."""
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    common = ["--allocation", "megatron[actor]:d2t2|megatron[critic]:d2p2", "--debug-train-only",
              "--load-debug-rollout-data", str(tmp_path / "r_{rollout_id}.pt")]
    cfg = _parse(tmp_path, "--advantage-estimator", "ppo", *common)
    assert (cfg.parallel.critic_tensor_model_parallel_size, cfg.parallel.critic_pipeline_model_parallel_size) == (1, 2)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.actor_world_size == 4
    with pytest.raises(ConfigError, match="places a critic .* which only --advantage-estimator ppo trains"):
        _parse(tmp_path, *common)
