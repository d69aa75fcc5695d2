"""Converter pieces that need no megatron model, and the CLI's refusals (exit 2, names).

Refusals here all happen before a model is built, so they run in-process and fast.
The end-to-end CLI round trip (one llama) runs the real tool in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.convert import common
from megatron_rl.models import model_dir
from megatron_rl.convert.safetensors_writer import INDEX_FILE, ShardedSafetensorsWriter, parse_size
from megatron_rl.errors import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "convert_ckpt.py")
sys.path.insert(0, os.path.join(REPO, "tools"))
import convert_ckpt  # noqa: E402


def _tensors(hf_dir) -> dict[str, torch.Tensor]:
    ck = HFCheckpoint(hf_dir)
    try:
        return {n: ck.read(n) for n in sorted(ck.names())}
    finally:
        ck.close()


def assert_same_tensors(a_dir, b_dir, cast=None):
    a, b = _tensors(a_dir), _tensors(b_dir)
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    for n in a:
        ref = a[n].to(cast) if cast is not None else a[n]
        assert ref.dtype == b[n].dtype, n
        assert ref.shape == b[n].shape, n
        assert torch.equal(ref.view(torch.uint8), b[n].view(torch.uint8)), f"{n} differs"


# ------------------------------------------------------------------------------------------ writer
def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000
    assert parse_size(7) == 7
    for bad in ("five", "-1MB", "0"):
        with pytest.raises(CheckpointError, match="max-shard-size"):
            parse_size(bad)


def test_writer_shards_by_size_and_indexes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, generator=g) for i in range(10)}  # ~400 B each
    tensors["big"] = torch.randn(1000, generator=g)  # 4000 B > limit: a shard of its own
    flat = torch.arange(20, dtype=torch.float32)
    views = {"v0": flat[:10].view(2, 5), "v1": flat[10:].view(2, 5)}  # share storage (like a PP bucket)
    w = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=1000)
    for n, t in {**tensors, **views}.items():
        w.add(n, t)
    index = w.finish()
    files = sorted(set(index["weight_map"].values()))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".part")]
    for f in files:
        size = sum(t.numel() * 4 for t in load_file(str(tmp_path / f)).values())
        assert size <= 1000 or len(load_file(str(tmp_path / f))) == 1
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in {**tensors, **views}.values())
    got = _tensors(tmp_path)
    assert sorted(got) == sorted({**tensors, **views})
    for n, t in {**tensors, **views}.items():
        assert torch.equal(got[n], t)
    assert w.peak_pending_bytes <= 4000


def test_writer_refuses_duplicates_and_empty(tmp_path):
    w = ShardedSafetensorsWriter(str(tmp_path / "a"), 10**6)
    w.add("x", torch.zeros(2))
    with pytest.raises(CheckpointError, match="'x' was written twice"):
        w.add("x", torch.zeros(2))
    with pytest.raises(CheckpointError, match="no tensors"):
        ShardedSafetensorsWriter(str(tmp_path / "b"), 10).finish()


# ------------------------------------------------------------------------------------------ common
def test_dtype_helpers():
    assert common.parse_dtype("keep") is None and common.parse_dtype(None) is None
    assert common.parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(CheckpointError, match="--dtype 'int8'"):
        common.parse_dtype("int8")
    assert common.uniform_dtype({"a": torch.float32, "b": torch.float32}, "x") is torch.float32
    with pytest.raises(CheckpointError, match=r"mixes dtypes.*bfloat16: 1 tensor\(s\), e.g. \['b'\].*--dtype"):
        common.uniform_dtype({"a": torch.float32, "b": torch.bfloat16}, "x")


def test_aux_files_copy(tmp_path, tiny_hf_models):
    src = tmp_path / "src"
    shutil.copytree(tiny_hf_models("llama"), src)
    (src / "tokenizer.json").write_text('{"x": 1}')
    (src / "tokenizer_config.json").write_text("{}")
    assert model_dir.aux_files(str(src)) == ["config.json", "generation_config.json", "tokenizer.json",
                                          "tokenizer_config.json"]
    dst = tmp_path / "dst"
    model_dir.copy_aux_files(str(src), str(dst), {"dtype": "bfloat16"})
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json in .*empty"):
        model_dir.copy_aux_files(str(tmp_path / "empty"), str(dst))


def _fake_dist(path, files=None, fmt=model_dir.FORMAT):
    os.makedirs(path)
    (path / "a.distcp").write_bytes(b"12345")
    meta = {"format": fmt, "files": files if files is not None else [{"path": "a.distcp", "bytes": 5}]}
    (path / model_dir.MARKER_NAME).write_text(json.dumps(meta))
    return path


def test_read_marker_refuses_incomplete_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        model_dir.read_marker(str(tmp_path / "nope"))
    (tmp_path / "nomarker").mkdir()
    with pytest.raises(CheckpointError, match=f"nomarker has no {model_dir.MARKER_NAME}: it is incomplete"):
        model_dir.read_marker(str(tmp_path / "nomarker"))
    (tmp_path / ".x.tmp").mkdir()
    with pytest.raises(CheckpointError, match="unpublished temp dir of an interrupted write"):
        model_dir.read_marker(str(tmp_path / ".x.tmp"))
    ok = _fake_dist(tmp_path / "ok")
    assert model_dir.read_marker(str(ok))["format"] == model_dir.FORMAT
    assert model_dir.read_marker(str(_fake_dist(tmp_path / "train", fmt=model_dir.TRAINING_FORMAT)))
    bad = _fake_dist(tmp_path / "bad", files=[{"path": "a.distcp", "bytes": 9}, {"path": "gone", "bytes": 1}])
    with pytest.raises(CheckpointError, match=r"corrupt: a.distcp has 5 bytes, COMPLETE.json says 9; gone missing"):
        model_dir.read_marker(str(bad))
    other = _fake_dist(tmp_path / "other", fmt="something.else")
    with pytest.raises(CheckpointError, match="format 'something.else'"):
        model_dir.read_marker(str(other))


def test_resolve_checkpoint_root(tmp_path):
    root = tmp_path / "root"
    _fake_dist(root / "iter_0000002")
    (root / "iter_0000005").mkdir()  # incomplete, newer: skipped
    assert model_dir.resolve_dist_dir(str(root)) == str(root / "iter_0000002")
    empty_root = tmp_path / "r2"
    (empty_root / "iter_0000001").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="none is complete"):
        model_dir.resolve_dist_dir(str(empty_root))


# ------------------------------------------------------------------------------------------ CLI refusals
def _edited_copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    if edit_config:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        edit_config(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return str(dst)


def _run_cli(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()  # drop fixture output
    rc = convert_ckpt.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", ["extra", "missing", "shape", "config", "mixed_dtype"])
def test_hf_to_dist_refusals_name_tensors(case, tmp_path, tiny_hf_models, capsys):
    src = tiny_hf_models("qwen2")
    edits = {
        "extra": (lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2)), None,
                  ["model.layers.0.mlp.extra_proj.weight", "map to no megatron parameter"]),
        "missing": (lambda t: t.pop("model.layers.2.self_attn.k_proj.bias"), None,
                    ["model.layers.2.self_attn.k_proj.bias", "are missing"]),
        "shape": (lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(100, 64)), None,
                  ["model.layers.1.mlp.up_proj.weight: checkpoint (100, 64) vs config (128, 64)"]),
        "config": (None, lambda c: c.update(num_hidden_layers=3),
                   ["model.layers.3.input_layernorm.weight", "map to no megatron parameter", "config.json"]),
        "mixed_dtype": (lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].bfloat16()), None,
                        ["mixes dtypes", "model.norm.weight", "--dtype"]),
    }
    edit_t, edit_c, needles = edits[case]
    bad = _edited_copy(src, tmp_path / "bad", edit_t, edit_c)
    out = tmp_path / "out"
    rc, err = _run_cli(["hf-to-dist", "--input", bad, "--output", str(out), "--no-progress"], capsys)
    assert rc == 2, err
    assert err.startswith("convert_ckpt.py hf-to-dist: ")
    for n in needles:
        assert n in err, (n, err)
    assert not out.exists() and not (tmp_path / ".out.tmp").exists()


def test_cli_refuses_unsupported_config_existing_output_and_incomplete_input(tmp_path, tiny_hf_models, capsys):
    src = tiny_hf_models("llama")
    bad = _edited_copy(src, tmp_path / "act", edit_config=lambda c: c.update(hidden_act="gelu"))
    rc, err = _run_cli(["hf-to-dist", "--input", bad, "--output", str(tmp_path / "o1")], capsys)
    assert rc == 2 and "hidden_act='gelu'" in err
    (tmp_path / "exists").mkdir()
    rc, err = _run_cli(["hf-to-dist", "--input", src, "--output", str(tmp_path / "exists")], capsys)
    assert rc == 2 and "exists; pass --overwrite" in err
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"x")
    rc, err = _run_cli(["dist-to-hf", "--input", str(tmp_path / "half"), "--output", str(tmp_path / "o2")], capsys)
    assert rc == 2 and "half has no COMPLETE.json: it is incomplete" in err
    rc, err = _run_cli(["dist-to-hf", "--input", str(_fake_dist(tmp_path / "noconf")),
                        "--output", str(tmp_path / "o3")], capsys)
    assert rc == 2 and "noconf/hf_config/config.json does not exist; pass --hf-config" in err
    rc, err = _run_cli(["dist-to-hf", "--input", str(tmp_path / "half"), "--output", str(tmp_path / "o4"),
                        "--max-shard-size", "lots"], capsys)
    assert rc == 2 and "--max-shard-size 'lots'" in err
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))


# ------------------------------------------------------------------------------------------ CLI round trip
def test_cli_round_trip_llama_bit_exact(tmp_path, tiny_hf_models, capsys):
    """The real tool, two processes: HF -> torch_dist -> HF (3 shards), --verify on both legs.
    Then same-size damage in either output is refused naming the file."""
    src = tiny_hf_models("llama")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    d, back = tmp_path / "dist", tmp_path / "back"
    for argv in (["hf-to-dist", "--input", src, "--output", str(d)],
                 ["dist-to-hf", "--input", str(d), "--output", str(back), "--max-shard-size", "150KB"]):
        p = subprocess.run([sys.executable, TOOL, *argv, "--verify", "--json", "--no-progress"], env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        summary = json.loads(p.stdout.strip().splitlines()[-1])
        assert summary["verified"] is True
    meta = json.load(open(d / model_dir.MARKER_NAME))
    assert meta["format"] == model_dir.FORMAT and meta["model"]["hidden_size"] == 64
    assert (d / "hf_config" / "config.json").read_bytes() == open(os.path.join(src, "config.json"), "rb").read()
    index = json.load(open(back / INDEX_FILE))
    assert len(set(index["weight_map"].values())) == summary["files"] >= 3
    assert (back / "config.json").read_bytes() == open(os.path.join(src, "config.json"), "rb").read()
    assert_same_tensors(src, back)

    # every file of both outputs has its CRC-32 in COMPLETE.json (the HF shards' computed while writing)
    from megatron_rl.infra.checkpoint_root import file_crc32
    hf_meta = json.load(open(back / model_dir.MARKER_NAME))
    assert hf_meta["format"] == model_dir.HF_FORMAT
    for out_dir, m in ((d, meta), (back, hf_meta)):
        listed = {e["path"]: e["crc32"] for e in m["files"]}
        assert set(listed) == {os.path.relpath(os.path.join(r, f), out_dir) for r, _, fs in os.walk(out_dir)
                               for f in fs if f != model_dir.MARKER_NAME}
        assert all(file_crc32(os.path.join(out_dir, p)) == c for p, c in listed.items())
    # same-size garbage inside a shard: refused by name (it used to convert and print "verified bit-exact")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".distcp"))[0]
    hf_shard = sorted(f for f in os.listdir(back) if f.endswith(".safetensors"))[-1]
    for path in (d / shard, back / hf_shard):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(size - 64)
            f.write(b"\x7f" * 16)  # e.g. +inf-ish bytes over some weights
        assert os.path.getsize(path) == size
    rc, err = _run_cli(["dist-to-hf", "--input", str(d), "--output", str(tmp_path / "again"), "--verify",
                        "--no-progress"], capsys)
    assert rc == 2 and f"{shard} has CRC-32" in err and "COMPLETE.json says" in err, err
    rc, err = _run_cli(["hf-to-dist", "--input", str(back), "--output", str(tmp_path / "again2"), "--verify",
                        "--no-progress"], capsys)
    assert rc == 2 and f"{hf_shard} has CRC-32" in err, err
    assert not (tmp_path / "again").exists() and not (tmp_path / "again2").exists()


def test_save_safetensors_reads_back_with_safetensors(tmp_path):
    """Our zero-copy serialiser writes files safetensors (and so transformers) reads exactly."""
    from safetensors import safe_open

    from megatron_rl.convert.safetensors_writer import save_safetensors

    g = torch.Generator().manual_seed(1)
    tensors = {"w.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16), "b.f32": torch.randn(7, generator=g),
               "h.f16": torch.randn(2, 2, 2, generator=g).half(), "scalar": torch.tensor(3.5),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False, True]),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "odd": torch.arange(3, dtype=torch.int8)}
    path = str(tmp_path / "x.safetensors")
    save_safetensors(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(CheckpointError, match="complex"):
        save_safetensors({"c": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "c.safetensors"))


# ------------------------------------------------------------------------------------------ data-loss guards
def _snapshot(root) -> dict:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def test_cli_refuses_outputs_that_would_replace_or_change_the_input(tmp_path, tiny_hf_models, capsys):
    """`--input P/hf --output P --overwrite` deleted the input and an unrelated file in P."""
    p = tmp_path / "P"
    shutil.copytree(tiny_hf_models("llama"), p / "hf")
    (p / "notes.txt").write_text("unrelated")
    os.symlink(p, tmp_path / "link")
    conv = _fake_dist(tmp_path / "root" / "iter_0000002")
    shutil.copytree(tiny_hf_models("llama"), tmp_path / "cfg")
    before = _snapshot(tmp_path)
    cases = [
        (["hf-to-dist", "--input", str(p / "hf"), "--output", str(p), "--overwrite"], "contains --input"),
        (["hf-to-dist", "--input", str(p / "hf"), "--output", str(p / "hf"), "--overwrite"], "is --input"),
        (["hf-to-dist", "--input", str(p / "hf"), "--output", str(p / "hf" / "dist")], "lies inside --input"),
        (["hf-to-dist", "--input", str(tmp_path / "link" / "hf"), "--output", str(p), "--overwrite"],
         "contains --input"),  # symlinks resolved
        (["hf-to-dist", "--input", str(p / "hf"), "--output", str(tmp_path / "link"), "--overwrite"],
         "contains --input"),
        (["dist-to-hf", "--input", str(tmp_path / "root"), "--output", str(tmp_path / "root" / "hf")],
         "lies inside --input"),
        (["dist-to-hf", "--input", str(conv), "--output", str(tmp_path / "root"), "--overwrite"], "contains --input"),
        (["dist-to-hf", "--input", str(conv), "--hf-config", str(tmp_path / "cfg"), "--output",
          str(tmp_path / "cfg"), "--overwrite"], "is --hf-config"),
    ]
    for argv, needle in cases:
        rc, err = _run_cli(argv + ["--no-progress"], capsys)
        assert rc == 2 and needle in err and "choose an --output outside" in err, (argv, err)
    assert _snapshot(tmp_path) == before
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_overwrite_replaces_only_a_previous_conversion_output(tmp_path, tiny_hf_models, capsys):
    src = tiny_hf_models("llama")
    other = tmp_path / "mydata"
    other.mkdir()
    (other / "results.csv").write_text("precious")
    (tmp_path / "afile").write_text("x")
    for direction, inp in (("hf-to-dist", src), ("dist-to-hf", str(_fake_dist(tmp_path / "conv")))):
        for out, needle in ((other, "is not a previous conversion output"), (tmp_path / "afile", "not a directory")):
            rc, err = _run_cli([direction, "--input", inp, "--output", str(out), "--overwrite", "--no-progress"],
                               capsys)
            assert rc == 2 and needle in err and "choose another --output" in err, (direction, err)
    assert (other / "results.csv").read_text() == "precious" and (tmp_path / "afile").read_text() == "x"
    # what --overwrite may replace: an empty dir, a previous output of the same direction
    (tmp_path / "empty").mkdir()
    common.check_output_dir(str(tmp_path / "empty"), {"--input": src}, True, "torch_dist")
    common.check_output_dir(str(_fake_dist(tmp_path / "prev")), {"--input": src}, True, "torch_dist")
    common.check_output_dir(src, {"--input": str(tmp_path / "conv")}, True, "hf")
    with pytest.raises(CheckpointError, match="not a previous conversion output"):  # a training checkpoint
        common.check_output_dir(str(_fake_dist(tmp_path / "it", fmt=model_dir.TRAINING_FORMAT)), {}, True, "torch_dist")
    with pytest.raises(CheckpointError, match="exists; pass --overwrite"):
        common.check_output_dir(str(tmp_path / "prev"), {}, False, "torch_dist")


# ------------------------------------------------------------------------------------------ damaged inputs, Ctrl-C
def _truncate(path, size=None):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


def test_truncated_safetensors_is_named_not_a_traceback(tmp_path, tiny_hf_models, capsys):
    """a truncated shard raised safetensors' SafetensorError from deep inside a load."""
    single = tmp_path / "single"
    shutil.copytree(tiny_hf_models("llama"), single)
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_hf_models("llama"), sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    os.unlink(sharded / "model.safetensors")
    w = ShardedSafetensorsWriter(str(sharded), max_shard_bytes=100_000)
    for n, t in tensors.items():
        w.add(n, t)
    shards = sorted(set(w.finish()["weight_map"].values()))
    for d, victim, cut in ((single, "model.safetensors", None), (single, "model.safetensors", 5),
                           (sharded, shards[-1], None)):
        shutil.copyfile(os.path.join(tiny_hf_models("llama"), "model.safetensors"), single / "model.safetensors")
        _truncate(d / victim, cut)
        with pytest.raises(CheckpointError, match=f"{d / victim} .* is not a readable safetensors file .* truncated"):
            HFCheckpoint(d)
    rc, err = _run_cli(["hf-to-dist", "--input", str(sharded), "--output", str(tmp_path / "o"), "--no-progress"],
                       capsys)
    assert rc == 2 and f"{sharded / shards[-1]}" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_torn_distcp_is_named_and_leaves_no_temp_dir(tmp_path, tiny_hf_models, capsys):
    """garbage inside a .distcp zip (a marker without checksums, so the load reaches it)
    raised torch's 'PytorchStreamReader failed reading zip archive' traceback from dist-to-hf."""
    d = tmp_path / "dist"
    rc, err = _run_cli(["hf-to-dist", "--input", tiny_hf_models("llama"), "--output", str(d), "--no-progress"],
                       capsys)
    assert rc == 0, err
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[::7] = bytes(b ^ 0x5A for b in data[::7])
    (d / "__0_0.distcp").write_bytes(data)
    meta = json.loads((d / model_dir.MARKER_NAME).read_text())
    for f in meta["files"]:
        f.pop("crc32", None)
    (d / model_dir.MARKER_NAME).write_text(json.dumps(meta))
    rc, err = _run_cli(["dist-to-hf", "--input", str(d), "--output", str(tmp_path / "hf"), "--no-progress"], capsys)
    assert rc == 2 and f"reading torch_dist checkpoint {d} failed" in err and "torn or corrupt" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / ".hf.tmp").exists()


