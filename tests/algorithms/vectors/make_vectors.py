"""Write the estimator/loss test vectors (``python tests/algorithms/vectors/make_vectors.py``).

Why a generator: the expected outputs are computed HERE, in plain float64 Python
(``math``, lists; no torch, nothing from ``megatron_rl``), straight from the
published formulas as written in docs/algorithms.md. A test that compared our
functions with themselves could not catch a wrong convention; these vectors can.

Each ``<name>.json`` holds ``formula`` (the formula the values follow, with the
peer it matches), ``convention`` (choices where peers differ) and ``cases``: each
case has ``inputs``, ``expected`` and ``atol``; ``exact_zero`` lists expected
outputs that must be exactly 0.0, not merely close. Edge cases included on
purpose: constant rewards, single-sample groups, masked (tool/observation)
spans, a single loss token, extreme log ratios.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG_RATIO_CLAMP = 20.0  # verl/our ratio clamp
KL_CLAMP = 10.0  # verl's low_var_kl bound


def _rng(seed):
    return random.Random(seed)


def _round(xs, nd=4):
    return [round(x, nd) for x in xs]


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


# ---------------------------------------------------------------- estimators
def grpo(rewards, groups, eps, normalize_std):
    """A_i = (r_i - mean_g) / (std_g + eps), std_g unbiased (n-1); 0 without contrast."""
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len(members)
        if n < 2 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = math.fsum(members) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in members) / (n - 1))
        out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


def rloo(rewards, groups):
    """A_i = r_i - mean_{j != i, same group} r_j; 0 without contrast."""
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        members = others + [r]
        if not others or max(members) == min(members):
            out.append(0.0)
        else:
            out.append(r - math.fsum(others) / len(others))
    return out


def whiten(values, mask, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over mask, var with Bessel's n-1 (verl masked_whiten); 0 if < 2 or constant."""
    sel = [v for v, m in zip(values, mask) if m]
    if len(sel) < 2 or max(sel) == min(sel):
        return [0.0] * len(values)
    mean = math.fsum(sel) / len(sel)
    var = math.fsum((v - mean) ** 2 for v in sel) / (len(sel) - 1)
    return [(v - mean) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(values, mask)]


def split(flat, lengths):
    out, i = [], 0
    for n in lengths:
        out.append(flat[i:i + n])
        i += n
    return out


def reinforce_pp(rewards, lengths, mask, kl, kl_coef, gamma, groups=None):
    """REINFORCE++ (arXiv 2501.03262, slime): r_t = -kl_coef*kl_t on loss tokens, + reward on the last loss
    token; G_t = r_t + gamma*G_{t+1} per sample; whitened over all loss tokens of the batch."""
    if groups is not None:  # -baseline: reward minus its group mean (0 for groups without contrast)
        rewards = [r - (math.fsum(x for x, g in zip(rewards, groups) if g == gi)
                        / sum(1 for g in groups if g == gi))
                   if len({x for x, g in zip(rewards, groups) if g == gi}) > 1 else 0.0
                   for r, gi in zip(rewards, groups)]
    returns = []
    for r, m, k in zip(rewards, split(mask, lengths), split(kl, lengths)):
        tok = [-kl_coef * kt * mt for kt, mt in zip(k, m)]
        live = [t for t, mt in enumerate(m) if mt]
        if live:
            tok[live[-1]] += r
        g, ret = 0.0, [0.0] * len(tok)
        for t in range(len(tok) - 1, -1, -1):
            g = tok[t] + gamma * g
            ret[t] = g
        returns += ret
    return whiten(returns, mask)


def gae(rewards, values, lengths, mask, gamma, lam):
    """GAE over the unmasked tokens of each sample only (verl's multi-turn GAE); 0 on masked tokens."""
    adv, ret = [], []
    for r, v, m in zip(split(rewards, lengths), split(values, lengths), split(mask, lengths)):
        a_s, ret_s = [0.0] * len(r), [0.0] * len(r)
        next_v, running = 0.0, 0.0
        for t in range(len(r) - 1, -1, -1):
            if not m[t]:
                continue
            running = r[t] + gamma * next_v - v[t] + gamma * lam * running
            a_s[t], ret_s[t] = running, running + v[t]
            next_v = v[t]
        adv += a_s
        ret += ret_s
    return adv, ret


# ---------------------------------------------------------------- losses
def kl_value_and_grad(lp, ref, kind):
    """Schulman's k1/k2/k3; k3 = low_var_kl clamped as verl: log ratio to +-20, value to [-10, 10].
    Gradient with respect to lp (0 where a clamp is active)."""
    lr = lp - ref
    if kind == "k1":
        return lr, 1.0
    if kind == "k2":
        return 0.5 * lr * lr, lr
    lrc = _clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    v = math.exp(-lrc) - 1.0 + lrc
    if abs(lr) > LOG_RATIO_CLAMP or abs(v) > KL_CLAMP:
        return _clamp(v, -KL_CLAMP, KL_CLAMP), 0.0
    return v, 1.0 - math.exp(-lr)


