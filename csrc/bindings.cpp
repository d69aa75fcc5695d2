// Python binding shared by the two builds of the fused kernels:
//   megatron_rl._C_cpu : CPU twins only (cpp_extension JIT or MEGATRON_RL_BUILD_EXT=cpu)
//   megatron_rl._C     : CPU twins + CUDA kernels (-DMRL_WITH_CUDA; MEGATRON_RL_BUILD_EXT=cuda|auto)
// Each entry point checks its arguments once, then runs the implementation of the tensors' device.
#include <torch/extension.h>

#include "ops.h"

namespace mrl {
namespace {

#define MRL_CHECK(cond, ...) TORCH_CHECK(cond, "megatron_rl fused kernel: ", __VA_ARGS__)

void same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  MRL_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but the inputs are on ", ref.device());
}

void vec(const at::Tensor& t, int64_t n, const char* name, const at::Tensor& ref) {
  MRL_CHECK(t.dim() == 1 && t.size(0) == n, name, " must have shape [", n, "], got ", t.sizes());
  MRL_CHECK(t.is_contiguous(), name, " must be contiguous");
  same_device(ref, t, name);
}

void vec_f32(const at::Tensor& t, int64_t n, const char* name, const at::Tensor& ref) {
  vec(t, n, name, ref);
  MRL_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
}

void opt_vec(const c10::optional<at::Tensor>& t, int64_t n, const char* name, const at::Tensor& ref,
             c10::optional<at::ScalarType> dtype) {
  if (!t.has_value()) return;
  vec(*t, n, name, ref);
  if (dtype) MRL_CHECK(t->scalar_type() == *dtype, name, " must be ", *dtype, ", got ", t->scalar_type());
}

void logits_2d(const at::Tensor& logits) {
  MRL_CHECK(logits.dim() == 2, "logits must be [N, V], got ", logits.sizes());
  MRL_CHECK(logits.is_contiguous(), "logits must be contiguous");
  MRL_CHECK(at::isFloatingType(logits.scalar_type()), "logits must be floating point, got ", logits.scalar_type());
}

}  // namespace

void check_logprob_fwd(MRL_LOGPROB_FWD_ARGS) {
  logits_2d(logits);
  const int64_t n = logits.size(0);
  vec(target_local, n, "target_local", logits);
  MRL_CHECK(target_local.scalar_type() == at::kLong, "target_local must be int64");
  MRL_CHECK(inv_temperature > 0, "inv_temperature must be > 0, got ", inv_temperature);
  vec_f32(m_out, n, "m_out", logits);
  vec_f32(s_out, n, "s_out", logits);
  vec_f32(w_out, n, "w_out", logits);
  vec_f32(tz_out, n, "tz_out", logits);
}

void check_logprob_bwd(MRL_LOGPROB_BWD_ARGS) {
  logits_2d(logits);
  const int64_t n = logits.size(0);
  MRL_CHECK(grad_out.sizes() == logits.sizes() && grad_out.scalar_type() == logits.scalar_type() &&
                grad_out.is_contiguous(),
            "grad_out must be a contiguous tensor shaped and typed like logits");
  same_device(logits, grad_out, "grad_out");
  vec(target_local, n, "target_local", logits);
  MRL_CHECK(target_local.scalar_type() == at::kLong, "target_local must be int64");
  vec_f32(lse, n, "lse", logits);
  vec_f32(g_lp, n, "g_lp", logits);
  opt_vec(g_h, n, "g_h", logits, at::kFloat);
  MRL_CHECK(!g_h.has_value() || entropy.has_value(), "g_h needs the saved entropy");
  opt_vec(entropy, n, "entropy", logits, at::kFloat);
}

