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
before timing them.

Usage: ``python benchmarks/kernels.py [--n 64 256] [--vocab 151936] [--tokens 1048576] [--repeat 3]``
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
    """Max errors of one implementation vs the float64 reference: log-probs, entropy, logits' gradient (fp32 and
    bf16 logits, T=0.7, a -inf column) and the PPO terms + gradient vs torch. ``ok`` applies the tests' tolerances
    (a GPU's exp approximation gets 4x)."""
    import torch

    from megatron_rl.ops import PolicyLossParams, logprobs_and_entropy, naive_logprobs, policy_loss_terms

    device = "cuda" if torch.cuda.is_available() else "cpu"
    slack = 4.0 if device == "cuda" else 1.0
    g = torch.Generator(device=device).manual_seed(0)
    out, ok = {}, True
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(n_tok, vocab, generator=g, device=device, dtype=torch.float64) * 4
        full[:, 3] = -float("inf")
        target = torch.randint(4, vocab, (n_tok,), generator=g, device=device)
        g_lp, g_h = (torch.randn(n_tok, generator=g, device=device, dtype=torch.float64) for _ in range(2))
        ref_x = full.to(dtype).double().requires_grad_()
        rlp, rh = naive_logprobs(ref_x, target, temperature=0.7, with_entropy=True)
        ((rlp * g_lp).sum() + (rh * g_h).sum()).backward()
        os.environ["MEGATRON_RL_KERNELS"] = method
        x = full.to(dtype).requires_grad_()
        lp, h = logprobs_and_entropy(x, target, temperature=0.7, with_entropy=True)
        ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
        name = "fp32" if dtype == torch.float32 else "bf16"
        errs = {"logprobs": (lp.double() - rlp).abs().max().item(), "entropy": (h.double() - rh).abs().max().item(),
                "grad_rel": ((x.grad.double() - ref_x.grad).abs().max() / ref_x.grad.abs().max()).item()}
        grad_tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        ok &= errs["logprobs"] < 1e-5 * slack and errs["entropy"] < 1e-5 * slack and errs["grad_rel"] < grad_tol * slack
        out.update({f"logprob/{name}/{k}": v for k, v in errs.items()})
    lp, old, adv, ref, roll = (torch.randn(4099, generator=g, device=device) for _ in range(5))
    params = PolicyLossParams(ppo=True, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, kl_type="k3", unbiased_kl=True,
                              tis_cap=2.0, tis_low=0.5)
    res = {}
    for impl in ("torch", method):
        os.environ["MEGATRON_RL_KERNELS"] = impl
        x = lp.clone().requires_grad_()
        t = policy_loss_terms(x, old, adv, params, ref_logprobs=ref, rollout_logprobs=roll)
        (t.pg.sum() + 0.3 * t.kl.sum()).backward()
        res[impl] = (t, x.grad)
    (tt, tg), (ct, cg) = res["torch"], res[method]
    for name in ("ratio", "pg", "kl", "tis_weight"):
        out[f"loss/{name}"] = (getattr(tt, name) - getattr(ct, name)).abs().max().item()
    out["loss/grad"] = (tg - cg).abs().max().item()
    out["loss/mask_mismatches"] = sum(int((getattr(tt, k) != getattr(ct, k)).sum()) for k in
                                      ("clipped", "dual", "tis_capped", "tis_floored"))
    ok &= max(v for k, v in out.items() if k.startswith("loss/") and k != "loss/mask_mismatches") < 1e-5 * slack
    return {"method": method, "n": n_tok, "vocab": vocab, "device": device, "ok": bool(ok), "errors": out}


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
        print(f"correctness vs float64 log_softmax / torch loss terms, N={args.check_n}, V={args.vocab}:")
        for method in [m for m in methods if m != "naive"]:
            r = _measure("check", method, args.check_n, args.vocab)
            rows.append({"kind": "check", "method": method, **r})
            if "error" in r or not r["ok"]:
                failed.append(method)
            worst = {k: f"{v:.1e}" for k, v in r.get("errors", {}).items() if "grad" in k or "logprobs" in k}
            print(f"  {method:>8}: {'ok' if r.get('ok') else 'FAILED'} {r.get('error', worst)}")
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
