"""Our SGLang client and engine against REAL SGLang 0.5.23 on a CPU-only machine.

CI tests ``megatron_rl/rollout/sglang`` against a protocol stand-in (tests/rollout/sglang_standin.py);
this driver runs the same code against the real server, so a difference between the two shows
up here. Run it through ``scripts/test_sglang_real.sh`` (which installs SGLang into its own venv
first); it is too heavy for the default test command (7 GB install, 1-2 min server start-up).

Runs with OUR venv (megatron_rl + megatron-core); the server runs from the SGLang venv as
``python -m sglang.launch_server`` with the CPU route of docs/sglang-cpu.md
(``SGLANG_USE_CPU_ENGINE=1``, the pure-torch ``sgl_kernel`` stand-in of ``tools/sglang_cpu`` on its
PYTHONPATH, device/attention/sampling args for CPU), on 127.0.0.1 and a free port, in its own
process group that is killed on every exit path (normal end, failed check, exception, SIGTERM,
Ctrl-C). Every wait has a timeout whose error names who did not answer.

Checks, all through ``SGLangEngine`` / ``SGLangClient``:

1. batched greedy ``generate`` with log-probs; the tokens are the argmax and the log-probs agree
   with an HF forward of the same weights (teacher-forced on SGLang's tokens) within ``--logprob-tol``;
2. ``update_weights`` (the disk route, ``VersionedWeightDir``): ``lm_head`` set to zeros gives
   greedy log-probs of exactly -ln(vocab); restoring the weights gives the first log-probs back;
   ``/model_info`` weight_version and each sample's weight_version follow every update;
3. ``update_weight_version``, ``flush_cache`` (idle: 200; with a request running: 400),
   ``pause_generation`` / ``continue_generation``, ``abort_request``, ``health``, ``health_generate``;
4. ``update_weights_from_named_tensors`` inside ``begin_weight_update`` / ``end_weight_update``
   (refused outside the pair), the same zero / restore check;
5. the tensor transport (``weight_sync.sglang_tensor.SGLangTensorSynchronizer``, the engine placed as
   colocated with this one trainer rank): flattened per-dtype buckets (a bf16 zero ``lm_head``
   among fp32 tensors: two requests for its bucket) over ``/update_weights_from_tensor``, the same
   zero / restore check and versions, then the plain route (``load_format`` None); its sync time joins
   the disk / distributed timing below;
6. the distributed transport (``weight_sync.distributed.DistributedSynchronizer``, gloo: our
   trainer end is rank 0 of a group the server joins through ``/init_weights_update_group``):
   the same zero / restore check, versions, ``/update_weights_from_distributed`` refused outside
   begin/end, the group destroyed on the server at ``shutdown()``; the same zero / restore with
   flattened buckets (``load_format="flattened_bucket"``: one uint8 broadcast per bucket, what NCCL
   groups send); then the sync time of the disk and the distributed transports (both ways) on the
   same model, alternating, ``--sync-repeats`` each;
7. ``--update-weight-verify checksum`` (``verify_checksums``, ``weight_sync.sglang_verify``): ``/weights_checker``'s
   ``checksum`` reply (per TP rank, SGLang's fused names); the formula weights of the CI stand-in's fixture give
   the committed reply exactly; the disk, distributed and tensor transports each sync verified (every tensor
   SGLang holds equals the trainer's checksum of the same bytes), with the time of syncs with and without; a
   tensor changed inside the server after each transport's load is named (fused name, engine rank, version) and
   the engine refuses to generate until a verified full sync; ``verify_qwen3``: the same on a second server
   serving a tiny Qwen3 with tied embeddings and ``--dtype auto`` (float16 bytes);
   ``delta_sync``: ``--update-weight-mode delta`` through the host checkpoint (``rollout/sglang/host_checkpoint.py``):
   N delta syncs of sparse Adam-like steps, each verified, leave every tensor SGLang holds with the checksum a full
   sync of the same weights gives; each load carries only the changed tensors; bytes and time, full vs delta;
8. end to end: ``python -m megatron_rl.train`` on one CPU rank with the real megatron-core backend
   against this server, once through the disk transport and once through the distributed one, and
   on 2 torchrun ranks with 2 pipeline stages through the distributed one (``distributed-pp2``: each
   stage's sender makes its own group with the server) (``--e2e-transports``); exit 0, the samples
   of rollout ``i`` carry weight version ``i``; the disk and distributed runs with
   ``--update-weight-verify checksum`` (every sync's tensors in SGLang equal megatron's export);
9. the CI stand-in against the replies recorded above that need a request in flight or a second server, and its
   ``/weights_checker`` checksum reply on the checkpoint against the real one, every value (``standin_fidelity``), and this server against the committed fixture of ``record_replies.py``
   (``fixture_still_holds``: its fixed requests re-sent, statuses, shapes and messages compared; a
   difference means SGLang changed since the recording: ``--record-replies`` refreshes it).

Not called: ``/release_memory_occupation`` / ``/resume_memory_occupation`` (on CPU SGLang calls CUDA
synchronize there: the scheduler dies and the server goes down), ``/get_weights_by_name`` (the
Qwen2 model class lacks it). Writes ``figures.json`` and ``check.log`` under ``--out``; exits 1 if
any check failed, 2 if the server could not be started.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402 - after the repo is on sys.path

from megatron_rl.data import synthetic  # noqa: E402
from megatron_rl.errors import EngineError, SyncError  # noqa: E402
from megatron_rl.infra.ports import free_port  # noqa: E402
from megatron_rl.data.types import GenerateRequest, SamplingParams  # noqa: E402
from megatron_rl.models.hf_tiny import build_tiny_hf_model  # noqa: E402
from megatron_rl.rollout.sglang import SGLangClient, SGLangEngine, SGLangSyncError  # noqa: E402
from megatron_rl.rollout.sglang import protocol  # noqa: E402
from megatron_rl.weight_sync.disk import DiskSynchronizer  # noqa: E402
from megatron_rl.weight_sync.distributed import DistributedSynchronizer  # noqa: E402
from megatron_rl.weight_sync.sglang_verify import SGLangVerifier  # noqa: E402
from megatron_rl.plan.sglang_weights import read_hf_config  # noqa: E402
from megatron_rl.weight_sync.sglang_tensor import (FLATTENED_BUCKET, SGLangTensorSynchronizer,  # noqa: E402
                                                   _bucket_entries)
from megatron_rl.plan.engines import EnginePlacement, EngineSlot  # noqa: E402

KERNEL_STANDIN = REPO / "tools" / "sglang_cpu"
# what the server process finds on its PYTHONPATH: the CPU stand-in for sgl_kernel; with --against-double also
# tests/rollout/sglang_double, whose ``sglang.launch_server`` serves CI's protocol stand-in with SGLang's CLI
SERVER_PYTHONPATH = [str(KERNEL_STANDIN)]
DOUBLE = REPO / "tests" / "rollout" / "sglang_double"
# The engine arguments of the CPU route (docs/sglang-cpu.md); each one is needed there.
SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
               "--disable-overlap-schedule", "--disable-cuda-graph", "--dtype", "float32",
               "--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--skip-server-warmup"]


# The steps of one run, in order: (name, whether it takes the first generation's log-probs); then the checks that
# need a second server or the recorded fixture. tests/tools/test_sglang_harness.py collects one test per step.
SERVER_STEPS = [("generation", False), ("weights_check", False), ("delta_routes", False), ("long_prompts", False),
                ("aborted_rows_retried", False), ("seeded", False), ("disk_updates", True), ("sharded_disk", True),
                ("router", False), ("control", False), ("abort_flush_pause", False), ("tensor_updates", True),
                ("tensor_transport", True), ("distributed_updates", True), ("verify_checksums", True),
                ("delta_sync", True)]
ALL_STEPS = [name for name, _ in SERVER_STEPS] + ["unavailable_503", "verify_qwen3", "standin_fidelity",
                                                  "fixture_still_holds"]


class CheckFailed(Exception):
    pass


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Report:
    """Checks, figures and a log, written to ``out`` as they come (a crash still leaves them)."""

    def __init__(self, out: Path):
        self.out = out
        self.checks: list[dict] = []
        self.step = ""  # the step the checks being recorded belong to (tests/tools/test_sglang_harness.py)
        self.figures: dict[str, Any] = {}
        self.replies: dict[str, Any] = {}  # raw replies of real SGLang, to keep the stand-in exact
        self._log = open(out / "check.log", "a", buffering=1)
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        line = f"[real-sglang +{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self._log.write(line + "\n")

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail, "step": self.step})
        self.log(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
        self.save()
        return ok

    def save(self) -> None:
        data = {"checks": self.checks, "figures": self.figures, "replies": self.replies,
                "passed": sum(c["ok"] for c in self.checks), "failed": sum(not c["ok"] for c in self.checks)}
        tmp = self.out / "figures.json.tmp"
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(self.out / "figures.json")

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.checks if not c["ok"]]


def _safe(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raises (a server still starting)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - polling: any failure means "not yet"
        return None


def wait_until(predicate: Callable[[], bool], timeout_s: float, who: str, what: str, *, every_s: float = 0.5,
               progress: Optional[Callable[[float], None]] = None) -> None:
    """Poll ``predicate`` until true; past ``timeout_s`` raise an error naming ``who`` did not ``what``."""
    start = time.monotonic()
    last_note = start
    while not predicate():
        now = time.monotonic()
        if now - start > timeout_s:
            raise CheckFailed(f"{who} did not {what} within {timeout_s:g} s")
        if progress and now - last_note >= 10:
            progress(now - start)
            last_note = now
        time.sleep(every_s)


class SGLangServer:
    """``python -m sglang.launch_server`` in its own process group; ``stop()`` kills the whole group."""

    def __init__(self, python: str, model: Path, log_path: Path, *, port: int, extra_args: list[str],
                 env: Optional[dict] = None):
        # a path relative to the caller's cwd: the server starts in its log's dir
        self.python = os.path.abspath(python) if os.sep in python else python
        self.model, self.log_path, self.port = model, log_path, port
        self.extra_args, self.env = extra_args, dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(SERVER_PYTHONPATH), **self.env}  # this process only
        env.pop("VIRTUAL_ENV", None)
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), *SERVER_ARGS, *self.extra_args]
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(self.log_path.parent))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after 20 s (scheduler/detokenizer children too)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(pgid, signal.SIGKILL)  # children that outlived the launcher
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        if self._log_file:
            self._log_file.close()


def finish(report: "Report", out: Path) -> int:
    """A check script's end: total time and figures saved, the count said; exit 1 when a check failed, else 0."""
    report.figures["total_s"] = round(time.monotonic() - report.t0, 1)
    report.save()
    failed = report.failed
    report.log(f"{len(report.checks) - len(failed)} passed, {len(failed)} failed  (figures: {out / 'figures.json'})")
    return 1 if failed else 0


def start_checked(report: "Report", server: SGLangServer, timeout_s: float, what: str) -> bool:
    """Start ``server`` for a check script: stopped at exit and on SIGTERM / SIGINT (they raise SystemExit, so
    the caller's ``finally`` stops it too), ``startup_s`` in the figures; False (reported as the failed check
    ``what``) when it does not become healthy within ``timeout_s``."""
    atexit.register(server.stop)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the caller's finally, which stops the server

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    report.log(f"starting SGLang with {' '.join(server.extra_args) or 'the CPU route'} on {server.url} "
               f"(log: {server.log_path})")
    server.start()
    try:
        report.figures["startup_s"] = round(wait_healthy(server, timeout_s, report.log), 1)
    except CheckFailed as exc:
        report.log(f"error: {exc}")
        report.check(what, False, str(exc)[:800])
        return False
    return True