void check_ppo_fwd(MRL_PPO_FWD_ARGS) {
  const int64_t n = logprobs.numel();
  const auto dt = logprobs.scalar_type();
  MRL_CHECK(at::isFloatingType(dt), "logprobs must be floating point, got ", dt);
  vec(logprobs, n, "logprobs", logprobs);
  opt_vec(old_logprobs, n, "old_logprobs", logprobs, dt);
  opt_vec(advantages, n, "advantages", logprobs, dt);
  MRL_CHECK(kl_type >= 0 && kl_type <= 3, "kl_type must be 0 (none), 1 (k1), 2 (k2) or 3 (k3), got ", kl_type);
  MRL_CHECK(kl_type == 0 || ref_logprobs.has_value(), "kl_type ", kl_type, " needs ref_logprobs");
  MRL_CHECK(!do_tis || rollout_logprobs.has_value(), "do_tis needs rollout_logprobs");
  opt_vec(ref_logprobs, n, "ref_logprobs", logprobs, dt);
  opt_vec(rollout_logprobs, n, "rollout_logprobs", logprobs, dt);
  opt_vec(ratio_out, n, "ratio_out", logprobs, dt);
  MRL_CHECK(!do_ppo || (pg_out && clipped_out && dual_out), "do_ppo needs pg_out, clipped_out and dual_out");
  opt_vec(pg_out, n, "pg_out", logprobs, dt);
  opt_vec(clipped_out, n, "clipped_out", logprobs, at::kBool);
  opt_vec(dual_out, n, "dual_out", logprobs, at::kBool);
  MRL_CHECK(kl_type == 0 || kl_out.has_value(), "kl_type ", kl_type, " needs kl_out");
  opt_vec(kl_out, n, "kl_out", logprobs, dt);
  MRL_CHECK(!do_tis || (tis_w_out && tis_capped_out && tis_floored_out),
            "do_tis needs tis_w_out, tis_capped_out and tis_floored_out");
  opt_vec(tis_w_out, n, "tis_w_out", logprobs, dt);
  opt_vec(tis_capped_out, n, "tis_capped_out", logprobs, at::kBool);
  opt_vec(tis_floored_out, n, "tis_floored_out", logprobs, at::kBool);
}

void check_ppo_bwd(MRL_PPO_BWD_ARGS) {
  const int64_t n = logprobs.numel();
  const auto dt = logprobs.scalar_type();
  MRL_CHECK(at::isFloatingType(dt), "logprobs must be floating point, got ", dt);
  vec(logprobs, n, "logprobs", logprobs);
  opt_vec(grad_out, n, "grad_out", logprobs, dt);
  opt_vec(old_logprobs, n, "old_logprobs", logprobs, dt);
  opt_vec(advantages, n, "advantages", logprobs, dt);
  MRL_CHECK(kl_type >= 0 && kl_type <= 3, "kl_type must be 0..3, got ", kl_type);
  MRL_CHECK(kl_type == 0 || ref_logprobs.has_value(), "kl_type ", kl_type, " needs ref_logprobs");
  opt_vec(ref_logprobs, n, "ref_logprobs", logprobs, dt);
  opt_vec(g_pg, n, "g_pg", logprobs, dt);
  opt_vec(g_kl, n, "g_kl", logprobs, dt);
}

