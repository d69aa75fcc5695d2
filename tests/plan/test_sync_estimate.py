"""The weight-sync and step-time estimate (plan/sync_estimate.py): the payload against real HF checkpoints' bytes,
each stage's seconds by hand, the links and their overrides, the flags, and the section in --dry-run and
tools/check_plan.py."""

import json
import math
import struct
from pathlib import Path

import pytest

from megatron_rl.errors import ConfigError, PlanError
from megatron_rl.plan.memory import MegatronLayout, ModelArch, TrainingFlags
from megatron_rl.plan.sync_estimate import (ACHIEVED_FRACTION, LINKS, Links, StepPlan, SyncPlan, active_matmul_params,
                                            estimate_step, estimate_sync, merged_payload)

LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
BF16 = TrainingFlags(params_dtype="bfloat16")
GIB = 2 ** 30


def _safetensors_bytes(model_dir: str) -> int:
    """The tensor bytes of a checkpoint's safetensors files, from their headers (8-byte length, JSON)."""
    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def test_the_merged_payload_is_the_checkpoints_bytes(tiny_hf_models, family):
    """What a sync sends is the HF model the engine loads: every family's tiny checkpoint (fp32, every architecture
    switch on: tied embeddings, q/k norms, MLA, sinks and expert biases, gated delta-net layers, expert-bias
    buffers) holds exactly the payload's bytes."""
    path = tiny_hf_models(family)
    arch = ModelArch.from_path(path)
    for pp in (1, 2):  # split over stages, the same bytes
        pay = merged_payload(arch, MegatronLayout(world=pp, pp=pp), TrainingFlags())
        assert pay.total == _safetensors_bytes(path)


def test_llama3_70b_distributed_by_hand():
    """TP 8 on one node, two TP-8 servers on other nodes, 1 GiB buckets, H100 and IB NDR."""
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    lay = MegatronLayout(world=8, tp=8)
    plan = SyncPlan("distributed", engines=2, engine_gpus=8, colocated=False, engines_remote=True, gpus_per_node=8,
                    bucket_bytes=GIB)
    est = estimate_sync(arch, lay, BF16, plan, Links.resolve("H100-80G"))
    b = 70_553_706_496 * 2  # bf16
    assert est.payload.total == b
    assert est.buckets == math.ceil(b / GIB) == 132
    nvlink, ib, hbm = 450e9 * ACHIEVED_FRACTION, 50e9 * ACHIEVED_FRACTION, 3350e9 * ACHIEVED_FRACTION
    seconds = {s.name: s.seconds for s in est.stages}
    assert seconds == pytest.approx({
        "TP 8 gather": b * 7 / 8 / nvlink,
        "NCCL broadcast into 2 engine(s) x TP 8": b / ib,
        "flatten + engine load copies": 4 * b / hbm,
        "134 calls (132 bucket(s) + begin/end)": 134 * 0.010})
    assert est.seconds == pytest.approx(sum(seconds.values()))


def test_pipeline_stages_broadcast_for_tensor_but_send_in_turn_for_distributed():
    arch = ModelArch.from_hf_config(QWEN3_30B_A3B)
    lay = MegatronLayout(world=32, tp=4, pp=2, ep=8, etp=1)
    links = Links.resolve("H100-80G")
    common = dict(engines=4, engine_gpus=8, gpus_per_node=8, bucket_bytes=GIB)
    tensor = estimate_sync(arch, lay, BF16, SyncPlan("tensor", colocated=True, engines_remote=False, **common), links)
    dist = estimate_sync(arch, lay, BF16, SyncPlan("distributed", colocated=False, engines_remote=True, **common), links)
    names = [s.name for s in tensor.stages]
    assert names[:3] == ["TP 4 gather", "EP 8 gather", "PP 2 broadcast"]
    assert "PP 2 broadcast" not in [s.name for s in dist.stages]
    pp = next(s for s in tensor.stages if s.name == "PP 2 broadcast")
    assert pp.seconds == pytest.approx(tensor.payload.total / (50e9 * ACHIEVED_FRACTION))  # 32 ranks: across nodes
    # the experts: 48 layers x 128 x 3 x 2048 x 768 bf16, gathered over EP 8 (one node) at 7/8
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert sum(tensor.payload.expert) == experts
    ep = next(s for s in tensor.stages if s.name == "EP 8 gather")
    assert ep.seconds == pytest.approx(experts * 7 / 8 / (450e9 * ACHIEVED_FRACTION))
    # buckets per stage and phase (dense / experts), whole tensors: at least one per part
    assert tensor.buckets == sum(math.ceil(x / GIB) for x in (*tensor.payload.dense, *tensor.payload.expert))


