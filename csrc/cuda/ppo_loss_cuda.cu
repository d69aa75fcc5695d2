// Fused per-token PPO/GRPO terms (CUDA): one elementwise pass applying csrc/common/fused_math.h's
// ppo_forward / ppo_backward (the CPU twin, csrc/cpu/ppo_loss_cpu.cpp, applies the same functions).
// Tensors are [T] (tokens of a micro-batch), so a grid-stride loop over tokens is all it needs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../common/fused_math.h"
#include "../ops.h"

namespace mrl {
namespace cuda {
namespace {

constexpr int kThreads = 256;

PpoParams make_params(MRL_PPO_PARAMS) {
  return PpoParams{do_ppo, static_cast<float>(clip_lo), static_cast<float>(clip_hi), has_dual,
                   static_cast<float>(dual_c), static_cast<int>(kl_type), unbiased_kl, do_tis,
                   static_cast<float>(tis_cap), static_cast<float>(tis_low)};
}

template <typename T>
T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

template <typename scalar_t>
__global__ void ppo_fwd_kernel(int64_t n, const scalar_t* __restrict__ lp, const scalar_t* __restrict__ old,
                               const scalar_t* __restrict__ adv, const scalar_t* __restrict__ ref,
                               const scalar_t* __restrict__ roll, PpoParams P, scalar_t* __restrict__ ratio,
                               scalar_t* __restrict__ pg, bool* __restrict__ clipped, bool* __restrict__ dual,
                               scalar_t* __restrict__ kl, scalar_t* __restrict__ tis_w, bool* __restrict__ capped,
                               bool* __restrict__ floored) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const PpoOut o = ppo_forward(static_cast<float>(lp[i]), static_cast<float>(old[i]), static_cast<float>(adv[i]),
                                 ref ? static_cast<float>(ref[i]) : 0.0f, roll ? static_cast<float>(roll[i]) : 0.0f, P);
    ratio[i] = static_cast<scalar_t>(o.ratio);
    if (pg) pg[i] = static_cast<scalar_t>(o.pg);
    if (clipped) clipped[i] = o.clipped;
    if (dual) dual[i] = o.dual;
    if (kl) kl[i] = static_cast<scalar_t>(o.kl);
    if (tis_w) tis_w[i] = static_cast<scalar_t>(o.tis_w);
    if (capped) capped[i] = o.tis_capped;
    if (floored) floored[i] = o.tis_floored;
  }
}

template <typename scalar_t>
__global__ void ppo_bwd_kernel(int64_t n, scalar_t* __restrict__ grad, const scalar_t* __restrict__ lp,
                               const scalar_t* __restrict__ old, const scalar_t* __restrict__ adv,
                               const scalar_t* __restrict__ ref, const scalar_t* __restrict__ g_pg,
                               const scalar_t* __restrict__ g_kl, PpoParams P) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    grad[i] = static_cast<scalar_t>(ppo_backward(
        static_cast<float>(lp[i]), static_cast<float>(old[i]), static_cast<float>(adv[i]),
        ref ? static_cast<float>(ref[i]) : 0.0f, g_pg ? static_cast<float>(g_pg[i]) : 0.0f,
        g_kl ? static_cast<float>(g_kl[i]) : 0.0f, P));
  }
}

}  // namespace

void ppo_fwd(MRL_PPO_FWD_ARGS) {
  const int64_t n = logprobs.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const PpoParams P = make_params(do_ppo, clip_lo, clip_hi, has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap,
                                  tis_low);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprobs.scalar_type(), "ppo_fwd_cuda", [&] {
    ppo_fwd_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        n, logprobs.data_ptr<scalar_t>(), old_logprobs.data_ptr<scalar_t>(), advantages.data_ptr<scalar_t>(),
        ptr_or_null<scalar_t>(ref_logprobs), ptr_or_null<scalar_t>(rollout_logprobs), P,
        ratio_out.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(pg_out), ptr_or_null<bool>(clipped_out),
        ptr_or_null<bool>(dual_out), ptr_or_null<scalar_t>(kl_out), ptr_or_null<scalar_t>(tis_w_out),
        ptr_or_null<bool>(tis_capped_out), ptr_or_null<bool>(tis_floored_out));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void ppo_bwd(MRL_PPO_BWD_ARGS) {
  const int64_t n = logprobs.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const PpoParams P = make_params(do_ppo, clip_lo, clip_hi, has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap,
                                  tis_low);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprobs.scalar_type(), "ppo_bwd_cuda", [&] {
    ppo_bwd_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        n, grad_out.data_ptr<scalar_t>(), logprobs.data_ptr<scalar_t>(), old_logprobs.data_ptr<scalar_t>(),
        advantages.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(ref_logprobs), ptr_or_null<scalar_t>(g_pg),
        ptr_or_null<scalar_t>(g_kl), P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace mrl