def wait_healthy(server: SGLangServer, timeout_s: float, log: Callable[[str], None]) -> float:
    """Seconds until the started ``server`` answers ``/health`` with 200; ``CheckFailed`` naming it, with its
    log's tail, when its process exits or ``timeout_s`` passes first. Progress every 10 s to ``log``."""
    t = time.monotonic()
    probe = SGLangClient(server.url, timeout_s=5, connect_retries=0)

    def healthy() -> bool:
        if not server.alive():
            raise CheckFailed(f"the SGLang server process exited with {server.proc.returncode} while starting; "
                              f"log tail ({server.log_path}):\n{server.log_tail()}")
        try:
            return probe.health(timeout_s=5)
        except Exception:  # noqa: BLE001 - not up yet
            return False

    try:
        wait_until(healthy, timeout_s, f"SGLang server {server.url}", "answer /health with 200",
                   every_s=1.0, progress=lambda s: log(f"  waiting for {server.url}/health: {s:.0f} s"))
    except CheckFailed as exc:
        if server.alive():  # (an exited one's error has the tail already)
            raise CheckFailed(f"{exc}; log tail ({server.log_path}):\n{server.log_tail()}") from None
        raise
    finally:
        probe.close()
    return time.monotonic() - t


def build_model(out: Path, seed: int) -> Path:
    """A tiny random-weight Qwen2 with the demo's digit tokenizer (SGLang needs one in the model dir).

    Untied ``lm_head`` (so it can be zeroed alone) and the wider init of ``hf_tiny`` (so logits are
    far from uniform and the log-prob comparison compares something); vocab 32, as the demo.
    """
    path = out / "model"
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    eos = synthetic.VOCAB.index(synthetic.EOS)
    build_tiny_hf_model("qwen2", path, seed=seed, vocab_size=synthetic.VOCAB_SIZE, num_hidden_layers=2,
                        bos_token_id=synthetic.VOCAB.index(synthetic.BOS), eos_token_id=eos,
                        pad_token_id=synthetic.VOCAB.index(synthetic.PAD))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0,
                                                             "bos_token_id": 1}))
    synthetic.build_tokenizer(str(path))
    return path


