"""The converters' byte paths: the splicing file writer, mapped HF reads, mapped torch_dist chunk reads.

Each must give exactly what the plain path gives (the bytes of ``write()``, ``HFCheckpoint.read``,
torch's ``FileSystemReader``); the whole conversions are proven bit-exact in
tests/convert/test_convert_roundtrip.py and tests/convert/test_convert.py.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.convert import distcp_reader, file_writer
from megatron_rl.convert.file_writer import FileWriter
from megatron_rl.convert.mapped_checkpoint import MappedHFCheckpoint
from megatron_rl.models.hf_checkpoint import HFCheckpoint, NonFiniteWeights


def _pieces() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 256, (3 * file_writer.PIPE_BYTES + 12345,), dtype=torch.uint8, generator=g)
    return [b"header", bytes(range(200)) * 400, big.numpy().tobytes(), b"", b"tail" * 10]


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "write"])
def test_file_writer_writes_every_byte_and_its_crc(tmp_path, monkeypatch, splice):
    if not splice:  # a filesystem without splice_write: the writer drains the pipe and goes on with write()
        def refuse(*args, **kwargs):
            raise OSError(22, "Invalid argument")
        monkeypatch.setattr(os, "splice", refuse)
    path = tmp_path / "out.bin"
    pieces = _pieces()
    with FileWriter(str(path)) as f:
        for p in pieces:
            assert f.write(p) == len(p)
        assert f.tell() == sum(map(len, pieces))
        os.fsync(f.fileno())
    data = path.read_bytes()
    assert data == b"".join(pieces)
    assert f.hexdigest == f"{zlib.crc32(data):08x}"


def _hf_dir(tmp_path) -> str:
    g = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(7, 5, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
               "c": torch.randn(4, 6, generator=g).half(), "s": torch.tensor(2.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("args", [("a",), ("a", 0, 2, 5), ("a", 0, 0, 0), ("a", 1, 1, 4), ("b",), ("c", 0, 1, None)])
def test_mapped_reads_equal_copied_reads(tmp_path, args):
    d = _hf_dir(tmp_path)
    plain, mapped = HFCheckpoint(d), MappedHFCheckpoint(d)
    a, b = plain.read(*args), mapped.read(*args)
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    b.add_(1)  # copy-on-write: the file is never changed through a view
    assert torch.equal(MappedHFCheckpoint(d).read(*args), a)


def test_mapped_reads_refuse_non_finite_values(tmp_path):
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(NonFiniteWeights, match="'w'"):
        MappedHFCheckpoint(str(tmp_path)).read("w")


def test_mapped_distcp_reads_equal_torch_reads(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    mapped = []  # tensors read from mapped pages (not torch's fallback read)
    real = distcp_reader._mapped_tensor
    monkeypatch.setattr(distcp_reader, "_mapped_tensor", lambda *a: mapped.append(real(*a)) or mapped[-1])

    g = torch.Generator().manual_seed(2)
    saved = {"w": torch.randn(6, 4, generator=g), "h": torch.randn(5, generator=g).to(torch.bfloat16),
             "blob": {"x": 1}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    reader_cls = distcp_reader._reader_class()
    cache: dict = {}
    for _ in range(2):  # the second load reuses the parsed .metadata
        state = {"w": torch.empty(6, 4), "h": torch.empty(5, dtype=torch.bfloat16), "blob": {"x": 0}}
        dcp.load(state, storage_reader=reader_cls(str(tmp_path), cache), no_dist=True)
        assert torch.equal(state["w"], saved["w"]) and torch.equal(state["h"], saved["h"])
        assert state["blob"] == {"x": 1}
    assert "metadata" in cache
    assert len(mapped) == 4


def test_shard_writer_writes_big_views_as_they_are_and_copies_small_ones(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.convert.safetensors_writer import ShardedSafetensorsWriter, _own_storage

    fc1 = torch.arange(24.0).reshape(8, 3)
    gate, up = torch.chunk(fc1, 2, dim=0)  # what the export yields for a gated linear_fc1
    row = torch.arange(300.0).reshape(100, 3)[7]  # a small view of a big buffer
    assert _own_storage(gate).data_ptr() == gate.data_ptr()  # written from the view: no copy
    assert _own_storage(row).untyped_storage().nbytes() == row.nbytes  # copied: keeps no big buffer alive
    w = ShardedSafetensorsWriter(str(tmp_path), 10**6)
    for name, t in (("gate", gate), ("up", up), ("row", row), ("t", fc1.t())):
        w.add(name, t)
    w.finish()
    back = load_file(str(tmp_path / "model-00001-of-00001.safetensors"))
    for name, t in (("gate", gate), ("up", up), ("row", row), ("t", fc1.t())):
        assert torch.equal(back[name], t), name


def test_crc32_and_its_combination_equal_zlib():
    from megatron_rl.infra.crc32 import crc32, crc32_combine

    g = torch.Generator().manual_seed(3)
    for la, lb in ((0, 0), (5, 0), (0, 7), (1000, 3), (12345, 1 << 20)):
        a = torch.randint(0, 256, (la,), dtype=torch.uint8, generator=g).numpy().tobytes()
        b = torch.randint(0, 256, (lb,), dtype=torch.uint8, generator=g).numpy().tobytes()
        assert crc32(a + b) == zlib.crc32(a + b) and crc32(b, crc32(a)) == zlib.crc32(a + b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)


def test_torch_archives_get_torchs_record_crcs_and_mapped_bytes_are_copied(tmp_path):
    """torch.save inside ``torch_archive`` (torch's record CRC off): the writer fills in each record's CRC-32,
    so every archive is what torch writes with its CRC on (zipfile checks them); a tensor over a mapped file
    range is copied from the file (copy_file_range), and the file's CRC-32 still covers every byte."""
    import io
    import zipfile

    from megatron_rl.convert import file_views

    g = torch.Generator().manual_seed(4)
    src = tmp_path / "src.bin"
    src.write_bytes(torch.randn(40000, generator=g).numpy().tobytes())
    mapped = file_views.map_tensor(str(src), 4 * 1000, 30000, torch.float32)  # unaligned: a tensor's range
    objects = [torch.randn(50000, generator=g), torch.arange(10), torch.empty(0), {"a": 1, "b": torch.zeros(2)},
               torch.randn(300, generator=g).bfloat16(), mapped]
    path = tmp_path / "out.distcp"
    offsets = []
    with FileWriter(str(path)) as f:
        for obj in objects:
            offsets.append(f.tell())
            with f.torch_archive():
                torch.save(obj, f)
        offsets.append(f.tell())
    assert torch.serialization.get_crc32_options()  # restored
    data = path.read_bytes()
    assert f.hexdigest == f"{zlib.crc32(data):08x}"
    assert f.copied_bytes == mapped.nbytes
    for obj, start, end in zip(objects, offsets, offsets[1:]):
        ours = zipfile.ZipFile(io.BytesIO(data[start:end]))
        assert ours.testzip() is None  # every record's data matches its CRC-32
        ref = io.BytesIO()
        torch.save(obj, ref)
        theirs = zipfile.ZipFile(io.BytesIO(ref.getvalue()))
        def records(z):
            return [(i.filename, i.CRC, i.file_size) for i in z.infolist() if "serialization_id" not in i.filename]
        assert records(ours) == records(theirs) and end - start == len(ref.getvalue())
        back = torch.load(io.BytesIO(data[start:end]), weights_only=True)
        if isinstance(obj, torch.Tensor):
            assert torch.equal(back, obj)


def test_shard_writer_copies_mapped_tensors_from_their_file(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.convert import file_views
    from megatron_rl.convert.safetensors_writer import ShardedSafetensorsWriter
    from megatron_rl.infra.checkpoint_root import file_crc32

    g = torch.Generator().manual_seed(5)
    src = tmp_path / "chunks.bin"
    src.write_bytes(torch.randn(5000, generator=g).numpy().tobytes())
    whole = file_views.map_tensor(str(src), 40, 3000, torch.float32).view(300, 10)
    tensors = {"embed": whole[:200], "norm": torch.ones(10), "head": whole[200:]}
    out = tmp_path / "out"
    w = ShardedSafetensorsWriter(str(out), 10**6)
    for name, t in tensors.items():
        w.add(name, t)
    assert not any(isinstance(v, torch.Tensor) for k, v in w._pending.items() if k != "norm")  # held as file ranges
    w.finish()
    shard = out / "model-00001-of-00001.safetensors"
    back = load_file(str(shard))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    assert w.checksums[shard.name] == file_crc32(str(shard))


def test_shard_writer_copies_split_rows_of_mapped_tensors_from_their_file(tmp_path):
    """q/k/v split from a fused, mapped QKV are handed on as the row blocks they are (``FileRows``: no copy of
    the rows); the writer holds them as those file ranges and writes the same bytes as the split tensors (and
    the shard's CRC-32 still covers them); ``build()`` gives the split tensor itself."""
    from safetensors.torch import load_file

    from megatron_rl.convert import file_views
    from megatron_rl.convert.safetensors_writer import ShardedSafetensorsWriter
    from megatron_rl.convert.streaming_load import _file_rows, _row_pieces
    from megatron_rl.infra.checkpoint_root import file_crc32
    from megatron_rl.models import weight_maps

    g = torch.Generator().manual_seed(6)
    src = tmp_path / "qkv.bin"
    src.write_bytes(torch.randn(4000, generator=g).numpy().tobytes())
    qkv = file_views.map_tensor(str(src), 64, 24 * 8, torch.float32).view(24, 8)  # 2 groups x (2 q + k + v) x 3
    blocks = [(0, 24, file_views.tensor_file_range(qkv))]
    rows = weight_maps.split_qkv(torch.arange(24), 2, 2, 3)
    tensors = dict(zip("qkv", weight_maps.split_qkv(qkv, 2, 2, 3)))
    out = tmp_path / "out"
    w = ShardedSafetensorsWriter(str(out), 10**6)
    for (name, t), r in zip(tensors.items(), rows):
        pieces = _row_pieces(r.tolist(), blocks, 8 * 4)
        assert pieces is not None and len(pieces) == 2  # one row block per group
        lazy = _file_rows(qkv, r, pieces)
        assert lazy.shape == t.shape and lazy.dtype == t.dtype and torch.equal(lazy.build(), t)
        assert file_views.tensor_file_ranges(lazy) == [p[2] for p in pieces]
        w.add(name, lazy)
    assert not any(isinstance(v, torch.Tensor) for v in w._pending.values())  # held as file ranges
    assert _row_pieces([0, 1, 30], blocks, 32) is None  # a row no block holds: built instead
    w.finish()
    shard = out / "model-00001-of-00001.safetensors"
    back = load_file(str(shard))
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    assert w.checksums[shard.name] == file_crc32(str(shard))


def test_input_digest_hashes_files_as_the_plain_check_does_and_knows_each_model_chunk(tmp_path, monkeypatch):
    """dist-to-hf's input check (``InputDigest.file_crcs``) gives every file the CRC-32 ``crc32_of_files`` gives,
    damaged ones too, and learns on the way each model chunk's data CRC-32 and whether it is finite: small
    windows and blocks here, so a chunk spans several of each and the inf/NaN is in a later block."""
    import mmap

    import torch.distributed.checkpoint as dcp

    from megatron_rl.convert import file_views, input_digest
    from megatron_rl.infra.checkpoint_root import crc32_of_files
    from megatron_rl.models.dist_io import MODEL_KEY_ROOTS

    monkeypatch.setattr(input_digest, "WINDOW", 2 * mmap.ALLOCATIONGRANULARITY)
    monkeypatch.setattr(input_digest, "BLOCK", 1024)
    g = torch.Generator().manual_seed(7)
    bad = torch.randn(40, 128, generator=g)
    bad[37, 5] = float("inf")
    saved = {"decoder.w": torch.randn(64, 96, generator=g), "decoder.h": torch.randn(300, generator=g).bfloat16(),
             "embedding.bad": bad, "optimizer.m": torch.randn(50, generator=g), "blob": {"x": 1}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    paths = sorted(str(p) for p in tmp_path.iterdir() if p.is_file())
    digest = input_digest.InputDigest(str(tmp_path), MODEL_KEY_ROOTS)
    assert digest.file_crcs(paths) == crc32_of_files(paths)

    files = distcp_reader.ChunkFiles(str(tmp_path), {})
    read = {k: files.read(k, (0,) * v.dim(), tuple(v.shape), v.dtype) for k, v in saved.items()
            if isinstance(v, torch.Tensor)}
    for key in ("decoder.w", "decoder.h", "embedding.bad"):
        t = read[key]
        assert torch.equal(t, saved[key])
        assert digest.crc(file_views.tensor_file_range(t)) == zlib.crc32(t.view(torch.uint8).numpy().tobytes())
    assert digest.finite(read["decoder.w"]) and digest.finite(read["decoder.h"]) and digest.finite(read["decoder.w"][3:9])
    assert not digest.finite(read["embedding.bad"]) and not digest.finite(read["embedding.bad"][:2])  # checked then
    assert digest.crc(file_views.tensor_file_range(read["decoder.w"][3:9])) is None  # rows: hashed by the writer
    assert digest.crc(file_views.tensor_file_range(read["optimizer.m"])) is None  # not a model chunk: not digested
    assert not digest.finite(read["optimizer.m"]) and not digest.finite(torch.ones(3))
    assert not digest.finite(read["decoder.w"].view(torch.int32))  # values read as another dtype: unknown

    shard = next(p for p in paths if p.endswith(".distcp"))
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 2] ^= 0xFF  # damage: the digest's CRC-32 of the file is still the file's
    with open(shard, "wb") as f:
        f.write(raw)
    assert input_digest.InputDigest(str(tmp_path), MODEL_KEY_ROOTS).file_crcs(paths) == crc32_of_files(paths)
