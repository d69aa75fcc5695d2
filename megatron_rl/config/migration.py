"""docs/migrating-from-slime.md, generated from the flag tables (``python -m megatron_rl.config.docs``).

Why generated: what each slime flag does here is already stated once, in the schema's help
(config/schema.py), the architecture table (config/architecture.py), the Megatron flag
table (config/megatron_flags.py) and the table of slime flags not built here (config/slime_args.py).
This module lists every flag of slime's example scripts (``scripts/models/*.sh`` and
``scripts/run-*.sh``: Qwen2.5, Qwen3, Qwen3-Next, Qwen3.5, GLM-4.5/4.7/5, DeepSeek-V3/R1, Kimi-K2,
Moonlight) and every flag ``slime/utils/arguments.py`` and ``slime/backends/sglang_utils/arguments.py``
declare, and renders, per flag, its status and that text; :data:`NOTES` holds only what no table says
(slime semantics that differ). :data:`OFF_POLICY_PEERS` maps the off-policy correction settings of slime,
verl and AReaL (config keys, not flags) to ours. Tests check the file is current, that slime's launch
scripts (tests/config/slime_fixtures/scripts.json) use no flag missing here and that every flag of slime's
arguments.py has a row, so the page cannot drift from the parser or from slime.
"""

from __future__ import annotations

from pathlib import Path

from .architecture import ARCHITECTURE_FIELDS
from .megatron_flags import MEGATRON_FLAGS
from .schema import flag_name, iter_fields
from .slime_args import ARGUMENTS_PY_HERE, NOT_BUILT, SLIME_SGLANG_REFUSED

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-slime.md"

