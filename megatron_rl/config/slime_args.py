"""slime's flags that this parser does not take, each with the reason, and slime's own ``--sglang-*`` flags.

Why a table: slime's ``slime/utils/arguments.py`` declares ~200 flags and its launch scripts add
Megatron-LM ones. Every one of them is either a flag here (config/schema.py, with the architecture and
Megatron tables), or refused: the parser rejects an unknown flag, and :func:`not_built_reason` adds to that
error why slime's flag has no counterpart and what to use instead (config/flags.py), so a slime user is
never left with a bare "unknown flag". docs/migrating-from-slime.md lists the same text
(config/migration.py), and a test checks that every flag of slime's arguments.py (extracted from a
snapshot of THUDM/slime, tests/config/slime_fixtures/) has a row there.

slime's ``--sglang-*`` flags of its own (slime/backends/sglang_utils/arguments.py) are not SGLang server
arguments: passed through to ``sglang.launch_server`` they would stop it. ``--sglang-server-concurrency``
is a flag here (config/schema.py); the router address flags are refused in config/rollout_rules.py; the
rest are refused by :func:`slime_sglang_errors`.
"""

from __future__ import annotations

from .schema import Config

#: slime flag -> why it is not built here (and what to use instead); the parser refuses it as unknown
NOT_BUILT: dict[str, str] = {
    # placement, offload, environment
    "--num-gpus-per-node": "slime's GPUs per node for rollout engines on nodes of their own; engines this run "
                           "launches live on the trainer's nodes (--actor-num-gpus-per-node), engines elsewhere are "
                           "given by --rollout-engine-urls",
    "--offload": "use its two halves, --offload-train --offload-rollout (or --colocate, which implies both)",
    "--train-env-vars": "set the variables in the environment torchrun starts the ranks with",
    "--release-train": "slime recreates its Ray training actors around each rollout; the ranks here are "
                       "torchrun processes that live for the whole run (--offload-train frees their GPU memory)",
    "--qwen-gdn-backend": "slime's choice of gated delta-net kernel; the gated delta-net layers here are "
                          "this package's own (models/), there is no kernel to choose",
    "--custom-model-provider-path": "the model is built by the bridge of config.json's model_type "
                                    "(models/families.py); add a bridge for a new architecture",
    "--model-name": "slime's name for its megatron -> HF weight converter; the bridge of config.json's model_type "
                    "converts here",
    "--recompute-loss-function": "recomputing the loss in the backward pass is not built; activation memory is "
                                 "set by --recompute-granularity / --recompute-method",
    "--only-train-params-name-list": "freezing parameters by name is not built; --lora-rank trains adapters only",
    "--freeze-params-name-list": "freezing parameters by name is not built; --lora-rank trains adapters only",
    "--allgather-cp": "slime's contiguous context-parallel token layout, which slime itself allows for DSA models "
                      "only (DeepSeek-V3.2, GLM-5), and no bridge here builds DSA; context parallelism here splits "
                      "each sequence into megatron's load-balanced chunks and all-gathers K/V; drop it",
    "--data-pad-size-multiplier": "slime pads each packed micro-batch to a multiple of this for its kernels; the "
                                  "packer here pads to what TP x SP and 2 x CP need (pad tokens are masked, so the "
                                  "multiple changes no result, only memory); drop it",
    "--enable-experimental": "megatron-core's experimental features (slime's GLM-5 DSA spec needs them); no layer "
                             "built here uses one; drop it",
    # weight updates
    "--update-weight-disk-keep-files": "the disk transport keeps the newest versions only "
                                       "(rollout/weight_dir.py); not configurable yet",
    "--custom-update-weight-post-write-path": "a hook after the disk transport writes is not built; the disk "
                                              "transport writes each version under a temporary name and renames "
                                              "it into place complete",
    "--update-weight-local-checkpoint-dir": "engine-local checkpoint copies (/pull_weights) are not built; use "
                                            "--update-weight-transport disk with --update-weight-disk-dir on a "
                                            "shared filesystem, or distributed",
    "--update-weights-interval": "weights go to the engines after every training step (--async-mode one-step / "
                                 "full bound staleness instead)",
    # rollout
    "--rollout-max-context-len": "prompt and response are bounded apart: --rollout-max-prompt-len, "
                                 "--rollout-max-response-len (--seq-length is what the trainer holds)",
    "--rollout-skip-special-tokens": "responses are token ids here (trained as generated); decoded text keeps "
                                     "special tokens",
    "--rollout-stop": "stop strings are not built; give their token ids as --rollout-stop-token-ids",
    "--mask-offpolicy-in-partial-rollout": "with --partial-rollout every token keeps the log-prob of the weights "
                                           "that generated it; masking the older part is not built (--use-tis "
                                           "corrects for it)",
    "--rollout-sample-hook-path": "per-sample hooks are not built; a --custom-generate-function-path returns the "
                                  "sample it wants",
    "--custom-rollout-log-function-path": "custom rollout logging is not built; the rollout metrics are logged "
                                          "(docs/metrics.md)",
    "--custom-eval-rollout-log-function-path": "custom eval logging is not built; eval metrics are logged per set "
                                               "(eval/NAME/...)",
    "--buffer-filter-path": "slime's rollout buffer is not built; --dynamic-sampling-filter-path filters groups",
    "--rollout-data-postprocess-path": "a hook after the log-probs is not built",
    "--rollout-data-transport": "slime's Ray transport of rollout data; rollouts reach the ranks by "
                                "torch.distributed here, there is no transport to choose",
    "--rollout-health-check-interval": "the SGLang engines' health is polled at a fixed interval "
                                       "(rollout/sglang/health.py); not configurable yet",
    "--rollout-health-check-timeout": "the health poll's timeout is fixed (rollout/sglang/health.py); not "
                                      "configurable yet",
    "--rollout-health-check-first-wait": "engines are polled once /health answers after start-up "
                                         "(--rollout-engine-startup-timeout bounds the wait)",
    "--num-epoch": "give the number of rollouts as --num-rollout (epochs x prompts / --rollout-batch-size)",
    "--disable-rollout-global-dataset": "prompts always come from --prompt-data (a --rollout-function-path may "
                                        "ignore them)",
    "--data-source-path": "a custom data source class is not built; --prompt-data reads JSONL / parquet",
    "--apply-chat-template-kwargs": "extra chat-template arguments are not built; --apply-chat-template uses the "
                                    "tokenizer's template as is",
    "--start-rollout-id": "a run resumes from --load's latest checkpoint at its rollout (--no-auto-resume starts "
                          "over); starting at another id is not built",
    "--balance-by-flops": "the dynamic packer balances token counts (--use-dynamic-batch-size); FLOP-based "
                          "balancing is not built",
    "--log-probs-max-tokens-per-gpu": "the log-prob passes pack micro-batches by --max-tokens-per-gpu; a "
                                      "separate budget is not built",
    # evaluation
    "--eval-function-path": "evaluation generates with the rollout's generate function; a separate one is not "
                            "built",
    "--eval-config": "give the eval sets as --eval-prompt-data NAME PATH [NAME PATH ...]",
    "--skip-eval-before-train": "there is no evaluation before the first step here (--eval-interval counts from "
                                "the first rollout), so there is nothing to skip",
    "--eval-input-key": "eval sets are read with --input-key / --label-key / --tool-key",
    "--eval-label-key": "eval sets are read with --input-key / --label-key / --tool-key",
    "--eval-tool-key": "eval sets are read with --input-key / --label-key / --tool-key",
    "--eval-max-prompt-len": "eval prompts are bounded by --rollout-max-prompt-len",
    "--eval-min-new-tokens": "a minimum response length is not built",
    "--eval-max-context-len": "eval prompts and responses are bounded by --rollout-max-prompt-len and "
                              "--eval-max-response-len",
    # checkpoints
    "--ref-ckpt-step": "--ref-load takes a checkpoint dir (an iter_NNNNNNN dir or a model-only torch_dist dir); "
                       "point it at the step's dir",
    "--opd-teacher-ckpt-step": "--opd-teacher-load takes a dir; point it at the step's dir",
    # algorithm
    "--disable-compute-advantages-and-returns": "SFT and losses without advantages are not built (the loss is "
                                                "the policy loss)",
    "--use-rollout-entropy": "the entropy is computed in the training pass (--entropy-coef); an entropy of the "
                             "log-prob passes for custom masks is not built",
    "--reset-optimizer-states": "resetting the optimizer after each rollout is not built",
    "--use-stateless-adam": "a stateless Adam is not built",
    "--use-opsm": "off-policy sequence masking is not built; --use-rs --rs-level sequence masks sequences by "
                  "their importance ratio",
    "--opsm-delta": "off-policy sequence masking is not built",
    "--use-opd": "on-policy distillation is on when --opd-teacher-load and --opd-kl-coef are given",
    "--opd-type": "the teacher is a frozen model on the trainer's ranks (--opd-teacher-load, slime's 'megatron' "
                  "type); a teacher behind an SGLang server ('sglang') is not built",
    "--group-rm": "rewards are computed per sample; a group reward function is not built",
    "--custom-reward-post-process-path": "custom reward post-processing is not built; the group normalisation "
                                         "is set by --advantage-estimator, --disable-rewards-normalization, "
                                         "--grpo-std-level",
    "--custom-convert-samples-to-train-data-path": "the samples -> training batch conversion is not a hook here",
    "--rollout-buffer-url": "slime's external rollout buffer is not built; a --rollout-function-path can fetch "
                            "trajectories itself",
    "--fetch-trajectory-retry-times": "slime's external rollout buffer is not built",
    "--min-batch-collection-ratio": "slime's external rollout buffer is not built",
    "--rollout-task-type": "slime's external rollout buffer is not built",
    "--loss-mask-type": "slime's per-family SFT loss masks; SFT is not built (the loss mask here covers the "
                        "generated response tokens)",
    "--rollout-sample-filter-path": "per-sample loss filters are not built; --dynamic-sampling-filter-path "
                                    "filters groups",
    "--rollout-all-samples-process-path": "a hook over all samples (filtered ones included) is not built",
    # hooks into megatron
    "--custom-megatron-init-path": "hooks into megatron's initialisation are not built",
    "--custom-megatron-before-log-prob-hook-path": "hooks around the log-prob pass are not built",
    "--custom-megatron-before-train-step-hook-path": "hooks before the train step are not built",
    "--megatron-deepgemm-forward-layers": "slime's block-FP8 DeepGEMM forward (to match SGLang's FP8 numerics) "
                                          "needs transformer-engine layers, which this build does not use",
    "--megatron-deepgemm-forward-modules": "slime's block-FP8 DeepGEMM forward is not built (see "
                                           "--megatron-deepgemm-forward-layers)",
    "--megatron-deepgemm-moe-forward-layers": "slime's grouped DeepGEMM expert forward needs grouped-GEMM "
                                              "experts, which are not built",
    "--megatron-deepgemm-moe-forward-modules": "slime's grouped DeepGEMM expert forward is not built",
    # logging and debugging
    "--wandb-dir": "set WANDB_DIR in the environment (wandb reads it)",
    "--disable-wandb-random-suffix": "W&B names the run here (--wandb-group groups the runs); slime's name suffix "
                                     "does not exist",
    "--wandb-always-use-train-step": "every metric is logged at the rollout's step (rollout id + 1); a train-step "
                                     "axis is not built",
    "--log-multi-turn": "multi-turn statistics are not logged separately",
    "--log-passrate": "pass@n logging is not built",
    "--log-reward-category": "reward categories are not logged; a reward function's dict results are logged per "
                             "key",
    "--log-correct-samples": "logging the correct samples is not built",
    "--use-tensorboard": "TensorBoard logging is on when --tensorboard-dir is given",
    "--tb-project-name": "give the directory as --tensorboard-dir",
    "--tb-experiment-name": "give the directory as --tensorboard-dir",
    "--load-debug-rollout-data-subsample": "subsampling a debug rollout is not built",
    "--load-forge-rollout-data": "replaying dumped rollouts goes through --load-debug-rollout-data",
    "--save-debug-train-data": "saving the training batch is not built; --save-debug-rollout-data saves the "
                               "rollouts it is made of",
    "--dump-details": "slime's post-hoc dump is not built; --save-debug-rollout-data saves the rollouts",
    "--memory-snapshot-dir": "CUDA memory snapshots are not built",
    "--memory-snapshot-num-steps": "CUDA memory snapshots are not built",
    "--profile-target": "profiling hooks are not built",
    "--memory-recorder": "memory recording is not built",
    "--http-proxy": "set http_proxy / https_proxy in the environment",
    "--use-distributed-post": "slime's distributed HTTP posting of generate requests; each engine here gets one "
                              "batched /generate per call from the driver",
    "--ci-test": "slime's CI assertions",
    "--ci-disable-kl-checker": "slime's CI assertions",
    "--ci-train-rollout-logprob-abs-diff-threshold": "slime's CI assertions (train/mismatch_abs_logprob is "
                                                     "logged with --get-mismatch-metrics)",
    "--ci-save-grad-norm": "slime's CI assertions",
    "--ci-load-grad-norm": "slime's CI assertions",
    # slime/backends/sglang_utils/arguments.py
    "--prefill-num-servers": "prefill/decode disaggregation is not built: every engine here prefills and decodes",
    # Megatron-LM flags of slime's SFT scripts
    "--lr-warmup-fraction": "give the warm-up as --lr-warmup-iters (optimizer steps)",
    # Megatron-LM flags of slime's GLM-4 (model_type glm4), Llama 3 and AMD scripts
    "--rotary-interleaved": "GLM-4's interleaved RoPE (model_type glm4), a family no bridge here builds",
    "--post-self-attn-layernorm": "GLM-4's norm after attention (model_type glm4), a family no bridge here builds",
    "--post-mlp-layernorm": "GLM-4's norm after the MLP (model_type glm4), a family no bridge here builds",
    "--use-rope-scaling": "Llama-3.1's RoPE scaling (rope_type llama3) is not built: the llama bridge maps default "
                          "RoPE only and refuses such a checkpoint",
    "--no-offload-train": "--colocate here always frees the trainer's device memory for the engine (and back); "
                          "without --colocate nothing is offloaded unless --offload-train is given: drop it",
    "--no-offload-rollout": "--colocate here always releases the engine's memory while the trainer trains; without "
                            "--colocate nothing is released unless --offload-rollout is given: drop it",
}

