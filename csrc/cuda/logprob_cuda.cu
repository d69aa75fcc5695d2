// Fused log-prob / entropy over this rank's vocab shard (CUDA). CPU twin: csrc/cpu/logprob_cpu.cpp;
// the per-element maths is shared in csrc/common/fused_math.h.
//
// Forward: one block per token row. Each thread streams its strided part of the row with 16-byte
// vector loads (when the row is 16-byte aligned), keeping an online (max, sum exp, sum exp*z) partial
// in registers; the partials merge exactly through warp shuffles and one shared-memory step. The row
// is read once and nothing but four floats per row is written.
// Backward: a 2-D grid (row, slice of the row) recomputes p = exp(z - lse) from the saved global
// logsumexp and writes the gradient directly in the logits' dtype -- the softmax is never stored.
// Only c10/cuda headers are used (the CI toolkit has no cuBLAS headers, which ATen/cuda pulls in).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/fused_math.h"
#include "../ops.h"

namespace mrl {
namespace cuda {
namespace {

constexpr int kFwdThreads = 512;
constexpr int kBwdThreads = 256;
constexpr int kBwdVecsPerThread = 4;  // each backward block covers kBwdThreads * VEC * 4 columns

template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Vec {
  scalar_t v[VEC];
};

__device__ __forceinline__ Partial warp_merge(Partial p) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    Partial o{__shfl_xor_sync(0xffffffffu, p.m, off), __shfl_xor_sync(0xffffffffu, p.s, off),
              __shfl_xor_sync(0xffffffffu, p.w, off)};
    p = merge_partial(p, o);
  }
  return p;
}

__device__ __forceinline__ void online_add(Partial& p, float z) {
  if (z > p.m) p = rebase(p, z);
  accumulate(p, z);
}

template <typename scalar_t, int VEC>
__global__ void logprob_fwd_kernel(const scalar_t* __restrict__ logits, const int64_t* __restrict__ target_local,
                                   int64_t V, float inv_t, float* __restrict__ m_out, float* __restrict__ s_out,
                                   float* __restrict__ w_out, float* __restrict__ tz_out) {
  const int64_t row = blockIdx.x;
  const scalar_t* x = logits + row * V;
  Partial p = empty_partial();
  const int64_t n_vec = V / VEC;
  const auto* xv = reinterpret_cast<const Vec<scalar_t, VEC>*>(x);
  for (int64_t i = threadIdx.x; i < n_vec; i += blockDim.x) {
    const Vec<scalar_t, VEC> chunk = xv[i];
#pragma unroll
    for (int k = 0; k < VEC; ++k) online_add(p, static_cast<float>(chunk.v[k]) * inv_t);
  }
  for (int64_t j = n_vec * VEC + threadIdx.x; j < V; j += blockDim.x) online_add(p, static_cast<float>(x[j]) * inv_t);

  p = warp_merge(p);
  __shared__ Partial warp_partials[kFwdThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    p = lane < n_warps ? warp_partials[lane] : empty_partial();
    p = warp_merge(p);
    if (lane == 0) {
      m_out[row] = p.m;
      s_out[row] = p.s;
      w_out[row] = p.w;
      const int64_t t = target_local[row];
      tz_out[row] = (t >= 0 && t < V) ? static_cast<float>(x[t]) * inv_t : 0.0f;
    }
  }
}

template <typename scalar_t, int VEC>
__global__ void logprob_bwd_kernel(scalar_t* __restrict__ grad, const scalar_t* __restrict__ logits,
                                   const int64_t* __restrict__ target_local, const float* __restrict__ lse,
                                   const float* __restrict__ entropy, const float* __restrict__ g_lp,
                                   const float* __restrict__ g_h, int64_t V, float inv_t) {
  const int64_t row = blockIdx.x;
  const bool with_h = g_h != nullptr;
  const float l = lse[row], a = g_lp[row], h = with_h ? entropy[row] : 0.0f, b = with_h ? g_h[row] : 0.0f;
  const int64_t t = target_local[row];
  const scalar_t* x = logits + row * V;
  scalar_t* g = grad + row * V;
  const int64_t span = static_cast<int64_t>(kBwdThreads) * VEC * kBwdVecsPerThread;
  const int64_t begin = blockIdx.y * span, end = begin + span < V ? begin + span : V;
  const auto* xv = reinterpret_cast<const Vec<scalar_t, VEC>*>(x);  // VEC > 1 only when V % VEC == 0
  auto* gv = reinterpret_cast<Vec<scalar_t, VEC>*>(g);
  for (int64_t i = begin / VEC + threadIdx.x; i < end / VEC; i += blockDim.x) {
    const Vec<scalar_t, VEC> in = xv[i];
    Vec<scalar_t, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float v = logprob_grad(static_cast<float>(in.v[k]) * inv_t, l, h, a, b, with_h);
      if (i * VEC + k == t) v += a;
      out.v[k] = static_cast<scalar_t>(v * inv_t);
    }
    gv[i] = out;
  }
}