#: every flag of slime's example scripts, by the bash array it sits in (launcher line first)
SLIME_FLAGS: dict[str, tuple[str, ...]] = {
    "launcher (python3 train.py ...)": (
        "--actor-num-nodes", "--actor-num-gpus-per-node", "--colocate", "--rollout-num-gpus",
        "--update-weight-buffer-size", "--calculate-per-token-loss"),
    "MODEL_ARGS (scripts/models/*.sh)": (
        "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
        "--num-query-groups", "--kv-channels", "--vocab-size", "--swiglu", "--normalization", "--norm-epsilon",
        "--rotary-base", "--rotary-percent", "--position-embedding-type", "--use-rotary-position-embeddings",
        "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--attention-output-gate",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
        "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-layer-freq",
        "--moe-router-score-function", "--moe-router-dtype", "--moe-token-dispatcher-type", "--moe-grouped-gemm",
        "--moe-permute-fusion", "--moe-aux-loss-coeff", "--moe-token-drop-policy",
        "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", "--moe-router-load-balancing-type", "--moe-router-topk-scaling-factor",
        "--moe-router-num-groups", "--moe-router-group-topk", "--multi-latent-attention", "--q-lora-rank",
        "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor",
        "--mscale", "--mscale-all-dim", "--no-rope-fusion"),
    "MODEL_ARGS of the newer scripts (Qwen3-Next, Qwen3.5, GLM-4.7-Flash, GLM-5)": (
        "--spec", "--use-gated-attention", "--no-position-embedding", "--make-vocab-size-divisible-by",
        "--enable-experimental", "--allgather-cp"),
    "CKPT_ARGS": ("--hf-checkpoint", "--ref-load", "--load", "--save", "--save-interval"),
    "ROLLOUT_ARGS": (
        "--prompt-data", "--input-key", "--label-key", "--apply-chat-template", "--rollout-shuffle", "--rm-type",
        "--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len",
        "--rollout-temperature", "--global-batch-size", "--balance-data", "--over-sampling-batch-size",
        "--dynamic-sampling-filter-path", "--rm-url", "--num-steps-per-rollout", "--rollout-stop-token-ids"),
    "EVAL_ARGS": ("--eval-interval", "--eval-prompt-data", "--n-samples-per-eval-prompt", "--eval-max-response-len",
                  "--eval-top-p", "--eval-top-k"),
    "PERF_ARGS": (
        "--tensor-model-parallel-size", "--sequence-parallel", "--pipeline-model-parallel-size",
        "--context-parallel-size", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--recompute-granularity",
        "--recompute-method", "--recompute-num-layers", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
        "--data-pad-size-multiplier", "--log-probs-chunk-size"),
    "GRPO_ARGS": ("--advantage-estimator", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--kl-coef",
                  "--entropy-coef", "--eps-clip", "--eps-clip-high", "--use-tis"),
    "OPTIMIZER_ARGS": ("--optimizer", "--lr", "--lr-decay-style", "--weight-decay", "--adam-beta1", "--adam-beta2",
                       "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
                       "--use-precision-aware-optimizer"),
    "WANDB_ARGS": ("--use-wandb", "--wandb-project", "--wandb-group", "--wandb-team", "--wandb-host", "--wandb-key"),
    "SGLANG_ARGS": ("--rollout-num-gpus-per-engine", "--sglang-*", "--deterministic-mode"),
    "slime's own SGLang flags (slime/backends/sglang_utils/arguments.py; not SGLang server arguments)": (
        "--sglang-server-concurrency", "--sglang-router-ip", "--sglang-router-port",
        "--sglang-router-request-timeout-secs", "--sglang-config", "--prefill-num-servers"),
    "Megatron-LM flags of the other scripts (GLM-4, Llama 3, MiMo, AMD, FP8)": (
        "--max-position-embeddings", "--use-rope-scaling", "--rotary-interleaved", "--post-self-attn-layernorm",
        "--post-mlp-layernorm", "--transformer-impl", "--no-gradient-accumulation-fusion", "--no-offload-train",
        "--no-offload-rollout", "--seq-length", "--bf16", "--fp8-format", "--fp8-recipe"),
    "SFT_ARGS (scripts/run-qwen3.5-35B-A3B-sft.sh, run-qwen3-4B-base-sft.sh)": (
        "--loss-mask-type", "--num-epoch", "--disable-compute-advantages-and-returns", "--lr-warmup-fraction",
        "--min-lr", "--use-distributed-optimizer"),
    "algorithm hooks (slime/utils/arguments.py, not in the example scripts)": (
        "--custom-advantage-function-path", "--disable-rewards-normalization", "--get-mismatch-metrics",
        "--loss-type", "--custom-loss-function-path", "--custom-pg-loss-reducer-function-path",
        "--custom-tis-function-path", "--ref-update-interval", "--reward-key", "--eval-reward-key",
        "--true-on-policy-mode"),
    "multi-token prediction (slime/utils/arguments.py, GLM-4.5 / DeepSeek-V3 MTP)": (
        "--mtp-num-layers", "--enable-mtp-training", "--mtp-loss-scaling-factor"),
    "PPO / critic (slime/utils/arguments.py, not in the example scripts)": (
        "--gamma", "--lambd", "--value-clip", "--num-critic-only-steps", "--critic-lr", "--critic-lr-warmup-iters",
        "--critic-load", "--critic-save", "--critic-num-nodes", "--critic-num-gpus-per-node",
        "--megatron-config-path"),
    "other slime flags (slime/utils/arguments.py: data keys, external engines, saving, async)": (
        "--metadata-key", "--tool-key", "--multimodal-keys", "--rollout-external-engine-addrs", "--save-hf", "--keep-old-actor"),
    "weight sync (slime/utils/arguments.py)": (
        "--update-weight-mode", "--update-weight-delta-encoding", "--update-weight-delta-checksum",
        "--update-weight-disk-dir"),
    "MISC_ARGS": ("--attention-dropout", "--hidden-dropout", "--accumulate-allreduce-grads-in-fp32",
                  "--attention-softmax-in-fp32", "--attention-backend", "--moe-enable-deepep",
                  "--no-masked-softmax-fusion", "--no-check-for-nan-in-loss-and-grad"),
}
_LISTED = {f for flags in SLIME_FLAGS.values() for f in flags}
SLIME_FLAGS["every other flag of slime/utils/arguments.py"] = tuple(
    sorted((set(NOT_BUILT) | set(ARGUMENTS_PY_HERE)) - _LISTED))

