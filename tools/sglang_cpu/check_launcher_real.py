"""The RL loop launching REAL SGLang 0.5.23 engines itself, on this CPU machine (issue 14).

Not part of the test suite (SGLang's CPU route needs its own 7 GB venv and 1-2 minutes per engine
start): ``bash scripts/test_sglang_real.sh --launcher`` runs it after installing that venv. Checks:

1. ``python -m megatron_rl.train --rollout-backend sglang`` (no URLs) with ``--rollout-engine-python``
   pointing at the SGLang venv and the CPU route as ``--sglang-*`` flags: the launcher starts
   ``sglang.launch_server``, waits for ``/health``, the run trains ``--num-rollout`` steps through the
   transport ``auto`` picks for separate engines (distributed, gloo on CPU), the samples of rollout
   ``i`` carry weight version ``i``, and the engine's process group is gone after the run;
2. the same with ``--colocate``: ``auto`` picks the tensor transport (flattened buckets through
   file-system shared memory into the engine process), the engine keeps its memory (SGLang on CPU
   cannot release it);
3. the engine killed (SIGKILL to its process group) while the run is going: the run stops with exit 2
   and an error naming the engine and its log file, within a bounded time (no hang).

Writes ``launcher_figures.json`` and logs under ``--out``; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
KERNEL_STANDIN = Path(__file__).resolve().parent  # the CPU test stand-in for sgl_kernel (sgl_kernel/)

from megatron_rl.data import synthetic  # noqa: E402 - after the path set-up above

CPU_ROUTE = ["--sglang-device", "cpu", "--sglang-attention-backend", "torch_native", "--sglang-sampling-backend",
             "pytorch", "--sglang-disable-overlap-schedule", "--sglang-disable-cuda-graph", "--sglang-dtype",
             "float32", "--sglang-mem-fraction-static", "0.05", "--sglang-max-total-tokens", "8192",
             "--sglang-skip-server-warmup", "--sglang-disable-radix-cache"]


def _train_cmd(args, model: Path, prompts: Path, out: Path, num_rollout: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(model), "--prompt-data", str(prompts),
            "--input-key", "prompt", "--label-key", "label", "--custom-rm-path",
            "megatron_rl.data.synthetic:digit_reward", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "6", "--num-rollout", str(num_rollout), "--lr", "1e-3",
            "--rollout-num-gpus", "1", "--rollout-engine-python", args.sglang_python,
            "--rollout-engine-startup-timeout", str(args.startup_timeout_s), *CPU_ROUTE,
            "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt"),
            "--output-dir", str(out / "run"), *extra]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(KERNEL_STANDIN)])}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _engine_pid(log: Path) -> int | None:
    """The engine's launcher pid, from the "started ... pid N" line the trainer logs."""
    for line in log.read_text(errors="replace").splitlines():
        if "started SGLang engine 0" in line and "pid" in line:
            return int(line.rsplit("pid", 1)[1].strip().split()[0])
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/sglang_launcher_real")
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"))
    ap.add_argument("--num-rollout", type=int, default=3)
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--skip-kill", action="store_true", help="only the training run, not the killed engine")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        synthetic.prepare(str(out))  # the demo's tiny model with its digit tokenizer, and prompts
    prompts = out / "prompts.jsonl"
    figures: dict = {}
    ok = True

    def check(name: str, cond: bool, detail: str = "") -> bool:
        nonlocal ok
        ok &= bool(cond)
        print(f"{'PASS' if cond else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
        return bool(cond)

    run = out / "train"
    t = time.monotonic()
    with open(out / "train.log", "w") as log:
        proc = subprocess.run(_train_cmd(args, model, prompts, run, args.num_rollout), cwd=REPO, env=_env(),
                              stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    figures["train_wall_s"] = round(time.monotonic() - t, 1)
    tail = "\n".join((out / "train.log").read_text(errors="replace").splitlines()[-30:])
    if check("launched real SGLang: python -m megatron_rl.train exits 0", proc.returncode == 0,
             f"rc={proc.returncode}" + ("" if proc.returncode == 0 else "\n" + tail)):
        records = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "perf/step_time_s" in r]
        figures["startup_engines_s"] = next((round(r["perf/startup_engines_s"], 1) for r in records
                                             if "perf/startup_engines_s" in r), None)
        figures["transport"] = "distributed" if any("sync/broadcast_s" in r for r in records) else "other"
        figures["reward"] = [round(r.get("rollout/reward_mean", -1), 3) for r in steps]
        figures["step_s"] = [round(r["perf/step_time_s"], 2) for r in steps]
        check("one record per rollout", len(steps) == args.num_rollout, f"{len(steps)}")
        check("transport auto = distributed for separate engines", figures["transport"] == "distributed")
        import torch  # noqa: PLC0415 - only after the run (the check reads the saved rollouts)

        versions = [sorted({s["weight_version"] for s in torch.load(run / "rollouts" / f"rollout_{i}.pt",
                                                                       weights_only=False)["samples"]})
                    for i in range(args.num_rollout)]
        figures["sample_weight_versions"] = versions
        check("samples of rollout i carry weight version i", versions == [[i] for i in range(args.num_rollout)],
              str(versions))
        pid = _engine_pid(out / "train.log")
        gone = False
        for _ in range(100):  # SIGKILLed children are reaped by init a moment after the run exits
            try:
                os.killpg(pid, 0) if pid is not None else None
            except ProcessLookupError:
                gone = True
                break
            time.sleep(0.1)
        check("the engine's process group is gone after the run", gone, f"pid {pid}")
        log_file = run / "run" / "engines" / "engine_0.log"
        check("the engine's log is kept", log_file.exists() and "sglang.launch_server" in log_file.read_text())

    run = out / "colocated"
    t = time.monotonic()
    with open(out / "colocated.log", "w") as log:
        proc = subprocess.run(_train_cmd(args, model, prompts, run, args.num_rollout, "--colocate"), cwd=REPO,
                              env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    figures["colocated_wall_s"] = round(time.monotonic() - t, 1)
    tail = "\n".join((out / "colocated.log").read_text(errors="replace").splitlines()[-30:])
    if check("colocated (tensor transport): python -m megatron_rl.train exits 0", proc.returncode == 0,
             f"rc={proc.returncode}" + ("" if proc.returncode == 0 else "\n" + tail)):
        records = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        syncs = [r for r in records if "sync/post_s" in r]
        figures["colocated_sync_s"] = [round(r["sync/time_s"], 3) for r in syncs]
        figures["colocated_step_s"] = [round(r["perf/step_time_s"], 2) for r in records if "perf/step_time_s" in r]
        check("colocated: every sync went through the tensor transport, versions 0..N",
              [r["sync/weight_version"] for r in syncs] == [float(v) for v in range(args.num_rollout + 1)],
              str([r["sync/weight_version"] for r in syncs]))
        import torch  # noqa: PLC0415 - only after the run

        versions = [sorted({s["weight_version"] for s in torch.load(run / "rollouts" / f"rollout_{i}.pt",
                                                                       weights_only=False)["samples"]})
                    for i in range(args.num_rollout)]
        check("colocated: samples of rollout i carry weight version i",
              versions == [[i] for i in range(args.num_rollout)], str(versions))
        mism = [r.get("train/mismatch_abs_logprob") for r in records if "train/mismatch_abs_logprob" in r]
        figures["colocated_mismatch_abs_logprob"] = mism
        check("colocated: engine-vs-trainer log-prob mismatch logged every step and small",
              len(mism) == args.num_rollout and max(mism) < 1e-3, str(mism))

    if not args.skip_kill:
        run = out / "killed"
        t = time.monotonic()
        with open(out / "killed.log", "w") as log:
            proc = subprocess.Popen(_train_cmd(args, model, prompts, run, 50), cwd=REPO, env=_env(),
                                    stdout=log, stderr=subprocess.STDOUT)
            pid, killed_at = None, None
            while proc.poll() is None and time.monotonic() - t < args.timeout_s:
                metrics = run / "run" / "metrics.jsonl"
                if killed_at is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    pid = _engine_pid(out / "killed.log")
                    if pid:
                        os.killpg(pid, signal.SIGKILL)
                        killed_at = time.monotonic()
                time.sleep(0.5)
            if proc.poll() is None:
                proc.kill()
        text = (out / "killed.log").read_text(errors="replace")
        figures["killed_exit_after_s"] = None if killed_at is None else round(time.monotonic() - killed_at, 1)
        err = next((x for x in text.splitlines() if x.startswith("error:")), "")
        figures["killed_error"] = err[:400]
        check("the engine was killed mid-run", killed_at is not None)
        check("the run stops with exit 2 and an error naming the engine and its log",
              proc.returncode == 2 and "SGLang engine 0" in text and "engine_0.log" in text,
              f"rc={proc.returncode}; {err[:300]}")
    (out / "launcher_figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
