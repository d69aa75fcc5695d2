"""``--update-weight-verify checksum`` with SGLang engines (``weight_sync.sglang_verify``).

SGLang's ``/weights_checker`` ``checksum`` action reports, per TP rank, a checksum of every tensor it holds, over
its own fused tensors; the trainer builds the same tensors from its export (``plan.sglang_weights``) and hashes them
as SGLang does (``rollout.sglang.checksums``). Held here to what real SGLang 0.5.23 answered
(``fixtures/sglang_0.5.23_weights_checksum.json``, recorded from a real server on CPU), to SGLang's GPU hash kernel
(known answers from its Triton kernel run under Triton's interpreter), to the stand-in's layout at TP 1-4 (the
stand-in's is written apart), and end to end: every transport into the stand-in passes, and a tensor perturbed
inside the engine during the apply is named with its engine rank, bucket and version, the engine then refusing
to generate. Against real SGLang: ``scripts/test_sglang_real.sh --steps verify_checksums``.
"""

import json
import os
import sys

import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.plan.engines import EnginePlacement, EngineSlot
from megatron_rl.plan.sglang_weights import SGLangWeightLayout, layout_problem, read_hf_config
from megatron_rl.rollout import GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.checksums import (SGLangChecksums, ServerLayout, engine_dtype, sglang_cpu_hash,
                                                  sglang_cuda_hash)
from megatron_rl.rollout.weight_delta import WeightChecksumMismatch
from megatron_rl.weight_sync import make_synchronizer
from megatron_rl.weight_sync.disk import DiskSynchronizer
from megatron_rl.weight_sync.distributed import DistributedSynchronizer
from megatron_rl.weight_sync.sglang_verify import SGLangVerifier

from test_weight_sync import FakeBackend, checkpoint_tensors  # tests/weight_sync is on sys.path (rootdir)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn, formula_weights, sglang_held_tensors  # noqa: E402 - on sys.path above

FIXTURE = os.path.join(REPO, "tests", "rollout", "fixtures", "sglang_0.5.23_weights_checksum.json")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
BUCKET = 64 * 1024


@pytest.fixture(scope="module")
def real_shape(tiny_hf_models):
    """The model the real reply was recorded on: tiny Qwen2, 2 layers, vocab 32, its formula weights."""
    hf = tiny_hf_models("qwen2", vocab_size=32, num_hidden_layers=2)
    return hf, formula_weights({n: tuple(t.shape) for n, t in checkpoint_tensors(hf).items()})


def test_the_trainer_computes_what_real_sglang_reported(real_shape):
    hf, weights = real_shape
    reply = json.load(open(FIXTURE))["reply"]
    server = ServerLayout(SGLangWeightLayout.from_hf_config(read_hf_config(hf), 1), torch.float32, "cpu")
    checksums = SGLangChecksums([server])
    for name, t in weights.items():
        checksums.add(name, t, 1)
    assert checksums.compare(server, "real", reply, 3) == 17  # fused: 17 engine tensors from 27 HF ones
    reply["ranks"][0]["checksums"]["model.layers.1.mlp.gate_up_proj.weight"] = "0" * 16
    with pytest.raises(WeightChecksumMismatch, match=r"version 3 .*engine rank 0: 1 tensor\(s\) differs: "
                                                     r"model\.layers\.1\.mlp\.gate_up_proj\.weight \(bucket 1\)"):
        checksums.compare(server, "real", reply, 3)


def test_the_double_answers_as_real_sglang_did(real_shape, tmp_path):
    hf, weights = real_shape
    recorded = json.load(open(FIXTURE))["reply"]
    with SGLangStandIn(hf) as server:
        engine = SGLangEngine([server.url], weight_dir=str(tmp_path / "w"), hf_checkpoint=hf, timeout_s=30,
                              connect_retries=0, health_interval_s=0)
        try:
            engine.update_weights(weights.items(), 1)
            assert engine.clients[0].weight_checksums() == recorded  # every key and value, per_*_checksum too
        finally:
            engine.close()


def test_the_cuda_hash_is_sglangs_triton_kernel():
    # gpu_tensor_hash (SGLang 0.5.23, sglang/kernels/ops/memory) run under TRITON_INTERPRET=1 on these inputs
    assert sglang_cuda_hash(torch.arange(20000, dtype=torch.float32)) == "2c83f6b96fb4c653"  # 3 tiles, partial last
    assert sglang_cuda_hash((torch.arange(7) * 0.5).to(torch.bfloat16)) == "681211a208e22fec"  # 14 bytes: padded
    assert sglang_cuda_hash(torch.arange(3, dtype=torch.int8)) == "0a97cf45c78490e5"
    assert sglang_cpu_hash(torch.empty(0)) == "e3b0c44298fc1c14"  # sha256 of nothing


@pytest.mark.parametrize("tp,family,overrides", [(2, "qwen2", {}), (4, "qwen2", {}), (2, "qwen3", {}),
                                                 (4, "llama", {"tie_word_embeddings": True})])
def test_tp_slices_match_the_doubles_layout(tiny_hf_models, tp, family, overrides):
    """At TP > 1 (SGLang's CPU route runs TP 1 only): each rank's tensors equal the stand-in's independent cut,
    including kv heads replicated over ranks (2 kv heads, TP 4) and the vocab padding (250 -> 256 rows)."""
    from transformers import AutoConfig

    hf = tiny_hf_models(family, **overrides)
    tensors = checkpoint_tensors(hf)
    server = ServerLayout(SGLangWeightLayout.from_hf_config(read_hf_config(hf), tp), torch.bfloat16, "cpu")
    checksums = SGLangChecksums([server])
    for name, t in tensors.items():
        checksums.add(name, t, 1)
    config = AutoConfig.from_pretrained(hf)
    ranks = []
    for rank in range(tp):
        held = sglang_held_tensors({n: t.to(torch.bfloat16) for n, t in tensors.items()}, config, tp, rank)
        ranks.append({"checksums": {n: sglang_cpu_hash(t) for n, t in held.items()},
                      "parallelism_info": [{"tp_rank": rank}]})
    assert checksums.compare(server, "double", {"ranks": ranks}, 1) == sum(len(r["checksums"]) for r in ranks)


