"""Samples per second of ``--async-mode off``, ``one-step`` and ``full`` on the same ranks, model and prompts.

Full mode runs twice: ``full`` with ``--partial-rollout --pause-generation-mode in_place`` (the rows in flight stay
parked on the engine across each sync, with their KV cache, and the engine generates while the trainer exports
and writes the weights) and ``full-abort`` with ``--pause-generation-mode abort`` (they are aborted before each
sync and resubmitted after it, prompt + tokens, the cache computed again).

One trainer (``python -m megatron_rl.train``, megatron-core, one CPU rank, one thread) and one engine in a
process of its own (one thread): the embedded engine server the run starts with ``--embedded-engine-ranks
process`` (``rollout.embedded_server``: SGLang's HTTP protocol, rows of concurrent requests batched), synced
from disk, the same in every mode. The shape is generation-heavy (long
responses on a small model), where overlapping generation with training pays. The modes run
interleaved (off, one-step, full, off, ...) so a machine that slows down mid-run slows all of them;
each run's first step (start-up, first compile) is left out. Printed per mode: samples/s (the median
over runs of trained samples over the steps' wall time), the ratio to ``off``, and the engine and
trainer idle fractions the loop logs (``perf/engine_idle_frac``, ``perf/trainer_idle_frac``); per run also the
generation span of its first and last batch (``rollout/time_s``: a span that grows over a run is an engine that
slows down as the run goes on).

    python benchmarks/async_rl.py [--steps 8] [--repeat 2] [--response-len 192] [--max-staleness 1] [--out DIR]
        [--modes off,one-step,full,full-abort]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


FULL = ["--async-mode", "full", "--partial-rollout"]
MODES = {"off": [], "one-step": ["--async-mode", "one-step"],
         "full": [*FULL, "--pause-generation-mode", "in_place"],
         "full-abort": [*FULL, "--pause-generation-mode", "abort"]}


def run_mode(mode: str, args, model: str, prompts: str, work: str, k: int) -> dict:
    out = os.path.join(work, f"{mode}_{k}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([work, REPO])}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", model, "--prompt-data", prompts,
           "--custom-rm-path", "parity_reward:score", "--rollout-batch-size", str(args.groups),
           "--n-samples-per-prompt", str(args.n), "--rollout-max-response-len", str(args.response_len),
           "--num-rollout", str(args.steps), "--lr", "1e-4", "--rollout-backend", "embedded",
           "--embedded-engine-ranks", "process", "--output-dir", out, *MODES[mode],
           *(["--max-staleness", str(args.max_staleness)] if mode.startswith("full") else [])]
    t = time.monotonic()
    with open(out + ".log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{mode} run {k} exited {rc}; see {out}.log")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        steps = [r for r in map(json.loads, fh) if "train/pg_loss" in r][1:]  # the first step: start-up
    wall = sum(r["perf/step_time_s"] for r in steps)
    samples = len(steps) * args.groups * args.n
    if mode == "off":  # in turn: the engines idle while the trainer trains, the trainer while they generate
        for r in steps:
            share = r["perf/generate_s"] / r["perf/step_time_s"]
            r["perf/engine_idle_frac"], r["perf/trainer_idle_frac"] = 1.0 - share, share
    return {"samples_per_s": samples / wall, "wall_s": time.monotonic() - t,
            # one-step's last step generates nothing ahead, so it has no idle fractions
            "engine_idle": statistics.mean(r["perf/engine_idle_frac"] for r in steps if "perf/engine_idle_frac" in r),
            "trainer_idle": statistics.mean(r["perf/trainer_idle_frac"] for r in steps
                                            if "perf/trainer_idle_frac" in r),
            "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in steps),
            # a batch's generation span (its first group's start to its last group's end): in full mode it grows
            # from step to step when the engine's batch gets slower as the run goes on
            "span_first": steps[0]["rollout/time_s"], "span_last": steps[-1]["rollout/time_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="rollouts per run (the first is left out)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per mode, interleaved")
    ap.add_argument("--groups", type=int, default=4, help="--rollout-batch-size")
    ap.add_argument("--n", type=int, default=4, help="--n-samples-per-prompt")
    ap.add_argument("--response-len", type=int, default=192, help="--rollout-max-response-len")
    ap.add_argument("--max-staleness", type=int, default=1, help="full mode's --max-staleness")
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--out", default=None, help="work dir (default: a temp dir)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)} (off first: "
                    "the ratios are to it)")
    args = ap.parse_args(argv)
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    work = args.out or tempfile.mkdtemp(prefix="async_rl_")
    os.makedirs(work, exist_ok=True)
    model = build_tiny_hf_model(args.family, os.path.join(work, "model"))
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as fh:
        for i in range(4096):
            fh.write(json.dumps({"prompt": [3, 4, 5 + i % 50], "label": str(i)}) + "\n")
    with open(os.path.join(work, "parity_reward.py"), "w") as fh:
        fh.write("def score(sample):\n    return float(sample.response_ids[-1] % 2)\n")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or modes[:1] != ["off"]:
        ap.error(f"--modes {args.modes}: start with off, then any of {', '.join(MODES)}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for k in range(args.repeat):
        for mode in modes:
            r = run_mode(mode, args, model, prompts, work, k)
            results[mode].append(r)
            print(f"  {mode:9s} run {k}: {r['samples_per_s']:.2f} samples/s (engine idle {r['engine_idle']:.2f}, "
                  f"trainer idle {r['trainer_idle']:.2f}, staleness max {r['staleness_max']:.0f}, "
                  f"batch span {r['span_first']:.2f} -> {r['span_last']:.2f} s, "
                  f"{r['wall_s']:.0f} s)", flush=True)
    base = statistics.median(r["samples_per_s"] for r in results["off"])
    print(f"\n{args.groups} prompts x {args.n} samples, responses <= {args.response_len} tokens, {args.family} tiny; "
          f"{args.steps - 1} steps x {args.repeat} runs per mode; full: --max-staleness {args.max_staleness}")
    print(f"{'mode':10s} {'samples/s':>10s} {'vs off':>7s} {'engine idle':>12s} {'trainer idle':>13s}")
    summary = {}
    for mode, runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        engine_idle = statistics.median(r["engine_idle"] for r in runs)
        trainer_idle = statistics.median(r["trainer_idle"] for r in runs)
        summary[mode] = {"samples_per_s": sps, "vs_off": sps / base, "engine_idle": engine_idle,
                         "trainer_idle": trainer_idle}
        print(f"{mode:10s} {sps:10.2f} {sps / base:6.2f}x {engine_idle:12.2f} {trainer_idle:13.2f}")
    with open(os.path.join(work, "async_rl.json"), "w") as fh:
        json.dump({"args": vars(args), "runs": results, "summary": summary}, fh, indent=1)
    print(f"(results: {os.path.join(work, 'async_rl.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