def ppo_clip(log_ratio, adv, eps_low, eps_high, c):
    """max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); dual clip: A<0 capped at -A c. r = exp(clamp(lr, +-20))."""
    out = []
    for lr, a in zip(log_ratio, adv):
        r = math.exp(_clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        loss = max(-a * r, -a * _clamp(r, 1 - eps_low, 1 + eps_high))
        if c is not None and a < 0:
            loss = min(loss, -a * c)
        out.append(loss)
    return out


def tis(old, rollout, cap, low):
    """clamp(exp(min(old - rollout, 20)), low, cap) (slime: --tis-clip-low, --tis-clip)."""
    return [_clamp(math.exp(min(o - r, LOG_RATIO_CLAMP)), low, cap) for o, r in zip(old, rollout)]


def gspo_loss(lp, old, mask, lengths, seq_adv, eps_low, eps_high):
    """GSPO (arXiv 2507.18071): s_i = exp(mean_t(lp - old)), loss = mean_i max(-A_i s_i, -A_i clip(s_i))."""
    total = 0.0
    for p, o, m, a in zip(split(lp, lengths), split(old, lengths), split(mask, lengths), seq_adv):
        n = sum(m)
        if not n:
            continue
        s = math.exp(math.fsum((pt - ot) * mt for pt, ot, mt in zip(p, o, m)) / n)
        total += max(-a * s, -a * _clamp(s, 1 - eps_low, 1 + eps_high))
    return total / len(lengths)


def token_mean_policy_loss(lp, old, ref, adv, mask, eps, kl_coef, kind, unbiased):
    """token_mean of pg + kl_coef * kl_w; kl_w = kl without --use-unbiased-kl; with it (slime's
    compute_approx_kl) w * k3 unclamped, then clamped to [-10, 10] for k3/low_var_kl, w = exp(lp - old);
    ppo_kl = mean over loss tokens of -clamp(lp - old, +-20) (verl)."""
    n = sum(mask)
    pg = ppo_clip([p - o for p, o in zip(lp, old)], adv, eps, eps, None)
    total, kl_sum = 0.0, 0.0
    for t in range(len(lp)):
        if unbiased:
            w = math.exp(_clamp(lp[t] - old[t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            if kind in ("k3", "low_var_kl"):
                lrc = _clamp(lp[t] - ref[t], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                k = _clamp(w * (math.exp(-lrc) - 1.0 + lrc), -KL_CLAMP, KL_CLAMP)
            else:
                k = w * kl_value_and_grad(lp[t], ref[t], kind)[0]
        else:
            k, _ = kl_value_and_grad(lp[t], ref[t], kind)
        total += mask[t] * (pg[t] + kl_coef * k)
        kl_sum += mask[t] * k
    ppo_kl = math.fsum(m * -_clamp(p - o, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) for p, o, m in zip(lp, old, mask)) / n
    return total / n, ppo_kl, kl_sum / n


# ---------------------------------------------------------------- verl's newer estimators and policy losses
def gpg_adv(rewards, groups):
    """verl compute_gpg_outcome_advantage (f_norm 1): alpha = B / max(count_nonzero(r), 1),
    A_i = alpha * (r_i - mean_g); ours: 0 for a group of size 1 or without contrast."""
    alpha = len(rewards) / max(sum(1 for r in rewards if r != 0), 1)
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(members) < 2 or max(members) == min(members):
            out.append(0.0)
        else:
            out.append(alpha * (r - math.fsum(members) / len(members)))
    return out


def opo_adv(rewards, groups, token_counts):
    """verl compute_opo_outcome_advantage: baseline_g = sum_g(l_j r_j) / sum_g(l_j), l = response_mask.sum();
    ours: 0 for a group of size 1, without contrast, or without loss tokens."""
    out = []
    for r, g in zip(rewards, groups):
        members = [(x, n) for x, h, n in zip(rewards, groups, token_counts) if h == g]
        total = sum(n for _, n in members)
        if len(members) < 2 or len({x for x, _ in members}) < 2 or total == 0:
            out.append(0.0)
        else:
            out.append(r - math.fsum(x * n for x, n in members) / total)
    return out


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def pg_loss_and_grad(kind, lp, old, adv, mask, lengths, agg, eps_low, eps_high, tau_pos, tau_neg, max_len):
    """verl's compute_policy_loss_<kind> restated per token, then agg_loss; returns (loss, d loss / d lp,
    clip_frac or None). Ratio r = exp(clamp(lp - old, +-20)) for every kind (verl clamps for cispo and sapo;
    geo_mean's clamp is commented out there: it only matters for |lp - old| > 20)."""
    n_tok = sum(mask)
    samples = len(lengths)
    value, dvalue, clipped = [0.0] * len(lp), [0.0] * len(lp), [0.0] * len(lp)
    if kind == "geo_mean":  # one value per sequence: -mean(A) * exp(mean of the sign-side clipped log-ratio)
        loss, grad, start = 0.0, [0.0] * len(lp), 0
        for n in lengths:
            idx = range(start, start + n)
            start += n
            cnt = sum(mask[t] for t in idx)
            xs, chosen = {}, {}
            for t in idx:
                raw = lp[t] - old[t]
                lr = _clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
                sgn = (adv[t] > 0) - (adv[t] < 0)
                bounded = _clamp(lr, -eps_low, eps_high)
                xs[t] = sgn * min(sgn * lr, sgn * bounded)
                chosen[t] = sgn != 0 and xs[t] == lr and abs(raw) <= LOG_RATIO_CLAMP
                clipped[t] = float(lr != bounded and sgn != 0)
            s_lr = math.fsum(xs[t] * mask[t] for t in idx) / (cnt + 1e-8)
            a_bar = math.fsum(adv[t] * mask[t] for t in idx) / (cnt + 1e-8)
            seq = -a_bar * math.exp(s_lr)
            loss += seq / samples
            for t in idx:
                if mask[t] and chosen[t]:
                    grad[t] = seq * (1.0 / cnt) / samples
        return loss, grad, math.fsum(c * m for c, m in zip(clipped, mask)) / n_tok
    for t in range(len(lp)):
        raw = lp[t] - old[t]
        r = math.exp(_clamp(raw, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        inside = abs(raw) <= LOG_RATIO_CLAMP
        if kind == "cispo":  # -sg[clip(r)] * A * logp
            c = _clamp(r, 1 - eps_low, 1 + eps_high)
            value[t], dvalue[t], clipped[t] = -c * adv[t] * lp[t], -c * adv[t], float(r != c)
        elif kind == "gpg":  # -logp * A
            value[t], dvalue[t] = -lp[t] * adv[t], -adv[t]
        elif kind == "sapo":  # -(4 / tau) * sigmoid(tau (r - 1)) * A, tau by the sign of A
            tau = tau_pos if adv[t] > 0 else tau_neg
            sg = _sigmoid(tau * (r - 1.0))
            value[t] = -sg * (4.0 / tau) * adv[t]
            dvalue[t] = -4.0 * sg * (1.0 - sg) * r * adv[t] if inside else 0.0
    weight = _agg_weights(mask, lengths, agg, max_len)  # d agg / d value_t (verl agg_loss; B counts every sample)
    loss = math.fsum(v * w for v, w in zip(value, weight))
    frac = math.fsum(c * m for c, m in zip(clipped, mask)) / n_tok if kind == "cispo" else None
    return loss, [d * w for d, w in zip(dvalue, weight)], frac


def _agg_weights(mask, lengths, agg, max_len):
    """d agg_loss / d value_t of verl's agg_loss modes, B counting every sample."""
    n_tok, samples, weight, start = sum(mask), len(lengths), [0.0] * len(mask), 0
    for n in lengths:
        cnt = sum(mask[start:start + n])
        for t in range(start, start + n):
            if mask[t]:
                weight[t] = {"token_mean": 1.0 / n_tok, "seq_mean_token_mean": 1.0 / (cnt * samples),
                             "seq_mean_token_sum": 1.0 / samples,
                             "seq_mean_token_sum_norm": 1.0 / (samples * max_len)}[agg]
        start += n
    return weight


def cov_loss_and_grad(kind, lp, old, adv, mask, lengths, agg, eps_low, eps_high, share, lb, ub, coef, max_len):
    """verl's compute_policy_loss_clip_cov / _kl_cov on one micro-batch: cov_t = (A_t - mean A)(lp_t - mean lp)
    over its loss tokens. clip_cov: max(-A r, -A clip(r)) times 0 on the tokens the clip left alone with
    lb < cov < ub, at most max(int(share * N), 1) of them (the cases here have no more candidates than that,
    so verl's random pick takes them all); kl_cov: -A r, plus coef |lr| on the max(int(share * N), 1) tokens of
    largest cov. lr = clamp(lp - old, +-20) (verl does not clamp these two; no case here reaches it).
    Returns (loss, d loss / d lp, clip_frac or None, selected fraction)."""
    valid = [t for t in range(len(lp)) if mask[t]]
    mean_a = math.fsum(adv[t] for t in valid) / len(valid)
    mean_l = math.fsum(lp[t] for t in valid) / len(valid)
    cov = [(a - mean_a) * (p - mean_l) for a, p in zip(adv, lp)]
    value, dvalue, selected, by_origin = [0.0] * len(lp), [0.0] * len(lp), [False] * len(lp), [False] * len(lp)
    lr = [_clamp(p - o, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) for p, o in zip(lp, old)]
    if kind == "clip_cov":
        count = max(int(share * len(valid)), 1)
        for t in range(len(lp)):
            r = math.exp(lr[t])
            pg1, pg2 = -adv[t] * r, -adv[t] * _clamp(r, 1 - eps_low, 1 + eps_high)
            by_origin[t] = pg2 > pg1 and bool(mask[t])
            inside = abs(lp[t] - old[t]) <= LOG_RATIO_CLAMP
            value[t], dvalue[t] = (pg1, -adv[t] * r * inside) if pg1 >= pg2 else (pg2, 0.0)
        candidates = [t for t in valid if not by_origin[t] and lb < cov[t] < ub]
        assert 0 < len(candidates) <= count, (candidates, count)  # the deterministic part of verl's pick
        for t in candidates:
            selected[t], value[t], dvalue[t] = True, 0.0, 0.0
    else:
        count = max(1, int(len(valid) * share))
        top = sorted(valid, key=lambda t: -cov[t])[:count]
        assert count == len(valid) or cov[top[-1]] > max(cov[t] for t in valid if t not in top)  # no ties
        for t in range(len(lp)):
            r = math.exp(lr[t])
            inside = abs(lp[t] - old[t]) <= LOG_RATIO_CLAMP  # the clamp stops the gradient beyond +-20
            value[t], dvalue[t] = -adv[t] * r, -adv[t] * r * inside
            if t in top:
                selected[t] = True
                value[t] += coef * abs(lr[t])
                dvalue[t] += coef * ((lr[t] > 0) - (lr[t] < 0)) * inside
    weight = _agg_weights(mask, lengths, agg, max_len)
    loss = math.fsum(v * w for v, w in zip(value, weight))
    frac = math.fsum(float(b) for b in by_origin) / len(valid) if kind == "clip_cov" else None
    return loss, [d * w for d, w in zip(dvalue, weight)], frac, sum(selected) / len(valid)


# ---------------------------------------------------------------- cases
def _case(name, inputs, expected, atol, exact_zero=()):
    return {"name": name, "inputs": inputs, "expected": expected, "atol": atol, "exact_zero": list(exact_zero)}


def build():
    rng = _rng(10)
    files = {}

    rewards = _round([rng.uniform(-1, 2) for _ in range(12)])
    groups = [0] * 4 + [1] * 4 + [2] * 4
    cases = []
    for norm in (True, False):
        cases.append(_case(f"ordinary_normalize_std_{norm}", dict(rewards=rewards, groups=groups, eps=1e-6,
                                                                    normalize_std=norm),
                           {"advantages": grpo(rewards, groups, 1e-6, norm)}, 1e-6))
    r = [0.1] * 6 + [1.0, 0.0, 0.5]
    g = [0] * 6 + [1] * 3
    cases.append(_case("constant_group_of_six_0.1", dict(rewards=r, groups=g, eps=1e-6, normalize_std=True),
                       {"advantages": grpo(r, g, 1e-6, True)}, 1e-6, exact_zero=["advantages[0:6]"]))
    r, g = [3.0, 0.2, 1.0, -1.0], [5, 9, 7, 7]
    cases.append(_case("single_sample_groups_and_non_contiguous_ids", dict(rewards=r, groups=g, eps=1e-6,
                                                                          normalize_std=True),
                       {"advantages": grpo(r, g, 1e-6, True)}, 1e-6, exact_zero=["advantages[0:2]"]))
    files["grpo"] = dict(function="megatron_rl.algorithms.advantages.grpo_advantages",
                         formula="A_i = (r_i - mean_g) / (std_g + eps), std_g unbiased (n-1) (GRPO; verl, slime); "
                                 "Dr.GRPO (normalize_std=False): A_i = r_i - mean_g",
                         convention="a group of size 1 or with all-equal rewards gives exactly 0 (slime gives 0 for "
                                    "size 1 via r - mean; verl keeps r / (1 + eps))",
                         cases=cases)

    cases = [_case("ordinary", dict(rewards=rewards, groups=groups), {"advantages": rloo(rewards, groups)}, 1e-6)]
    r, g = [0.1] * 4 + [2.0, 7.0], [0] * 4 + [1, 2]
    cases.append(_case("constant_group_and_single_samples", dict(rewards=r, groups=g), {"advantages": rloo(r, g)},
                       1e-6, exact_zero=["advantages[0:6]"]))
    files["rloo"] = dict(function="megatron_rl.algorithms.advantages.rloo_advantages",
                         formula="A_i = r_i - mean_{j != i in group} r_j (RLOO; verl)",
                         convention="0 for groups of size 1 or without contrast", cases=cases)

    def rpp_case(name, rewards, lengths, mask, kl, kl_coef, gamma, groups=None, zero=False):
        inputs = dict(rewards=rewards, response_lengths=lengths, loss_mask=mask, kl=kl, kl_coef=kl_coef,
                      gamma=gamma)
        if groups is not None:
            inputs["group_index"] = groups
        exp = reinforce_pp(rewards, lengths, mask, kl, kl_coef, gamma, groups)
        return _case(name, inputs, {"advantages": exp}, 1e-5, exact_zero=["advantages"] if zero else ())

    lengths = [3, 5, 2, 4, 1, 3]
    n = sum(lengths)
    kl = _round([rng.uniform(-0.3, 0.5) for _ in range(n)])
    mask = [1] * n
    multi = [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]  # tool spans in samples 1 and 3
    rew6 = _round([rng.uniform(0, 1) for _ in range(6)])
    cases = [
        rpp_case("ordinary_kl_gamma", rew6, lengths, mask, kl, 0.05, 0.9),
        rpp_case("masked_tool_spans", rew6, lengths, multi, kl, 0.05, 1.0),
        rpp_case("constant_rewards_0.1_six_samples", [0.1] * 6, lengths, mask, [0.0] * n, 0.0, 1.0, zero=True),
        rpp_case("single_loss_token", [2.0], [3], [0, 1, 0], [0.0] * 3, 0.0, 1.0, zero=True),
    ]
    files["reinforce_plus_plus"] = dict(
        function="megatron_rl.algorithms.advantages.reinforce_plus_plus_advantages",
        formula="r_t = -kl_coef * kl_t (loss tokens) + reward on the last loss token; G_t = r_t + gamma * G_{t+1}; "
                "A = (G - mean) / sqrt(var + 1e-8) over the batch's loss tokens, var unbiased (REINFORCE++, slime; "
                "verl masked_whiten)",
        convention="returns run through masked tokens (slime; verl resets at them); a constant batch or one with "
                   "fewer than 2 loss tokens gives exactly 0",
        cases=cases)

    groups6 = [0, 0, 0, 1, 1, 2]
    cases = [
        rpp_case("ordinary", rew6, lengths, mask, [0.0] * n, 0.0, 1.0, groups=groups6),
        rpp_case("masked_tool_spans", rew6, lengths, multi, [0.0] * n, 0.0, 1.0, groups=groups6),
        rpp_case("constant_groups", [0.1, 0.1, 0.1, 0.7, 0.7, 0.3], lengths, mask, [0.0] * n, 0.0, 1.0,
                 groups=groups6, zero=True),
    ]
    files["reinforce_plus_plus_baseline"] = dict(
        function="megatron_rl.algorithms.advantages.reinforce_plus_plus_advantages(group_index=...)",
        formula="reward minus its group mean, broadcast to the loss tokens, whitened over the batch "
                "(REINFORCE++-baseline; verl, slime)",
        convention="single-sample or constant groups give 0 before whitening (slime; verl keeps a single "
                   "sample's raw reward)",
        cases=cases)

    vals = _round([rng.uniform(-1, 1) for _ in range(n)])
    tok_r = [0.0] * n
    ends = [sum(lengths[:i + 1]) - 1 for i in range(len(lengths))]
    for i, e in enumerate(ends):
        tok_r[e] = rew6[i]
    multi_end = list(multi)
    multi_end[ends[1]] = 0  # sample 1 ends in an observation: its reward there is dropped
    cases = []
    for name, m, gamma, lam in (("unmasked", mask, 0.99, 0.95), ("masked_tool_spans", multi, 0.9, 0.8),
                                ("ends_in_a_masked_span", multi_end, 1.0, 1.0),
                                ("fully_masked_sample", [0] * 3 + mask[3:], 0.9, 0.95)):
        adv, ret = gae(tok_r, vals, lengths, m, gamma, lam)
        cases.append(_case(name, dict(token_rewards=tok_r, values=vals, response_lengths=lengths, loss_mask=m,
                                      gamma=gamma, lam=lam), {"advantages": adv, "returns": ret}, 1e-5))
    files["gae"] = dict(function="megatron_rl.algorithms.advantages.gae_advantages",
                        formula="delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, "
                                "returns = A + V, "
                                "'next' = next unmasked token of the sample (verl multi-turn GAE)",
                        convention="masked tokens: advantage and return 0, their rewards dropped (verl)",
                        cases=cases)

    x = _round([rng.uniform(-2, 3) for _ in range(10)])
    m = [1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    cases = [_case("ordinary", dict(x=x, mask=m), {"out": whiten(x, m)}, 1e-9),
             _case("constant", dict(x=[0.1] * 6, mask=[1] * 6), {"out": whiten([0.1] * 6, [1] * 6)}, 0,
                   exact_zero=["out"]),
             _case("one_token", dict(x=[5.0, 1.0], mask=[0, 1]), {"out": [0.0, 0.0]}, 0, exact_zero=["out"])]
    files["normalize_advantages"] = dict(function="megatron_rl.algorithms.advantages.masked_whiten",
                                         formula="(x - mean) / sqrt(var + 1e-8) over loss tokens, var unbiased, "
                                                 "float64 (verl masked_whiten; slime --normalize-advantages)",
                                         convention="constant or < 2 tokens: exactly 0", cases=cases)

    lp = [-1.0, -1.0, -100.0, -0.05, -2.0, -30.0, -0.5]
    ref = [-1.5, -0.7, -1.0, -3.0, -0.1, -1.0, -25.0]
    cases = []
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        vg = [kl_value_and_grad(a, b, kind) for a, b in zip(lp, ref)]
        cases.append(_case(kind, dict(logprobs=lp, ref_logprobs=ref, kind=kind),
                           {"kl": [v for v, _ in vg], "grad": [g for _, g in vg]}, 1e-9))
    files["kl"] = dict(function="megatron_rl.algorithms.losses.kl_estimate",
                       formula="log r = lp - ref; k1 = log r, k2 = (log r)^2 / 2, k3 = low_var_kl = "
                               "exp(-clamp(log r, +-20)) - 1 + clamp(log r, +-20), clamped to [-10, 10] "
                               "(Schulman; verl low_var_kl)",
                       convention="k3 is clamped like low_var_kl (verl: both names; slime clamps only "
                                  "low_var_kl); grads are d/d lp, 0 where a clamp is active",
                       cases=cases)

    lr = [0.1, -0.4, 0.5, -0.5, 1.5, 50.0, -50.0]
    adv = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -2.0]
    cases = [_case("clip_higher_dual_clip_extreme_ratios", dict(log_ratio=lr, advantages=adv, eps_low=0.2,
                                                               eps_high=0.28, dual_clip_c=3.0),
                   {"loss": ppo_clip(lr, adv, 0.2, 0.28, 3.0)}, 1e-9),
             _case("symmetric_no_dual", dict(log_ratio=lr, advantages=adv, eps_low=0.2, eps_high=0.2,
                                             dual_clip_c=None),
                   {"loss": ppo_clip(lr, adv, 0.2, 0.2, None)}, 1e-9)]
    files["ppo_clip"] = dict(function="megatron_rl.algorithms.losses.ppo_clip_per_token",
                             formula="max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), A < 0 capped at -A c "
                                     "(PPO, DAPO clip-higher, dual-clip; verl, slime)",
                             convention="r = exp(clamp(log r, +-20))", cases=cases)

    old = [-1.0, -2.0, -0.5, -3.0, -0.05]
    rollout = [-1.0 - math.log(10.0), -2.0 + 5.0, -0.5 + 0.3, -3.0 + 30.0, -0.05 - 40.0]
    cases = [_case("bounds_and_extremes", dict(old_logprobs=old, rollout_logprobs=rollout, cap=2.0, low=0.5),
                   {"weights": tis(old, rollout, 2.0, 0.5)}, 1e-9),
             _case("no_lower_bound", dict(old_logprobs=old, rollout_logprobs=rollout, cap=2.0, low=0.0),
                   {"weights": tis(old, rollout, 2.0, 0.0)}, 1e-9)]
    files["tis"] = dict(function="megatron_rl.algorithms.losses.tis_weights",
                        formula="w = clamp(exp(old - rollout), tis_clip_low, tis_cap) "
                                "(slime --tis-clip-low/--tis-clip)",
                        convention="old - rollout clamped to <= 20 before exp", cases=cases)

    lengths = [3, 4, 2, 1]
    n = sum(lengths)
    lp = _round([-rng.uniform(0.05, 3) for _ in range(n)])
    old_g = [round(p + rng.uniform(-2e-3, 2e-3), 6) for p in lp]
    mask = [1, 1, 1, 1, 0, 1, 1, 1, 1, 0]  # last sample fully masked
    seq_adv = [0.8, -1.2, 0.4, 2.0]
    cases = [_case("seq_mean_default", dict(logprobs=lp, old_logprobs=old_g, loss_mask=mask, response_lengths=lengths,
                                            seq_advantages=seq_adv, eps_low=3e-4, eps_high=4e-4),
                   {"loss": gspo_loss(lp, old_g, mask, lengths, seq_adv, 3e-4, 4e-4)}, 1e-12)]
    files["gspo"] = dict(function="megatron_rl.algorithms.losses.compute_policy_loss (GSPO, default aggregation)",
                         formula="s_i = exp(mean over loss tokens of (lp - old)); "
                                 "loss = (1/B) sum_i max(-A_i s_i, -A_i clip(s_i, 1 - e_low, 1 + e_high)) "
                                 "(GSPO paper; verl seq-mean-token-mean)",
                         convention="samples without loss tokens add 0 and still count in B", cases=cases)

    # token 6: w = e^0.1, k3 = 9.86 < 10 but w * k3 = 10.9 -> 10 (slime's order); token 7: log ratio -30 -> ppo_kl 20
    lp = [-1.0, -2.0, -0.5, -100.0, -0.3, -1.0, -31.0]
    old = [-1.3, -2.0, -0.1, -100.2, -0.3, -1.1, -1.0]
    ref = [-1.2, -2.5, -0.5, -1.0, -0.9, 1.6, -31.0]
    adv = [1.0, -0.5, -2.0, 0.7, 0.3, 0.4, -0.2]
    mask = [1, 1, 1, 1, 0, 1, 1]
    cases = []
    for kind, unbiased in (("k3", False), ("k3", True), ("k1", True), ("low_var_kl", False),
                           ("low_var_kl", True)):
        loss, ppo_kl, kl_mean = token_mean_policy_loss(lp, old, ref, adv, mask, 0.2, 0.05, kind, unbiased)
        cases.append(_case(f"{kind}_unbiased_{unbiased}", dict(logprobs=lp, old_logprobs=old, ref_logprobs=ref,
                                                               advantages=adv, loss_mask=mask, eps_clip=0.2,
                                                               kl_loss_coef=0.05, kl_loss_type=kind,
                                                               use_unbiased_kl=unbiased),
                           {"loss": loss, "ppo_kl": ppo_kl, "kl": kl_mean}, 1e-9))
    files["policy_loss"] = dict(function="megatron_rl.algorithms.losses.compute_policy_loss (token_mean)",
                                formula="token_mean(pg + kl_loss_coef * kl); with --use-unbiased-kl kl = "
                                        "w * kl_raw, w = exp(lp - old), clamped to [-10, 10] after the product for "
                                        "k3/low_var_kl (slime's compute_approx_kl); train/ppo_kl = mean of "
                                        "-clamp(lp - old, +-20) over loss tokens (verl)",
                                convention="log-prob -100 vs ref -1: k3 clamps to 10, loss stays finite",
                                cases=cases)
    r = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0, 0.0, 0.3, 0.0, 0.0]
    g = [0, 0, 0, 0, 1, 1, 1, 7, 3, 3, 9, 9]  # group 1 constant, 7 single, 9 all zero; ids not contiguous
    cases = [_case("ordinary", dict(rewards=rewards, groups=groups), {"advantages": gpg_adv(rewards, groups)}, 1e-6),
             _case("sparse_rewards_constant_and_single_groups", dict(rewards=r, groups=g),
                   {"advantages": gpg_adv(r, g)}, 1e-6, exact_zero=["advantages[4:8]", "advantages[10:12]"]),
             _case("all_zero", dict(rewards=[0.0] * 4, groups=[0, 0, 1, 1]), {"advantages": [0.0] * 4}, 0,
                   exact_zero=["advantages"])]
    files["gpg"] = dict(function="megatron_rl.algorithms.advantages.gpg_advantages",
                        formula="A_i = alpha * (r_i - mean_g), alpha = B / max(#{r_i != 0}, 1) over the batch "
                                "(GPG; verl compute_gpg_outcome_advantage, f_norm = 1)",
                        convention="a group of size 1 or without contrast gives exactly 0 (verl keeps alpha * r "
                                   "for a single sample)", cases=cases)

    counts = [3, 5, 1, 4, 2, 6, 0, 2, 7]
    r, g = [1.0, 0.0, 1.0, 0.4, 0.4, 0.9, 0.2, 3.0, 1.0], [0, 0, 0, 5, 5, 2, 2, 8, 4]
    cases = [_case("ordinary", dict(rewards=rewards, groups=groups, token_counts=[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]),
                   {"advantages": opo_adv(rewards, groups, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8])}, 1e-6),
             _case("constant_single_and_masked_samples", dict(rewards=r, groups=g, token_counts=counts),
                   {"advantages": opo_adv(r, g, counts)}, 1e-6, exact_zero=["advantages[3:5]", "advantages[7:9]"])]
    files["opo"] = dict(function="megatron_rl.algorithms.advantages.opo_advantages",
                        formula="A_i = r_i - sum_g(l_j r_j) / sum_g(l_j), l_j the loss-token count "
                                "(OPO arXiv 2505.23585; verl compute_opo_outcome_advantage)",
                        convention="a group of size 1, without contrast or without loss tokens gives exactly 0 "
                                   "(verl keeps r for a single sample); a sample with 0 loss tokens still takes "
                                   "its group's baseline", cases=cases)

    # extreme log-ratios +-50 (ratio clamp), ratios on both sides of both clip bounds, A of both signs and 0,
    # masked tool tokens and a fully masked sample
    lengths = [4, 3, 2, 3]
    lr = [0.1, -0.4, 0.5, 50.0, -50.0, 0.05, -0.3, 0.02, 1.5, 0.25, -0.25, 0.0]
    lp = [-0.7, -1.2, -0.4, -0.3, -2.0, -0.9, -1.6, -0.05, -2.5, -0.8, -1.1, -0.6]
    old = [p - x for p, x in zip(lp, lr)]
    adv = [1.0, 1.0, 1.0, 1.0, -0.5, -0.5, -0.5, 0.0, 0.0, 2.0, -1.5, 0.7]
    mask = [1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    cases = []
    for kind, aggs in (("cispo", ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                  "seq_mean_token_sum_norm")),
                       ("gpg", ("token_mean", "seq_mean_token_sum")),
                       ("geo_mean", ("seq_mean_token_mean",)), ("sapo", ("seq_mean_token_mean",))):
        for agg in aggs:
            loss, grad, frac = pg_loss_and_grad(kind, lp, old, adv, mask, lengths, agg, 0.2, 0.28, 1.0, 1.05, 8)
            expected = {"loss": loss, "grad": grad}
            if frac is not None:
                expected["clip_frac"] = frac
            cases.append(_case(f"{kind}_{agg}", dict(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask,
                                                     response_lengths=lengths, policy_loss_type=kind,
                                                     loss_agg_mode=agg, eps_clip=0.2, eps_clip_high=0.28,
                                                     sapo_tau_pos=1.0, sapo_tau_neg=1.05, max_response_length=8),
                               expected, 1e-6))
    loss, grad, _ = pg_loss_and_grad("sapo", lp, old, adv, mask, lengths, "seq_mean_token_mean", 0.2, 0.28, 2.0,
                                     3.0, 8)
    cases.append(_case("sapo_tau_2_3", dict(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask,
                                            response_lengths=lengths, policy_loss_type="sapo",
                                            loss_agg_mode="seq_mean_token_mean", eps_clip=0.2, eps_clip_high=0.28,
                                            sapo_tau_pos=2.0, sapo_tau_neg=3.0, max_response_length=8),
                       {"loss": loss, "grad": grad}, 1e-6))
    for kind, share, lb, ub, agg in (("clip_cov", 0.25, 0.05, 5.0, "token_mean"),
                                     ("clip_cov", 0.25, 0.05, 5.0, "seq_mean_token_mean"),
                                     ("kl_cov", 0.25, 1.0, 5.0, "token_mean"),
                                     ("kl_cov", 0.25, 1.0, 5.0, "seq_mean_token_sum"),
                                     ("kl_cov", 0.05, 1.0, 5.0, "token_mean")):
        # kl_cov has no clip: a loss token at ratio e^20 would be a loss of 5e8, beyond float32's 1e-6; its
        # extremes are a masked +50 (must not leak) and the -50 token
        old_c = old if kind == "clip_cov" else [p - x for p, x in zip(lp, lr[:2] + [50.0, 2.0] + lr[4:])]
        loss, grad, frac, sel = cov_loss_and_grad(kind, lp, old_c, adv, mask, lengths, agg, 0.2, 0.28, share, lb,
                                                  ub, 0.1, 8)
        expected = {"loss": loss, "grad": grad, "cov_selected_frac": sel}
        if frac is not None:
            expected["clip_frac"] = frac
        knobs = (dict(clip_cov_ratio=share, clip_cov_lb=lb, clip_cov_ub=ub) if kind == "clip_cov" else
                 dict(kl_cov_ratio=share, ppo_kl_coef=0.1))
        cases.append(_case(f"{kind}_{share}_{agg}", dict(logprobs=lp, old_logprobs=old_c, advantages=adv,
                                                         loss_mask=mask, response_lengths=lengths,
                                                         policy_loss_type=kind, loss_agg_mode=agg, eps_clip=0.2,
                                                         eps_clip_high=0.28, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                                                         max_response_length=8, **knobs), expected, 1e-6))
    files["policy_loss_types"] = dict(
        function="megatron_rl.algorithms.losses.compute_policy_loss (--policy-loss-type), float32 log-probs",
        formula="r = exp(clamp(lp - old, +-20)). cispo: -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * lp; "
                "gpg: -A * lp; sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg; "
                "geo_mean (GMPO): per sequence -mean(A) exp(mean of sign(A) min(sign(A) lr, sign(A) clamp(lr, "
                "-eps_low, eps_high))), mean over sequences; clip_cov / kl_cov: cov_loss_and_grad in "
                "make_vectors.py (one micro-batch); then verl's agg_loss (verl core_algos "
                "compute_policy_loss_cispo / _gpg / _sapo / _geo_mean / _clip_cov / _kl_cov); grad = d loss / d lp",
        convention="B (every seq_mean mode) counts every sample, the fully masked one too (verl's agg_loss "
                   "without global_batch_size counts only samples with loss tokens); geo_mean's log-ratio is "
                   "clamped to +-20 like the others (verl leaves that clamp commented out); the clip_cov cases "
                   "have no more candidates than it may drop, so verl's random pick is the whole set",
        cases=cases)
    return files


def main():
    for name, content in build().items():
        (HERE / f"{name}.json").write_text(json.dumps(content, indent=1) + "\n")
        print(f"wrote {HERE / name}.json ({len(content['cases'])} cases)")


if __name__ == "__main__":
    main()
