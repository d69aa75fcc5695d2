"""What the per-file CRC-32 in ``COMPLETE.json`` costs, against the torch_dist save and load it guards.

One process (gloo, world 1) saves a sharded state dict of ``--mb`` MB of fp32
tensors with megatron-core's ``dist_checkpointing.save`` (the torch_dist writer
training checkpoints use, fsync included), then measures on the same dir:

* ``save``: the collective write itself;
* ``checksum on save``: ``checkpoint_root.file_list`` (every file read back once
  on rank 0 and hashed; what ``save_checkpoint`` adds before publishing);
* ``load``: ``dist_checkpointing.load`` into preallocated tensors;
* ``checksum on load``: ``checkpoint_root.listed_file_problems`` (sizes + CRC-32,
  what ``load_checkpoint`` adds on rank 0 before the read);
* ``non-finite check``: ``checkpoint.is_non_finite`` (``torch.aminmax``) over every
  loaded tensor (every rank, its own shards);

and prints each as a ratio to the save / load. Also the raw hash throughput of
zlib.crc32 against hashlib.blake2b (and xxhash's xxh3 if installed) on the same
bytes. The page cache is warm for the read-backs (as it is right after a save;
a load from cold storage pays the read once, the checksum then reads from cache).

    python benchmarks/checksum.py [--mb 512] [--workdir DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_rl.infra.ports import free_port  # noqa: E402 - after the repo is on sys.path


def _init_gloo() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _state_dict(total_mb: int, n_tensors: int = 16, fill: bool = True) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    numel = total_mb * (1 << 20) // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n_tensors):
        t = torch.randn(numel, generator=g) if fill else torch.empty(numel)
        out[f"w{i}"] = ShardedTensor.from_rank_offsets(f"w{i}", t, replica_id=0)
    return out


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _hash_rates(data: bytes) -> dict[str, float]:
    mv = memoryview(data)
    rates = {}
    fns = {"zlib.crc32": lambda: zlib.crc32(mv), "hashlib.blake2b": lambda: hashlib.blake2b(mv).digest()}
    try:
        import xxhash

        fns["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64(mv).digest()
    except ImportError:
        pass
    for name, fn in fns.items():
        rates[name] = len(data) / _best(fn, 3) / 1e9
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--mb", type=int, default=512, help="checkpoint size in MB (fp32 tensors)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the best is reported")
    args = ap.parse_args(argv)

    from megatron_rl.backends.megatron.checkpoint import is_non_finite
    from megatron_rl.infra.checkpoint_root import file_list, listed_file_problems
    from megatron_rl.models.dist_io import dist_checkpointing

    _init_gloo()
    dc = dist_checkpointing()  # megatron-core's, with the CPU shim on its writer modules
    work = tempfile.mkdtemp(prefix="ckpt_checksum_", dir=args.workdir)
    try:
        sd = _state_dict(args.mb)
        ckpt = os.path.join(work, "iter_0000001")

        def save():
            shutil.rmtree(ckpt, ignore_errors=True)
            os.makedirs(ckpt)
            dc.save(sd, ckpt)

        t_save = _best(save, args.repeat)
        files = []
        t_sum_save = _best(lambda: files.__setitem__(slice(None), file_list(ckpt)), args.repeat)
        meta = {"files": files}
        nbytes = sum(e["bytes"] for e in files)
        target = _state_dict(args.mb, fill=False)
        loaded = {}
        t_load = _best(lambda: loaded.update(dc.load(target, ckpt)), args.repeat)
        problems = []
        t_sum_load = _best(lambda: problems.extend(listed_file_problems(ckpt, meta)), args.repeat)
        assert not problems, problems
        t_finite = _best(lambda: [is_non_finite(t) for t in loaded.values()], args.repeat)

        print(f"torch_dist checkpoint: {nbytes / 1e6:.0f} MB in {len(files)} files; best of {args.repeat}")
        print(f"{'step':28s} {'s':>8s} {'GB/s':>7s} {'ratio':>22s}")
        rows = [("save (write + fsync)", t_save, "1.00 (of save)"),
                ("checksum on save (CRC-32)", t_sum_save, f"{t_sum_save / t_save:.2f} of save"),
                ("load", t_load, "1.00 (of load)"),
                ("checksum on load (CRC-32)", t_sum_load, f"{t_sum_load / t_load:.2f} of load"),
                ("non-finite check", t_finite, f"{t_finite / t_load:.2f} of load")]
        for name, t, ratio in rows:
            print(f"{name:28s} {t:8.3f} {nbytes / t / 1e9:7.2f} {ratio:>22s}")
        with open(os.path.join(ckpt, sorted(e["path"] for e in files if e["path"].endswith(".distcp"))[0]),
                  "rb") as f:
            sample = f.read(256 << 20)
        print("hash throughput on the same bytes (GB/s): " +
              ", ".join(f"{k} {v:.2f}" for k, v in _hash_rates(sample).items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
