"""fsdp-to-hf: a --train-backend fsdp checkpoint (DCP) -> HF dir, bit-exact against the model the run held.

One module fixture trains a real FSDPBackend (one rank, a gloo group made in this process
and destroyed before the conversions run) one step on a tied-embedding qwen2 and on a
qwen3_moe with --bf16, and saves each with the backend's own save. The converted dirs are
loaded with transformers and compared tensor by tensor (torch.equal) with the parameters
the run held (fp32 master weights), and under --dtype bfloat16 with what the run exported
to its rollout engine. The DP2 -> HF case (shards of two ranks) is in
tests/dist/test_fsdp_backend.py (it reuses that file's launch).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open

from megatron_rl.infra.checkpoint_root import iter_dir, temp_dir_for
from megatron_rl.models import model_dir
from megatron_rl.models.hf_checkpoint import HFCheckpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, os.path.join(REPO, "tests", "dist", "scripts"))
import convert_ckpt  # noqa: E402
from backend_worker import make_samples  # noqa: E402  (the backend tests' batch)


@dataclass
class Run:
    hf: str  # the --hf-checkpoint it started from
    root: str  # its checkpoint root (iter_0000001 inside)
    held: dict  # module name -> the full fp32 parameter the run held when it saved
    exported: dict  # HF name -> what export_weights gave the rollout engine


def _train_and_save(hf: str, root: str, flags: list[str]):
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config

    cfg = parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "1", "--train-backend", "fsdp",
                        "--lr", "1e-2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "3",
                        "--micro-batch-size", "1", "--seed", "7", *flags])
    spec = PolicyGradientSpec(PolicyGradientConfig())
    backend = make_backend("fsdp")
    backend.initialize(cfg, spec)
    samples = make_samples(backend.vocab_size)
    backend.train_step(TrainBatch(samples, spec.compute_advantages(samples),
                                  old_logprobs=backend.forward_only(samples)))
    backend.save(iter_dir(root, 1), {"rollout_id": 1})
    held = {n: p.full_tensor().detach().clone() for n, p in backend.model.named_parameters()}
    exported = {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}
    return backend, Run(hf, root, held, exported)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_hf_models):
    import torch.distributed as dist

    from megatron_rl.backends.fsdp.backend import init_process_group

    tmp = tmp_path_factory.mktemp("fsdp_convert")
    made = not dist.is_initialized()
    init_process_group()  # one rank, a private TCP store: nothing leaks into os.environ
    try:
        backend, dense = _train_and_save(tiny_hf_models("qwen2", tie_word_embeddings=True), str(tmp / "dense"), [])
        # the same run's weights with one NaN, saved under another root: a checkpoint no HF dir should come from
        p = backend.model.model.layers[1].mlp.down_proj.weight
        with torch.no_grad():
            p.to_local()[0, 0] = float("nan")
        backend.save(iter_dir(str(tmp / "nan"), 1), {"rollout_id": 1})
        _, moe = _train_and_save(tiny_hf_models("qwen3_moe"), str(tmp / "moe"), ["--bf16"])
        # GLM-4.5's router bias is a persistent buffer the checkpoint holds: it must reach the HF dir
        _, glm = _train_and_save(tiny_hf_models("glm4_moe"), str(tmp / "glm"), [])
    finally:
        if made:
            dist.destroy_process_group()  # the converter runs without a process group, as the CLI does
    return {"dense": dense, "moe": moe, "glm": glm, "nan": str(tmp / "nan")}


def _cli(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = convert_ckpt.main(argv + ["--no-progress"])
    return rc, capsys.readouterr().err


def _read_all(hf_dir) -> dict[str, torch.Tensor]:
    ck = HFCheckpoint(hf_dir)
    try:
        return {n: ck.read(n) for n in ck.names()}
    finally:
        ck.close()


def _names_in(hf_dir) -> set[str]:
    names = set()
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), framework="pt") as st:
                names |= set(st.keys())
    return names


@pytest.mark.parametrize("which", ["dense", "moe", "glm"])
def test_converted_dir_loads_in_transformers_equal_to_the_held_model(runs, which, tmp_path, capsys):
    import transformers

    run = runs[which]
    out = tmp_path / "hf"
    rc, err = _cli(["fsdp-to-hf", "--input", run.root, "--output", str(out), "--verify"], capsys)  # a root
    assert rc == 0, err
    # the HF checkpoint's own names: per-expert for qwen3_moe, the tied lm_head once (not at all)
    assert _names_in(out) == _names_in(run.hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    got = dict(model.named_parameters())
    assert set(got) == set(run.held)
    assert all(torch.equal(got[n].detach(), run.held[n]) for n in run.held), \
        [n for n in run.held if not torch.equal(got[n].detach(), run.held[n])]
    initial = transformers.AutoModelForCausalLM.from_pretrained(run.hf, dtype=torch.float32)
    assert any(not torch.equal(p, got[n]) for n, p in initial.named_parameters())  # the trained weights, not these
    # persistent buffers (glm4_moe's e_score_correction_bias) are the checkpoint's, never a loader's zeros
    buffers = {n: b for n, b in initial.named_buffers() if n in initial.state_dict()}
    assert all(torch.equal(model.get_buffer(n), b) for n, b in buffers.items())
    if which == "glm":
        assert any("e_score_correction_bias" in n and b.abs().sum() > 0 for n, b in buffers.items())
        assert any("e_score_correction_bias" in n for n in run.exported)  # and the engine gets it too
    marker = json.load(open(out / model_dir.MARKER_NAME))
    assert marker["format"] == model_dir.HF_FORMAT and marker["source"]["kind"] == "fsdp_dcp"
    assert marker["source"]["path"] == iter_dir(run.root, 1) and marker["source"]["optimizer_steps"] == 1
    assert json.load(open(out / "config.json")) == json.load(open(os.path.join(run.hf, "config.json")))
    assert not os.path.exists(temp_dir_for(str(out)))


def test_dtype_bfloat16_streamed_equals_what_the_run_exported(runs, tmp_path, capsys):
    """--bf16 run: --dtype bfloat16 gives the engine's weights bit for bit, read a layer at a
    time (--bucket-size 1 byte) into many shards."""
    run = runs["moe"]
    out = tmp_path / "hf"
    rc, err = _cli(["fsdp-to-hf", "--input", iter_dir(run.root, 1), "--output", str(out), "--dtype", "bfloat16",
                    "--bucket-size", "1", "--max-shard-size", "40KB", "--verify"], capsys)
    assert rc == 0, err
    written = _read_all(out)
    assert set(written) == set(run.exported)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, run.exported[n]) for n, t in written.items())
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 3
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"


def test_the_wrong_kind_of_checkpoint_is_refused_naming_the_right_direction(runs, tmp_path, capsys):
    run = runs["dense"]
    rc, err = _cli(["dist-to-hf", "--input", run.root, "--output", str(tmp_path / "o1")], capsys)
    assert rc == 2 and "is an fsdp training checkpoint" in err and "convert_ckpt.py fsdp-to-hf --input" in err, err
    # a megatron training checkpoint is told apart by its marker's format alone (the protocol): marker-only dir
    meg = tmp_path / "meg" / "iter_0000004"
    meg.mkdir(parents=True)
    (meg / model_dir.MARKER_NAME).write_text(json.dumps({"format": model_dir.TRAINING_FORMAT, "files": []}))
    rc, err = _cli(["fsdp-to-hf", "--input", str(tmp_path / "meg"), "--output", str(tmp_path / "o2")], capsys)
    assert rc == 2 and "megatron torch_dist training checkpoint" in err and "convert_ckpt.py dist-to-hf" in err, err
    rc, err = _cli(["fsdp-to-hf", "--input", run.hf, "--output", str(tmp_path / "o3")], capsys)
    assert rc == 2 and "is an HF model dir" in err and "HF already" in err, err
    rc, err = _cli(["hf-to-dist", "--input", iter_dir(run.root, 1), "--output", str(tmp_path / "o4")], capsys)
    assert rc == 2 and "convert_ckpt.py fsdp-to-hf" in err, err
    assert not [p for p in os.listdir(tmp_path) if p.startswith(("o", ".o"))]


def test_refusals_name_the_problem_and_leave_no_output(runs, tmp_path, tiny_hf_models, capsys):
    run = runs["dense"]
    src = iter_dir(run.root, 1)
    damaged = tmp_path / "damaged" / "iter_0000001"
    shutil.copytree(src, damaged)
    shard = next(f for f in os.listdir(damaged) if f.endswith(".distcp"))
    with open(damaged / shard, "r+b") as f:  # same size, other bytes
        f.seek(os.path.getsize(damaged / shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    (tmp_path / "exists").mkdir()
    half = tmp_path / "r" / ".iter_0000002.tmp"  # a save killed after it wrote everything, marker included
    shutil.copytree(src, half)
    cases = [
        (["--input", str(damaged)], f"{shard} has CRC-32"),
        (["--input", runs["nan"]],
         "non-finite (inf/NaN) weights in model.layers.1.mlp.down_proj.weight"),
        (["--input", src, "--hf-config", tiny_hf_models("qwen2", hidden_size=32)], "hidden_size: checkpoint 64 vs "
                                                                                  "config 32"),
        (["--input", src, "--hf-config", tiny_hf_models("qwen2", tie_word_embeddings=True, intermediate_size=96)],
         "mis-shaped ['model.layers.0.mlp.down_proj.weight (64, 128) (config: (64, 96))'"),
        (["--input", str(half)], "is an unpublished temp dir of an interrupted write"),
        (["--input", str(tmp_path / "nope")], "does not exist"),
        (["--input", str(tmp_path / "exists")], "has no COMPLETE.json"),
    ]
    for i, (argv, needle) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, err = _cli(["fsdp-to-hf", *argv, "--output", str(out)], capsys)
        assert rc == 2 and needle in err, (argv, err)
        assert not out.exists() and not os.path.exists(temp_dir_for(str(out))), argv
    rc, err = _cli(["fsdp-to-hf", "--input", src, "--output", str(tmp_path / "exists")], capsys)
    assert rc == 2 and "exists; pass --overwrite" in err