_SGLANG_LAUNCHED = ("the engines this run launches (python -m sglang.launch_server from each node's local rank 0; "
                    "docs/sglang.md); with these flags --rollout-backend auto picks SGLang, as slime always does")

#: (status, text) where the tables alone would not say what a slime user needs to know
NOTES: dict[str, tuple[str, str]] = {
    "--update-weight-mode": ("differs", "delta: the same idea (only the changed bits, per tensor, against the "
                             "version the engine holds; xor or overwrite), applied by the embedded engine in this "
                             "process, in place, over --update-weight-transport tensor or disk; into SGLang servers on "
                             "the trainer's host over disk as slime does it (a host-local checkpoint patched, the "
                             "changed tensors reloaded with /update_weights_from_disk; the driver patches it, no "
                             "SGLang fork needed). A patching process beside servers on other hosts is not built: "
                             "delta to them is refused. Where slime compares in "
                             "the trainer's HF dtype, this compares in the engine's (a bf16 engine gets only what "
                             "changes its bf16 values)."),
    "--update-weight-delta-checksum": ("differs", "xxh3-128 (default) and adler32 as slime's, sha256 where slime has "
                                       "blake3 (refused). Also the checksum --update-weight-verify compares after "
                                       "every sync."),
    "--sequence-parallel": ("same", "Shards activations over the TP group. At TP 1 it has no effect, as in "
                            "Megatron-LM (slime's Qwen2.5-0.5B script passes it at TP 1); start-up logs that."),
    "--rollout-num-gpus": ("same", "GPUs of " + _SGLANG_LAUNCHED + "; colocated: the trainer's, separate: the GPUs "
                           "the trainer leaves free on its own nodes (rollout nodes of their own: start SGLang there "
                           "and give --rollout-engine-urls)."),
    "--rollout-num-gpus-per-engine": ("same", "GPUs (--tp-size) of each of " + _SGLANG_LAUNCHED + "; an engine "
                                      "bigger than a node takes whole nodes (--nnodes parts, docs/sglang.md)."),
    "--sglang-*": ("same", "Passed through verbatim to " + _SGLANG_LAUNCHED + " (several values become a list, "
                   "e.g. --sglang-cuda-graph-bs 1 2 4 8); the ones the launcher sets (port, host, tp-size, "
                   "model-path, ...) are refused by name; slime's --sglang-router-ip / --sglang-router-port (a "
                   "running router) are refused naming --rollout-engine-urls http://IP:PORT, which takes a router "
                   "(generation through it, weights to the workers it lists)."),
    "--sglang-router-ip": ("refused", "slime's address of a running sglang-router: refused naming "
                           "--rollout-engine-urls http://IP:PORT, which takes a router (generation through it, "
                           "weights to the workers it lists); --rollout-router on starts one."),
    "--sglang-router-port": ("refused", "As --sglang-router-ip."),
    "--multimodal-keys": ("same", "Same JSON map (only \"image\"); its images (paths, bytes, base64) are read "
                          "and run through the checkpoint's own image processor, and train with a Qwen2.5-VL "
                          "checkpoint on the megatron backend and the embedded engine (docs/vlm.md); SGLang's "
                          "image_data and the FSDP backend are refused by name."),
    "--optimizer-cpu-offload": ("same", "megatron: megatron-core's hybrid CPU optimizer. Implies "
                                "--use-distributed-optimizer (Megatron-LM requires it; slime always turns it on). "
                                "fsdp: FSDP2's CPUOffloadPolicy."),
    "--rm-type": ("same", "Built-in rewards exact_match, math and deepscaler (slime's rule; graded with the "
                  "numeric / normalised-string subset of slime's mathd + sympy check), f1 and the boxed_ prefix "
                  "(boxed_exact_match, boxed_f1) as slime's; slime's other rm_hub names "
                  "(dapo, gpqa, ifbench, random) are refused while parsing flags: use --custom-rm-path (slime's "
                  "reward_func runs unchanged); for remote_rm give --rm-url alone."),
    "--rm-url": ("same", "slime's --rm-type remote_rm --rm-url URL is --rm-url URL alone here (it excludes "
                 "--rm-type). slime posts one sample per request and reads the reply as the reward; here a "
                 "request carries a batch, {\"samples\": [{\"prompt\", \"response\", \"label\", ...}]}, "
                 "answered by {\"rewards\": [...]} (docs/agentic.md, \"Reward servers\")."),
    "--dynamic-sampling-filter-path": ("same", "slime's filter signature fn(args, samples) and its dotted paths; "
                                       "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std "
                                       "(and _with_fallback) name the built-in filters here. Kept groups beyond "
                                       "the batch are dropped, as in slime; a batch still short after "
                                       "--dynamic-sampling-max-rounds stops the run (slime samples on without "
                                       "end)."),
    "--custom-advantage-function-path": ("same", "slime's fn(args, rollout_data) contract: args holds every flag "
                                         "by its slime name; rollout_data the per-sample rewards (group-normalised "
                                         "as slime), raw_reward, response_lengths, total_lengths, loss_masks, "
                                         "log_probs, ref_log_probs, rollout_log_probs, kl, values (the critic's "
                                         "with --advantage-estimator ppo, else None); the function sets "
                                         "rollout_data['advantages'], and with a critic rollout_data['returns'] "
                                         "(read only then). Imported and its arity checked at start-up; "
                                         "docs/algorithms.md."),
    "--value-clip": ("same", "The clip of the critic's value loss; the loss is verl's (0.5 * the max of the clipped "
                     "and unclipped squared errors, through --loss-agg-mode; slime's has no 0.5): "
                     "docs/algorithms.md, 'PPO with a critic'."),
    "--num-critic-only-steps": ("same", "The first N rollouts train the critic only (no actor update, no train/* "
                                "metrics); slime's semantics."),
    "--critic-lr-warmup-iters": ("same", "Linear warm-up of the critic's LR over its first N optimizer steps."),
    "--critic-load": ("differs", "The critic's initial trunk as a model-only torch_dist dir (convert_ckpt.py "
                      "hf-to-dist); a run's critic resumes from its --save checkpoints (beside the actor), so "
                      "slime's critic checkpoint dirs do not load. HF weights: --critic-hf-checkpoint."),
    "--critic-save": ("refused", "Not built yet as a separate dir: the critic goes into each --save checkpoint."),
    "--critic-num-nodes": ("same", "The critic runs on the actor's ranks, as slime's (which sets these to the "
                           "actor's counts): the actor's value is accepted, another is refused. Its own layout "
                           "on those ranks: --critic-tensor-model-parallel-size / "
                           "--critic-pipeline-model-parallel-size (slime's critic must share the actor's)."),
    "--critic-num-gpus-per-node": ("same", "As --critic-num-nodes: the actor's value is accepted, another "
                                   "refused."),
    "--megatron-config-path": ("differs", "slime's role YAML (megatron: [{role, overrides}]): an actor entry's "
                               "keys are this engine's flag names; a critic entry may set "
                               "tensor_model_parallel_size, pipeline_model_parallel_size (its own layout, which "
                               "slime leaves unsupported), lr and lr_warmup_iters; any other critic key (save, "
                               "load, optimizer knobs) is refused by name. The overrides win over the command "
                               "line, as in slime."),
    "--get-mismatch-metrics": ("same", "Logs train/mismatch_abs_logprob and train/mismatch_k3_kl (mean |train - "
                               "rollout| log-prob, k3 KL) without correcting; slime pairs it with a "
                               "--custom-tis-function-path, here it stands alone."),
    "--true-on-policy-mode": ("differs", "slime and miles run their FSDP trainer and SGLang with "
                              "--sglang-enable-deterministic-inference on GPUs; here the embedded engine and the "
                              "megatron trainer (TP1, fp32, dense) run under this engine's batch-invariant CPU ops, "
                              "and the layouts not yet invariant are refused by name (docs/on-policy.md)."),
    "--loss-type": ("refused (custom_loss, sft_loss)", "policy_loss (the default) is the loss here; sft_loss is "
                    "refused (SFT is not built); custom_loss is refused "
                    "with --custom-loss-function-path (below)."),
    "--custom-loss-function-path": ("refused", "slime's fn(args, batch, logits, sum_of_sample_mean) works on its "
                                    "own batch dict and per-micro-batch reducer; losses here are normalised over "
                                    "the whole step, so a slime loss would not run unchanged. Use the built-in "
                                    "terms or register a Spec (algorithms/spec.py)."),
    "--custom-pg-loss-reducer-function-path": ("refused", "Denominators here are global over micro-batches and DP "
                                               "ranks; Dr.GRPO's constant divisor is --loss-agg-mode "
                                               "seq_mean_token_sum_norm."),
    "--custom-tis-function-path": ("refused", "slime's built-ins are flags here: vanilla_tis_function = --use-tis, "
                                   "icepop_function = --use-tis --tis-mode mask (table below)."),
    "--enable-mtp-training": ("partial", "The MTP loss (token t+2+d at depth d, loss-masked response tokens, "
                              "divided by the step's loss-token count) is added to the policy loss and, as in "
                              "slime, trains only the MTP layers; megatron backend at any TP (+SP), PP, CP, EP "
                              "and DP (LoRA and fsdp are refused). Metric train/mtp_loss."),
    "--mtp-loss-scaling-factor": ("same", "Weight of --enable-mtp-training's loss, divided by --mtp-num-layers "
                                  "as megatron does (default 0.2)."),
    "--rollout-external-engine-addrs": ("same", "An alias of --rollout-engine-urls: servers you run, host:port "
                                        "(read as http://host:port) or a URL each. slime asks each engine's "
                                        "/server_info for its GPUs and puts a router of its own in front; here "
                                        "each URL is a server (or a router) talked to as given, and the weights "
                                        "go by --update-weight-transport disk or distributed (docs/sglang.md)."),
    "--save-hf": ("refused", "slime writes an HF copy at every save; not built into the run here. Export a "
                  "saved iter_NNNNNNN with tools/convert_ckpt.py dist-to-hf (or slime's "
                  "tools/convert_torch_dist_to_hf.py, the same converter; fsdp-to-hf for --train-backend fsdp)."),
    "--keep-old-actor": ("refused", "slime keeps the weights that generated a rollout on the trainer for the old "
                         "log-probs; no such copy is kept here. With --async-mode off the old log-probs come from "
                         "those weights anyway; under --async-mode one-step / full use --use-rollout-logprobs (the "
                         "generating engine's log-probs) or --use-tis / --use-rs."),
    "--eval-prompt-data": ("same", "One JSONL file (metrics eval/reward_mean), or slime's named sets NAME "
                           "PATH [NAME PATH ...] with metrics eval/NAME/reward_mean and eval/NAME/response_len_mean."),
}

