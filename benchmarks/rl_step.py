"""The CPU demo's RL step split by phase, at 1 and 2 processes, against its compute floor.

Framework side: ``scripts/run_demo_cpu.sh`` itself (its exact model and flags, torchrun,
gloo, ``OMP_NUM_THREADS=1``) for ``--warmup + --steps`` rollouts; the per-phase
``perf/*_s`` the loop logs every step (docs/metrics.md) are averaged over the steps after
the warm-up. Eval steps have their ``perf/eval_s`` taken out (evaluation is not the step).
Start-up is the wall time from launching the script to the step-0 record (the initial
weight sync, just before the first rollout), with the demo's model and prompts already
written (the script then only checks they exist); the driver's own
phases after ``main`` began (``perf/startup_*_s``) are printed with it.

Compute floor: the same work on one thread in plain torch, in this process, with the
demo's HF weights (``transformers`` Qwen2) and no framework around it: sample the same
32 prompts x 8 completions of up to 6 tokens with a KV cache (each prompt prefilled
once), score them with the demo's reward, one no-grad forward for the old log-probs and
one with a second, frozen copy of the weights for the reference ones, then the demo's 2
optimizer steps of 128 completions (forward, GRPO clip loss + k3 KL, backward, clip,
Adam). No weight sync: the sampling model IS the trained one.

Drift: this class of VM changes speed by 20-60% within minutes (the floor itself moves
that much between runs), so one framework run against one floor says little. The run
is done in ``--rounds`` rounds; each round measures the floor (median of ``--repeats``),
then every variant, each followed by the floor again, and a variant's ratio in that
round is its step over the mean of the two floors measured just before and just after
it. Steps and floor repetitions are summarised by their median (the steal bursts hit
single steps; a best-of floor against a mean step would charge them to the framework).
Reported: the per-round ratios and their median (and 2 proc / 1 proc per round).

    python benchmarks/rl_step.py [--nprocs 1 2] [--steps 8] [--warmup 2] [--rounds 3] [--extra-variant]
                                 [--driver-engine] [--in-process]

``--in-process`` first runs the loop's own pieces (generate, ``train_on_rollout``, sync) at
1 process inside this process, alternating with the floor step by step (the least drift-prone
ratio, without torchrun, logging or the launcher).

``--extra-variant`` also runs 1 process with ``--use-rollout-logprobs`` (no old-log-prob
forward); ``--driver-engine`` also runs 2 processes with the embedded engine on the driver
alone (``--embedded-engine-ranks driver``), against the default replica on every rank.
Run it on a quiet machine (load average well under 1 per process used).
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

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["generate", "old_logprob", "ref_logprob", "train", "sync"]  # + broadcast, reward (inside generate)
PROMPTS, N_SAMPLES, MAX_NEW, GBS, CLIP, KL_COEF, LR = 32, 8, 6, 128, 0.2, 0.05, 1e-3


# ---------------------------------------------------------------- framework side


def run_demo(out: str, nproc: int, rollouts: int, *extra: str) -> tuple[list[dict], float]:
    """(metrics records, launch time) of one run of the demo script."""
    env = {**os.environ, "OUT": out, "NPROC": str(nproc), "NUM_ROLLOUT": str(rollouts), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run(["bash", "scripts/run_demo_cpu.sh", "--no-auto-resume", *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        sys.exit(f"demo run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh], t0


def phase_medians(records: list[dict], warmup: int) -> dict[str, float]:
    """Per phase, the median over the measured steps (bursts of the VM's steal time hit single steps:
    a median, like the floor's, is not dragged by them; a mean would be)."""
    steps = [r for r in records if "perf/step_time_s" in r][warmup:]
    med = (lambda key: statistics.median(r.get(key, 0.0) for r in steps))
    out = {p: med(f"perf/{p}_s") for p in PHASES + ["broadcast", "reward", "weight_swap"]}
    out["step"] = statistics.median(r["perf/step_time_s"] - r.get("perf/eval_s", 0.0) for r in steps)
    out["other"] = out["step"] - sum(out[p] for p in PHASES + ["broadcast"])
    return out


def framework(nproc: int, steps: int, warmup: int, *extra: str) -> dict[str, float]:
    from megatron_rl.data.synthetic import prepare

    with tempfile.TemporaryDirectory(prefix="rl_step_") as out:
        prepare(out)  # the demo's model and prompts exist before the launch: start-up is the engine's alone
        records, t0 = run_demo(out, nproc, warmup + steps, *extra)
        result = phase_medians(records, warmup)
        first = next(r for r in records if r["step"] == 0)
        result["startup"] = first["time"] - t0
        result["startup_phases"] = {k[len("perf/startup_"):-2]: v for k, v in first.items()
                                    if k.startswith("perf/startup_") and k != "perf/startup_s"}
        result["startup_phases"]["total"] = first["perf/startup_s"]
    return result


# ---------------------------------------------------------------- compute floor (plain torch)


def _logprobs(model, ids: torch.Tensor, n_prompt: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, n_prompt - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)


def floor_once(model, ref, opt, prompt_ids: torch.Tensor, labels: list[str], tok, eos: int) -> dict[str, float]:
    from megatron_rl.data.synthetic import score

    t = {}
    start = time.perf_counter()
    with torch.no_grad():  # sample: prefill each prompt once, then 8 rows per prompt share its cache
        out = model(input_ids=prompt_ids, use_cache=True)
        cache = out.cache
        cache.batch_repeat_interleave(N_SAMPLES)
        logits = out.logits[:, -1].repeat_interleave(N_SAMPLES, 0)
        gen = []
        for _ in range(MAX_NEW):
            nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
            gen.append(nxt)
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[:, -1]
    response = torch.cat(gen, 1)
    mask = torch.cumprod(torch.cat([torch.ones_like(response[:, :1]), (response[:, :-1] != eos).long()], 1), 1)
    t["generate"] = time.perf_counter() - start
    start = time.perf_counter()
    texts = tok.batch_decode(response * mask, skip_special_tokens=True)
    rewards = torch.tensor([score(x, labels[i // N_SAMPLES]) for i, x in enumerate(texts)])
    t["reward"] = time.perf_counter() - start
    t["generate"] += t["reward"]
    ids = torch.cat([prompt_ids.repeat_interleave(N_SAMPLES, 0), response], 1)
    n_prompt, maskf = prompt_ids.shape[1], mask.float()
    start = time.perf_counter()
    with torch.no_grad():
        old = _logprobs(model, ids, n_prompt)
    t["old_logprob"], start = time.perf_counter() - start, time.perf_counter()
    with torch.no_grad():
        ref_lp = _logprobs(ref, ids, n_prompt)
    t["ref_logprob"], start = time.perf_counter() - start, time.perf_counter()
    grouped = rewards.view(-1, N_SAMPLES)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    for s in range(0, ids.shape[0], GBS):
        sl = slice(s, s + GBS)
        lp = _logprobs(model, ids[sl], n_prompt)
        ratio = torch.exp(lp - old[sl])
        pg = torch.max(-adv[sl] * ratio, -adv[sl] * ratio.clamp(1 - CLIP, 1 + CLIP))
        log_r = (ref_lp[sl] - lp).clamp(-20, 20)
        kl = (torch.exp(log_r) - log_r - 1).clamp(max=10)
        loss = ((pg + KL_COEF * kl) * maskf[sl]).sum() / maskf[sl].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    t["train"] = time.perf_counter() - start
    t["sync"] = 0.0
    t["step"] = sum(t[p] for p in PHASES)
    return t


def compute_floor(repeats: int):
    """A callable: each call runs the floor ``repeats`` times (after one warm-up) and returns the per-phase median."""
    import transformers

    from megatron_rl.data.synthetic import prepare

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rl_floor_") as out:
        paths = prepare(out)
        model = transformers.AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
        ref = transformers.AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(paths["model"])
        with open(paths["prompts"]) as fh:
            rows = [json.loads(line) for _, line in zip(range(PROMPTS), fh)]
    prompt_ids = torch.tensor([tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows])
    labels = [str(r["label"]) for r in rows]
    model.requires_grad_(True).train()
    ref.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999))
    torch.manual_seed(0)

    def measure() -> dict[str, float]:
        floor_once(model, ref, opt, prompt_ids, labels, tok, tok.eos_token_id)  # warm-up
        runs = [floor_once(model, ref, opt, prompt_ids, labels, tok, tok.eos_token_id) for _ in range(repeats)]
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    return measure


# ---------------------------------------------------------------- in-process, interleaved


def demo_flags(out: str) -> list[str]:
    """The ``megatron_rl.train`` flags of scripts/run_demo_cpu.sh at 1 process (read from the script, so
    the two cannot drift apart), without its output/checkpoint flags (nothing is saved in-process)."""
    import shlex

    with open(os.path.join(REPO, "scripts", "run_demo_cpu.sh")) as fh:
        text = fh.read()
    body = text.split("-m megatron_rl.train", 1)[1].split('"$@"', 1)[0].replace("\\\n", " ")
    for var, value in (("OUT", out), ("NPROC", "1"), ("NUM_ROLLOUT", "1000")):
        body = body.replace(f'"${var}"', value).replace(f"${var}", value)
    flags, skip = [], {"--save", "--save-interval", "--save-max-to-keep", "--output-dir", "--tensorboard-dir"}
    tokens = shlex.split(body)
    i = 0
    while i < len(tokens):
        if tokens[i] in skip:
            i += 2
            continue
        flags.append(tokens[i])
        i += 1
    return flags


def in_process(steps: int, warmup: int, repeats: int) -> None:
    """One process, one thread: per rollout, the loop's own pieces (generate, ``train_on_rollout``, sync)
    and then the floor, alternately, so both see the same machine state; medians over the steps."""
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config
    from megatron_rl.data.synthetic import prepare
    from megatron_rl.rollout.build import build_rollout
    from megatron_rl.runner.step import train_on_rollout
    from megatron_rl.weight_sync import make_synchronizer_from_config

    torch.set_num_threads(1)
    measure_floor = compute_floor(1)
    with tempfile.TemporaryDirectory(prefix="rl_step_inproc_") as out:
        prepare(out)
        cfg = parse_config(demo_flags(out))
        spec = spec_from_config(cfg)
        backend = make_backend(cfg.precision.train_backend)
        backend.initialize(cfg, spec)
        backend.snapshot_weights("ref")  # the KL reference: the initial policy, as the loop's fresh start does
        rollout = build_rollout(cfg)
        sync = make_synchronizer_from_config(cfg)
        sync.sync(backend, rollout.engine, version=0)
        ours: list[dict] = []
        floors: list[dict] = []
        for i in range(warmup + steps):
            perf: dict = {}
            t0 = time.perf_counter()
            samples, _ = rollout.generate(i)
            perf["perf/generate_s"] = time.perf_counter() - t0
            train_on_rollout(backend, spec, samples, cfg, perf=perf)
            t = time.perf_counter()
            sync.sync(backend, rollout.engine, version=i + 1)
            perf["perf/sync_s"] = time.perf_counter() - t
            perf["perf/step_time_s"] = time.perf_counter() - t0
            floor = measure_floor()
            if i >= warmup:
                ours.append(perf)
                floors.append(floor)
    med = statistics.median
    print(f"\nin-process, 1 thread, floor and step alternating ({steps} steps after {warmup} warm-up; medians)")
    total = med(p["perf/step_time_s"] for p in ours)
    f_total = med(f["step"] for f in floors)
    for phase in PHASES + ["broadcast"]:
        v = med(p.get(f"perf/{phase}_s", 0.0) for p in ours)
        fv = med(f.get(phase, 0.0) for f in floors)
        print(f"{phase:<14}{fv:>9.4f}{v:>12.4f}" + (f" ({v / fv:.2f}x)" if fv else ""))
    print(f"{'step':<14}{f_total:>9.4f}{total:>12.4f} ({total / f_total:.2f}x)")
    ratios = [p["perf/step_time_s"] / f["step"] for p, f in zip(ours, floors)]
    print(f"step / floor per step: median {med(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


# ---------------------------------------------------------------- report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=8, help="measured rollouts after the warm-up")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="compute-floor repetitions (median of)")
    ap.add_argument("--rounds", type=int, default=3, help="floor + every variant, this many times (VM drift)")
    ap.add_argument("--extra-variant", action="store_true", help="also 1 process with --use-rollout-logprobs")
    ap.add_argument("--driver-engine", action="store_true",
                    help="also 2 processes with the embedded engine on the driver alone (--embedded-engine-ranks "
                         "driver: the generation before replicas on every rank)")
    ap.add_argument("--in-process", action="store_true",
                    help="also the 1-process step in this process, alternating with the floor step by step")
    args = ap.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    if args.in_process:
        in_process(max(args.steps, 10), args.warmup, args.repeats)
    measure_floor = compute_floor(args.repeats)
    variants = {f"{n} proc": (n,) for n in args.nprocs}
    if args.extra_variant:
        variants["1 proc, rollout logprobs"] = (1, "--use-rollout-logprobs")
    if args.driver_engine:
        variants["2 proc, driver engine"] = (2, "--embedded-engine-ranks", "driver")
    rounds: list[dict] = []  # per round: {variant: (result, floor around it)}
    for k in range(args.rounds):
        before = measure_floor()
        this = {}
        for name, (n, *extra) in variants.items():
            result = framework(n, args.steps, args.warmup, *extra)
            after = measure_floor()
            around = {p: (before[p] + after[p]) / 2 for p in before}
            this[name] = (result, around)
            before = after
        rounds.append(this)
        print(f"round {k + 1}: " + ", ".join(f"{name} {r['step']:.4f} s/step = {r['step'] / f['step']:.2f}x floor "
                                              f"({f['step']:.4f})" for name, (r, f) in this.items()), flush=True)

    def median(xs):
        return statistics.median(xs)

    # the table: per phase, the median over rounds of each variant's time and of its floor
    floor = {p: median([rd[next(iter(variants))][1][p] for rd in rounds]) for p in rounds[0][next(iter(variants))][1]}
    runs = {name: {key: median([rd[name][0][key] for rd in rounds])
                   for key in rounds[0][name][0] if key != "startup_phases"} for name in variants}
    for name in variants:
        runs[name]["startup_phases"] = rounds[-1][name][0]["startup_phases"]
    rows = PHASES + ["broadcast", "other", "step"]
    print(f"\nseconds per RL step (median over {args.rounds} rounds of the median of {args.steps} steps after "
          f"{args.warmup} warm-up; floor: median of {args.repeats}, around each run)")
    print(f"{'phase':<14}{'floor':>9}" + "".join(f"{name:>26}" for name in runs))
    for p in rows:
        cells = "".join(f"{r[p]:>17.4f} ({r[p] / floor[p]:>5.2f}x)" if floor.get(p) else f"{r[p]:>26.4f}"
                        for r in runs.values())
        print(f"{p:<14}{floor.get(p, 0.0):>9.4f}{cells}")
    print(f"{'(reward)':<14}{floor['reward']:>9.4f}" + "".join(f"{r['reward']:>26.4f}" for r in runs.values()))
    print(f"{'(ref swap)':<14}{0.0:>9.4f}" + "".join(f"{r['weight_swap']:>26.4f}" for r in runs.values()))
    print(f"{'start-up':<14}{'':>9}" + "".join(f"{r['startup']:>26.1f}" for r in runs.values()))
    for name in variants:
        ratios = [rd[name][0]["step"] / rd[name][1]["step"] for rd in rounds]
        print(f"{name}: step / floor per round " + ", ".join(f"{x:.2f}" for x in ratios)
              + f"; median {median(ratios):.2f}")
    for name in [v for v in variants if v.startswith("2 proc")] if "1 proc" in variants else []:
        speed = [rd[name][0]["step"] / rd["1 proc"][0]["step"] for rd in rounds]
        print(f"{name} / 1 proc step per round " + ", ".join(f"{x:.2f}" for x in speed)
              + f"; median {median(speed):.2f}")
    for name, r in runs.items():
        print(f"{name}: start-up inside the driver (s, last round): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["startup_phases"].items()))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