def test_disk_and_the_lora_adapter_payload():
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    lay = MegatronLayout(world=8, tp=8)
    lora = TrainingFlags(params_dtype="bfloat16", lora_rank=16, lora_targets=("q_proj", "v_proj"))
    plan = SyncPlan("disk", engines=1, engine_gpus=8, colocated=False, engines_remote=False, gpus_per_node=8,
                    bucket_bytes=GIB, payload="adapter")
    est = estimate_sync(arch, lay, lora, plan, Links.resolve("H100-80G", disk_link="nvme-gen5"))
    # per layer: q A [16, 8192] + B [8192, 16], v A [16, 8192] + B [1024, 16]
    assert est.payload.total == 80 * 16 * (8192 + 8192 + 8192 + 1024) * 2
    assert [s.name for s in est.stages] == ["disk write (driver)", "disk read (engines, in parallel)",
                                            "3 calls (1 bucket(s) + begin/end)"]
    write, read = est.stages[0].seconds, est.stages[1].seconds
    assert write == pytest.approx(est.payload.total / (10e9 * ACHIEVED_FRACTION))
    assert read == pytest.approx(est.payload.total / (14e9 * ACHIEVED_FRACTION))
    assert any("also carries the base model" in a for a in est.assumptions)
    with pytest.raises(PlanError, match="--lora-sync adapter needs --lora-rank"):
        estimate_sync(arch, lay, BF16, plan, Links.resolve())


def test_links_named_and_overridden():
    assert Links.resolve("A100-80G").intra == ("nvlink3", 300 * ACHIEVED_FRACTION)
    assert Links.resolve("B200-192G").intra == ("nvlink5", 900 * ACHIEVED_FRACTION)
    links = Links.resolve("H100-80G", intra_node_link="pcie5", inter_node_link="ib-hdr",
                          inter_node_gb_per_s=None, disk_gb_per_s=2.5)
    assert links.intra == ("pcie5", 64 * ACHIEVED_FRACTION) and links.inter == ("ib-hdr", 25 * ACHIEVED_FRACTION)
    assert links.disk_read == links.disk_write == ("--disk-bandwidth-gb-per-s 2.5", 2.5)  # measured: as given
    assert {LINKS[n].kind for n in ("nvlink4", "ib-ndr", "nvme-gen4")} == {"intra-node", "inter-node", "disk"}
    with pytest.raises(PlanError, match="--inter-node-link 'nvlink4' is not one of ib-hdr"):
        Links.resolve(inter_node_link="nvlink4")
    with pytest.raises(PlanError, match="--intra-node-bandwidth-gb-per-s -1 must be a positive number"):
        Links.resolve(intra_node_gb_per_s=-1)