#: off-policy correction: (peer, its setting, the flags here). verl's and AReaL's are config keys, not flags,
#: and slime's MIS settings are keys of its example's YAML (examples/train_infer_mismatch_helper/mis.yaml), so
#: none of them is parsed here: this table says what to write instead (docs/algorithms.md has the formulas).
OFF_POLICY_PEERS: tuple[tuple[str, str, str], ...] = (
    ("slime", "--use-tis --tis-clip C --tis-clip-low L", "the same flags (token-level truncated IS)"),
    ("slime", "--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function",
     "--use-tis --tis-mode mask (with the same --tis-clip / --tis-clip-low)"),
    ("slime MIS", "tis_level, tis_mode: truncate | mask, tis_upper_bound, tis_lower_bound",
     "--tis-level, --tis-mode, --tis-cap, --tis-clip-low (slime's unset lower bound is 1 / upper in clip and "
     "mask mode; here it is 0: give it)"),
    ("slime MIS", "tis_mode: clip", "--tis-mode truncate --tis-clip-low L"),
    ("slime MIS", "use_rs, rs_level, rs_upper_bound, rs_lower_bound",
     "--use-rs, --rs-level, --rs-upper-bound, --rs-lower-bound"),
    ("verl", "rollout_is: token | sequence, rollout_is_threshold: C",
     "--use-tis --tis-level token | sequence --tis-cap C"),
    ("verl", "rollout_rs: token | sequence | geometric, rollout_rs_threshold: U, rollout_rs_threshold_lower: L",
     "--use-rs --rs-level token | sequence | geometric --rs-upper-bound U --rs-lower-bound L"),
    ("verl", "rollout_rs: token_k1 | seq_sum_k1 | seq_mean_k1, rollout_rs_threshold: 'L_U'",
     "--use-rs --rs-level token | sequence | geometric --rs-lower-bound 1/U --rs-upper-bound 1/L (verl's k1 is "
     "rollout - old, the log of the reciprocal ratio)"),
    ("AReaL", "use_decoupled_loss: true, behav_imp_weight_cap: C",
     "--use-tis --tis-mode mask --tis-cap C (AReaL's proximal policy is the old log-probs recomputed here)"),
    ("AReaL", "rejection_sampling: {level: token | sequence, action: mask | clamp, metric: ratio, agg: mean, "
     "upper: C, lower: L}",
     "--use-tis --tis-level token | geometric --tis-mode mask | truncate --tis-cap C --tis-clip-low L"),
)

