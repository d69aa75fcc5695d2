"""The Triton kernels without a GPU: compiled for sm_90 (catches what the interpreter accepts but the compiler
refuses), and run under the interpreter in a fresh process (see scripts/triton_cases.py for why fresh)."""

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

from _util import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton==3.6.0; CUDA builds of torch "
                                       "ship it)")


def test_triton_kernels_interpreted_match_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(REPO / "tests" / "ops" / "scripts" / "triton_cases.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"Triton interpreter cases failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def _compile(fn, pointer_and_scalar_types, constexprs):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: pointer_and_scalar_types.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32))


def test_triton_kernels_compile_for_sm90():
    """Every kernel and flag combination the wrappers launch compiles to PTX + cubin for an H100/H200."""
    import megatron_rl.ops.triton_kernels as tk

    if type(tk._logprob_fwd_kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels were decorated for the interpreter")
    for dt in ("bf16", "fp32"):
        _compile(tk._logprob_fwd_kernel, {"x_ptr": f"*{dt}", "tgt_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32",
                                          "w_ptr": "*fp32", "tz_ptr": "*fp32", "V": "i32", "inv_t": "fp32"},
                 {"BLOCK": 4096})
        for with_h in (True, False):
            _compile(tk._logprob_bwd_kernel, {"g_ptr": f"*{dt}", "x_ptr": f"*{dt}", "tgt_ptr": "*i64",
                                              "lse_ptr": "*fp32", "ent_ptr": "*fp32", "glp_ptr": "*fp32",
                                              "gh_ptr": "*fp32", "V": "i32", "inv_t": "fp32"},
                     {"WITH_H": with_h, "BLOCK": 4096, "OUT_BF16": dt == "bf16"})
    floats = ("lp_ptr", "old_ptr", "adv_ptr", "ref_ptr", "roll_ptr", "ratio_ptr", "pg_ptr", "kl_ptr", "tw_ptr")
    bools = ("clipped_ptr", "dual_ptr", "capped_ptr", "floored_ptr")
    scalars = {n: "fp32" for n in ("clip_lo", "clip_hi", "dual_c", "tis_cap", "tis_low")}
    for kl in (0, 1, 2, 3):
        flags = {"DO_PPO": kl != 1, "HAS_DUAL": kl == 3, "KL_TYPE": kl, "UNBIASED": kl == 3}
        _compile(tk._ppo_fwd_kernel, {**{n: "*bf16" for n in floats}, **{n: "*i1" for n in bools}, "n": "i32",
                                      **scalars}, {**flags, "DO_TIS": kl != 2, "BLOCK": 1024, "OUT_BF16": True})
        _compile(tk._ppo_bwd_kernel, {**{n: "*bf16" for n in ("g_ptr", "lp_ptr", "old_ptr", "adv_ptr", "ref_ptr",
                                                            "gpg_ptr", "gkl_ptr")}, "n": "i32",
                                      **{n: "fp32" for n in ("clip_lo", "clip_hi", "dual_c")}},
                 {**flags, "HAS_GPG": True, "HAS_GKL": kl != 0, "BLOCK": 1024, "OUT_BF16": True})
