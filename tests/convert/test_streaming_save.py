"""The streaming HF -> torch_dist writer: bucketing, lazy resolution, and its memory bound.

That its output equals ``dist_checkpointing.save`` of the loaded model is proven
in tests/convert/test_convert_roundtrip.py (TP1, every family, also with tiny
buckets) and tests/dist/test_convert_layouts.py (TP2 / PP2 / EP2).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_rl.convert.streaming_save import StorageIndex, split_into_buckets
from megatron_rl.errors import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensor_item(name: str, rows: int, dtype=torch.float32) -> WriteItem:
    size = torch.Size([rows, 4])
    return WriteItem(index=MetadataIndex(name, torch.Size([0, 0])), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size),
                                                 properties=TensorProperties(dtype=dtype), size=size))


def _bytes_item(name: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)


def test_buckets_keep_order_bound_size_and_isolate_big_items():
    items = [_tensor_item("a", 4), _bytes_item("x"), _tensor_item("b", 4), _tensor_item("big", 100),
             _tensor_item("c", 2, torch.bfloat16), _bytes_item("y"), _tensor_item("d", 4)]
    # 4 rows x 4 cols x 4 B = 64 B; big = 1600 B; c = 16 B
    buckets = split_into_buckets(items, 128)
    names = [[i.index.fqn for i in b] for b in buckets]
    assert names == [["x", "y", "a", "b"], ["big"], ["c", "d"]]
    assert [i.index.fqn for b in buckets for i in b if i.tensor_data is not None] == ["a", "b", "big", "c", "d"]
    # a bucket larger than everything: one file
    assert len(split_into_buckets(items, 10**9)) == 1
    # only byte items
    assert [[i.index.fqn for i in b] for b in split_into_buckets([_bytes_item("x")], 1)] == [["x"]]


def test_storage_index_resolves_views_and_reads_each_parameter_once():
    with torch.device("meta"):
        fc1 = torch.nn.Parameter(torch.empty(8, 3))
        other = torch.nn.Parameter(torch.empty(2, 3))
    reads = []

    def materialize(p):
        reads.append(tuple(p.shape))
        return torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)

    index = StorageIndex({fc1.untyped_storage()._cdata: ("fc1", fc1),
                          other.untyped_storage()._cdata: ("other", other)}, materialize)
    gate, up = torch.chunk(fc1.detach(), 2, dim=0)  # what megatron's swiglu factory saves
    full = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    assert torch.equal(index.resolve(gate), full[:4])
    assert torch.equal(index.resolve(up.view(1, 4, 3)), full[4:].view(1, 4, 3))  # prepended layer axis
    assert reads == [(8, 3)]  # the two halves cost one read
    assert torch.equal(index.resolve(other.detach()), torch.arange(6.0).reshape(2, 3))
    assert index.materialized == 2

    with torch.device("meta"):
        stray = torch.empty(3)
    with pytest.raises(CheckpointError, match="views no model parameter"):
        index.resolve(stray)

    bad = StorageIndex({fc1.untyped_storage()._cdata: ("fc1", fc1)}, lambda p: torch.zeros(7, 3))
    with pytest.raises(CheckpointError, match=r"fc1 was built as \(7, 3\)"):
        bad.resolve(gate)


def test_storage_index_writes_row_blocks_as_read():
    """A value given as row blocks (a gated linear_fc1: [gate; up]): a view that is exactly one block is that
    block (no fused tensor, no copy); any other view gets the concatenation."""
    with torch.device("meta"):
        fc1 = torch.nn.Parameter(torch.empty(8, 3))
    gate_v, up_v = torch.arange(12.0).reshape(4, 3), torch.arange(12.0, 24.0).reshape(4, 3)
    index = StorageIndex({fc1.untyped_storage()._cdata: ("fc1", fc1)}, lambda p: [gate_v, up_v])
    gate, up = torch.chunk(fc1.detach(), 2, dim=0)
    got_gate, got_up = index.resolve(gate), index.resolve(up.view(1, 4, 3))
    assert got_gate.data_ptr() == gate_v.data_ptr() and torch.equal(got_gate, gate_v)
    assert got_up.data_ptr() == up_v.data_ptr() and torch.equal(got_up, up_v.view(1, 4, 3))
    assert torch.equal(index.resolve(fc1.detach()[2:6]), torch.arange(6.0, 18.0).reshape(4, 3))  # straddles both
    assert index.materialized == 1
    bad = StorageIndex({fc1.untyped_storage()._cdata: ("fc1", fc1)}, lambda p: [gate_v, up_v[:3]])
    with pytest.raises(CheckpointError, match=r"fc1 was built as \[\(4, 3\), \(3, 3\)\]"):
        bad.resolve(gate)


def test_for_chunks_refuses_a_materialised_model():
    with pytest.raises(CheckpointError, match="meta device"):
        StorageIndex.for_chunks([torch.nn.Linear(2, 2)], lambda p: p)


def test_hf_to_dist_peak_memory_is_largest_tensor_plus_bucket(tmp_path):
    """The conversion never holds the model: its RSS high-water mark above the import floor
    stays under the largest tensor + one bucket + a fixed allowance, far below the model."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from convert import run_rss

    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    # ~201 MB fp32 model; largest tensors (embed_tokens / lm_head) 32.8 MB each
    hf = build_tiny_hf_model("llama", tmp_path / "hf", hidden_size=512, num_hidden_layers=12, vocab_size=16000,
                             intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2)
    model_bytes = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    largest, bucket = 16000 * 512 * 4, 8 * 10**6
    _, _, peak, _ = run_rss(["hf-to-dist", "--input", str(hf), "--output", str(tmp_path / "dist"), "--no-progress",
                             "--bucket-size", str(bucket)])
    allowance = 40 * 10**6  # model skeleton on meta, megatron's parallel state, DCP planning, allocator slack
    assert peak < largest + bucket + allowance, (peak, largest, bucket)
    assert peak < 0.45 * model_bytes, (peak, model_bytes)
