"""The static-memory estimator (plan/memory.py) on published configs, figures computed by hand here; its tables in
``--dry-run`` and ``tools/check_plan.py``. The bytes a real backend holds are compared in
tests/dist/test_static_memory.py."""

import json

import pytest

from megatron_rl.errors import PlanError
from megatron_rl.plan.memory import (GIB, GPU_MEMORY_GIB, MegatronLayout, ModelArch, RoleModelSpec, TrainingFlags,
                                     estimate_megatron, format_memory, gpu_memory_gib, stage_tensors)

# Llama-3-70B's config.json (the fields that size it)
LLAMA3_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
# Qwen3-235B-A22B's
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                  num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=40960)
BF16_DO = TrainingFlags(params_dtype="bfloat16", distributed_optimizer=True)


def _rows(stage):
    return {r.kind: r for r in stage.rows}


def test_llama3_70b_tp8_pp4_dp2_by_hand():
    """Per layer: qkv (64 + 2 x 8) x 128 x 8192 = 83,886,080, o_proj 67,108,864, gate+up 2 x 28672 x 8192 =
    469,762,048, down 234,881,024 (855,638,016 split over TP 8: 106,954,752) + two norms of 8192 = 106,971,136 per
    rank; 20 layers per stage. The vocab 128256 pads to 129024 (a multiple of 128 x 8), 129024 x 8192 / 8 =
    132,120,576 per TP rank: the embedding on stage 0, the output layer and final norm (8192) on stage 3.
    Every size is a multiple of 64 and of lcm(DP 2, 128): no buffer padding."""
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    whole = sum(t.elements for t in stage_tensors(arch, MegatronLayout(world=1), 0, 0))
    assert whole == 70_553_706_496  # Llama-3-70B's published 70.6 B (vocab padded to 128256 -> 128256 at TP 1)
    lay = MegatronLayout(world=64, tp=8, pp=4)
    actor = RoleModelSpec("actor", arch, lay)
    report = estimate_megatron(actor, BF16_DO, gpu_type="H100-80G")
    [comp] = report.components
    first, middle, last = comp.stages[0], comp.stages[1], comp.stages[3]
    assert middle.params == 20 * 106_971_136 == 2_139_422_720
    assert first.params == 2_139_422_720 + 132_120_576 == 2_271_543_296
    assert last.params == 2_139_422_720 + 132_120_576 + 8192 == 2_271_551_488
    rows = _rows(last)
    assert rows["parameters, trainable (bf16)"].device == 2 * 2_271_551_488
    assert rows["gradient buffers (fp32 main grads)"].device == 4 * 2_271_551_488
    # fp32 master (4 B) and two Adam moments (8 B) over DP 2
    assert rows["optimizer: fp32 master params"].device == 4 * 2_271_551_488 / 2
    assert rows["optimizer: exp_avg + exp_avg_sq (fp32)"].device == 8 * 2_271_551_488 / 2
    assert last.total("device") == 12 * 2_271_551_488 == 27_258_617_856  # 25.39 GiB
    rank, dev, host = report.heaviest_rank()
    assert (rank, dev, host) == (48, 27_258_617_856, 0)  # the first rank of the last stage (64 / 4 x 3)
    lines = "\n".join(format_memory(report))
    assert "25.39 GiB" in lines and "activations" in lines and "not estimated yet" in lines
    assert f"leaves {(79.6 * GIB - 27_258_617_856) / GIB:.2f} GiB" in lines and "no fit verdict" in lines


def test_llama3_70b_without_distributed_optimizer_holds_the_whole_state():
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    flags = TrainingFlags(params_dtype="bfloat16")
    report = estimate_megatron(RoleModelSpec("actor", arch, MegatronLayout(world=64, tp=8, pp=4)), flags)
    last = report.components[0].stages[3]
    assert last.total("device") == (2 + 4 + 12) * 2_271_551_488  # bf16 + fp32 grads + master and moments unsharded


