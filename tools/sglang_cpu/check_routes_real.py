"""MoE routing replay (R3) against REAL SGLang 0.5.23 on a CPU-only machine: the routes it returns.

Starts ``sglang.launch_server`` (the CPU route of ``check_real_sglang.py``) on a tiny random Qwen3-MoE with
``--enable-return-routed-experts`` and generates through megatron_rl's ``SGLangEngine`` with a
``RouteLayout`` (what ``--use-rollout-routing-replay`` builds), so every sample carries
``Sample.routed_experts`` read from SGLang's ``meta_info.routed_experts``. Checks:

1. every sample has routes of ``total_length - 1`` tokens (the engine's own length check passed);
2. the routes are the experts one HF forward over prompt + response picks in every MoE layer (as sets: the
   order within a token's top-k carries no meaning), for every input token: the prompt's (prefill) and the
   response's (each decode step);
3. the same with the radix cache serving a shared prompt prefix (the second batch repeats the first's
   prompts with ``n = 2``), so routes of cached tokens come from SGLang's capture of the earlier request;
4. after a weight update through the disk route (a second random Qwen3-MoE), the routes follow the new
   weights.

SGLang's routed-experts capture keeps a host buffer that it page-locks with ``cudaHostRegister``, which
kills the server on a machine without CUDA; the CPU stand-in ``sgl_kernel`` allocates that buffer unpinned
(``tools/sglang_cpu/sgl_kernel/_host_memory.py``), the only change. Run through
``scripts/test_sglang_real.sh --routes``. Writes figures.json / check.log / server.log under ``--out``;
exit 0 all passed, 1 a check failed, 2 the server could not be started.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402 - after the repo is on sys.path

from check_real_sglang import CheckFailed, Report, SGLangServer, wait_healthy  # noqa: E402
from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams  # noqa: E402
from megatron_rl.infra.ports import free_port  # noqa: E402
from megatron_rl.models.hf_tiny import build_tiny_hf_model  # noqa: E402
from megatron_rl.rollout.routes import RouteCapture, RouteLayout  # noqa: E402
from megatron_rl.rollout.sglang import SGLangEngine  # noqa: E402

VOCAB = 128
# a tiny Qwen3-MoE: 3 layers, 8 experts, top-2 (every layer MoE); the wide init of hf_tiny keeps router
# logits apart, so a route flip would be a bug, not a near-tie
MODEL = dict(vocab_size=VOCAB, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def build_model(path: Path, seed: int) -> Path:
    if not (path / "config.json").exists():
        build_tiny_hf_model("qwen3_moe", path, seed=seed, **MODEL)
    return path


class HFRoutes:
    """The experts one HF forward over ``ids`` picks: ``[len(ids), moe_layers, topk]``, sorted per token."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.capture = RouteCapture(self.model)

    def __call__(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            self.model(torch.tensor([ids]))
        return self.capture.take(1, len(ids))[0].sort(dim=-1).values


def compare(samples: list[Sample], reference: HFRoutes) -> tuple[int, int, list[str]]:
    """(token-layer pairs equal, pairs in all, a description of the first few that differ)."""
    equal = total = 0
    diffs: list[str] = []
    for i, s in enumerate(samples):
        if s.routed_experts is None:
            raise CheckFailed(f"sample {i} has no routes")
        ids = list(s.prompt_ids) + list(s.response_ids)
        got = torch.from_numpy(s.routed_experts.array.astype("int64")).sort(dim=-1).values
        want = reference(ids)[:-1].to(torch.int64)  # the last token is never an input
        if got.shape != want.shape:
            raise CheckFailed(f"sample {i}: routes {tuple(got.shape)}, expected {tuple(want.shape)}")
        same = (got == want).all(dim=-1)
        equal += int(same.sum())
        total += same.numel()
        for t, layer in (~same).nonzero().tolist()[:3]:
            where = "prompt" if t < len(s.prompt_ids) else "response"
            diffs.append(f"sample {i} token {t} ({where}) MoE layer {layer}: SGLang {got[t, layer].tolist()}, "
                         f"HF {want[t, layer].tolist()}")
    return equal, total, diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/sglang_routes", help="output dir: figures.json, check.log, server.log")
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"))
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    if not os.access(args.sglang_python, os.X_OK):
        report.log(f"error: {args.sglang_python} is not an executable python; run scripts/sglang_cpu_install.sh")
        return 2
    model_dir = build_model(out / "model", args.seed)
    other_dir = build_model(out / "model_v1", args.seed + 1)
    server = SGLangServer(args.sglang_python, model_dir, out / "server.log", port=free_port(),
                          extra_args=["--enable-return-routed-experts", "--skip-tokenizer-init"])
    atexit.register(server.stop)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally below, which stops the server

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        report.log(f"starting SGLang with --enable-return-routed-experts on {server.url} (log: {server.log_path})")
        server.start()
        try:
            report.figures["startup_s"] = round(wait_healthy(server, args.startup_timeout_s, report.log), 1)
        except CheckFailed as exc:
            report.log(f"error: {exc}")
            report.check("server starts with --enable-return-routed-experts", False, str(exc)[:800])
            return 2
        layout = RouteLayout.of_checkpoint(str(model_dir))
        engine = SGLangEngine([server.url], weight_dir=str(out / "weights"), hf_checkpoint=str(model_dir),
                              timeout_s=60, generate_timeout_s=300, update_timeout_s=300, route_layout=layout)
        rng = random.Random(args.seed)
        prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(args.batch)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        sampled = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, n=2,
                                 seed=args.seed)
        reference = HFRoutes(model_dir)

        def run(name: str, sampling: SamplingParams, ref: HFRoutes) -> list[Sample]:
            t = time.monotonic()
            samples = engine.generate([GenerateRequest(list(p), i) for i, p in enumerate(prompts)], sampling)
            seconds = time.monotonic() - t
            equal, total, diffs = compare(samples, ref)
            tokens = sum(s.routed_experts.tokens for s in samples if s.routed_experts is not None)
            report.figures[name] = {"samples": len(samples), "route_tokens": tokens, "pairs_equal": equal,
                                    "pairs": total, "generate_s": round(seconds, 2),
                                    "route_bytes_per_token": samples[0].routed_experts.array.nbytes
                                    / samples[0].routed_experts.tokens if samples[0].routed_experts else None}
            report.check(f"{name}: SGLang's routes equal one HF forward's over prompt + response "
                         f"({equal}/{total} token-layer top-k sets)", equal == total, "; ".join(diffs))
            return samples

        run("greedy", greedy, reference)
        run("sampled_n2_shared_prefix", sampled, reference)
        _update(engine, other_dir)
        updated = run("after_weight_update", greedy, HFRoutes(other_dir))
        stale, total, _ = compare(updated, reference)  # the old weights' experts for the same tokens
        report.figures["after_weight_update"]["pairs_equal_to_old_weights"] = stale
        report.check(f"after_weight_update: the routes moved with the weights ({total - stale}/{total} token-layer "
                     "sets differ from the old weights' choice)", stale < total)
        engine.close()
        report.check("server alive at the end", server.alive(), "" if server.alive() else server.log_tail())
    except CheckFailed as exc:
        report.check("route checks ran", False, str(exc))
    finally:
        server.stop()
        report.figures["total_s"] = round(time.monotonic() - report.t0, 1)
        report.save()
    failed = report.failed
    report.log(f"{len(report.checks) - len(failed)} passed, {len(failed)} failed  (figures: {out / 'figures.json'})")
    return 1 if failed else 0


def _update(engine: SGLangEngine, model_dir: Path) -> None:
    """The disk route with another checkpoint's tensors (what a weight sync sends)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    engine.update_weights(list(tensors.items()), 1)


if __name__ == "__main__":
    sys.exit(main())