def test_ctrl_c_during_conversion_leaves_nothing_and_exits_130(tmp_path, tiny_hf_models):
    """Ctrl-C mid-conversion printed a KeyboardInterrupt traceback and left the temp dir.

    The tool pauses once every tensor is in the temp dir, before --verify and the publish (pause point
    publish_written:out): the Ctrl-C lands mid-conversion however slow the machine (polling for the temp dir
    and then signalling sent it after the conversion had finished on a busy machine: exit 0)."""
    import signal

    from _util import PausePoint

    out, tmp = tmp_path / "out", tmp_path / ".out.tmp"
    point = PausePoint(tmp_path / "pause", "publish_written:out")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **point.env}
    p = subprocess.Popen([sys.executable, TOOL, "hf-to-dist", "--input", tiny_hf_models("llama"), "--output",
                          str(out), "--no-progress", "--verify", "--bucket-size", "50KB"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        point.wait(p, timeout=240, output=lambda: p.communicate()[1][-3000:])  # a hang bound only
        assert any(tmp.iterdir()) and not out.exists()  # mid-conversion: files written, nothing published
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)  # a hang bound only
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == (f"convert_ckpt.py hf-to-dist: interrupted; --output {out} was not written "
                                            "or changed (the partial temp dir was removed)")
    assert not out.exists() and not tmp.exists()


def test_truncated_index_json_is_named(tmp_path, tiny_hf_models):
    d = tmp_path / "m"
    shutil.copytree(tiny_hf_models("llama"), d)
    (d / INDEX_FILE).write_text('{"weight_map": {"a": "model.safe')
    with pytest.raises(CheckpointError, match=f"{d / INDEX_FILE} is not a JSON object .* truncated or corrupt"):
        HFCheckpoint(d)


def test_cli_keeps_mtp_layers_with_mtp_num_layers(tmp_path, tiny_hf_models, capsys):
    """A GLM-4.5-style checkpoint's MTP layer: hf-to-dist --mtp-num-layers 1 -> dist-to-hf gives the source back
    bit-exactly (MTP tensors included; --verify on both legs). Without the flag they are skipped and dist-to-hf
    says the output has no draft head; another count is refused naming both."""
    src = tiny_hf_models("glm4_moe", mtp=True)
    d, back = tmp_path / "dist", tmp_path / "back"
    rc, err = _run_cli(["hf-to-dist", "--input", src, "--output", str(d), "--mtp-num-layers", "1", "--verify",
                        "--no-progress"], capsys)
    assert rc == 0, err
    rc, err = _run_cli(["dist-to-hf", "--input", str(d), "--output", str(back), "--verify", "--no-progress"], capsys)
    assert rc == 0 and "note:" not in err, err
    assert_same_tensors(src, back)
    assert "model.layers.4.eh_proj.weight" in _tensors(back)
    d0, back0 = tmp_path / "dist0", tmp_path / "back0"
    assert _run_cli(["hf-to-dist", "--input", src, "--output", str(d0), "--no-progress"], capsys)[0] == 0
    rc, err = _run_cli(["dist-to-hf", "--input", str(d0), "--output", str(back0), "--no-progress"], capsys)
    assert rc == 0 and "num_nextn_predict_layers=1" in err and "holds no MTP layers" in err, err
    assert not any(n.startswith("model.layers.4.") for n in _tensors(back0))
    rc, err = _run_cli(["hf-to-dist", "--input", src, "--output", str(tmp_path / "two"), "--mtp-num-layers", "2",
                        "--no-progress"], capsys)
    assert rc == 2 and "--mtp-num-layers 2 but config.json's num_nextn_predict_layers is 1" in err, err