def test_qwen3_235b_a22b_tp4_pp2_ep8_by_hand():
    """32 ranks: TP 4, PP 2 (47 layers each), EP 8, expert-TP 1, so DP 4 and expert-DP 32 / (8 x 2) = 2.
    Per layer and rank: attention qkv (64 + 2 x 4) x 128 x 4096 = 37,748,736 and o_proj 33,554,432 over TP 4 =
    17,825,792; q/k norms 2 x 128; two norms 2 x 4096; the router 128 x 4096 = 524,288 (replicated):
    18,358,528 dense. Experts: 128 / 8 = 16 per rank, each gate+up 2 x 1536 x 4096 + down 4096 x 1536 =
    18,874,368: 301,989,888 expert. Stage 0 adds the embedding: vocab 151936 pads to 152064 (x 512),
    152064 x 4096 / 4 = 155,713,536."""
    arch = ModelArch.from_hf_config(QWEN3_235B)
    whole = sum(t.elements for t in stage_tensors(arch, MegatronLayout(world=1), 0, 0))
    assert whole == 235_093_634_560  # the published 235 B (151936 is a multiple of 128: no padding at TP 1)
    lay = MegatronLayout(world=32, tp=4, pp=2, ep=8, etp=1)
    assert (lay.dp, lay.edp) == (4, 2)
    report = estimate_megatron(RoleModelSpec("actor", arch, lay), BF16_DO, gpu_type="H100-80G")
    stage0 = report.components[0].stages[0]
    dense, expert = 47 * 18_358_528 + 155_713_536, 47 * 301_989_888
    assert (dense, expert) == (1_018_564_352, 14_193_524_736)
    assert stage0.params == dense + expert == 15_212_089_088
    rows = _rows(stage0)
    assert rows["parameters, trainable (bf16)"].device == 2 * (dense + expert)
    assert rows["gradient buffers (fp32 main grads)"].device == 4 * (dense + expert)
    # master + moments (12 B) of dense / DP 4 and experts / expert-DP 2
    opt = rows["optimizer: fp32 master params"].device + rows["optimizer: exp_avg + exp_avg_sq (fp32)"].device
    assert opt == 12 * (dense / 4 + expert / 2) == 88_216_841_472
    total = 6 * (dense + expert) + 88_216_841_472
    assert stage0.total("device") == total  # 167.2 GiB: far above an H100
    assert "exceeds the GPU's memory (H100-80G: 79.6 GiB): it does not fit" in "\n".join(format_memory(report))
    # --optimizer-cpu-offload: the master copy, a gradient copy and the moments (16 B) in host memory
    off = TrainingFlags(params_dtype="bfloat16", distributed_optimizer=True, cpu_offload=True, precision_aware=True)
    stage0 = estimate_megatron(RoleModelSpec("actor", arch, lay), off).components[0].stages[0]
    assert stage0.total("device") == 6 * (dense + expert)
    assert stage0.total("host") == 16 * (dense / 4 + expert / 2)


