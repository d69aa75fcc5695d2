"""Weight-sync transports vs a plain memcpy and a raw disk write of the same bytes, in one run.

Weights: the HF tensors of a random ``qwen2`` model built with ``megatron_rl.models.hf_tiny``,
scaled up by overrides (default hidden 1024, 8 layers, intermediate = hidden, 8 heads / 2 KV
heads, vocab 2048, float32: ~197 MB in 99 tensors). The trainer side is a fake backend whose
``export_weights(bucket_bytes)`` yields those tensors (x 1.01, so a sync changes the engine)
in greedy buckets of ``--update-weight-buffer-size``, as tests/weight_sync's fake does: no
gathers, no dtype cast, so the rows measure the transport and the engine, not an export.

Rows (after timing, each engine in this process is checked tensor-for-tensor equal to what was
sent; the stand-in process as said below):

* ``tensor -> embedded``: ``InProcessSynchronizer`` into the real ``EmbeddedEngine``
  (``update_weights``: a ``copy_`` per tensor into the live HF parameters).
* ``disk -> embedded``: ``DiskSynchronizer`` into the same engine: ``sync/write_s`` (the
  stream into ``v<version>/model.safetensors``: ``save_file``, fsync of the tree, atomic
  rename) and ``sync/load_s`` (``update_weights_from_disk``: ``safe_open`` per tensor + copy).
* ``disk -> SGLangEngine + stand-in``: the same transport into ``SGLangEngine`` talking HTTP
  to ``tests/rollout/sglang_standin.py`` in this process, the protocol stand-in CI uses, NOT real SGLang (it
  answers ``/update_weights_from_disk`` with ``load_file`` + the embedded engine's copy): this
  measures our client and file path plus a stand-in loader, not SGLang's loader.
* ``distributed -> SGLangEngine + stand-in``: ``DistributedSynchronizer`` into the same stand-in
  running in its own process (its ``main()``, as an SGLang server is a process of its own): it
  joins our gloo group as SGLang does, and per bucket of ``--update-weight-buffer-size`` gets one
  ``/update_weights_from_distributed`` plus one ``broadcast`` per tensor (TCP over loopback; what
  the transport sends over gloo), which it receives into fresh tensors and copies into its embedded
  engine (``sync/broadcast_s``: the HTTP calls and broadcasts of every bucket, until the stand-in
  loaded and answered). ``distributed, flattened``: the same with ONE broadcast of each bucket's
  bytes (``load_format "flattened_bucket"``, ``flattened=True``; what the transport sends over NCCL
  to SGLang 0.5.19+), in its own group, in the same run: on CPU the flattening copy into fresh
  host memory is the price.
* ``tensor -> SGLangEngine + stand-in`` (colocated): ``SGLangTensorSynchronizer`` with a 1-rank
  placement (one colocated ``EngineSlot``, ``trainer_ranks=(0,)``) into that stand-in process:
  per bucket and dtype one flattened buffer in file-system shared memory (``/dev/shm``), whose
  handle the stand-in maps (``/update_weights_from_tensor``, ``flattened_bucket``) and copies from
  (``sync/serialize_s``: flatten into the new buffer + pickle; ``sync/post_s``: the POSTs, until
  the stand-in loaded and answered; the rest includes freeing the buffer after the reply).
  Both stand-in rows measure our client + transport + the stand-in's receive and copy, NOT
  SGLang's loader (no sharding, no host-to-GPU copy; on GPU the tensor route is CUDA IPC, which a CPU
  run cannot show). The out-of-process stand-in cannot be read
  tensor by tensor, so after timing each of these transports pushes all-zero weights (every
  greedy log-prob must then be -ln(vocab)) and then the sent weights again, after which the
  stand-in's greedy generation (tokens and log-probs) must equal the embedded engine's, which was
  checked tensor-for-tensor equal to what was sent, and its ``/model_info`` must report the version.

* ``... -> real SGLang`` (with ``--sglang-python``, the python of a venv holding SGLang 0.5.23, e.g.
  ``/work/sglang-venv/bin/python`` from ``scripts/sglang_cpu_install.sh``): the same four transports
  (disk, distributed per tensor, distributed flattened, tensor colocated) into a REAL
  ``sglang.launch_server`` on this machine's CPU (the route of ``tools/sglang_cpu``: torch_native
  attention, float32, no radix cache, ``--skip-tokenizer-init``), so the rows include SGLang's own
  loaders (its safetensors reader, ``update_weights_from_distributed``'s receive into
  ``load_weights`` with its qkv/gate-up fusing, the flattened bucket's unflatten, the tensor route's
  ``MultiprocessingSerializer`` + load). Checked after timing: each transport pushes all-zero weights
  (every greedy log-prob then -ln(vocab)) and the sent weights again, after which the server's greedy
  generation must equal, bit for bit, its generation after the disk route's load of the same weights
  (SGLang's own loader), whose tokens must be the embedded engine's and log-probs within 1e-3 of its
  (torch_native attention rounds otherwise than HF's); ``/model_info`` must report the version.
  Start-up of the server (16-22 s on an AVX-512 Xeon VM, 50-120 s measured on slower ones)
  overlaps the weights' build and is bounded by ``--sglang-timeout-s``; a server that does not
  come up ends the run with its log's tail.

Baselines, same bytes, same run, same directory (``--dir``): ``memcpy`` (``Tensor.copy_`` of
every tensor into preallocated ones), ``raw write`` (the tensors' bytes ``os.write``-n to one
file, ``os.fsync``-ed), ``raw read`` (that file ``readinto`` a preallocated buffer: page cache),
``safetensors save_file`` (+ ``os.fsync``, as the transport fsyncs) and ``load_file`` + ``copy_``
into the preallocated tensors (``load_file`` maps the file lazily: the copy reads the bytes),
and ``memcpy`` into the embedded engine's own parameters (what ``tensor`` does, minus the
transport and ``update_weights`` around it).

Every row is timed ``--repeats`` times after 2 untimed rounds (first touches; two versions on
disk, so every timed disk sync also prunes one, as each sync of a run does), the rows' order
rotated each round (load drifts on a shared machine); the best round counts (for the disk
rows, write, load and the rest, the prune, are that round's).
``x memcpy`` / ``x raw write`` = the row's seconds / the baseline's (how many times slower).
One thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Loads read files just
written, so they come from the page cache, as on a host where the engine shares the disk.

    python benchmarks/weight_sync.py [--hidden 1024] [--layers 8] [--repeats 5] [--sglang-python PY]

The stand-in process starts while the weights are built (~10 s; ``--standin-timeout-s`` bounds the
wait for its ``URL`` line); its log is ``standin.log`` in the run's temp dir (its tail is printed if
it does not start). Both stand-ins answer with TCP_NODELAY, as uvicorn (real SGLang) does: the
stand-in's ``http.server`` otherwise waits ~40 ms per reply for the client's delayed ACK (see NODELAY).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# The CI stand-in for an SGLang server (tests/rollout/sglang_standin.py), not real SGLang: it
# speaks SGLang's HTTP protocol and is backed by the embedded engine.
STANDIN_DIR = os.path.join(REPO, "tests", "rollout")
sys.path.insert(0, STANDIN_DIR)
sys.path.insert(0, os.path.join(REPO, "tools", "sglang_cpu"))  # check_real_sglang: the real server (--sglang-python)
# The stand-in's http.server writes a reply's headers and body in two sends; with Nagle on, the body
# waits for the client's delayed ACK, ~40 ms per request on Linux loopback. uvicorn (real SGLang)
# sets TCP_NODELAY, so the benchmark's stand-ins do too (in this process and in the stand-in's own).
NODELAY = "import sglang_standin; sglang_standin._Handler.disable_nagle_algorithm = True"

DEFAULT_BUCKET = 512 * 1024 * 1024  # --update-weight-buffer-size's default (config/schema.py)
WARMUP = 2  # untimed rounds


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FakeBackend:
    """The trainer side of a sync: ``export_weights(bucket_bytes)`` yields greedy buckets of ``(name, tensor)``."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def export_weights(self, bucket_bytes: int):
        bucket, size = [], 0
        for name, tensor in self.tensors.items():
            if bucket and size + nbytes(tensor) > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            size += nbytes(tensor)
        if bucket:
            yield bucket


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _byte_view(t: torch.Tensor):
    return memoryview(t.contiguous().view(torch.uint8).numpy())


