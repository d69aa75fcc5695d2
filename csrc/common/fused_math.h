// Per-element maths shared by the CPU twins (csrc/cpu) and the CUDA kernels (csrc/cuda).
//
// Why one header: the twins exist so the numerics of the CUDA kernels are tested
// on machines without a GPU. Keeping every formula here (host+device inline
// functions) means the CPU and CUDA files differ only in how they walk memory and
// reduce, never in the maths. All arithmetic is float32.
//
// Conventions (match megatron_rl/ops/logprob.py and megatron_rl/ops/policy_loss.py):
// * log-prob partials of one row over this rank's vocab shard, with z = logit / T:
//     m = max z,  s = sum exp(z - m),  w = sum exp(z - m) * (z - m)
//   -inf logits contribute nothing (no 0 * -inf NaN); a row with no finite logit
//   has m = -inf, s = w = 0. Partials of two shards (or two blocks of one row)
//   merge exactly with merge_partial; the entropy of the merged row is
//   log s - w / s.
// * gradients reproduce torch autograd's conventions at the edges: clamp passes
//   the gradient on the closed interval, maximum splits it in half on ties.
#pragma once

#include <cmath>
#include <cfloat>

#if defined(__CUDACC__)
#define MRL_HD __host__ __device__ __forceinline__
#else
#define MRL_HD inline
#endif