def test_sglang_dtype_auto_and_unknown_families():
    assert engine_dtype("auto", {"dtype": "float32", "model_type": "qwen2"}) == torch.float16  # SGLang's rule
    assert engine_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert engine_dtype("float32", {"dtype": "bfloat16"}) == torch.float32
    assert layout_problem({"model_type": "qwen3_moe"}).startswith("config.json's model_type 'qwen3_moe' is not")


# ------------------------------------------------------------------------------------- through the transports
@pytest.fixture(scope="module")
def served(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    g = torch.Generator().manual_seed(3)
    new = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in checkpoint_tensors(hf).items()}
    with SGLangStandIn(hf, group_timeout_s=30) as server:
        yield hf, server, new


def _engine(hf, server, tmp_path):
    return SGLangEngine([server.url], weight_dir=str(tmp_path / "w"), hf_checkpoint=hf, timeout_s=30,
                        update_timeout_s=30, connect_retries=0, health_interval_s=0)


def _synchronizers(hf, url, tmp_path):
    verifier = SGLangVerifier(read_hf_config(hf))
    disk = DiskSynchronizer(BUCKET, disk_dir=str(tmp_path / "disk"), hf_checkpoint=hf)
    distributed = DistributedSynchronizer(BUCKET, timeout_s=30)
    placement = EnginePlacement((EngineSlot(0, url, 0, (), (0,), "/tmp/engine0.log"),), colocated=True)
    tensor = make_synchronizer("tensor", rollout_backend="sglang", bucket_bytes=BUCKET, engines=placement,
                               timeout_s=30, connect_retries=0)
    for sync in (disk, distributed, tensor):
        sync.sglang_verifier = verifier
    return {"disk": disk, "distributed": distributed, "tensor": tensor}


def test_every_transport_is_verified_and_a_corrupted_apply_is_named(served, tmp_path):
    hf, server, new = served
    engine = _engine(hf, server, tmp_path)
    syncs = _synchronizers(hf, server.url, tmp_path)
    try:
        version = engine.weight_version
        for name, sync in syncs.items():
            version += 1
            metrics = sync.sync(FakeBackend(new), engine, version)
            assert metrics["sync/verified_tensors"] == 31.0, name  # 4 layers x 7 + embed, norm, lm_head
            assert metrics["sync/verify_time_s"] > 0 and metrics["sync/verify_hash_s"] > 0
        server.faults.corrupt_after_update = "model.layers.2.self_attn.k_proj.weight"  # inside the engine
        for name, sync in syncs.items():
            version += 1
            with pytest.raises(Exception) as err:
                sync.sync(FakeBackend(new), engine, version)
            text = str(err.value)
            assert (f"after the weight sync to version {version} SGLang server {server.url} holds other bytes" in text
                    and "engine rank 0: 1 tensor(s) differs: model.layers.2.self_attn.qkv_proj.weight (bucket "
                    in text), (name, text)
            if name != "tensor":  # the tensor transport agrees every rank's error into one SyncError
                assert isinstance(err.value, WeightChecksumMismatch), name
            with pytest.raises(EngineError, match="--update-weight-verify found the update to version"):
                engine.generate([GenerateRequest([5, 17, 3], 0)], GREEDY)
    finally:
        server.faults.corrupt_after_update = None
        for sync in syncs.values():
            sync.shutdown()
        engine.close()


# ------------------------------------------------------------------------------------------------ validation
def _cfg(tmp_path, hf, *extra):
    return parse_config(["--hf-checkpoint", hf, "--rollout-backend", "sglang", "--rollout-engine-urls",  # validates
                         "http://127.0.0.1:1", "--update-weight-verify", "checksum", *extra])


def test_validation_lifts_the_refusal_only_where_it_works(tiny_hf_models, tmp_path):
    qwen2 = tiny_hf_models("qwen2")
    d = str(tmp_path / "w")
    for transport in (["disk", "--update-weight-disk-dir", d], ["distributed"]):
        cfg = _cfg(tmp_path, qwen2, "--update-weight-transport", *transport)
        assert cfg.weight_update_verify == "checksum" and SGLangVerifier.from_config(cfg) is not None
    with pytest.raises(ConfigError, match="model_type 'qwen3_moe' is not one whose SGLang layout"):
        _cfg(tmp_path, tiny_hf_models("qwen3_moe"), "--update-weight-transport", "disk", "--update-weight-disk-dir", d)
    cfg = _cfg(tmp_path, qwen2, "--update-weight-transport", "disk", "--update-weight-disk-dir", d,
               "--update-weight-mode", "delta")  # servers on this host: the host checkpoint (test_sglang_delta.py)
    assert cfg.weight_update_verify == "checksum" and SGLangVerifier.from_config(cfg) is not None
    with pytest.raises(ConfigError, match="--update-weight-mode delta with SGLang goes through --update-weight-"):
        _cfg(tmp_path, qwen2, "--update-weight-transport", "distributed", "--update-weight-mode", "delta")
    with pytest.raises(ConfigError, match="each pipeline stage sends its own tensors"):
        _cfg(tmp_path, qwen2, "--update-weight-transport", "distributed", "--pipeline-model-parallel-size", "2")