class StandInProcess:
    """The CI stand-in (tests/rollout/sglang_standin.py) in its own process, as an SGLang server is: the
    distributed transport's broadcasts and the tensor transport's shared-memory handles cross a real
    process boundary. Started by the constructor (it loads for ~10 s while the caller builds the rest), waited
    for with ``wait_url``, killed by ``stop``."""

    def __init__(self, hf: str, log_path: str):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((STANDIN_DIR, REPO))}
        code = f"import sys; {NODELAY}; sys.exit(sglang_standin.main(sys.argv[1:]))"  # its main(), TCP_NODELAY
        self.proc = subprocess.Popen([sys.executable, "-c", code, "--model", hf, "--group-timeout-s", "120"],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)

    def wait_url(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("URL "):
            self.stop()
            with open(self.log_path) as fh:
                tail = fh.read()[-2000:]
            raise SystemExit(f"the stand-in process (tests/rollout/sglang_standin.py) did not print its URL within "
                             f"{timeout_s:g} s (got {line!r}); the tail of its log:\n{tail or '(empty)'}")
        return line.split()[1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


# transport -> (its row's label, the sync metrics printed under it); disk first: check()'s reference
REAL_ROWS = {"disk": ("disk -> real SGLang", ("sync/write_s", "sync/load_s")),
             "distributed": ("distributed -> real SGLang", ("sync/broadcast_s",)),
             "flattened": ("distributed, flattened -> real SGLang", ("sync/broadcast_s",)),
             "tensor": ("tensor -> real SGLang", ("sync/serialize_s", "sync/post_s"))}


class RealSGLangRows:
    """The four transports into one real SGLang server (``--sglang-python``): built once it answers
    ``/health``, one ``SGLangEngine`` and one version counter for all four (as a run has one engine)."""

    def __init__(self, server, hf: str, root: str, bucket: int, timeout_s: float):
        from check_real_sglang import CheckFailed, wait_healthy  # tools/sglang_cpu/
        from megatron_rl.plan.engines import EnginePlacement, EngineSlot
        from megatron_rl.rollout.sglang import SGLangEngine
        from megatron_rl.weight_sync.disk import DiskSynchronizer
        from megatron_rl.weight_sync.distributed import DistributedSynchronizer
        from megatron_rl.weight_sync.sglang_tensor import SGLangTensorSynchronizer

        self.server = server
        try:
            self.startup_s = wait_healthy(server, timeout_s, lambda line: print(line, file=sys.stderr))
        except CheckFailed as exc:  # (with its log's tail) main's closers still stop it and remove the run's dir
            raise SystemExit(f"--sglang-python: {exc}") from None
        self.engine = SGLangEngine([server.url], timeout_s=60, generate_timeout_s=300, update_timeout_s=timeout_s)
        self.version_counter = 0
        self.version = self.engine.clients[0].server_info().get("version", "?")
        placement = EnginePlacement((EngineSlot(0, server.url, 0, (), (0,), str(server.log_path)),),
                                    colocated=True)
        self.syncs = {
            "disk": DiskSynchronizer(bucket, disk_dir=os.path.join(root, "sync_real"), hf_checkpoint=hf),
            "distributed": DistributedSynchronizer(bucket, timeout_s=timeout_s),
            "flattened": DistributedSynchronizer(bucket, timeout_s=timeout_s, flattened=True),
            "tensor": SGLangTensorSynchronizer(bucket, engines=placement, timeout_s=timeout_s),
        }

    def closers(self) -> list:
        """In the order ``main`` runs them reversed: the groups are destroyed before the engine closes."""
        return [self.engine.close] + [s.shutdown for s in self.syncs.values()]

    def sync(self, transport: str, weights) -> dict:
        self.version_counter += 1
        return self.syncs[transport].sync(weights, self.engine, self.version_counter)

    def _greedy(self, prompts, greedy):
        return [(r.response_ids, r.rollout_logprobs) for r in self.engine.generate(prompts, greedy)]

    def check(self, weights, zeros, prompts, greedy, embedded_want, vocab: int) -> None:
        """Every transport lands what SGLang's own disk loader lands (see the module docstring)."""
        reference = None
        for transport in REAL_ROWS:  # disk first: the reference
            self.sync(transport, zeros)
            flat = [lp for _, lps in self._greedy(prompts, greedy) for lp in lps]
            assert flat and all(abs(lp + math.log(vocab)) < 1e-5 for lp in flat), \
                f"{transport} -> real SGLang: after pushing zero weights the log-probs are not -ln(vocab): {flat[:4]}"
            self.sync(transport, weights)
            got = self._greedy(prompts, greedy)
            if reference is None:
                reference = got
                for (tokens, lps), (want_tokens, want_lps) in zip(got, embedded_want):
                    worst = max(abs(a - b) for a, b in zip(lps, want_lps))
                    assert tokens == want_tokens and worst < 1e-3, \
                        f"real SGLang after its disk load: {tokens} vs the embedded engine's {want_tokens}, " \
                        f"log-probs {worst:.2e} apart"
            assert got == reference, f"{transport} -> real SGLang generates otherwise than after its disk load"
            served = self.engine.clients[0].weight_version()
            assert served == str(self.version_counter), \
                f"{transport} -> real SGLang: /model_info reports weight_version {served}, sent {self.version_counter}"
        if not self.server.alive():
            raise AssertionError(f"the real SGLang server died; log tail:\n{self.server.log_tail()}")



def delta_main(args) -> int:
    """``--delta``: bytes and seconds per sync, full vs ``--update-weight-mode delta``, over training steps.

    Two models: the CPU demo's (``data.synthetic.build_demo_model``: qwen2, hidden 64, 2 layers, 0.3 MB in
    float32) trained at the demo's settings (Adam, lr 1e-3, beta2 0.999, grad clip 1.0), and a real-shaped one
    (the rows above: ``--hidden`` x ``--layers``) at ``--delta-lr`` (default 1e-6, an RL post-training rate).
    Each step is one real optimizer step of the float32 HF model on a next-token loss over random token batches
    (the demo's GRPO loss needs rollouts; what the delta sees is how many weights' bits an Adam step moves).
    After every step the float32 weights are synced into embedded engines in float32 and in bfloat16: by the
    in-process route (``tensor``) full without and with ``--update-weight-verify checksum`` and delta with it, and
    by ``disk`` (``v<version>`` written, fsynced, loaded; a delta version holds only the patches) full and delta,
    both verified. Reported per row: bytes and
    seconds per sync over the steps after the first (the first sync of a delta engine is full), the bytes as a
    fraction of full (in the engine's dtype), and the verification's seconds. At the end each delta engine
    must hold, bit for bit, what the full in-process engine of its dtype holds.
    """
    import statistics

    import transformers

    from megatron_rl.data.synthetic import build_demo_model
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout import EmbeddedEngine
    from megatron_rl.weight_sync.delta import EngineUpdates
    from megatron_rl.weight_sync.disk import DiskSynchronizer
    from megatron_rl.weight_sync.in_process import InProcessSynchronizer

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="weight_sync_delta_", dir=args.dir)
    heads = max(1, args.hidden // 128)
    models = [("demo", build_demo_model(os.path.join(root, "demo")), 1e-3),
              (f"hidden {args.hidden} x {args.layers} layers", build_tiny_hf_model(
                  "qwen2", os.path.join(root, "hf"), hidden_size=args.hidden, num_hidden_layers=args.layers,
                  intermediate_size=args.intermediate or args.hidden, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), vocab_size=args.vocab), args.delta_lr)]
    print(f"delta sync: {args.delta_steps} optimizer steps per model, one sync after each (and one before); "
          f"rows average the syncs after the first; one thread")
    print(f"{'model':<26} {'engine':<9} {'route':<6} {'mode':<6} {'verify':<8} {'MB/sync':>9} {'x full':>7} {'s/sync':>8} "
          f"{'verify s':>9} {'changed':>8}")
    try:
        for label, hf, lr in models:
            model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
            opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
            vocab = int(model.config.vocab_size)
            g = torch.Generator().manual_seed(0)
            rows = {}
            for dtype in (torch.float32, torch.bfloat16):
                names = [n for n, _ in EmbeddedEngine(hf, dtype=dtype).named_weights()]
                for transport, mode, verify in (("tensor", "full", False), ("tensor", "full", True),
                                                ("tensor", "delta", True), ("disk", "full", True),
                                                ("disk", "delta", True)):
                    engine = EmbeddedEngine(hf, dtype=dtype)
                    updates = EngineUpdates(mode=mode, verify=verify)
                    sync = InProcessSynchronizer(bucket_bytes=args.update_weight_buffer_size, updates=updates) \
                        if transport == "tensor" else DiskSynchronizer(
                            bucket_bytes=args.update_weight_buffer_size, updates=updates, hf_checkpoint=hf,
                            disk_dir=os.path.join(root, f"w_{label[:4]}_{dtype}_{mode}"))
                    rows[(dtype, transport, mode, verify)] = (engine, sync, [])
            for step in range(args.delta_steps + 1):
                if step:
                    batch = torch.randint(0, vocab, (8, 16), generator=g)
                    loss = model(input_ids=batch, labels=batch).loss
                    opt.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                state = model.state_dict()
                weights = {n: state[n].detach().clone() for n in names if n in state}
                for engine, sync, out in rows.values():
                    out.append(sync.sync(FakeBackend(weights), engine, version=step))
            for (dtype, transport, mode, verify), (engine, _sync, out) in rows.items():
                later = out[1:]
                full_bytes = later[0].get("sync/full_bytes", sum(nbytes(t) for _, t in engine.named_weights()))
                sent = statistics.mean(m["sync/bytes"] if mode == "delta" else full_bytes for m in later)
                secs = statistics.median(m["sync/time_s"] for m in later)
                vs = statistics.median(m.get("sync/verify_time_s", 0.0) for m in later)
                changed = statistics.mean(m.get("sync/changed_fraction", 1.0) for m in later)
                print(f"{label:<26} {str(dtype).replace('torch.', ''):<9} {transport:<6} {mode:<6} "
                      f"{'checksum' if verify else 'off':<8} "
                      f"{sent / 1e6:>9.3f} {sent / full_bytes:>7.3f} {secs:>8.4f} {vs:>9.4f} {changed:>8.4f}")
            for dtype in (torch.float32, torch.bfloat16):
                want = dict(rows[(dtype, "tensor", "full", False)][0].named_weights())
                for transport in ("tensor", "disk"):
                    got = dict(rows[(dtype, transport, "delta", True)][0].named_weights())
                    if not all(torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8))
                               for n in want):
                        print(f"FAILED: the {dtype} delta engine of {transport} differs from the full one")
                        return 1
        print("checked: after the last step every delta engine equals the full engine of its dtype bit for bit")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)