#: flags of slime's arguments.py that are flags here too but sit in no script array of the page
#: (docs/migrating-from-slime.md lists them, with the rest of NOT_BUILT, under "other flags of arguments.py")
ARGUMENTS_PY_HERE: tuple[str, ...] = (
    "--train-backend", "--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data",
    "--save-debug-rollout-data", "--offload-train", "--offload-rollout", "--update-weight-transport",
    "--update-weight-disk-dir", "--check-weight-update-equal", "--log-probs-chunk-size", "--rollout-function-path",
    "--custom-generate-function-path", "--custom-rm-path", "--rollout-top-p", "--rollout-top-k",
    "--rollout-max-prompt-len", "--rollout-seed", "--partial-rollout", "--use-fault-tolerance", "--eval-temperature",
    "--eps-clip-c", "--use-unbiased-kl", "--normalize-advantages", "--disable-grpo-std-normalization",
    "--use-rollout-logprobs", "--tis-clip", "--tis-clip-low", "--use-routing-replay", "--use-rollout-routing-replay",
    "--opd-kl-coef", "--opd-teacher-load", "--wandb-mode", "--wandb-run-id",
)

#: slime's own ``--sglang-KEY`` flags (not SGLang server arguments), refused here: KEY -> why
SLIME_SGLANG_REFUSED: dict[str, str] = {
    "router_request_timeout_secs": "slime's timeout of one request through its router; here every /generate "
                                   "call (through a router or not) has --rollout-generate-timeout: use it",
    "config": "slime's YAML of SGLang server groups (prefill / decode workers, per-group overrides); "
              "prefill/decode disaggregation and server groups are not built: give the engines' arguments as "
              "--sglang-KEY flags and drop it",
}


def not_built_reason(flag: str) -> str | None:
    """Why slime's ``flag`` is refused here, or None when it is not one of slime's."""
    return NOT_BUILT.get(flag)


def slime_sglang_errors(cfg: Config) -> list[str]:
    """slime's own --sglang-* flags that reached the pass-through (they would stop sglang.launch_server)."""
    r = cfg.rollout
    errors = [f"--sglang-{key.replace('_', '-')} is slime's flag, not SGLang's: {why}"
              for key, why in SLIME_SGLANG_REFUSED.items() if key in r.sglang_args]
    if r.sglang_server_concurrency is not None and r.rollout_backend != "sglang":
        errors.append(f"--sglang-server-concurrency {r.sglang_server_concurrency} bounds the requests to SGLang "
                      f"engines, but --rollout-backend is {r.rollout_backend}: drop it")
    elif r.sglang_server_concurrency is not None and r.sglang_server_concurrency < 1:
        errors.append(f"--sglang-server-concurrency {r.sglang_server_concurrency} must be >= 1")
    return errors


__all__ = ["NOT_BUILT", "SLIME_SGLANG_REFUSED", "not_built_reason", "slime_sglang_errors"]
