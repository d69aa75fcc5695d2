"""slime's algorithm hooks: --custom-advantage-function-path (its fn(args, rollout_data) contract),
--disable-rewards-normalization, --get-mismatch-metrics, --ref-update-interval's resume rule, and the refused
ones (each error names the flag)."""

import math
import textwrap

import pytest
import torch

from megatron_rl.algorithms import PolicyGradientConfig, PolicyGradientSpec, get_spec
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError

ADV_MODULE = textwrap.dedent('''
    import torch

    SEEN = {}


    def reinforce(args, rollout_data):
        """Plain REINFORCE with a per-token bonus: the raw reward plus 0.1 * kl, written as slime's functions do."""
        SEEN.update(args=args, data=dict(rollout_data))
        rollout_data["advantages"] = [torch.ones_like(kl) * r + 0.1 * kl
                                      for r, kl in zip(rollout_data["raw_reward"], rollout_data["kl"])]
        rollout_data["returns"] = rollout_data["advantages"]


    def wrong_length(args, rollout_data):
        rollout_data["advantages"] = [torch.zeros(1) for _ in rollout_data["rewards"]]


    def one_arg(rollout_data):
        return None


    NOT_A_FUNCTION = 3
''')


def _samples():
    return [
        Sample(group_index=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], reward=1.0, loss_mask=[1, 0, 1],
               rollout_logprobs=[-1.0, -2.0, -0.5]),
        Sample(group_index=0, prompt_ids=[1, 2], response_ids=[6, 7], reward=0.0, rollout_logprobs=[-0.3, -0.1]),
        Sample(group_index=1, prompt_ids=[9], response_ids=[8], reward=0.5, rollout_logprobs=[-2.0]),
        Sample(group_index=1, prompt_ids=[9], response_ids=[8, 9], reward=0.25, rollout_logprobs=[-2.0, -1.0]),
    ]


@pytest.fixture
def adv_module(tmp_path, monkeypatch):
    (tmp_path / "my_adv.py").write_text(ADV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import my_adv
    return importlib.reload(my_adv)


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def test_custom_advantage_function_gets_slimes_rollout_data(adv_module, hf_dir):
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.config import parse_config

    cfg = parse_config(["--hf-checkpoint", hf_dir, "--custom-advantage-function-path", "my_adv.reinforce",
                        "--kl-coef", "0.5", "--kl-loss-type", "k1", "--n-samples-per-prompt", "2"])
    spec = spec_from_config(cfg)
    req = spec.prepare_batch(_samples())
    assert req.advantages_need_logprobs and req.ref_logprobs and spec.needs_whole_batch()
    old = [torch.tensor(s.rollout_logprobs) for s in _samples()]
    ref = [t - 0.25 for t in old]
    adv = spec.compute_advantages(_samples(), old_logprobs=old, ref_logprobs=ref)
    # raw reward + 0.1 * k1 (0.25) on loss tokens, 0 on the masked one
    assert [t.tolist() for t in adv] == [pytest.approx(v) for v in ([1.025, 0.0, 1.025], [0.025, 0.025], [0.525],
                                                                    [0.275, 0.275])]
    seen = adv_module.SEEN
    assert seen["args"].n_samples_per_prompt == 2 and seen["args"].kl_coef == 0.5  # slime's flag names
    data = seen["data"]
    # slime's _post_process_rewards for grpo: (r - mean_g) / (std_g + 1e-6), std unbiased
    a, b = 0.5 / (math.sqrt(0.5) + 1e-6), 0.125 / (math.sqrt(2 * 0.125 ** 2) + 1e-6)
    assert data["rewards"] == pytest.approx([a, -a, b, -b], rel=1e-6)
    assert data["raw_reward"] == [1.0, 0.0, 0.5, 0.25]
    assert data["response_lengths"] == [3, 2, 1, 2] and data["total_lengths"] == [5, 4, 2, 3]
    assert data["loss_masks"][0].tolist() == [1.0, 0.0, 1.0] and data["values"] is None
    assert torch.equal(data["log_probs"][0], old[0]) and torch.equal(data["ref_log_probs"][1], ref[1])
    assert all(torch.allclose(k, torch.full_like(k, 0.25)) for k in data["kl"])  # --kl-loss-type k1 of old vs ref


def test_custom_advantage_then_normalize_advantages(adv_module):
    spec = PolicyGradientSpec(PolicyGradientConfig(custom_advantage_function_path="my_adv:reinforce",
                                                   normalize_advantages=True))
    adv = torch.cat(spec.compute_advantages(_samples(), old_logprobs=[torch.tensor(s.rollout_logprobs)
                                                                      for s in _samples()]))
    live = adv[torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]) > 0]
    assert abs(live.mean().item()) < 1e-6 and adv[1] == 0.0  # whitened after the function, as slime


