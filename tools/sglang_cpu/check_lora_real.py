"""``--lora-sync adapter`` against REAL SGLang 0.5.23 on a CPU-only machine: the adapters it serves.

Starts ``sglang.launch_server`` (the CPU route of ``check_real_sglang.py``) on a tiny random Qwen2 with the
server flags the launcher adds for ``--lora-sync adapter`` (``launcher.lora_server_args``: ``--enable-lora
--max-lora-rank R --lora-target-modules ...``) and ``--lora-backend torch_native``. The trainer is HF PEFT
itself (random A and B on every linear): its adapter tensors under PEFT's saved keys are what the backends'
``export_adapters`` give. Through megatron_rl's ``DiskSynchronizer`` (adapter mode) and ``SGLangEngine``:

1. version 0 carries the base model (``/update_weights_from_disk``: its index keeps the adapter file out of
   SGLang's loader) and the adapter (``/load_lora_adapter``); versions 1 and 2 the adapter alone (bytes checked),
   each loaded under its own name with the previous one unloaded;
2. every version's greedy generations (named through ``lora_path``) equal HF + PEFT: the same tokens, and
   SGLang's log-probs within ``--tol`` of a teacher-forced PEFT forward over prompt + response;
3. the base model before any adapter equals plain HF, and the adapter visibly changes what is generated;
4. ``python -m megatron_rl.train --lora-rank 8 --lora-sync adapter`` (megatron-core, one CPU rank) against
   the server: exits 0, the first sync carries the base and the rest the adapter alone, and the trainer's
   old log-probs equal SGLang's rollout log-probs (``train/mismatch_abs_logprob``);
5. ``SGLangClient.load_lora_adapter_from_tensors`` (SGLang's from-tensors route): generation under it equals
   HF PEFT's;
6. SGLang's replies to what the CPU stand-in (``tests/rollout/sglang_standin.py``) also answers: a name
   loaded twice, an unknown name unloaded, a request naming an adapter never loaded, an unloaded adapter named
   again (SGLang reloads it from its path): the stand-in's words are these.

SGLang's LoRA layers page-lock small host tensors (``pin_memory=True``), which needs CUDA; the CPU stand-in
``sgl_kernel`` makes page-locking a no-op without CUDA (``tools/sglang_cpu/sgl_kernel/_pinless.py``), the
only change. Run through ``scripts/test_sglang_real.sh --lora``. Writes figures.json / check.log /
server.log under ``--out``; exit 0 all passed, 1 a check failed, 2 the server could not be started.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402 - after the repo is on sys.path

from check_real_sglang import (CheckFailed, Report, SGLangServer, build_model, finish,  # noqa: E402
                               start_checked)
from megatron_rl.backends.base import bucketed  # noqa: E402
from megatron_rl.config import parse_config  # noqa: E402
from megatron_rl.data.types import GenerateRequest, SamplingParams  # noqa: E402
from megatron_rl.infra.ports import free_port  # noqa: E402
from megatron_rl.models.peft_adapter import AdapterExport  # noqa: E402
from megatron_rl.rollout.sglang import SGLangClient, SGLangEngine  # noqa: E402
from megatron_rl.rollout.sglang.launcher import lora_server_args  # noqa: E402
from megatron_rl.weight_sync.disk import DiskSynchronizer  # noqa: E402

RANK, ALPHA = 8, 16.0


class PeftTrainer:
    """HF PEFT as the trainer: ``export_adapters`` / ``export_weights`` as the TrainBackend contract says."""

    def __init__(self, hf_dir: Path):
        import transformers
        from peft import LoraConfig, get_peft_model
        from safetensors.torch import load_file

        self.names = list(load_file(str(hf_dir / "model.safetensors")))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        self.pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")).eval()

    def step(self, seed: int) -> None:
        """New adapter values, large enough to change the greedy tokens (what training does to them)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in self.pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.15)

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        return AdapterExport({n.replace(".default.weight", ".weight"): p.detach().clone()
                              for n, p in self.pm.named_parameters() if "lora_" in n}, RANK, ALPHA)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False, merge_adapters: bool = True):
        if merge_adapters:
            state = copy.deepcopy(self.pm).merge_and_unload().state_dict()
        else:
            state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                     for k, v in self.pm.state_dict().items() if "lora_" not in k}
        return bucketed(((n, state[n].detach().clone()) for n in self.names), bucket_bytes)

    def logprobs(self, prompt: list[int], response: list[int], adapter: bool = True) -> list[float]:
        """Teacher-forced log-probs of ``response`` after ``prompt`` (float32, PEFT's unmerged forward)."""
        ids = torch.tensor([prompt + response])
        with torch.no_grad(), (contextlib.nullcontext() if adapter else self.pm.disable_adapter()):
            logits = self.pm(ids).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        return [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/sglang_lora", help="output dir: figures.json, check.log, server.log")
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"))
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest |SGLang - PEFT| log-prob allowed (fp32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-rollout", type=int, default=3, help="rollouts of the end-to-end run")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    if not os.access(args.sglang_python, os.X_OK):
        report.log(f"error: {args.sglang_python} is not an executable python; run scripts/sglang_cpu_install.sh")
        return 2
    model_dir = build_model(out, args.seed)
    cfg = parse_config(["--hf-checkpoint", str(model_dir), "--lora-rank", str(RANK), "--lora-sync", "adapter"],
                       validate=False)
    server_args = lora_server_args(cfg) + ["--lora-backend", "torch_native", "--skip-tokenizer-init"]
    server = SGLangServer(args.sglang_python, model_dir, out / "server.log", port=free_port(), extra_args=server_args)
    try:
        if not start_checked(report, server, args.startup_timeout_s, "server starts with --enable-lora"):
            return 2
        engine = SGLangEngine([server.url], timeout_s=60, generate_timeout_s=300, update_timeout_s=300,
                              health_interval_s=0, releases_memory=False)
        trainer = PeftTrainer(model_dir)
        rng = random.Random(args.seed)
        prompts = [[1] + [rng.randrange(3, 30) for _ in range(rng.randrange(3, 10))] for _ in range(args.batch)]
        requests = [GenerateRequest(list(p), i) for i, p in enumerate(prompts)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)

        def against_peft(name: str, adapter: bool) -> list[list[int]]:
            samples = engine.generate(requests, greedy)
            worst, tokens_equal = 0.0, True
            for s in samples:
                want = trainer.logprobs(list(s.prompt_ids), list(s.response_ids), adapter=adapter)
                worst = max([worst] + [abs(a - b) for a, b in zip(s.rollout_logprobs, want)])
                # greedy: each token SGLang chose is PEFT's argmax too, unless two logits tie within the tolerance
                ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
                with torch.no_grad(), (contextlib.nullcontext() if adapter else trainer.pm.disable_adapter()):
                    lp = torch.log_softmax(trainer.pm(ids).logits[0].float(), -1)
                for t, tok in enumerate(s.response_ids):
                    row = lp[len(s.prompt_ids) - 1 + t]
                    tokens_equal &= bool(row[tok] >= row.max() - args.tol)
            report.figures[name] = {"samples": len(samples), "max_abs_logprob_diff": worst,
                                    "weight_versions": sorted({s.weight_version for s in samples})}
            report.check(f"{name}: SGLang's greedy tokens are PEFT's and its log-probs within {args.tol:g} "
                         f"(max {worst:.2e})", tokens_equal and worst <= args.tol)
            return [list(s.response_ids) for s in samples]

        base_tokens = against_peft("base_before_any_adapter", adapter=False)
        sync = DiskSynchronizer(1 << 20, adapter=True, disk_dir=str(out / "weights"), hf_checkpoint=str(model_dir))
        adapter_bytes = None
        for version in range(3):
            trainer.step(args.seed + 10 + version)
            t = time.monotonic()
            m = sync.sync(trainer, engine, version=version)
            adapter_bytes = trainer.export_adapters().nbytes
            report.figures[f"sync_v{version}"] = {"s": round(time.monotonic() - t, 2), "bytes": m["sync/bytes"],
                                                  "base_bytes": m["sync/base_bytes"], "adapter_bytes": adapter_bytes}
            if version:
                report.check(f"v{version}: the sync sent the adapter alone ({adapter_bytes} bytes)",
                             m["sync/bytes"] == adapter_bytes and m["sync/base_bytes"] == 0)
            else:
                report.check("v0: the first sync sent the base model with the adapter", m["sync/base_bytes"] > 0)
            tokens = against_peft(f"adapter_v{version}", adapter=True)
            report.check(f"v{version}: every sample generated at weight version {version}",
                         report.figures[f"adapter_v{version}"]["weight_versions"] == [version])
            if version == 0:
                changed = sum(a != b for a, b in zip(tokens, base_tokens))
                report.check(f"v0: the adapter changes what is generated ({changed}/{len(tokens)} responses)",
                             changed > 0)
        from_tensors(report, server, trainer, requests, greedy, args)
        with SGLangClient(server.url, connect_retries=0) as client:
            info = client.request("GET", "/v1/models").json()
            names = sorted(m.get("id") for m in info.get("data", []) if m.get("id", "").startswith("mrl-lora-v"))
            report.figures["adapters_listed"] = names
            report.check("only the newest version's adapter stays loaded (/v1/models)", names == ["mrl-lora-v2"],
                         str(names))
            replies(report, client, out / "weights" / "v2")
        engine.close()
        e2e(report, server, model_dir, args)
        report.check("server alive at the end", server.alive(), "" if server.alive() else server.log_tail())
    except CheckFailed as exc:
        report.check("LoRA checks ran", False, str(exc))
    finally:
        server.stop()
    return finish(report, out)


def from_tensors(report: Report, server: SGLangServer, trainer: PeftTrainer, requests, greedy,
                 args: argparse.Namespace) -> None:
    """``SGLangClient.load_lora_adapter_from_tensors`` (file-system shared CPU tensors, PEFT's keys and config):
    generation under that adapter equals HF PEFT's. The transports do not use this route yet (the disk one
    loads a PEFT dir); this checks the client's side of SGLang's from-tensors protocol."""
    trainer.step(args.seed + 99)
    adapter = trainer.export_adapters()
    with SGLangClient(server.url, connect_retries=0) as client:
        client.load_lora_adapter_from_tensors("from-tensors", adapter.config(), adapter.tensors.items())
        worst, same = 0.0, True
        for req in requests:
            entry = client.generate([req.prompt_ids], [{"max_new_tokens": greedy.max_new_tokens, "temperature": 0.0,
                                                        "ignore_eos": True}], lora_path="from-tensors")[0]
            got = [lp for lp, _tok, _ in entry["meta_info"]["output_token_logprobs"]]
            want = trainer.logprobs(list(req.prompt_ids), list(entry["output_ids"]))
            worst = max([worst] + [abs(a - b) for a, b in zip(got, want)])
            same &= len(got) == len(want) == greedy.max_new_tokens
        client.unload_lora_adapter("from-tensors")
    report.figures["from_tensors_max_abs_logprob_diff"] = worst
    report.check(f"from tensors: the adapter loaded by /load_lora_adapter_from_tensors generates as HF PEFT "
                 f"(log-probs within {worst:.2e})", same and worst <= args.tol)


def e2e(report: Report, server: SGLangServer, model_dir: Path, args: argparse.Namespace) -> None:
    """``python -m megatron_rl.train --lora-rank 8 --lora-sync adapter`` on one CPU rank against the server (which
    still holds adapters named like this run's first versions: they are replaced). The trainer's old log-probs,
    computed by megatron-core with its adapters, equal SGLang's rollout log-probs (train/mismatch_abs_logprob):
    the server generated with the trainer's adapters."""
    import json
    import shutil
    import subprocess

    from megatron_rl.data import synthetic

    out = report.out / "e2e"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    synthetic.write_prompt_file(str(out / "prompts.jsonl"), 64, 4, seed=args.seed + 1)
    cmd = [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(model_dir), "--prompt-data",
           str(out / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--num-rollout", str(args.num_rollout),
           "--lr", "1e-2", "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-sync", "adapter",
           "--rollout-backend", "sglang", "--rollout-engine-urls", server.url, "--update-weight-transport", "disk",
           "--update-weight-disk-dir", str(out / "weights"), "--output-dir", str(out / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    report.log("e2e: " + " ".join(cmd))
    t = time.monotonic()
    with open(out / "train.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = None
    report.figures["e2e_wall_s"] = round(time.monotonic() - t, 1)
    tail = "\n".join((out / "train.log").read_text(errors="replace").splitlines()[-25:])
    if not report.check("e2e: python -m megatron_rl.train --lora-sync adapter against real SGLang exits 0", rc == 0,
                        f"rc={rc}; log tail:\n{tail}"):
        return
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    syncs = [r for r in records if "sync/weight_version" in r]
    steps = [r for r in records if "perf/step_time_s" in r]
    mismatch = [r["train/mismatch_abs_logprob"] for r in steps if "train/mismatch_abs_logprob" in r]
    report.figures["e2e_sync_bytes"] = [r.get("sync/bytes") for r in syncs]
    report.figures["e2e_base_bytes"] = [r.get("sync/base_bytes") for r in syncs]
    report.figures["e2e_mismatch_abs_logprob"] = mismatch
    report.check("e2e: the first sync carried the base, every later one the adapter alone",
                 bool(syncs) and syncs[0].get("sync/base_bytes", 0) > 0
                 and all(r.get("sync/base_bytes") == 0 and r.get("sync/adapter_bytes", 0) > 0 for r in syncs[1:]),
                 str(report.figures["e2e_base_bytes"]))
    report.check(f"e2e: SGLang's rollout log-probs equal the LoRA trainer's (max mismatch "
                 f"{max(mismatch) if mismatch else float('nan'):.2e} <= {args.tol:g})",
                 len(mismatch) == args.num_rollout and max(mismatch) <= args.tol, str(mismatch))


def replies(report: Report, client: SGLangClient, peft_dir: Path) -> None:
    """SGLang's words for what the CPU stand-in also refuses (tests/weight_sync/test_lora_adapter_sync.py holds the
    stand-in to these)."""
    def words(call) -> str:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the message is what is compared
            return str(getattr(exc, "server_message", None) or exc)
        return "(accepted)"

    expected = {
        "load_twice": "Failed to load LoRA adapter mrl-lora-v2 because it is already loaded",
        "unload_unknown": "LoRA with name nope does not exist",
        "never_loaded": "Got LoRA adapter that has never been loaded: nope",
    }
    got = {
        "load_twice": words(lambda: client.load_lora_adapter("mrl-lora-v2", str(peft_dir))),
        "unload_unknown": words(lambda: client.unload_lora_adapter("nope")),
        "never_loaded": words(lambda: client.generate([[1, 5]], [{"max_new_tokens": 1}], lora_path="nope")),
    }
    report.figures["replies"] = got
    for key, want in expected.items():
        report.check(f"SGLang's reply ({key}) has the stand-in's words: {want!r}", want in got[key], got[key])
    client.unload_lora_adapter("mrl-lora-v2")
    again = words(lambda: client.generate([[1, 5]], [{"max_new_tokens": 1}], lora_path="mrl-lora-v2"))
    report.check("an unloaded adapter a request names is loaded again from its path (as the stand-in does)",
                 again == "(accepted)", again)


if __name__ == "__main__":
    sys.exit(main())
