"""Fused kernels vs the torch paths: time and peak extra memory, as ratios to naive ``log_softmax``, in one run.

Log-probs + entropy, forward + backward of ``sum(logprobs) + 0.01 * sum(entropy)``
from bf16 logits ``[N, V]`` (V = 151,936, Qwen's vocab), temperature 0.7:

* naive: ``log_softmax(logits.float() / T)`` + gather + entropy (``ops.naive_logprobs``);
* torch: the chunked TP-aware reference (``MEGATRON_RL_KERNELS=torch``);
* cpu_ext (CPU): the C++ CPU twins of the CUDA kernels (JIT-built before timing);
* cuda, triton (GPU, when built / importable): the fused kernels.

And the per-token PPO loss terms (TIS weight, dual-clip surrogate, unbiased k3 KL),
forward + backward over T tokens: torch vs the fused kernel of the device.

"Peak extra" is the peak above the memory held once the inputs exist, over the
forward + backward, including the logits' gradient (N*V bf16, the same for all).
GPU: ``torch.cuda.max_memory_allocated`` deltas; CPU: process RSS sampled every
0.5 ms (as benchmarks/logprob_memory.py). Each row runs in a fresh subprocess; time
is the best of ``--repeat`` runs after one warm-up.

A correctness check runs first (``--check-n`` rows vs the float64 reference, each
implementation; exit status 1 if one fails), so a GPU run proves the kernels right
before timing them. Its bounds are derived, not fixed: ``ops.selfcheck.SLACK`` x the
float32 reference's own error against float64 on the same inputs (fp32 log-probs at
V = 151,936 are ~8e-6 from float64 on an AVX2 EPYC, more on other CPUs). For each
fused implementation it also runs the self-check a training run does on first use
(``ops.selfcheck``) and prints its cost in milliseconds.

Usage: ``python benchmarks/kernel_ops.py [--n 64 256] [--vocab 151936] [--tokens 1048576] [--repeat 3]``
(defaults: ~2 min on 2 idle cores, most of it the naive rows and the one-time JIT build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

GIB = 1024 ** 3
MIB = 1024 ** 2


class _Peak:
    """Peak memory above a base: CUDA allocator stats, or sampled RSS on CPU."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda, self.torch = cuda, torch
        if not cuda:  # psutil only for the CPU's RSS sampling (the GPU machine may not have it)
            import psutil

            self.proc = psutil.Process()

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
            return self
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()

        def sample():
            while not self.stop.is_set():
                self.peak = max(self.peak, self.proc.memory_info().rss)
                time.sleep(0.0005)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.peak = self.torch.cuda.max_memory_allocated()
        else:
            self.stop.set()
            self.thread.join()
            self.peak = max(self.peak, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def _logprob_worker(method: str, n_tok: int, vocab: int, repeat: int) -> dict:
    import torch

    from megatron_rl.ops import logprobs_and_entropy, naive_logprobs

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if method != "naive":
        os.environ["MEGATRON_RL_KERNELS"] = method

    def run(logits, target):
        x = logits.detach().requires_grad_()
        fn = naive_logprobs if method == "naive" else logprobs_and_entropy
        lp, h = fn(x, target, temperature=0.7, with_entropy=True)
        (lp.sum() + 0.01 * h.sum()).backward()
        return x.grad

    small = torch.randn(8, vocab, device=device).to(torch.bfloat16)
    run(small, torch.zeros(8, dtype=torch.long, device=device))  # lazy init, JIT load, Triton compile
    del small
    logits = torch.empty(n_tok, vocab, dtype=torch.bfloat16, device=device).normal_(0, 2)
    target = torch.randint(0, vocab, (n_tok,), device=device)
    with _Peak(cuda) as peak:
        grad = run(logits, target)
    del grad
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        grad = run(logits, target)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del grad
    return {"method": method, "n": n_tok, "vocab": vocab, "device": device, "seconds": min(times),
            "peak_extra_bytes": peak.extra, "logits_bytes": logits.numel() * logits.element_size()}


def _loss_worker(method: str, n_tok: int, repeat: int) -> dict:
    import torch

    from megatron_rl.ops import PolicyLossParams, policy_loss_terms

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    os.environ["MEGATRON_RL_KERNELS"] = method
    g = torch.Generator(device=device).manual_seed(0)
    lp, old, adv, ref, roll = (torch.randn(n_tok, generator=g, device=device) for _ in range(5))
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                              tis_cap=2.0, tis_low=0.0)

    def run():
        x = lp.detach().requires_grad_()
        t = policy_loss_terms(x, old, adv, params, ref_logprobs=ref, rollout_logprobs=roll)
        ((t.tis_weight * t.pg).sum() + 0.1 * t.kl.sum()).backward()
        return x.grad

    run()
    with _Peak(cuda) as peak:
        run()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"method": method, "n": n_tok, "device": device, "seconds": min(times), "peak_extra_bytes": peak.extra}


