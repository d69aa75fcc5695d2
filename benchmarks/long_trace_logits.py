"""Peak memory of a long agentic trace: logits at every position vs at the loss rows vs projected by row chunks.

An 8-turn tool-use trajectory is mostly prompt and tool observations; only the
assistant tokens carry loss. Three paths, each a backend's way at some point:

* ``full``: logits at every packed position, then the response rows picked from them
  (the path before loss rows; kept here, in ``_full_sequence_*``, as the reference);
* ``loss_rows``: the output layer on the loss rows only, their logits whole
  (``megatron_rl/backends/loss_rows.py``; still the path of an output layer whose
  logits are changed after its matmul, e.g. Gemma's soft-capping);
* ``chunked``: the backends' default, the output projection fused into the log-prob op
  and run ``--log-probs-chunk-size`` rows at a time, forward and backward
  (``megatron_rl/ops/linear_logprob.py``).

Each (backend, path) runs in a fresh process: the real backend (megatron-core or
FSDP2, one process, gloo), a tiny Qwen2 model with Qwen's 151,936-token vocab, bf16.
After a warm-up step on a short trace the kernel's peak-RSS counter is reset
(``/proc/self/clear_refs``) and the peak above the resident memory at that point is
read from ``VmHWM``, once for the no-grad forward (the old log-probs) and once for
the training step. glibc serves these large tensors with mmap, so RSS follows them.
The trace's log-probs at the loss rows on the initial weights are compared with the full
path's (bitwise count and max difference), and the gradient norm of the first training
step (the warm-up, a one-turn trace of 192 loss rows: two chunks) printed for each.

    python benchmarks/long_trace_logits.py [--turns 8] [--prompt 512] [--assistant 192]
                                           [--observation 320] [--vocab 151936] [--backends megatron fsdp]
                                           [--log-probs-chunk-size N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

GIB = 1024 ** 3
PATHS = ("full", "loss_rows", "chunked")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_above(fn):
    """(result, peak resident bytes above the resident memory at the start, seconds) of ``fn()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, (_status_kib("VmHWM") - base) * 1024, seconds


def _trace(args, seed: int = 0, turns: int | None = None):
    """One multi-turn sample: prompt, then per turn the assistant's tokens (loss) and a tool observation (no loss)."""
    import torch

    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(seed)
    turns = args.turns if turns is None else turns
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()
    response = torch.randint(0, args.vocab, (turns * (args.assistant + args.observation),), generator=g).tolist()
    mask = ([1] * args.assistant + [0] * args.observation) * turns
    return Sample(group_index=0, prompt_ids=prompt, response_ids=response, reward=1.0, loss_mask=mask)


def _full_sequence_megatron(self, spec, mb, rows, output, with_entropy=True):
    """The megatron role's path before loss rows (CP 1): logits at every position, then the response rows."""
    from megatron_rl.algorithms.spec import ModelOutput

    logits = output[0] if output.dim() == 3 else output
    picked = mb.gather_response(logits)
    out = spec.extract_model_output(picked, mb.response_target_ids.to(picked.device), vocab_start_index=0,
                                    vocab_size=self.vocab_size, with_entropy=with_entropy)
    return ModelOutput(out.logprobs, out.entropy)


def _full_sequence_fsdp(self, model, mb, with_entropy=True):
    """The fsdp backend's path before loss rows: logits of every padded position, then the response rows."""
    from megatron_rl.backends.fsdp.padding import unpack_to_rows

    padded = unpack_to_rows(mb, self.pad_token_id).to(self.device)
    logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False).logits
    picked = logits[padded.response_rows, padded.response_cols].float()
    return self.spec.extract_model_output(picked, mb.response_target_ids.to(self.device), with_entropy=with_entropy)


def _select_path(backend: str, path: str) -> None:
    """Put the backend on ``path``: ``full`` (logits at every position), ``loss_rows`` (the output layer on the
    loss rows, their logits whole), ``chunked`` (the backends' default: the projection fused into the log-prob
    op by row chunks)."""
    import contextlib

    if path == "chunked":
        return
    if backend == "megatron":
        from megatron_rl.backends.megatron import role_model as mod

        mod._fusable = lambda layer: False  # the output layer returns the loss rows' logits
        if path == "full":
            mod._output_rows = lambda layer, rows, head=None: contextlib.nullcontext()
            mod.RoleModel.model_output = _full_sequence_megatron
    else:
        from megatron_rl.backends.fsdp import backend as mod

        mod.lm_head_is_plain = lambda model, lm_head: False
        if path == "full":
            mod.FSDPBackend._model_output = _full_sequence_fsdp


