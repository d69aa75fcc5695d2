// CPU twin of csrc/cuda/logprob_cuda.cu: the same per-row maths (csrc/common/fused_math.h),
// rows spread over threads with at::parallel_for. Each row is read in blocks of kBlock
// elements: the block max first, then the block's exponentials summed in kLanes short
// accumulators while it is still in cache and merged into the row's running partial -- the CPU
// form of the CUDA kernel's per-thread partials merged by a tree reduction. Nothing
// [N, V]-sized is allocated besides grad_out.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "../common/fused_math.h"
#include "../ops.h"

namespace mrl {
namespace cpu {
namespace {

constexpr int64_t kBlock = 2048;
constexpr int kLanes = 8;  // independent accumulators per block: fp32 sums stay short (accuracy) and vectorisable

template <typename scalar_t>
Partial row_partial(const scalar_t* x, int64_t V, float inv_t) {
  Partial p = empty_partial();
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(b0 + kBlock, V);
    float bm = -INFINITY;
    for (int64_t j = b0; j < b1; ++j) bm = std::max(bm, static_cast<float>(x[j]) * inv_t);
    if (bm == -INFINITY) continue;
    Partial lane[kLanes];
    for (int k = 0; k < kLanes; ++k) lane[k] = Partial{bm, 0.0f, 0.0f};
    int64_t j = b0;
    for (; j + kLanes <= b1; j += kLanes)
      for (int k = 0; k < kLanes; ++k) accumulate(lane[k], static_cast<float>(x[j + k]) * inv_t);
    for (; j < b1; ++j) accumulate(lane[0], static_cast<float>(x[j]) * inv_t);
    Partial block{bm, 0.0f, 0.0f};
    for (int k = 0; k < kLanes; ++k) {
      block.s += lane[k].s;
      block.w += lane[k].w;
    }
    p = merge_partial(p, block);
  }
  return p;
}

}  // namespace

void logprob_fwd_partials(MRL_LOGPROB_FWD_ARGS) {
  const int64_t N = logits.size(0), V = logits.size(1);
  const float inv_t = static_cast<float>(inv_temperature);
  const int64_t* tgt = target_local.data_ptr<int64_t>();
  float *m = m_out.data_ptr<float>(), *s = s_out.data_ptr<float>(), *w = w_out.data_ptr<float>(),
        *tz = tz_out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_fwd_partials_cpu", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = x + r * V;
        const Partial p = row_partial(row, V, inv_t);
        m[r] = p.m;
        s[r] = p.s;
        w[r] = p.w;
        const int64_t t = tgt[r];
        tz[r] = (t >= 0 && t < V) ? static_cast<float>(row[t]) * inv_t : 0.0f;
      }
    });
  });
}

void logprob_bwd(MRL_LOGPROB_BWD_ARGS) {
  const int64_t N = logits.size(0), V = logits.size(1);
  const float inv_t = static_cast<float>(inv_temperature);
  const bool with_h = g_h.has_value();
  const int64_t* tgt = target_local.data_ptr<int64_t>();
  const float* lse_p = lse.data_ptr<float>();
  const float* glp = g_lp.data_ptr<float>();
  const float* gh = with_h ? g_h->data_ptr<float>() : nullptr;
  const float* ent = with_h ? entropy->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_bwd_cpu", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    scalar_t* g = grad_out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = x + r * V;
        scalar_t* grow = g + r * V;
        const float l = lse_p[r], a = glp[r], h = with_h ? ent[r] : 0.0f, b = with_h ? gh[r] : 0.0f;
        const int64_t t = tgt[r];
        for (int64_t j = 0; j < V; ++j) {
          float v = logprob_grad(static_cast<float>(row[j]) * inv_t, l, h, a, b, with_h);
          if (j == t) v += a;
          grow[j] = static_cast<scalar_t>(v * inv_t);
        }
      }
    });
  });
}

}  // namespace cpu
}  // namespace mrl
