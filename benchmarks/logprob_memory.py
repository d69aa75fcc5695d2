"""Peak extra memory and time: chunked log-prob/entropy op vs naive full-vocab log_softmax.

Forward + backward of ``sum(logprobs) + 0.01 * sum(entropy)`` from bf16 logits
``[N, V]`` (V = 151,936, Qwen2/3's vocab), both paths computing log-probs AND
entropy, temperature 1.

* naive: ``logp = log_softmax(logits.float()); gather; -(exp(logp) * logp).sum(-1)``
  (what most RL trainers do once the vocab is gathered);
* chunked: ``megatron_rl.ops.logprobs_and_entropy`` (single device, auto chunk).

"Peak extra" is the peak above the memory held once the logits exist, over the
whole forward + backward; it includes the logits' gradient (``N*V`` bf16, the
same in both paths). On GPU it is ``torch.cuda.max_memory_allocated`` deltas; on
CPU the process RSS sampled every 0.5 ms by a thread (glibc serves these
multi-MiB tensors with mmap, so a free shows up in RSS at once). Each
measurement runs in a fresh subprocess so allocator caches do not leak between
rows. A naive row is skipped when the machine lacks the memory for it.

Usage: ``python benchmarks/logprob_memory.py [--n 256 1024 2048] [--vocab 151936]`` (defaults fit
~2 min on 2 idle cores; ``--n 4096`` needs ~12 GiB for the naive path and several minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

GIB = 1024 ** 3


def _worker(method: str, n_tok: int, vocab: int) -> dict:
    import psutil
    import torch

    from megatron_rl.ops import logprobs_and_entropy, naive_logprobs

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"

    def run(logits, target):
        x = logits.detach().requires_grad_()
        if method == "naive":
            lp, h = naive_logprobs(x, target, with_entropy=True)
        else:
            lp, h = logprobs_and_entropy(x, target, with_entropy=True)
        (lp.sum() + 0.01 * h.sum()).backward()
        return x.grad

    small = torch.randn(8, vocab, device=device).to(torch.bfloat16)
    run(small, torch.zeros(8, dtype=torch.long, device=device))  # warm kernels / lazy init
    del small
    logits = torch.empty(n_tok, vocab, dtype=torch.bfloat16, device=device).normal_(0, 2)
    target = torch.randint(0, vocab, (n_tok,), device=device)
    proc = psutil.Process()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    sampler = None if cuda else threading.Thread(target=sample, daemon=True)
    if sampler:
        sampler.start()
    t0 = time.perf_counter()
    grad = run(logits, target)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if sampler:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], proc.memory_info().rss)
    else:
        peak[0] = torch.cuda.max_memory_allocated()
    del grad
    return {"method": method, "n": n_tok, "vocab": vocab, "device": device, "seconds": seconds,
            "peak_extra_bytes": peak[0] - base, "logits_bytes": logits.numel() * logits.element_size()}


def _measure(method: str, n_tok: int, vocab: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", method, str(n_tok), str(vocab)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))))
        return
    import psutil

    print(f"V={args.vocab}, bf16 logits, forward+backward of log-probs + entropy; 'extra' = peak above "
          f"the logits, incl. their bf16 grad (1.0x logits)")
    print(f"{'N':>6} {'logits':>9} | {'naive extra':>12} {'chunked extra':>14} {'mem ratio':>9} | "
          f"{'naive s':>8} {'chunked s':>9} {'time ratio':>10}")
    for n_tok in args.n:
        chunked = _measure("chunked", n_tok, args.vocab)
        logits_gib = chunked["logits_bytes"] / GIB
        # naive peaks near 1.25 logits + ~8 logits-sized fp32/bf16 buffers; leave headroom for others
        need = 10 * chunked["logits_bytes"]
        if psutil.virtual_memory().available < need + 4 * GIB:
            print(f"{n_tok:>6} {logits_gib:>7.2f}Gi | {'skipped':>12} {chunked['peak_extra_bytes'] / GIB:>12.2f}Gi"
                  f" {'-':>9} | {'-':>8} {chunked['seconds']:>9.2f} {'-':>10}  (naive needs ~{need / GIB:.0f} GiB)")
            continue
        naive = _measure("naive", n_tok, args.vocab)
        ne, ce = naive["peak_extra_bytes"], chunked["peak_extra_bytes"]
        print(f"{n_tok:>6} {logits_gib:>7.2f}Gi | {ne / GIB:>10.2f}Gi {ce / GIB:>12.2f}Gi {ne / max(ce, 1):>8.1f}x | "
              f"{naive['seconds']:>8.2f} {chunked['seconds']:>9.2f} {chunked['seconds'] / naive['seconds']:>9.2f}x")
    print(f"device: {chunked['device']}")


if __name__ == "__main__":
    main()