_OFF_POLICY_NOT_BUILT = ("Not built: verl's k2 / k3 / seq_max rejection criteria and rollout_is_batch_normalize, "
                         "slime MIS's rs_veto_threshold and tis_batch_normalize, AReaL's KL-metric rejection "
                         "sampling and prox_logp_method approximations.")

_DEFAULTS = """## Defaults that differ from slime

slime sets some Megatron arguments itself (`_set_default_megatron_args`) and picks some
components for you; here each is a flag, so a script that relied on slime's choice states it:

| slime | here |
|---|---|
| always the distributed optimizer | `--use-distributed-optimizer` (implied by `--optimizer-cpu-offload`) |
| bf16 unless `--fp16` | fp32 unless `--bf16` (or `--fp16`) |
| SGLang engines always | SGLang when a flag sizes or configures it (`--rollout-backend auto`), else the embedded engine; `--rollout-backend sglang` says so outright; servers you run: `--rollout-engine-urls` |
| weight update by CUDA IPC when colocated, NCCL broadcast otherwise | the same by default (`--update-weight-transport auto`: `tensor` colocated, `distributed` separate); `disk` on request |
| evaluation samples at `--rollout-temperature` unless `--eval-temperature` | greedy evaluation unless `--eval-temperature` > 0 (so `--eval-top-p` < 1 or `--eval-top-k` > 1 need it) |
| Megatron-LM dropout defaults (0.1) | 0, from config.json (slime's scripts pass 0 anyway) |
| model built from MODEL_ARGS, weights converted into it | model built from `--hf-checkpoint`'s config.json; MODEL_ARGS are checked against it and a mismatch is refused by name |
| `tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint HF --save DIR` writes `DIR/release/` | the same command (over `tools/convert_ckpt.py`, MODEL_ARGS checked against config.json) writes the model-only torch_dist dir `DIR`, which `--ref-load DIR` / `--load DIR` take as it is; `tools/convert_torch_dist_to_hf.py --input-dir --output-dir --origin-hf-dir` as slime's (docs/convert.md) |
"""