def _check_worker(method: str, n_tok: int, vocab: int) -> dict:
    """Errors of one implementation vs the float64 reference: log-probs, entropy, logits' gradient (fp32 and
    bf16 logits, T=0.7, a -inf column) and the PPO terms + gradient. Every error is ``max |diff| / (1 + |ref|)``
    (``ops.selfcheck.scaled_error``) and its bound is derived, not fixed: ``ops.selfcheck.SLACK`` x the error of
    the float32 reference on the same inputs (naive ``log_softmax``; the torch loss terms), which depends on the
    CPU's or GPU's exp/log and on V. Also the fused implementations' own self-check (``ops.selfcheck``: the one a
    run does on first use) with its cost."""
    import torch

    from megatron_rl.ops import PolicyLossParams, dispatch, logprobs_and_entropy, naive_logprobs, policy_loss_terms
    from megatron_rl.ops.selfcheck import derived_bound, scaled_error

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    out, bounds, ok = {}, {}, True
    self_check = {}
    if method != "torch":
        kernels = dispatch.KERNELS.get(method).load()
        for dtype in (torch.float32, torch.bfloat16):
            res = dispatch.self_check(method, kernels, torch.device(device), dtype)
            self_check[str(dtype).removeprefix("torch.")] = {"ok": res.ok, "ms": res.seconds * 1e3,
                                                             "report": res.describe()}
            ok &= res.ok
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(n_tok, vocab, generator=g, device=device, dtype=torch.float64) * 4
        full[:, 3] = -float("inf")
        target = torch.randint(4, vocab, (n_tok,), generator=g, device=device)
        g_lp, g_h = (torch.randn(n_tok, generator=g, device=device, dtype=torch.float64) for _ in range(2))

        def run(fn, x_in):
            x = x_in.detach().clone().requires_grad_()
            lp, h = fn(x, target, temperature=0.7, with_entropy=True)
            ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
            return {"logprobs": lp.detach(), "entropy": h.detach(), "grad": x.grad}

        exact = run(naive_logprobs, full.to(dtype).double())
        os.environ["MEGATRON_RL_KERNELS"] = "torch"
        # the float32 reference of a fused row is the torch chunked op it replaces (as tests/ops/ and the self-check
        # bound it); the torch row's own is log_softmax in float32, and its bound is at least one float32 rounding of
        # the logsumexp it stores (it forms log p = z - lse in float32; log_softmax keeps z - max and log sum apart)
        reference = run(naive_logprobs if method == "torch" else logprobs_and_entropy, full.to(dtype))
        lse = torch.logsumexp(full.to(dtype).double() / 0.7, dim=-1).abs().max().item()
        floor = torch.finfo(torch.float32).eps * lse if method == "torch" else 0.0
        os.environ["MEGATRON_RL_KERNELS"] = method
        got = run(logprobs_and_entropy, full.to(dtype))
        name = "fp32" if dtype == torch.float32 else "bf16"
        for key in ("logprobs", "entropy", "grad"):
            err = scaled_error(got[key], exact[key])
            bound = derived_bound(max(scaled_error(reference[key], exact[key]), floor))
            out[f"logprob/{name}/{key}"], bounds[f"logprob/{name}/{key}"] = err, bound
            ok &= err <= bound
        del full, exact, reference, got
    lp, old, adv, ref, roll = (torch.randn(4099, generator=g, device=device) for _ in range(5))
    g_pg, g_kl = torch.randn(4099, generator=g, device=device), torch.randn(4099, generator=g, device=device)
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                              tis_cap=2.0, tis_low=0.5)
    res = {}
    for impl, dtype in (("torch", torch.float64), ("torch", torch.float32), (method, torch.float32)):
        os.environ["MEGATRON_RL_KERNELS"] = impl
        x = lp.detach().to(dtype).clone().requires_grad_()  # a fresh leaf each time: no gradient accumulates
        t = policy_loss_terms(x, old.to(dtype), adv.to(dtype), params, ref_logprobs=ref.to(dtype),
                              rollout_logprobs=roll.to(dtype))
        ((t.pg * g_pg.to(dtype)).sum() + (t.kl * g_kl.to(dtype)).sum()).backward()
        res[impl, dtype] = (t, x.grad)
    (t64, g64), (tt, tg), (ct, cg) = res["torch", torch.float64], res["torch", torch.float32], res[method,
                                                                                                     torch.float32]
    for name in ("ratio", "pg", "kl", "tis_weight", "grad"):
        pick = (lambda terms, grad: grad if name == "grad" else getattr(terms, name))
        err, bound = scaled_error(pick(ct, cg), pick(t64, g64)), derived_bound(scaled_error(pick(tt, tg),
                                                                                            pick(t64, g64)))
        out[f"loss/{name}"], bounds[f"loss/{name}"] = err, bound
        ok &= err <= bound
    out["loss/mask_mismatches_vs_torch_fp32"] = sum(int((getattr(tt, k) != getattr(ct, k)).sum()) for k in
                                                    ("clipped", "dual", "tis_capped", "tis_floored"))
    return {"method": method, "n": n_tok, "vocab": vocab, "device": device, "ok": bool(ok), "errors": out,
            "bounds": bounds, "self_check": self_check}


