// Declarations of the fused kernels. Each exists as a CPU twin (csrc/cpu, namespace
// mrl::cpu) and, in the CUDA build, as a CUDA kernel (csrc/cuda, namespace mrl::cuda)
// with the same signature; csrc/bindings.cpp picks one by the tensors' device.
//
// Every function writes into caller-allocated outputs (the *_out arguments) and
// writes every element of them: the Python side allocates with torch.empty and the
// tests poison those buffers to prove it.
#pragma once

#include <ATen/core/Tensor.h>  // not ATen.h: a lighter include keeps the CPU twins' JIT build short
#include <c10/util/Optional.h>

namespace mrl {

// Log-prob/entropy partials of each row of this rank's logits shard, z = logits * inv_temperature.
//   logits [N, V] bf16/fp16/fp32/fp64, row-contiguous; target_local [N] int64: the target's column in this
//   shard or -1 when another rank owns it.
//   Outputs (float32 [N]): m = max z; s = sum exp(z - m); w = sum exp(z - m) (z - m); tz = z[target] (0 when
//   not owned). Python combines them over the TP group (megatron_rl/ops/fused.py).
#define MRL_LOGPROB_FWD_ARGS                                                                           \
  const at::Tensor &logits, const at::Tensor &target_local, double inv_temperature, at::Tensor &m_out, \
      at::Tensor &s_out, at::Tensor &w_out, at::Tensor &tz_out

// grad_out [N, V] (logits' dtype) = d(sum g_lp * logprob + g_h * entropy) / d logits, recomputing the softmax
// from the saved global lse = logsumexp(z) (and entropy when g_h is given).
#define MRL_LOGPROB_BWD_ARGS                                                                              \
  at::Tensor &grad_out, const at::Tensor &logits, const at::Tensor &target_local, const at::Tensor &lse, \
      const c10::optional<at::Tensor> &entropy, const at::Tensor &g_lp, const c10::optional<at::Tensor> &g_h, \
      double inv_temperature

// PPO/GRPO per-token terms (see fused_math.h ppo_forward). Inputs [T], one floating dtype. Outputs [T]:
// ratio, and when enabled pg (clipped surrogate), clipped / dual (bool), kl, tis_w + tis_capped / tis_floored.
#define MRL_PPO_PARAMS                                                                                     \
  bool do_ppo, double clip_lo, double clip_hi, bool has_dual, double dual_c, int64_t kl_type, bool unbiased_kl, \
      bool do_tis, double tis_cap, double tis_low

#define MRL_PPO_FWD_ARGS                                                                                     \
  const at::Tensor &logprobs, const at::Tensor &old_logprobs, const at::Tensor &advantages,                \
      const c10::optional<at::Tensor> &ref_logprobs, const c10::optional<at::Tensor> &rollout_logprobs,     \
      MRL_PPO_PARAMS, at::Tensor &ratio_out, const c10::optional<at::Tensor> &pg_out,                          \
      const c10::optional<at::Tensor> &clipped_out, const c10::optional<at::Tensor> &dual_out,                 \
      const c10::optional<at::Tensor> &kl_out, const c10::optional<at::Tensor> &tis_w_out,                     \
      const c10::optional<at::Tensor> &tis_capped_out, const c10::optional<at::Tensor> &tis_floored_out

// grad_out [T] (logprobs' dtype) = d(sum g_pg * pg + g_kl * kl) / d logprobs.
#define MRL_PPO_BWD_ARGS                                                                                    \
  at::Tensor &grad_out, const at::Tensor &logprobs, const at::Tensor &old_logprobs,                        \
      const at::Tensor &advantages, const c10::optional<at::Tensor> &ref_logprobs,                         \
      const c10::optional<at::Tensor> &g_pg, const c10::optional<at::Tensor> &g_kl, MRL_PPO_PARAMS

namespace cpu {
void logprob_fwd_partials(MRL_LOGPROB_FWD_ARGS);
void logprob_bwd(MRL_LOGPROB_BWD_ARGS);
void ppo_fwd(MRL_PPO_FWD_ARGS);
void ppo_bwd(MRL_PPO_BWD_ARGS);
}  // namespace cpu

#ifdef MRL_WITH_CUDA
namespace cuda {
void logprob_fwd_partials(MRL_LOGPROB_FWD_ARGS);
void logprob_bwd(MRL_LOGPROB_BWD_ARGS);
void ppo_fwd(MRL_PPO_FWD_ARGS);
void ppo_bwd(MRL_PPO_BWD_ARGS);
}  // namespace cuda
#endif

// Shape/dtype/device checks shared by both implementations (csrc/checks.cpp); they raise c10::Error
// (RuntimeError in Python) naming the argument.
void check_logprob_fwd(MRL_LOGPROB_FWD_ARGS);
void check_logprob_bwd(MRL_LOGPROB_BWD_ARGS);
void check_ppo_fwd(MRL_PPO_FWD_ARGS);
void check_ppo_bwd(MRL_PPO_BWD_ARGS);

}  // namespace mrl
