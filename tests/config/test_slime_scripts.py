"""slime launch scripts through ``--dry-run``.

The commands below are slime's own ``scripts/models/<model>.sh`` MODEL_ARGS and
``scripts/run-<model>.sh`` arrays (THUDM/slime), written out as slime's bash arrays are, with
the paths pointed at local files. ``--hf-checkpoint`` dirs hold the real models' config.json
(nothing else: validation and the planner read only that), so the architecture flags are
checked against the real configs. Each command is parsed and validated in-process (fast);
one goes through ``python -m megatron_rl.train --dry-run``'s ``main`` end to end.

A slime script's SGLang flags select SGLang (``--rollout-backend auto``) and its placement the
weight transport (``--update-weight-transport auto``: tensor colocated, distributed separate), as
in slime; ``--dry-run`` prints the plan the flags describe (TP/PP/EP/CP, GPU demand, colocation)
and the engines each node launches. What a real run here still refuses is only what this
machine lacks (GPU-only flags, SGLang in this venv), named, not hidden.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.placement import model_shape_for_config, plan_for_config
from megatron_rl.config.validate import is_not_built_yet, collect_errors
from megatron_rl.errors import ConfigError
from megatron_rl.plan import validate_plan

# -- the real HF config.json of each model (huggingface.co/Qwen/<model>/config.json) ---------------
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
            "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 32,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
            "rope_theta": 1000000, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
              "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
              "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                 "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                 "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
                 "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                 "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "use_sliding_window": False,
                 "vocab_size": 151936}

# huggingface.co/zai-org/GLM-4.5, deepseek-ai/DeepSeek-R1 and moonshotai/Kimi-K2-Instruct
GLM45 = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
         "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
         "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
         "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
         "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
         "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
         "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
         "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": True, "vocab_size": 151552}
_DS_MLA = {"attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
           "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
           "kv_lora_rank": 512, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_shared_experts": 1,
           "norm_topk_prob": True, "num_experts_per_tok": 8, "num_hidden_layers": 61, "q_lora_rank": 1536,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "scoring_func": "sigmoid",
           "seq_aux": True, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
           "use_cache": True, "v_head_dim": 128}
DEEPSEEK_R1 = {**_DS_MLA, "architectures": ["DeepseekV3ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
               "first_k_dense_replace": 3, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
               "n_group": 8, "n_routed_experts": 256, "num_attention_heads": 128, "num_key_value_heads": 128,
               "num_nextn_predict_layers": 1,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]},
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "rope_theta": 10000, "routed_scaling_factor": 2.5, "topk_group": 4, "vocab_size": 129280}
KIMI_K2 = {**_DS_MLA, "architectures": ["DeepseekV3ForCausalLM"],
           "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                        "AutoModel": "modeling_deepseek.DeepseekV3Model",
                        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
           "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
           "max_position_embeddings": 131072, "model_type": "kimi_k2", "n_group": 1, "n_routed_experts": 384,
           "num_attention_heads": 64, "num_key_value_heads": 64, "num_nextn_predict_layers": 0,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "topk_group": 1, "vocab_size": 163840}

# -- scripts/models/*.sh ------------------------------------------------------------------------------
QWEN3_4B_MODEL_ARGS = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]
QWEN25_05B_MODEL_ARGS = [
    "--swiglu", "--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
    "--num-attention-heads", "14", "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--group-query-attention",
    "--num-query-groups", "2", "--vocab-size", "151936",
]


def _moe_layer_freq(n: int) -> str:
    return "[" + ", ".join(["1"] * n) + "]"  # printf -v MOE_LAYER_FREQ "[%s]" (FIRST_K_DENSE_REPLACE=0)


def moe_model_args(layers, hidden, ffn, heads, groups, moe_ffn) -> list[str]:
    """scripts/models/qwen3-30B-A3B.sh and qwen3-235B-A22B.sh (they differ only in these numbers)."""
    return [
        "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", str(heads),
        "--num-query-groups", str(groups), "--kv-channels", "128", "--num-layers", str(layers),
        "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--norm-epsilon", "1e-6",
        "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "151936",
        "--rotary-base", "1000000",
        # moe
        "--moe-ffn-hidden-size", str(moe_ffn), "--moe-router-score-function", "softmax",
        "--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "8",
        "--moe-layer-freq", _moe_layer_freq(layers), "--num-experts", "128", "--moe-grouped-gemm",
        "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
        "--moe-aux-loss-coeff", "0",
    ]


def _first_dense(n_dense: int, layers: int) -> str:
    return "[" + ", ".join(["0"] * n_dense + ["1"] * (layers - n_dense)) + "]"  # printf -v MOE_LAYER_FREQ "[%s]"


# scripts/models/glm4.5-355B-A32B.sh (N_DENSE_LAYERS=3, N_MOE_LAYERS=89)
GLM45_MODEL_ARGS = [
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "96",
    "--num-query-groups", "8", "--kv-channels", "128", "--num-layers", "92", "--hidden-size", "5120",
    "--ffn-hidden-size", "12288", "--add-qkv-bias", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--rotary-percent", "0.5", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "151552",
    "--rotary-base", "1000000",
    # moe
    "--moe-ffn-hidden-size", "1536", "--moe-shared-expert-intermediate-size", "1536", "--moe-router-pre-softmax",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "8", "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "[0]*3+[1]*89",
    "--num-experts", "160", "--moe-grouped-gemm", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]


def mla_model_args(layers, heads, kv_channels, vocab, scaling, base, experts, dense, groups, group_topk, route_scale):
    """scripts/models/deepseek-v3.sh and kimi-k2.sh (they differ only in these values)."""
    return [
        "--disable-bias-linear", "--num-layers", str(layers), "--hidden-size", "7168", "--ffn-hidden-size", "18432",
        "--num-attention-heads", str(heads), "--kv-channels", str(kv_channels), "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--swiglu",
        "--untie-embeddings-and-output-weights", "--vocab-size", str(vocab),
        "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--qk-layernorm", "--rotary-scaling-factor", scaling,
        "--rotary-base", base, "--mscale", "1.0", "--mscale-all-dim", "1.0", "--attention-softmax-in-fp32",
        "--no-rope-fusion",
        # moe
        "--num-experts", str(experts), "--moe-layer-freq", _first_dense(dense, layers), "--moe-ffn-hidden-size",
        "2048", "--moe-router-topk", "8", "--moe-shared-expert-intermediate-size", "2048", "--moe-router-pre-softmax",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall",
        "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0", "--moe-router-group-topk", str(group_topk),
        "--moe-router-num-groups", str(groups), "--moe-grouped-gemm", "--moe-router-topk-scaling-factor", route_scale,
        "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    ]


# kimi-k2.sh states --kv-channels 64, deepseek-v3.sh 128: megatron's MLA reads neither (it sizes heads by
# --qk-head-dim / --v-head-dim), so neither is compared with config.json
DEEPSEEK_V3_MODEL_ARGS = mla_model_args(61, 128, 128, 129280, "40", "10000", 256, 3, 8, 4, "2.5")
KIMI_K2_MODEL_ARGS = mla_model_args(61, 64, 64, 163840, "32.0", "50000", 384, 1, 1, 1, "2.827")

QWEN3_30B_A3B_MODEL_ARGS = moe_model_args(48, 2048, 6144, 32, 4, 768)
QWEN3_235B_A22B_MODEL_ARGS = moe_model_args(94, 4096, 12288, 64, 4, 1536)

# -- the run scripts' arrays ---------------------------------------------------------------------------
MISC_ARGS = [  # identical in every run-*.sh
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",  # default dropout in megatron is 0.1
    "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    "--attention-backend", "flash",  # need to comment this when using model with MLA
]
OPTIMIZER_ARGS = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                  "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
# slime always turns the distributed optimizer on (_set_default_megatron_args); here
# --optimizer-cpu-offload implies it, as Megatron-LM requires (docs/migrating-from-slime.md)
CPU_OFFLOAD_ARGS = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer"]
GRPO_ARGS = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
             "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

def runnable(argv: list[str]) -> list[str]:
    """The command as written: every slime flag above is accepted (kept as a seam should one not be)."""
    return list(argv)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("slime")
    paths = {}
    for name, cfg in (("Qwen3-4B", QWEN3_4B), ("Qwen2.5-0.5B-Instruct", QWEN25_05B),
                      ("Qwen3-30B-A3B", QWEN3_30B_A3B), ("GLM-4.5", GLM45), ("DeepSeek-R1", DEEPSEEK_R1),
                      ("Kimi-K2-Instruct", KIMI_K2)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = str(root / name)
    for data in ("dapo-math-17k.jsonl", "aime-2024.jsonl"):
        (root / data).write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
        paths[data] = str(root / data)
    paths["root"] = str(root)
    return paths


def ckpt_args(files, model):
    r = files["root"]
    return ["--hf-checkpoint", files[model], "--ref-load", f"{r}/{model}_torch_dist", "--load", f"{r}/{model}_slime/",
            "--save", f"{r}/{model}_slime/", "--save-interval", "20"]


def rollout_args(files, rbs="32", gbs="256"):
    return ["--prompt-data", files["dapo-math-17k.jsonl"], "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000",
            "--rollout-batch-size", rbs, "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
            "--rollout-temperature", "1", "--global-batch-size", gbs, "--balance-data"]


def eval_args(files):
    return ["--eval-interval", "20", "--eval-prompt-data", "aime", files["aime-2024.jsonl"],
            "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "1"]


def perf_args(tp, ep, tokens, pp="1", cp="1", extra=()):
    return ["--tensor-model-parallel-size", tp, "--sequence-parallel", "--pipeline-model-parallel-size", pp,
            "--context-parallel-size", cp, "--expert-model-parallel-size", ep, "--expert-tensor-parallel-size", "1",
            *extra, *RECOMPUTE, "--use-dynamic-batch-size", "--max-tokens-per-gpu", tokens]


def qwen3_4b(files):
    """scripts/run-qwen3-4B.sh on 8 GPUs: colocated, TP2 + SP, SGLang engines of 2 GPUs."""
    return ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
            *QWEN3_4B_MODEL_ARGS, *ckpt_args(files, "Qwen3-4B"), *rollout_args(files), *OPTIMIZER_ARGS, *GRPO_ARGS,
            *perf_args("2", "1", "9216"), *eval_args(files),
            "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7", *MISC_ARGS]


def qwen25_05b(files):
    """scripts/run-qwen2.5-0.5B-reproducibility.sh: qkv bias, deterministic, W&B flags; its PERF_ARGS pass
    --sequence-parallel at TP 1, which has no effect there (as in Megatron-LM)."""
    return ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate", "--calculate-per-token-loss",
            *QWEN25_05B_MODEL_ARGS, "--hf-checkpoint", files["Qwen2.5-0.5B-Instruct"],
            "--ref-load", files["root"] + "/Qwen2.5-0.5B-Instruct_torch_dist/",
            "--prompt-data", files["dapo-math-17k.jsonl"], "--input-key", "messages", "--label-key", "label",
            "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "100",
            "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1024",
            "--rollout-temperature", "1", "--global-batch-size", "256",
            *OPTIMIZER_ARGS, "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00",
            "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2",
            "--eps-clip-high", "0.28",
            "--use-wandb", "--wandb-host", "https://wandb.ai/", "--wandb-team", "glm-zero", "--wandb-project",
            "slime-dev", "--wandb-group", "qwen2.5-0.5B-gsm8k-deterministic",
            "--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
            "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
            "--eval-interval", "20", "--eval-prompt-data", "gsm8k", files["aime-2024.jsonl"],
            "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-top-k", "1",
            "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7",
            "--sglang-enable-deterministic-inference", "--sglang-attention-backend", "flashinfer",
            "--deterministic-mode", *MISC_ARGS]


def qwen3_30b_a3b(files):
    """scripts/run-qwen3-30B-A3B.sh: MoE, TP4 EP8, CPU-offloaded optimizer, colocated on 8 GPUs."""
    return ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
            *QWEN3_30B_A3B_MODEL_ARGS, *ckpt_args(files, "Qwen3-30B-A3B"), *rollout_args(files),
            *OPTIMIZER_ARGS, *CPU_OFFLOAD_ARGS, *GRPO_ARGS, *perf_args("4", "8", "20480"), *eval_args(files),
            "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
            "--sglang-cuda-graph-bs", "1", "2", "4", "8", *[str(b) for b in range(16, 257, 8)], *MISC_ARGS]


def qwen3_235b_a22b(files):
    """scripts/run-qwen3-235B-A22B.sh: 8 nodes x 8 GPUs training, 64 separate rollout GPUs, PP4 with an
    uneven last stage, CP2, EP16. Its checkpoint paths point at nothing (a laptop has no 235B
    checkpoint): the plan comes from the architecture flags. slime picks the NCCL broadcast transport
    for separate GPUs and SGLang as the engine; here both are flags (--rollout-backend sglang
    --update-weight-transport distributed); --dry-run accepts them. Its engines of 32 GPUs span nodes and its
    rollout GPUs are nodes of their own, which a real run refuses at launch (engines this run launches live on
    its own nodes): such a run gives --rollout-engine-urls of servers started on the rollout nodes."""
    base = "/nonexistent/BASE_FOLDER"
    return ["--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "64",
            "--update-weight-buffer-size", str(1024 * 1024 * 1024 * 4),
            "--rollout-backend", "sglang", "--update-weight-transport", "distributed",
            *QWEN3_235B_A22B_MODEL_ARGS,
            "--hf-checkpoint", f"{base}/Qwen3-235B-A22B-FP8", "--ref-load", f"{base}/Qwen3-235B-A22B_torch_dist",
            "--load", f"{base}/Qwen3-235B-A22B_slime/", "--save", files["root"] + "/Qwen3-235B-A22B_slime/",
            "--save-interval", "20",
            *rollout_args(files, rbs="8", gbs="64"), *OPTIMIZER_ARGS, *CPU_OFFLOAD_ARGS,
            "--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
            "--entropy-coef", "0.00", "--eps-clip", "4e-4",
            *perf_args("4", "16", "16384", pp="4", cp="2", extra=("--decoder-last-pipeline-num-layers", "22")),
            "--eval-prompt-data", "aime", files["aime-2024.jsonl"], "--n-samples-per-eval-prompt", "16",
            "--eval-max-response-len", "16384", "--eval-top-p", "1",
            "--rollout-num-gpus-per-engine", "32", "--sglang-mem-fraction-static", "0.7",
            "--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "32",
            "--sglang-enable-dp-lm-head", "--sglang-cuda-graph-bs", "1", "2", "4", "8",
            *[str(b) for b in range(16, 257, 8)], "--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto",
            *MISC_ARGS, "--dry-run"]


# the run scripts of the frontier MoE models share these arrays (slime's run-deepseek-r1.sh,
# run-kimi-k2-Instruct.sh and run-glm4.7-355B-A32B.sh)
def frontier_rollout_args(files, rm_type, num_rollout, extra=()):
    return ["--prompt-data", files["dapo-math-17k.jsonl"], "--input-key", "prompt", "--label-key", "label",
            "--apply-chat-template", "--rollout-shuffle", "--rm-type", rm_type, "--num-rollout", num_rollout,
            "--rollout-batch-size", "128", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "32768",
            "--rollout-temperature", "1", "--over-sampling-batch-size", "256",
            "--dynamic-sampling-filter-path",
            "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
            "--num-steps-per-rollout", "4", "--balance-data", *extra]


def frontier_eval_args(files):
    return ["--eval-interval", "20", "--eval-prompt-data", "aime", files["aime-2024.jsonl"],
            "--n-samples-per-eval-prompt", "8", "--eval-max-response-len", "32768", "--eval-top-p", "1"]


FRONTIER_MISC_ARGS = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
                      "--attention-softmax-in-fp32", "--attention-backend", "flash", "--moe-enable-deepep",
                      "--moe-token-dispatcher-type", "flex"]


def deepseek_r1(files):
    """scripts/run-deepseek-r1.sh: 16 nodes x 8 GPUs colocated, TP8 PP4 (last stage 13 layers) CP4 EP32, SGLang
    engines of 64 GPUs with DP attention, DeepEP and MTP speculative decoding (EAGLE), DeepEP in megatron."""
    return ["--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--colocate",
            *DEEPSEEK_V3_MODEL_ARGS, *ckpt_args(files, "DeepSeek-R1"),
            *frontier_rollout_args(files, "deepscaler", "3000"), *OPTIMIZER_ARGS, *CPU_OFFLOAD_ARGS, *GRPO_ARGS,
            *perf_args("8", "32", "16384", pp="4", cp="4", extra=("--decoder-last-pipeline-num-layers", "13")),
            *frontier_eval_args(files),
            "--rollout-num-gpus-per-engine", "64", "--sglang-mem-fraction-static", "0.7", "--sglang-ep-size", "64",
            "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-moe-dense-tp-size", "1",
            "--sglang-enable-dp-lm-head", "--sglang-moe-a2a-backend", "deepep", "--sglang-deepep-mode", "auto",
            "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "3",
            "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "4",
            "--sglang-server-concurrency", "1024", *FRONTIER_MISC_ARGS]


def kimi_k2(files):
    """scripts/run-kimi-k2-Instruct.sh: 32 nodes x 8 GPUs colocated, TP8 PP8 (last stage 5 layers) CP4 EP32.
    (slime's file lacks the backslash after --update-weight-buffer-size, so bash would end the command there;
    this is the command it means.)"""
    return ["--actor-num-nodes", "32", "--actor-num-gpus-per-node", "8", "--colocate",
            "--update-weight-buffer-size", str(4 * 512 * 1024 * 1024),
            *KIMI_K2_MODEL_ARGS, *ckpt_args(files, "Kimi-K2-Instruct"),
            *frontier_rollout_args(files, "math", "100"), *OPTIMIZER_ARGS, *CPU_OFFLOAD_ARGS, *GRPO_ARGS,
            *perf_args("8", "32", "16384", pp="8", cp="4", extra=("--decoder-last-pipeline-num-layers", "5")),
            *frontier_eval_args(files),
            "--rollout-num-gpus-per-engine", "16", "--sglang-mem-fraction-static", "0.7",
            "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-moe-dense-tp-size", "1",
            "--sglang-enable-dp-lm-head", "--sglang-ep-size", "16", "--sglang-server-concurrency", "1024",
            *FRONTIER_MISC_ARGS]


def glm45(files):
    """scripts/run-glm4.7-355B-A32B.sh (it sources models/glm4.5-355B-A32B.sh; GLM-4.5/4.6/4.7 share the
    architecture) on GLM-4.5's config.json: 8 nodes x 8 GPUs colocated, TP8 PP4 CP2 EP16, GSPO with TIS,
    MTP speculative decoding in SGLang."""
    r = files["root"]
    return ["--actor-num-nodes", "8", "--actor-num-gpus-per-node", "8", "--colocate",
            *GLM45_MODEL_ARGS, "--hf-checkpoint", files["GLM-4.5"], "--ref-load", f"{r}/GLM-4.5_torch_dist/",
            *frontier_rollout_args(files, "deepscaler", "3000",
                                   extra=("--rollout-stop-token-ids", "151329", "151336", "151338")),
            *OPTIMIZER_ARGS, *CPU_OFFLOAD_ARGS,
            "--advantage-estimator", "gspo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--kl-coef",
            "0.00", "--entropy-coef", "0.00", "--eps-clip", "1e-4", "--eps-clip-high", "2e-4", "--use-tis",
            *perf_args("8", "16", "16384", pp="4", cp="2"), *frontier_eval_args(files),
            "--rollout-num-gpus-per-engine", "32", "--sglang-mem-fraction-static", "0.7",
            "--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "32",
            "--sglang-enable-dp-lm-head", "--sglang-moe-dense-tp-size", "1", "--sglang-speculative-algorithm", "EAGLE",
            "--sglang-speculative-num-steps", "3", "--sglang-speculative-eagle-topk", "1",
            "--sglang-speculative-num-draft-tokens", "4", *FRONTIER_MISC_ARGS]


SCRIPTS = {"qwen3-4B": qwen3_4b, "qwen2.5-0.5B": qwen25_05b, "qwen3-30B-A3B": qwen3_30b_a3b,
           "qwen3-235B-A22B": qwen3_235b_a22b, "deepseek-r1": deepseek_r1, "kimi-k2-instruct": kimi_k2,
           "glm4.5-355B-A32B": glm45}



@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def checked(argv):
    """Parse + validate like --dry-run; return (cfg, plan, report) after asserting nothing is refused."""
    cfg = parse_config(runnable(argv) + ["--dry-run"], validate=False)
    others = [e for e in collect_errors(cfg) if not is_not_built_yet(e)]
    assert not others, others
    plan = plan_for_config(cfg)
    report = validate_plan(plan, None, model_shape_for_config(cfg), cfg.model.seq_length,
                           cfg.parallel.virtual_pipeline_model_parallel_size,
                           last_stage_layers=cfg.parallel.decoder_last_pipeline_num_layers)
    assert report.ok, report.errors
    return cfg, plan, report


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_flag_of_the_script_is_known(name, files):
    parse_config(runnable(SCRIPTS[name](files)), validate=False)  # no "unknown flag"


def test_qwen3_4b_dense_colocated(files):
    cfg, plan, _ = checked(qwen3_4b(files))
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
            p.expert_model_parallel_size, p.sequence_parallel) == (2, 1, 1, 1, True)
    assert cfg.data_parallel_size == 4 and plan.total_gpus == 8
    assert plan.actor.spec().endswith(":d4t2") and len(plan.groups) == 1  # rollout and actor share the 8 GPUs
    assert cfg.architecture.qk_layernorm and cfg.megatron.attention_backend == "flash"


def test_qwen25_qkv_bias_and_wandb(files):
    cfg, plan, _ = checked(qwen25_05b(files))
    assert cfg.architecture.add_qkv_bias and cfg.megatron.deterministic_mode
    assert (cfg.runtime.wandb_team, cfg.runtime.wandb_project) == ("glm-zero", "slime-dev")
    assert plan.actor.spec().endswith(":d8") and plan.total_gpus == 8


def test_qwen3_moe_with_cpu_offloaded_optimizer(files):
    from megatron_rl.config.megatron_flags import megatron_core_kwargs

    cfg, plan, _ = checked(qwen3_30b_a3b(files))
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size) == (4, 8, 1)
    assert cfg.optimizer.optimizer_cpu_offload and cfg.optimizer.overlap_cpu_optimizer_d2h_h2d
    assert plan.actor.spec().endswith(":d2t4e8") and plan.total_gpus == 8 and len(plan.groups) == 1
    assert cfg.rollout.sglang_args["cuda_graph_bs"][:5] == ["1", "2", "4", "8", "16"]
    kw = megatron_core_kwargs(cfg)
    assert kw["transformer"]["moe_aux_loss_coeff"] == 0.0  # slime's 0 wins over config.json's 0.001
    assert kw["transformer"]["moe_router_load_balancing_type"] == "none"
    assert kw["optimizer"] == {"overlap_cpu_optimizer_d2h_h2d": True}


def test_qwen3_235b_multi_node_separate_rollout_planned_from_flags(files):
    cfg, plan, _ = checked(qwen3_235b_a22b(files))
    shape = model_shape_for_config(cfg)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_query_groups, shape.num_experts) == (94, 64, 4, 128)
    assert "architecture flags" in shape.source
    assert plan.actor.spec().endswith(":d2p4t4c2e16") and plan.actor.world_size == 64
    assert [r.spec().split(":")[1] for r in plan.rollout] == ["d2t32"]
    assert plan.total_gpus == 128 and len(plan.groups) == 2  # separate: 64 training + 64 rollout GPUs


@pytest.mark.parametrize("name, spec, gpus, global_batch", [
    ("deepseek-r1", ":d1p4t8c4e32", 128, 256), ("kimi-k2-instruct", ":d1p8t8c4e32", 256, 256),
    ("glm4.5-355B-A32B", ":d1p4t8c2e16", 64, 256)])
def test_frontier_moe_scripts_state_their_configs(files, name, spec, gpus, global_batch):
    """DeepSeek-R1, Kimi-K2 and GLM-4.5 as slime runs them: every MLA / shared-expert / sigmoid-router flag
    agrees with the real config.json (a wrong one is refused: test_slime_architecture.py), the plan is the
    scripts' layout, --num-steps-per-rollout 4 splits 128 x 8 samples into steps of 256, and the router
    settings reach megatron-core as slime sets them (bias frozen, no load-balancing loss)."""
    from megatron_rl.config.megatron_flags import megatron_core_kwargs

    cfg, plan, _ = checked(SCRIPTS[name](files))
    assert plan.actor.spec().endswith(spec) and plan.total_gpus == gpus and len(plan.groups) == 1
    assert cfg.batching.effective_global_batch_size == global_batch and cfg.batching.optimizer_steps_per_rollout == 4
    a = cfg.architecture
    assert a.moe_router_enable_expert_bias and a.moe_router_score_function == "sigmoid"
    assert a.multi_latent_attention == (name != "glm4.5-355B-A32B")
    kw = megatron_core_kwargs(cfg)["transformer"]
    assert (kw["moe_router_bias_update_rate"], kw["moe_aux_loss_coeff"], kw["moe_router_load_balancing_type"]) == (
        0.0, 0.0, "seq_aux_loss")
    assert kw["moe_enable_deepep"] and kw["moe_token_dispatcher_type"] == "flex"


def test_dry_run_main_end_to_end_prints_the_plan(files, capsys):
    """``python -m megatron_rl.train --dry-run`` itself, on the 30B script as slime wrote it: the plan,
    the SGLang engine each node launches with its command line, the model line, what the real run needs."""
    from megatron_rl.train import main

    assert main(runnable(qwen3_30b_a3b(files)) + ["--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "megatron[actor]:d2t4e8" in out and "total GPU demand: 8" in out
    assert "rollout: 1 SGLang engine(s) of 8 GPU(s), colocated on the trainer's devices" in out
    assert ("node 0 engine 0: trainer ranks 0-7's devices: sglang.launch_server --model-path "
            f"{files['Qwen3-30B-A3B']} --host HOST --port PORT --nccl-port PORT --tp-size 8") in out
    assert "--enable-memory-saver --mem-fraction-static 0.7 --cuda-graph-bs 1 2 4 8 16" in out
    assert "model: 48 layers, 32 heads, 4 KV groups, vocab 151936, 128 experts" in out
    assert "needs: --moe-grouped-gemm takes effect only with grouped-GEMM experts" in out
    assert "dry run: configuration valid" in out and "error" not in err


# Kimi-K2 in bf16 (this config.json has no fp8 quantization_config): ~2 TB of weights over an engine of 16 H100s
OVER_MEMORY = {"kimi-k2-instruct"}


def test_over_memory_plan_is_refused_with_fixes(files, capsys):
    """A plan the memory estimate says does not fit exits 2 naming the component, rank and shortfall (plan/fit.py);
    --allow-over-memory goes on with a warning line (test_every_script_dry_runs_unchanged)."""
    from megatron_rl.train import main

    argv = [a for a in runnable(kimi_k2(files)) if a != "--dry-run"]
    assert main(argv + ["--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "verdict: does NOT fit H100-80G" in out and "dry run: the plan does not fit" in out
    assert "engine weights + trainer residual on rank 32's GPU (generate: no room for a KV cache)" in err
    assert "--sglang-mem-fraction-static 0.7 gives 55.72 GiB" in err
    assert main(argv + ["--dry-run", "--gpu-memory-gib", "400"]) == 0  # a card that holds it


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_dry_runs_unchanged(name, files, capsys):
    """Each slime command, flags as slime wrote them (SGLang is chosen by its SGLang flags, the transport
    by the placement, as in slime): --dry-run checks and prints its plan and engines and exits 0. What a
    real run here still refuses is only what this machine lacks: GPU-only flags, SGLang in this venv, and
    the 235B script's paths, which point at nothing."""
    from megatron_rl.train import main

    argv = [a for a in runnable(SCRIPTS[name](files)) if a != "--dry-run"]
    over = ["--allow-over-memory"] if name in OVER_MEMORY else []  # test_over_memory_plan_is_refused_with_fixes
    assert main(argv + over + ["--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "total GPU demand" in out and "dry run: configuration valid" in out, (out, err)
    assert "verdict: " + ("does NOT fit" if over else "fits") in out and "activation peak" in out
    assert "SGLang engine(s) of" in out and not err, err
    cfg = parse_config(argv, validate=False)
    assert cfg.rollout.rollout_backend == "sglang"
    errors = collect_errors(cfg)
    assert not [e for e in errors if is_not_built_yet(e)], errors
    if name == "deepseek-r1":  # its config.json is DeepSeek's fp8 release (slime's script names a bf16 copy too)
        fp8 = [e for e in errors if "quantization_config quant_method='fp8'" in e]
        assert len(fp8) == 1 and "fp8_cast_bf16.py" in fp8[0], errors
        errors = [e for e in errors if e not in fp8]
    if name != "qwen3-235B-A22B":
        assert all("cannot take effect here" in e or "has no sglang package" in e for e in errors), errors


@pytest.mark.parametrize("flag, value, want", [
    ("--rotary-base", "500000", "rope_theta gives 1000000"),
    ("--norm-epsilon", "1e-05", "rms_norm_eps gives 1e-06"),
    ("--num-query-groups", "4", "num_key_value_heads gives 8"),
    ("--kv-channels", "64", "head_dim gives 128"),
    ("--vocab-size", "151643", "151643 pads to 151808, 151936 pads to 152064"),  # TP 2: multiples of 256
])
def test_a_wrong_architecture_flag_is_refused_by_name(files, flag, value, want):
    argv = runnable(qwen3_4b(files))
    i = argv.index(flag)
    argv[i + 1] = value
    with pytest.raises(ConfigError) as exc:
        parse_config(argv)
    line = next(x for x in str(exc.value).splitlines() if flag in x)
    assert f"{flag} {value}" in line and want in line and files["Qwen3-4B"] + "/config.json" in line


def test_real_run_refuses_flags_this_machine_cannot_honour(files):
    """Without --dry-run, the GPU/TE-only flags are refused before any worker starts, by name."""
    argv = [a for a in runnable(qwen3_30b_a3b(files)) if a != "--dry-run"]
    with pytest.raises(ConfigError) as exc:
        parse_config(argv)
    msg = str(exc.value)
    for flag in ("--moe-grouped-gemm", "--moe-permute-fusion", "--attention-backend flash",
                 "--overlap-cpu-optimizer-d2h-h2d"):
        assert f"{flag} cannot take effect here" in msg, flag


def test_slime_eval_and_kl_flags_keep_slime_meaning(files):
    from megatron_rl.algorithms import spec_from_config

    cfg, _, _ = checked(qwen3_4b(files))
    assert cfg.data.eval_sets == (("aime", files["aime-2024.jsonl"]),)
    assert (cfg.data.eval_max_response_len, cfg.data.eval_top_p, cfg.batching.balance_data) == (16384, 1.0, True)
    spec = spec_from_config(cfg)  # --use-kl-loss --kl-loss-coef 0.00: the KL is logged, not added
    assert spec.cfg.kl_loss_coef == 0 and spec.cfg.log_kl and spec.prepare_batch([]).ref_logprobs


# -- docs/migrating-from-slime.md against the parser and these commands --------------------------------
#: flags the commands above add to slime's, each explained in the page's "Defaults that differ" table
ADDED_HERE = {"--dry-run", "--rollout-backend", "--update-weight-transport"}


def test_migration_doc_is_current():
    from megatron_rl.config import migration

    assert migration.DOC_PATH.read_text() == migration.render(), \
        "docs/migrating-from-slime.md is stale: run python -m megatron_rl.config.docs"


def test_migration_doc_covers_every_flag_of_the_commands(files):
    from megatron_rl.config.migration import all_slime_flags

    listed = set(all_slime_flags())
    used = {a for argv in (f(files) for f in SCRIPTS.values()) for a in argv if a.startswith("--")}
    missing = {f for f in used - listed - ADDED_HERE if not f.startswith("--sglang-")}
    assert not missing, f"flags of the slime commands missing from docs/migrating-from-slime.md: {sorted(missing)}"


def test_migration_doc_statuses_match_the_parser():
    from megatron_rl.config import build_parser
    from megatron_rl.config.migration import all_slime_flags, slime_flag_status

    known = {s for a in build_parser()._actions for s in a.option_strings}
    for flag in all_slime_flags():
        status, text = slime_flag_status(flag)
        assert text.strip(), flag
        if not flag.startswith("--sglang-") or flag in known:  # (others: SGLang pass-through, refused there)
            assert (flag in known) == (status != "not built yet"), (flag, status)