def _measure(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _methods() -> list[str]:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return ["naive", "torch", "cpu_ext"]
    from megatron_rl.ops import available_backends

    have = available_backends("cuda")
    return ["naive", "torch"] + [m for m in ("cuda", "triton") if m in have or
                                 (m == "triton" and importlib.util.find_spec("triton"))]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256], help="token rows of the log-prob rows")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the PPO-loss rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--check-n", type=int, default=16,
                    help="rows of the correctness check run first against the float64 reference (0: skip it)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, method, *rest = args.worker
        rest = [int(v) for v in rest]
        worker = {"logprob": _logprob_worker, "loss": _loss_worker, "check": _check_worker}[kind]
        print(json.dumps(worker(method, *rest)))
        return
    import torch

    methods = _methods()
    if "cpu_ext" in methods:  # build once outside the timed subprocesses
        t0 = time.perf_counter()
        from megatron_rl.ops._ext import load_cpu_ext

        load_cpu_ext()
        print(f"cpu_ext ready in {time.perf_counter() - t0:.1f}s (JIT build or cache hit)")
    rows = []
    failed = []
    if args.check_n:
        from megatron_rl.ops.selfcheck import SLACK

        print(f"correctness vs float64, N={args.check_n}, V={args.vocab}; error = max |diff|/(1+|ref|), bound = "
              f"{SLACK:g}x the float32 reference's own error (the torch ops; for torch, log_softmax):")
        for method in [m for m in methods if m != "naive"]:
            r = _measure("check", method, args.check_n, args.vocab)
            rows.append({"kind": "check", "method": method, **r})
            if "error" in r or not r["ok"]:
                failed.append(method)
            if "error" in r:
                print(f"  {method:>8}: FAILED {r['error']}")
                continue
            worst = max(r["errors"][k] / r["bounds"][k] for k in r["bounds"])
            over = [f"{k} {r['errors'][k]:.1e} > {r['bounds'][k]:.1e}" for k in r["bounds"]
                    if not r["errors"][k] <= r["bounds"][k]]
            grads = {k: f"{r['errors'][k]:.1e}/{r['bounds'][k]:.1e}" for k in r["bounds"] if k.endswith("grad")}
            print(f"  {method:>8}: {'ok' if r['ok'] else 'FAILED'} (worst error/bound {worst:.2f}; grad error/bound "
                  f"{grads}){' ' + '; '.join(over) if over else ''}")
            for dtype, sc in r["self_check"].items():
                print(f"  {method:>8}: self-check {dtype}: {'passed' if sc['ok'] else 'FAILED'} in {sc['ms']:.1f} ms"
                      f"{'' if sc['ok'] else ' (' + sc['report'] + ')'}")
    print(f"log-probs + entropy, fwd+bwd, bf16 logits, V={args.vocab}, T=0.7; ratios are to naive "
          f"(time: lower is faster; memory: peak extra incl. the 1.0x-logits bf16 grad)")
    print(f"{'N':>5} {'method':>8} | {'seconds':>8} {'x naive':>8} | {'peak extra':>11} {'x naive':>8} {'x logits':>8}")
    for n_tok in args.n:
        naive = None
        for method in methods:
            r = _measure("logprob", method, n_tok, args.vocab, args.repeat)
            rows.append({"kind": "logprob", **r, "method": method, "n": n_tok})
            if "error" in r:
                print(f"{n_tok:>5} {method:>8} | failed: {r['error']}")
                continue
            naive = naive or r
            print(f"{n_tok:>5} {method:>8} | {r['seconds']:>8.3f} {r['seconds'] / naive['seconds']:>7.2f}x | "
                  f"{r['peak_extra_bytes'] / MIB:>8.0f}MiB {r['peak_extra_bytes'] / max(naive['peak_extra_bytes'], 1):>7.2f}x"
                  f" {r['peak_extra_bytes'] / r['logits_bytes']:>7.2f}x")
    fused = [m for m in methods if m not in ("naive", "torch")]
    print(f"\nPPO loss terms (TIS + dual clip + unbiased k3), fwd+bwd, T={args.tokens} fp32 tokens; ratios to torch")
    base = None
    for method in ["torch"] + fused:
        r = _measure("loss", method, args.tokens, args.repeat)
        rows.append({"kind": "loss", **r, "method": method, "n": args.tokens})
        if "error" in r:
            print(f"{method:>8} | failed: {r['error']}")
            continue
        base = base or r
        print(f"{method:>8} | {r['seconds'] * 1e3:>8.2f} ms {r['seconds'] / base['seconds']:>6.2f}x | "
              f"{r['peak_extra_bytes'] / MIB:>7.1f} MiB {r['peak_extra_bytes'] / max(base['peak_extra_bytes'], 1):>6.2f}x")
    print(f"device: {'cuda ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        sys.exit(f"correctness check failed for: {', '.join(failed)}")


if __name__ == "__main__":
    main()
