"""Frozen, typed configuration grouped by concern.

Every field is declared once, here, with its flag name, help and choices in the
field metadata. The argparse parser (``flags.py``), the YAML loader and
``docs/flags.md`` are all generated from these declarations, so a flag cannot
exist in one and not the others.

Field names are the Megatron/slime flag names with dashes turned into
underscores, so a YAML file uses the same keys as the command line. Values that
follow from others (data-parallel size, GPU demand, whether a rollout engine is
started) are properties, never stored twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

from megatron_rl.plan.sync_estimate import (DEFAULT_BUCKET_LATENCY_MS, DEFAULT_DECODE_MFU, DEFAULT_DISK_LINK,
                                             DEFAULT_INTER_NODE_LINK, DEFAULT_TRAIN_MFU, DISK_LINKS,
                                             INTER_NODE_LINKS, INTRA_NODE_LINKS)


@dataclass(frozen=True)
class Domain:
    """Where a number flag's value may lie: always finite, between ``lo`` and ``hi``.

    Python's ``float()`` parses ``nan``, ``inf`` and ``-inf`` from a command line or YAML, and
    every comparison with NaN is false, so a scattered ``if lr <= 0`` lets NaN through to
    the optimizer. Each float flag declares its domain once, next to its help, in interval
    notation (``"(0, inf)"``, ``"[0, 1)"``); ``validate.py`` walks them all
    (``domain_errors``) and ``docs/flags.md`` prints them. An infinite end is always open: no
    float flag takes an infinite value.
    """

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool

    @classmethod
    def parse(cls, text: str) -> "Domain":
        m = re.fullmatch(r"\s*([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])\s*", text)
        if not m:
            raise ValueError(f"domain {text!r}: write an interval such as '(0, inf)' or '[0, 1)'")
        lo, hi = float(m.group(2)), float(m.group(3))
        if not lo < hi or math.isnan(lo) or math.isnan(hi):
            raise ValueError(f"domain {text!r} is empty")
        return cls(lo, hi, m.group(1) == "(" or math.isinf(lo), m.group(4) == ")" or math.isinf(hi))

    def __str__(self) -> str:
        def end(v: float) -> str:
            return "inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:g}"
        return f"{'(' if self.lo_open else '['}{end(self.lo)}, {end(self.hi)}{')' if self.hi_open else ']'}"

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


def flag(default: Any, help: str, *, choices: tuple | None = None, type: Any = None,
         aliases: tuple[str, ...] = (), metavar: str | tuple[str, ...] | None = None,
         nargs: str | int | None = None,
         domain: str | None = None):
    """Declare a config field together with its command-line flag (a float flag: with its ``domain``)."""
    meta = {"help": help, "choices": choices, "type": type, "aliases": aliases,
            "metavar": metavar, "nargs": nargs, "domain": Domain.parse(domain) if domain else None}
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(type_copy, default), metadata=meta)
    return field(default=default, metadata=meta)


def type_copy(value):
    return list(value) if isinstance(value, list) else dict(value)


def parse_duration(text: str | int | float | None) -> Optional[float]:
    """'7d', '12h', '90m', '45s' or a plain number of seconds -> seconds."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    s = str(text).strip().lower()
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    try:
        if s and s[-1] in units:
            return float(s[:-1]) * units[s[-1]]
        return float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration; write e.g. 7d, 12h, 90m or a number of seconds") from None


def engine_url(address: str) -> str:
    """A server address: slime's ``host:port`` (``--rollout-external-engine-addrs``) as ``http://host:port``,
    a URL with a scheme as given."""
    address = str(address)
    return address if "://" in address else f"http://{address}"


# --rm-type's choices: the names of rollout.rewards.BUILTIN_REWARDS (tests/rollout/test_rewards.py keeps them equal)
BUILTIN_REWARD_NAMES = ("exact_match", "math", "deepscaler", "f1", "boxed_exact_match", "boxed_f1", "code",
                        "gsm8k", "verl_math", "math_dapo", "verl")


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: Optional[str] = flag(None, "HF model directory (config.json + safetensors). The model "
                                        "architecture, tokenizer and initial weights come from here.")
    seq_length: Optional[int] = flag(None, "Longest prompt+response the trainer must hold; defaults to "
                                     "--rollout-max-prompt-len + --rollout-max-response-len.")
    freeze_vision_tower: bool = flag(False, "A vision-language --hf-checkpoint: train the language model only; the "
                                     "vision tower and merger get no gradient and no optimizer state, and every "
                                     "weight sync after the first sends the language model alone (the engine keeps "
                                     "the tower the first one sent). Not with --offload-rollout / --colocate "
                                     "(a released engine needs every tensor back). docs/vlm.md.")


@dataclass(frozen=True)
class LoraConfig:
    lora_rank: int = flag(0, "LoRA rank r (0: off, full fine-tuning). On: adapters as HF PEFT's on the linears of "
                          "--lora-target-modules, the base model frozen (no gradient, optimizer state or master "
                          "copy), the KL reference = the base model (the initial adapters: B starts at zero), the "
                          "engine synced with the adapters merged into the weights (docs/lora.md). Megatron "
                          "backend, local layer spec (CPU, or GPUs without transformer-engine).")
    lora_alpha: float = flag(8.0, "LoRA alpha: the adapter output is scaled by alpha / rank (PEFT's lora_alpha). "
                             "Recommended: 2 x --lora-rank, with --lr about 1-2x the full fine-tuning one and "
                             "--lora-modules-to-save embed_tokens (docs/lora.md, the sweep).", domain="(0, inf)")
    lora_dropout: float = flag(0.0, "Dropout on the adapters' input (PEFT's lora_dropout).", domain="[0, 1)")
    lora_target_modules: list = flag(["all-linear"], "HF module names to adapt (PEFT's target_modules): any of "
                                     "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (or a dotted suffix), "
                                     "or all-linear. MoE expert linears and multi-latent attention are refused.",
                                     type=str, nargs="+", metavar="NAME")
    lora_modules_to_save: list = flag([], "HF modules trained in full beside the adapters (PEFT's modules_to_save; "
                                      "TRL's lora_modules_to_save), by PEFT's rule: a module whose name ends with "
                                      "NAME, e.g. embed_tokens (the embedding; with tied embeddings the output "
                                      "layer too), lm_head (an untied output layer), norm (every norm). Their "
                                      "optimizer state, checkpoint entries and syncs are as the adapters'; the "
                                      "PEFT export holds their full tensors. Linears are targets, not modules to "
                                      "save (docs/lora.md).", type=str, nargs="+", metavar="NAME")
    lora_load: Optional[str] = flag(None, "Start the adapters from a HF PEFT dir (adapter_config.json + "
                                    "adapter_model.safetensors, e.g. convert_ckpt.py dist-to-peft's output) instead "
                                    "of PEFT's initialisation; its r, lora_alpha and target modules must equal the "
                                    "--lora-* flags. The KL reference is then the base model plus this adapter (the "
                                    "initial policy).", metavar="DIR")
    lora_sync: str = flag("merged", "What each weight sync sends the rollout engine in a LoRA run: merged (the whole "
                          "model with W + alpha/r B A folded in) or adapter (the adapter tensors and their config "
                          "only; the engine keeps the targeted base weights, sent once on the first sync, and merges "
                          "them itself). adapter: the embedded engine with --update-weight-transport tensor or disk "
                          "(a PEFT dir per version); refused with SGLang engines (docs/lora.md).",
                          choices=("merged", "adapter"))


