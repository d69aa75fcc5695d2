"""SIGKILL during an fsdp save: the next run resumes from the last complete checkpoint, exactly.

The fsdp counterpart of tests/e2e/test_resume.py (ii) (the megatron demo SIGKILLed while
``.iter_0000002.tmp`` exists), at the cost of one single-process run instead of demo launches:

1. a worker process (this file run as a script) trains a real one-rank FSDPBackend, saves
   iter_1 through the runner's ``CheckpointSaver`` (DCP files, marker, publish, pointers),
   trains a 2nd step and starts saving iter_2. The save is held at its last moment: every
   file, ``COMPLETE.json`` included, is in ``.iter_0000002.tmp`` and only the rename into
   place is left (pause point ``publish_sealed:iter_0000002``). The test SIGKILLs it there:
   the most complete half-written checkpoint there can be (an earlier kill leaves a subset
   of these files in the same temp dir);
2. in this process a fresh backend runs the runner's ``Resumer`` on the root: it must load
   iter_1 (the temp dir is never a candidate, whatever it holds), give the weights the
   killed run had after step 1 bit for bit, train step 2 to the weights the killed run had
   reached (same layout: model, optimizer, scheduler and RNG restored), and save iter_2
   again over the leftover temp dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
import pytest

pytestmark = pytest.mark.dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 600  # a hang bound on the worker's start-up (imports, model) and two steps; ~10 s on an idle 2-core machine


def _backend_and_saver(hf: str, root: str):
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config
    from megatron_rl.infra.tracking import Tracker
    from megatron_rl.infra.wall_time import WallClock
    from megatron_rl.runner.checkpoints import CheckpointCursor, CheckpointSaver

    cfg = parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "1", "--train-backend", "fsdp",
                        "--lr", "1e-2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                        "--micro-batch-size", "1", "--seed", "7", "--save", root, "--save-interval", "1"])
    spec = PolicyGradientSpec(PolicyGradientConfig())
    backend = make_backend("fsdp")
    backend.initialize(cfg, spec)
    cursor = CheckpointCursor()
    saver = CheckpointSaver(cfg, cursor, WallClock(None, 0.0), Tracker(root, enabled=False), is_driver=True)
    return cfg, spec, backend, cursor, saver


def _train_step(backend, spec) -> dict:
    sys.path.insert(0, os.path.join(REPO, "tests", "dist", "scripts"))
    from backend_worker import make_samples

    from megatron_rl.backends.base import TrainBatch

    samples = make_samples(backend.vocab_size)
    backend.train_step(TrainBatch(samples, spec.compute_advantages(samples),
                                  old_logprobs=backend.forward_only(samples)))
    return {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}


def worker(hf: str, root: str, out: str) -> None:
    """Step 1, save iter_1, step 2, save iter_2, held before its rename (the test's pause point)."""
    _, spec, backend, _, saver = _backend_and_saver(hf, root)
    torch.save(_train_step(backend, spec), os.path.join(out, "step1.pt"))
    saver.save(backend, None, 1)
    torch.save(_train_step(backend, spec), os.path.join(out, "step2.pt"))
    saver.save(backend, None, 2)  # pauses at publish_sealed:iter_0000002: the test SIGKILLs us there
    raise SystemExit("not killed at the pause point")


def test_sigkill_during_save_resumes_from_the_last_complete_checkpoint(tmp_path, tiny_hf_models, caplog):
    import torch.distributed as dist

    from _util import PausePoint
    from megatron_rl.backends.fsdp.backend import init_process_group
    from megatron_rl.infra import checkpoint_root as ckpt
    from megatron_rl.runner.resume import Resumer

    hf, root = tiny_hf_models("qwen2"), str(tmp_path / "ckpt")
    log = open(tmp_path / "worker.log", "w")
    point = PausePoint(tmp_path / "pause", "publish_sealed:iter_0000002")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")} | point.env
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), hf, root, str(tmp_path)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        assert point.wait(proc, timeout=WAIT_S, output=lambda: (tmp_path / "worker.log").read_text()[-3000:]) == \
            proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == -signal.SIGKILL  # a hang bound
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=120)
        log.close()

    # what the kill left: iter_1 published, iter_2 complete in every file but only under its temp name
    half = tmp_path / "ckpt" / ".iter_0000002.tmp"
    assert (half / ckpt.MARKER_NAME).is_file() and (half / ".metadata").is_file()
    assert ckpt.list_iterations(root) == [1] and ckpt.resume_candidates(root) == [1]
    assert ckpt.read_latest(root) == 1 and ckpt.read_resume_state(root)["checkpoint"] == ckpt.iter_dir(root, 1)

    made = not dist.is_initialized()
    init_process_group()
    try:
        cfg, spec, backend, cursor, saver = _backend_and_saver(hf, root)
        with caplog.at_level("INFO", logger="megatron_rl"):
            assert Resumer(cfg, cursor).resume_or_init(backend, None) == 1
        assert f"resumed from {ckpt.iter_dir(root, 1)} at rollout 1" in caplog.text
        step1, step2 = (torch.load(tmp_path / f"step{i}.pt") for i in (1, 2))
        resumed = {n: t for bucket in backend.export_weights(1 << 20) for n, t in bucket}
        assert resumed.keys() == step1.keys() and all(torch.equal(resumed[n], step1[n]) for n in step1)
        again = _train_step(backend, spec)
        assert all(torch.equal(again[n], step2[n]) for n in step2)  # exact resume
        assert any(not torch.equal(step1[n], step2[n]) for n in step1)
        saver.save(backend, None, 2)  # over the killed save's leftover temp dir
    finally:
        if made:
            dist.destroy_process_group()
    assert ckpt.list_iterations(root) == [1, 2] and not half.exists()
    assert ckpt.resume_candidates(root) == [2, 1]
    assert ckpt.read_resume_state(root)["checkpoint"] == ckpt.iter_dir(root, 2)


if __name__ == "__main__":
    worker(*sys.argv[1:4])
