"""LoRA (--lora-rank) vs full fine-tuning on the same model and batch: what each trains, holds and syncs.

For each variant, one process (megatron-core, one rank, fp32, Adam), the same random batch of samples:

* trainable parameters (those with ``requires_grad``) and the bytes DDP's grad buffers hold;
* optimizer state bytes (Adam's exp_avg / exp_avg_sq, plus master copies where there are any);
* the bytes of a KL-reference weight tag (a full run copies the model, a LoRA run the adapters);
* the step time (median over the steps after the first, ``--repeat`` interleaved runs);
* the bytes one weight sync sends to the engine (``export_weights``: the merged model for LoRA, as the
  engine serves it) and the adapter tensors' own bytes (what an adapter-only sync would send);
* for LoRA, a real weight sync into the embedded engine (the in-process transport) with ``--lora-sync merged``
  and ``adapter``: its ``sync/bytes`` and ``sync/time_s`` (median of 3 after the first, which for ``adapter``
  carries the base model too), the engine's weights checked against the merged export after the last;

as ratios to full fine-tuning, printed in one run.

    python benchmarks/lora.py [--hidden 512] [--layers 4] [--ranks 8 64] [--steps 5] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def samples_for(vocab: int, count: int, seed: int = 0):
    import torch

    from megatron_rl.data.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(0, vocab, (int(torch.randint(32, 96, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(0, vocab, (64,), generator=g).tolist()
        s = Sample(prompt_ids=prompt, response_ids=response, group_index=i // 4, reward=float(torch.rand(1, generator=g)))
        s.rollout_logprobs = [0.0] * len(response)
        out.append(s)
    return out


def run(hf: str, rank: int, samples, args) -> dict:
    import torch

    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config
    from megatron_rl.models.parallel import destroy_parallel

    torch.manual_seed(0)
    argv = ["--hf-checkpoint", hf, "--lr", "1e-4", "--rollout-batch-size", str(len(samples) // 4),
            "--n-samples-per-prompt", "4", "--micro-batch-size", "4", "--seed", "7", "--use-kl-loss"]
    if rank:
        argv += ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)]
    cfg = parse_config(argv)
    spec = spec_from_config(cfg)
    backend = MegatronBackend()
    backend.initialize(cfg, spec)
    backend.snapshot_weights("ref")
    old = backend.forward_only(samples)
    adv = spec.compute_advantages(samples)
    seconds = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        backend.train_step(TrainBatch(samples, adv, old_logprobs=old))
        seconds.append(time.perf_counter() - t0)
    params = [p for c in backend.chunks for p in c.parameters()]
    inner = [o.optimizer for o in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])]
    state_bytes = sum(t.numel() * t.element_size() for o in inner for st in o.state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
    sync_bytes = sum(t.numel() * t.element_size() for bucket in backend.export_weights(1 << 26) for _, t in bucket)
    adapter_bytes = sum(p.numel() * p.element_size() for a in backend.lora for p in a.parameters())
    synced = engine_syncs(hf, backend) if rank else {}
    result = {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "total": sum(p.numel() for p in params),
        "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for m in backend.model
                                 for b in m.buffers + m.expert_parallel_buffers),
        "optimizer_state_bytes": state_bytes,
        "ref_tag_bytes": backend.weights.nbytes("ref"),
        "step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
        "sync_bytes": sync_bytes,
        "adapter_bytes": adapter_bytes,
        **synced,
    }
    destroy_parallel()
    return result


def engine_syncs(hf: str, backend) -> dict:
    """``--lora-sync merged`` vs ``adapter`` into one embedded engine: bytes and median seconds per sync."""
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.weight_sync.in_process import InProcessSynchronizer

    engine = EmbeddedEngine(hf)
    version, out = 0, {}
    for mode in ("merged", "adapter"):
        sync = InProcessSynchronizer(1 << 26, adapter=mode == "adapter")
        sync.sync(backend, engine, version)  # the first: adapter mode sends the base model along
        version += 1
        seconds, metrics = [], {}
        for _ in range(3):
            metrics = sync.sync(backend, engine, version)
            seconds.append(metrics["sync/time_s"])
            version += 1
        out[f"sync_{mode}_bytes"], out[f"sync_{mode}_s"] = metrics["sync/bytes"], statistics.median(seconds)
    checker = InProcessSynchronizer(1 << 26, check_equal=True, adapter=True)
    checker._base_sent = True  # the engine holds the base from above: this sync sends the adapter alone
    out["sync_checked"] = checker.sync(backend, engine, version)["sync/checked_tensors"]
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each variant, interleaved (median step time)")
    args = ap.parse_args()

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    variants = [0, *args.ranks]
    with tempfile.TemporaryDirectory(prefix="lora_bench_") as tmp:
        hf = build_tiny_hf_model("qwen3", os.path.join(tmp, "hf"), hidden_size=args.hidden,
                                 intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                 num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                                 head_dim=64, vocab_size=4096)
        samples = samples_for(4096, args.samples)
        results: dict[int, list[dict]] = {v: [] for v in variants}
        for _ in range(args.repeat):
            for v in variants:
                results[v].append(run(hf, v, samples, args))
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    full = results[0][0]
    print(f"qwen3, hidden {args.hidden}, {args.layers} layers, vocab 4096: {full['total']:,} parameters; "
          f"{len(samples)} samples ({tokens} tokens) per step; fp32 Adam, KL loss; 1 process; "
          f"LoRA alpha = 2 x rank on all-linear")
    head = f"{'':>26} {'full':>14}" + "".join(f" {'r' + str(r):>14} {'ratio':>7}" for r in args.ranks)
    print(head)
    step = {v: statistics.median(rep["step_s"] for rep in results[v]) for v in variants}
    rows = [("trainable parameters", "trainable", "{:,.0f}"), ("grad buffer bytes", "grad_buffer_bytes", "{:,.0f}"),
            ("optimizer state bytes", "optimizer_state_bytes", "{:,.0f}"), ("KL reference tag bytes", "ref_tag_bytes",
                                                                             "{:,.0f}"),
            ("weight sync bytes (merged)", "sync_bytes", "{:,.0f}"), ("adapter bytes", "adapter_bytes", "{:,.0f}")]
    for label, key, fmt in rows:
        line = f"{label:>26} {fmt.format(full[key]):>14}"
        for r in args.ranks:
            got = results[r][0][key]
            ratio = f"{got / full[key]:.4f}" if full[key] else "-"
            line += f" {fmt.format(got):>14} {ratio:>7}"
        print(line)
    for label, key, fmt in [("sync bytes, merged", "sync_merged_bytes", "{:,.0f}"),
                            ("sync bytes, adapter", "sync_adapter_bytes", "{:,.0f}"),
                            ("sync s, merged", "sync_merged_s", "{:.4f}"), ("sync s, adapter", "sync_adapter_s", "{:.4f}")]:
        line = f"{label:>26} {'-':>14}"
        for r in args.ranks:
            got, merged = results[r][0][key], results[r][0][key.replace("adapter", "merged")]
            line += f" {fmt.format(got):>14} {got / merged:>7.4f}"
        print(line)
    line = f"{'step time (s, median)':>26} {step[0]:>14.3f}"
    for r in args.ranks:
        line += f" {step[r]:>14.3f} {step[r] / step[0]:>7.2f}"
    print(line)


if __name__ == "__main__":
    main()