namespace {

bool on_cuda(const at::Tensor& t) { return t.is_cuda(); }

#ifndef MRL_WITH_CUDA
[[noreturn]] void no_cuda() {
  MRL_CHECK(false, "CUDA tensors given to megatron_rl._C_cpu (the CPU twins); build the CUDA extension "
                   "(MEGATRON_RL_BUILD_EXT=cuda pip install -e .) or use MEGATRON_RL_KERNELS=triton|torch");
}
#endif

void logprob_fwd_partials(MRL_LOGPROB_FWD_ARGS) {
  check_logprob_fwd(logits, target_local, inv_temperature, m_out, s_out, w_out, tz_out);
  if (on_cuda(logits)) {
#ifdef MRL_WITH_CUDA
    return cuda::logprob_fwd_partials(logits, target_local, inv_temperature, m_out, s_out, w_out, tz_out);
#else
    no_cuda();
#endif
  }
  cpu::logprob_fwd_partials(logits, target_local, inv_temperature, m_out, s_out, w_out, tz_out);
}

void logprob_bwd(MRL_LOGPROB_BWD_ARGS) {
  check_logprob_bwd(grad_out, logits, target_local, lse, entropy, g_lp, g_h, inv_temperature);
  if (on_cuda(logits)) {
#ifdef MRL_WITH_CUDA
    return cuda::logprob_bwd(grad_out, logits, target_local, lse, entropy, g_lp, g_h, inv_temperature);
#else
    no_cuda();
#endif
  }
  cpu::logprob_bwd(grad_out, logits, target_local, lse, entropy, g_lp, g_h, inv_temperature);
}

#define MRL_PPO_PARAM_NAMES do_ppo, clip_lo, clip_hi, has_dual, dual_c, kl_type, unbiased_kl, do_tis, tis_cap, tis_low

void ppo_fwd(MRL_PPO_FWD_ARGS) {
  check_ppo_fwd(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs, MRL_PPO_PARAM_NAMES, ratio_out,
                pg_out, clipped_out, dual_out, kl_out, tis_w_out, tis_capped_out, tis_floored_out);
  if (on_cuda(logprobs)) {
#ifdef MRL_WITH_CUDA
    return cuda::ppo_fwd(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs, MRL_PPO_PARAM_NAMES,
                         ratio_out, pg_out, clipped_out, dual_out, kl_out, tis_w_out, tis_capped_out, tis_floored_out);
#else
    no_cuda();
#endif
  }
  cpu::ppo_fwd(logprobs, old_logprobs, advantages, ref_logprobs, rollout_logprobs, MRL_PPO_PARAM_NAMES, ratio_out,
               pg_out, clipped_out, dual_out, kl_out, tis_w_out, tis_capped_out, tis_floored_out);
}

void ppo_bwd(MRL_PPO_BWD_ARGS) {
  check_ppo_bwd(grad_out, logprobs, old_logprobs, advantages, ref_logprobs, g_pg, g_kl, MRL_PPO_PARAM_NAMES);
  if (on_cuda(logprobs)) {
#ifdef MRL_WITH_CUDA
    return cuda::ppo_bwd(grad_out, logprobs, old_logprobs, advantages, ref_logprobs, g_pg, g_kl, MRL_PPO_PARAM_NAMES);
#else
    no_cuda();
#endif
  }
  cpu::ppo_bwd(grad_out, logprobs, old_logprobs, advantages, ref_logprobs, g_pg, g_kl, MRL_PPO_PARAM_NAMES);
}

}  // namespace
}  // namespace mrl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "megatron_rl fused log-prob/entropy and PPO-loss kernels (see csrc/ops.h)";
#ifdef MRL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("logprob_fwd_partials", &mrl::logprob_fwd_partials, py::arg("logits"), py::arg("target_local"),
        py::arg("inv_temperature"), py::arg("m_out"), py::arg("s_out"), py::arg("w_out"), py::arg("tz_out"));
  m.def("logprob_bwd", &mrl::logprob_bwd, py::arg("grad_out"), py::arg("logits"), py::arg("target_local"),
        py::arg("lse"), py::arg("entropy"), py::arg("g_lp"), py::arg("g_h"), py::arg("inv_temperature"));
  m.def("ppo_fwd", &mrl::ppo_fwd, py::arg("logprobs"), py::arg("old_logprobs"), py::arg("advantages"),
        py::arg("ref_logprobs"), py::arg("rollout_logprobs"), py::arg("do_ppo"), py::arg("clip_lo"),
        py::arg("clip_hi"), py::arg("has_dual"), py::arg("dual_c"), py::arg("kl_type"), py::arg("unbiased_kl"),
        py::arg("do_tis"), py::arg("tis_cap"), py::arg("tis_low"), py::arg("ratio_out"), py::arg("pg_out"),
        py::arg("clipped_out"), py::arg("dual_out"), py::arg("kl_out"), py::arg("tis_w_out"),
        py::arg("tis_capped_out"), py::arg("tis_floored_out"));
  m.def("ppo_bwd", &mrl::ppo_bwd, py::arg("grad_out"), py::arg("logprobs"), py::arg("old_logprobs"),
        py::arg("advantages"), py::arg("ref_logprobs"), py::arg("g_pg"), py::arg("g_kl"), py::arg("do_ppo"),
        py::arg("clip_lo"), py::arg("clip_hi"), py::arg("has_dual"), py::arg("dual_c"), py::arg("kl_type"),
        py::arg("unbiased_kl"), py::arg("do_tis"), py::arg("tis_cap"), py::arg("tis_low"));
}
