"""HF -> torch_dist -> HF for every family in one process: bit-exact, loadable, same logits.

One job (tests/dist/scripts/convert_worker.py --mode roundtrip, a world of one) does
all conversions (with --verify on every leg) so megatron and the torch_dist
writer start once; it runs in the 1-rank launch of its launch group
(tests/_launches.py), which pays the interpreter's start and megatron-core's import
for the group's other 1-rank jobs too. This test then checks the outputs
independently of the converter's own verification.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.models.hf_tiny import FAMILIES

from test_convert import _tensors, assert_same_tensors

pytestmark = pytest.mark.dist

def shared_launch(ctx):
    """Job ``convert --mode roundtrip`` of tests/dist/harness.py in its group's 1-rank launch; the results."""
    out = ctx.tmp_path_factory.mktemp("convert_rt")
    families = ["llama"] + [f for f in FAMILIES if f != "llama"]  # llama first: also the bf16 case
    yield {1: [("convert", ["--mode", "roundtrip", "--out", out, "--family", *families])]}
    return json.load(open(out / "results.json"))


@pytest.fixture(scope="module")
def roundtrip(shared_launch_state):
    return shared_launch_state


def _logits(hf_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([[1, 5, 17, 42, 99, 200, 3, 7]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fam", FAMILIES)
def test_round_trip_bit_exact_and_same_logits(roundtrip, fam):
    r = roundtrip[fam]
    assert r["shards"] >= 2  # --max-shard-size 200KB really sharded the output
    assert_same_tensors(r["hf"], r["back"])  # same names, dtypes, bytes
    with open(os.path.join(r["hf"], "config.json"), "rb") as a, open(os.path.join(r["back"], "config.json"), "rb") as b:
        assert a.read() == b.read()
    assert torch.equal(_logits(r["hf"]), _logits(r["back"]))


@pytest.mark.parametrize("fam", FAMILIES)
def test_streaming_writer_equals_megatron_save(roundtrip, fam):
    """HF -> torch_dist never holds the model, yet writes what dist_checkpointing.save of the
    loaded model writes: same .metadata, common.pt, metadata.json and bytes."""
    assert roundtrip[fam]["vs_megatron_save"] == []


def test_tied_embeddings_round_trip(roundtrip):
    r = roundtrip["tied"]
    assert r["vs_megatron_save"] == []
    assert_same_tensors(r["hf"], r["back"])
    assert "lm_head.weight" not in _tensors(r["back"])


def test_streaming_writer_small_buckets_still_equal_megatron_save(roundtrip):
    r = roundtrip["small_buckets"]
    assert r["files"] >= 5  # --bucket-size 20KB split the rank's data into many files
    assert r["vs_megatron_save"] == []


def test_dtype_conversion_is_the_cast(roundtrip):
    r = roundtrip["bf16"]
    assert_same_tensors(r["hf"], r["back"], cast=torch.bfloat16)
    assert json.load(open(os.path.join(r["back"], "config.json")))["dtype"] == "bfloat16"
    # bf16 -> fp32 on export is exact: every value is the bf16 value widened
    src = _tensors(r["hf"])
    back32 = _tensors(r["back_fp32"])
    for n, t in src.items():
        assert back32[n].dtype == torch.float32 and torch.equal(back32[n], t.bfloat16().float()), n


def test_dist_to_hf_refusals_name_what_differs(roundtrip):
    ref = roundtrip["refusals"]
    assert "hidden_size: checkpoint 64 vs config 32" in ref["fingerprint"]
    assert "self_attention.q_layernorm.weight" in ref["keys"] and "map to no parameter" in ref["keys"]
    assert "--overwrite" in ref["exists"]