def test_step_by_hand():
    """A two-layer dense model: N = 2 x (4 h^2 + 3 h ffn + 2 h) + the output layer + the final norm."""
    arch = ModelArch.from_hf_config({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
                                     "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 1000})
    n = 2 * (4 * 1024 ** 2 + 3 * 1024 * 4096 + 2 * 1024) + 1000 * 1024 + 1024
    assert active_matmul_params(arch, 0) == n
    attn = 2 * 2 * 8 * (128 + 128)  # layers x 2 x heads x (d_qk + d_v), per key
    links = Links.resolve("H100-80G")
    step = estimate_step(arch, 0, StepPlan(prompts=4, samples_per_prompt=2, prompt_len=100, response_len=300,
                                           train_gpus=8, engine_gpus=8), links, sync_s=1.0)
    assert step.tokens == 8 * 400
    assert step.train_flops == 3 * 3200 * (2 * n + attn * 200)
    prefill, decode = 4 * 100 * (2 * n + attn * 50), 8 * 300 * (2 * n + attn * 250)
    assert step.rollout_flops == prefill + decode
    peak = 989e12
    assert step.rollout_s == pytest.approx(prefill / (8 * peak * 0.3) + decode / (8 * peak * 0.1))
    assert step.train_s == pytest.approx(step.train_flops / (8 * peak * 0.3))
    assert step.sync_share == pytest.approx(1.0 / (step.rollout_s + step.train_s + 1.0))
    # MoE: the top-k of the routed experts count
    moe = ModelArch.from_hf_config(QWEN3_30B_A3B)
    assert active_matmul_params(moe, 8) == pytest.approx(3.04e9, rel=0.01)  # Qwen3-30B-A3B: "3B activated"
    with pytest.raises(PlanError, match="--estimate-train-mfu 0 must lie in"):
        estimate_step(arch, 0, StepPlan(1, 1, 1, 1, 1, 1), links, 0.0, train_mfu=0)


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "1+1?", "label": "2"}\n')
    return str(p)


def _model(tmp_path, cfg):
    d = tmp_path / cfg["model_type"]
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_dry_run_prints_the_sync_and_step_estimate(tmp_path, capsys):
    from megatron_rl.config import parse_config
    from megatron_rl.runner.dry_run import print_plan

    cfg = parse_config(["--hf-checkpoint", _model(tmp_path, QWEN3_30B_A3B), "--prompt-data", _prompts(tmp_path),
                        "--dry-run", "--bf16", "--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8",
                        "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                        "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
                        "--use-distributed-optimizer", "--rollout-backend", "sglang", "--rollout-engine-urls",
                        "http://10.0.0.5:30000", "http://10.0.0.6:30000", "--use-kl-loss",
                        "--update-weight-buffer-size", str(GIB), "--inter-node-link", "ib-xdr",
                        "--estimate-train-mfu", "0.4"])
    assert cfg.sync.update_weight_transport == "distributed"
    print_plan(cfg)
    out = capsys.readouterr().out
    assert "weight sync estimate (--update-weight-transport distributed): 61.06 GB per sync" in out
    assert "NCCL broadcast into 2 engine(s) x TP 8" in out and "ib-xdr at 80 GB/s" in out
    assert "step estimate: rollout" in out and "of it" in out
    assert "(forward + backward 3, the reference's log-probs 1)" in out and "MFU 0.4" in out
    assert "one node's 8 GPUs each" in out


@pytest.mark.parametrize("flag, value", [("--estimate-train-mfu", "0"), ("--estimate-decode-mfu", "1.5"),
                                         ("--intra-node-bandwidth-gb-per-s", "-3"), ("--sync-bucket-latency-ms", "nan")])
def test_the_estimate_flags_are_refused_out_of_range(tmp_path, flag, value):
    from megatron_rl.config import parse_config

    with pytest.raises(ConfigError, match=f"{flag} .* it must lie in"):
        parse_config(["--hf-checkpoint", _model(tmp_path, LLAMA3_70B), "--prompt-data", _prompts(tmp_path),
                      "--dry-run", flag, value])


def test_check_plan_prints_the_estimate(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import check_plan

    model = _model(tmp_path, QWEN3_30B_A3B)
    args = ["sglang:d4t2|megatron:d4t2", "--hf-checkpoint", model, "--bf16", "--use-distributed-optimizer",
            "--rollout-max-response-len", "8192", "--n-samples-per-prompt", "16"]
    assert check_plan.main(args) == 0
    out = capsys.readouterr().out
    assert "weight sync estimate (--update-weight-transport tensor)" in out
    assert "CUDA IPC buckets (flatten + engine load)" in out and "32 prompts x 16 samples" in out
    assert check_plan.main(args + ["--json"]) == 0
    [sync] = json.loads(capsys.readouterr().out)["sync"]
    assert sync["bytes"] == 61_064_245_248 and sync["step"]["tokens"] == 32 * 16 * (1024 + 8192)
    assert check_plan.main(args + ["--estimate-decode-mfu", "0"]) == 2
    assert "--estimate-decode-mfu 0 is out of range" in capsys.readouterr().err


def test_the_docs_table_is_fresh():
    """docs/planner.md's table is tools/planner_table.py's output (rerun it with --update-doc after a change)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import planner_table

    doc = Path(planner_table.DOC).read_text()
    between = doc.split(planner_table.BEGIN)[1].split(planner_table.END)[0].strip()
    assert between == planner_table.table(), "run: python tools/planner_table.py --update-doc"