def parse_moe_layer_freq(text):
    """Megatron-LM's ``--moe-layer-freq``: ``N`` (every N-th layer is MoE, counting from layer 0)
    or a Python list expression of 0/1 per layer (``"[1, 1, 0]"``, ``"([0]*3+[1]*45)"``).

    Evaluated with a small AST walker (lists of ints, ``*`` by an int, ``+`` of lists), never
    ``eval``: a launch script is data, not code.
    """
    import ast

    if isinstance(text, (int, list)) and not isinstance(text, bool):
        return text
    src = str(text).strip()
    if src.isdigit():
        return int(src)

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.List):
            return [walk(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = walk(node.left), walk(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(ast.dump(node)[:60])

    try:
        value = walk(ast.parse(src, mode="eval"))
    except (SyntaxError, ValueError, TypeError):
        value = None
    if not (isinstance(value, int) or (isinstance(value, list) and all(v in (0, 1) for v in value))):
        raise ValueError(f"{text!r} is not a MoE layer frequency; write N (every N-th layer) or a list of "
                         "0/1 per layer, e.g. \"[1, 1, 1]\" or \"([0]*1+[1]*47)\"")
    return value


_CHECKED = "Checked against --hf-checkpoint's config.json (which builds the model); a mismatch is refused."


@dataclass(frozen=True)
class ArchitectureConfig:
    """Megatron-LM's model-architecture flags (a slime ``MODEL_ARGS``). The HF config builds the
    model; these are accepted so launch scripts run unchanged, compared with config.json so a
    wrong value is refused instead of silently describing another model, and used for the
    plan by ``--dry-run`` where the checkpoint is not on this machine (config/architecture.py)."""

    num_layers: Optional[int] = flag(None, "Transformer layers (config.json num_hidden_layers). " + _CHECKED)
    hidden_size: Optional[int] = flag(None, "Hidden size (hidden_size). " + _CHECKED)
    ffn_hidden_size: Optional[int] = flag(None, "Dense MLP hidden size (intermediate_size). " + _CHECKED)
    num_attention_heads: Optional[int] = flag(None, "Attention heads (num_attention_heads). " + _CHECKED)
    group_query_attention: bool = flag(False, "Grouped-query attention with --num-query-groups groups (Megatron: "
                                       "without it --num-query-groups is ignored, with it the default is 1). "
                                       + _CHECKED)
    num_query_groups: Optional[int] = flag(None, "KV head groups (num_key_value_heads); needs "
                                           "--group-query-attention, as in Megatron-LM. " + _CHECKED)
    kv_channels: Optional[int] = flag(None, "Head dimension (head_dim, default hidden_size / heads); an MLA model "
                                      "does not read it (--qk-head-dim / --v-head-dim size its heads). " + _CHECKED)
    vocab_size: Optional[int] = flag(None, "Vocabulary size; megatron pads it to a multiple of 128 x TP, so "
                                     "it must equal config.json's vocab_size or pad to the same size. " + _CHECKED)
    swiglu: bool = flag(False, "SwiGLU MLP (hidden_act silu, gated; gpt_oss's clamped quick-GELU GLU is not "
                        "SwiGLU). " + _CHECKED)
    normalization: Optional[str] = flag(None, "Norm type (RMSNorm when config.json has rms_norm_eps). " + _CHECKED,
                                        choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: Optional[float] = flag(None, "Norm epsilon (rms_norm_eps). " + _CHECKED, domain="(0, inf)")
    rotary_base: Optional[float] = flag(None, "RoPE base (rope_theta). " + _CHECKED, domain="(0, inf)")
    rotary_percent: Optional[float] = flag(None, "Fraction of the head dim rotated (partial_rotary_factor, "
                                           "default 1). " + _CHECKED, domain="(0, 1]")
    position_embedding_type: Optional[str] = flag(None, "Position embedding (the supported families use "
                                                  "rope; gpt_oss with YaRN: yarn). " + _CHECKED,
                                                  choices=("learned_absolute", "rope", "mrope", "yarn", "none"))
    use_rotary_position_embeddings: bool = flag(False, "Megatron-LM's older spelling of "
                                                "--position-embedding-type rope. " + _CHECKED)
    disable_bias_linear: bool = flag(False, "No bias in the linear layers (config.json mlp_bias false). "
                                     + _CHECKED)
    add_qkv_bias: bool = flag(False, "Bias on the q/k/v projections (Qwen2; attention_bias of GLM). " + _CHECKED)
    qk_layernorm: bool = flag(False, "RMSNorm on q and k per head (Qwen3; GLM use_qk_norm). " + _CHECKED)
    attention_output_gate: bool = flag(False, "Gated full attention: q_proj also gives a per-head gate and the "
                                       "attention output is multiplied by its sigmoid (Qwen3-Next, Qwen3.5; "
                                       "--use-gated-attention is slime's name for it). " + _CHECKED,
                                       aliases=("--use-gated-attention",))
    max_position_embeddings: Optional[int] = flag(None, "Longest position the model is built for "
                                                  "(max_position_embeddings). " + _CHECKED)
    no_position_embedding: bool = flag(False, "No learned absolute position embedding (Megatron-LM's "
                                       "add_position_embedding false): true of every family built here (each "
                                       "encodes positions in attention: RoPE or YaRN), so the flag restates the "
                                       "model.")
    make_vocab_size_divisible_by: Optional[int] = flag(
        None, "Megatron-LM's vocab padding multiple (x TP) for --vocab-size: the vocab check pads both sizes by it. "
        "The embedding here is padded to a multiple of 128 x TP whatever it says; the padding rows are sliced off "
        "before every softmax, so no result depends on it.")
    spec: Optional[list] = flag(None, "slime's custom layer spec, MODULE FUNCTION (its Qwen3-Next and Qwen3.5 "
                                "plugins): here config.json's model_type picks the bridge that builds the layers, "
                                "so the spec must name slime's plugin for that same family (a mismatch, or a spec "
                                "of a family no bridge builds, is refused). " + _CHECKED,
                                type=str, nargs=2, metavar=("MODULE", "FUNCTION"))
    apply_layernorm_1p: bool = flag(False, "Zero-centred norm gains, x / rms(x) * (1 + w) (Qwen3-Next, Gemma 3). "
                                    + _CHECKED)
    untie_embeddings_and_output_weights: bool = flag(False, "Separate output layer (tie_word_embeddings "
                                                     "false). " + _CHECKED)
    num_experts: Optional[int] = flag(None, "MoE experts (num_experts / num_local_experts / n_routed_experts). "
                                      + _CHECKED)
    moe_ffn_hidden_size: Optional[int] = flag(None, "Expert MLP hidden size (moe_intermediate_size; Mixtral: "
                                              "intermediate_size). " + _CHECKED)
    moe_router_topk: Optional[int] = flag(None, "Experts per token (num_experts_per_tok). " + _CHECKED)
    moe_layer_freq: Optional[str] = flag(None, "Which layers are MoE: N (every N-th) or a 0/1 list per layer "
                                         "(config.json decoder_sparse_step / mlp_only_layers / "
                                         "first_k_dense_replace). " + _CHECKED,
                                         type=parse_moe_layer_freq)
    moe_router_score_function: Optional[str] = flag(None, "Router score function (sigmoid for glm4_moe, softmax "
                                                    "for the other MoE families). " + _CHECKED,
                                                    choices=("softmax", "sigmoid"))
    moe_shared_expert_intermediate_size: Optional[int] = flag(
        None, "Size of the always-on shared expert(s) (n_shared_experts x moe_intermediate_size; Qwen3-Next "
        "shared_expert_intermediate_size; 0: none). " + _CHECKED)
    moe_shared_expert_gate: bool = flag(False, "The shared expert's output times a sigmoid gate of the layer input "
                                        "(Qwen3-Next shared_expert_gate). " + _CHECKED)
    moe_router_pre_softmax: bool = flag(False, "Softmax router: softmax over all experts before the top-k, "
                                        "weights not renormalised (config.json norm_topk_prob false); a sigmoid "
                                        "router does not read it. " + _CHECKED)
    moe_router_enable_expert_bias: bool = flag(False, "Sigmoid router's selection-only expert bias "
                                               "(e_score_correction_bias: glm4_moe, deepseek_v3). " + _CHECKED)
    moe_router_topk_scaling_factor: Optional[float] = flag(None, "Scale of the routed experts' weights "
                                                           "(routed_scaling_factor; 1 for softmax routers). "
                                                           + _CHECKED, domain="(0, inf)")
    moe_router_num_groups: Optional[int] = flag(None, "Expert groups of the group-limited top-k (n_group). "
                                                + _CHECKED)
    moe_router_group_topk: Optional[int] = flag(None, "Groups each token may route to (topk_group); needs "
                                                "--moe-router-num-groups. " + _CHECKED)
    rotary_scaling_factor: Optional[float] = flag(None, "RoPE scaling factor (rope_scaling factor, e.g. YaRN's; "
                                                  "1: no scaling). " + _CHECKED, domain="(0, inf)")
    multi_latent_attention: bool = flag(False, "Multi-latent attention (deepseek_v3: q/kv latents, decoupled "
                                        "RoPE). " + _CHECKED)
    q_lora_rank: Optional[int] = flag(None, "MLA query latent rank (q_lora_rank; null: a plain q_proj). "
                                      + _CHECKED)
    kv_lora_rank: Optional[int] = flag(None, "MLA key/value latent rank (kv_lora_rank). " + _CHECKED)
    qk_head_dim: Optional[int] = flag(None, "MLA query/key head size without RoPE (qk_nope_head_dim). "
                                      + _CHECKED)
    qk_pos_emb_head_dim: Optional[int] = flag(None, "MLA query/key RoPE head size (qk_rope_head_dim). "
                                              + _CHECKED)
    v_head_dim: Optional[int] = flag(None, "MLA value head size (v_head_dim). " + _CHECKED)
    mscale: Optional[float] = flag(None, "MLA YaRN mscale (rope_scaling mscale; not read without YaRN). "
                                   + _CHECKED, domain="[0, inf)")
    mscale_all_dim: Optional[float] = flag(None, "MLA YaRN mscale_all_dim (rope_scaling mscale_all_dim; not read "
                                           "without YaRN). " + _CHECKED, domain="[0, inf)")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = flag(1, "Tensor-parallel size (TP) of the training model.")
    pipeline_model_parallel_size: int = flag(1, "Pipeline-parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = flag(
        None, "Virtual pipeline stages per PP rank (interleaved schedule); needs PP > 1.")
    context_parallel_size: int = flag(1, "Context-parallel size (CP): each sequence is split over CP ranks.")
    expert_model_parallel_size: int = flag(1, "Expert-parallel size (EP) for MoE models.")
    expert_tensor_parallel_size: Optional[int] = flag(
        None, "Tensor-parallel size inside each expert (ETP); defaults to TP as in megatron-core.")
    sequence_parallel: bool = flag(False, "Shard norm/dropout activations over the TP group. With "
                                   "--tensor-model-parallel-size 1 there is nothing to shard over: it has no effect "
                                   "(as in Megatron-LM, which turns it off there) and start-up logs that.")
    decoder_first_pipeline_num_layers: Optional[int] = flag(
        None, "Layers on the first pipeline stage (uneven PP; TransformerConfig.num_layers_in_first_pipeline_stage); "
        "the stages without a size of their own split the rest evenly.")
    decoder_last_pipeline_num_layers: Optional[int] = flag(
        None, "Layers on the last pipeline stage (uneven PP; TransformerConfig.num_layers_in_last_pipeline_stage); "
        "the stages without a size of their own split the rest evenly.")
    critic_tensor_model_parallel_size: Optional[int] = flag(
        None, "--advantage-estimator ppo: the critic's own tensor-parallel size on the actor's ranks (its data-"
        "parallel size is then ranks / (TP x PP)); unset: the actor's. Sequence parallelism follows "
        "--sequence-parallel. slime: the critic role's tensor_model_parallel_size in --megatron-config-path.")
    critic_pipeline_model_parallel_size: Optional[int] = flag(
        None, "--advantage-estimator ppo: the critic's own pipeline-parallel size on the actor's ranks; unset: the "
        "actor's.")
    distributed_timeout_minutes: float = flag(
        10.0, "Megatron-LM's: minutes a collective of the training ranks waits for a rank (every process group "
        "they make: the default, megatron's, the weight sync's agreement). A rank that does not answer a step's "
        "train, weight sync, checkpoint save or resume within it ends the run naming that rank, its host and pid "
        "(a roll call of at most one more bound; docs/checkpoints.md, 'Every wait is bounded').",
        domain="(0, inf)")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = flag("adam", "Optimizer.", choices=("adam", "sgd"))
    lr: float = flag(1e-6, "Peak learning rate.", domain="(0, inf)")
    min_lr: float = flag(0.0, "Learning rate floor for decaying schedules.", domain="[0, inf)")
    lr_decay_style: str = flag("constant", "Learning-rate schedule after warm-up.",
                               choices=("constant", "linear", "cosine", "inverse-square-root"))
    lr_warmup_iters: int = flag(0, "Optimizer steps of linear warm-up from 0 to --lr.")
    lr_decay_iters: Optional[int] = flag(None, "Optimizer steps over which the LR decays (default: all steps).")
    weight_decay: float = flag(0.0, "Decoupled weight decay.", domain="[0, inf)")
    adam_beta1: float = flag(0.9, "Adam beta1.", domain="[0, 1)")
    adam_beta2: float = flag(0.98, "Adam beta2.", domain="[0, 1)")
    adam_eps: float = flag(1e-8, "Adam epsilon.", domain="(0, inf)")
    grad_clip: float = flag(1.0, "Clip the global gradient norm to this value (0 disables).",
                            aliases=("--clip-grad",), domain="[0, inf)")
    use_distributed_optimizer: bool = flag(False, "Shard optimizer state over data-parallel ranks (ZeRO-1). "
                                           "Implied by --optimizer-cpu-offload.")
    optimizer_cpu_offload: bool = flag(False, "Keep optimizer state and step on the CPU. megatron: "
                                       "megatron-core's hybrid device optimizer; implies "
                                       "--use-distributed-optimizer (which Megatron-LM requires with it and "
                                       "slime always sets) and needs --use-precision-aware-optimizer, as in "
                                       "Megatron-LM; docs/optimizer.md. fsdp: FSDP2's CPUOffloadPolicy (sharded "
                                       "parameters, gradients and optimizer state in host memory).")
    optimizer_offload_fraction: float = flag(1.0, "Fraction of the optimizer state megatron-core's hybrid "
                                             "optimizer keeps on the CPU with --optimizer-cpu-offload "
                                             "(0 < f <= 1; only 1.0 on a CPU-only machine).", domain="(0, 1]")
    use_precision_aware_optimizer: bool = flag(False, "Let the optimizer own the master weights "
                                               "(megatron-core precision-aware optimizer): transformer-engine's "
                                               "FusedAdam on a GPU, or the hybrid optimizer with "
                                               "--optimizer-cpu-offload.")
    critic_lr: Optional[float] = flag(None, "Peak learning rate of the critic (--advantage-estimator ppo); unset: "
                                      "--lr. Its schedule is --lr-decay-style's, with its own warm-up.",
                                      domain="(0, inf)")
    critic_lr_warmup_iters: int = flag(0, "Optimizer steps of linear warm-up of the critic's learning rate.")
    overlap_cpu_optimizer_d2h_h2d: bool = flag(False, "With --optimizer-cpu-offload: overlap the GPU<->CPU "
                                               "copies of the hybrid optimizer with its step on CUDA streams "
                                               "(OptimizerConfig.overlap_cpu_optimizer_d2h_h2d; needs a GPU).")

    @property
    def effective_distributed_optimizer(self) -> bool:
        """The distributed optimizer is on: asked for, or implied by --optimizer-cpu-offload."""
        return self.use_distributed_optimizer or self.optimizer_cpu_offload


@dataclass(frozen=True)
class BatchingConfig:
    rollout_batch_size: int = flag(32, "Prompts per rollout step.")
    n_samples_per_prompt: int = flag(8, "Responses sampled per prompt (the GRPO group size).")
    global_batch_size: Optional[int] = flag(
        None, "Samples per optimizer step; default: all samples of a rollout in one step "
        "(rollout-batch-size x n-samples-per-prompt), or that split by --num-steps-per-rollout.")
    num_steps_per_rollout: Optional[int] = flag(
        None, "Optimizer steps per rollout, as slime: the global batch is rollout-batch-size x "
        "n-samples-per-prompt / N (it must divide; with --global-batch-size too, both must agree).")
    micro_batch_size: int = flag(1, "Samples per micro-batch when --use-dynamic-batch-size is off.")
    use_dynamic_batch_size: bool = flag(False, "Pack samples into micro-batches by token count "
                                        "(--max-tokens-per-gpu) instead of a fixed sample count.")
    max_tokens_per_gpu: Optional[int] = flag(None, "Token budget of one packed micro-batch on one GPU "
                                             "(needs --use-dynamic-batch-size).")
    balance_data: bool = flag(False, "slime's token balancing over data-parallel ranks: with "
                              "--use-dynamic-batch-size the packer always splits each step's samples over DP ranks "
                              "with near-equal token counts (Karmarkar-Karp, data/packing.py), so this restates it; "
                              "refused without --use-dynamic-batch-size (fixed micro-batches are split by position, "
                              "as Megatron's sampler does).")
    log_probs_chunk_size: Optional[int] = flag(
        None, "Tokens per chunk when computing log-probs/entropy: the output projection runs this many loss rows "
              "at a time, forward and backward, so it bounds the logits and the fp32 working set (unset: as many "
              "rows as fit 64 MiB of fp32 logits of this rank's vocab shard, 110 at a 151,936 vocab).")

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def effective_global_batch_size(self) -> int:
        if self.global_batch_size:
            return self.global_batch_size
        if self.num_steps_per_rollout:
            return max(1, self.samples_per_rollout // self.num_steps_per_rollout)
        return self.samples_per_rollout

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.samples_per_rollout // self.effective_global_batch_size


@dataclass(frozen=True)
class MemoryConfig:
    recompute_granularity: Optional[str] = flag(None, "Activation recomputation.", choices=("full", "selective"))
    recompute_method: Optional[str] = flag(None, "With full recompute: which layers.", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag(None, "With full recompute: layers per recompute unit.")
    colocate: bool = flag(False, "Run the rollout engine on the training GPUs (implies offloading both sides).")
    offload_train: bool = flag(False, "Release the trainer's GPU memory while the rollout engine runs.")
    offload_rollout: bool = flag(False, "Release the rollout engine's GPU memory while training.")
    offload_train_groups: str = flag(
        "auto", "With --offload-train/--colocate (megatron backend): also destroy the trainer's process groups "
        "(their NCCL communicators' GPU memory) while the engine generates, and rebuild them before training. "
        "auto: off. On CPU gloo groups hold no device memory; on GPUs the teardown has run over gloo only, never "
        "on NCCL, so it stays off until scripts/gpu_check.sh has verified it there (the log says so). "
        "on: do it (GPU: frees the communicators' memory; CPU: the same teardown over gloo, costs their rebuild "
        "each step). off: keep them.",
        choices=("auto", "on", "off"))
    ref_weights_location: str = flag(
        "auto", "Where the frozen reference/teacher weight copies live. device: beside the parameters, so each "
        "reference forward's swap (actor out, reference in, actor back) runs at device-memory speed, for one "
        "more copy of this rank's parameters in GPU memory. host: pinned CPU memory, the swap crosses PCIe "
        "three times per reference forward. auto: device when that copy takes at most a quarter of the GPU memory "
        "free once model and optimizer exist (logged), host otherwise and always with --offload-train/"
        "--colocate. On a CPU-only run both are host memory.", choices=("auto", "device", "host"))
    gpu_type: str = flag(
        "H100-80G", "The training GPU --dry-run compares its memory estimate with (parameters, gradient buffers, "
        "optimizer state, activations per rank, the engines' GPUs; docs/planner.md): its memory is the total "
        "nvidia-smi reports, A100-80G 80 GiB, H100-80G 79.6, H200-141G 140.4, B200-192G 179.1. A real run on GPUs "
        "compares with the card it finds unless --gpu-memory-gib is given.",
        choices=("A100-80G", "H100-80G", "H200-141G", "B200-192G"))
    gpu_memory_gib: Optional[float] = flag(None, "The training GPU's memory in GiB for the memory estimate "
                                           "(--dry-run, and a real run on GPUs), instead of --gpu-type's.",
                                           domain="(0, inf)")
    allow_over_memory: bool = flag(False, "Go on when the memory estimate says a GPU does not fit (--dry-run and a "
                                   "real run on GPUs refuse such a plan with exit 2, naming the component, rank, "
                                   "shortfall and the ranked fixes); the run then starts with a warning line.")

    # slime semantics: --colocate implies both offloads. Derived, never written back.
    @property
    def effective_offload_train(self) -> bool:
        return self.offload_train or self.colocate

    @property
    def effective_offload_rollout(self) -> bool:
        return self.offload_rollout or self.colocate


@dataclass(frozen=True)
class PrecisionConfig:
    train_backend: str = flag("megatron", "Training backend.", choices=("megatron", "fsdp"))
    bf16: bool = flag(False, "Train in bf16 with fp32 master weights.")
    fp16: bool = flag(False, "Train in fp16 with loss scaling (dynamic unless --loss-scale; a step whose "
                      "gradients overflow is skipped and the scale backs off).")
    loss_scale: Optional[float] = flag(None, "With --fp16: a constant loss scale instead of the dynamic one "
                                       "(OptimizerConfig.loss_scale).", domain="(0, inf)")
    initial_loss_scale: float = flag(2.0 ** 32, "With --fp16: the dynamic loss scale's start "
                                     "(OptimizerConfig.initial_loss_scale, Megatron-LM's default).", domain="(0, inf)")
    min_loss_scale: float = flag(1.0, "With --fp16: the dynamic loss scale never backs off below this "
                                 "(OptimizerConfig.min_loss_scale).", domain="(0, inf)")
    loss_scale_window: int = flag(1000, "With --fp16: steps without overflow before the dynamic loss scale "
                                  "doubles (OptimizerConfig.loss_scale_window).")
    hysteresis: int = flag(2, "With --fp16: overflowing steps tolerated before the dynamic loss scale halves; "
                           "reset when it grows (OptimizerConfig.hysteresis).")
    fp8_format: Optional[str] = flag(None, "FP8 training through transformer-engine (TransformerConfig.fp8): "
                                     "e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients).",
                                     choices=("e4m3", "hybrid"))
    fp8_recipe: str = flag("delayed", "FP8 scaling recipe (TransformerConfig.fp8_recipe; needs --fp8-format). "
                           "mxfp8 is Blackwell-only.", choices=("delayed", "tensorwise", "mxfp8", "blockwise"))
    fp8_margin: int = flag(0, "Scaling-factor margin of the delayed recipe (TransformerConfig.fp8_margin).")
    fp8_amax_history_len: int = flag(1, "amax history window of the delayed recipe "
                                     "(TransformerConfig.fp8_amax_history_len).")
    fp8_amax_compute_algo: str = flag("most_recent", "How the delayed recipe picks amax from its history "
                                      "(TransformerConfig.fp8_amax_compute_algo).", choices=("most_recent", "max"))
    fp8_param_gather: bool = flag(False, "Keep GEMM weights in FP8 and all-gather them in FP8 "
                                  "(TransformerConfig.fp8_param + DDP fp8_param_gather; needs "
                                  "--use-distributed-optimizer).")

    @property
    def params_dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-LM training knobs, each mapped onto megatron-core's TransformerConfig, DDP or
    optimizer config by the registry in config/megatron_flags.py (which also says what each
    one needs on this machine: a real run refuses a flag that cannot take effect here)."""

    attention_dropout: Optional[float] = flag(None, "Attention dropout (TransformerConfig.attention_dropout). "
                                              "Unset: config.json's attention_dropout (0 for the supported "
                                              "families), not Megatron-LM's 0.1.", domain="[0, 1)")
    hidden_dropout: Optional[float] = flag(None, "Hidden-state dropout (TransformerConfig.hidden_dropout). "
                                           "Unset: 0, not Megatron-LM's 0.1.", domain="[0, 1)")
    attention_softmax_in_fp32: bool = flag(False, "Attention softmax in fp32 "
                                           "(TransformerConfig.attention_softmax_in_fp32); always on here.")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, "Accumulate and all-reduce gradients in fp32 "
                                                    "(DDP grad_reduce_in_fp32); always on here.")
    calculate_per_token_loss: bool = flag(False, "Megatron's per-token loss normalisation "
                                          "(TransformerConfig.calculate_per_token_loss); always on here: losses "
                                          "are normalised by the step's global token count (--loss-agg-mode).")
    attention_backend: str = flag("auto", "Attention kernel (TransformerConfig.attention_backend): flash, "
                                  "fused and unfused pick transformer-engine's kernels (GPU with TE); local is "
                                  "the torch attention used without TE; auto lets the layer spec choose.",
                                  choices=("flash", "fused", "unfused", "local", "auto"))
    deterministic_mode: bool = flag(False, "Deterministic kernels (TransformerConfig.deterministic_mode); with "
                                    "transformer-engine it needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0.")
    moe_router_dtype: Optional[str] = flag(None, "Router logits dtype (TransformerConfig.moe_router_dtype); "
                                           "unset: fp32.", choices=("fp32", "fp64"))
    moe_token_dispatcher_type: Optional[str] = flag(None, "MoE token dispatcher "
                                                    "(TransformerConfig.moe_token_dispatcher_type); unset: "
                                                    "alltoall, the one megatron-core allows with packed "
                                                    "variable-length sequences.",
                                                    choices=("allgather", "alltoall", "flex"))
    moe_grouped_gemm: bool = flag(False, "Grouped-GEMM experts (TransformerConfig.moe_grouped_gemm).")
    moe_enable_deepep: bool = flag(False, "DeepEP all-to-all for the flex dispatcher "
                                   "(TransformerConfig.moe_enable_deepep; needs --moe-token-dispatcher-type flex, "
                                   "DeepEP and GPUs).")
    moe_permute_fusion: bool = flag(False, "Fused token permutation (TransformerConfig.moe_permute_fusion; "
                                    "transformer-engine >= 2.1 on a GPU).")
    moe_aux_loss_coeff: Optional[float] = flag(None, "Load-balancing aux loss coefficient "
                                               "(TransformerConfig.moe_aux_loss_coeff; 0 turns the aux loss "
                                               "off). Unset: config.json's router_aux_loss_coef.", domain="[0, inf)")
    moe_router_load_balancing_type: Optional[str] = flag(
        None, "Load-balancing loss type (TransformerConfig.moe_router_load_balancing_type). aux_loss and none "
        "as megatron-core; seq_aux_loss and global_aux_loss only with --moe-aux-loss-coeff 0 (slime's scripts: "
        "no loss), since over packed micro-batches megatron-core's sequence loss sees one sequence per "
        "micro-batch; sinkhorn is refused (it routes training tokens differently from the engine's top-k).",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    moe_router_bias_update_rate: Optional[float] = flag(
        None, "Aux-loss-free update rate of a sigmoid router's expert bias "
        "(TransformerConfig.moe_router_bias_update_rate). Unset: 0, the bias stays config.json's "
        "e_score_correction_bias as in slime's scripts; a non-zero rate is refused (not verified here yet).",
        domain="[0, inf)")
    no_rope_fusion: bool = flag(False, "Unfused RoPE (TransformerConfig.apply_rope_fusion false): always so here, "
                                "megatron-core's default, which this build never changes.")
    no_gradient_accumulation_fusion: bool = flag(
        False, "Unfused weight-gradient accumulation (TransformerConfig.gradient_accumulation_fusion false): always "
        "so here, megatron-core's default, which this build never changes.")
    transformer_impl: Optional[str] = flag(
        None, "Megatron-LM's layer implementation (TransformerConfig.transformer_impl). This build picks it by "
        "what is installed: the transformer-engine spec where transformer-engine is, the local spec where it is "
        "not; the flag states which one, and a real run where the other is built is refused.",
        choices=("local", "transformer_engine"))
    no_masked_softmax_fusion: bool = flag(False, "Unfused masked softmax (TransformerConfig.masked_softmax_fusion "
                                          "false): always so here, megatron-core's default, which this build never "
                                          "changes.")
    no_check_for_nan_in_loss_and_grad: bool = flag(
        False, "No NaN check of the gradients (DistributedDataParallelConfig.check_for_nan_in_grad false): always so "
        "here, megatron-core's default, which this build never changes (a NaN loss shows in the step's metrics).")
    use_routing_replay: bool = flag(False, "MoE routing replay (R2): record each token's experts in the "
                                    "old-log-prob pass and replay them in the reference pass and in training "
                                    "(forward and activation recompute), so the PPO ratio compares the same "
                                    "experts (megatron-core RouterReplay; metric train/route_agreement). MoE "
                                    "models, --train-backend megatron.")
    use_rollout_routing_replay: bool = flag(False, "MoE routing replay of the rollout engine's routes (R3): the "
                                            "engine records each token's experts and the old-log-prob, reference "
                                            "and training forwards (and activation recompute) replay them, so the "
                                            "trainer computes with the experts the rollout used (metric "
                                            "train/route_agreement: how often its own router agrees). The "
                                            "embedded engine records them; SGLang engines return them "
                                            "(--enable-return-routed-experts, added by the launcher). MoE "
                                            "models, --train-backend megatron.")
    moe_token_drop_policy: Optional[str] = flag(None, "Which tokens an over-capacity expert drops "
                                                "(TransformerConfig.moe_token_drop_policy). No expert capacity "
                                                "is set here, so nothing is dropped: only probs (the default) "
                                                "is accepted.", choices=("probs", "position"))
    mtp_num_layers: Optional[int] = flag(None, "Multi-token-prediction layers (TransformerConfig.mtp_num_layers): "
                                         "the DeepSeek-V3 / GLM-4.5 checkpoint's MTP layers (config.json "
                                         "num_nextn_predict_layers) become megatron-core's MTP block on the last "
                                         "pipeline stage: loaded, frozen (no gradient or optimizer state), "
                                         "checkpointed and exported, so an HF export keeps the draft head SGLang's "
                                         "EAGLE/NextN speculative decoding uses; the weight sync sends them to the "
                                         "embedded engine when it drafts with them (--speculative-algorithm), else "
                                         "leaves them out. 0 or unset: skipped on load, as "
                                         "transformers does. Only 0 or config.json's count.")
    enable_mtp_training: bool = flag(False, "Train the MTP layers with the MTP language-model loss (slime's "
                                     "flag): each depth d's cross-entropy of token t+2+d at the loss-masked "
                                     "response tokens, divided by the step's loss-token count, times "
                                     "--mtp-loss-scaling-factor / --mtp-num-layers, added to the policy loss; only "
                                     "the MTP layers get its gradient (docs/parity.md). Needs --mtp-num-layers; "
                                     "megatron backend at any TP (+SP), PP (the MTP block on the last stage), CP, "
                                     "EP and DP, each equal to one process; an MoE MTP layer routes on its own "
                                     "under routing replay (the engine reports no MTP routes); not with LoRA.")
    mtp_loss_scaling_factor: float = flag(0.2, "Weight of the MTP loss of --enable-mtp-training (slime's default "
                                          "0.2), divided by --mtp-num-layers as megatron does.", domain="[0, inf)")


@dataclass(frozen=True)
class CheckpointConfig:
    load: Optional[str] = flag(None, "Checkpoint root to resume from (torch_dist); defaults to --save when "
                               "that holds a complete checkpoint. A model-only dir from convert_ckpt.py "
                               "hf-to-dist gives the initial weights instead (fresh optimizer, step 0; "
                               "resuming is then from --save).")
    save: Optional[str] = flag(None, "Checkpoint root: iter_NNNNNNN/ dirs, resume_state.json, rollout_ckpts/ "
                               "(the rollout generated right after each kept checkpoint, so a resume from it "
                               "skips regenerating that rollout).")
    save_interval: Optional[int] = flag(None, "Save every N rollout steps (needs --save).")
    save_max_to_keep: Optional[int] = flag(None, "Keep only the newest N checkpoints under --save.")
    no_auto_resume: bool = flag(False, "Start afresh (from --hf-checkpoint) instead of resuming from --save; "
                                "if --save holds checkpoints, --existing-save must say what to do with them.")
    existing_save: Optional[str] = flag(None, "With --no-auto-resume: what to do with checkpoints already under "
                                        "--save, which the fresh run would overwrite and prune: archive moves "
                                        "them to --save/archive_<UTC time>/, discard deletes them. Without it "
                                        "such a start is refused.", choices=("archive", "discard"))
    allow_resume_older: bool = flag(False, "With --load ROOT/iter_N and a --save that holds iterations above N: "
                                    "move those into --save/superseded/ (renamed iter_M.<UTC time>, never deleted) "
                                    "and continue from N. Without it such a start is refused, since the run's "
                                    "saves would overwrite them.")
    ref_load: Optional[str] = flag(None, "Frozen reference weights for the KL term (torch_dist or HF dir); "
                                   "default: the initial policy.")
    opd_teacher_load: Optional[str] = flag(None, "Frozen teacher weights for on-policy distillation (an HF dir or a "
                                           "torch_dist dir; --train-backend fsdp: HF): of the student's shapes a "
                                           "weight tag, of other shapes "
                                           "(a larger teacher, same tokenizer) a frozen model of its own "
                                           "(docs/algorithms.md).")
    critic_hf_checkpoint: Optional[str] = flag(None, "--advantage-estimator ppo: the critic's initial trunk weights "
                                               "(an HF dir, of the policy's architecture or another size or "
                                               "family with a vocabulary holding the policy's ids; its lm_head is "
                                               "not read, the value head starts fresh as slime's). Unset: the "
                                               "actor's initial weights with a fresh value head.")
    critic_load: Optional[str] = flag(None, "--advantage-estimator ppo: the critic's initial trunk weights as a "
                                      "model-only torch_dist dir (what convert_ckpt.py hf-to-dist writes; the value "
                                      "head starts fresh). A run's critic resumes from its --save checkpoints, "
                                      "which hold it beside the actor; slime's separate critic checkpoint dirs do "
                                      "not load. --train-backend megatron only (fsdp: convert it to HF and pass "
                                      "--critic-hf-checkpoint).", metavar="DIR")
    save_hf: Optional[str] = flag(None, "slime's HF export at every save (a path with {rollout_id}). Refused: "
                                  "not built into the run; export a saved checkpoint with tools/convert_ckpt.py "
                                  "dist-to-hf --input SAVE/iter_NNNNNNN --output DIR (slime's "
                                  "tools/convert_torch_dist_to_hf.py works too), or fsdp-to-hf for "
                                  "--train-backend fsdp.", metavar="PATH")
    critic_save: Optional[str] = flag(None, "slime's separate critic save dir. Refused: the critic's model and "
                                      "optimizer go into each --save checkpoint, beside the actor's.", metavar="DIR")


@dataclass(frozen=True)
class RolloutConfig:
    rollout_backend: str = flag("auto", "Rollout engine: embedded (in-process torch engine), or sglang: "
                                "SGLang servers this run launches (python -m sglang.launch_server, placed by "
                                "--colocate / --rollout-num-gpus(-per-engine), configured by --sglang-* flags), "
                                "or servers you run yourself given by --rollout-engine-urls (docs/sglang.md). "
                                "auto: sglang when a flag sizes, configures or names SGLang engines "
                                "(--rollout-num-gpus, --rollout-num-gpus-per-engine other than 1, --sglang-*, "
                                "--rollout-engine-urls), as in slime's scripts; else embedded.",
                                choices=("auto", "embedded", "sglang"))
    rollout_engine_urls: list = flag([], "Running SGLang servers (http://host:port each; a bare host:port is "
                                     "read as http://host:port) to use instead of launching engines; needs "
                                     "--rollout-backend sglang and --update-weight-transport disk or distributed. "
                                     "slime's --rollout-external-engine-addrs HOST:PORT ... is the same flag.",
                                     type=str, nargs="+", metavar="URL",
                                     aliases=("--rollout-external-engine-addrs",))
    rollout_num_gpus: Optional[int] = flag(None, "GPUs for the SGLang engines this run launches (default: the "
                                           "actor's); with --colocate the trainer's own, else the GPUs the trainer "
                                           "leaves free on its nodes; refused with the embedded engine, which runs "
                                           "on the driver rank.")
    rollout_num_gpus_per_engine: int = flag(1, "GPUs per SGLang rollout engine (its tensor-parallel size, "
                                              "--tp-size); the embedded engine is one engine: other values are "
                                              "refused.")
    rollout_engine_python: Optional[str] = flag(None, "Python interpreter that runs sglang.launch_server for the "
                                                "engines this run launches (default: this one); e.g. another "
                                                "venv's bin/python. Validation checks it can import sglang.")
    rollout_engine_startup_timeout: float = flag(600.0, "Seconds the launched SGLang engines get to answer "
                                                 "/health; an engine not up by then, or whose process exits, "
                                                 "stops the run with its log file named.", domain="(0, inf)")
    rollout_generate_timeout: float = flag(600.0, "Seconds the driver waits for an SGLang engine's (or the "
                                           "sglang-router's, or the served embedded engine's) answer to one "
                                           "/generate call; a call not answered by then stops the run naming the "
                                           "server (or, with --use-fault-tolerance, the server is restarted).",
                                           domain="(0, inf)")
    rollout_update_timeout: float = flag(600.0, "Seconds the driver waits for an SGLang engine's (or the served "
                                         "embedded engine's) answer to a weight update, a pause, a memory "
                                         "release or resume, or a LoRA load; also the distributed transport's "
                                         "bound per bucket. A call not answered by then stops the run naming "
                                         "the server and the route.", domain="(0, inf)")
    rollout_router: str = flag("off", "on: an sglang-router in front of the SGLang engines this run launches "
                               "(python -m sglang_router.launch_router from the engines' Python, on the driver's "
                               "node; generation goes through it, one request per sample, weights and pauses to "
                               "each engine). off: round robin by request, a prompt's samples on one engine. The "
                               "router retries a request on another engine when one dies and keeps listing the "
                               "dead one: the engines' processes are checked after every rollout, so the death "
                               "still stops the run naming the engine, or --use-fault-tolerance restarts it.",
                               choices=("on", "off"))
    sglang_server_concurrency: Optional[int] = flag(
        None, "slime's cap on generate requests in flight per SGLang engine (a flag of slime's, not SGLang's: never "
        "passed to the servers). Through an sglang-router (--rollout-router on, or a router among "
        "--rollout-engine-urls) it bounds the per-sample requests in flight: this times the engines (unset: 64 in "
        "all). Without a router each engine gets one batched /generate per call and SGLang's own scheduler bounds "
        "what runs at once (--sglang-max-running-requests), so there it changes nothing.")
    embedded_engine_ranks: str = flag("auto", "Where the embedded engine generates. all: a replica on every "
                                      "rank, each drawing a contiguous part of the rollout's prompts (same seeds "
                                      "per sample as one engine, so the same tokens; log-probs equal to float32 "
                                      "rounding, as a smaller batch's GEMMs may round otherwise), gathered on the "
                                      "driver; "
                                      "costs one model copy per rank. driver: one engine on the driver rank while "
                                      "the others wait. process: one engine in a process of its own that the "
                                      "driver starts on its node (python -m megatron_rl.rollout.embedded_server), "
                                      "spoken to over SGLang's HTTP protocol and synced from disk (under "
                                      "--update-weight-disk-dir, default <--output-dir>/engine_weights), so it "
                                      "generates while the trainer trains: what --async-mode needs with this "
                                      "engine. auto: process with --async-mode one-step or full, else all when the "
                                      "run generates and trains, else driver. Evaluation generates on the driver "
                                      "(or the process). Only for --rollout-backend embedded.",
                                      choices=("auto", "all", "driver", "process"))
    async_mode: str = flag("off", "How generation and training overlap (docs/async.md). off: generate, train, "
                           "sync, in turn. one-step: the driver generates rollout N+1 while every rank trains on "
                           "rollout N (verl's one-step-off-policy, slime's train_async): each rollout after the "
                           "first is generated by the weights one update behind those it is trained on "
                           "(staleness 1); the weights are synced after both finish. Needs engines that do not "
                           "share the trainer's devices (SGLang engines launched on GPUs of their own, or "
                           "--rollout-engine-urls). full: the engines generate prompt groups continuously into "
                           "a bounded buffer and each step trains the --rollout-batch-size earliest-admitted groups "
                           "once they finished; "
                           "admission is paced so no trained token is more than --max-staleness updates old "
                           "(AReaL, verl fully-async); with --partial-rollout a sync pauses the rows in flight and "
                           "they continue on the new weights.",
                           choices=("off", "one-step", "full"))
    max_staleness: Optional[int] = flag(None, "--async-mode full: the most weight updates between a token's "
                                        "generation and the training on it (a sample trained by version t has "
                                        "every token from version >= t - K). The producer paces admission so it "
                                        "holds (untrained groups < (K+1) x --rollout-batch-size); a group that "
                                        "still exceeds it is dropped and counted (rollout/dropped_stale). Default "
                                        "1; at least 1 (0 is --async-mode off).")
    partial_rollout: bool = flag(False, "--async-mode full: a response cut by a weight sync (or by any other "
                                 "abort) continues on the current weights (its tokens so far kept, each with the "
                                 "version and log-prob of the weights that drew it; the rest generated from prompt "
                                 "+ those tokens, the cache computed afresh); without it the response is drawn "
                                 "again from its prompt.")
    pause_generation_mode: str = flag("abort", "--async-mode full --partial-rollout: what a weight sync does to "
                                      "the rows in flight (slime's and SGLang's /pause_generation modes; "
                                      "docs/async.md). abort: the producer aborts them before the sync (they come "
                                      "back with their tokens and are resubmitted after it, prompt + tokens, the "
                                      "cache computed afresh), and generation stops while the weights are exported "
                                      "and written. retract: they stay on the servers, parked while the new weights "
                                      "load, then their cache is recomputed by the new weights (no resubmission). "
                                      "in_place: they stay parked with the KV cache the old weights built and go on "
                                      "over it (no recomputation); the engines generate while the trainer exports "
                                      "and writes the weights, pausing only for the load. Every token keeps the "
                                      "version and log-prob of the weights whose forward drew it either way.",
                                      choices=("abort", "retract", "in_place"))
    async_wait_timeout: float = flag(3600.0, "--async-mode: seconds the trainer waits for its next batch (one-step: "
                                     "the rollout generated meanwhile; full: enough finished groups); past it the "
                                     "run stops naming what it waited for and the engines.", domain="(0, inf)")
    num_rollout: int = flag(100, "Rollout steps to run.")
    rollout_temperature: float = flag(1.0, "Sampling temperature.", domain="[0, inf)")
    rollout_top_p: float = flag(1.0, "Nucleus sampling threshold.", domain="(0, 1]")
    rollout_top_k: int = flag(-1, "Top-k sampling (-1 disables).")
    rollout_max_prompt_len: int = flag(1024, "Prompts longer than this many tokens are refused.")
    rollout_max_response_len: int = flag(1024, "Maximum new tokens per response.")
    rollout_stop_token_ids: list = flag([], "Extra stop token ids (the tokenizer's EOS always stops).",
                                        type=int, nargs="*")
    rollout_seed: int = flag(42, "Base seed for sampling.")
    custom_generate_function_path: Optional[str] = flag(
        None, "Your generation of one prompt group (slime's name; docs/agentic.md), as module:function or "
        "path/to/file.py:function: fn(request, sampling, engine) returns the group's --n-samples-per-prompt "
        "Samples, generating token ids in, token ids + behaviour log-probs + weight versions out through "
        "engine.generate(input_ids, sampling), and may append tokens of its own with loss_mask 0 (tool "
        "observations); def or async def. Runs with every engine, for training and evaluation rollouts. Built-in "
        "multi-turn tool use: megatron_rl.rollout.agent:generate (--tools, --max-turns, --tool-timeout). "
        "slime's async generate(args, sample, sampling_params) -> Sample (first parameter named args) runs "
        "unchanged: called per sample, posting to this run's SGLang-protocol /generate (docs/slime-functions.md).")
    rollout_function_path: Optional[str] = flag(
        None, "Your generation of a whole rollout batch (slime's name; docs/agentic.md), as module:function: "
        "fn(rollout_id, requests, sampling, engine) returns len(requests) x --n-samples-per-prompt Samples, "
        "request-major; rewards, retries of aborted groups and training as for the engine's own samples. "
        "With --async-mode full it is called on --rollout-batch-size prompts at a time, rollout_id numbering the "
        "calls, as many calls running as --max-staleness allows; a call a weight sync cuts runs again whole "
        "(docs/async.md). Excludes --custom-generate-function-path. slime's generate_rollout(args, rollout_id, data_source, "
        "evaluation=False) runs unchanged (docs/slime-functions.md).")
    agent_function_path: Optional[str] = flag(
        None, "Your agent, trained as it talks to an OpenAI-compatible endpoint this run serves (docs/agentic.md), "
        "as module:function or path/to/file.py:function: agent(base_url, task) -> reward, {'reward': reward, ...} "
        "or None (the run's reward scores the session); def or async def, called once per sample. base_url "
        "(http://127.0.0.1:PORT/sessions/ID/v1) serves /v1/chat/completions for an unchanged OpenAI client: "
        "messages rendered with the model's chat template, generated by the rollout engine; the sample trained is "
        "the session's recorded token ids and log-probs, never re-tokenised text (a session whose chat template "
        "re-renders its history, e.g. Qwen3 dropping earlier thinking, splits into branches: one sample each). "
        "Excludes --custom-generate-function-path and --rollout-function-path.")
    tools: Optional[str] = flag(
        None, "The tool loop's tools (megatron_rl.rollout.agent:generate) as module:REGISTRY, a dict of tool name "
        "-> callable(arguments: dict) -> str; default: the built-in calculator (exact integer + - *).",
        metavar="MODULE:REGISTRY")
    max_turns: int = flag(8, "The tool loop: model turns per trajectory at most; a last turn that still calls a "
                          "tool ends the trajectory (finish_reason length) without running it.")
    tool_timeout: float = flag(30.0, "The tool loop: seconds one tool call may take; a slower call becomes an "
                               "error observation and the trajectory goes on.", domain="(0, inf)")
    sandbox_wall_seconds: float = flag(
        10.0, "The sandbox (the python and shell tools of megatron_rl.rollout.agent.sandbox_tools:TOOLS, --rm-type code; "
        "docs/agentic.md): wall-clock seconds one program may run, the sandbox's start included; then its "
        "processes are killed. Below --tool-timeout when the tool loop runs.", domain="(0, 3600]")
    sandbox_cpu_seconds: int = flag(10, "The sandbox: CPU seconds per process of the program (RLIMIT_CPU; "
                                    "SIGXCPU, then SIGKILL a second later).")
    sandbox_memory_mb: int = flag(512, "The sandbox: address space per process in MiB (RLIMIT_AS); an allocation "
                                  "past it fails (Python: MemoryError). The interpreter itself needs some 30.")
    sandbox_file_size_mb: int = flag(16, "The sandbox: largest file the program may write, MiB (RLIMIT_FSIZE).")
    sandbox_disk_mb: int = flag(64, "The sandbox: size of the work directory, a tmpfs that vanishes with the "
                                "program, MiB; the rest of the file system is read-only to it.")
    sandbox_processes: int = flag(32, "The sandbox: processes (and threads) the program may have at once, itself "
                                  "included (RLIMIT_NPROC in the sandbox's own user namespace: a fork bomb's "
                                  "forks fail, also for a root caller).")
    sandbox_open_files: int = flag(64, "The sandbox: open file descriptors per process (RLIMIT_NOFILE).")
    sandbox_output_bytes: int = flag(16384, "The sandbox: bytes of stdout + stderr kept; a program printing more "
                                     "is killed and the first bytes kept (what the model or the reward reads).")
    sandbox_python: Optional[str] = flag(None, "The sandbox: the Python interpreter programs run with; unset: "
                                         "this one when the sandbox's user (nobody, for a root caller) can run "
                                         "it, else python3 on /usr/local/bin:/usr/bin:/bin.", metavar="PATH")
    user_function_timeout: float = flag(
        3600.0, "Seconds one call into your code may take: a --custom-generate-function-path group (its engine "
        "calls included), a --rollout-function-path batch, a --custom-rm-path or --custom-reward-function-path batch of "
        "rewards, a "
        "--dynamic-sampling-filter-path verdict, a --custom-advantage-function-path step. A call still running then, or one that raises, stops the run "
        "with one error line naming the flag, the function and its line (a hung call's thread is left behind: "
        "Python cannot stop one). Tools have --tool-timeout, a reward server --rm-timeout.", domain="(0, inf)")
    rollout_abort_retries: int = flag(2, "A prompt group with a sample the engine aborted (finish_reason abort: "
                                      "cut short by an /abort_request or a pause in abort mode) is generated "
                                      "again, whole, with new seeds, at most this many times; still aborted, the "
                                      "rollout stops naming the prompt and the engine's message. Aborted samples "
                                      "are never trained on. 0: no retry.")
    dynamic_sampling_filter_path: Optional[str] = flag(
        None, "Dynamic sampling (DAPO, docs/agentic.md): a filter judging each prompt group after its rewards, as "
        "module:function, file.py:function or slime's dotted path; fn(args, samples) returns True to keep the group "
        "or slime's DynamicFilterOutput. Prompts are drawn and generated in rounds of --over-sampling-batch-size "
        "until --rollout-batch-size kept groups fill the batch (kept groups beyond it are dropped and counted); "
        "under --async-mode full each group is judged as it finishes and a dropped one never enters the buffer. "
        "Built-in: megatron_rl.rollout.dynamic_sampling:check_reward_nonzero_std (drops groups whose rewards are "
        "all equal; slime's slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std names it "
        "too) and check_reward_nonzero_std_with_fallback.")
    over_sampling_batch_size: Optional[int] = flag(
        None, "Prompts drawn at a time while dynamic sampling fills a batch (default: --rollout-batch-size); "
        "needs --dynamic-sampling-filter-path.")
    dynamic_sampling_max_rounds: int = flag(
        10, "Dynamic sampling: generation rounds one rollout may take to fill its batch; a batch still short "
        "then stops the run naming the filter's reasons (verl's max_num_gen_batches).")
    use_fault_tolerance: bool = flag(False, "Restart a launched SGLang engine whose process dies, sync the "
                                     "current weights into it and generate the failed rollout again (at most 3 "
                                     "restarts a run); with --async-mode full the producer parks instead, its "
                                     "buffer kept, and the groups the death cut are generated again. Without it "
                                     "the run stops naming the engine and its log. Only for engines this run "
                                     "launches.")
    speculative_algorithm: Optional[str] = flag(
        None, "Speculative decoding in rollout with the model's own MTP head as the draft (SGLang's argument): the "
        "embedded engine drafts --speculative-num-steps tokens a round with the checkpoint's MTP layer 0 (a chain, "
        "SGLang's NEXTN; EAGLE runs the same chain here) and verifies them in one target forward; accept/reject as "
        "the target's sampling law requires, so the tokens follow non-speculative sampling and the reported "
        "log-probs are the target's (docs/speculative.md). Needs a checkpoint with MTP layers (config.json "
        "num_nextn_predict_layers) and, with --train-backend megatron, --mtp-num-layers (the weight sync then "
        "carries the MTP layers, trained with --enable-mtp-training). SGLang engines this run launches get the "
        "four --speculative-* arguments on their command line. Metrics: rollout/spec_accept_rate_d{j}.",
        choices=("NEXTN", "EAGLE"))
    speculative_num_steps: int = flag(3, "Draft tokens per speculative round (SGLang's --speculative-num-steps); "
                                      "with --speculative-algorithm.")
    speculative_eagle_topk: int = flag(1, "Draft branches per step (SGLang's --speculative-eagle-topk): 1, a chain "
                                       "(the embedded engine builds no tree); with --speculative-algorithm.")
    speculative_num_draft_tokens: Optional[int] = flag(
        None, "Tokens one verify forward scores (SGLang's --speculative-num-draft-tokens): for a chain "
        "--speculative-num-steps + 1 (the default); with --speculative-algorithm.")
    sglang_args: dict = flag({}, "Pass-through: every --sglang-KEY VALUE flag lands here as {KEY: VALUE} "
                                "for SGLang servers; refused with the embedded engine.")

    def __post_init__(self):
        if any("://" not in str(u) for u in self.rollout_engine_urls):  # slime's host:port form, CLI or YAML
            object.__setattr__(self, "rollout_engine_urls", [engine_url(u) for u in self.rollout_engine_urls])
        if self.rollout_backend == "auto":  # resolved once, here, so every reader sees embedded or sglang
            object.__setattr__(self, "rollout_backend", "sglang" if self.names_sglang_engines else "embedded")

    @property
    def names_sglang_engines(self) -> bool:
        """Whether a flag sizes, configures or names SGLang engines (what --rollout-backend auto follows)."""
        return bool(self.rollout_engine_urls or self.rollout_num_gpus is not None
                    or self.rollout_num_gpus_per_engine != 1 or self.sglang_args
                    or self.sglang_server_concurrency is not None)


@dataclass(frozen=True)
class DataConfig:
    prompt_data: Optional[Union[str, list]] = flag(
        None, "JSONL file of prompts, or a .parquet file in verl's schema (chat-message prompts, "
        "reward_model.ground_truth, data_source, extra_info; needs --apply-chat-template; docs/migrating-from-verl.md). "
        "Several files (verl's data.train_files list) are one dataset, in the order given.", type=str, nargs="+",
        metavar="FILE")
    max_prompt_line_mib: int = flag(16, "Longest line (MiB) a --prompt-data or --eval-prompt-data file may "
                                    "hold; the driver reads each file line by line before the workers start "
                                    "and refuses a longer line by its number.", domain="[1, inf)")
    input_key: str = flag("prompt", "JSON key of the prompt text.")
    label_key: Optional[str] = flag("label", "JSON key of the ground-truth label used by the reward.")
    metadata_key: Optional[str] = flag("metadata", "JSON key of a prompt's metadata (slime's): a JSON object "
                                       "whose keys join the request's and every sample's metadata (what a "
                                       "--custom-rm-path or --custom-generate-function-path reads, what --rm-url "
                                       "receives); a line without the key has none. Keys the engine sets itself "
                                       "(prompt_index, line, epoch, turns, ...) are refused by name. '' turns it "
                                       "off.", metavar="KEY")
    tool_key: Optional[str] = flag("tools", "JSON key of a prompt's tool schemas (slime's): a list of tool "
                                   "definitions, or a JSON string holding one, given to the tokenizer's chat "
                                   "template as tools= with --apply-chat-template and kept in the metadata as "
                                   "'tools'; a line without the key has none. '' turns it off.", metavar="KEY")
    multimodal_keys: Optional[str] = flag(
        None, "JSON map from modality to the prompt column holding it (slime's; verl's data.image_key), e.g. "
        "'{\"image\": \"images\"}': each prompt's images (file paths, bytes, base64, or verl's {bytes|path} "
        "dicts) are decoded and run once through the --hf-checkpoint's own image processor, and its image-pad "
        "tokens are expanded to each image's features (docs/vlm.md). Only \"image\" is a modality. Needs a "
        "vision-language --hf-checkpoint (qwen2_5_vl, qwen3_vl); trains on the megatron backend with the embedded engine "
        "(SGLang's image_data and the FSDP backend are refused by name).", metavar="JSON")
    apply_chat_template: bool = flag(False, "Wrap prompts with the tokenizer's chat template.")
    rollout_shuffle: bool = flag(False, "Shuffle prompts each epoch (seeded).")
    eval_prompt_data: list = flag([], "Evaluation prompts: one JSONL file (metrics eval/reward_mean, ...), or "
                                  "slime's named sets NAME PATH [NAME PATH ...] (metrics eval/NAME/reward_mean, "
                                  "eval/NAME/response_len_mean per set).", type=str, nargs="+", metavar="[NAME] PATH")
    eval_interval: Optional[int] = flag(None, "Evaluate every N rollout steps (needs --eval-prompt-data).")
    n_samples_per_eval_prompt: int = flag(1, "Responses per evaluation prompt.")
    eval_temperature: float = flag(0.0, "Sampling temperature of evaluation; 0 is greedy, the default here "
                                   "(slime's default is --rollout-temperature).", domain="[0, inf)")
    eval_top_p: Optional[float] = flag(None, "Nucleus threshold of evaluation sampling (unset: --rollout-top-p); "
                                       "a value below 1 needs --eval-temperature > 0.", domain="(0, 1]")
    eval_top_k: Optional[int] = flag(None, "Top-k of evaluation sampling (-1 disables; unset: --rollout-top-k); "
                                     "a k > 1 needs --eval-temperature > 0 (k 1 is greedy).")
    eval_max_response_len: Optional[int] = flag(None, "Maximum new tokens per evaluation response (unset: "
                                                "--rollout-max-response-len).")
    rm_type: Optional[str] = flag(None, "Built-in reward function (rollout/rewards.py): exact_match, math, "
                                  "deepscaler (slime's rule), f1 (slime's word-overlap F1), boxed_exact_match, "
                                  "boxed_f1 (slime's boxed_ prefix: the rule on the last \\boxed{}); verl's rules with "
                                  "verl's scores (rollout/verl_scores.py): "
                                  "gsm8k, verl_math, math_dapo, and verl (one of them by each sample's data_source, as "
                                  "verl's default_compute_score); code (the response's last code block run against "
                                  "the label's tests in the sandbox, --sandbox-*; docs/agentic.md); anything else: "
                                  "--custom-rm-path.",
                                  choices=BUILTIN_REWARD_NAMES)
    custom_rm_path: Optional[str] = flag(None, "User reward function as module:function (or slime's module.function): "
                                         "fn(sample) -> float, batched fn(samples), or slime's async "
                                         "reward_func(args, sample, **kwargs) / (args, samples) unchanged "
                                         "(docs/slime-functions.md).")
    custom_reward_function_path: Optional[str] = flag(
        None, "verl's reward function (custom_reward_function.path / .name) as file.py:name, module:name, or file.py "
        "alone for its compute_score: called per sample as compute_score(data_source=, solution_str=, ground_truth=, "
        "extra_info=, **kwargs) with the keywords its signature takes (so verl's own per-dataset scorers, "
        "compute_score(solution_str, ground_truth), run too); sync or async; a number, or verl's dict whose 'score' "
        "is the reward and whose other numeric keys are logged as reward/<key>. Bounded by --user-function-timeout "
        "per batch. Excludes --rm-type, --custom-rm-path and --rm-url (docs/migrating-from-verl.md).",
        metavar="FILE.py[:NAME]")
    custom_reward_function_kwargs: Optional[str] = flag(
        None, "verl's custom_reward_function.reward_kwargs: a JSON object of keyword arguments added to every "
        "--custom-reward-function-path call (they win over verl's four), e.g. '{\"method\": \"flexible\"}'.",
        metavar="JSON")
    reward_key: Optional[str] = flag(None, "slime's --reward-key: the key of a dict reward that trains (its other "
                                     "keys are logged as reward/<key>); unset: 'reward'. A plain-number reward "
                                     "with it set is refused by name.", metavar="KEY")
    eval_reward_key: Optional[str] = flag(None, "The dict-reward key evaluation reports as eval/reward_mean; "
                                          "unset: --reward-key's (slime's fallback).", metavar="KEY")
    overlong_buffer_len: int = flag(0, "DAPO's overlong reward shaping (verl's reward_model.overlong_buffer.len): "
                                    "a training response of L tokens longer than --rollout-max-response-len minus "
                                    "N gets -(L - (max - N)) / N x --overlong-penalty-factor added to its reward "
                                    "(0 up to max - N, -factor at max); logged as reward/overlong_penalty. "
                                    "Evaluation rewards are not shaped. 0: off.", metavar="N")
    overlong_penalty_factor: float = flag(1.0, "The overlong penalty at --rollout-max-response-len tokens (verl's "
                                          "overlong_buffer.penalty_factor); needs --overlong-buffer-len.",
                                          domain="[0, inf)")
    reward_clip_range: list = flag([], "Clip every training reward (after the overlong penalty) to [LOW, HIGH] "
                                   "(OpenRLHF's --reward_clip_range); reward/reward_clipped is the clipped "
                                   "fraction. Evaluation rewards are not clipped. Unset: no clip.",
                                   type=float, nargs=2, metavar=("LOW", "HIGH"))
    rm_url: Optional[str] = flag(None, "Reward server URL (slime's name): batches of samples are POSTed to it "
                                 "as JSON and it answers one reward per sample (protocol: docs/agentic.md). "
                                 "Excludes --rm-type and --custom-rm-path.", metavar="URL")
    rm_timeout: float = flag(120.0, "Seconds the reward server (--rm-url) gets to answer one request; no answer "
                             "by then stops the rollout naming the server (never resent).", domain="(0, inf)")
    rm_batch_size: int = flag(64, "Samples per request to the reward server (--rm-url); a multiple of "
                              "--n-samples-per-prompt keeps each prompt's group in one request.")
    rm_max_concurrency: int = flag(16, "Requests to the reward server (--rm-url) in flight at once.")
    rm_max_retries: int = flag(5, "Times a request to the reward server (--rm-url) that got no reply because of "
                               "the connection (refused, dropped) is sent again, with backoff; an HTTP error or "
                               "a malformed reply is never retried.")
    reward_model_path: Optional[str] = flag(
        None, "A reward model on the trainer's ranks (OpenRLHF's --reward_pretrain, verl's reward_model.model.path): "
        "an HF AutoModelForSequenceClassification dir with one label. Between generation and training it scores "
        "every sample; the reward becomes --reward-model-weight x score, plus the --rm-type/--custom-rm-path/"
        "--rm-url reward when one is given (logged as reward/rule; the score as reward/rm_score). It reads the "
        "policy's token ids when its tokenizer is the policy's, else prompt + response text through its own "
        "(docs/algorithms.md).", metavar="DIR")
    reward_model_weight: float = flag(1.0, "The weight of --reward-model-path's score in the reward.",
                                      domain="(0, inf)")
    reward_model_micro_batch_size: int = flag(16, "Samples per forward of --reward-model-path's model on each trainer "
                                              "rank (verl's reward_model.micro_batch_size_per_gpu); right-padded "
                                              "with its pad id (one per forward when it has none).")

    def __post_init__(self):
        v = self.prompt_data  # one file stays a string (what a YAML or a single flag value gives)
        if isinstance(v, (list, tuple)):
            object.__setattr__(self, "prompt_data", v[0] if len(v) == 1 else (list(v) or None))

    @property
    def prompt_files(self) -> tuple[str, ...]:
        """``--prompt-data``'s files, in order (one or several; none when unset)."""
        v = self.prompt_data
        return () if not v else (v,) if isinstance(v, str) else tuple(v)

    @property
    def eval_sets(self) -> tuple[tuple[Optional[str], str], ...]:
        """``(name, path)`` per evaluation set: one PATH is the unnamed set (metrics ``eval/...``),
        slime's NAME PATH pairs are named sets (``eval/NAME/...``). A YAML string is one PATH."""
        v = self.eval_prompt_data
        items = [v] if isinstance(v, str) else list(v or [])
        if len(items) == 1:
            return ((None, items[0]),)
        return tuple((items[i], items[i + 1]) for i in range(0, len(items) - 1, 2))


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage_estimator: str = flag("grpo", "How rewards become advantages (formulas and peer conventions: "
                                    "docs/algorithms.md). gae is verl's name for ppo (GAE with a learned critic).",
                                    choices=("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                             "rloo", "gpg", "opo", "remax", "ppo", "gae"))
    policy_loss_type: str = flag("vanilla", "The policy-gradient loss, verl's policy_loss.loss_mode names "
                                 "(formulas in docs/algorithms.md). vanilla: the PPO clip (GSPO is "
                                 "--advantage-estimator gspo). cispo: clipped importance weight, stop-gradient, times "
                                 "log-prob (MiniMax-M1). gpg: -A * log-prob (GPG). geo_mean: GMPO, the geometric "
                                 "mean of the token ratios per sequence. sapo: SAPO's soft sigmoid gate "
                                 "(--sapo-tau-pos/--sapo-tau-neg). geo_mean and sapo are means over sequences: "
                                 "--loss-agg-mode seq_mean_token_mean only (the default for them). clip_cov / "
                                 "kl_cov: the PPO clip with a few high-covariance tokens dropped / the unclipped "
                                 "ratio with a |log-ratio| penalty on a few (Clip-Cov / KL-Cov; tokens chosen per "
                                 "micro-batch, as verl).",
                                 choices=("vanilla", "cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov"))
    sapo_tau_pos: float = flag(1.0, "SAPO gate temperature for tokens with advantage > 0 (verl's tau_pos); needs "
                               "--policy-loss-type sapo.", domain="(0, inf)")
    clip_cov_ratio: float = flag(2e-4, "Clip-Cov: at most max(int(ratio * loss tokens), 1) tokens of each micro-batch "
                                 "lose their gradient (verl's clip_cov_ratio); needs --policy-loss-type clip_cov.",
                                 domain="(0, 1]")
    clip_cov_lb: float = flag(1.0, "Clip-Cov: lower bound of the covariance (A - mean A)(logp - mean logp) of a "
                              "token it may drop (verl's clip_cov_lb); needs --policy-loss-type clip_cov.",
                              domain="(-inf, inf)")
    clip_cov_ub: float = flag(5.0, "Clip-Cov: upper bound of that covariance (verl's clip_cov_ub); needs "
                              "--policy-loss-type clip_cov.", domain="(-inf, inf)")
    kl_cov_ratio: float = flag(2e-4, "KL-Cov: the max(int(ratio * loss tokens), 1) tokens of largest covariance in "
                               "each micro-batch get the |log-ratio| penalty (verl's kl_cov_ratio); needs "
                               "--policy-loss-type kl_cov.", domain="(0, 1]")
    ppo_kl_coef: float = flag(0.1, "KL-Cov: coefficient of |logp - old_logp| on its selected tokens (verl's "
                              "ppo_kl_coef); needs --policy-loss-type kl_cov.", domain="[0, inf)")
    sapo_tau_neg: float = flag(1.05, "SAPO gate temperature for tokens with advantage <= 0 (verl's tau_neg); needs "
                               "--policy-loss-type sapo.", domain="(0, inf)")
    gamma: float = flag(1.0, "Discount of the token rewards (slime's --gamma): the returns of "
                        "--advantage-estimator reinforce_plus_plus(_baseline) and the GAE of ppo (and args.gamma of a "
                        "--custom-advantage-function-path).", domain="(0, 1]")
    lambd: float = flag(1.0, "GAE lambda of --advantage-estimator ppo (slime's --lambd; 1: returns minus the "
                        "critic's value, 0: one-step TD; and args.lambd of a --custom-advantage-function-path).",
                        domain="[0, 1]")
    value_clip: float = flag(0.2, "--advantage-estimator ppo: the critic's new value may move at most this far from "
                             "the old one before the clipped value loss takes over (slime's --value-clip, verl's "
                             "cliprange_value).", domain="(0, inf)")
    num_critic_only_steps: int = flag(0, "--advantage-estimator ppo: the first N rollout steps train the critic "
                                      "only (the actor's weights do not change; no train/* policy metrics).")
    disable_grpo_std_normalization: bool = flag(False, "GRPO without dividing by the group std (Dr.GRPO).")
    grpo_std_level: str = flag("group", "Whose reward std divides a GRPO/GSPO advantage r - mean_group: the "
                               "group's (the GRPO paper, slime, verl) or the whole rollout batch's (TRL's "
                               "scale_rewards='batch'; arXiv 2508.08221).", choices=("group", "batch"))
    normalize_advantages: bool = flag(False, "Whiten the advantages over all loss tokens of the rollout batch "
                                      "after the estimator (float64, Bessel variance, eps inside the sqrt).")
    loss_agg_mode: Optional[str] = flag(None, "How per-token losses aggregate over the step (global "
                                        "denominators; docs/algorithms.md). Unset: seq_mean_token_mean for "
                                        "--advantage-estimator gspo (which refuses token_mean) and --policy-loss-type "
                                        "geo_mean / sapo (which take only it), token_mean otherwise.",
                                        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                                 "seq_mean_token_sum_norm"))
    eps_clip: float = flag(0.2, "PPO ratio clip (lower side, and upper unless --eps-clip-high).", domain="(0, inf)")
    eps_clip_high: Optional[float] = flag(None, "Upper ratio clip (DAPO clip-higher).", domain="(0, inf)")
    eps_clip_c: Optional[float] = flag(None, "Dual-clip constant c (> 1) for negative advantages.", domain="(1, inf)")
    kl_coef: float = flag(0.0, "KL to the reference (the --kl-loss-type estimator of the old log-probs, as slime) "
                          "folded into the token rewards (slime's --kl-coef; "
                          "REINFORCE++: --advantage-estimator reinforce_plus_plus, formulas in docs/algorithms.md); "
                          "0: off. slime ignores it for GRPO/GSPO/RLOO; here a value > 0 with those is refused "
                          "(use --use-kl-loss --kl-loss-coef for a KL term in the loss).", domain="[0, inf)")
    kl_ctrl_type: str = flag("fixed", "How the --kl-coef folded into the rewards moves: fixed, or adaptive (verl's "
                             "algorithm.kl_ctrl; Ziegler et al. 2019): after each rollout beta *= 1 + clip(kl / "
                             "--kl-target - 1, +-0.2) x responses / --kl-horizon; logged as train/reward_kl_coef, "
                             "kept in checkpoints.", choices=("fixed", "adaptive"))
    kl_target: float = flag(0.1, "The adaptive KL controller's target KL per token (verl's target_kl).",
                            domain="(0, inf)")
    kl_horizon: float = flag(10000.0, "Responses over which the adaptive KL controller closes a proportional error "
                             "(verl's horizon).", domain="(0, inf)")
    use_kl_loss: bool = flag(False, "KL to the reference model: added to the loss times --kl-loss-coef, and "
                             "logged as train/kl; with --kl-loss-coef 0 logged only (slime's way to watch it).")
    kl_loss_coef: float = flag(0.0, "Coefficient of the KL penalty (needs --use-kl-loss when > 0).", domain="[0, inf)")
    kl_loss_type: str = flag("k3", "KL estimator; k3 and low_var_kl are the same low-variance estimator, "
                             "clamped as verl's (log ratio to +-20, value to <= 10). A trailing + (verl's k3+): "
                             "that estimator's value with k2's gradient (straight-through; docs/algorithms.md).",
                             choices=("k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+"))
    use_unbiased_kl: bool = flag(False, "Weight the KL loss term by the importance ratio exp(logp - old_logp) "
                                 "(slime's unbiased KL, DeepSeek-V3.2; k3/low_var_kl clamp the weighted "
                                 "product to [-10, 10]); needs --use-kl-loss.")
    entropy_coef: float = flag(0.0, "Entropy bonus coefficient.", domain="[0, inf)")
    use_tis: bool = flag(False, "Off-policy importance weight on the policy-gradient term: w = exp(old - rollout) "
                         "log-probs (the trainer's recomputed proximal policy over the engine's behaviour policy), "
                         "formed per --tis-level and bounded to [--tis-clip-low, --tis-cap] per --tis-mode "
                         "(docs/algorithms.md, 'Off-policy correction'). Default: slime's token-level truncated "
                         "IS; with --tis-mode mask, AReaL's decoupled PPO (use_decoupled_loss).")
    tis_cap: float = flag(2.0, "Upper bound of the TIS weight (AReaL's behav_imp_weight_cap, verl's "
                          "rollout_is_threshold); >= 1 with --use-tis.", aliases=("--tis-clip",), domain="(0, inf)")
    tis_clip_low: float = flag(0.0, "Lower bound of the TIS weight (0: none); needs --use-tis.", domain="[0, inf)")
    tis_level: str = flag("token", "Needs --use-tis. token: one weight per token. sequence: the product of the "
                          "response's token ratios over its loss tokens (verl's rollout_is sequence). geometric: "
                          "their geometric mean (slime MIS's geometric; AReaL's sequence level). One weight per "
                          "response at the last two.", choices=("token", "sequence", "geometric"))
    tis_mode: str = flag("truncate", "Needs --use-tis. truncate: clamp the weight into [--tis-clip-low, --tis-cap]. "
                         "mask: weight 0 outside those bounds, the ratio itself inside (AReaL's decoupled PPO "
                         "cap, slime's IcePop and MIS mask). A weight of 0 keeps the token in the loss "
                         "denominator.", choices=("truncate", "mask"))
    use_rs: bool = flag(False, "Rejection sampling (verl's rollout_rs, slime MIS's use_rs): tokens, or whole "
                        "responses per --rs-level, whose ratio exp(old - rollout) lies outside [--rs-lower-bound, "
                        "--rs-upper-bound] get weight 0 in the policy-gradient term; combines with --use-tis.")
    rs_level: str = flag("token", "Needs --use-rs. The ratio rejection sampling tests: token, sequence (product "
                         "over the response's loss tokens) or geometric (their geometric mean, verl's "
                         "seq_mean_k1).", choices=("token", "sequence", "geometric"))
    rs_upper_bound: float = flag(2.0, "Needs --use-rs. Largest ratio kept (verl's rollout_rs_threshold); e.g. "
                                 "1.001 for --rs-level geometric.", domain="[1, inf)")
    rs_lower_bound: Optional[float] = flag(None, "Needs --use-rs. Smallest ratio kept; unset: 1 / "
                                           "--rs-upper-bound (verl's and slime's default).", domain="[0, 1]")
    use_rollout_logprobs: bool = flag(False, "Take the old log-probs from the rollout engine (each sample's "
                                      "rollout log-probs) instead of a forward pass: one forward less per "
                                      "step, at the price of the engine/trainer mismatch "
                                      "(train/mismatch_abs_logprob). Refused with --use-tis and --use-rs, "
                                      "which correct exactly that mismatch.")
    opd_kl_coef: float = flag(0.0, "On-policy distillation: reverse-KL coefficient to the teacher "
                              "(needs --opd-teacher-load).", domain="[0, inf)")
    num_steps_per_rollout_updates: int = flag(1, "Passes of optimizer updates over each rollout "
                                              "(PPO epochs).")
    custom_advantage_function_path: Optional[str] = flag(
        None, "User advantage estimator, slime's contract: fn(args, rollout_data) sets rollout_data['advantages'] "
        "to one tensor per sample (one value per response token). args: every flag by its slime name; "
        "rollout_data: rewards (group-normalised as slime for grpo/gspo), raw_reward, response_lengths, "
        "total_lengths, loss_masks, log_probs, ref_log_probs, rollout_log_probs, kl, values (docs/algorithms.md). "
        "module:function, module.function or path/to/file.py:function; imported, and its arity checked, at "
        "start-up. --normalize-advantages still whitens after it.", metavar="PATH")
    disable_rewards_normalization: bool = flag(
        False, "slime's switch: no group baseline for grpo / gspo (advantage = the raw reward, no mean or std) "
        "and reinforce_plus_plus_baseline (no group mean); refused with other estimators.")
    get_mismatch_metrics: bool = flag(
        False, "Read the engine's rollout log-probs and log the train-vs-rollout mismatch "
        "(train/mismatch_abs_logprob, train/mismatch_k3_kl) without correcting for it (--use-tis / --use-rs "
        "correct it and log it too).")
    true_on_policy_mode: bool = flag(
        False, "Truly on-policy (miles' and slime's name): the embedded rollout engine and the megatron trainer run "
        "every forward under the batch-invariant ops (fixed matmul tiles, fixed reduction chunks, attention in key "
        "tiles from each sequence's first token; the embedded engine's server takes SGLang's "
        "--enable-deterministic-inference), so a token's rollout log-prob is the trainer's old log-prob bit for bit "
        "whatever the batch, padding, packing or micro-batch size. Logs train/mismatch_logprob_diff_frac and "
        "train/mismatch_abs_logprob_max (0 in this mode). Refused where a layout is not invariant yet "
        "(docs/on-policy.md): TP, CP, PP, EP > 1, SGLang, the FSDP backend, bf16/fp16/fp8, LoRA; MoE models "
        "(qwen3_moe, mixtral) need --use-rollout-routing-replay.")
    loss_type: str = flag("policy_loss", "slime's loss selector. policy_loss: the PPO/GRPO loss (docs/algorithms.md). "
                          "custom_loss (with --custom-loss-function-path) is refused: see that flag. sft_loss "
                          "(slime's SFT scripts) is refused: supervised fine-tuning is not built.",
                          choices=("policy_loss", "custom_loss", "sft_loss"))
    custom_loss_function_path: Optional[str] = flag(
        None, "Refused: slime calls it as fn(args, batch, logits, sum_of_sample_mean) with its own batch dict, raw "
        "(CP-sliced) logits and per-micro-batch reducer; here losses are globally normalised over micro-batches "
        "and DP ranks (docs/algorithms.md), so a slime loss function would not run unchanged. Use the built-in "
        "terms (--kl-loss-coef, --entropy-coef, --opd-kl-coef, --use-tis) or register a Spec "
        "(algorithms/spec.py register_spec).", metavar="PATH")
    custom_pg_loss_reducer_function_path: Optional[str] = flag(
        None, "Refused: slime's reducer divides one micro-batch's pg_loss by its own count; here the denominators "
        "are global (exact over micro-batches and DP ranks). For Dr.GRPO's constant divisor use --loss-agg-mode "
        "seq_mean_token_sum_norm (divides by samples x --rollout-max-response-len).", metavar="PATH")
    custom_tis_function_path: Optional[str] = flag(
        None, "Refused: slime's hook rewrites pg_loss and the loss masks of one micro-batch; its built-ins are "
        "flags here: slime...vanilla_tis_function = --use-tis, slime...icepop_function = --use-tis --tis-mode "
        "mask; sequence/geometric levels and rejection sampling: --tis-level, --use-rs.", metavar="PATH")
    keep_old_actor: bool = flag(False, "slime's copy of the weights that generated a rollout, kept on the trainer "
                                "to compute the old log-probs. Refused: no such copy is kept here; with "
                                "--async-mode off the old log-probs already come from the generating weights, and "
                                "under --async-mode one-step / full --use-rollout-logprobs takes them from the "
                                "engine that generated the rollout (or --use-tis / --use-rs correct towards it).")
    ref_update_interval: Optional[int] = flag(
        None, "slime's: after every N-th rollout trains, the reference model becomes the actor's current weights "
        "(train/ref_updated logs it); unset: the reference stays --ref-load's / the initial weights. Needs "
        "--use-kl-loss or --kl-coef; --save-interval a multiple of N (a resume restores the reference from such a "
        "checkpoint).", domain="[1, inf)")


@dataclass(frozen=True)
class SyncConfig:
    update_weight_transport: str = flag("auto", "How trained weights reach the rollout engine: tensor "
                                        "(in-process hand-over to the embedded engine; flattened buckets to "
                                        "colocated SGLang engines), disk (HF safetensors in versioned dirs under "
                                        "--update-weight-disk-dir, loaded by the engine), or distributed "
                                        "(--rollout-backend sglang only: the driver rank and every server's TP "
                                        "ranks form a process group, gloo on CPU / NCCL on GPU, and each bucket "
                                        "is broadcast into the servers; docs/sglang.md). auto, as slime: tensor "
                                        "with the embedded engine or colocated SGLang engines, else distributed.",
                                        choices=("auto", "disk", "tensor", "distributed"))
    update_weight_buffer_size: int = flag(512 * 1024 * 1024, "Bytes per weight-update bucket.")
    update_weight_mode: str = flag("full", "slime's: what each weight sync sends. full: every tensor. delta: per "
                                   "tensor only the elements whose bits changed since the version the engine "
                                   "holds, compared in the engine's dtype (sparse indices + values; a tensor whose "
                                   "sparse form is not smaller goes whole). Each delta names its base version; an "
                                   "engine at another version (fresh, restarted, a failed update) refuses it and "
                                   "gets a full sync (sync/delta_fallbacks counts them). The trainer keeps a host "
                                   "copy of the engine's weights to diff against. The embedded engine in this "
                                   "process (--update-weight-transport tensor or disk; not with --colocate: it keeps "
                                   "no weights while the trainer trains), or SGLang servers on this host with "
                                   "--update-weight-transport disk: SGLang cannot patch its weights in place, so the "
                                   "driver patches a checkpoint kept beside them (<--update-weight-disk-dir>/"
                                   "host_checkpoint) and they reload the changed tensors from it "
                                   "(/update_weights_from_disk); servers on other hosts are refused. docs/sglang.md, "
                                   "\"Delta sync and post-apply checksums\".",
                                   choices=("full", "delta"))
    update_weight_delta_encoding: str = flag("xor", "slime's: how --update-weight-mode delta encodes a changed "
                                             "element. xor: new ^ old bits (must be applied once, onto exactly the "
                                             "base version). overwrite: the new bits (idempotent). Same size here "
                                             "(indices + one value per changed element).",
                                             choices=("xor", "overwrite"))
    update_weight_delta_checksum: str = flag("xxh3-128", "slime's: the per-tensor checksum a delta carries (checked "
                                             "by the engine after it patched the tensor) and the one "
                                             "--update-weight-verify compares. xxh3-128 (default, xxhash), sha256 "
                                             "(stdlib), adler32 (32-bit).",
                                             choices=("xxh3-128", "sha256", "adler32"))
    update_weight_verify: str = flag("auto", "After each sync the engine reports the checksum "
                                     "(--update-weight-delta-checksum) of every tensor it now holds and the trainer "
                                     "compares each with its own of the bytes it sent (in the engine's dtype); a "
                                     "mismatch stops the run naming the tensor, its bucket and the version. checksum: "
                                     "on: the embedded engine (in this process, or its own: --embedded-engine-ranks process), or SGLang servers (their "
                                     "/weights_checker checksum of every tensor on every TP rank, against the "
                                     "trainer's of the same bytes in SGLang's fused layout; qwen2, qwen3 and llama "
                                     "models; disk, tensor, or distributed from one pipeline stage); not with "
                                     "--lora-sync adapter, whose engine merges the adapter itself. auto: checksum with "
                                     "the embedded engine (either placement) and a whole-model sync (an engine that "
                                     "reports no checksums is not verified), else off. off.",
                                     choices=("auto", "checksum", "off"))
    update_weight_disk_dir: Optional[str] = flag(None, "Directory for --update-weight-transport disk (needed "
                                                 "by it, refused without it): each sync publishes v<version>/ "
                                                 "there atomically and keeps the newest 2. SGLang servers must "
                                                 "be able to read it (a shared filesystem across hosts); "
                                                 "created if missing.")
    check_weight_update_equal: bool = flag(False, "Verify the weight updates. Embedded engine: after each sync, "
                                           "every engine tensor equals the trainer's. SGLang (every transport): the "
                                           "update to version 0 of a fresh run (the trainer's initial weights) is "
                                           "compared inside every server, tensor for tensor, with the server's own "
                                           "load of --hf-checkpoint (/weights_checker snapshot, reset_tensors, "
                                           "compare; SGLang >= 0.5.19; a host copy of the model per server). A "
                                           "mismatch stops the run naming the tensors.")


@dataclass(frozen=True)
class EstimateConfig:
    """The assumptions of --dry-run's weight-sync and step-time estimate (plan/sync_estimate.py, docs/planner.md):
    they change what the estimate prints, nothing a run does."""

    intra_node_link: Optional[str] = flag(
        None, "The link inside a node for --dry-run's weight-sync estimate (TP/EP gathers, engines on the "
        "trainer's node): a name from docs/planner.md's link table; default the --gpu-type's NVLink.",
        choices=INTRA_NODE_LINKS)
    inter_node_link: str = flag(DEFAULT_INTER_NODE_LINK, "The link between nodes (per GPU) for --dry-run's "
                                "weight-sync estimate (PP broadcasts, engines on other nodes).",
                                choices=INTER_NODE_LINKS)
    disk_link: str = flag(DEFAULT_DISK_LINK, "The storage --update-weight-transport disk writes and the engines "
                          "read, for --dry-run's weight-sync estimate.", choices=DISK_LINKS)
    intra_node_bandwidth_gb_per_s: Optional[float] = flag(
        None, "Measured GB/s (one direction, per GPU) inside a node: replaces --intra-node-link's figure in "
        "--dry-run's weight-sync estimate.", domain="(0, inf)")
    inter_node_bandwidth_gb_per_s: Optional[float] = flag(
        None, "Measured GB/s (one direction, per GPU) between nodes: replaces --inter-node-link's figure.",
        domain="(0, inf)")
    disk_bandwidth_gb_per_s: Optional[float] = flag(
        None, "Measured GB/s of the weight-sync directory's storage, read and write: replaces --disk-link's "
        "figures.", domain="(0, inf)")
    sync_bucket_latency_ms: float = flag(
        DEFAULT_BUCKET_LATENCY_MS, "Fixed cost per weight-update bucket (an HTTP call to the engine and its "
        "collectives) in --dry-run's weight-sync estimate; two more per sync (begin / end).", domain="(0, inf)")
    estimate_train_mfu: float = flag(
        DEFAULT_TRAIN_MFU, "Model FLOPs utilisation assumed for training and prefill in --dry-run's step-time "
        "estimate (FLOPs / (GPUs x the --gpu-type's dense bf16 peak)).", domain="(0, 1]")
    estimate_decode_mfu: float = flag(
        DEFAULT_DECODE_MFU, "Model FLOPs utilisation assumed for the engines' decode in --dry-run's step-time "
        "estimate (decode is memory-bound: far below training's).", domain="(0, 1]")


@dataclass(frozen=True)
class PlacementConfig:
    allocation: Optional[str] = flag(None, "Allocation string, e.g. sglang:d2t4+megatron:d2p2t2: sets the "
                                     "actor's --train-backend, parallel sizes, rank count and the rollout "
                                     "GPU counts for flags left unset; a given flag that disagrees is "
                                     "refused (docs/planner.md).")
    actor_num_nodes: int = flag(1, "Nodes for the training actor (x --actor-num-gpus-per-node = torchrun's "
                                "WORLD_SIZE).")
    critic_num_nodes: Optional[int] = flag(None, "slime's critic placement: the critic runs on the actor's ranks "
                                           "(as slime's, whose critic always takes the actor's GPU count), so only "
                                           "--actor-num-nodes is accepted; its own layout: "
                                           "--critic-tensor-model-parallel-size.")
    critic_num_gpus_per_node: Optional[int] = flag(None, "slime's critic placement: the critic runs on the actor's "
                                                   "ranks, so only --actor-num-gpus-per-node is accepted; its own "
                                                   "layout: --critic-tensor-model-parallel-size.")
    actor_num_gpus_per_node: int = flag(1, "GPUs (or CPU ranks) per node for the training actor; must equal "
                                        "the ranks torchrun launches per node (LOCAL_WORLD_SIZE).")


@dataclass(frozen=True)
class ModeConfig:
    debug_train_only: bool = flag(False, "Train without a rollout engine (needs --load-debug-rollout-data).")
    debug_rollout_only: bool = flag(False, "Generate and save rollouts without training.")
    load_debug_rollout_data: Optional[str] = flag(
        None, "Rollout file pattern with {rollout_id} to train from (implies --debug-train-only).")
    save_debug_rollout_data: Optional[str] = flag(None, "Save each rollout to this pattern with {rollout_id}.")
    dry_run: bool = flag(False, "Validate everything, print the plan and exit without starting work.")
    verl_overrides: list = flag([], "verl's Hydra overrides: one argument per KEY=VALUE (as a verl launch script "
                                "passes them to verl.trainer.main_ppo), or one argument holding them all (split as "
                                "a shell splits words), translated into this engine's "
                                "flags through the table of docs/migrating-from-verl.md; a key the table refuses or "
                                "does not know is refused by name with the reason. Flags on the command line win "
                                "over the translation; --dry-run prints it.", type=str, nargs="+",
                                metavar="KEY=VALUE")
    verl_config: Optional[str] = flag(None, "A YAML of verl config keys (nested as verl's config, e.g. "
                                      "actor_rollout_ref: {actor: {optim: {lr: 1e-6}}}), translated as "
                                      "--verl-overrides (which win over it).", metavar="FILE.yaml")

    # slime semantics: loading saved rollouts means there is nothing to generate.
    @property
    def train_only(self) -> bool:
        return self.debug_train_only or self.load_debug_rollout_data is not None


@dataclass(frozen=True)
class RuntimeConfig:
    seed: int = flag(1234, "Global seed for model init, data order and dropout.")
    output_dir: str = flag("runs/latest", "Run directory: metrics.jsonl, plots, logs.")
    wall_time_limit: Optional[float] = flag(None, "Stop (after saving) before this much time has passed: "
                                            "7d, 12h, 90m or seconds.", type=parse_duration, domain="(0, inf)")
    wall_time_reserve: float = flag(600.0, "Time kept in hand at the end for the final save (and 2x for eval).",
                                    type=parse_duration, domain="[0, inf)")
    use_wandb: bool = flag(False, "slime's W&B switch: logging to W&B is on exactly when --wandb-project is "
                           "given, so this needs it (refused without).")
    wandb_project: Optional[str] = flag(None, "Log to this W&B project.")
    wandb_group: Optional[str] = flag(None, "W&B group.")
    wandb_team: Optional[str] = flag(None, "W&B entity (team or user) the run belongs to (wandb.init entity); "
                                     "needs --wandb-project.")
    wandb_host: Optional[str] = flag(None, "W&B server URL, for a self-hosted W&B (wandb.Settings base_url and "
                                     "wandb.login host); needs --wandb-project.")
    wandb_key: Optional[str] = flag(None, "W&B API key: wandb.login(key) before the run starts in "
                                    "--wandb-mode online (none offline, as slime); never written to the logged config. "
                                    "Needs --wandb-project.")
    wandb_mode: str = flag("online", "W&B mode (offline works without network).",
                           choices=("online", "offline", "disabled"))
    wandb_resume_id: Optional[str] = flag(None, "Continue this W&B run id.", aliases=("--wandb-run-id",))
    tensorboard_dir: Optional[str] = flag(None, "Write TensorBoard scalars here.")


GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "architecture": ArchitectureConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "batching": BatchingConfig,
    "memory": MemoryConfig,
    "precision": PrecisionConfig,
    "megatron": MegatronConfig,
    "checkpoint": CheckpointConfig,
    "rollout": RolloutConfig,
    "data": DataConfig,
    "algorithm": AlgorithmConfig,
    "sync": SyncConfig,
    "estimate": EstimateConfig,
    "placement": PlacementConfig,
    "mode": ModeConfig,
    "runtime": RuntimeConfig,
}


@dataclass(frozen=True)
class Config:
    """The whole validated configuration of one run (built by ``config.parse_config``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self):
        served = self.embedded_placement == "process"
        if self.sync.update_weight_transport == "auto":  # resolved once, here: every reader sees a transport
            same_devices = self.rollout.rollout_backend == "embedded" or (
                self.memory.colocate and not self.rollout.rollout_engine_urls)
            transport = "disk" if served else "tensor" if same_devices else "distributed"
            object.__setattr__(self, "sync", replace(self.sync, update_weight_transport=transport))
        if served and self.sync.update_weight_transport == "disk" and self.sync.update_weight_disk_dir is None:
            object.__setattr__(self, "sync", replace(self.sync, update_weight_disk_dir=os.path.join(
                self.runtime.output_dir, "engine_weights")))  # the engine process loads each version from here

    @property
    def embedded_placement(self) -> Optional[str]:
        """Where the embedded engine generates (--embedded-engine-ranks, auto resolved): "all" (a replica on every
        rank), "driver", or "process" (its own process, rollout.embedded_server); None without that engine."""
        r = self.rollout
        if r.rollout_backend != "embedded" or not self.has_rollout_engine:
            return None
        if r.embedded_engine_ranks != "auto":
            return r.embedded_engine_ranks
        if r.async_mode != "off" and self.has_training:
            return "process"
        return "all" if self.has_training else "driver"

    @property
    def in_process_engine(self) -> bool:
        """Whether the rollout engine lives in the trainer's processes (the embedded engine on the driver or on
        every rank): the engine weight syncs can patch in place and read checksums from."""
        return self.rollout.rollout_backend == "embedded" and self.embedded_placement in ("driver", "all")

    @property
    def weight_update_verify(self) -> str:
        """--update-weight-verify resolved: "checksum" or "off" (auto: checksum with the embedded engine, in this
        process or its own, and a whole-model sync)."""
        v = self.sync.update_weight_verify
        if v == "auto":  # --lora-sync adapter: the engine merges the adapter itself, in float32 (not bit-exact)
            embedded = self.rollout.rollout_backend == "embedded" and self.embedded_placement is not None
            return "checksum" if embedded and self.lora.lora_sync != "adapter" else "off"
        return v

    @property
    def actor_world_size(self) -> int:
        return self.placement.actor_num_nodes * self.placement.actor_num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.actor_world_size // self.parallel.model_parallel_size

    @property
    def has_rollout_engine(self) -> bool:
        return not self.mode.train_only

    @property
    def has_training(self) -> bool:
        return not self.mode.debug_rollout_only

    @property
    def embedded_replicas(self) -> bool:
        """Whether the embedded engine has a replica on every rank (--embedded-engine-ranks; auto: yes when the
        run both generates and trains; a one-rank run has the driver's alone either way)."""
        return self.embedded_placement == "all" and self.has_training

    @property
    def seq_length(self) -> int:
        return self.model.seq_length or (self.rollout.rollout_max_prompt_len + self.rollout.rollout_max_response_len)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def iter_fields():
    """Yield (group_name, group_cls, dataclass Field) for every declared flag, in declaration order."""
    for group_name, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            yield group_name, cls, f


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")
