"""Weight-sync transports vs a plain memcpy and a raw disk write of the same bytes, in one run.

Weights: the HF tensors of a random ``qwen2`` model built with ``megatron_rl.models.hf_tiny``,
scaled up by overrides (default hidden 1024, 8 layers, intermediate = hidden, 8 heads / 2 KV
heads, vocab 2048, float32: ~197 MB in 99 tensors). The trainer side is a fake backend whose
``export_weights(bucket_bytes)`` yields those tensors (x 1.01, so a sync changes the engine)
in greedy buckets of ``--update-weight-buffer-size``, as tests/weight_sync's fake does: no
gathers, no dtype cast, so the rows measure the transport and the engine, not an export.

Rows (each synced engine is checked tensor-for-tensor equal to what was sent, after timing):

* ``tensor -> embedded``: ``InProcessSynchronizer`` into the real ``EmbeddedEngine``
  (``update_weights``: a ``copy_`` per tensor into the live HF parameters).
* ``disk -> embedded``: ``DiskSynchronizer`` into the same engine: ``sync/write_s`` (the
  stream into ``v<version>/model.safetensors``: ``save_file``, fsync of the tree, atomic
  rename) and ``sync/load_s`` (``update_weights_from_disk``: ``safe_open`` per tensor + copy).
* ``disk -> SGLangEngine + stand-in``: the same transport into ``SGLangEngine`` talking HTTP
  to ``tests/rollout/sglang_standin.py``, the protocol stand-in CI uses, NOT real SGLang (it
  answers ``/update_weights_from_disk`` with ``load_file`` + the embedded engine's copy): this
  measures our client and file path plus a stand-in loader, not SGLang's loader.

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

    python benchmarks/weight_sync.py [--hidden 1024] [--layers 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# The CI stand-in for an SGLang server (tests/rollout/sglang_standin.py), not real SGLang: it
# speaks SGLang's HTTP protocol and is backed by the embedded engine.
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

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
    args = ap.parse_args(argv)

    import transformers
    from safetensors.torch import load_file, save_file
    from sglang_standin import SGLangStandIn  # tests/rollout/ (see the sys.path line at the top)

    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout import EmbeddedEngine
    from megatron_rl.rollout.sglang import SGLangEngine
    from megatron_rl.weight_sync.disk import DiskSynchronizer
    from megatron_rl.weight_sync.in_process import InProcessSynchronizer

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of each engine's model load
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    heads = max(1, args.hidden // 128)
    root = tempfile.mkdtemp(prefix="weight_sync_bench_", dir=args.dir)
    try:
        hf = build_tiny_hf_model("qwen2", os.path.join(root, "hf"), hidden_size=args.hidden,
                                 num_hidden_layers=args.layers, intermediate_size=args.intermediate or args.hidden,
                                 num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                                 vocab_size=args.vocab)
        source = {k: v * 1.01 for k, v in load_file(os.path.join(hf, "model.safetensors")).items()}
        total = sum(nbytes(t) for t in source.values())
        backend = FakeBackend(source)
        n_buckets = sum(1 for _ in backend.export_weights(args.update_weight_buffer_size))
        bucket = args.update_weight_buffer_size
        engine = EmbeddedEngine(hf)
        server = SGLangStandIn(hf).start()
        sgl = SGLangEngine([server.url], timeout_s=60)
        disk_embedded = DiskSynchronizer(bucket, disk_dir=os.path.join(root, "sync_embedded"), hf_checkpoint=hf)
        disk_sglang = DiskSynchronizer(bucket, disk_dir=os.path.join(root, "sync_sglang"), hf_checkpoint=hf)
        in_process = InProcessSynchronizer(bucket)
        dst = {k: torch.empty_like(v) for k, v in source.items()}
        live = dict(engine.named_weights())  # views of the engine's parameters
        raw_path, st_path = os.path.join(root, "raw.bin"), os.path.join(root, "plain.safetensors")
        raw_buf = bytearray(total)
        version = {"embedded": 0, "sglang": 0}

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

        rows = {"memcpy": memcpy, "memcpy live": memcpy_live, "raw write": raw_write, "raw read": raw_read,
                "st save": st_save, "st load": st_load, "tensor -> embedded": tensor_embedded,
                "disk -> embedded": disk_to_embedded, "disk -> sglang": disk_to_sglang}
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
        sgl.close()
        server.stop()
    finally:
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
    print("* the protocol stand-in CI uses (tests/rollout/sglang_standin.py: load_file + the embedded engine's "
          "copy), not real SGLang: our client + file path, not SGLang's loader")
    return 0


if __name__ == "__main__":
    sys.exit(main())
