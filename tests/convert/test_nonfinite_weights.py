"""An HF checkpoint holding inf/NaN is refused where it is read, naming the tensor and its file.

Before: the trainer loaded it and reported "NaN logits ... weights corrupt or never loaded" after
step 0, the embedded engine served it, and tools/convert_ckpt.py copied it silently both ways. The
model is the tiny llama tests/conftest.py builds, with one value of one tensor poisoned.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.errors import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint, NonFiniteWeights, check_finite

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "convert_ckpt.py")
sys.path.insert(0, os.path.join(REPO, "tools"))
import convert_ckpt  # noqa: E402

VICTIM = "model.layers.1.mlp.down_proj.weight"  # [hidden 64, intermediate 128] in the tiny llama


@pytest.fixture
def poisoned(tiny_hf_models, tmp_path):
    """A copy of the tiny llama with one NaN at row 3, column 100 of VICTIM."""
    src = tiny_hf_models("llama")
    dst = tmp_path / "poisoned"
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors[VICTIM][3, 100] = float("nan")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_reader_refuses_what_it_reads_and_only_that(poisoned):
    ckpt = HFCheckpoint(poisoned)
    with pytest.raises(NonFiniteWeights) as e:
        ckpt.read(VICTIM)
    msg = str(e.value)
    assert f"'{VICTIM}' in {poisoned / 'model.safetensors'}" in msg and "1 NaN, 0 inf" in msg
    assert "re-download it, or re-export it" in msg
    with pytest.raises(NonFiniteWeights):
        ckpt.read(VICTIM, 1, 96, 128)  # a TP rank's column slice that holds it
    assert ckpt.read(VICTIM, 1, 0, 64).shape == (64, 64)  # one that does not: that rank reads sound values
    assert ckpt.read(VICTIM, 0, 4, 64).shape == (60, 128)
    assert torch.isfinite(ckpt.read("model.norm.weight")).all()  # the other tensors load
    check_finite("ids", torch.tensor([1, 2]), "x")  # only floating dtypes are checked
    with pytest.raises(NonFiniteWeights, match=r"'b' in here holds non-finite values \(0 NaN, 2 inf"):
        check_finite("b", torch.tensor([1.0, float("inf"), -float("inf")], dtype=torch.bfloat16), "here")


def test_the_trainer_hf_load_refuses_it(poisoned):
    from megatron_rl.models import dist_io, get_bridge
    from megatron_rl.models.parallel import ParallelLayout

    dist_io.setup(ParallelLayout())
    bridge = get_bridge(str(poisoned))
    chunks = bridge.build_model(ParallelLayout())
    with pytest.raises(CheckpointError, match=rf"'{VICTIM}' in {poisoned / 'model.safetensors'} holds non-finite"):
        bridge.load_hf_weights(chunks, str(poisoned))


def test_the_embedded_engine_refuses_it(poisoned):
    from megatron_rl.rollout.embedded import EmbeddedEngine

    with pytest.raises(NonFiniteWeights, match=rf"'{VICTIM}' in {poisoned / 'model.safetensors'} holds non-finite "
                                               r"values \(1 NaN"):
        EmbeddedEngine(str(poisoned))


def test_cast_to_a_narrower_dtype_that_overflows_is_refused():
    from megatron_rl.convert.common import cast_checked

    t = torch.tensor([1.0, 1e6])
    assert cast_checked("w", t, torch.float32) is t
    assert cast_checked("w", t, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(NonFiniteWeights, match=r"'w' in the output cast to --dtype float16 .* 1 inf.*use --dtype "
                                               r"bfloat16 or float32"):
        cast_checked("w", t, torch.float16)


def test_convert_ckpt_hf_to_dist_refuses_it_exit_2(poisoned, tmp_path):
    """The real tool in a subprocess: one line naming the tensor and file, exit 2, nothing written."""
    out = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, TOOL, "hf-to-dist", "--input", str(poisoned), "--output", str(out),
                        "--no-progress"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_ckpt.py hf-to-dist: tensor ") and VICTIM in last, p.stderr[-3000:]
    assert str(poisoned / "model.safetensors") in last and "1 NaN" in last
    assert "Traceback" not in p.stderr  # torch's writer wrapped it in a CheckpointException traceback
    assert not out.exists() and not (tmp_path / ".dist.tmp").exists()


def test_convert_ckpt_dist_to_hf_refuses_a_nonfinite_checkpoint_exit_2(tiny_hf_models, tmp_path, monkeypatch,
                                                                       capsys):
    """A torch_dist dir whose weights diverged (inf written by the save itself, so every CRC-32 in its
    COMPLETE.json matches): dist-to-hf refuses it by HF tensor name instead of publishing it."""
    from megatron_rl.convert import hf_to_dist

    real = hf_to_dist.local_value

    def diverged(bridge, slot, ckpt):
        value = real(bridge, slot, ckpt)
        if slot.canonical_name == "decoder.layers.1.mlp.linear_fc2.weight":
            value = value.clone()
            value[0, 0] = float("inf")
        return value

    dist = tmp_path / "dist"
    monkeypatch.setattr(hf_to_dist, "local_value", diverged)
    assert convert_ckpt.main(["hf-to-dist", "--input", tiny_hf_models("llama"), "--output", str(dist),
                              "--no-progress"]) == 0
    monkeypatch.undo()
    capsys.readouterr()
    out = tmp_path / "hf"
    assert convert_ckpt.main(["dist-to-hf", "--input", str(dist), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"convert_ckpt.py dist-to-hf: tensor '{VICTIM}' in torch_dist checkpoint {dist} holds "
                          "non-finite values (0 NaN, 1 inf"), err
    assert "convert an earlier iter_NNNNNNN dir" in err
    assert not out.exists() and not (tmp_path / ".hf.tmp").exists()