@pytest.mark.parametrize("path,match", [
    ("my_adv:wrong_length", r"rollout_data\['advantages'\]\[0\] has shape \(1,\) but sample 0 has 3"),
    ("my_adv:one_arg", r"cannot be called as fn\(args, rollout_data\)"),
    ("my_adv:NOT_A_FUNCTION", "is a int, not a function"),
    ("my_adv:nope", "has no 'nope'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
])
def test_custom_advantage_function_errors_name_the_flag(adv_module, path, match):
    with pytest.raises(ConfigError, match="--custom-advantage-function-path .*" + match):
        spec = PolicyGradientSpec(PolicyGradientConfig(custom_advantage_function_path=path))
        spec.compute_advantages(_samples(), old_logprobs=[torch.tensor(s.rollout_logprobs) for s in _samples()])


def test_disable_rewards_normalization_is_slimes_raw_reward():
    raw = get_spec("policy_gradient", PolicyGradientConfig(rewards_normalization=False)).compute_advantages(_samples())
    assert [t.tolist() for t in raw] == [[1.0, 0.0, 1.0], [0.0, 0.0], [0.5], [0.25, 0.25]]
    base = PolicyGradientConfig(advantage_estimator="reinforce_plus_plus_baseline", rewards_normalization=False)
    plain = PolicyGradientConfig(advantage_estimator="reinforce_plus_plus")
    assert all(torch.equal(x, y) for x, y in zip(get_spec("policy_gradient", base).compute_advantages(_samples()),
                                                 get_spec("policy_gradient", plain).compute_advantages(_samples())))
    with pytest.raises(ConfigError, match="--disable-rewards-normalization"):
        PolicyGradientConfig(advantage_estimator="rloo", rewards_normalization=False)


def test_get_mismatch_metrics_reads_rollout_logprobs_and_corrects_nothing():
    from megatron_rl.algorithms import LossInputs, compute_policy_loss, reduce_metrics
    from megatron_rl.data.packing import LossDenominators

    spec = get_spec("policy_gradient", PolicyGradientConfig(get_mismatch_metrics=True))
    assert spec.prepare_batch(_samples()).rollout_logprobs
    bad = _samples()
    bad[1].rollout_logprobs = [-0.3]
    with pytest.raises(ConfigError, match="--get-mismatch-metrics needs rollout log-probs .* sample 1"):
        spec.prepare_batch(bad)
    lp = torch.tensor([-1.0, -2.0, -0.5])
    x = LossInputs(lp.clone(), torch.tensor([1.0, -1.0, 0.5]), torch.ones(3), [3], old_logprobs=lp,
                   rollout_logprobs=lp - 0.5)
    loss, m = spec.compute_loss(x, LossDenominators(3, 1, 3, 1))
    plain, _ = compute_policy_loss(LossInputs(lp.clone(), x.advantages, torch.ones(3), [3], old_logprobs=lp),
                                   LossDenominators(3, 1, 3, 1), PolicyGradientConfig())
    assert torch.equal(loss, plain)  # no weight applied
    assert reduce_metrics([m])["mismatch_abs_logprob"] == pytest.approx(0.5)


@pytest.mark.parametrize("flags,match", [
    (["--loss-type", "custom_loss"], "--loss-type custom_loss / --custom-loss-function-path: refused"),
    (["--custom-loss-function-path", "m:f"], "--custom-loss-function-path: refused"),
    (["--custom-pg-loss-reducer-function-path", "m:f"], "--custom-pg-loss-reducer-function-path m:f: refused"),
    (["--custom-tis-function-path", "m:f"], "--custom-tis-function-path m:f: refused.*--use-tis --tis-mode mask"),
    (["--ref-update-interval", "5"], "--ref-update-interval 5 replaces the reference model, which this run"),
    (["--ref-update-interval", "4", "--use-kl-loss", "--save", "/tmp/x", "--save-interval", "6"],
     "--ref-update-interval 4 with --save-interval 6"),
    (["--custom-advantage-function-path", "nocolon"], "--custom-advantage-function-path nocolon must be"),
    (["--custom-advantage-function-path", "missing.py:f"], "no such file missing.py"),
    (["--disable-rewards-normalization", "--advantage-estimator", "rloo"], "--disable-rewards-normalization"),
])
def test_slime_hook_flags_are_checked_in_validation(hf_dir, flags, match):
    from megatron_rl.config import parse_config

    with pytest.raises(ConfigError, match=match):
        parse_config(["--hf-checkpoint", hf_dir, *flags])


def test_ref_update_interval_on_resume_takes_the_reference_from_a_boundary_checkpoint():
    """A resume at rollout count R: R < N keeps the initial reference, R a multiple of N snapshots the resumed
    weights as the reference (they are the actor slime would have copied), any other R is refused by name
    (the end to end run is tests/e2e/test_custom_advantage.py)."""
    from megatron_rl.config import parse_config
    from megatron_rl.runner.resume import Resumer

    class Recorder:  # the one TrainBackend call the check makes, recorded
        def __init__(self):
            self.tags = []

        def snapshot_weights(self, tag):
            self.tags.append(tag)

    cfg = parse_config(["--use-kl-loss", "--ref-update-interval", "4"], validate=False)
    resumer, backend = Resumer(cfg, None), Recorder()
    resumer._restore_updated_reference(backend, 3, "ckpt/iter_0000003")
    assert backend.tags == []
    resumer._restore_updated_reference(backend, 8, "ckpt/iter_0000008")
    assert backend.tags == ["ref"]
    with pytest.raises(ConfigError, match="--ref-update-interval 4: ckpt/iter_0000006 is at rollout 6, but the "
                                          "reference was last replaced by the actor at rollout 4"):
        resumer._restore_updated_reference(backend, 6, "ckpt/iter_0000006")
