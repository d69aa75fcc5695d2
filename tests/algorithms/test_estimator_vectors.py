"""Our estimators and losses against vectors computed independently from the published formulas.

The expected values in tests/algorithms/vectors/*.json come from make_vectors.py (plain
float64 Python, never our code): regenerate them with
``python tests/algorithms/vectors/make_vectors.py``. Each file names the formula and the
peer convention it follows; docs/algorithms.md lists them.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss, reduce_metrics
from megatron_rl.algorithms import advantages as A
from megatron_rl.algorithms import losses as L
from megatron_rl.data.packing import compute_loss_denominators

VECTORS = Path(__file__).resolve().parent / "vectors"


def f64(x):
    return torch.tensor(x, dtype=torch.float64)


def _run_grpo(i):
    return {"advantages": A.grpo_advantages(i["rewards"], i["groups"], normalize_std=i["normalize_std"],
                                            eps=i["eps"])}


def _run_rloo(i):
    return {"advantages": A.rloo_advantages(i["rewards"], i["groups"])}


def _run_rpp(i):
    return {"advantages": A.reinforce_plus_plus_advantages(
        i["rewards"], i["response_lengths"], f64(i["loss_mask"]), kl=f64(i["kl"]), kl_coef=i["kl_coef"],
        gamma=i["gamma"], group_index=i.get("group_index"))}


def _run_gae(i):
    adv, ret = A.gae_advantages(f64(i["token_rewards"]), f64(i["values"]), i["response_lengths"],
                                loss_mask=f64(i["loss_mask"]), gamma=i["gamma"], lam=i["lam"])
    return {"advantages": adv, "returns": ret}


def _run_whiten(i):
    return {"out": A.masked_whiten(f64(i["x"]), f64(i["mask"]))}


def _run_kl(i):
    lp = f64(i["logprobs"]).requires_grad_()
    kl = L.kl_estimate(lp, f64(i["ref_logprobs"]), i["kind"])
    (grad,) = torch.autograd.grad(kl.sum(), lp)
    return {"kl": kl.detach(), "grad": grad}


def _run_ppo_clip(i):
    loss, *_ = L.ppo_clip_per_token(f64(i["log_ratio"]), f64(i["advantages"]), i["eps_low"], i["eps_high"],
                                    i["dual_clip_c"])
    return {"loss": loss}


def _run_tis(i):
    w, _, _ = L.tis_weights(f64(i["old_logprobs"]), f64(i["rollout_logprobs"]), i["cap"], i["low"])
    return {"weights": w}


def _run_gspo(i):
    lengths, mask = i["response_lengths"], f64(i["loss_mask"])
    adv = f64(i["seq_advantages"]).repeat_interleave(torch.tensor(lengths))
    cfg = PolicyGradientConfig(use_gspo=True, gspo_eps_clip=i["eps_low"], gspo_eps_clip_high=i["eps_high"])
    inputs = LossInputs(f64(i["logprobs"]), adv, mask, lengths, old_logprobs=f64(i["old_logprobs"]))
    loss, _ = compute_policy_loss(inputs, compute_loss_denominators(torch.split(mask, lengths)), cfg)
    return {"loss": loss}


def _run_policy_loss(i):
    mask = f64(i["loss_mask"])
    cfg = PolicyGradientConfig(eps_clip=i["eps_clip"], kl_loss_coef=i["kl_loss_coef"],
                               kl_loss_type=i["kl_loss_type"], use_unbiased_kl=i["use_unbiased_kl"])
    inputs = LossInputs(f64(i["logprobs"]).requires_grad_(), f64(i["advantages"]), mask, [len(mask)],
                        old_logprobs=f64(i["old_logprobs"]), ref_logprobs=f64(i["ref_logprobs"]))
    loss, metrics = compute_policy_loss(inputs, compute_loss_denominators([mask]), cfg)
    loss.backward()
    assert torch.isfinite(inputs.logprobs.grad).all()
    m = reduce_metrics([metrics])
    return {"loss": loss.detach(), "ppo_kl": m["ppo_kl"], "kl": m["kl"]}


def _run_gpg(i):
    return {"advantages": A.gpg_advantages(i["rewards"], i["groups"])}


def _run_opo(i):
    return {"advantages": A.opo_advantages(i["rewards"], i["groups"], i["token_counts"])}


def _run_policy_loss_types(i):
    """float32 log-probs, as training runs: values and gradients within the vectors' 1e-6."""
    lengths, mask = i["response_lengths"], torch.tensor(i["loss_mask"], dtype=torch.float32)
    cfg = PolicyGradientConfig(policy_loss_type=i["policy_loss_type"], loss_agg_mode=i["loss_agg_mode"],
                               eps_clip=i["eps_clip"], eps_clip_high=i["eps_clip_high"],
                               sapo_tau_pos=i["sapo_tau_pos"], sapo_tau_neg=i["sapo_tau_neg"],
                               max_response_length=i["max_response_length"],
                               **{k: i[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                                                    "ppo_kl_coef") if k in i})
    f32 = (lambda k: torch.tensor(i[k], dtype=torch.float32))
    inputs = LossInputs(f32("logprobs").requires_grad_(), f32("advantages"), mask, lengths,
                        old_logprobs=f32("old_logprobs"))
    loss, metrics = compute_policy_loss(inputs, compute_loss_denominators(torch.split(mask, lengths)), cfg)
    loss.backward()
    out = {"loss": loss.detach(), "grad": inputs.logprobs.grad}
    reduced = reduce_metrics([metrics])
    out.update({k: reduced[k] for k in ("clip_frac", "cov_selected_frac") if k in reduced})
    return out


RUNNERS = {
    "grpo": _run_grpo, "rloo": _run_rloo, "reinforce_plus_plus": _run_rpp, "reinforce_plus_plus_baseline": _run_rpp,
    "gae": _run_gae, "normalize_advantages": _run_whiten, "kl": _run_kl, "ppo_clip": _run_ppo_clip, "tis": _run_tis,
    "gspo": _run_gspo, "policy_loss": _run_policy_loss, "gpg": _run_gpg, "opo": _run_opo,
    "policy_loss_types": _run_policy_loss_types,
}


def _cases():
    out = []
    for path in sorted(VECTORS.glob("*.json")):
        for case in json.loads(path.read_text())["cases"]:
            out.append(pytest.param(path.stem, case, id=f"{path.stem}-{case['name']}"))
    return out


def test_every_vector_file_has_a_runner():
    assert sorted(p.stem for p in VECTORS.glob("*.json")) == sorted(RUNNERS)


@pytest.mark.parametrize("name,case", _cases())
def test_vector(name, case):
    got = RUNNERS[name](case["inputs"])
    for key, expected in case["expected"].items():
        value = torch.as_tensor(got[key], dtype=torch.float64)
        want = torch.as_tensor(expected, dtype=torch.float64)
        assert value.shape == want.shape, key
        assert torch.isfinite(value).all(), key
        assert torch.allclose(value, want, atol=case["atol"], rtol=0), (key, value.tolist(), want.tolist())
    for spec in case["exact_zero"]:
        key, lo, hi = re.fullmatch(r"(\w+)(?:\[(\d+):(\d+)\])?", spec).groups()
        part = torch.as_tensor(got[key])
        part = part if lo is None else part[int(lo):int(hi)]
        assert (part == 0).all(), (spec, part.tolist())
