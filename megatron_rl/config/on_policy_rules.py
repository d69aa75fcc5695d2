"""What ``--true-on-policy-mode`` refuses: every combination not yet bitwise invariant (docs/on-policy.md).

The mode's contract is that a token's rollout log-prob equals the trainer's old log-prob bit for bit. It
holds where the engine's forward and the trainer's compute each token with the same operations in the same
order under ``ops.batch_invariant``; each row below is a place where they do not (yet), refused by name
before any worker starts, as ``NotBuilt`` (a valid run this version does not build: ``--dry-run`` still
prints its plan). One table, one walk: a layout made invariant leaves the table with its test.
"""

from __future__ import annotations

import os
from typing import Callable

from .architecture import read_hf_config, text_config
from .rollout_rules import NotBuilt
from .schema import Config

# (flag as the user wrote it, whether this run sets it, why the mode cannot hold there yet)
_NOT_INVARIANT: tuple[tuple[Callable[[Config], str], Callable[[Config], bool], str], ...] = (
    (lambda c: f"--tensor-model-parallel-size {c.parallel.tensor_model_parallel_size}",
     lambda c: c.parallel.tensor_model_parallel_size > 1,
     "a row-parallel linear splits each dot product over the ranks and the all-reduce adds the partial sums, "
     "while the engine's one-rank matmul adds every term in one order (docs/on-policy.md)"),
    (lambda c: f"--context-parallel-size {c.parallel.context_parallel_size}",
     lambda c: c.parallel.context_parallel_size > 1,
     "CP splits each sequence's keys over ranks, so the attention's key tiles are not the engine's"),
    (lambda c: f"--pipeline-model-parallel-size {c.parallel.pipeline_model_parallel_size}",
     lambda c: c.parallel.pipeline_model_parallel_size > 1,
     "pipeline stages are not yet checked bitwise against the engine"),
    (lambda c: f"--expert-model-parallel-size {c.parallel.expert_model_parallel_size}",
     lambda c: c.parallel.expert_model_parallel_size > 1,
     "experts spread over ranks are not yet checked bitwise (the all-to-all's chunk order decides the expert "
     "combine's order; the mode's MoE runs every expert on one rank)"),
    (lambda c: "--rollout-backend sglang", lambda c: c.rollout.rollout_backend == "sglang",
     "SGLang's --enable-deterministic-inference kernels are CUDA (batch-invariant Triton); on the CPU route "
     "SGLang has none, and its GPU kernels are not matched by this trainer's CPU ops yet: use "
     "--rollout-backend embedded"),
    (lambda c: "--train-backend fsdp", lambda c: c.precision.train_backend == "fsdp",
     "the FSDP backend's forward is not yet run under the batch-invariant ops: use --train-backend megatron"),
    (lambda c: "--bf16", lambda c: c.precision.bf16,
     "the embedded engine generates in fp32; a bf16 trainer computes other bits"),
    (lambda c: "--fp16", lambda c: c.precision.fp16, "the embedded engine generates in fp32"),
    (lambda c: f"--fp8-format {c.precision.fp8_format}", lambda c: c.precision.fp8_format is not None,
     "fp8 GEMMs are transformer-engine kernels, not the batch-invariant ops"),
    (lambda c: f"--lora-rank {c.lora.lora_rank}", lambda c: c.lora.lora_rank > 0,
     "the engine merges the adapters into its weights (x @ (W + BA)) while the trainer adds x @ A @ B: "
     "other arithmetic"),
)

# the families whose HF module (the engine) and megatron model (the trainer) are checked bitwise under the mode
# (tests/rollout/test_true_on_policy.py); sliding-window, linear-attention, zero-centred-norm, attention-sink,
# shared-expert and sigmoid-router families are not yet
INVARIANT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# the MoE ones among them: a softmax router over every expert, top-k, no shared expert; their expert weights
# are the engine's bits only for the engine's experts, so they need routing replay from the rollout (R3)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


def _model_type(path: str) -> object:
    try:
        return text_config(read_hf_config(path)).get("model_type")
    except (OSError, ValueError):
        return None


def _model_problem(path: str) -> str:
    """Why the checkpoint's model cannot run the mode yet ('' when it can)."""
    try:
        hf = text_config(read_hf_config(path))
    except (OSError, ValueError):
        return ""  # a missing/unreadable config.json is named by the checkpoint checks
    model_type = hf.get("model_type")
    if model_type not in INVARIANT_MODEL_TYPES:
        return (f"model_type {model_type!r} is not yet checked bitwise between the engine and the trainer "
                f"(checked: {', '.join(INVARIANT_MODEL_TYPES)})")
    if hf.get("use_sliding_window") or (model_type == "mixtral" and hf.get("sliding_window")):
        return "sliding-window attention moves each query's first key"
    return ""


def _moe_problem(cfg: Config) -> str:
    """Why this MoE run cannot hold the mode ('' when it can): the trainer must route each token to the engine's
    experts (R3) and run megatron's plain softmax router, unfused permutation and one-expert-at-a-time MLPs."""
    m = cfg.megatron
    if not m.use_rollout_routing_replay:
        return ("a MoE model needs the engine's experts replayed in the trainer (R3): add "
                "--use-rollout-routing-replay")
    refused = [(f"--moe-token-dispatcher-type {m.moe_token_dispatcher_type}",
                m.moe_token_dispatcher_type not in (None, "alltoall")),
               ("--moe-grouped-gemm", m.moe_grouped_gemm), ("--moe-permute-fusion", m.moe_permute_fusion),
               (f"--moe-router-dtype {m.moe_router_dtype}", m.moe_router_dtype not in (None, "fp32"))]
    shown = [flag for flag, given in refused if given]
    if shown:
        return (f"{', '.join(shown)}: fused/grouped MoE kernels are not the batch-invariant ops (the mode runs the "
                "experts one by one through them, dispatched by the checked alltoall path); drop it")
    return ""


def true_on_policy_errors(cfg: Config) -> list[str]:
    """Every refusal of ``--true-on-policy-mode`` for this run (empty when the flag is off)."""
    if not cfg.algorithm.true_on_policy_mode:
        return []
    errors: list[str] = [
        NotBuilt(f"--true-on-policy-mode with {shown(cfg)}: {why}; drop one of the two")
        for shown, given, why in _NOT_INVARIANT if given(cfg)]
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        problem = _model_problem(path)
        if problem:
            errors.append(NotBuilt(f"--true-on-policy-mode with --hf-checkpoint {path}: {problem}; drop "
                                   "--true-on-policy-mode for this model"))
        elif _model_type(path) in MOE_MODEL_TYPES:
            problem = _moe_problem(cfg)
            if problem:
                errors.append(NotBuilt(f"--true-on-policy-mode with the MoE model {path}: {problem}"))
    return errors