def _help(field: str) -> str:
    for _, _, f in iter_fields():
        if f.name == field:
            return f.metadata["help"]
    raise KeyError(field)


def _fields_by_flag() -> dict[str, str]:
    out = {}
    for _, _, f in iter_fields():
        out[flag_name(f)] = f.name
        for alias in f.metadata["aliases"]:
            out[alias] = f.name
    return out


def slime_flag_status(flag: str) -> tuple[str, str]:
    """(status, what it does here) of one slime flag: NOTES first, then the tables, then the schema."""
    if flag in NOTES:
        return NOTES[flag]
    if flag in NOT_BUILT:
        return "not built yet", NOT_BUILT[flag] + ". Refused as an unknown flag, with this reason."
    key = flag[len("--sglang-"):].replace("-", "_")
    if flag.startswith("--sglang-") and key in SLIME_SGLANG_REFUSED:
        return "refused", SLIME_SGLANG_REFUSED[key] + "."
    field = _fields_by_flag().get(flag)
    if field is None:
        raise KeyError(f"{flag} is neither a flag here nor in NOTES; say what it does (config/migration.py)")
    if field in ARCHITECTURE_FIELDS:
        return "checked", _help(field)
    for row in MEGATRON_FLAGS:
        if row.field == field:
            status = "refused for a real run" if row.effect.startswith("refused") else row.effect.split(":")[0]
            return status, row.effect[0].upper() + row.effect[1:] + "."
    return "same", _help(field)


