"""Training start-up with a damaged --hf-checkpoint ends in one ``error:`` line and exit 2.

issue 11: a truncated ``model.safetensors`` raised safetensors' SafetensorError traceback from
inside the weight load. One real ``python -m megatron_rl.train`` process (it fails before any
collective, so one rank shows the whole behaviour).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from _util import REPO, free_port


def _start_training(hf, tmp_path) -> subprocess.CompletedProcess:
    """One real single-rank ``python -m megatron_rl.train`` on ``hf`` (it is expected to refuse at start-up)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(hf), "--output-dir",
                           str(tmp_path / "run"), "--num-rollout", "1", "--rollout-batch-size", "2",
                           "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_truncated_hf_checkpoint_is_one_error_line(tmp_path, tiny_hf_models):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("llama"), hf)
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    p = _start_training(hf, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert (f"error: {shard} ({os.path.getsize(shard)} bytes) is not a readable safetensors file"
            in p.stderr), p.stderr[-3000:]


def test_damaged_dist_to_hf_output_is_refused_by_file_name(tmp_path, tiny_hf_models):
    """A dist-to-hf output carries CRC-32s in its COMPLETE.json; same-size damage to a shard used to
    train silently from --hf-checkpoint (only the converter checked the marker)."""
    import json

    from megatron_rl.models.model_dir import HF_FORMAT
    from megatron_rl.infra.checkpoint_root import MARKER_NAME, file_list

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("llama"), hf)
    (hf / MARKER_NAME).write_text(json.dumps({"format": HF_FORMAT, "files": file_list(str(hf))}))
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:  # flip bytes of the last tensor's data: the header stays readable
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    p = _start_training(hf, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "model.safetensors has CRC-32" in p.stderr and "same size, different bytes" in p.stderr, p.stderr[-3000:]