namespace mrl {

constexpr float kLogRatioClamp = 20.0f;  // exp(20) ~ 5e8 (losses.py _LOG_RATIO_CLAMP)
constexpr float kKlClamp = 10.0f;        // low_var_kl bound (losses.py _KL_CLAMP)
constexpr float kF32Min = -FLT_MAX;      // torch.finfo(float32).min: the clamp of log p

enum KlType : int { kKlNone = 0, kKlK1 = 1, kKlK2 = 2, kKlK3 = 3 };

struct Partial {
  float m, s, w;
};

MRL_HD Partial empty_partial() { return Partial{-INFINITY, 0.0f, 0.0f}; }

// Rescale (m, s, w) to a new reference max `to` (to >= p.m).
MRL_HD Partial rebase(Partial p, float to) {
  if (!(p.s > 0.0f)) return Partial{to, 0.0f, 0.0f};
  const float d = p.m - to;
  const float a = expf(d);
  return Partial{to, p.s * a, a * (p.w + d * p.s)};
}

MRL_HD Partial merge_partial(Partial a, Partial b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return empty_partial();
  const Partial ra = rebase(a, m), rb = rebase(b, m);
  return Partial{m, ra.s + rb.s, ra.w + rb.w};
}

// Accumulate one scaled logit z into a partial whose reference max is already >= z.
MRL_HD void accumulate(Partial& p, float z) {
  if (z == -INFINITY) return;
  const float d = z - p.m;
  const float e = expf(d);
  p.s += e;
  p.w += e * d;
}

// d(g_lp * logp_target + g_h * H) / dz_j for one vocab entry; the caller adds g_lp on the
// target column and multiplies by 1/T. logp = max(z - lse, F32_MIN) as the torch path.
MRL_HD float logprob_grad(float z, float lse, float entropy, float g_lp, float g_h, bool with_entropy) {
  float logp = z - lse;
  logp = logp < kF32Min ? kF32Min : logp;
  const float p = expf(logp);
  float g = p * (-g_lp);
  if (with_entropy) g += (logp + entropy) * p * (-g_h);
  return g;
}

MRL_HD float clampf(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
MRL_HD float pass_grad(float x, float lo, float hi) { return (x >= lo && x <= hi) ? 1.0f : 0.0f; }

struct PpoParams {
  int do_ppo;        // compute the clipped surrogate (PPO token-level path)
  float clip_lo;     // 1 - eps_low
  float clip_hi;     // 1 + eps_high
  int has_dual;      // dual-clip PPO
  float dual_c;
  int kl_type;       // KlType; kKlNone: no KL
  int unbiased_kl;   // KL times exp(clamp(logp - old))
  int do_tis;        // truncated importance weight from rollout log-probs
  float tis_cap, tis_low;
};

struct PpoOut {
  float pg, ratio, kl, tis_w;
  bool clipped, dual, tis_capped, tis_floored;
};

// Forward of one token. lp: new log-prob, old: old log-prob, adv: advantage,
// ref: reference log-prob (when kl_type), roll: rollout log-prob (when do_tis).
MRL_HD PpoOut ppo_forward(float lp, float old, float adv, float ref, float roll, const PpoParams& P) {
  PpoOut o{0.0f, 0.0f, 0.0f, 1.0f, false, false, false, false};
  const float lr = lp - old;
  const float ratio = expf(clampf(lr, -kLogRatioClamp, kLogRatioClamp));
  o.ratio = ratio;
  if (P.do_ppo) {
    const float unclipped = -adv * ratio;
    const float clipped_loss = -adv * clampf(ratio, P.clip_lo, P.clip_hi);
    float loss = fmaxf(unclipped, clipped_loss);
    o.clipped = clipped_loss > unclipped;
    if (P.has_dual) {
      const float cap = -adv * P.dual_c;
      o.dual = (adv < 0.0f) && (loss > cap);
      if (o.dual) loss = cap;
    }
    o.pg = loss;
  }
  if (P.kl_type != kKlNone) {
    const float log_r = lp - ref;
    float kl;
    if (P.kl_type == kKlK1) {
      kl = log_r;
    } else if (P.kl_type == kKlK2) {
      kl = 0.5f * (log_r * log_r);
    } else {
      const float c = clampf(log_r, -kLogRatioClamp, kLogRatioClamp);
      kl = (expf(-c) - 1.0f) + c;
    }
    if (P.unbiased_kl) kl = ratio * kl;  // slime: the low-variance bound clamps the weighted product
    o.kl = P.kl_type == kKlK3 ? clampf(kl, -kKlClamp, kKlClamp) : kl;
  }
  if (P.do_tis) {
    float d = old - roll;
    d = d > kLogRatioClamp ? kLogRatioClamp : d;
    const float raw = expf(d);
    o.tis_w = fminf(fmaxf(raw, P.tis_low), P.tis_cap);
    o.tis_capped = raw > P.tis_cap;
    o.tis_floored = raw < P.tis_low;
  }
  return o;
}

// d(g_pg * pg + g_kl * kl) / d lp (old, adv, ref are constants).
MRL_HD float ppo_backward(float lp, float old, float adv, float ref, float g_pg, float g_kl, const PpoParams& P) {
  const float lr = lp - old;
  const float lr_gate = pass_grad(lr, -kLogRatioClamp, kLogRatioClamp);
  const float ratio = expf(clampf(lr, -kLogRatioClamp, kLogRatioClamp));
  float g_lr = 0.0f;  // gradient reaching lr = lp - old
  float g_lp = 0.0f;  // gradient reaching lp directly (through the KL's log_r)
  if (P.do_ppo && g_pg != 0.0f) {
    const float unclipped = -adv * ratio;
    const float clipped_loss = -adv * clampf(ratio, P.clip_lo, P.clip_hi);
    const float loss = fmaxf(unclipped, clipped_loss);
    bool dual = false;
    if (P.has_dual) dual = (adv < 0.0f) && (loss > -adv * P.dual_c);
    if (!dual) {
      const float w_unc = unclipped > clipped_loss ? 1.0f : (unclipped == clipped_loss ? 0.5f : 0.0f);
      const float w_clp = (1.0f - w_unc) * pass_grad(ratio, P.clip_lo, P.clip_hi);
      const float g_ratio = g_pg * w_unc * (-adv) + g_pg * w_clp * (-adv);
      g_lr += g_ratio * ratio;
    }
  }
  if (P.kl_type != kKlNone && g_kl != 0.0f) {
    const float log_r = lp - ref;
    float kl, dkl;
    if (P.kl_type == kKlK1) {
      kl = log_r;
      dkl = 1.0f;
    } else if (P.kl_type == kKlK2) {
      kl = 0.5f * (log_r * log_r);
      dkl = log_r;
    } else {
      const float c = clampf(log_r, -kLogRatioClamp, kLogRatioClamp);
      const float e = expf(-c);
      kl = (e - 1.0f) + c;
      dkl = pass_grad(log_r, -kLogRatioClamp, kLogRatioClamp) * (1.0f - e);
    }
    const bool bounded = P.kl_type == kKlK3;  // the final clamp gates the whole gradient
    if (P.unbiased_kl) {
      const float gate = bounded ? pass_grad(ratio * kl, -kKlClamp, kKlClamp) : 1.0f;
      g_lp += g_kl * gate * ratio * dkl;
      g_lr += g_kl * gate * kl * ratio;
    } else {
      g_lp += g_kl * (bounded ? pass_grad(kl, -kKlClamp, kKlClamp) : 1.0f) * dkl;
    }
  }
  return g_lp + g_lr * lr_gate;
}

}  // namespace mrl