def worker(args) -> dict:
    import torch

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config

    torch.manual_seed(0)
    argv = ["--hf-checkpoint", args.hf, "--train-backend", args.backend, "--bf16", "--micro-batch-size", "1",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "1", "--lr", "1e-6"]
    if args.log_probs_chunk_size:
        argv += ["--log-probs-chunk-size", str(args.log_probs_chunk_size)]
    cfg = parse_config(argv)
    _select_path(args.backend, args.path)
    spec = spec_from_config(cfg)
    backend = make_backend(args.backend)
    backend.initialize(cfg, spec)

    def step(sample):
        old = backend.forward_only([sample])
        adv = [torch.full((sample.response_length,), 0.5)]
        return old, backend.train_step(TrainBatch([sample], adv, old_logprobs=old))

    sample = _trace(args)
    # values on the initial weights, the same in every path (a training step's update depends on the path's
    # gradient bits: Adam's first step is about the sign of each element's gradient)
    first = backend.forward_only([sample])
    _, warm = step(_trace(args, seed=1, turns=1))  # warm-up: optimizer state, kernels, allocator
    old, fwd_peak, fwd_s = _peak_above(lambda: backend.forward_only([sample]))
    adv = [torch.full((sample.response_length,), 0.5)]
    metrics, train_peak, train_s = _peak_above(
        lambda: backend.train_step(TrainBatch([sample], adv, old_logprobs=old)))
    keep = torch.tensor(sample.loss_mask, dtype=torch.bool)
    return {"forward_peak": fwd_peak, "forward_s": fwd_s, "train_peak": train_peak, "train_s": train_s,
            "loss_logprobs": first[0][keep].tolist(), "grad_norm": warm.get("train/grad_norm")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (system + task)")
    ap.add_argument("--assistant", type=int, default=192, help="assistant tokens per turn (carry loss)")
    ap.add_argument("--observation", type=int, default=320, help="tool-observation tokens per turn (no loss)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--backends", nargs="+", default=["megatron", "fsdp"], choices=["megatron", "fsdp"])
    ap.add_argument("--log-probs-chunk-size", type=int, default=0,
                    help="the run's --log-probs-chunk-size (rows per chunk; 0: unset, the ~64 MiB float32 default)")
    ap.add_argument("--worker", nargs=3, metavar=("BACKEND", "PATH", "HF"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.backend, args.path, args.hf = args.worker
        print(json.dumps(worker(args)))
        return

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    total = args.prompt + args.turns * (args.assistant + args.observation)
    loss = args.turns * args.assistant
    print(f"trace: {args.turns} turns, {total} tokens ({args.prompt} prompt, {args.turns} x ({args.assistant} assistant "
          f"+ {args.observation} observation)), {loss} carry loss ({loss / total:.0%}); vocab {args.vocab:,}; bf16")
    print(f"full bf16 logits of the trace: {total * args.vocab * 2 / GIB:.2f} GiB; of its loss rows: "
          f"{loss * args.vocab * 2 / GIB:.2f} GiB")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="long_trace_") as tmp:
        hf = build_tiny_hf_model("qwen2", os.path.join(tmp, "hf"), vocab_size=args.vocab, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, max_position_embeddings=total + 64)
        for backend in args.backends:
            res = {}
            for path in PATHS:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, path, hf,
                       *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))]
                             for k in ("turns", "prompt", "assistant", "observation", "vocab",
                                       "log_probs_chunk_size")), [])]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if proc.returncode:
                    sys.exit(f"{backend}/{path} worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
                res[path] = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((backend, res))
    print(f"\n{'backend':9} {'pass':8} | {'full seq':>9} {'loss rows':>9} {'chunked':>9} | {'rows/full':>9} "
          f"{'chunk/full':>10} | {'full s':>7} {'rows s':>7} {'chunk s':>7}")
    for backend, res in rows:
        full, lrows, chunked = (res[p] for p in PATHS)
        for what in ("forward", "train"):
            f, r, c = (x[f"{what}_peak"] for x in (full, lrows, chunked))
            fs, rs, cs = (x[f"{what}_s"] for x in (full, lrows, chunked))
            print(f"{backend:9} {what:8} | {f / GIB:8.2f}G {r / GIB:8.2f}G {c / GIB:8.2f}G | {r / max(f, 1):8.2f}x "
                  f"{c / max(f, 1):9.2f}x | {fs:7.2f} {rs:7.2f} {cs:7.2f}")
        for other in ("loss_rows", "chunked"):
            a, b = full["loss_logprobs"], res[other]["loss_logprobs"]
            same = sum(x == y for x, y in zip(a, b))
            diff = max(abs(x - y) for x, y in zip(a, b))
            print(f"{backend:9} {other:9} log-probs at the loss rows vs full: {same}/{len(a)} bitwise equal, "
                  f"max |diff| {diff:.3g}; first step's grad norm {res[other]['grad_norm']:.7g} "
                  f"(full {full['grad_norm']:.7g})")


if __name__ == "__main__":
    main()