def hf_logprobs(model, prompt: list[int], output: list[int]) -> tuple[list[float], list[float]]:
    """Teacher-forced log-probs of ``output`` after ``prompt``, and the top log-prob at each step."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(output)), torch.tensor(output)].tolist(), lp.max(dim=-1).values.tolist()


def abort_retry_manager(model_dir: Path, url: str, engine: Any) -> Any:
    """The rollout manager of ``aborted_rows_retried``, its config built as the product builds it (flags ->
    validated dataclasses: a stand-in object lacked whatever the manager read next, and the check rotted);
    tests/tools/test_sglang_harness.py builds it on every commit."""
    from megatron_rl.config import parse_config
    from megatron_rl.rollout.manager import RolloutManager

    cfg = parse_config(["--hf-checkpoint", str(model_dir), "--rollout-engine-urls", url, "--rollout-abort-retries", "2"])
    return RolloutManager(cfg, engine, prompts=None, reward_fn=None)


class Checks:
    """The checks against one running server; each records figures and PASS/FAIL lines."""

    def __init__(self, report: Report, server: SGLangServer, model_dir: Path, args: argparse.Namespace):
        self.r, self.server, self.model_dir, self.args = report, server, model_dir, args
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.vocab = self.hf.config.vocab_size
        self.engine = SGLangEngine([server.url], weight_dir=str(report.out / "weights"),
                                   hf_checkpoint=str(model_dir), tokenizer=self.tokenizer, timeout_s=60,
                                   generate_timeout_s=300, update_timeout_s=300)
        self.client: SGLangClient = self.engine.clients[0]
        import random

        rng = random.Random(args.seed)
        self.prompts = [self.tokenizer(synthetic.make_problem(rng, 4)[0])["input_ids"] for _ in range(args.batch)]
        self.greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        self.original = {k: v.detach().clone() for k, v in self.hf.state_dict().items()}
        self._uninterrupted: Optional[dict] = None  # interrupt_delay's measured long generation

    def requests(self, prompts=None) -> list[GenerateRequest]:
        return [GenerateRequest(list(p), i) for i, p in enumerate(prompts or self.prompts)]

    def generate(self, sampling: Optional[SamplingParams] = None, prompts=None):
        t = time.monotonic()
        samples = self.engine.generate(self.requests(prompts), sampling or self.greedy)
        return samples, time.monotonic() - t

    def raw(self, name: str, method: str, path: str, payload: Any = None, ok=(200,)) -> Any:
        """One request through our client, its status and body kept for the stand-in comparison."""
        resp = self.client.request(method, path, payload, ok_statuses=ok)
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        self.r.replies[name] = {"status": resp.status_code, "body": body}
        return body

    # ------------------------------------------------------------------ checks
    def generation(self) -> list[list[float]]:
        r = self.r
        samples, cold_s = self.generate()
        samples, warm_s = self.generate()
        tokens = sum(len(s.response_ids) for s in samples)
        r.figures.update({"generate_batch": len(self.prompts), "generate_max_new_tokens": self.args.max_new_tokens,
                          "generate_first_s": round(cold_s, 3), "generate_s": round(warm_s, 3),
                          "generate_tokens_per_s": round(tokens / warm_s, 1)})
        r.log(f"generate: {len(samples)} rows x {self.args.max_new_tokens} tokens in {warm_s:.2f} s "
              f"(first call {cold_s:.2f} s), {tokens / warm_s:.0f} tokens/s")
        r.check("generate returns one sample per prompt with every token and its log-prob",
                len(samples) == len(self.prompts)
                and all(len(s.response_ids) == len(s.rollout_logprobs) == self.args.max_new_tokens for s in samples)
                and all(s.finish_reason == "length" for s in samples),
                f"finish reasons {sorted({s.finish_reason for s in samples})}")
        r.check("samples carry weight_version 0 before any update (SGLang reports \"default\")",
                all(s.weight_version == 0 for s in samples))
        max_diff, not_argmax = 0.0, 0
        for p, s in zip(self.prompts, samples):
            ref, top = hf_logprobs(self.hf, p, s.response_ids)
            max_diff = max(max_diff, max(abs(a - b) for a, b in zip(ref, s.rollout_logprobs)))
            not_argmax += sum(1 for a, b in zip(ref, top) if a < b - self.args.logprob_tol)
        r.figures["logprob_max_abs_diff_vs_hf"] = max_diff
        r.figures["logprob_tolerance"] = self.args.logprob_tol
        r.check(f"greedy tokens are the HF argmax (within {self.args.logprob_tol:g})", not_argmax == 0,
                f"{not_argmax} token(s) were not")
        r.check(f"SGLang log-probs match an HF forward of the same weights within {self.args.logprob_tol:g}",
                max_diff <= self.args.logprob_tol, f"max abs diff {max_diff:.3g}")
        texts = [s.response_text for s in samples]
        r.check("samples carry the server's decoded text", all(isinstance(t, str) for t in texts),
                f"first: {texts[0]!r}")
        self.raw("generate_single", "POST", "/generate",
                 {"input_ids": self.prompts[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
                  "return_logprob": True})
        self.first_logprobs = [s.rollout_logprobs for s in samples]
        return self.first_logprobs

    def weights_check(self) -> None:
        """``--check-weight-update-equal`` with SGLang: the update to version 0 compared inside the server with its
        own load of the checkpoint (/weights_checker snapshot, reset_tensors, compare)."""
        from megatron_rl.errors import SyncError

        r = self.r

        def engine(tag: str) -> SGLangEngine:
            return SGLangEngine([self.server.url], weight_dir=str(r.out / f"weights_check_{tag}"),
                                hf_checkpoint=str(self.model_dir), timeout_s=60, update_timeout_s=300,
                                health_interval_s=0, check_first_update=True)

        same = engine("same")
        t = time.monotonic()
        try:
            same.update_weights(self.original.items(), 0)
            verdict = "passed"
        except SyncError as exc:
            verdict = str(exc)
        finally:
            same.close()
        if str(self.client.server_info().get("device", "cpu")) == "cpu":  # compare chunks go .cuda() (0.5.23's
            # utils/weight_checker_comparator.py)
            r.check("--check-weight-update-equal on CPU SGLang: snapshot and reset_tensors run, compare cannot (it "
                    "needs CUDA), and the error says nothing was compared rather than calling the weights wrong",
                    "could not run" in verdict and "compare" in verdict and "NVIDIA driver" in verdict
                    and "differ from its own load" not in verdict, f"{time.monotonic() - t:.2f} s: {verdict[:500]}")
        else:
            r.check("--check-weight-update-equal: the checkpoint pushed as version 0 equals the server's own load",
                    verdict == "passed", verdict[:600])
            tampered = dict(self.original)
            tampered["model.norm.weight"] = tampered["model.norm.weight"] * 2
            wrong = engine("wrong")
            try:
                wrong.update_weights(tampered.items(), 0)
                r.check("--check-weight-update-equal: a changed tensor is named by SGLang's compare", False, "accepted")
            except SyncError as exc:
                r.check("--check-weight-update-equal: a changed tensor is named by SGLang's compare",
                        "model.norm" in str(exc) and "differ from its own load" in str(exc), str(exc)[:600])
            finally:
                wrong.close()
        self.engine.update_weights(self.original.items(), 0)  # the server back at the checkpoint, version 0
        samples, _ = self.generate()
        r.check("after the weight checks the server generates the checkpoint's tokens again",
                [s.rollout_logprobs for s in samples] == self.first_logprobs)

    def delta_routes(self) -> None:
        """Why ``--update-weight-mode delta`` reaches SGLang through a host checkpoint (step ``delta_sync``): 0.5.23
        has no route that applies a weight delta in place (slime's SGLang fork: ``/pull_weights``; none may answer
        with success: a new one means the route can be revisited). Per-tensor checksums come from
        ``/weights_checker``'s ``checksum`` action instead (step ``verify_checksums``)."""
        import httpx

        r = self.r
        for path, body in (("/pull_weights", {"target_version": 1}), ("/get_weights_checksum", {}),
                           ("/weights_checksum", {})):
            resp = httpx.post(self.server.url + path, json=body, timeout=30)
            r.check(f"SGLang has no {path} route (a delta is patched into the host checkpoint instead)",
                    resp.status_code in (404, 405), f"{resp.status_code}: {resp.text[:300]}")
        samples, _ = self.generate()
        r.check("after the probes the server still generates the checkpoint's tokens",
                [s.rollout_logprobs for s in samples] == self.first_logprobs)

    def long_prompts(self) -> None:
        """Prompts near and past the context length: SGLang 0.5.23 refuses both with a 400 (an abort
        carrying a status code becomes an HTTP error), so no cut-short sample reaches the rollout."""
        from megatron_rl.errors import EngineError

        r = self.r
        context = int(self.hf.config.max_position_embeddings)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=2)
        for n, words in ((context - 3, "exceeds the maximum allowed length"), (context, "context length")):
            prompt = [3 + i % 20 for i in range(n)]
            try:
                samples = self.engine.generate([GenerateRequest(prompt, 0)], sampling)
                r.check(f"a prompt of {n} tokens (context {context}): refused with a 400 naming it", False,
                        f"answered {samples[0].finish_reason}: {samples[0].metadata}")
            except EngineError as exc:
                r.check(f"a prompt of {n} tokens (context {context}): refused with a 400 naming it",
                        getattr(exc, "status", None) == 400 and words in str(exc), str(exc)[:300])

    def aborted_rows_retried(self) -> None:
        """Rows aborted by /abort_request (HTTP 200, finish_reason abort): the rollout generates their
        groups again and keeps no cut-short sample."""
        r = self.r
        manager = abort_retry_manager(self.model_dir, self.server.url, self.engine)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=self.args.long_tokens, ignore_eos=True, n=2)
        requests = self.requests(self.prompts[:2])
        result: dict[str, Any] = {}

        def run():
            try:
                result["samples"] = manager._generate_complete(requests, sampling)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        delay = self.interrupt_delay()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(delay)
        self.client.abort_request(abort_all=True)
        self._join(thread, result, "abort_request(abort_all) under the rollout's retry", timeout_s=300)
        samples = result["samples"]
        r.check("rows aborted by /abort_request: their groups generated again, every sample finished",
                manager.last_aborted == 4 and manager.last_retried_groups == 2
                and [s.group_index for s in samples] == [0, 0, 1, 1]
                and all(s.finish_reason == "length" and len(s.response_ids) == self.args.long_tokens
                        for s in samples),
                f"aborted {manager.last_aborted}, groups again {manager.last_retried_groups}, reasons "
                f"{[s.finish_reason for s in samples]}")

    def seeded(self) -> None:
        """SGLang honours sampling_seed only with --enable-deterministic-inference (GPU attention backends
        only), so on this route seeded rows are not reproducible; the engine must say so once."""
        info = self.client.server_info()
        deterministic = info.get("enable_deterministic_inference")
        self.r.replies["server_info_subset"] = {k: info.get(k) for k in (
            "enable_deterministic_inference", "attention_backend", "sampling_backend", "device", "tp_size",
            "dp_size", "disable_radix_cache", "weight_version", "version")}
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1234, n=2, ignore_eos=True)
        handler = _Capture()
        logging.getLogger("megatron_rl.rollout.sglang.engine").addHandler(handler)
        try:
            a, _ = self.generate(sampling)
            b, _ = self.generate(sampling)
        finally:
            logging.getLogger("megatron_rl.rollout.sglang.engine").removeHandler(handler)
        same = [x.response_ids for x in a] == [y.response_ids for y in b]
        self.r.figures["seeded_reproducible"] = same
        self.r.figures["enable_deterministic_inference"] = deterministic
        warned = [m for m in handler.messages if "enable-deterministic-inference" in m]
        if deterministic:
            self.r.check("seeded sampling is reproducible on a deterministic-inference server", same)
        else:
            self.r.check("server without deterministic inference: the engine warns once that the seed is ignored",
                         len(warned) == 1, f"reproducible={same}; warnings: {warned[:1]}")

    def _state(self, lm_head: Optional[torch.Tensor] = None) -> list[tuple[str, torch.Tensor]]:
        state = dict(self.original)
        if lm_head is not None:
            state["lm_head.weight"] = lm_head
        return list(state.items())

    def _expect_uniform(self, what: str, version: int) -> None:
        samples, _ = self.generate()
        want = -math.log(self.vocab)
        diff = max(abs(lp - want) for s in samples for lp in s.rollout_logprobs)
        self.r.check(f"{what}: lm_head zeroed -> every greedy log-prob is -ln({self.vocab}) = {want:.6f}",
                     diff < 1e-5, f"max abs diff {diff:.3g}")
        self.r.check(f"{what}: samples carry weight_version {version}",
                     all(s.weight_version == version for s in samples),
                     f"got {sorted({s.weight_version for s in samples})}")

    def _expect_restored(self, what: str, first: list[list[float]], version: int) -> None:
        samples, _ = self.generate()
        diff = max(abs(a - b) for s, f in zip(samples, first) for a, b in zip(s.rollout_logprobs, f))
        self.r.check(f"{what}: original weights restored -> log-probs equal the first run's", diff < 1e-5,
                     f"max abs diff {diff:.3g}")
        self.r.check(f"{what}: samples carry weight_version {version}",
                     all(s.weight_version == version for s in samples))

    def disk_updates(self, first: list[list[float]]) -> None:
        r = self.r
        zero = torch.zeros_like(self.original["lm_head.weight"])
        for version, state, expect in ((1, self._state(zero), "uniform"), (2, self._state(), "restored")):
            t = time.monotonic()
            self.engine.update_weights(state, version)
            took = time.monotonic() - t
            r.figures[f"disk_update_v{version}_s"] = round(took, 3)
            r.log(f"disk update to v{version} ({expect}): {took:.2f} s (write + load + /model_info)")
            info = self.raw(f"model_info_after_disk_v{version}", "GET", "/model_info")
            r.check(f"disk v{version}: /model_info weight_version is {version!s}",
                    info.get("weight_version") == str(version), f"got {info.get('weight_version')!r}")
            if expect == "uniform":
                self._expect_uniform(f"disk v{version}", version)
            else:
                self._expect_restored(f"disk v{version}", first, version)
        r.check("disk: published versions pruned to the newest two", self.engine.weights.versions() == [1, 2],
                f"{self.engine.weights.versions()}")
        reply = self.raw("update_weights_from_disk_ok", "POST", "/update_weights_from_disk",
                         {"model_path": self.engine.weights.path(2), "weight_version": "2"})
        r.check("disk: a reload answers {success, message, num_paused_requests}",
                isinstance(reply, dict) and reply.get("success") is True and "num_paused_requests" in reply,
                json.dumps(reply))
        try:
            self.client.update_weights_from_disk(str(r.out / "no-such-dir"), weight_version="99")
            r.check("disk: a missing dir is refused with the server's message", False, "it was accepted")
        except SGLangSyncError as exc:
            r.replies["update_weights_from_disk_missing"] = {"status": exc.status, "body": exc.server_message}
            r.check("disk: a missing dir is refused with the server's message (SGLangSyncError, 400)",
                    exc.status == 400 and bool(exc.server_message), str(exc)[:300])
        r.check("disk: after the refused load the server still reports version 2",
                self.client.weight_version() == "2")

    def sharded_disk(self, first: list[list[float]]) -> None:
        """The disk transport's layout for a model larger than one bucket: shards of ``shard_bytes`` +
        ``model.safetensors.index.json`` (rollout/weight_dir.py), loaded by the real server."""
        from megatron_rl.rollout.weight_dir import VersionedWeightDir

        r = self.r
        root = VersionedWeightDir(str(r.out / "weights_sharded"), hf_checkpoint=str(self.model_dir))
        total = sum(t.numel() * t.element_size() for _, t in self._state())
        zero = torch.zeros_like(self.original["lm_head.weight"])
        for state, expect in ((self._state(zero), "uniform"), (self._state(), "restored")):
            version = self.engine.weight_version + 1
            path = root.write(state, version, shard_bytes=total // 4)
            shards = sorted(f for f in os.listdir(path) if f.startswith("model-"))
            r.check(f"sharded disk v{version}: {len(shards)} shards + model.safetensors.index.json",
                    len(shards) >= 3 and os.path.exists(os.path.join(path, "model.safetensors.index.json")),
                    " ".join(shards))
            t = time.monotonic()
            self.engine.update_weights_from_disk(path, version)
            r.figures[f"sharded_disk_v{version}_s"] = round(time.monotonic() - t, 3)
            r.check(f"sharded disk v{version}: /model_info weight_version is {version}",
                    self.client.weight_version() == str(version))
            if expect == "uniform":
                self._expect_uniform(f"sharded disk v{version}", version)
            else:
                self._expect_restored(f"sharded disk v{version}", first, version)

    def router(self) -> None:
        """An sglang-router (the project venv's sglang_router) in front of the real server: the engine's
        router mode (one request per row, rids and seeds through the router's typed schema) gives the
        greedy samples the server gives directly."""
        r = self.r
        port = free_port()
        log_path = r.out / "router.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                     "--port", str(port), "--prometheus-port", str(free_port()), "--worker-urls",
                                     self.server.url, "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            probe = SGLangClient(url, timeout_s=5, connect_retries=0)

            def healthy() -> bool:
                body = _safe(lambda: probe.request("GET", "/workers").json())
                return bool(body) and all(w.get("is_healthy") for w in body.get("workers", [])) \
                    and bool(body.get("workers"))

            wait_until(healthy, 60, "sglang-router", "list the server as healthy")
            workers = probe.router_workers()
            probe.close()
            r.check("router: GET /workers lists the real server", workers == [self.server.url], str(workers))
            direct, _ = self.generate()
            via = SGLangEngine([self.server.url], router_url=url, timeout_s=60, generate_timeout_s=300,
                               tokenizer=self.tokenizer)
            try:
                t = time.monotonic()
                routed = via.generate(self.requests(), self.greedy)
                r.figures["router_generate_s"] = round(time.monotonic() - t, 3)
            finally:
                via.close()
            r.check("router: greedy samples through the router equal the server's",
                    [s.response_ids for s in routed] == [s.response_ids for s in direct]
                    and all(s.weight_version == direct[0].weight_version for s in routed))
        finally:
            proc.terminate()
            proc.wait(timeout=20)

    def control(self) -> None:
        r, c = self.r, self.client
        r.check("health", c.health())
        t = time.monotonic()
        r.check("health_generate", c.health_generate(timeout_s=60), f"{time.monotonic() - t:.2f} s")
        reply = c.update_weight_version("5", abort_all_requests=False)
        r.replies["update_weight_version"] = {"status": 200, "body": reply}
        r.check("update_weight_version: /model_info follows", c.weight_version() == "5", json.dumps(reply))
        samples, _ = self.generate(prompts=self.prompts[:2])
        r.check("update_weight_version: samples carry the new version", all(s.weight_version == 5 for s in samples))
        c.update_weight_version("2", abort_all_requests=False)  # back to the engine's version
        self.raw("flush_cache_idle", "POST", "/flush_cache")
        r.check("flush_cache while idle: 200", True)
        self.raw("pause_generation", "POST", "/pause_generation", {"mode": "abort"})
        self.raw("continue_generation", "POST", "/continue_generation", {})
        r.check("pause_generation / continue_generation answer {message, status: ok}",
                r.replies["pause_generation"]["body"].get("status") == "ok"
                and r.replies["continue_generation"]["body"].get("status") == "ok")

    def _long_generate(self, tokens: Optional[int] = None, raw: bool = False):
        """Start a long generation in a thread (``raw``: through the client, rows unparsed); return
        (thread, result holder)."""
        result: dict[str, Any] = {}
        sampling = SamplingParams(temperature=0.0, max_new_tokens=tokens or self.args.long_tokens, ignore_eos=True)

        def run():
            t = time.monotonic()
            try:
                if raw:
                    result["rows"] = self.client.generate(
                        self.prompts[:4], [protocol.sampling_params_dict(sampling)] * 4, timeout_s=300)
                else:
                    result["samples"] = self.engine.generate(self.requests(self.prompts[:4]), sampling)
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                result["error"] = exc
            result["s"] = time.monotonic() - t

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, result

    def _join(self, thread: threading.Thread, result: dict, what: str, timeout_s: float = 120) -> None:
        thread.join(timeout_s)
        if thread.is_alive():
            raise CheckFailed(f"SGLang server {self.server.url} did not answer the long /generate within "
                              f"{timeout_s:g} s after {what}")
        if "error" in result:
            raise CheckFailed(f"the long /generate failed after {what}: {result['error']}")

    def interrupt_delay(self) -> float:
        """Seconds into a long generation at which the checks abort, pause or flush: ``--interrupt-after-s``,
        or a quarter of an uninterrupted one, measured once (4 rows x ``--long-tokens``; a fixed second
        came after the end on a fast VM, where they took 1.01 s)."""
        if self._uninterrupted is None:
            thread, full = self._long_generate()
            self._join(thread, full, "nothing (an uninterrupted run)", timeout_s=300)
            self._uninterrupted = full
            self.r.figures["long_generate_s"] = round(full["s"], 2)
            self.r.log(f"long generate: 4 rows x {self.args.long_tokens} tokens in {full['s']:.2f} s")
        return self.args.interrupt_after_s or self._uninterrupted["s"] / 4

    def abort_flush_pause(self) -> None:
        r, c = self.r, self.client
        delay = self.interrupt_delay()  # the full length first, also to know what an abort saves
        full = self._uninterrupted

        thread, res = self._long_generate()
        time.sleep(delay)
        try:
            c.flush_cache()
            r.check("flush_cache with a request running: refused (400)", False, "it answered 200")
        except Exception as exc:  # noqa: BLE001 - the status is what is checked
            r.replies["flush_cache_busy"] = {"status": getattr(exc, "status", None),
                                             "body": getattr(exc, "server_message", str(exc))}
            r.check("flush_cache with a request running: refused (400)", getattr(exc, "status", None) == 400,
                    str(exc)[:200])
        c.abort_request(abort_all=True)
        self._join(thread, res, "abort_request(abort_all)")
        reasons = sorted({s.finish_reason for s in res["samples"]})
        lengths = [len(s.response_ids) for s in res["samples"]]
        r.check("abort_request(abort_all): rows come back with finish_reason abort, early",
                reasons == ["abort"] and max(lengths) < self.args.long_tokens,
                f"reasons {reasons}, tokens {lengths}, {res['s']:.2f} s vs {full['s']:.2f} s")

        thread, res = self._long_generate(raw=True)
        time.sleep(delay)
        c.pause_generation("abort")
        self._join(thread, res, "pause_generation(abort)")
        r.replies["generate_row_aborted"] = {"status": 200, "body": res["rows"][0]}
        parsed = [protocol.parse_generate_output(row, where=self.server.url) for row in res["rows"]]
        reasons = sorted({p.finish_reason for p in parsed})
        r.check("pause_generation(abort): running rows aborted (and the aborted rows parse)", reasons == ["abort"],
                f"reasons {reasons}, tokens {[len(p.output_ids) for p in parsed]}, "
                f"finish_reason {res['rows'][0]['meta_info'].get('finish_reason')}")
        thread, res = self._long_generate(tokens=self.args.max_new_tokens)
        time.sleep(2.0)
        waiting = thread.is_alive()
        c.continue_generation()
        self._join(thread, res, "continue_generation")
        reasons = sorted({s.finish_reason for s in res["samples"]})
        r.check("while paused a new generate waits; after continue_generation it completes",
                waiting and reasons == ["length"], f"waited={waiting}, reasons {reasons}")
        self.raw("flush_cache_after", "POST", "/flush_cache")

    def tensor_updates(self, first: list[list[float]]) -> None:
        r, c = self.r, self.client
        zero = torch.zeros_like(self.original["lm_head.weight"])
        try:
            c.update_weights_from_named_tensors([("lm_head.weight", zero)], weight_version="3")
            r.check("tensor update outside begin/end is refused (400)", False, "it was accepted")
        except SGLangSyncError as exc:
            r.replies["update_weights_from_tensor_no_session"] = {"status": exc.status, "body": exc.server_message}
            r.check("tensor update outside begin/end is refused (400)", exc.status == 400, str(exc)[:300])
        r.check("the client's sharing strategy is file_system after serialising",
                torch.multiprocessing.get_sharing_strategy() == "file_system")
        for version, tensors, expect in ((3, [("lm_head.weight", zero)], "uniform"),
                                         (4, self._state(), "restored")):
            t = time.monotonic()
            began = c.begin_weight_update()
            reply = c.update_weights_from_named_tensors(tensors, weight_version=str(version), timeout_s=300)
            c.end_weight_update()
            took = time.monotonic() - t
            if version == 3:
                self.raw("begin_weight_update", "POST", "/begin_weight_update", {})
                self.raw("end_weight_update", "POST", "/end_weight_update", {})
                try:
                    c.end_weight_update()
                except SGLangSyncError as exc:
                    r.replies["end_weight_update_no_session"] = {"status": exc.status, "body": exc.server_message}
            r.replies[f"update_weights_from_tensor_v{version}"] = {"status": 200, "body": reply}
            r.figures[f"tensor_update_v{version}_s"] = round(took, 3)
            r.log(f"tensor update to v{version} ({len(tensors)} tensor(s), {expect}): {took:.2f} s")
            r.check(f"tensor v{version}: begin_weight_update exists (0.5.21+) and the update succeeded",
                    began and reply.get("success") is True, json.dumps(reply))
            r.check(f"tensor v{version}: /model_info weight_version is {version}", c.weight_version() == str(version))
            self.engine._weight_version = version  # the engine's own update route is disk; keep it in step
            if expect == "uniform":
                self._expect_uniform(f"tensor v{version}", version)
            else:
                self._expect_restored(f"tensor v{version}", first, version)
        r.check("server still healthy after the tensor updates", c.health_generate(timeout_s=60))


class StateBackend:
    """The trainer side of a sync for a fixed state dict: ``export_weights`` in buckets of ~``bucket_bytes``."""

    def __init__(self, state: list[tuple[str, torch.Tensor]]):
        self.state = state

    def export_weights(self, bucket_bytes: int):
        bucket, size = [], 0
        for name, tensor in self.state:
            if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        if bucket:
            yield bucket


def tensor_synchronizer(checks: "Checks", load_format: Optional[str] = FLATTENED_BUCKET) -> SGLangTensorSynchronizer:
    """The tensor transport with this process as the one trainer rank colocated with the server."""
    server = checks.server
    placement = EnginePlacement((EngineSlot(0, server.url, 0, (), (0,), str(server.log_path)),), colocated=True)
    return SGLangTensorSynchronizer(bucket_bytes=checks.args.sync_bucket_bytes, engines=placement,
                                    load_format=load_format, timeout_s=120, connect_retries=0)


def tensor_transport(checks: "Checks", first: list[list[float]]) -> None:
    """The tensor transport against the real server: flattened buckets (SGLang's allowlisted unpickler, its
    FlattenedTensorBucket), zero / restore, versions, the plain route; sets ``checks.tensor_ok``."""
    r, c, engine = checks.r, checks.client, checks.engine
    zero = torch.zeros_like(checks.original["lm_head.weight"], dtype=torch.bfloat16)  # bf16 among fp32 tensors
    zero32 = torch.zeros_like(checks.original["lm_head.weight"])  # the restored state's sizes: its buffers reused
    version = engine.weight_version
    for load_format, steps in ((FLATTENED_BUCKET, ((checks._state(zero), "uniform"), (checks._state(), "restored"),
                                                   (checks._state(zero32), "uniform"), (checks._state(), "restored"))),
                               (None, ((checks._state(zero), "uniform"), (checks._state(), "restored")))):
        sync = tensor_synchronizer(checks, load_format)
        tag = "tensor" if load_format else "tensor_plain"
        kept: dict = {}
        try:
            for step, (state, expect) in enumerate(steps):
                version += 1
                metrics = sync.sync(StateBackend(state), engine, version)
                if load_format and step >= 1:  # the CPU buffers stay in /dev/shm and are rewritten (ShmBuffers)
                    now = {key: buf.data_ptr() for key, buf in sync._shm._buffers.items()}
                    if step == 1:
                        kept = now
                    else:
                        r.check(f"{tag} v{version}: the /dev/shm buffers of the sync before are rewritten, not "
                                "made again", now == kept and bool(kept), f"{len(kept)} kept, {len(now)} now")
                r.figures[f"{tag}_transport_v{version}_s"] = round(metrics["sync/time_s"], 3)
                r.log(f"{tag} transport to v{version} ({expect}, {int(metrics['sync/buckets'])} bucket(s), "
                      f"{int(metrics['sync/requests'])} request(s), {int(metrics['sync/bytes'])} bytes): "
                      f"{metrics['sync/time_s']:.3f} s (serialise {metrics['sync/serialize_s']:.3f} s, HTTP "
                      f"{metrics['sync/post_s']:.3f} s)")
                if step == 0:  # the bf16 lm_head among fp32 tensors
                    r.check(f"{tag}: a bucket of two dtypes is sent as one request per dtype",
                            metrics["sync/requests"] == metrics["sync/buckets"] + 1,
                            f"{int(metrics['sync/requests'])} requests for {int(metrics['sync/buckets'])} buckets")
                r.check(f"{tag} v{version}: /model_info weight_version is {version}", c.weight_version() == str(version))
                if expect == "uniform":
                    checks._expect_uniform(f"{tag} v{version}", version)
                else:
                    checks._expect_restored(f"{tag} v{version}", first, version)
        finally:
            sync.shutdown()
    # one raw flattened request (no version), its reply kept for the stand-in comparison
    entries, buffers = _bucket_entries([("lm_head.weight", checks.original["lm_head.weight"])], FLATTENED_BUCKET)
    c.begin_weight_update()
    try:
        reply = c.update_weights_from_tensor([entries[0].payload], load_format=FLATTENED_BUCKET, timeout_s=120)
    finally:
        c.end_weight_update()
        del buffers
    r.replies["update_weights_from_tensor_flattened"] = {"status": 200, "body": reply}
    r.check("tensor: a raw flattened bucket answers {success: true, message: Success}",
            reply == {"success": True, "message": "Success"}, json.dumps(reply))
    checks._expect_restored("after the raw flattened request", first, version)
    checks.tensor_ok = True
    r.check("server still healthy after the tensor transport", c.health_generate(timeout_s=60))


class _CorruptingVerifier(SGLangVerifier):
    """The post-apply check, but before it one tensor is changed inside the server behind the trainer's back (a
    one-tensor dir loaded with /update_weights_from_disk, same weight version): what a faulty apply leaves."""

    def __init__(self, hf_config: dict, client: SGLangClient, corrupt_dir: Path):
        super().__init__(hf_config)
        self.client, self.corrupt_dir = client, corrupt_dir

    def check(self, engine: Any, version: int) -> dict[str, float]:
        self.client.update_weights_from_disk(str(self.corrupt_dir), weight_version=str(version), flush_cache=False,
                                             timeout_s=120)
        return super().check(engine, version)


def verify_checksums(checks: "Checks", first: list[list[float]]) -> None:
    """--update-weight-verify checksum against the server (weight_sync/sglang_verify.py): /weights_checker's checksum
    reply (per TP rank, SGLang's fused names), the committed fixture's reply for the formula weights (the CI
    stand-in is held to it), every transport's sync verified (all of SGLang's tensors equal the trainer's), the
    cost (syncs with and without), and a tensor changed inside the server after each transport's load: named with
    its fused name, engine rank and version, the engine then refusing to generate until a verified full sync."""
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from sglang_standin import formula_weights  # noqa: E402 - test tooling, on sys.path just above

    r, c, engine = checks.r, checks.client, checks.engine
    reply = c.weight_checksums(timeout_s=120)
    r.replies["weights_checker_checksum"] = {"status": 200, "body": reply}
    ranks = reply.get("ranks") or []
    names = sorted((ranks[0].get("checksums") or {}) if ranks else ())
    tp = int(c.server_info().get("tp_size") or 1)
    r.check("/weights_checker checksum: one entry per TP rank, each a checksum per tensor SGLang holds, under its own "
            "fused names (qkv_proj, gate_up_proj; no q_proj / gate_proj)",
            len(ranks) == tp and "model.layers.0.self_attn.qkv_proj.weight" in names
            and "model.layers.0.mlp.gate_up_proj.weight" in names
            and not any(".q_proj." in n or ".gate_proj." in n for n in names),
            f"{len(ranks)} rank(s), {len(names)} tensors: {names[:6]} ...")
    hf_config = read_hf_config(str(checks.model_dir))
    formula = formula_weights({n: tuple(t.shape) for n, t in checks.original.items()})
    version = engine.weight_version + 1
    engine.update_weights(formula.items(), version)
    fixture = json.loads((REPO / "tests" / "rollout" / "fixtures" / "sglang_0.5.23_weights_checksum.json").read_text())
    got = c.weight_checksums(timeout_s=120)
    r.check("the formula weights give the committed fixture's checksum reply exactly (the CI stand-in is held to "
            "it: tests/weight_sync/test_sglang_verify.py)", got == fixture["reply"],
            json.dumps(got)[:400] if got != fixture["reply"] else f"{len(names)} checksums and the overall ones")
    bucket = checks.args.sync_bucket_bytes
    placement = EnginePlacement((EngineSlot(0, checks.server.url, 0, (), (0,), str(checks.server.log_path)),),
                                colocated=True)

    def transports() -> dict:
        return {"disk": DiskSynchronizer(bucket, disk_dir=str(checks.r.out / "verify_disk"),
                                         hf_checkpoint=str(checks.model_dir)),
                "distributed": DistributedSynchronizer(bucket_bytes=bucket, group_backend="gloo", timeout_s=120),
                "tensor": SGLangTensorSynchronizer(bucket_bytes=bucket, engines=placement, timeout_s=120,
                                                   connect_retries=0)}

    syncs = transports()
    verifier = SGLangVerifier(hf_config)
    states = [list(formula.items()), checks._state()]
    try:
        for name, sync in syncs.items():
            timed: dict[str, list[float]] = {"off": [], "on": [], "hash": [], "check": []}
            verified = []
            rounds = 1 if checks.args.against_double else 2  # the double's timings mean nothing: one round
            for _ in range(rounds):  # alternating: unverified, verified; the formula weights and the checkpoint in turn
                for on in (False, True):
                    sync.sglang_verifier = verifier if on else None
                    version += 1
                    metrics = sync.sync(StateBackend(states[version % 2]), engine, version)
                    timed["on" if on else "off"].append(metrics["sync/time_s"] + metrics.get("sync/verify_time_s", 0))
                    if on:
                        verified.append(metrics["sync/verified_tensors"])
                        timed["hash"].append(metrics["sync/verify_hash_s"])
                        timed["check"].append(metrics["sync/verify_time_s"])
            med = {k: sorted(v)[len(v) // 2] for k, v in timed.items()}
            r.figures[f"verify_{name}"] = {k: round(v, 4) for k, v in med.items()}
            r.log(f"verify, {name}: sync {med['off']:.3f} s unverified, {med['on']:.3f} s verified (the trainer's "
                  f"hashing {med['hash'] * 1e3:.1f} ms, /weights_checker + compare {med['check'] * 1e3:.1f} ms)")
            r.check(f"verify, {name}: every sync's checksums equal SGLang's for all {len(names)} tensors it holds",
                    verified == [float(len(names) * tp)] * rounds, f"{verified}")
        version += 1
        metrics = syncs["disk"].sync(StateBackend(checks._state()), engine, version)  # the checkpoint, verified
        checks._expect_restored(f"verify v{version}", first, version)
        target = "model.layers.1.mlp.up_proj.weight"
        bad = dict(checks.original)[target].clone()
        bad.view(-1)[0] += 1.0
        corrupt_dir = checks.r.out / "verify_corrupt"
        corrupt_dir.mkdir(exist_ok=True)
        save_file({target: bad}, str(corrupt_dir / "model.safetensors"))
        corrupting = _CorruptingVerifier(hf_config, c, corrupt_dir)
        for name, sync in syncs.items():
            version += 1
            sync.sglang_verifier = corrupting
            try:
                sync.sync(StateBackend(checks._state()), engine, version)
                r.check(f"verify, {name}: a tensor changed inside SGLang after the load is named", False, "passed")
            except (SyncError, EngineError) as exc:
                text = str(exc)
                r.check(f"verify, {name}: a tensor changed inside SGLang after the load is named (its fused name, "
                        "engine rank, version)", f"version {version}" in text and "engine rank 0: 1 tensor(s) "
                        "differs: model.layers.1.mlp.gate_up_proj.weight (bucket " in text, text[:500])
            try:
                engine.generate(checks.requests(checks.prompts[:1]), checks.greedy)
                r.check(f"verify, {name}: the engine refuses to generate after the mismatch", False, "it generated")
            except EngineError as exc:
                r.check(f"verify, {name}: the engine refuses to generate after the mismatch",
                        "--update-weight-verify found the update" in str(exc), str(exc)[:300])
        version += 1
        syncs["disk"].sglang_verifier = verifier
        metrics = syncs["disk"].sync(StateBackend(checks._state()), engine, version)
        r.check("verify: a verified full sync after the mismatches passes", metrics["sync/verified_tensors"] ==
                float(len(names) * tp), str(metrics.get("sync/verified_tensors")))
        checks._expect_restored(f"verify v{version}", first, version)
    finally:
        for sync in syncs.values():
            sync.shutdown()


def sparse_steps(original: dict[str, torch.Tensor], n: int, seed: int, frac: float = 0.02
                 ) -> list[list[tuple[str, torch.Tensor]]]:
    """``n`` successive weight states from ``original``: each step moves ``frac`` of the elements of four tensors
    in five (the fifth stays: a tensor with no changed bit is not sent) by a small random amount."""
    g = torch.Generator().manual_seed(seed)
    cur, states = {k: v.clone() for k, v in original.items()}, []
    for step in range(n):
        cur = {k: v.clone() for k, v in cur.items()}
        for i, t in enumerate(cur.values()):
            if (i + step) % 5 == 0:
                continue
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * frac)),), generator=g)
            flat[idx] += 1e-3 * torch.randn(idx.numel(), generator=g)
        states.append(list(cur.items()))
    return states