// 16-byte vectors when every row starts 16-byte aligned, else scalar loads.
template <typename scalar_t>
int vec_width(const at::Tensor& logits, int64_t V) {
  constexpr int vec = 16 / sizeof(scalar_t);
  const bool aligned = reinterpret_cast<uintptr_t>(logits.data_ptr()) % 16 == 0 && (V * sizeof(scalar_t)) % 16 == 0;
  return aligned ? vec : 1;
}

}  // namespace

void logprob_fwd_partials(MRL_LOGPROB_FWD_ARGS) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const float inv_t = static_cast<float>(inv_temperature);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_fwd_partials_cuda", [&] {
    constexpr int VEC = 16 / sizeof(scalar_t);
    const dim3 grid(static_cast<unsigned>(N));
    auto launch = [&](auto kernel) {
      kernel<<<grid, kFwdThreads, 0, stream>>>(logits.data_ptr<scalar_t>(), target_local.data_ptr<int64_t>(), V,
                                               inv_t, m_out.data_ptr<float>(), s_out.data_ptr<float>(),
                                               w_out.data_ptr<float>(), tz_out.data_ptr<float>());
    };
    if (vec_width<scalar_t>(logits, V) == VEC) {
      launch(logprob_fwd_kernel<scalar_t, VEC>);
    } else {
      launch(logprob_fwd_kernel<scalar_t, 1>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void logprob_bwd(MRL_LOGPROB_BWD_ARGS) {
  const int64_t N = logits.size(0), V = logits.size(1);
  if (N == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const float inv_t = static_cast<float>(inv_temperature);
  const float* ent = g_h.has_value() ? entropy->data_ptr<float>() : nullptr;
  const float* gh = g_h.has_value() ? g_h->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_bwd_cuda", [&] {
    constexpr int VEC = 16 / sizeof(scalar_t);
    const bool vec = vec_width<scalar_t>(logits, V) == VEC &&
                     reinterpret_cast<uintptr_t>(grad_out.data_ptr()) % 16 == 0;
    const int64_t span = static_cast<int64_t>(kBwdThreads) * (vec ? VEC : 1) * kBwdVecsPerThread;
    const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((V + span - 1) / span));
    if (vec) {
      logprob_bwd_kernel<scalar_t, VEC><<<grid, kBwdThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), logits.data_ptr<scalar_t>(), target_local.data_ptr<int64_t>(),
          lse.data_ptr<float>(), ent, g_lp.data_ptr<float>(), gh, V, inv_t);
    } else {
      logprob_bwd_kernel<scalar_t, 1><<<grid, kBwdThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), logits.data_ptr<scalar_t>(), target_local.data_ptr<int64_t>(),
          lse.data_ptr<float>(), ent, g_lp.data_ptr<float>(), gh, V, inv_t);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace mrl