def test_lora_adapters_by_hand():
    """--lora-rank 16 on q/k/v/o of a Llama-3-70B layer at TP 8: q, k, v are parts of the column-parallel linear_qkv
    (A [16, 8192] replicated, B [rows / 8, 16]): q 16 x 8192 + 8192 / 8 x 16, k and v 16 x 8192 + 1024 / 8 x 16;
    o_proj is row-parallel (A [16, 8192 / 8], B [8192, 16])."""
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    flags = TrainingFlags(params_dtype="bfloat16", lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    lay = MegatronLayout(world=8, tp=8, pp=1)
    tensors = stage_tensors(arch, lay, 0, 0, flags=flags)
    trainable = sum(t.elements for t in tensors if not t.frozen)
    per_layer = (16 * 8192 + 1024 * 16) + 2 * (16 * 8192 + 128 * 16) + (16 * 1024 + 8192 * 16)
    assert trainable == 80 * per_layer
    report = estimate_megatron(RoleModelSpec("actor", arch, lay), flags, tags=("ref",))
    stage = report.components[0].stages[0]
    assert _rows(stage)["parameters, trainable (bf16)"].device == 2 * 80 * per_layer
    assert _rows(stage)["gradient buffers (fp32 main grads)"].device == 4 * 80 * per_layer
    assert _rows(stage)["parameters, frozen (bf16)"].device == 2 * (stage.params - 80 * per_layer)
    # the reference with LoRA is a tag of the adapters, plus the actor's kept copy
    [tags] = [c for c in report.components if c.name == "tags"]
    assert tags.stages[0].total("host") == 2 * 2 * 80 * per_layer


def test_gpu_types_and_override():
    from megatron_rl.config.schema import MemoryConfig
    import dataclasses

    [field] = [f for f in dataclasses.fields(MemoryConfig) if f.name == "gpu_type"]
    assert field.metadata["choices"] == tuple(GPU_MEMORY_GIB)  # the flag's choices are the table
    assert gpu_memory_gib(None)[0] == GPU_MEMORY_GIB["H100-80G"]
    assert gpu_memory_gib("B200-192G", 100.0) == (100.0, "--gpu-memory-gib: 100 GiB")
    with pytest.raises(PlanError, match="--gpu-type 'V100'"):
        gpu_memory_gib("V100")


def _model_dir(tmp_path, cfg):
    d = tmp_path / cfg["model_type"]
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_dry_run_prints_the_memory_table(tmp_path, capsys):
    """--dry-run of a ppo run with a KL reference: the actor's and the critic's tables (the critic at its own
    layout), the reference's weight tag, the actor's activations (plan/activations.py) and the fit verdict."""
    from megatron_rl.config import parse_config
    from megatron_rl.runner.dry_run import print_plan

    hf = _model_dir(tmp_path, LLAMA3_70B)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    cfg = parse_config(["--hf-checkpoint", hf, "--prompt-data", str(prompts), "--dry-run", "--bf16",
                        "--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size",
                        "8", "--pipeline-model-parallel-size", "4", "--use-distributed-optimizer",
                        "--advantage-estimator", "ppo", "--critic-pipeline-model-parallel-size", "8",
                        "--use-kl-loss", "--ref-weights-location", "host", "--gpu-type", "H200-141G",
                        "--debug-train-only", "--load-debug-rollout-data", str(tmp_path / "r{rollout_id}.pt")])
    print_plan(cfg)
    out = capsys.readouterr().out
    assert "static memory per training rank" in out
    assert "actor: megatron TP 8 x PP 4 x DP 2, trains" in out
    assert "critic: megatron TP 8 x PP 8 x DP 1, trains" in out
    assert "weight tags (ref)" in out and "2 copies of the actor's parameter shards (--ref-weights-location host)" in out
    assert "parameters, trainable (bf16)" in out and "gradient buffers (fp32 main grads)" in out
    assert "not estimated yet" not in out and "logits peak (log-prob/entropy)" in out and "activation peak" in out
    assert "verdict: fits H200-141G: 140.4 GiB, headroom" in out


def test_check_plan_prints_the_memory_table(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tools"))
    import check_plan

    cfg = _model_dir(tmp_path, QWEN3_235B)
    assert check_plan.main(["megatron:(attn:d4p2t4|ffn:d2p2t1e8)", "--hf-checkpoint", cfg, "--bf16",
                            "--use-distributed-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "actor: megatron TP 4 x PP 2 x EP 8 x DP 4 (expert-TP 1, expert-DP 2), trains" in out
    assert "it does not fit" in out
    assert check_plan.main(["megatron:(attn:d4p2t4|ffn:d2p2t1e8)", "--hf-checkpoint", cfg, "--bf16",
                            "--use-distributed-optimizer", "--json"]) == 0
    [memory] = json.loads(capsys.readouterr().out)["memory"]
    # the last stage: the output layer as large as stage 0's embedding, plus the final norm (4096: 6 B + 12 B / DP 4)
    assert memory["heaviest_rank"]["device_bytes"] == 6 * 15_212_089_088 + 88_216_841_472 + 4096 * (6 + 3)
    assert memory["heaviest_rank"]["rank"] == 16
    assert memory["activations"] == "not estimated yet"


def test_estimator_matches_every_bridge_at_tp1():
    """The estimator's parameter count of each tiny family (every architecture switch on) equals the bridge's own
    shape map (``Bridge.megatron_param_shapes``, which tests/models check against built models), with MTP."""
    import math

    from megatron_rl.models import get_bridge
    from megatron_rl.models.hf_tiny import FAMILIES, tiny_config

    for family in FAMILIES:
        extra = {"num_nextn_predict_layers": 1} if family in ("glm4_moe", "deepseek_v3") else {}
        cfg = tiny_config(family, **extra).to_dict()
        for mtp in (0, 1) if extra else (0,):
            bridge = get_bridge(cfg, mtp_num_layers=mtp)
            want = sum(math.prod(s) for s in bridge.megatron_param_shapes("local", 1).values())
            got = sum(t.elements for t in stage_tensors(ModelArch.from_hf_config(cfg), MegatronLayout(world=1), 0, 0,
                                                        mtp_layers=mtp))
            assert got == want, (family, mtp)


def test_lora_the_run_refuses_is_named():
    """LoRA's default all-linear on a MoE model (expert linears) and on MLA are refused by models/lora.py: the
    estimate says so instead of pricing adapters the run never builds."""
    moe = ModelArch.from_hf_config(QWEN3_235B)
    assert "MoE expert linears" in moe.lora_problem(("all-linear",))
    assert moe.lora_problem(("q_proj", "v_proj")) is None
    assert ModelArch.from_hf_config(LLAMA3_70B).lora_problem(("all-linear",)) is None