def verify_main(args) -> int:
    """``--sglang-verify`` (needs ``--sglang-python``): the cost of ``--update-weight-verify checksum`` with a real
    SGLang server, per sync, on the real-shaped model of the rows above (``--hidden`` x ``--layers``, float32).

    One real ``sglang.launch_server`` on this CPU (``tools/sglang_cpu``'s route); per transport (disk, distributed
    per tensor, tensor colocated), ``--repeats`` rounds of one sync without and one with the check (the weights x
    1.01 and x 1.02 in turn, so every sync changes the engine). Reported per transport: the median sync seconds
    without and with (with: ``sync/time_s`` + the check after it), the trainer's part (``sync/verify_hash_s``:
    cutting SGLang's fused / padded tensors from the export and hashing them, inside ``sync/time_s``) and the
    server's (``sync/verify_time_s``: ``/weights_checker`` checksum of every tensor on the server, the reply and the
    compare). Every verified sync must compare every tensor SGLang holds.
    """
    import statistics

    import transformers
    from safetensors.torch import load_file

    from check_real_sglang import SGLangServer, free_port  # tools/sglang_cpu/
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.plan.sglang_weights import read_hf_config
    from megatron_rl.weight_sync.sglang_verify import SGLangVerifier

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    heads = max(1, args.hidden // 128)
    root = tempfile.mkdtemp(prefix="weight_sync_verify_", dir=args.dir)
    closers: list = []
    try:
        hf = build_tiny_hf_model("qwen2", os.path.join(root, "hf"), hidden_size=args.hidden,
                                 num_hidden_layers=args.layers, intermediate_size=args.intermediate or args.hidden,
                                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                 vocab_size=args.vocab)
        # --mem-fraction-static above the CPU route's 0.05: on a host with less free memory the 201 MB of weights
        # leave SGLang no KV cache under 0.05 (it refuses to start, naming 0.133)
        server = SGLangServer(args.sglang_python, Path(hf), Path(root) / "sglang.log", port=free_port(),
                              extra_args=["--disable-radix-cache", "--skip-tokenizer-init",
                                          "--mem-fraction-static", "0.3"])
        server.start()
        closers.append(server.stop)
        base = load_file(os.path.join(hf, "model.safetensors"))
        states = [FakeBackend({k: v * f for k, v in base.items()}) for f in (1.01, 1.02)]
        total = sum(nbytes(t) for t in base.values())
        real = RealSGLangRows(server, hf, root, args.update_weight_buffer_size, args.sglang_timeout_s)
        closers += real.closers()
        verifier = SGLangVerifier(read_hf_config(hf))
        print(f"--update-weight-verify checksum into real SGLang {real.version} on CPU (start-up "
              f"{real.startup_s:.0f} s): qwen2 hidden {args.hidden} x {args.layers} layers, {total / 1e6:.0f} MB "
              f"float32 in {len(base)} tensors, one bucket of {args.update_weight_buffer_size / 2**20:.0f} MiB; "
              f"median of {args.repeats}; one thread")
        print(f"{'transport':<12} {'sync s':>8} {'verified s':>11} {'trainer hash s':>15} {'server check s':>15} "
              f"{'tensors':>8}")
        for transport in ("disk", "distributed", "tensor"):
            sync = real.syncs[transport]
            rows: dict[str, list[float]] = {"off": [], "on": [], "hash": [], "check": []}
            checked = set()
            for i in range(args.repeats):
                for on in (False, True):
                    sync.sglang_verifier = verifier if on else None
                    m = real.sync(transport, states[(2 * i + on) % 2])
                    rows["on" if on else "off"].append(m["sync/time_s"] + m.get("sync/verify_time_s", 0.0))
                    if on:
                        rows["hash"].append(m["sync/verify_hash_s"])
                        rows["check"].append(m["sync/verify_time_s"])
                        checked.add(int(m["sync/verified_tensors"]))
            med = {k: statistics.median(v) for k, v in rows.items()}
            print(f"{transport:<12} {med['off']:>8.3f} {med['on']:>11.3f} {med['hash']:>15.3f} {med['check']:>15.3f} "
                  f"{'/'.join(map(str, sorted(checked))):>8}")
            if len(checked) != 1:
                print(f"FAILED: {transport}: the verified syncs compared {sorted(checked)} tensors")
                return 1
        return 0
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(root, ignore_errors=True)


def _training_states(hf: str, lr: float, steps: int, names: list[str]):
    """The float32 weights before and after each of ``steps`` Adam steps (delta_main's loss and settings), the same
    sequence on every call (one thread, seeded): a pass of full syncs and a pass of delta syncs see equal states."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999))
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    for step in range(steps + 1):
        if step:
            batch = torch.randint(0, vocab, (8, 16), generator=g)
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        state = model.state_dict()
        yield {n: state[n].detach().clone() for n in names}


def sglang_delta_main(args) -> int:
    """``--sglang-delta`` (needs ``--sglang-python``): ``--update-weight-mode delta`` into a REAL SGLang server through
    the host checkpoint (``rollout/sglang/host_checkpoint.py``), against full syncs, over training steps.

    Per model (the CPU demo's at its lr 1e-3, and the real-shaped ``--hidden`` x ``--layers`` at ``--delta-lr``; the
    Adam steps of ``--delta``) one ``sglang.launch_server`` on this CPU (``--sglang-dtype``, float32 or bfloat16):
    a pass of full disk syncs after every step (``v<version>`` of the float32 export, SGLang casts on load), then,
    from the same weights again, a pass of delta syncs (the first full: the host checkpoint adopts its files; then
    the diff in the server's dtype, the delta version, the patch into the host checkpoint and SGLang's load of the
    changed tensors). Reported per pass over the syncs after the first: MB written by the trainer per sync (full:
    the export; delta: indices + values + dense tensors), its fraction of the model in the server's dtype, the
    changed elements' fraction, the tensors the server reloads, and seconds per sync (median; write, load).
    Checked: after both passes every tensor the server holds has the same ``/weights_checker`` checksum.
    """
    import statistics

    import transformers

    from check_real_sglang import CheckFailed, SGLangServer, free_port, wait_healthy  # tools/sglang_cpu/
    from megatron_rl.data.synthetic import build_demo_model
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout import EmbeddedEngine
    from megatron_rl.rollout.sglang import SGLangEngine
    from megatron_rl.rollout.sglang.host_checkpoint import PATCH_FILE, HostCheckpoint
    from megatron_rl.weight_sync.delta import EngineUpdates
    from megatron_rl.weight_sync.disk import DiskSynchronizer

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="weight_sync_sglang_delta_", dir=args.dir)
    heads = max(1, args.hidden // 128)
    bucket = args.update_weight_buffer_size
    closers: list = []
    try:
        models = [("demo", build_demo_model(os.path.join(root, "demo")), 1e-3),
                  (f"hidden {args.hidden} x {args.layers}", build_tiny_hf_model(
                      "qwen2", os.path.join(root, "hf"), hidden_size=args.hidden, num_hidden_layers=args.layers,
                      intermediate_size=args.intermediate or args.hidden, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4), vocab_size=args.vocab), args.delta_lr)]
        print(f"--update-weight-mode delta into real SGLang on CPU (--dtype {args.sglang_dtype}), disk transport, "
              f"{args.delta_steps} Adam steps, one sync after each (and one before); rows: the syncs after the "
              f"first, median seconds; one thread")
        print(f"{'model':<20} {'mode':<6} {'MB/sync':>9} {'x model':>8} {'changed':>8} {'reloaded':>9} {'s/sync':>8} "
              f"{'write s':>8} {'load s':>8}")
        for label, hf, lr in models:
            names = [n for n, _ in EmbeddedEngine(hf).named_weights()]
            server = SGLangServer(args.sglang_python, Path(hf), Path(root) / f"sglang_{label[:4]}.log",
                                  port=free_port(), extra_args=["--disable-radix-cache", "--skip-tokenizer-init",
                                                                "--mem-fraction-static", "0.3", "--dtype",
                                                                args.sglang_dtype])
            server.start()
            closers.append(server.stop)
            try:
                wait_healthy(server, args.sglang_timeout_s, lambda line: print(line, file=sys.stderr))
            except CheckFailed as exc:
                raise SystemExit(f"--sglang-python: {exc}") from None
            host = HostCheckpoint(os.path.join(root, label[:4], "host"), hf_checkpoint=hf, shard_bytes=bucket)
            engine = SGLangEngine([server.url], hf_checkpoint=hf, timeout_s=60, update_timeout_s=args.sglang_timeout_s,
                                  health_interval_s=0, host_checkpoint=host)
            closers.append(engine.close)
            passes = {"full": DiskSynchronizer(bucket, disk_dir=os.path.join(root, label[:4], "full"), hf_checkpoint=hf),
                      "delta": DiskSynchronizer(bucket, disk_dir=os.path.join(root, label[:4], "delta"),
                                                hf_checkpoint=hf, updates=EngineUpdates(mode="delta"))}
            checksums = {}
            served = getattr(torch, args.sglang_dtype)
            model_bytes = sum(t.numel() * torch.empty((), dtype=served).element_size()
                              for t in next(iter(_training_states(hf, lr, 0, names))).values())
            for mode, sync in passes.items():
                out = []
                for weights in _training_states(hf, lr, args.delta_steps, names):
                    out.append(sync.sync(FakeBackend(weights), engine, engine.weight_version + 1))
                    patch = os.path.join(host.patches.path(engine.weight_version), PATCH_FILE)
                    if mode == "delta" and len(out) > 1 and os.path.isfile(patch):
                        with open(patch) as fh:
                            out[-1]["reloaded"] = len(json.load(fh)["tensors"])  # the tensors SGLang reloads
                checksums[mode] = engine.clients[0].weight_checksums(timeout_s=args.sglang_timeout_s)
                later = out[1:]
                if mode == "delta":
                    if not all(m.get("sync/delta") == 1.0 for m in later):
                        print(f"FAILED: {label}: a sync after the first was not a delta: "
                              f"{[m.get('sync/delta') for m in later]}")
                        return 1
                sent = statistics.mean(m["sync/bytes"] for m in later)
                names_loaded = statistics.mean(m.get("reloaded", 0) for m in later) if mode == "delta" else len(names)
                print(f"{label:<20} {mode:<6} {sent / 1e6:>9.3f} "
                      f"{sent / model_bytes:>8.3f} "
                      f"{statistics.mean(m.get('sync/changed_fraction', 1.0) for m in later):>8.4f} "
                      f"{names_loaded:>9.1f} {statistics.median(m['sync/time_s'] for m in later):>8.3f} "
                      f"{statistics.median(m['sync/write_s'] for m in later):>8.3f} "
                      f"{statistics.median(m['sync/load_s'] for m in later):>8.3f}")
            if checksums["full"].get("ranks") != checksums["delta"].get("ranks"):
                print(f"FAILED: {label}: after the delta pass SGLang holds other bytes than after the full pass")
                return 1
        print("checked: after each model's delta pass every tensor SGLang holds has the checksum it had after the "
              "full pass of the same weights (/weights_checker)")
        return 0
    finally:
        for close in reversed(closers):
            close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: = --hidden)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--update-weight-buffer-size", type=int, default=DEFAULT_BUCKET,
                    help="bytes per exported bucket (default: the flag's default, 512 MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds (best of)")
    ap.add_argument("--dir", default=None, help="where files are written (default: the system temp dir)")
    ap.add_argument("--standin-timeout-s", type=float, default=120.0,
                    help="how long the stand-in process may take to start (print its URL)")
    ap.add_argument("--sglang-python", default=None,
                    help="the python of a venv with SGLang 0.5.23 (scripts/sglang_cpu_install.sh): adds the rows "
                         "into a real SGLang server on this CPU (default: none, the stand-in rows only)")
    ap.add_argument("--sglang-timeout-s", type=float, default=600.0,
                    help="how long the real SGLang server may take to answer /health")
    ap.add_argument("--delta", action="store_true",
                    help="only the full-vs-delta rows (--update-weight-mode delta) over training steps: see delta_main")
    ap.add_argument("--delta-steps", type=int, default=6, help="--delta: optimizer steps per model")
    ap.add_argument("--delta-lr", type=float, default=1e-6, help="--delta: the real-shaped model's Adam lr")
    ap.add_argument("--sglang-verify", action="store_true",
                    help="only --update-weight-verify checksum's cost per sync into real SGLang (needs "
                         "--sglang-python): see verify_main")
    ap.add_argument("--sglang-delta", action="store_true",
                    help="only full vs --update-weight-mode delta into real SGLang through the host checkpoint "
                         "(needs --sglang-python): see sglang_delta_main")
    ap.add_argument("--sglang-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                    help="--sglang-delta: the server's --dtype (what the delta is computed in)")
    args = ap.parse_args(argv)
    if args.sglang_delta:
        if not args.sglang_python:
            ap.error("--sglang-delta measures against real SGLang: give --sglang-python")
        return sglang_delta_main(args)
    if args.delta:
        return delta_main(args)
    if args.sglang_verify:
        if not args.sglang_python:
            ap.error("--sglang-verify measures against real SGLang: give --sglang-python")
        return verify_main(args)
    if args.sglang_python and not os.access(args.sglang_python, os.X_OK):
        ap.error(f"--sglang-python {args.sglang_python}: not an executable python; run "
                 "scripts/sglang_cpu_install.sh (it prints the venv) or drop the flag")

    import transformers
    from safetensors.torch import load_file, save_file
    import sglang_standin  # tests/rollout/ (see the sys.path line at the top)
    from sglang_standin import SGLangStandIn

    sglang_standin._Handler.disable_nagle_algorithm = True  # see NODELAY

    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.plan.engines import EnginePlacement, EngineSlot
    from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
    from megatron_rl.rollout.sglang import SGLangEngine
    from megatron_rl.weight_sync.disk import DiskSynchronizer
    from megatron_rl.weight_sync.distributed import DistributedSynchronizer
    from megatron_rl.weight_sync.in_process import InProcessSynchronizer
    from megatron_rl.weight_sync.sglang_tensor import SGLangTensorSynchronizer

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of each engine's model load
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    heads = max(1, args.hidden // 128)
    root = tempfile.mkdtemp(prefix="weight_sync_bench_", dir=args.dir)
    closers: list = []  # run in reverse order on every path: the group is destroyed before its server goes
    try:
        hf = build_tiny_hf_model("qwen2", os.path.join(root, "hf"), hidden_size=args.hidden,
                                 num_hidden_layers=args.layers, intermediate_size=args.intermediate or args.hidden,
                                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                 vocab_size=args.vocab)
        standin = StandInProcess(hf, os.path.join(root, "standin.log"))  # starts while the rest is built
        closers.append(standin.stop)
        real_server = None
        if args.sglang_python:  # starts while the rest is built, too
            from check_real_sglang import SGLangServer, free_port  # tools/sglang_cpu/

            real_server = SGLangServer(args.sglang_python, Path(hf), Path(root) / "sglang.log", port=free_port(),
                                       extra_args=["--disable-radix-cache", "--skip-tokenizer-init"])
            real_server.start()
            closers.append(real_server.stop)
        source = {k: v * 1.01 for k, v in load_file(os.path.join(hf, "model.safetensors")).items()}
        total = sum(nbytes(t) for t in source.values())
        backend = FakeBackend(source)
        n_buckets = sum(1 for _ in backend.export_weights(args.update_weight_buffer_size))
        bucket = args.update_weight_buffer_size
        engine = EmbeddedEngine(hf)
        server = SGLangStandIn(hf).start()
        closers.append(server.stop)
        sgl = SGLangEngine([server.url], timeout_s=60)
        closers.append(sgl.close)
        disk_embedded = DiskSynchronizer(bucket, disk_dir=os.path.join(root, "sync_embedded"), hf_checkpoint=hf)
        disk_sglang = DiskSynchronizer(bucket, disk_dir=os.path.join(root, "sync_sglang"), hf_checkpoint=hf)
        in_process = InProcessSynchronizer(bucket)
        dst = {k: torch.empty_like(v) for k, v in source.items()}
        live = dict(engine.named_weights())  # views of the engine's parameters
        raw_path, st_path = os.path.join(root, "raw.bin"), os.path.join(root, "plain.safetensors")
        raw_buf = bytearray(total)
        version = {"embedded": 0, "sglang": 0, "remote": 0}
        url = standin.wait_url(args.standin_timeout_s)
        remote = SGLangEngine([url], timeout_s=60, update_timeout_s=120)  # the stand-in process
        distributed = DistributedSynchronizer(bucket, timeout_s=120)
        flattened = DistributedSynchronizer(bucket, timeout_s=120, flattened=True)
        placement = EnginePlacement((EngineSlot(0, url, 0, (), (0,), standin.log_path),), colocated=True)
        tensor_sglang = SGLangTensorSynchronizer(bucket, engines=placement, timeout_s=120)
        closers += [remote.close, distributed.shutdown, flattened.shutdown,
                    tensor_sglang.shutdown]  # shutdown: destroys the group
        real = RealSGLangRows(real_server, hf, root, bucket, args.sglang_timeout_s) if real_server else None
        if real:
            closers += real.closers()

        def memcpy():
            for k, v in source.items():
                dst[k].copy_(v)
            return {}

        def raw_write():
            fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for v in source.values():
                    view = _byte_view(v)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            return {}

        def raw_read():
            with open(raw_path, "rb", buffering=0) as fh:
                view, got = memoryview(raw_buf), 0
                while got < total:
                    got += fh.readinto(view[got:])
            return {}

        def st_save():
            save_file(source, st_path, metadata={"format": "pt"})
            _fsync_path(st_path)
            return {}

        def st_load():  # load_file maps the file lazily: copy_ reads the bytes (as the engines' loads do)
            for k, v in load_file(st_path).items():
                dst[k].copy_(v)
            return {}

        def memcpy_live():
            for k, v in source.items():
                live[k].copy_(v)
            return {}

        def tensor_embedded():
            version["embedded"] += 1
            return in_process.sync(backend, engine, version["embedded"])

        def disk_to_embedded():
            version["embedded"] += 1
            return disk_embedded.sync(backend, engine, version["embedded"])

        def disk_to_sglang():
            version["sglang"] += 1
            return disk_sglang.sync(backend, sgl, version["sglang"])

        def distributed_to_sglang(weights=backend):
            version["remote"] += 1
            return distributed.sync(weights, remote, version["remote"])

        def flattened_to_sglang(weights=backend):
            version["remote"] += 1
            return flattened.sync(weights, remote, version["remote"])

        def tensor_to_sglang(weights=backend):
            version["remote"] += 1
            return tensor_sglang.sync(weights, remote, version["remote"])

        rows = {"memcpy": memcpy, "memcpy live": memcpy_live, "raw write": raw_write, "raw read": raw_read,
                "st save": st_save, "st load": st_load, "tensor -> embedded": tensor_embedded,
                "disk -> embedded": disk_to_embedded, "disk -> sglang": disk_to_sglang,
                "distributed -> sglang": distributed_to_sglang, "flattened -> sglang": flattened_to_sglang,
                "tensor -> sglang": tensor_to_sglang}
        if real:
            rows.update({f"{t} -> real sglang": (lambda t=t: real.sync(t, backend)) for t in REAL_ROWS})
        raw_write()  # raw read needs the file; the first round's order may put it first
        best: dict[str, tuple[float, dict]] = {}
        for it in range(WARMUP + args.repeats):  # warm-up: first touches, and 2 versions on disk so every
            names = list(rows)                      # timed disk sync prunes one, as in a run's steady state
            shift = it * 3 % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                metrics = rows[name]()
                seconds = time.perf_counter() - t0
                if it >= WARMUP and (name not in best or seconds < best[name][0]):
                    best[name] = (seconds, metrics)

        # untimed: each transport again into zeroed weights, then the engine must equal what was sent
        # ("memcpy live" writes the same values into the embedded engine, so check right after each sync)
        for what, sync, target in (("tensor -> embedded", tensor_embedded, engine),
                                   ("disk -> embedded", disk_to_embedded, engine),
                                   ("disk -> sglang", disk_to_sglang, server.engine)):
            for _, t in target.named_weights():
                t.zero_()
            sync()
            got = dict(target.named_weights())
            bad = [n for n, t in source.items() if not torch.equal(got[n], t)]
            assert not bad and set(got) == set(source), f"{what}: the engine differs from what was sent: {bad[:5]}"
        # the stand-in process cannot be read tensor by tensor: all-zero weights first (every greedy log-prob is
        # then -ln(vocab): the push landed), then the sent weights again, after which its greedy generation must
        # equal the embedded engine's (which holds exactly what was sent, checked above) and /model_info the version
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        prompts = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]
        # one row at a time, as the stand-in generates a batch's rows (a padded batch rounds differently)
        want = [(r.response_ids, r.rollout_logprobs) for p in prompts for r in engine.generate([p], greedy)]
        zeros = FakeBackend({k: torch.zeros_like(v) for k, v in source.items()})
        for what, sync in (("distributed -> sglang", distributed_to_sglang),
                           ("flattened -> sglang", flattened_to_sglang), ("tensor -> sglang", tensor_to_sglang)):
            sync(zeros)
            flat = [lp for r in remote.generate(prompts, greedy) for lp in r.rollout_logprobs]
            assert flat and all(abs(lp + math.log(args.vocab)) < 1e-5 for lp in flat), \
                f"{what}: after pushing zero weights the stand-in's log-probs are not -ln(vocab): {flat[:4]}"
            sync()
            got = [(r.response_ids, r.rollout_logprobs) for r in remote.generate(prompts, greedy)]
            assert got == want, f"{what}: the stand-in generates otherwise than the weights sent: {got} != {want}"
            served = remote.clients[0].weight_version()
            assert served == str(version["remote"]) == str(remote.weight_version), \
                f"{what}: /model_info reports weight_version {served}, sent {version['remote']}"
        if real:
            real.check(backend, zeros, prompts, greedy, want, args.vocab)
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - reported, and the other closers still run
                print(f"while closing down: {type(exc).__name__}: {exc}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t_start

    s = {name: sec for name, (sec, _) in best.items()}
    m = {name: met for name, (_, met) in best.items()}
    table = [
        ("memcpy (Tensor.copy_, preallocated)", s["memcpy"]),
        ("memcpy into the engine's own params", s["memcpy live"]),
        ("raw write (os.write one file + fsync)", s["raw write"]),
        ("raw read (readinto, page cache)", s["raw read"]),
        ("safetensors save_file + fsync", s["st save"]),
        ("safetensors load_file + copy_", s["st load"]),
        ("safetensors save + load", s["st save"] + s["st load"]),
        ("tensor -> EmbeddedEngine", s["tensor -> embedded"]),
        ("disk -> EmbeddedEngine", s["disk -> embedded"]),
        ("  sync/write_s", m["disk -> embedded"]["sync/write_s"]),
        ("  sync/load_s", m["disk -> embedded"]["sync/load_s"]),
        ("  rest (prune: rm the version 2 back)", s["disk -> embedded"] - m["disk -> embedded"]["sync/write_s"]
         - m["disk -> embedded"]["sync/load_s"]),
        ("disk -> SGLangEngine + CI stand-in *", s["disk -> sglang"]),
        ("  sync/write_s", m["disk -> sglang"]["sync/write_s"]),
        ("  sync/load_s (HTTP + stand-in load)", m["disk -> sglang"]["sync/load_s"]),
        ("  rest (prune: rm the version 2 back)", s["disk -> sglang"] - m["disk -> sglang"]["sync/write_s"]
         - m["disk -> sglang"]["sync/load_s"]),
        ("distributed -> SGLangEngine + stand-in *", s["distributed -> sglang"]),
        ("  sync/broadcast_s (HTTP + gloo + load)", m["distributed -> sglang"]["sync/broadcast_s"]),
        ("  rest (pause, begin/end, /model_info)", s["distributed -> sglang"]
         - m["distributed -> sglang"]["sync/broadcast_s"] - m["distributed -> sglang"]["sync/connect_s"]),
        ("distributed, flattened buckets *", s["flattened -> sglang"]),
        ("  sync/broadcast_s (+ the flatten copy)", m["flattened -> sglang"]["sync/broadcast_s"]),
        ("tensor -> SGLangEngine + stand-in *", s["tensor -> sglang"]),
        ("  sync/serialize_s (flatten into shm)", m["tensor -> sglang"]["sync/serialize_s"]),
        ("  sync/post_s (HTTP + map + load)", m["tensor -> sglang"]["sync/post_s"]),
        ("  rest (free shm; pause, begin/end)", s["tensor -> sglang"] - m["tensor -> sglang"]["sync/serialize_s"]
         - m["tensor -> sglang"]["sync/post_s"]),
    ]
    print(f"qwen2 hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate or args.hidden}, "
          f"{heads}/{max(1, heads // 4)} heads, vocab {args.vocab}, float32: {len(source)} tensors, "
          f"{total / 1e6:.1f} MB in {n_buckets} bucket(s) of <= {bucket / 2**20:.0f} MiB")
    print(f"best of {args.repeats} rounds, 1 thread; files under {args.dir or tempfile.gettempdir()}; "
          f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; whole run {wall:.0f} s")
    print(f"{'':<40}{'MB':>8}{'s':>9}{'GB/s':>8}{'x memcpy':>10}{'x raw write':>13}")
    for label, sec in table:
        print(f"{label:<40}{total / 1e6:>8.1f}{sec:>9.3f}{total / sec / 1e9:>8.2f}"
              f"{sec / s['memcpy']:>10.1f}{sec / s['raw write']:>13.2f}")
    if real:
        print(f"real SGLang {real.version} on this CPU (the server answered /health {real.startup_s:.0f} s after its start):")
        for t, (label, keys) in REAL_ROWS.items():
            sec, met = best[f"{t} -> real sglang"]
            parts = [(label, sec)] + [(f"  {k}", met[k]) for k in keys if k in met]
            for text, v in parts:
                print(f"{text:<40}{total / 1e6:>8.1f}{v:>9.3f}{total / v / 1e9:>8.2f}"
                      f"{v / s['memcpy']:>10.1f}{v / s['raw write']:>13.2f}")
    else:
        print("real SGLang rows: not run (--sglang-python PY, a venv from scripts/sglang_cpu_install.sh)")
    print("* the protocol stand-in CI uses (tests/rollout/sglang_standin.py), not real SGLang: our client + transport "
          "+ the stand-in's receive and copy into its embedded engine, not SGLang's loader; disk: in this process "
          "(load_file + copy); distributed and tensor: in its own process (gloo broadcasts over loopback; a mapped "
          "/dev/shm buffer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