def render() -> str:
    lines = [
        "# Migrating from slime",
        "",
        "Generated by `python -m megatron_rl.config.docs` from the flag tables (config/migration.py); do not edit "
        "by hand (a test fails when this file is stale).",
        "",
        "A slime launch script runs here with `python -m megatron_rl.train` in place of `ray job submit ... "
        "python3 train.py`: the flags keep their names. `--dry-run` validates a script and prints its plan "
        "without starting anything, also on a machine without the checkpoint (the model shape then comes from "
        "the MODEL_ARGS). Statuses: **same** (same name, same meaning), **mapped** (set on megatron-core's "
        "config), **checked** (compared with `--hf-checkpoint`'s config.json, refused on a mismatch), "
        "**refused for a real run** (`--dry-run` accepts it), **refused** (validation refuses it, saying why), "
        "**not built yet** (no such flag here: the parser refuses it as unknown, with the reason in this table). "
        "Flags that need "
        "a GPU or transformer-engine are refused for a real run on a machine without them, before any "
        "worker starts; `--dry-run` lists what they need.",
        "",
        "slime's functions (`--custom-generate-function-path`, `--rollout-function-path`, `--custom-rm-path` written "
        "as `generate(args, sample, sampling_params)`, `generate_rollout(args, rollout_id, data_source, ...)`, "
        "`reward_func(args, sample, **kwargs)`) run unchanged: [slime-functions.md](slime-functions.md).",
        "",
    ]
    for array, flags in SLIME_FLAGS.items():
        lines += [f"## {array}", "", "| flag | status | here |", "|---|---|---|"]
        for flag in flags:
            status, text = slime_flag_status(flag)
            lines.append(f"| `{flag}` | {status} | {text.replace('|', '/')} |")
        lines.append("")
    lines.append(_DEFAULTS)
    lines += ["## Off-policy correction: verl, slime and AReaL settings", "",
              "Formulas, metrics and sources: docs/algorithms.md, \"Off-policy correction\".", "",
              "| peer | setting | here |", "|---|---|---|"]
    for peer, setting, here in OFF_POLICY_PEERS:
        lines.append(f"| {peer} | `{setting.replace('|', '/')}` | {here.replace('|', '/')} |")
    lines += ["", _OFF_POLICY_NOT_BUILT, ""]
    return "\n".join(lines)


def all_slime_flags() -> list[str]:
    return [f for flags in SLIME_FLAGS.values() for f in flags]


__all__ = ["DOC_PATH", "NOTES", "OFF_POLICY_PEERS", "SLIME_FLAGS", "all_slime_flags", "render",
           "slime_flag_status"]