def delta_sync(checks: "Checks", first: list[list[float]]) -> None:
    """--update-weight-mode delta into SGLang (rollout/sglang/host_checkpoint.py): the engine gets a host checkpoint;
    the disk transport's first sync is full (the checkpoint adopts its files), then each delta is patched into the
    checkpoint and the server loads the changed tensors, whole, with /update_weights_from_disk. Every sync is verified
    (/weights_checker checksum of every tensor SGLang holds against the trainer's); after the N deltas the server's
    checksums equal those a plain full sync of the same weights gives, bit for bit. Then the bytes and time per sync,
    full against delta, on the same states; the checkpoint's weights restored at the end."""
    from megatron_rl.rollout.sglang.host_checkpoint import HostCheckpoint
    from megatron_rl.rollout.weight_delta import read_delta_dir
    from megatron_rl.weight_sync.delta import EngineUpdates

    r, c, engine = checks.r, checks.client, checks.engine
    bucket, out = checks.args.sync_bucket_bytes, checks.r.out
    hf_config = read_hf_config(str(checks.model_dir))
    n = 2 if checks.args.against_double else 4
    states = sparse_steps(checks.original, n + 1, checks.args.seed)
    host = HostCheckpoint(str(out / "delta_disk" / "host_checkpoint"), hf_checkpoint=str(checks.model_dir),
                          shard_bytes=bucket)
    engine.host_checkpoint = host
    delta = DiskSynchronizer(bucket, disk_dir=str(out / "delta_disk"), hf_checkpoint=str(checks.model_dir),
                             updates=EngineUpdates(mode="delta", encoding="xor"))
    full = DiskSynchronizer(bucket, disk_dir=str(out / "delta_full"), hf_checkpoint=str(checks.model_dir))
    delta.sglang_verifier = SGLangVerifier(hf_config)
    figures: dict[str, list] = {"delta_bytes": [], "full_bytes": [], "delta_time_s": [], "full_time_s": [],
                                "patch_tensors": []}
    try:
        version = engine.weight_version
        for i, state in enumerate(states):
            version += 1
            loads_before = c.model_info().get("model_path")
            m = delta.sync(StateBackend(state), engine, version)
            sent_delta = m.get("sync/delta") == 1.0
            r.check(f"delta v{version}: {'a delta' if i else 'the first sync is full'}, verified (every tensor SGLang "
                    "holds has the trainer's checksum)", sent_delta == (i > 0) and m.get("sync/verified_tensors", 0) > 0
                    and host.version == version, f"delta={m.get('sync/delta')} verified={m.get('sync/verified_tensors')}"
                    f" host={host.version} fraction={m.get('sync/delta_fraction'):.4f}")
            if i:
                patch = host.patches.path(version)
                _header, deltas = read_delta_dir(delta.weights.path(version))
                sent = {d.name for d in deltas}
                loaded = c.model_info().get("model_path")
                changed = {name for (name, t), (_, p) in zip(state, states[i - 1]) if not torch.equal(t, p)}
                r.check(f"delta v{version}: the server loaded the patch dir of the {len(sent)} changed tensor(s) "
                        f"only (of {len(state)})", loaded == patch and sent == changed and len(sent) < len(state),
                        f"loaded {loaded} (before {loads_before}); sent {len(sent)}, changed {len(changed)}")
                figures["delta_bytes"].append(int(m["sync/bytes"]))
                figures["patch_tensors"].append(len(sent))
        want = c.weight_checksums(timeout_s=120)
        version += 1
        full.sync(StateBackend(states[-1]), engine, version)  # a plain full sync of the same weights
        got = c.weight_checksums(timeout_s=120)
        per_tensor = (want.get("ranks") or [{}])[0].get("checksums") or {}
        r.check(f"after {n} delta syncs every tensor SGLang holds ({len(per_tensor)}) equals a full sync's of the same "
                "weights, bit for bit (/weights_checker checksum, per TP rank)",
                bool(per_tensor) and want.get("ranks") == got.get("ranks"),
                "" if want.get("ranks") == got.get("ranks") else json.dumps([want, got])[:600])
        # the cost, unverified: the same states synced full, then by delta (its first sync full again: the engine
        # moved on under the full synchronizer); the double's timings mean nothing
        delta.sglang_verifier = None
        for state in states[1:]:
            version += 1
            mf = full.sync(StateBackend(state), engine, version)
            figures["full_time_s"].append(round(mf["sync/time_s"], 4))
            figures["full_bytes"].append(int(mf["sync/bytes"]))
        for i, state in enumerate(states):
            version += 1
            md = delta.sync(StateBackend(state), engine, version)
            if i:
                figures["delta_time_s"].append(round(md["sync/time_s"], 4))
        r.figures["delta_sync"] = figures
        r.log(f"delta sync: bytes per sync {figures['delta_bytes']} (full {figures['full_bytes'][:1]}), time "
              f"{figures['delta_time_s']} s vs full {figures['full_time_s']} s")
    finally:
        engine.host_checkpoint = None
        delta.shutdown()
        full.shutdown()
    version = engine.weight_version + 1
    engine.update_weights(checks._state(), version)
    checks._expect_restored(f"delta v{version}", first, version)


