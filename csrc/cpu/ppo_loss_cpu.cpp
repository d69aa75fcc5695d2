// CPU twin of csrc/cuda/ppo_loss_cuda.cu: one loop over tokens applying
// fused_math.h's ppo_forward / ppo_backward, all in float32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "../common/fused_math.h"
#include "../ops.h"

namespace mrl {
namespace cpu {
namespace {

constexpr int64_t kGrain = 4096;

PpoParams make_params(MRL_PPO_PARAMS) {
  return PpoParams{do_ppo, static_cast<float>(clip_lo), static_cast<float>(clip_hi), has_dual,
                   static_cast<float>(dual_c), static_cast<int>(kl_type), unbiased_kl, do_tis,
                   static_cast<float>(tis_cap), static_cast<float>(tis_low)};
}

template <typename T>
T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

}  // namespace

void ppo_fwd(MRL_PPO_FWD_ARGS) {
  const int64_t n = logprobs.numel();
  const PpoParams P = make_params(do_ppo, clip_lo, clip_hi, has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap,
                                  tis_low);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprobs.scalar_type(), "ppo_fwd_cpu", [&] {
    const scalar_t *lp = logprobs.data_ptr<scalar_t>(), *old = old_logprobs.data_ptr<scalar_t>(),
                   *adv = advantages.data_ptr<scalar_t>();
    const scalar_t *ref = ptr_or_null<scalar_t>(ref_logprobs), *roll = ptr_or_null<scalar_t>(rollout_logprobs);
    scalar_t *ratio = ratio_out.data_ptr<scalar_t>(), *pg = ptr_or_null<scalar_t>(pg_out),
             *kl = ptr_or_null<scalar_t>(kl_out), *tw = ptr_or_null<scalar_t>(tis_w_out);
    bool *clipped = ptr_or_null<bool>(clipped_out), *dual = ptr_or_null<bool>(dual_out),
         *capped = ptr_or_null<bool>(tis_capped_out), *floored = ptr_or_null<bool>(tis_floored_out);
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const PpoOut o = ppo_forward(static_cast<float>(lp[i]), static_cast<float>(old[i]),
                                     static_cast<float>(adv[i]), ref ? static_cast<float>(ref[i]) : 0.0f,
                                     roll ? static_cast<float>(roll[i]) : 0.0f, P);
        ratio[i] = static_cast<scalar_t>(o.ratio);
        if (pg) pg[i] = static_cast<scalar_t>(o.pg);
        if (clipped) clipped[i] = o.clipped;
        if (dual) dual[i] = o.dual;
        if (kl) kl[i] = static_cast<scalar_t>(o.kl);
        if (tw) tw[i] = static_cast<scalar_t>(o.tis_w);
        if (capped) capped[i] = o.tis_capped;
        if (floored) floored[i] = o.tis_floored;
      }
    });
  });
}

void ppo_bwd(MRL_PPO_BWD_ARGS) {
  const int64_t n = logprobs.numel();
  const PpoParams P = make_params(do_ppo, clip_lo, clip_hi, has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap,
                                  tis_low);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprobs.scalar_type(), "ppo_bwd_cpu", [&] {
    const scalar_t *lp = logprobs.data_ptr<scalar_t>(), *old = old_logprobs.data_ptr<scalar_t>(),
                   *adv = advantages.data_ptr<scalar_t>(), *ref = ptr_or_null<scalar_t>(ref_logprobs);
    const scalar_t *gpg = ptr_or_null<scalar_t>(g_pg), *gkl = ptr_or_null<scalar_t>(g_kl);
    scalar_t* g = grad_out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float v = ppo_backward(static_cast<float>(lp[i]), static_cast<float>(old[i]),
                                     static_cast<float>(adv[i]), ref ? static_cast<float>(ref[i]) : 0.0f,
                                     gpg ? static_cast<float>(gpg[i]) : 0.0f, gkl ? static_cast<float>(gkl[i]) : 0.0f,
                                     P);
        g[i] = static_cast<scalar_t>(v);
      }
    });
  });
}

}  // namespace cpu
}  // namespace mrl