def distributed_updates(checks: "Checks", first: list[list[float]]) -> None:
    """The distributed transport against the real server: zero / restore, versions, teardown, timing."""
    r, c, engine = checks.r, checks.client, checks.engine
    try:
        c.update_weights_from_distributed(names=["lm_head.weight"], dtypes=["float32"],
                                          shapes=[list(checks.original["lm_head.weight"].shape)],
                                          group_name="megatron_rl_no_such_group", timeout_s=60)
        r.check("distributed update outside begin/end is refused (400)", False, "it was accepted")
    except SGLangSyncError as exc:
        r.replies["update_weights_from_distributed_no_session"] = {"status": exc.status, "body": exc.server_message}
        r.check("distributed update outside begin/end is refused (400)", exc.status == 400, str(exc)[:300])
    bucket = checks.args.sync_bucket_bytes
    sync = DistributedSynchronizer(bucket_bytes=bucket, group_backend="gloo", timeout_s=120)
    tensor: Optional[SGLangTensorSynchronizer] = None
    flat: Optional[DistributedSynchronizer] = None
    zero = torch.zeros_like(checks.original["lm_head.weight"])
    version = engine.weight_version
    try:
        for state, expect in ((checks._state(zero), "uniform"), (checks._state(), "restored")):
            version += 1
            metrics = sync.sync(StateBackend(state), engine, version)
            r.figures[f"distributed_update_v{version}_s"] = round(metrics["sync/time_s"], 3)
            r.figures[f"distributed_update_v{version}_connect_s"] = round(metrics["sync/connect_s"], 3)
            r.log(f"distributed update to v{version} ({expect}, {int(metrics['sync/buckets'])} bucket(s), "
                  f"{int(metrics['sync/bytes'])} bytes): {metrics['sync/time_s']:.3f} s (group set-up "
                  f"{metrics['sync/connect_s']:.3f} s)")
            r.check(f"distributed v{version}: /model_info weight_version is {version}",
                    c.weight_version() == str(version))
            if expect == "uniform":
                checks._expect_uniform(f"distributed v{version}", version)
            else:
                checks._expect_restored(f"distributed v{version}", first, version)
        group = sync.group_name
        r.check("distributed: one group for both updates", bool(group) and metrics["sync/connect_s"] == 0.0, group)
        # the flattened bucket (what NCCL groups send to 0.5.19+): one uint8 broadcast per bucket, its own group
        flat = DistributedSynchronizer(bucket_bytes=bucket, group_backend="gloo", timeout_s=120, flattened=True)
        for state, expect in ((checks._state(zero), "uniform"), (checks._state(), "restored")):
            version += 1
            metrics = flat.sync(StateBackend(state), engine, version)
            r.log(f"distributed update, flattened buckets, to v{version} ({expect}, {int(metrics['sync/buckets'])} "
                  f"bucket(s)): {metrics['sync/time_s']:.3f} s")
            r.check(f"distributed flattened v{version}: the server took load_format flattened_bucket and "
                    f"/model_info weight_version is {version}", flat._flattened and c.weight_version() == str(version))
            if expect == "uniform":
                checks._expect_uniform(f"distributed flattened v{version}", version)
            else:
                checks._expect_restored(f"distributed flattened v{version}", first, version)

        # sync time of the two transports on the same model, alternating so drift hits both alike
        disk = DiskSynchronizer(bucket_bytes=bucket, disk_dir=str(r.out / "sync_bench"),
                                hf_checkpoint=str(checks.model_dir))
        tensor = tensor_synchronizer(checks) if getattr(checks, "tensor_ok", False) else None
        contenders = [("disk", disk), ("distributed", sync), ("distributed_flattened", flat)] + (
            [("tensor", tensor)] if tensor else [])
        nbytes = 0
        # the small buckets of the checks above (several per sync), then the default --update-weight-buffer-size
        # (512 MiB: the whole tiny model in one bucket)
        for tag, size in (("", bucket), ("_1bucket", 512 * 1024 * 1024)):
            for _, synchronizer in contenders:
                synchronizer.bucket_bytes = size
            times: dict[str, list[float]] = {name: [] for name, _ in contenders}
            buckets = {}
            for _ in range(checks.args.sync_repeats):
                for name, synchronizer in contenders:
                    version += 1
                    metrics = synchronizer.sync(StateBackend(checks._state()), engine, version)
                    times[name].append(metrics["sync/time_s"])
                    nbytes = int(metrics["sync/bytes"])
                    buckets[name] = int(metrics["sync/buckets"])
            for name, values in times.items():
                values.sort()
                r.figures[f"sync{tag}_{name}_s"] = [round(v, 4) for v in values]
                r.figures[f"sync{tag}_{name}_median_s"] = round(values[len(values) // 2], 4)
            r.figures[f"sync{tag}_buckets"] = buckets["distributed"]
            r.log(f"sync of {nbytes} bytes in {buckets['distributed']} bucket(s), median of "
                  f"{checks.args.sync_repeats}: " + ", ".join(f"{name} {r.figures[f'sync{tag}_{name}_median_s']:.4f} s"
                                                               for name, _ in contenders))
        r.figures["sync_bytes"] = nbytes
        r.figures["sync_bucket_bytes"] = bucket
        r.check("distributed: the server still generates the restored weights after the timing runs",
                c.weight_version() == str(version))
        checks._expect_restored("after the timing runs", first, version)
    finally:
        group = sync.group_name
        sync.shutdown()
        if flat is not None:
            flat.shutdown()
        if tensor is not None:
            tensor.shutdown()
    if group:
        try:
            c.destroy_weights_update_group(group, timeout_s=60)
            r.check("distributed: shutdown() destroyed the group on the server", False, "it still existed")
        except SGLangSyncError as exc:
            r.replies["destroy_weights_update_group_missing"] = {"status": exc.status, "body": exc.server_message}
            r.check("distributed: shutdown() destroyed the group on the server (a second destroy: 400, no group)",
                    exc.status == 400 and "does not exist" in (exc.server_message or ""), str(exc)[:300])
    r.check("server still healthy after the distributed updates", c.health_generate(timeout_s=60))


def unavailable_503(report: Report, model_dir: Path, args: argparse.Namespace) -> None:
    """A real 503 from /generate: a second server that runs one request at a time and aborts a request
    that waited 2 s in its queue (SGLANG_REQ_WAITING_TIMEOUT; SGLang aborts it with status 503, which
    fails the whole non-streamed request). Our engine must turn it into aborted rows carrying SGLang's
    words (the rollout generates their groups again), not an exception; the raw reply's shape is kept
    for the stand-in comparison."""
    server = SGLangServer(args.sglang_python, model_dir, report.out / "server_503.log", port=free_port(),
                          extra_args=["--disable-radix-cache", "--max-running-requests", "1"],
                          env={"SGLANG_REQ_WAITING_TIMEOUT": "2"})
    try:
        server.start()
        probe = SGLangClient(server.url, timeout_s=5, connect_retries=0)

        def healthy() -> bool:
            if not server.alive():
                raise CheckFailed(f"the second SGLang server exited while starting; log tail:\n{server.log_tail()}")
            return _safe(lambda: probe.health(timeout_s=5)) is True

        t = time.monotonic()
        wait_until(healthy, args.startup_timeout_s, f"SGLang server {server.url}", "answer /health with 200",
                   every_s=1.0)
        report.figures["startup_503_server_s"] = round(time.monotonic() - t, 1)
        probe.close()
        engine = SGLangEngine([server.url], timeout_s=60, generate_timeout_s=300, connect_retries=0)
        try:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=args.long_tokens, ignore_eos=True, n=2)
            t = time.monotonic()
            samples = engine.generate([GenerateRequest([5, 6, 7, 8], 0)], sampling)
            report.figures["generate_503_s"] = round(time.monotonic() - t, 1)
            messages = sorted({str(s.metadata.get("finish_message")) for s in samples})
            report.check("a real 503 (a request waiting past SGLANG_REQ_WAITING_TIMEOUT): every row of the "
                         "request comes back aborted with SGLang's words",
                         [s.finish_reason for s in samples] == ["abort", "abort"]
                         and all("answered 503: Request waiting timeout reached." in m for m in messages),
                         f"reasons {[s.finish_reason for s in samples]}, messages {messages}")
            resp = engine.clients[0].request(
                "POST", "/generate", {"input_ids": [[5, 6, 7, 8]] * 2, "sampling_params": [
                    {"temperature": 0.0, "max_new_tokens": args.long_tokens, "ignore_eos": True}] * 2},
                ok_statuses=(200, 503))
            report.replies["error_503_generate"] = {"status": resp.status_code, "body": resp.json()}
            report.check("the raw 503 reply is SGLang's error object",
                         resp.status_code == 503 and resp.json().get("code") == 503,
                         f"{resp.status_code}: {resp.text[:300]}")
        finally:
            engine.close()
    finally:
        server.stop()


def _shape(body: Any) -> Any:
    """The key structure of a reply (dict keys, one level into meta_info), for comparing servers."""
    if isinstance(body, list):
        return [_shape(body[0])] if body else []
    if isinstance(body, dict):
        return {k: (_shape(v) if k == "meta_info" else type(v).__name__) for k, v in body.items()}
    return type(body).__name__


def verify_qwen3(report: Report, args: argparse.Namespace) -> None:
    """--update-weight-verify checksum on a second layout: a second server on a tiny Qwen3 with tied embeddings
    (SGLang holds one embed_tokens, no lm_head; q_norm / k_norm beside qkv_proj) started with ``--dtype auto``
    (its config says float32, which SGLang serves as float16: the trainer must hash float16 bytes), vocab 100
    (padded to 128 rows); a perturbed sync verified over disk, then a tensor changed inside the server named."""
    from safetensors.torch import load_file, save_file

    model_dir = report.out / "model_qwen3"
    if not (model_dir / "config.json").exists():
        build_tiny_hf_model("qwen3", model_dir, seed=args.seed, num_hidden_layers=2, vocab_size=100,
                            tie_word_embeddings=True)
    server = SGLangServer(args.sglang_python, model_dir, report.out / "server_qwen3.log", port=free_port(),
                          # --mem-fraction-static: SGLang sizes the KV cache from the host's free memory, which a
                          # busy host may leave too small under 0.05 for a second server ("Raise ... above 0.068")
                          extra_args=["--disable-radix-cache", "--skip-tokenizer-init", "--dtype", "auto",
                                      "--mem-fraction-static", "0.2"])
    engine = None
    sync = DiskSynchronizer(args.sync_bucket_bytes, disk_dir=str(report.out / "verify_qwen3"),
                            hf_checkpoint=str(model_dir))
    try:
        server.start()
        t = time.monotonic()
        wait_healthy(server, args.startup_timeout_s, report.log)
        report.figures["startup_qwen3_server_s"] = round(time.monotonic() - t, 1)
        engine = SGLangEngine([server.url], timeout_s=60, generate_timeout_s=300, update_timeout_s=300,
                              connect_retries=0)
        info = engine.clients[0].server_info()
        hf_config = read_hf_config(str(model_dir))
        sync.sglang_verifier = SGLangVerifier(hf_config)
        weights = {k: v * 1.01 for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        metrics = sync.sync(StateBackend(list(weights.items())), engine, 1)
        held = sorted(engine.clients[0].weight_checksums()["ranks"][0]["checksums"])
        report.check(f"qwen3, tied, --dtype {info.get('dtype')} (float32 config: SGLang holds float16): every one of "
                     "the tensors SGLang holds equals the trainer's checksum", metrics["sync/verified_tensors"] ==
                     len(held) == 18 and "lm_head.weight" not in held
                     and "model.layers.0.self_attn.q_norm.weight" in held,
                     f"{metrics['sync/verified_tensors']} verified of {len(held)}: {held[:5]} ...")
        target = "model.embed_tokens.weight"
        bad = weights[target].clone()
        bad[-1, 0] += 1.0  # the last real vocab row (rows 100..127 are SGLang's padding)
        corrupt_dir = report.out / "verify_qwen3_corrupt"
        corrupt_dir.mkdir(exist_ok=True)
        save_file({target: bad}, str(corrupt_dir / "model.safetensors"))
        sync.sglang_verifier = _CorruptingVerifier(hf_config, engine.clients[0], corrupt_dir)
        try:
            sync.sync(StateBackend(list(weights.items())), engine, 2)
            report.check("qwen3: the embedding changed inside SGLang after the load is named", False, "passed")
        except (SyncError, EngineError) as exc:
            report.check("qwen3: the embedding changed inside SGLang after the load is named",
                         "version 2" in str(exc) and "differs: model.embed_tokens.weight" in str(exc)
                         and "float16" in str(exc), str(exc)[:400])
    finally:
        sync.shutdown()
        if engine is not None:
            engine.close()
        server.stop()


def standin_fidelity(report: Report, model_dir: Path) -> None:
    """The CI stand-in (tests/rollout/sglang_standin.py) against the replies real SGLang gave above:
    same statuses, the stand-in's keys a subset of real SGLang's (real model_info / server_info carry
    many more), generate rows with exactly the same meta_info keys, same bodies for the fixed replies."""
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from sglang_standin import SGLangStandIn  # noqa: E402 - test tooling, on sys.path just above

    real = report.replies
    with SGLangStandIn(str(model_dir)) as standin, SGLangClient(standin.url, connect_retries=0) as c:
        def get(method, path, payload=None):
            resp = c.request(method, path, payload, ok_statuses=(200, 400, 404, 503))
            try:
                return resp.status_code, resp.json()
            except ValueError:
                return resp.status_code, resp.text

        ids = [3, 4, 5, 3]
        got = {
            "model_info": get("GET", "/model_info"),
            "generate_single": get("POST", "/generate", {"input_ids": ids, "sampling_params": {
                "max_new_tokens": 2, "temperature": 0.0}, "return_logprob": True}),
            "update_weight_version": get("POST", "/update_weight_version", {"new_version": "5",
                                                                             "abort_all_requests": False}),
            "flush_cache_idle": get("POST", "/flush_cache"),
            "pause_generation": get("POST", "/pause_generation", {"mode": "abort"}),
            "continue_generation": get("POST", "/continue_generation", {}),
            # an entry that is base64 (SGLang 0.5.23 validates that before the session check), unopened
            "update_weights_from_tensor_no_session": get("POST", "/update_weights_from_tensor",
                                                         {"serialized_named_tensors": ["cGF5bG9hZA=="]}),
            "begin_weight_update": get("POST", "/begin_weight_update", {}),
            "end_weight_update": get("POST", "/end_weight_update", {}),
            "end_weight_update_no_session": get("POST", "/end_weight_update", {}),
            "update_weights_from_distributed_no_session": get("POST", "/update_weights_from_distributed", {
                "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]],
                "group_name": "megatron_rl_no_such_group"}),
            "destroy_weights_update_group_missing": get("POST", "/destroy_weights_update_group",
                                                        {"group_name": "megatron_rl_no_such_group"}),
        }
        standin.faults.unavailable_generates = 1
        got["error_503_generate"] = get("POST", "/generate", {"input_ids": [ids, ids], "sampling_params": [
            {"max_new_tokens": 2}] * 2})
        # the checkpoint's weights, as the real server held them when verify_checksums asked: the same reply
        got["weights_checker_checksum"] = get("POST", "/weights_checker", {"action": "checksum", "selector": "target"})
        lm_head = dict(standin.engine.named_weights())["lm_head.weight"].clone()
        entries, buffers = _bucket_entries([("lm_head.weight", lm_head)], FLATTENED_BUCKET)
        get("POST", "/begin_weight_update", {})
        got["update_weights_from_tensor_flattened"] = get("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [entries[0].payload], "load_format": FLATTENED_BUCKET, "flush_cache": True})
        get("POST", "/end_weight_update", {})
        del buffers
        standin.faults.delay_s["/generate:row"] = 5.0
        worker = threading.Thread(target=lambda: got.update(generate_row_aborted=get("POST", "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True})), daemon=True)
        worker.start()
        wait_until(lambda: standin.pending_count() > 0, 10, "the stand-in", "take the request")
        got["flush_cache_busy"] = get("POST", "/flush_cache")
        get("POST", "/pause_generation", {"mode": "abort"})
        worker.join(10)
        get("POST", "/continue_generation", {})
    problems = []
    for name, (status, body) in got.items():
        if name not in real:
            continue
        want = real[name]
        if want["status"] != status:
            problems.append(f"{name}: status {status}, real {want['status']}")
        real_body = want["body"]
        if name in ("model_info",):
            extra = sorted(set(body) - set(real_body))
            if extra:
                problems.append(f"{name}: keys real SGLang does not send: {extra}")
        elif name.startswith("generate"):
            a, b = _shape(body), _shape(real_body)
            if set(a) != set(b) or set(a["meta_info"]) != set(b["meta_info"]):
                problems.append(f"{name}: shape {a} vs real {b}")
            if name == "generate_row_aborted" and body["meta_info"]["finish_reason"].keys() != \
                    real_body["meta_info"]["finish_reason"].keys():
                problems.append(f"{name}: finish_reason {body['meta_info']['finish_reason']} vs real "
                                f"{real_body['meta_info']['finish_reason']}")
        elif name == "weights_checker_checksum":  # every checksum, per rank, and the overall ones
            if body != real_body:
                problems.append(f"{name}: {json.dumps(body)[:300]} vs real {json.dumps(real_body)[:300]}")
        elif isinstance(real_body, dict):
            if set(body) != set(real_body):
                problems.append(f"{name}: keys {sorted(body)} vs real {sorted(real_body)}")
            elif "message" in real_body and body.get("message") != real_body.get("message") \
                    and name not in ("update_weight_version", "error_503_generate"):
                problems.append(f"{name}: message {body.get('message')!r} vs real {real_body.get('message')!r}")
        elif isinstance(body, dict) and set(body) == {"success", "message"}:
            if body["message"] != real_body:
                problems.append(f"{name}: message {body['message']!r} vs real {real_body!r}")
        elif body != real_body:
            problems.append(f"{name}: body {body!r} vs real {real_body!r}")
    report.check("the CI stand-in answers like real SGLang (statuses, keys, fixed messages)", not problems,
                 "; ".join(problems) or f"{len(got)} replies compared")


def fixture_still_holds(report: Report, server: SGLangServer) -> None:
    """record_replies.py's fixed requests to this server against the committed fixture the CI stand-in is
    held to: a difference means SGLang (or the request list) changed since the recording; refresh it with
    ``scripts/test_sglang_real.sh --record-replies``."""
    from record_replies import compare, load_fixture, record  # noqa: E402 - this file's own dir

    got = record(server.url, str(server.model))
    problems = compare(load_fixture()["replies"], got)
    report.check("real SGLang still answers record_replies.py's requests as the committed fixture says",
                 not problems, "; ".join(problems)[:2000] or f"{len(got)} replies compared")


def run_e2e(report: Report, server: SGLangServer, model_dir: Path, args: argparse.Namespace,
            transport: str = "disk") -> None:
    """``python -m megatron_rl.train`` on one CPU rank against the real server through ``transport``
    (figures of the disk run keep their old names ``e2e_*``; the others are ``e2e_<transport>_*``)."""
    out = report.out / ("e2e" if transport == "disk" else f"e2e_{transport}")
    shutil.rmtree(out, ignore_errors=True)  # a run dir left by an earlier check would be resumed or appended to
    out.mkdir(parents=True, exist_ok=True)
    key = "e2e" if transport == "disk" else f"e2e_{transport}"
    what = f"e2e ({transport})"
    prompts = out / "prompts.jsonl"
    synthetic.write_prompt_file(str(prompts), 64, 4, seed=args.seed + 1)
    weights = out / "weights"
    # the server keeps its version from earlier checks; the run pushes 0, 1, ... (a restart of the server
    # would not): reset it so the version check below means this run's pushes
    SGLangClient(server.url).update_weight_version("0", abort_all_requests=False)
    asynchronous = transport.startswith("async-")  # the async drivers, over the disk transport
    sync_flags = (["--update-weight-transport", "disk", "--update-weight-disk-dir", str(weights)]
                  if transport in ("disk", "multi-turn", "delta") or asynchronous
                  else ["--update-weight-transport", transport.split("-")[0]])
    # the post-apply check on the one-sender runs: every sync's bytes in SGLang equal the megatron export's
    verified = transport in ("disk", "distributed", "delta")
    if verified:
        sync_flags += ["--update-weight-verify", "checksum"]
    if transport == "delta":  # --update-weight-mode delta: the host checkpoint under the disk dir, patched and reloaded
        sync_flags += ["--update-weight-mode", "delta"]
    # async-full: responses long enough that syncs land mid-response, so partial rollouts really continue rows
    # that real SGLang aborted with their tokens; async-one-step: rollout N+1 generated while N trains
    async_flags = {"async-one-step": ["--async-mode", "one-step"],
                   "async-full": ["--async-mode", "full", "--partial-rollout", "--max-staleness", "1",
                                  "--rollout-max-response-len", str(args.async_response_len)]}.get(transport, [])
    if transport == "multi-turn":  # a user's generate function from a file outside the package: two turns
        (out / "two_turns.py").write_text(TWO_TURNS.replace("@LOG@", str(out / "engine_calls.jsonl")))
        async_flags = ["--custom-generate-function-path", str(out / "two_turns.py") + ":generate",
                       "--rollout-max-response-len", "9"]  # two turns of 3 tokens around 3 observation ids
    # distributed-pp2: 2 torchrun ranks, 2 pipeline stages, each stage's source sending its own tensors
    launch = ([sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(out / "run"), "--nproc-per-node",
               "2", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
              if transport.endswith("-pp2") else [sys.executable])
    pp = (["--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
          if transport.endswith("-pp2") else [])
    cmd = [*launch, "-m", "megatron_rl.train", *pp, "--hf-checkpoint", str(model_dir), "--prompt-data",
           str(prompts), "--input-key", "prompt", "--label-key", "label",
           "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward",
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
           "--num-rollout", str(args.num_rollout), "--lr", "1e-3",
           "--rollout-backend", "sglang", "--rollout-engine-urls", server.url, *sync_flags,
           "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt"),
           "--output-dir", str(out / "run"), *async_flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    report.log(f"{what}: " + " ".join(cmd))
    t = time.monotonic()
    with open(out / "train.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.e2e_timeout_s, start_new_session=True)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    took = time.monotonic() - t
    report.figures[f"{key}_wall_s"] = round(took, 1)
    tail = "\n".join((out / "train.log").read_text(errors="replace").splitlines()[-25:])
    if not report.check(f"{what}: python -m megatron_rl.train against real SGLang exits 0", rc == 0,
                        f"rc={rc} after {took:.0f} s" + ("" if rc == 0 else f"; log tail:\n{tail}")):
        return
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [rec for rec in records if "perf/step_time_s" in rec]
    syncs = [rec for rec in records if "sync/weight_version" in rec]
    report.figures[f"{key}_steps"] = len(steps)
    report.figures[f"{key}_step_s"] = [round(rec["perf/step_time_s"], 2) for rec in steps]
    report.figures[f"{key}_generate_s"] = [round(rec.get("perf/generate_s", -1.0), 2) for rec in steps]
    report.figures[f"{key}_sync_s"] = [round(rec["sync/time_s"], 2) for rec in syncs if "sync/time_s" in rec]
    for metric in ("sync/load_s", "sync/write_s", "sync/broadcast_s", "sync/connect_s"):
        if syncs and metric in syncs[0]:
            report.figures[f"{key}_{metric.replace('/', '_')}"] = [round(rec[metric], 3) for rec in syncs]
    report.figures[f"{key}_startup_s"] = next((round(rec["perf/startup_s"], 1) for rec in records
                                           if "perf/startup_s" in rec), None)
    report.figures[f"{key}_reward"] = [round(rec.get("rollout/reward_mean", rec.get("rollout/raw_reward", -1)), 3)
                                    for rec in steps]
    report.check(f"{what}: one record per rollout", len(steps) == args.num_rollout, f"{len(steps)} steps")
    report.check(f"{what}: syncs pushed versions 0..N in order",
                 [rec["sync/weight_version"] for rec in syncs] == [float(v) for v in range(args.num_rollout + 1)],
                 f"{[rec['sync/weight_version'] for rec in syncs]}")
    if verified:
        held = len(SGLangClient(server.url).weight_checksums()["ranks"][0]["checksums"])
        report.check(f"{what}: --update-weight-verify checksum: after every sync every tensor SGLang holds equals "
                     "the trainer's checksum of megatron's export", len(syncs) == args.num_rollout + 1 and all(
                         rec.get("sync/verified_tensors") == float(held) for rec in syncs),
                     f"{[rec.get('sync/verified_tensors') for rec in syncs]} of {held}; verify s "
                     f"{[round(rec.get('sync/verify_time_s', -1), 3) for rec in syncs]}")
    if transport == "delta":
        report.figures[f"{key}_delta_fraction"] = [round(rec.get("sync/delta_fraction", -1), 4) for rec in syncs]
        report.check(f"{what}: the first sync full, every later one a delta patched into the host checkpoint and "
                     "reloaded (verified above)", [rec.get("sync/delta") for rec in syncs] ==
                     [0.0] + [1.0] * args.num_rollout and os.path.isdir(weights / "host_checkpoint"),
                     f"sync/delta {[rec.get('sync/delta') for rec in syncs]}, fraction "
                     f"{report.figures[f'{key}_delta_fraction']}")
    per_sample = []
    rollouts = [torch.load(out / "rollouts" / f"rollout_{i}.pt", weights_only=False)["samples"]
                for i in range(args.num_rollout)]
    for samples in rollouts:
        per_sample.append(sorted({s["weight_version"] for s in samples}))
    report.figures[f"{key}_sample_weight_versions"] = per_sample
    if transport == "multi-turn":
        check_multi_turn_e2e(report, what, out, rollouts)
    elif transport == "async-one-step":
        report.check(f"{what}: rollout 0 by version 0, then every rollout i by version i - 1 (generated while i - 1 "
                     "trained)", per_sample == [[0]] + [[i - 1] for i in range(1, args.num_rollout)], f"{per_sample}")
    elif transport == "async-full":
        check_full_async_e2e(report, what, key, rollouts, steps)
    else:
        report.check(f"{what}: every sample of rollout i carries weight version i",
                     per_sample == [[i] for i in range(args.num_rollout)], f"{per_sample}")
    report.check(f"{what}: the server ends at the last pushed version",
                 SGLangClient(server.url).weight_version() == str(args.num_rollout))
    if transport.endswith("-pp2"):
        text = (out / "train.log").read_text(errors="replace")
        made = sorted({line.split("weights-update group ", 1)[1].split(":", 1)[0] for line in text.splitlines()
                       if "weights-update group megatron_rl_weights_" in line})
        report.check(f"{what}: one weights-update group per pipeline stage, each made by its stage's sender",
                     len(made) == 2 and made[0].endswith("_pp0") and made[1].endswith("_pp1"), str(made))


# The multi-turn e2e's generate function (written beside the run, loaded by path as a user's would be):
# turn 1, an observation of fixed token ids (loss mask 0), turn 2 from exactly those tokens; every engine
# call's input and output ids and log-probs appended to a log the check compares the trained samples with.
TWO_TURNS = """
import json

OBSERVATION = [3, 4, 5]


def generate(request, sampling, engine):
    from dataclasses import replace

    from megatron_rl.data.types import Sample

    first = engine.generate(request.prompt_ids, replace(sampling, max_new_tokens=3))
    out = []
    with open("@LOG@", "a") as log:
        for turn in first:
            context = list(request.prompt_ids) + turn.output_ids + OBSERVATION
            second = engine.generate(context, replace(sampling, n=1, max_new_tokens=3))[0]
            log.write(json.dumps({"input": context, "first": turn.output_ids, "first_lp": turn.logprobs,
                                  "second": second.output_ids, "second_lp": second.logprobs}) + "\\n")
            out.append(Sample(request.group_index, list(request.prompt_ids),
                              turn.output_ids + OBSERVATION + second.output_ids,
                              rollout_logprobs=turn.logprobs + [0.0] * len(OBSERVATION) + second.logprobs,
                              loss_mask=[1] * len(turn.output_ids) + [0] * len(OBSERVATION) + [1] * len(second.output_ids),
                              token_versions=turn.token_versions + [turn.token_versions[-1]] * len(OBSERVATION)
                              + second.token_versions,
                              weight_version=turn.weight_version, finish_reason=second.finish_reason,
                              label=request.label, metadata=dict(request.metadata)))
    return out
"""


def check_multi_turn_e2e(report: Report, what: str, out: Path, rollouts: list) -> None:
    """Token in, token out over two turns: every trained sample is exactly the server's turn-1 output ids, the
    observation ids and the server's turn-2 output ids (no text anywhere in between), its behaviour log-probs
    the server's, and the loss mask 0 exactly on the observation."""
    calls = {}
    for line in (out / "engine_calls.jsonl").read_text().splitlines():
        rec = json.loads(line)
        calls[tuple(rec["input"])] = rec
    samples = [s for batch in rollouts for s in batch]
    bad = []
    for s in samples:
        n1 = s["response_ids"].index(3) if 3 in s["response_ids"] else -1
        rec = next((r for key, r in calls.items() if list(key) == s["prompt_ids"] + r["first"] + [3, 4, 5]
                    and s["response_ids"] == r["first"] + [3, 4, 5] + r["second"]), None)
        if rec is None or n1 < 0:
            bad.append(f"sample of {s['label']}: tokens not the server's turns")
            continue
        if s["rollout_logprobs"] != rec["first_lp"] + [0.0, 0.0, 0.0] + rec["second_lp"]:
            bad.append(f"sample of {s['label']}: behaviour log-probs not the server's")
        if s["loss_mask"] != [1] * len(rec["first"]) + [0, 0, 0] + [1] * len(rec["second"]):
            bad.append(f"sample of {s['label']}: loss mask not 0 exactly on the observation")
    report.figures["e2e_multi-turn_samples"] = len(samples)
    report.check(f"{what}: every trained sample is the server's output ids around the observation (two turns, "
                 "input_ids in, output_ids and log-probs out), loss mask 0 exactly on the observation",
                 bool(samples) and not bad, "; ".join(bad[:5]) or f"{len(samples)} samples, {len(calls)} turn-2 calls")


def check_full_async_e2e(report: Report, what: str, key: str, rollouts: list, steps: list) -> None:
    """--async-mode full --partial-rollout against real SGLang: every token within the bound, and rows the sync
    aborted (real SGLang returns their tokens) continued on the new weights, each token with its own version."""
    worst = [max(i - min(s["token_versions"] or [s["weight_version"]]) for s in samples)
             for i, samples in enumerate(rollouts)]
    report.figures[f"{key}_staleness_max"] = worst
    report.check(f"{what}: every trained token within --max-staleness 1", max(worst) <= 1, f"{worst}")
    continued = [s for samples in rollouts for s in samples if "partial_continuations" in s["metadata"]]
    mixed = [s for s in continued if len(set(s["token_versions"])) > 1]
    report.figures[f"{key}_partial_continued_samples"] = len(continued)
    report.figures[f"{key}_mixed_version_samples"] = len(mixed)
    report.check(f"{what}: rows cut by a sync were continued on the new weights (tokens of two versions, "
                 "log-probs and versions one per token)",
                 bool(mixed) and all(len(s["token_versions"]) == len(s["response_ids"]) == len(s["rollout_logprobs"])
                                     and s["token_versions"] == sorted(s["token_versions"]) for s in mixed),
                 f"{len(continued)} continued, {len(mixed)} with two versions")
    report.check(f"{what}: nothing dropped at the staleness bound",
                 all(rec.get("rollout/dropped_stale", 0.0) == 0.0 for rec in steps), "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/sglang_real", help="output dir: figures.json, check.log, server.log")
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"),
                    help="the python of the venv SGLang is installed in (scripts/sglang_cpu_install.sh)")
    ap.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--batch", type=int, default=16, help="prompts per batched generate")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=400, help="tokens per row of the abort/pause generations")
    ap.add_argument("--interrupt-after-s", type=float, default=None,
                    help="seconds into a long generation to abort / pause / flush it (default: a quarter of an "
                         "uninterrupted one, measured)")
    ap.add_argument("--logprob-tol", type=float, default=1e-3, help="max |SGLang - HF| token log-prob allowed")
    ap.add_argument("--num-rollout", type=int, default=3, help="rollouts of the end-to-end run")
    ap.add_argument("--e2e-timeout-s", type=float, default=900.0)
    ap.add_argument("--skip-e2e", action="store_true", help="only the client/engine checks")
    ap.add_argument("--e2e-transports", nargs="+",
                    default=["disk", "distributed", "distributed-pp2", "async-one-step", "async-full",
                             "multi-turn", "delta"],
                    choices=["disk", "distributed", "distributed-pp2", "async-one-step", "async-full", "multi-turn",
                             "delta"],
                    help="the end-to-end run once per weight-sync transport, then the async drivers (disk)")
    ap.add_argument("--async-response-len", type=int, default=160,
                    help="async-full: --rollout-max-response-len, long enough for syncs to land mid-response")
    ap.add_argument("--sync-repeats", type=int, default=5, help="syncs per transport for the disk/distributed timing")
    ap.add_argument("--sync-bucket-bytes", type=int, default=64 * 1024,
                    help="bucket size of the disk/distributed checks (small: several buckets on the tiny model)")
    ap.add_argument("--radix-cache", action="store_true",
                    help="keep SGLang's radix cache (default off: on this CPU route a repeated batch took ~12 s "
                         "with it, 2-3 s without)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", nargs="+", default=ALL_STEPS, choices=ALL_STEPS, metavar="STEP",
                    help=f"the checks to run, in this order (default all): {' '.join(ALL_STEPS)}")
    ap.add_argument("--against-double", action="store_true",
                    help="serve CI's protocol stand-in (tests/rollout/sglang_double, SGLang's command line) instead "
                         "of real SGLang, with this python: every check of this harness runs where SGLang is not "
                         "installed (tests/tools/test_sglang_harness.py), so the harness cannot rot between real runs")
    args = ap.parse_args(argv)
    if "generation" not in args.steps:  # the first generation's log-probs are what the weight checks restore
        args.steps.insert(0, "generation")
    if args.against_double:
        args.sglang_python = sys.executable
        SERVER_PYTHONPATH.insert(0, str(DOUBLE))

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    if not os.access(args.sglang_python, os.X_OK):
        report.log(f"error: {args.sglang_python} is not an executable python; run scripts/sglang_cpu_install.sh "
                   "(or give --sglang-python)")
        return 2
    server = SGLangServer(args.sglang_python, build_model(out, args.seed), out / "server.log",
                          port=args.port or free_port(), extra_args=[] if args.radix_cache else
                          ["--disable-radix-cache"])
    report.figures["radix_cache"] = bool(args.radix_cache)
    atexit.register(server.stop)

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally below, which stops the server

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        report.log(f"starting SGLang on {server.url} (log: {server.log_path})")
        server.start()
        try:
            report.figures["startup_s"] = round(wait_healthy(server, args.startup_timeout_s, report.log), 1)
        except CheckFailed as exc:  # (with the server's log tail)
            report.log(f"error: {exc}")
            report.check("server starts", False, str(exc)[:500])
            return 2
        report.log(f"server healthy after {report.figures['startup_s']} s")
        probe = SGLangClient(server.url, timeout_s=5, connect_retries=0)
        report.replies["model_info"] = {"status": 200, "body": probe.model_info()}
        probe.close()

        checks = Checks(report, server, server.model, args)
        first = None
        for name, needs in SERVER_STEPS:
            if name not in args.steps:
                continue
            report.step = name
            if not server.alive():
                report.check(f"{name}: server alive", False, f"the server died; log tail:\n{server.log_tail()}")
                break
            try:
                step = (lambda f: distributed_updates(checks, f)) if name == "distributed_updates" else \
                    (lambda f: tensor_transport(checks, f)) if name == "tensor_transport" else \
                    (lambda f: verify_checksums(checks, f)) if name == "verify_checksums" else \
                    (lambda f: delta_sync(checks, f)) if name == "delta_sync" else getattr(checks, name)
                result = step(first) if needs else step()
                if name == "generation":
                    first = result
            except Exception as exc:  # noqa: BLE001 - one failed step does not hide the others
                report.check(f"{name} ran without an error", False,
                             f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
                if name == "generation":
                    break
        report.log("not called: release/resume_memory_occupation (on CPU SGLang calls CUDA synchronize there: "
                   "the scheduler dies and the server goes down); get_weights_by_name (missing for Qwen2)")
        checks.engine.close()
        report.step = "unavailable_503"
        try:
            if "unavailable_503" in args.steps:
                unavailable_503(report, server.model, args)
        except Exception as exc:  # noqa: BLE001
            report.check("503 check ran without an error", False, f"{type(exc).__name__}: {exc}")
        report.step = "verify_qwen3"
        try:
            if "verify_qwen3" in args.steps:
                verify_qwen3(report, args)
        except Exception as exc:  # noqa: BLE001
            report.check("the qwen3 checksum check ran without an error", False, f"{type(exc).__name__}: {exc}")
        report.step = "standin_fidelity"
        try:
            if "standin_fidelity" in args.steps:
                standin_fidelity(report, server.model)
        except Exception as exc:  # noqa: BLE001
            report.check("stand-in comparison ran without an error", False, f"{type(exc).__name__}: {exc}")
        report.step = "fixture_still_holds"
        try:
            if "fixture_still_holds" in args.steps:
                fixture_still_holds(report, server)
        except Exception as exc:  # noqa: BLE001
            report.check("the recorded replies re-sent without an error", False, f"{type(exc).__name__}: {exc}")
        for transport in ([] if args.skip_e2e else args.e2e_transports):
            report.step = f"e2e-{transport}"
            if not server.alive():
                break
            try:
                run_e2e(report, server, server.model, args, transport)
            except Exception as exc:  # noqa: BLE001
                report.check(f"e2e ({transport}) ran without an error", False, f"{type(exc).__name__}: {exc}")
        report.step = "end"
        report.check("server alive at the end", server.alive(), "" if server.alive() else server.log_tail())
    finally:
        server.stop()
        report.figures["total_s"] = round(time.monotonic() - report.t0, 1)
        report.save()
    failed = report.failed
    report.log(f"{len(report.checks) - len(failed)} passed, {len(failed)} failed  (figures: {out / 'figures.json'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
