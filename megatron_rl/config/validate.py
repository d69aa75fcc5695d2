"""All cross-flag validation on the finished frozen ``Config`` (the engine x transport rules and the
SGLang interpreter probe: ``rollout_rules.py``).

Every problem found is collected and reported together (a user fixing a launch
script wants the whole list, not one error per attempt). Each message names the
flag(s), the value(s) and the fix. Nothing here touches a GPU, a file's content
beyond small JSON configs, or a process group, so it runs before any worker.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re

from megatron_rl.errors import ConfigError

from .schema import Config, flag_name, iter_fields
from .architecture import (ALL_HEADS_QK_NORM_TYPES, MLA_TYPES, EXPERT_BIAS_TYPES, LINEAR_ATTENTION_TYPES, architecture_errors,
                           dry_run_without_checkpoint, hf_is_moe, hf_model_type, hf_num_key_value_heads, hf_num_layers)
from .lora_rules import modules_to_save_errors
from .multimodal import parse_multimodal_keys
from .vlm_rules import vision_language_errors
from .role_models import fit_errors, own_model_dir
from .paths import PROMPTS_READ_TWICE, dir_problem, file_problem, within
from .on_policy_rules import true_on_policy_errors
from .speculative_rules import speculative_errors
from .rollout_rules import NotBuilt, refuse_unimplemented_rollout_and_sync
from .megatron_flags import MEGATRON_FLAGS, megatron_flag_errors
from .slime_args import slime_sglang_errors
from .placement import allocation_errors, model_shape_for_config, plan_errors, world_errors


def domain_errors(cfg: Config) -> list[str]:
    """Every number flag outside its declared domain (``schema.Domain``): NaN, +-inf, or out of range.

    One walk over the schema instead of an ``if`` per flag, so a flag added later is covered by
    declaring its domain (``tests/config/test_float_domains.py`` fails on a float flag without one).
    Unset optional flags (None) are skipped."""
    errors = []
    for group, _, f in iter_fields():
        domain = f.metadata.get("domain")
        value = getattr(getattr(cfg, group), f.name)
        if domain is None or value is None or isinstance(value, bool):
            continue
        if not domain.contains(float(value)):
            what = "is not a finite number" if not math.isfinite(float(value)) else "is out of range"
            errors.append(f"{flag_name(f)} {value:g} {what}: it must lie in {domain} "
                          f"(default {_default_text(f)}); docs/flags.md")
    return errors


def _default_text(f) -> str:
    return "unset" if f.default is None else f"{f.default:g}"


def _check_positive(errors: list[str], cfg: Config) -> None:
    p, b = cfg.parallel, cfg.batching
    for flag, value in [
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--context-parallel-size", p.context_parallel_size),
        ("--expert-model-parallel-size", p.expert_model_parallel_size),
        ("--actor-num-nodes", cfg.placement.actor_num_nodes),
        ("--actor-num-gpus-per-node", cfg.placement.actor_num_gpus_per_node),
        ("--rollout-batch-size", b.rollout_batch_size),
        ("--n-samples-per-prompt", b.n_samples_per_prompt),
        ("--micro-batch-size", b.micro_batch_size),
        ("--num-rollout", cfg.rollout.num_rollout),
        ("--rollout-max-response-len", cfg.rollout.rollout_max_response_len),
        ("--rollout-max-prompt-len", cfg.rollout.rollout_max_prompt_len),
        ("--update-weight-buffer-size", cfg.sync.update_weight_buffer_size),
        ("--rm-batch-size", cfg.data.rm_batch_size),
        ("--rm-max-concurrency", cfg.data.rm_max_concurrency),
        ("--dynamic-sampling-max-rounds", cfg.rollout.dynamic_sampling_max_rounds),
    ]:
        if value < 1:
            errors.append(f"{flag} {value} must be >= 1")
    for flag, value_or_unset in [
        ("--expert-tensor-parallel-size", p.expert_tensor_parallel_size),
        ("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size),
        ("--global-batch-size", b.global_batch_size),
        ("--max-tokens-per-gpu", b.max_tokens_per_gpu),
        ("--log-probs-chunk-size", b.log_probs_chunk_size),
        ("--save-interval", cfg.checkpoint.save_interval),
        ("--save-max-to-keep", cfg.checkpoint.save_max_to_keep),
        ("--eval-interval", cfg.data.eval_interval),
        ("--over-sampling-batch-size", cfg.rollout.over_sampling_batch_size),
        ("--num-steps-per-rollout", b.num_steps_per_rollout),
    ]:
        if value_or_unset is not None and value_or_unset < 1:
            errors.append(f"{flag} {value_or_unset} must be >= 1 (or left unset)")
    if cfg.rollout.rollout_abort_retries < 0:
        errors.append(f"--rollout-abort-retries {cfg.rollout.rollout_abort_retries} must be >= 0 (0: no retry)")
    if cfg.data.rm_max_retries < 0:
        errors.append(f"--rm-max-retries {cfg.data.rm_max_retries} must be >= 0 (0: no retry)")


def _check_parallel(errors: list[str], cfg: Config) -> None:
    p = cfg.parallel
    world = cfg.actor_world_size
    mp = p.model_parallel_size
    if cfg.has_training and world % mp:
        errors.append(
            f"training world size {world} (--actor-num-nodes {cfg.placement.actor_num_nodes} x "
            f"--actor-num-gpus-per-node {cfg.placement.actor_num_gpus_per_node}) is not divisible by "
            f"TP x PP x CP = {p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
            f"{p.context_parallel_size} = {mp}; change the GPU count or the parallel sizes")
    if p.virtual_pipeline_model_parallel_size is not None and p.pipeline_model_parallel_size < 2:
        errors.append("--virtual-pipeline-model-parallel-size needs --pipeline-model-parallel-size > 1 "
                      f"(got {p.pipeline_model_parallel_size}); drop the VPP flag or raise PP")
    ep = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if ep > 1 and cfg.has_training and world % mp == 0:
        # megatron-core builds expert groups from the ranks of one PP stage: EP x ETP must divide them.
        per_stage = world // p.pipeline_model_parallel_size
        if per_stage % (ep * etp):
            errors.append(f"--expert-model-parallel-size {ep} x expert TP {etp} = {ep * etp} does not divide "
                          f"the {per_stage} ranks of a pipeline stage; choose EP x ETP dividing {per_stage}")
    tp = p.tensor_model_parallel_size
    if (cfg.has_training and cfg.precision.train_backend == "megatron" and tp > 1 and ep == 1
            and p.expert_tensor_parallel_size == 1 and hf_is_moe(cfg)):
        errors.append(f"--tensor-model-parallel-size {tp} with --expert-tensor-parallel-size 1 and "
                      "--expert-model-parallel-size 1 trains an MoE model with wrong expert gradients in "
                      "megatron-core 0.16.1: with EP 1 it reduces the experts' gradients over data parallelism only, "
                      "while each TP rank's copy of an expert saw other tokens (docs/parity.md); use "
                      f"--expert-model-parallel-size > 1 (e.g. {tp}) or --expert-tensor-parallel-size {tp}")
    if (cfg.has_training and cfg.precision.train_backend == "megatron" and etp > 1
            and hf_model_type(cfg) in EXPERT_BIAS_TYPES):
        errors.append(f"expert tensor parallelism {etp} (--expert-tensor-parallel-size, default the TP size) with "
                      f"a {hf_model_type(cfg)} model: megatron-core 0.16.1 adds each expert's fc2 bias on every "
                      "expert-TP rank before their partial outputs are summed (docs/parity.md); pass "
                      "--expert-tensor-parallel-size 1 (with --expert-model-parallel-size > 1 at TP > 1)")
    kv_heads = hf_num_key_value_heads(cfg) if hf_model_type(cfg) in ALL_HEADS_QK_NORM_TYPES else None
    if cfg.has_training and cfg.precision.train_backend == "megatron" and kv_heads is not None and tp > kv_heads:
        errors.append(f"--tensor-model-parallel-size {tp} > num_key_value_heads={kv_heads} with a "
                      f"{hf_model_type(cfg)} model: its key norm spans all key heads, and a key head replicated over "
                      f"TP ranks would count once per copy (docs/parity.md); pass --tensor-model-parallel-size <= "
                      f"{kv_heads}")
    if (cfg.has_training and cfg.precision.train_backend == "megatron" and p.context_parallel_size > 1
            and hf_model_type(cfg) in LINEAR_ATTENTION_TYPES):
        errors.append(f"--context-parallel-size {p.context_parallel_size} with a {hf_model_type(cfg)} model: its gated "
                      "delta-net (linear attention) layers carry a recurrent state and a convolution window along "
                      "the sequence, which megatron_rl does not hand from one CP rank to the next (docs/parity.md); "
                      "pass --context-parallel-size 1")
    if cfg.precision.train_backend == "fsdp":
        for flag, value in [("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                            ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                            ("--context-parallel-size", p.context_parallel_size),
                            ("--expert-model-parallel-size", ep),
                            ("--expert-tensor-parallel-size", p.expert_tensor_parallel_size or 1)]:
            if value != 1:
                errors.append(f"--train-backend fsdp shards over data parallelism only; {flag} {value} "
                              "must be 1 (use --train-backend megatron for TP/PP/CP/EP)")
        for flag, given in [("--sequence-parallel", p.sequence_parallel),
                            ("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size),
                            ("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                            ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)]:
            if given:
                errors.append(f"{flag} is a megatron parallelism knob; --train-backend fsdp has no tensor or "
                              f"pipeline parallelism: drop {flag} (or use --train-backend megatron)")


def _check_batching(errors: list[str], cfg: Config) -> None:
    b = cfg.batching
    if b.use_dynamic_batch_size and b.max_tokens_per_gpu is None:
        errors.append("--use-dynamic-batch-size needs --max-tokens-per-gpu N (the packed token budget per GPU)")
    if b.balance_data and not b.use_dynamic_batch_size:
        errors.append("--balance-data balances token counts over data-parallel ranks, which the packer does with "
                      "--use-dynamic-batch-size (fixed --micro-batch-size micro-batches are split by position): "
                      "add --use-dynamic-batch-size --max-tokens-per-gpu N, or drop --balance-data")
    if b.max_tokens_per_gpu is not None and not b.use_dynamic_batch_size:
        errors.append("--max-tokens-per-gpu only applies with --use-dynamic-batch-size; add that flag "
                      "or drop --max-tokens-per-gpu")
    n = b.samples_per_rollout
    gbs = b.effective_global_batch_size
    steps = b.num_steps_per_rollout
    if steps is not None and steps >= 1 and n % steps:
        errors.append(f"--num-steps-per-rollout {steps} does not divide --rollout-batch-size {b.rollout_batch_size} "
                      f"x --n-samples-per-prompt {b.n_samples_per_prompt} = {n} samples per rollout; choose a "
                      f"divisor of {n}")
    elif steps is not None and steps >= 1 and b.global_batch_size is not None and b.global_batch_size * steps != n:
        errors.append(f"--num-steps-per-rollout {steps} with --global-batch-size {b.global_batch_size}: {steps} "
                      f"steps of {b.global_batch_size} samples is not the {n} samples of a rollout; give one of "
                      "them")
    elif n % gbs:
        errors.append(f"--rollout-batch-size {b.rollout_batch_size} x --n-samples-per-prompt "
                      f"{b.n_samples_per_prompt} = {n} samples per rollout is not divisible by "
                      f"--global-batch-size {gbs}; choose a global batch size that divides {n}")
    dp = max(cfg.data_parallel_size, 1)
    if cfg.has_training and not b.use_dynamic_batch_size and gbs % (b.micro_batch_size * dp):
        errors.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {b.micro_batch_size} x "
                      f"data-parallel size {dp}; adjust one of them or use --use-dynamic-batch-size")
    if cfg.has_training and gbs < dp:
        errors.append(f"--global-batch-size {gbs} is smaller than the data-parallel size {dp}: "
                      "some ranks would get no sample")


#: fp16 loss-scale flags: (field, default, what makes a value valid, the rule in words)
_LOSS_SCALE_FLAGS = (
    ("loss_scale", None, lambda v: v > 0, "must be > 0"),
    ("initial_loss_scale", 2.0 ** 32, lambda v: v > 0, "must be > 0"),
    ("min_loss_scale", 1.0, lambda v: v > 0, "must be > 0"),
    ("loss_scale_window", 1000, lambda v: v >= 1, "must be >= 1"),
    ("hysteresis", 2, lambda v: v >= 1, "must be >= 1"),
)


def _check_loss_scale(errors: list[str], pr) -> None:
    """Loss scaling exists only in fp16 (bf16 and fp32 have fp32's exponent range): a loss-scale
    flag without --fp16 would do nothing, so it is refused, as are values megatron-core's
    grad scalers assert against."""
    for name, default, valid, rule in _LOSS_SCALE_FLAGS:
        value = getattr(pr, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value == default:
            continue
        if not pr.fp16:
            errors.append(f"{flag} {value} only acts with --fp16 (bf16 and fp32 train without loss scaling); "
                          f"add --fp16 or drop {flag}")
        elif not valid(value):
            errors.append(f"{flag} {value} {rule}")
    if pr.fp16 and pr.loss_scale is None and pr.min_loss_scale > pr.initial_loss_scale:
        errors.append(f"--min-loss-scale {pr.min_loss_scale} is above --initial-loss-scale "
                      f"{pr.initial_loss_scale}; lower it")


def _check_precision(errors: list[str], cfg: Config) -> None:
    pr, opt = cfg.precision, cfg.optimizer
    if pr.bf16 and pr.fp16:
        errors.append("--bf16 and --fp16 are mutually exclusive; pick one")
    _check_loss_scale(errors, pr)
    if pr.fp8_format and importlib.util.find_spec("transformer_engine") is None:
        errors.append(f"--fp8-format {pr.fp8_format} needs transformer-engine, which is not installed "
                      "(pip install 'megatron_rl[fp8]' on a GPU machine), or drop --fp8-format")
    if pr.fp8_format and pr.train_backend == "fsdp":
        errors.append("--fp8-format is only supported with --train-backend megatron")
    _check_fp8_knobs(errors, cfg)
    if opt.optimizer_cpu_offload and not opt.use_precision_aware_optimizer and pr.train_backend == "megatron":
        errors.append("--optimizer-cpu-offload needs --use-precision-aware-optimizer, as in Megatron-LM: "
                      "megatron-core's hybrid device optimizer saves and loads its state through that "
                      "flag's code path (without it a resume fails)")
    if opt.optimizer_offload_fraction != 1.0 and not opt.optimizer_cpu_offload:
        errors.append(f"--optimizer-offload-fraction {opt.optimizer_offload_fraction} has no effect without "
                      "--optimizer-cpu-offload; add it or drop --optimizer-offload-fraction")
    if opt.min_lr > opt.lr:
        errors.append(f"--min-lr {opt.min_lr} is above --lr {opt.lr}")


_FP8_DELAYED_ONLY = (("--fp8-margin", "fp8_margin", 0), ("--fp8-amax-history-len", "fp8_amax_history_len", 1),
                     ("--fp8-amax-compute-algo", "fp8_amax_compute_algo", "most_recent"))


def _check_fp8_knobs(errors: list[str], cfg: Config) -> None:
    """A knob that would change nothing is refused, so no run believes it is tuned when it is not.

    Why delayed-only: megatron-core (fp8_utils.get_fp8_recipe) passes margin and amax
    settings only to TE's DelayedScaling; the other recipes ignore them.
    """
    pr = cfg.precision
    changed = [(name, getattr(pr, field)) for name, field, default in _FP8_DELAYED_ONLY
               if getattr(pr, field) != default]
    if not pr.fp8_format:
        extra = changed + ([("--fp8-recipe", pr.fp8_recipe)] if pr.fp8_recipe != "delayed" else []) \
            + ([("--fp8-param-gather", True)] if pr.fp8_param_gather else [])
        for name, value in extra:
            errors.append(f"{name} {value} has no effect without --fp8-format; add --fp8-format e4m3|hybrid "
                          f"or drop {name}")
        return
    if pr.fp8_recipe != "delayed":
        for name, value in changed:
            errors.append(f"{name} {value} only tunes the delayed recipe, not --fp8-recipe {pr.fp8_recipe}; "
                          f"drop {name} or use --fp8-recipe delayed")
    if pr.fp8_margin < 0:
        errors.append(f"--fp8-margin {pr.fp8_margin} must be >= 0")
    if pr.fp8_amax_history_len < 1:
        errors.append(f"--fp8-amax-history-len {pr.fp8_amax_history_len} must be >= 1")
    if pr.fp8_param_gather and not cfg.optimizer.effective_distributed_optimizer:
        errors.append("--fp8-param-gather keeps FP8 weights that only the distributed optimizer's main "
                      "params update; add --use-distributed-optimizer or drop --fp8-param-gather")


def _check_modes(errors: list[str], cfg: Config) -> None:
    m = cfg.mode
    if m.train_only and m.debug_rollout_only:
        errors.append("--debug-train-only (or --load-debug-rollout-data) and --debug-rollout-only are mutually "
                      "exclusive: one trains without an engine, the other generates without training")
    if m.debug_train_only and not m.load_debug_rollout_data:
        errors.append("--debug-train-only has no engine to generate with: give --load-debug-rollout-data "
                      "PATTERN (saved earlier with --save-debug-rollout-data)")
    for flag, pattern in [("--load-debug-rollout-data", m.load_debug_rollout_data),
                          ("--save-debug-rollout-data", m.save_debug_rollout_data)]:
        if pattern is not None and "{rollout_id}" not in pattern:
            errors.append(f"{flag} {pattern} must contain '{{rollout_id}}' (e.g. rollouts/{{rollout_id}}.pt)")


def _check_memory(errors: list[str], cfg: Config) -> None:
    m = cfg.memory
    if m.ref_weights_location == "device" and m.effective_offload_train:
        which = "--colocate" if m.colocate else "--offload-train"
        errors.append(f"--ref-weights-location device with {which}: the trainer hands its GPU memory to the "
                      f"rollout engine between steps, and reference copies on the device would stay there; use "
                      f"--ref-weights-location host (or auto, which picks host here)")
    if m.offload_train_groups == "on":
        if not m.effective_offload_train:
            errors.append("--offload-train-groups on destroys the trainer's process groups while it sleeps, and it "
                          "sleeps only with --offload-train or --colocate: add one of them (or drop the flag)")
        if cfg.precision.train_backend != "megatron":
            errors.append(f"--offload-train-groups on with --train-backend {cfg.precision.train_backend}: only the "
                          "megatron backend rebuilds its process groups after a sleep (FSDP2's device mesh keeps "
                          "its groups); drop the flag")


def _check_eval(errors: list[str], cfg: Config) -> None:
    """Evaluation sets (one PATH, or slime's NAME PATH pairs) and evaluation sampling."""
    d = cfg.data
    items = [d.eval_prompt_data] if isinstance(d.eval_prompt_data, str) else list(d.eval_prompt_data or [])
    if len(items) > 1 and len(items) % 2:
        errors.append(f"--eval-prompt-data {' '.join(items)}: give one PATH, or NAME PATH pairs (slime's named "
                      f"sets, e.g. aime /data/aime.jsonl gsm8k /data/gsm8k.jsonl); got {len(items)} values")
        return
    names = [n for n, _ in d.eval_sets if n is not None]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        errors.append(f"--eval-prompt-data names {', '.join(dup)} more than once; each set needs its own name "
                      "(its metrics are eval/NAME/...)")
    for name, path in d.eval_sets if cfg.has_rollout_engine else ():
        if (why := file_problem(path, PROMPTS_READ_TWICE)) is not None:
            errors.append(f"--eval-prompt-data {(name + ' ') if name else ''}{path}: {why}")
    sampling = [("--eval-temperature", d.eval_temperature if d.eval_temperature != 0.0 else None),
                ("--eval-top-p", d.eval_top_p), ("--eval-top-k", d.eval_top_k),
                ("--eval-max-response-len", d.eval_max_response_len)]
    if not items:
        for flag, value in sampling:
            if value is not None:
                errors.append(f"{flag} {value} sets evaluation sampling, but there is no evaluation: add "
                              f"--eval-prompt-data or drop {flag}")
        return
    if d.eval_top_k is not None and d.eval_top_k != -1 and d.eval_top_k < 1:
        errors.append(f"--eval-top-k {d.eval_top_k} must be >= 1, or -1 (no top-k)")
    if d.eval_max_response_len is not None and d.eval_max_response_len < 1:
        errors.append(f"--eval-max-response-len {d.eval_max_response_len} must be >= 1")
    if d.eval_temperature == 0:  # greedy: the most likely token, whatever the sampling filters keep
        if d.eval_top_p is not None and d.eval_top_p < 1:
            errors.append(f"--eval-top-p {d.eval_top_p} filters sampling, but evaluation is greedy "
                          "(--eval-temperature 0) and would not change: add --eval-temperature > 0 or drop it")
        if d.eval_top_k is not None and d.eval_top_k > 1:
            errors.append(f"--eval-top-k {d.eval_top_k} filters sampling, but evaluation is greedy "
                          "(--eval-temperature 0) and would not change: add --eval-temperature > 0 or drop it")


def _check_checkpoint_and_data(errors: list[str], cfg: Config) -> None:
    c, d, a = cfg.checkpoint, cfg.data, cfg.algorithm
    if c.save_interval is not None and not c.save:
        errors.append("--save-interval needs --save ROOT (where checkpoints go)")
    if c.save_max_to_keep is not None and not c.save:
        errors.append("--save-max-to-keep needs --save ROOT")
    if c.save_hf is not None:
        errors.append(f"--save-hf {c.save_hf}: refused; an HF export at every save is not built into the run. Export "
                      "a saved checkpoint instead: tools/convert_ckpt.py dist-to-hf --input SAVE/iter_NNNNNNN "
                      "--output DIR (or slime's tools/convert_torch_dist_to_hf.py --input-dir ... --output-dir ...; "
                      "--train-backend fsdp: convert_ckpt.py fsdp-to-hf): drop --save-hf")
    if cfg.has_training and not c.load and not c.save and not cfg.model.hf_checkpoint:
        errors.append("no model to train: give --hf-checkpoint DIR (or --load a checkpoint)")
    if (cfg.model.hf_checkpoint and not os.path.isfile(os.path.join(cfg.model.hf_checkpoint, "config.json"))
            and not dry_run_without_checkpoint(cfg)):  # a dry run elsewhere plans from the architecture flags
        errors.append(f"--hf-checkpoint {cfg.model.hf_checkpoint}: no config.json there; point it at an HF model "
                      "directory (config.json + *.safetensors)")
    if c.opd_teacher_load is None and a.opd_kl_coef > 0:
        errors.append(f"--opd-kl-coef {a.opd_kl_coef} needs a teacher: give --opd-teacher-load PATH")
    if d.eval_interval is not None and not d.eval_prompt_data:
        errors.append("--eval-interval needs --eval-prompt-data FILE")
    _check_eval(errors, cfg)
    if d.rm_type and d.custom_rm_path:
        errors.append("--rm-type and --custom-rm-path are mutually exclusive; pick one reward")
    if cfg.has_rollout_engine and d.custom_rm_path:  # slime's dotted module.reward_func too
        _function_path_errors(errors, "--custom-rm-path", d.custom_rm_path, "(e.g. my_rewards:score)")
    for path in d.prompt_files if cfg.has_rollout_engine else ():
        if why := file_problem(path, PROMPTS_READ_TWICE):
            errors.append(f"--prompt-data {path}: {why}")
    _check_verl_data(errors, cfg)
    if a.kl_loss_coef > 0 and not a.use_kl_loss:
        errors.append(f"--kl-loss-coef {a.kl_loss_coef} weights the KL loss term, which only exists with "
                      "--use-kl-loss; add --use-kl-loss or drop --kl-loss-coef")
    if a.tis_cap <= 0:
        errors.append(f"--tis-cap {a.tis_cap} must be > 0")
    rt = cfg.runtime
    if rt.wall_time_limit is not None and rt.wall_time_reserve >= rt.wall_time_limit:
        errors.append(f"--wall-time-reserve {rt.wall_time_reserve:g}s leaves no time inside "
                      f"--wall-time-limit {rt.wall_time_limit:g}s; lower the reserve or raise the limit")


def _check_multimodal_keys(errors: list[str], cfg: Config) -> None:
    """--multimodal-keys' map, and what a vision-language checkpoint may be combined with (config/vlm_rules.py;
    a text checkpoint with the flag is refused by the image processor's own check, data/images.py, which
    names the checkpoint's model_type)."""
    value = cfg.data.multimodal_keys
    if value is not None:
        try:
            parse_multimodal_keys(value)
        except ConfigError as exc:
            errors.append(str(exc))
    errors.extend(vision_language_errors(cfg))


def _check_verl_data(errors: list[str], cfg: Config) -> None:
    """A .parquet prompt file is verl's schema (data/verl_parquet.py): its prompts are chat messages, rendered through
    the chat template as verl always does, and its label and metadata have fixed places, so the JSONL key flags
    would be ignored: given another value than their default, they are refused."""
    d = cfg.data
    files = [("--prompt-data", p) for p in d.prompt_files] + [("--eval-prompt-data", p) for _, p in d.eval_sets]
    parquet = [(flag, path) for flag, path in files if path and str(path).endswith(".parquet")]
    if not parquet or not cfg.has_rollout_engine:
        return
    flag, path = parquet[0]
    if not d.apply_chat_template:
        errors.append(f"{flag} {path} is verl's parquet schema, whose prompts are chat messages: pass "
                      "--apply-chat-template (verl renders every prompt through the tokenizer's chat template)")
    for key_flag, value, default in (("--label-key", d.label_key, "label"), ("--metadata-key", d.metadata_key,
                                                                              "metadata"), ("--tool-key", d.tool_key,
                                                                                            "tools")):
        if value != default:
            errors.append(f"{key_flag} {value!r} does not apply to {flag} {path}: in verl's parquet schema the "
                          "label is reward_model.ground_truth and data_source / extra_info / ability are the "
                          f"metadata; drop {key_flag}")


def _check_reward_model(errors: list[str], cfg: Config) -> None:
    """--reward-model-path: a one-label sequence classifier, scored on the trainer's ranks between generation and
    training (backends/reward_model.py), so nothing that needs a reward before then can use it."""
    d = cfg.data
    path = d.reward_model_path
    if not path:
        tuned = [f for f, on in (("--reward-model-weight", d.reward_model_weight != 1.0),
                                 ("--reward-model-micro-batch-size", d.reward_model_micro_batch_size != 16)) if on]
        if tuned:
            errors.append(f"{' and '.join(tuned)} tune --reward-model-path's model; add --reward-model-path DIR or "
                          f"drop {' and '.join(tuned)}")
        return
    if d.reward_model_micro_batch_size < 1:
        errors.append(f"--reward-model-micro-batch-size {d.reward_model_micro_batch_size} must be >= 1")
    flag = f"--reward-model-path {path}"
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        errors.append(f"{flag}: no readable config.json there ({e}); give an HF AutoModelForSequenceClassification "
                      "dir")
        return
    archs = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        errors.append(f"{flag}: its config.json names {archs or 'no architecture'}, not a *ForSequenceClassification "
                      "model; a reward model is a sequence classifier with one label (save it with "
                      "AutoModelForSequenceClassification)")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
    if labels not in (None, 1):
        errors.append(f"{flag}: its head has {labels} labels; a reward model scores with one (num_labels 1)")
    has_rule = bool(d.rm_type or d.custom_rm_path or d.rm_url or d.custom_reward_function_path)
    if not cfg.has_training:
        errors.append(f"{flag} scores on the trainer's ranks, and this run trains nothing (--debug-rollout-only): "
                      "give the rollout a --rm-type/--custom-rm-path/--rm-url reward instead")
    why = "needs every reward when the samples are generated, and the reward model scores them on the trainer's ranks " \
          "right before training"
    if cfg.rollout.dynamic_sampling_filter_path:
        errors.append(f"--dynamic-sampling-filter-path with {flag}: the filter {why}; drop one of them")
    if cfg.algorithm.advantage_estimator == "remax":
        errors.append(f"--advantage-estimator remax with {flag}: its greedy baseline's reward {why}; use grpo or "
                      "reinforce_plus_plus, or a rule reward")
    if d.eval_prompt_data and not has_rule:
        errors.append(f"--eval-prompt-data with {flag} alone: evaluation scores on the driver, outside the training "
                      "step where the reward model runs; give evaluation a --rm-type/--custom-rm-path/--rm-url "
                      "reward (the reward model's score adds to it in training) or drop --eval-prompt-data")


_BUILTIN_STD_FILTERS = ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback")


def _check_rewards_and_dynamic_sampling(errors: list[str], cfg: Config) -> None:
    """One reward source; the reward server's and dynamic sampling's knobs only with the flag they tune."""
    d, r, b = cfg.data, cfg.rollout, cfg.batching
    if d.custom_reward_function_path:
        others = [f for f, v in (("--rm-type", d.rm_type), ("--custom-rm-path", d.custom_rm_path)) if v]
        if others:
            errors.append(f"--custom-reward-function-path {d.custom_reward_function_path} and {' and '.join(others)} "
                          "each name the reward: pick one")
    elif d.custom_reward_function_kwargs:
        errors.append("--custom-reward-function-kwargs are the keyword arguments of --custom-reward-function-path's "
                      "function: add --custom-reward-function-path or drop them")
    if d.rm_url:
        given = [f for f, v in (("--rm-type", d.rm_type), ("--custom-rm-path", d.custom_rm_path),
                                ("--custom-reward-function-path", d.custom_reward_function_path)) if v]
        if given:
            errors.append(f"--rm-url {d.rm_url} scores every sample on the reward server, and {' and '.join(given)} "
                          "would score them again: pick one reward (drop --rm-url or "
                          f"{' and '.join(given)})")
        if not re.match(r"https?://[^/\s]+", d.rm_url):
            errors.append(f"--rm-url {d.rm_url} must be an http:// or https:// URL (e.g. http://localhost:8000/score)")
    else:
        tuned = [f"{flag_name(f)} {getattr(d, f.name)}" for f in dataclasses.fields(d)
                 if f.name.startswith("rm_") and f.name not in ("rm_url", "rm_type") and getattr(d, f.name) != f.default]
        if tuned:
            errors.append(f"{', '.join(tuned)} tune the reward server, which only --rm-url names: add --rm-url URL "
                          f"or drop {', '.join(t.split()[0] for t in tuned)}")
    _check_reward_shaping(errors, cfg)
    _check_reward_model(errors, cfg)
    _check_multimodal_keys(errors, cfg)
    if not r.dynamic_sampling_filter_path:
        tuned = [f for f, on in (("--over-sampling-batch-size", r.over_sampling_batch_size is not None),
                                 ("--dynamic-sampling-max-rounds", r.dynamic_sampling_max_rounds != 10)) if on]
        if tuned:
            errors.append(f"{' and '.join(tuned)} size the rounds of dynamic sampling, which only "
                          "--dynamic-sampling-filter-path turns on (e.g. megatron_rl.rollout.dynamic_sampling:"
                          f"check_reward_nonzero_std): add it or drop {' and '.join(tuned)}")
        return
    if (r.dynamic_sampling_filter_path.rpartition(":")[2].rpartition(".")[2] in _BUILTIN_STD_FILTERS
            and b.n_samples_per_prompt < 2):
        errors.append(f"--dynamic-sampling-filter-path {r.dynamic_sampling_filter_path} drops groups whose rewards "
                      f"do not vary, and a group of --n-samples-per-prompt {b.n_samples_per_prompt} never varies: "
                      "sample at least 2 responses per prompt")
    if not cfg.has_rollout_engine:
        errors.append(f"--dynamic-sampling-filter-path {r.dynamic_sampling_filter_path} filters generated groups, "
                      "but this run generates nothing (--debug-train-only / --load-debug-rollout-data): drop it")


def _check_reward_shaping(errors: list[str], cfg: Config) -> None:
    """DAPO's overlong buffer inside the response bound; a clip range of two ordered numbers."""
    d, max_len = cfg.data, cfg.rollout.rollout_max_response_len
    if d.overlong_buffer_len < 0 or (d.overlong_buffer_len and d.overlong_buffer_len >= max_len):
        errors.append(f"--overlong-buffer-len {d.overlong_buffer_len} must be in [1, --rollout-max-response-len "
                      f"{max_len}): the penalty ramps over the last N tokens below the bound (0 turns it off)")
    if not d.overlong_buffer_len and d.overlong_penalty_factor != 1.0:
        errors.append(f"--overlong-penalty-factor {d.overlong_penalty_factor} sizes DAPO's overlong penalty, which "
                      "only --overlong-buffer-len N turns on: add it or drop --overlong-penalty-factor")
    clip = d.reward_clip_range
    if clip and (len(clip) != 2 or not clip[0] < clip[1]):  # a YAML config may give any list
        errors.append(f"--reward-clip-range {' '.join(str(v) for v in clip)} needs two numbers LOW HIGH with "
                      "LOW < HIGH, e.g. --reward-clip-range -10 10")


AGENT_GENERATE = "megatron_rl.rollout.agent:generate"


def _function_path_errors(errors: list[str], flag: str, value: str, example: str) -> None:
    """A user function's path in a form the loader reads (``infra/user_function.py``): module:function,
    path/to/file.py:function or slime's dotted module.function; a named file must exist."""
    module, sep, fn = value.rpartition(":")
    if not sep and not value.endswith(".py"):  # slime's dotted form, module.function
        module, sep, fn = value.rpartition(".")
    if not sep or not module or not fn:
        errors.append(f"{flag} {value} must be module:function, path/to/file.py:function or module.function "
                      f"{example}")
    elif module.endswith(".py") and not os.path.isfile(module):
        errors.append(f"{flag} {value}: no such file {module}")


def _check_rollout_functions(errors: list[str], cfg: Config) -> None:
    """``--custom-generate-function-path`` / ``--rollout-function-path`` (docs/agentic.md): their form here
    (the driver imports them, ``rollout/generate_fn.py::load_function``, before the engine loads), what they
    exclude, and the tool loop's flags only with a generate function that reads them."""
    r = cfg.rollout
    gen, batch = r.custom_generate_function_path, r.rollout_function_path
    for flag, value in (("--custom-generate-function-path", gen), ("--rollout-function-path", batch)):
        if value is None:
            continue
        _function_path_errors(errors, flag, value, "(e.g. my_rollout:generate)")
        if not cfg.has_rollout_engine:
            errors.append(f"{flag} {value} generates rollouts, but this run generates nothing (--debug-train-only / "
                          f"--load-debug-rollout-data): drop it")
    agent = r.agent_function_path
    if agent is not None:
        _function_path_errors(errors, "--agent-function-path", agent, "(e.g. my_agent:agent)")
        if not cfg.has_rollout_engine:
            errors.append(f"--agent-function-path {agent} generates rollouts, but this run generates nothing "
                          "(--debug-train-only / --load-debug-rollout-data): drop it")
        for flag, value in (("--custom-generate-function-path", gen), ("--rollout-function-path", batch)):
            if value:
                errors.append(f"--agent-function-path {agent} generates every sample through the agent endpoint, "
                              f"so {flag} {value} would never be called: keep one")
        if r.async_mode == "full" and r.partial_rollout:
            errors.append(f"--agent-function-path {agent} with --async-mode full --partial-rollout: a partial "
                          "rollout resumes a row cut by a weight sync, which cannot resume an agent's own state "
                          "between requests: drop --partial-rollout (a cut group is generated again whole)")
    if gen and batch:
        errors.append(f"--rollout-function-path {batch} generates the whole batch, so --custom-generate-function-path "
                      f"{gen} would never be called: keep one (the batch function may call the group function "
                      "itself)")
    for flag, value, unit in (("--custom-generate-function-path", gen, "group"),
                              ("--rollout-function-path", batch, "batch")):
        if r.async_mode == "full" and value and r.partial_rollout:
            errors.append(f"{flag} {value} with --async-mode full --partial-rollout: a partial rollout continues a "
                          "row cut by a weight sync by resubmitting prompt + its tokens to the engine, which cannot "
                          "resume a function's own state between turns (its tool calls, the observations it "
                          f"appended): drop --partial-rollout (a cut {unit} is generated again whole)")
    tuned = [f"{flag_name(f)} {getattr(r, f.name)}" for f in dataclasses.fields(r)
             if f.name in ("tools", "max_turns", "tool_timeout") and getattr(r, f.name) != f.default]
    if tuned and not gen:
        errors.append(f"{', '.join(tuned)} configure the tool loop of a generate function: add "
                      f"--custom-generate-function-path {AGENT_GENERATE} (or your own function that reads them) "
                      f"or drop {', '.join(t.split()[0] for t in tuned)}")
    if r.max_turns < 1:
        errors.append(f"--max-turns {r.max_turns} must be >= 1 (one model turn at least)")
    if r.tools is not None and ":" not in r.tools:
        errors.append(f"--tools {r.tools} must be module:REGISTRY (a dict of tool name -> callable)")
    _check_sandbox(errors, r)


def _check_sandbox(errors: list[str], r) -> None:
    """The --sandbox-* limits (infra/sandbox.py): whole numbers >= 1 (the wall bound has its domain), an
    absolute interpreter path. Whether this machine can give the sandbox at all, and start Python under these
    limits, is checked where the sandbox is used, at start-up (``infra.sandbox.check_sandbox``)."""
    for name in ("cpu_seconds", "memory_mb", "file_size_mb", "disk_mb", "processes", "open_files", "output_bytes"):
        value = getattr(r, "sandbox_" + name)
        if value < 1:
            errors.append(f"--sandbox-{name.replace('_', '-')} {value} must be >= 1")
    if r.sandbox_python is not None and not os.path.isabs(r.sandbox_python):
        errors.append(f"--sandbox-python {r.sandbox_python} must be an absolute path (the sandbox's PATH is "
                      "/usr/local/bin:/usr/bin:/bin, not yours)")


def _check_slime_algorithm_hooks(errors: list[str], cfg: Config) -> None:
    """slime's user-function flags of the algorithm: --custom-advantage-function-path in a loadable form (the
    Spec imports it and checks its arity at start-up), the rest refused with the reason (their help)."""
    a = cfg.algorithm
    path = a.custom_advantage_function_path
    if path is not None:
        _function_path_errors(errors, "--custom-advantage-function-path", path,
                              "(e.g. my_adv:compute), a function fn(args, rollout_data)")
    if a.disable_rewards_normalization and a.advantage_estimator not in ("grpo", "gspo",
                                                                         "reinforce_plus_plus_baseline"):
        errors.append(f"--disable-rewards-normalization turns off the group baseline of grpo / gspo / "
                      f"reinforce_plus_plus_baseline (as slime); --advantage-estimator {a.advantage_estimator} "
                      "never normalises rewards: drop it")
    if a.loss_type == "custom_loss" or a.custom_loss_function_path is not None:
        errors.append("--loss-type custom_loss / --custom-loss-function-path: refused. slime calls the function as "
                      "fn(args, batch, logits, sum_of_sample_mean) with its own batch dict and per-micro-batch "
                      "reducer; here losses are normalised over the whole step (docs/algorithms.md), so a slime "
                      "loss would not run unchanged. Use the built-in terms or register a Spec "
                      "(megatron_rl.algorithms.spec.register_spec)")
    if a.loss_type == "sft_loss":
        errors.append("--loss-type sft_loss: refused. slime's SFT (its sft_rollout, --loss-mask-type, "
                      "--num-epoch) is not built here: this trains with the policy loss on generated rollouts")
    if a.custom_pg_loss_reducer_function_path is not None:
        errors.append(f"--custom-pg-loss-reducer-function-path {a.custom_pg_loss_reducer_function_path}: refused. "
                      "slime's reducer divides one micro-batch's pg_loss by a count of its own; here the "
                      "denominators are global over micro-batches and DP ranks. For Dr.GRPO's constant divisor use "
                      "--loss-agg-mode seq_mean_token_sum_norm")
    if a.custom_tis_function_path is not None:
        errors.append(f"--custom-tis-function-path {a.custom_tis_function_path}: refused. slime's built-ins are "
                      "flags here: vanilla_tis_function = --use-tis, icepop_function = --use-tis --tis-mode mask; "
                      "other levels and rejection sampling: --tis-level, --use-rs (docs/algorithms.md)")
    if a.keep_old_actor:
        errors.append("--keep-old-actor: refused; no copy of the weights that generated a rollout is kept on the "
                      f"trainer. With --async-mode off the old log-probs already come from those weights; with "
                      f"--async-mode {cfg.rollout.async_mode if cfg.rollout.async_mode != 'off' else 'one-step / full'}"
                      " use --use-rollout-logprobs (the generating engine's log-probs as the old ones) or correct "
                      "towards them with --use-tis / --use-rs: drop --keep-old-actor")
    d = cfg.data
    if d.eval_reward_key is not None and not d.eval_sets:
        errors.append(f"--eval-reward-key {d.eval_reward_key} picks the reward evaluation reports, but this run "
                      "evaluates nothing: add --eval-prompt-data or drop it")
    if a.ref_update_interval is not None:
        n = a.ref_update_interval
        if not (a.use_kl_loss or a.kl_coef > 0):
            errors.append(f"--ref-update-interval {n} replaces the reference model, which this run does not use: "
                          "add --use-kl-loss (or --kl-coef) or drop it")
        c = cfg.checkpoint
        if c.save and c.save_interval and c.save_interval % n:
            errors.append(f"--ref-update-interval {n} with --save-interval {c.save_interval}: a resume restores "
                          f"the reference from a checkpoint at a multiple of {n} only (other checkpoints do not "
                          f"hold it); use a --save-interval that is a multiple of {n}")


def _check_policy_loss(errors: list[str], a) -> None:
    """--policy-loss-type and the new estimators: what PolicyGradientConfig refuses, said before workers start."""
    kind = a.policy_loss_type
    tau_set = (a.sapo_tau_pos, a.sapo_tau_neg) != (1.0, 1.05)
    if kind != "sapo" and tau_set:
        errors.append(f"--sapo-tau-pos {a.sapo_tau_pos} / --sapo-tau-neg {a.sapo_tau_neg} shape the SAPO gate: add "
                      "--policy-loss-type sapo or drop them")
    for flag, value, default, owner in (("--clip-cov-ratio", a.clip_cov_ratio, 2e-4, "clip_cov"),
                                        ("--clip-cov-lb", a.clip_cov_lb, 1.0, "clip_cov"),
                                        ("--clip-cov-ub", a.clip_cov_ub, 5.0, "clip_cov"),
                                        ("--kl-cov-ratio", a.kl_cov_ratio, 2e-4, "kl_cov"),
                                        ("--ppo-kl-coef", a.ppo_kl_coef, 0.1, "kl_cov")):
        if kind != owner and value != default:
            errors.append(f"{flag} {value} configures --policy-loss-type {owner}: add that or drop it")
    if kind == "clip_cov" and not a.clip_cov_lb < a.clip_cov_ub:
        errors.append(f"--clip-cov-lb {a.clip_cov_lb} must be below --clip-cov-ub {a.clip_cov_ub} (verl's defaults: "
                      "1.0 and 5.0)")
    if kind == "vanilla":
        return
    if a.advantage_estimator == "gspo":
        errors.append(f"--policy-loss-type {kind} with --advantage-estimator gspo: GSPO is itself a policy loss "
                      "(verl's loss_mode gspo); use --advantage-estimator grpo with it, or drop --policy-loss-type")
    if a.eps_clip_c is not None:
        errors.append(f"--eps-clip-c {a.eps_clip_c}: dual clip is part of the vanilla PPO loss, not of "
                      f"--policy-loss-type {kind}; drop it")
    if kind in ("geo_mean", "sapo") and a.loss_agg_mode not in (None, "seq_mean_token_mean"):
        errors.append(f"--policy-loss-type {kind} is a mean over sequences (verl aggregates it with "
                      f"seq-mean-token-mean whatever loss_agg_mode says): --loss-agg-mode {a.loss_agg_mode} is "
                      "refused; use seq_mean_token_mean or leave it unset")
    if kind == "geo_mean":
        for flag, on, level in (("--use-tis", a.use_tis, a.tis_level), ("--use-rs", a.use_rs, a.rs_level)):
            if on and level == "token":
                errors.append(f"--policy-loss-type geo_mean with {flag} at token level: GMPO's objective is one "
                              "ratio per sequence, so its off-policy weight must be one per sequence too: add "
                              f"{flag.replace('use-', '')}-level geometric (or sequence)")


def _check_algorithm(errors: list[str], cfg: Config) -> None:
    """Algorithm flags that contradict each other or would do nothing (see docs/algorithms.md)."""
    a = cfg.algorithm
    if a.grpo_std_level != "group":
        off = [f for f, on in (("--disable-grpo-std-normalization", a.disable_grpo_std_normalization),
                               ("--disable-rewards-normalization", a.disable_rewards_normalization)) if on]
        if a.advantage_estimator not in ("grpo", "gspo"):
            errors.append(f"--grpo-std-level {a.grpo_std_level} picks the std of a GRPO/GSPO advantage; "
                          f"--advantage-estimator {a.advantage_estimator} has none: drop it")
        elif off:
            errors.append(f"--grpo-std-level {a.grpo_std_level} picks the std GRPO divides by, but {off[0]} "
                          "divides by none: keep one of the two")
    if (a.kl_coef > 0 and a.advantage_estimator not in ("reinforce_plus_plus", "ppo")
            and not a.custom_advantage_function_path):
        errors.append(f"--kl-coef {a.kl_coef} folds KL into the rewards, which only --advantage-estimator "
                      f"reinforce_plus_plus does (and ppo, in its GAE rewards), or a --custom-advantage-function-path reading rollout_data['kl'] "
                      f"(slime ignores it for {a.advantage_estimator}); use --use-kl-loss "
                      "--kl-loss-coef for a KL term in the loss, or --kl-coef 0")
    if a.kl_ctrl_type == "adaptive" and not (a.kl_coef > 0 and a.advantage_estimator == "reinforce_plus_plus"
                                             and not a.custom_advantage_function_path):
        errors.append("--kl-ctrl-type adaptive adapts the KL coefficient folded into the rewards: it needs "
                      "--advantage-estimator reinforce_plus_plus with --kl-coef > 0 (the starting value) and no "
                      "--custom-advantage-function-path (which applies its own coefficient)")
    tuned = [f"{n} {v:g}" for n, v, d in (("--kl-target", a.kl_target, 0.1), ("--kl-horizon", a.kl_horizon, 10000.0))
             if v != d]
    if tuned and a.kl_ctrl_type != "adaptive":
        errors.append(f"{' and '.join(tuned)} tune the adaptive KL controller, which only --kl-ctrl-type adaptive "
                      "turns on: add it or drop them")
    _check_slime_algorithm_hooks(errors, cfg)
    if a.advantage_estimator == "gspo" and a.loss_agg_mode == "token_mean":
        errors.append("--advantage-estimator gspo with --loss-agg-mode token_mean weights each sequence by its "
                      "length, but GSPO's objective is a mean over sequences (GSPO paper, verl): use "
                      "--loss-agg-mode seq_mean_token_mean, or leave it unset (the gspo default)")
    _check_policy_loss(errors, a)
    if a.advantage_estimator == "remax" and cfg.rollout.async_mode == "full":
        errors.append("--advantage-estimator remax with --async-mode full: ReMax's baseline is one greedy response per "
                      "prompt generated with the group's weights, and the full-async producer streams groups "
                      "generated across weight versions without it; use --async-mode one-step or off, or grpo/rloo")
    if a.tis_clip_low and not a.use_tis:
        errors.append(f"--tis-clip-low {a.tis_clip_low} bounds the TIS weight, which only exists with --use-tis; "
                      "add --use-tis or drop --tis-clip-low")
    if not 0 <= a.tis_clip_low < a.tis_cap:
        errors.append(f"--tis-clip-low {a.tis_clip_low} must be in [0, --tis-cap {a.tis_cap}), e.g. 0.5")
    if a.use_unbiased_kl and not (a.use_kl_loss and a.kl_loss_coef > 0):
        errors.append("--use-unbiased-kl weights the KL loss term, which needs --use-kl-loss --kl-loss-coef > 0; "
                      "add them or drop --use-unbiased-kl")
    if a.use_unbiased_kl and a.kl_loss_type.endswith("+"):
        errors.append(f"--use-unbiased-kl with --kl-loss-type {a.kl_loss_type}: the ratio-weighted KL (slime's) and "
                      "the straight-through estimators (verl's) are each defined without the other, and no peer "
                      f"defines the pair; use --kl-loss-type {a.kl_loss_type[:-1]} or drop --use-unbiased-kl")
    if a.use_rollout_logprobs and a.use_tis:
        errors.append("--use-rollout-logprobs with --use-tis: TIS weights each token by exp(old - rollout) "
                      "log-probs, which is 1 when the old log-probs ARE the rollout ones (slime refuses the "
                      "pair too); drop one of them")
    # the off-policy knobs given without the switch that reads them (algorithms/config.py refuses them again
    # when the spec is built; here they are refused at parse time, so --dry-run names them too)
    for switch, on, knobs in (("--use-tis", a.use_tis, (("--tis-level", a.tis_level, "token"),
                                                        ("--tis-mode", a.tis_mode, "truncate"))),
                              ("--use-rs", a.use_rs, (("--rs-level", a.rs_level, "token"),
                                                      ("--rs-upper-bound", a.rs_upper_bound, 2.0),
                                                      ("--rs-lower-bound", a.rs_lower_bound, None)))):
        for flag, value, default in knobs:
            if not on and value != default:
                errors.append(f"{flag} {value} shapes what {switch} does, which is off: add {switch} or drop {flag}")
    if a.use_rollout_logprobs and a.use_rs:
        errors.append("--use-rollout-logprobs with --use-rs: rejection sampling tests exp(old - rollout), which is 1 "
                      "when the old log-probs ARE the rollout ones; drop one of them")
    if a.use_rollout_logprobs and cfg.mode.debug_rollout_only:
        errors.append("--use-rollout-logprobs chooses where training takes its old log-probs, but "
                      "--debug-rollout-only does not train; drop --use-rollout-logprobs")


def _check_critic(errors: list[str], cfg: Config) -> None:
    """--advantage-estimator ppo (a learned critic, docs/algorithms.md): what this version builds is a critic on the
    actor's ranks, with the actor's layout or its own, on the megatron backend; the rest is refused here, named."""
    a, c, pl = cfg.algorithm, cfg.checkpoint, cfg.placement
    ppo = a.advantage_estimator == "ppo"
    for placement_flag, count, actor_flag, actor_count in (
            ("--critic-num-nodes", pl.critic_num_nodes, "--actor-num-nodes", pl.actor_num_nodes),
            ("--critic-num-gpus-per-node", pl.critic_num_gpus_per_node, "--actor-num-gpus-per-node",
             pl.actor_num_gpus_per_node)):
        if count is not None and count != actor_count:
            errors.append(f"{placement_flag} {count}: the critic runs on the actor's ranks ({actor_flag} "
                          f"{actor_count}), as slime's critic always takes the actor's GPU count; a critic on GPUs "
                          f"of its own is not built. Drop {placement_flag}; for its own parallel layout use "
                          "--critic-tensor-model-parallel-size / --critic-pipeline-model-parallel-size")
    _check_critic_layout(errors, cfg, ppo)
    _check_role_models(errors, cfg, ppo)
    if c.critic_load is not None and c.critic_hf_checkpoint is not None:
        errors.append(f"--critic-load {c.critic_load} and --critic-hf-checkpoint {c.critic_hf_checkpoint} both give "
                      "the critic's initial weights: keep one")
    for flag, where, marker in (("--critic-load", c.critic_load, "COMPLETE.json"),
                                ("--critic-hf-checkpoint", c.critic_hf_checkpoint, "config.json")):
        if where is not None and not os.path.isfile(os.path.join(where, marker)):
            what = ("a model-only torch_dist dir (convert_ckpt.py hf-to-dist output)" if marker == "COMPLETE.json"
                    else "an HF model dir (config.json + *.safetensors)")
            errors.append(f"{flag} {where}: no {marker} there; give {what}")
    if c.critic_save is not None:
        errors.append(f"--critic-save {c.critic_save}: not built yet as a separate dir; the critic's model and "
                      "optimizer go into each --save checkpoint, beside the actor's: drop --critic-save")
    custom = a.custom_advantage_function_path is not None  # its args carry --gamma / --lambd (slime's contract)
    if not ppo:
        knobs: tuple[tuple[str, object, object], ...] = (
            ("--lambd", 1.0 if custom else a.lambd, 1.0), ("--value-clip", a.value_clip, 0.2),
            ("--num-critic-only-steps", a.num_critic_only_steps, 0), ("--critic-lr", cfg.optimizer.critic_lr, None),
            ("--critic-lr-warmup-iters", cfg.optimizer.critic_lr_warmup_iters, 0),
            ("--critic-hf-checkpoint", c.critic_hf_checkpoint, None), ("--critic-load", c.critic_load, None))
        for flag, value, default in knobs:
            if value != default:
                errors.append(f"{flag} {value} configures the critic, which only --advantage-estimator ppo has: "
                              f"add that or drop {flag}")
        if a.gamma != 1.0 and not custom and a.advantage_estimator not in ("reinforce_plus_plus",
                                                                           "reinforce_plus_plus_baseline"):
            errors.append(f"--gamma {a.gamma} discounts token rewards, which only --advantage-estimator ppo and "
                          f"reinforce_plus_plus(_baseline) have; {a.advantage_estimator} has one reward per "
                          "response: drop --gamma")
        return
    if a.num_critic_only_steps < 0:
        errors.append(f"--num-critic-only-steps {a.num_critic_only_steps} must be >= 0")
    if cfg.optimizer.critic_lr_warmup_iters < 0:
        errors.append(f"--critic-lr-warmup-iters {cfg.optimizer.critic_lr_warmup_iters} must be >= 0")
    if cfg.precision.train_backend == "fsdp" and c.critic_load is not None:  # fsdp: backends/fsdp/critic.py
        errors.append(f"--critic-load {c.critic_load} with --train-backend fsdp: the fsdp critic starts from HF "
                      "weights only, not a torch_dist dir; convert it (tools/convert_ckpt.py dist-to-hf) and pass "
                      "--critic-hf-checkpoint, or use --train-backend megatron")
    if a.loss_type != "policy_loss":
        errors.append(f"--advantage-estimator ppo with --loss-type {a.loss_type}: the critic trains beside the "
                      "built-in policy loss only")


def _critic_model_dir(cfg: Config):
    """The config dir of a critic whose architecture is not the policy's (``config/role_models.py``), else None."""
    ck = cfg.checkpoint
    return own_model_dir(cfg.model.hf_checkpoint, ck.critic_hf_checkpoint or ck.critic_load)


def _check_role_models(errors: list[str], cfg: Config, ppo: bool) -> None:
    """A role with a model of its own (a critic of another size, a teacher or reference of other shapes) splits
    over the layout it gets and reads the student's tokens (``config/role_models.py``)."""
    if not cfg.has_training or not cfg.model.hf_checkpoint:
        return
    policy, ck, p = cfg.model.hf_checkpoint, cfg.checkpoint, cfg.parallel
    megatron = cfg.precision.train_backend == "megatron"
    actor_tp = p.tensor_model_parallel_size if megatron else 1
    actor_pp = p.pipeline_model_parallel_size if megatron else 1
    critic_dir = _critic_model_dir(cfg) if ppo else None
    if critic_dir:
        flag = "--critic-hf-checkpoint" if ck.critic_hf_checkpoint else "--critic-load"
        errors.extend(fit_errors(flag, ck.critic_hf_checkpoint or ck.critic_load, critic_dir, policy,
                                 tp=(p.critic_tensor_model_parallel_size or actor_tp) if megatron else 1,
                                 pp=(p.critic_pipeline_model_parallel_size or actor_pp) if megatron else 1,
                                 tp_flag="--critic-tensor-model-parallel-size",
                                 pp_flag="--critic-pipeline-model-parallel-size"))
    for flag, path in (("--opd-teacher-load", ck.opd_teacher_load), ("--ref-load", ck.ref_load)):
        own = own_model_dir(policy, path)
        if own:  # a frozen model of its own at the actor's TP and PP (backends/megatron/frozen_role.py)
            errors.extend(fit_errors(flag, path, own, policy, tp=actor_tp, pp=actor_pp,
                                     tp_flag="--tensor-model-parallel-size: it takes the actor's",
                                     pp_flag="--pipeline-model-parallel-size: it takes the actor's"))


def _check_critic_layout(errors: list[str], cfg: Config, ppo: bool) -> None:
    """--critic-tensor-model-parallel-size / --critic-pipeline-model-parallel-size: the critic's own layout on the
    actor's ranks (megatron backend); its data-parallel size is what the ranks leave."""
    p = cfg.parallel
    given = [(f, v) for f, v in (("--critic-tensor-model-parallel-size", p.critic_tensor_model_parallel_size),
                                 ("--critic-pipeline-model-parallel-size", p.critic_pipeline_model_parallel_size))
             if v is not None]
    if not given:
        return
    if not ppo:
        errors.extend(f"{f} {v} lays out the critic, which only --advantage-estimator ppo has: add that or drop {f}"
                      for f, v in given)
        return
    if cfg.precision.train_backend != "megatron":
        errors.extend(f"{f} {v}: --train-backend {cfg.precision.train_backend} has no tensor or pipeline "
                      "parallelism; drop it (or use --train-backend megatron)" for f, v in given)
        return
    bad = [f"{f} {v} must be >= 1" for f, v in given if v < 1]
    if bad:
        errors.extend(bad)
        return
    tp = p.critic_tensor_model_parallel_size or p.tensor_model_parallel_size
    pp = p.critic_pipeline_model_parallel_size or p.pipeline_model_parallel_size
    world, cp = cfg.actor_world_size, 1  # the critic has no context parallelism (critic.critic_layout)
    if cfg.has_training and world % (tp * pp * cp):
        errors.append(f"the critic's layout TP {tp} x PP {pp} = {tp * pp} does not divide the "
                      f"{world} training ranks it shares with the actor; choose "
                      "--critic-tensor-model-parallel-size / --critic-pipeline-model-parallel-size dividing them")
    try:  # a critic of its own architecture is checked against its own config (_check_role_models)
        shape = None if _critic_model_dir(cfg) else model_shape_for_config(cfg)
    except Exception:  # noqa: BLE001 - an unreadable config.json is reported by the planner's check
        shape = None
    if shape is not None:
        for what, n in (("num_attention_heads", shape.num_attention_heads),
                        ("num_key_value_heads", shape.num_query_groups),
                        ("linear_num_key_heads", shape.linear_num_key_heads)):
            if n and n % tp:
                errors.append(f"--critic-tensor-model-parallel-size {tp}: the model's {what}={n} is not divisible "
                              f"by it; choose a divisor of {n}")
    layers = None if _critic_model_dir(cfg) else hf_num_layers(cfg)
    if layers is not None and layers % pp:
        errors.append(f"--critic-pipeline-model-parallel-size {pp}: the model's {layers} layers do not split "
                      f"evenly into {pp} stages; choose a divisor of {layers}")
    for flag, edge in (("--decoder-first-pipeline-num-layers", p.decoder_first_pipeline_num_layers),
                       ("--decoder-last-pipeline-num-layers", p.decoder_last_pipeline_num_layers)):
        if pp > 1 and edge is not None:
            errors.append(f"{flag} shapes the actor's stages; with a critic of its own pipeline size the critic's "
                          "would need their own: drop one of them")
    ep = p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    if ep > 1 and cfg.has_training and world % (tp * pp * cp) == 0 and (world // pp) % (ep * etp):
        errors.append(f"the critic's layout: --expert-model-parallel-size {ep} x expert TP {etp} does not divide "
                      f"the {world // pp} ranks of one of its pipeline stages; choose a critic layout where it does")


def _check_sync_and_rollout(errors: list[str], cfg: Config) -> None:
    r, s = cfg.rollout, cfg.sync
    served = cfg.has_rollout_engine and (r.rollout_backend == "sglang" or cfg.embedded_placement == "process")
    for name in ("rollout_generate_timeout", "rollout_update_timeout"):
        if getattr(r, name) != 600.0 and not served:
            errors.append(f"--{name.replace('_', '-')} {getattr(r, name):g} bounds the driver's HTTP calls to a "
                          f"served engine (--rollout-backend sglang, or --embedded-engine-ranks process), and this "
                          f"run's engine lives in the trainer's processes: drop it")
    if not cfg.has_rollout_engine:
        return
    if (r.rollout_backend == "sglang" and s.update_weight_transport == "tensor" and not cfg.memory.colocate
            and not r.rollout_engine_urls):  # external servers: refuse_unimplemented_rollout_and_sync says why
        errors.append("--update-weight-transport tensor hands CUDA IPC handles to engines on the SAME GPUs: "
                      "it needs --colocate; use --update-weight-transport distributed (or disk) for separate GPUs")
    if r.rollout_num_gpus is not None and r.rollout_num_gpus % r.rollout_num_gpus_per_engine:
        errors.append(f"--rollout-num-gpus {r.rollout_num_gpus} is not divisible by --rollout-num-gpus-per-engine "
                      f"{r.rollout_num_gpus_per_engine}")


def _check_wandb(errors: list[str], cfg: Config) -> None:
    """slime's W&B flags name what to log to; without --wandb-project nothing is logged to W&B,
    so each would be accepted and do nothing."""
    rt = cfg.runtime
    if rt.wandb_project:
        return
    for flag, value in (("--use-wandb", rt.use_wandb), ("--wandb-team", rt.wandb_team),
                        ("--wandb-host", rt.wandb_host), ("--wandb-key", rt.wandb_key and "***")):
        if value:
            shown = flag if value is True else f"{flag} {value}"
            errors.append(f"{shown}: W&B logging is on when --wandb-project is given, and it is not; add "
                          f"--wandb-project NAME (slime's scripts pass it with --use-wandb) or drop {flag}")


def _check_megatron_flags(errors: list[str], cfg: Config) -> None:
    """Megatron-LM's architecture flags against config.json (config/architecture.py) and its
    training knobs against what megatron-core accepts and this machine can run
    (config/megatron_flags.py)."""
    errors.extend(architecture_errors(cfg))
    errors.extend(megatron_flag_errors(cfg))
    errors.extend(slime_sglang_errors(cfg))


def _check_world(errors: list[str], cfg: Config) -> None:
    """The placement against its real sources: ``--allocation`` against the flags it states
    (TP/PP/CP/EP/expert-TP, --train-backend, the actor's rank count), one policy per run, and
    the ranks torchrun launched against --actor-num-nodes x --actor-num-gpus-per-node."""

    errors.extend(allocation_errors(cfg))
    errors.extend(world_errors(cfg))


# What a checkpoint root's writers put there (infra/checkpoint_root, infra/atomic temp files, the
# rollout cache): the entries a fresh start would overwrite, prune or be misled by. Anything else
# under --save (notes, an archive_* of an earlier fresh start) is not a checkpoint and is left alone.
_CHECKPOINT_ENTRY = re.compile(r"^\.?(iter_\d{7,}|latest_checkpointed_iteration\.txt|resume_state\.json)(\..*)?$"
                               r"|^rollout_ckpts$|^async_buffer$")


def save_root_checkpoint_entries(root: str | None) -> list[str]:
    """Names under the checkpoint root ``root`` that belong to an earlier run's checkpoints, sorted."""
    if not root or not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _CHECKPOINT_ENTRY.match(n))


def _check_paths(errors: list[str], cfg: Config) -> None:
    """Output locations, and a fresh start into a checkpoint root that already holds checkpoints.

    ``--no-auto-resume`` with such a root used to overwrite the old run's ``iter_*`` dirs and
    prune them (``--save-max-to-keep``) silently; it is refused unless ``--existing-save`` says
    what to do with them (``runner.fresh_start`` does it on rank 0 before the run starts).
    """
    c, rt, m = cfg.checkpoint, cfg.runtime, cfg.mode
    for flag, path in (("--save", c.save), ("--output-dir", rt.output_dir), ("--tensorboard-dir", rt.tensorboard_dir)):
        why = dir_problem(path) if path else None
        if why:
            errors.append(f"{flag} {path} {why}; give a directory this user can create and write to")
    pattern = m.save_debug_rollout_data
    if pattern and "{rollout_id}" in pattern:
        directory = os.path.dirname(pattern.replace("{rollout_id}", "0")) or "."
        why = dir_problem(directory)
        if why:
            errors.append(f"--save-debug-rollout-data {pattern}: its directory {directory} {why}; give a pattern "
                          "in a directory this user can create and write to")
    if c.existing_save and not c.save:
        errors.append(f"--existing-save {c.existing_save} needs --save ROOT (the checkpoints it applies to)")
    elif c.existing_save and not c.no_auto_resume:
        errors.append(f"--existing-save {c.existing_save} only applies to a fresh start: add --no-auto-resume, or "
                      "drop --existing-save to resume from --save")
    entries = save_root_checkpoint_entries(c.save) if c.no_auto_resume else []
    if entries and not c.existing_save:
        assert c.save is not None, "checkpoint entries are listed only from under a given --save"
        shown = ", ".join(entries[:4]) + (f", ... ({len(entries)} entries)" if len(entries) > 4 else "")
        errors.append(f"--no-auto-resume with --save {c.save}, which already holds checkpoints ({shown}): the fresh "
                      "run would overwrite and prune them; add --existing-save archive (moves them to "
                      f"{os.path.join(c.save, 'archive_<UTC time>')}/) or --existing-save discard (deletes them), "
                      "or choose an empty --save")
    elif entries:
        assert c.save is not None, "checkpoint entries are listed only from under a given --save"
        doomed = [os.path.realpath(os.path.join(c.save, e)) for e in entries]
        for flag, path in (("--load", c.load), ("--ref-load", c.ref_load), ("--opd-teacher-load", c.opd_teacher_load),
                           ("--hf-checkpoint", cfg.model.hf_checkpoint)):
            if path and any(within(os.path.realpath(path), d) for d in doomed):
                action = "move" if c.existing_save == "archive" else "delete"
                errors.append(f"{flag} {path} lies in the old checkpoints under --save {c.save} that --existing-save "
                              f"{c.existing_save} would {action} before the run reads it; copy it out of --save "
                              "first, or choose another --save")
    _check_resume_older(errors, cfg)


_ITER_DIR = re.compile(r"^iter_(\d{7,})$")  # infra.checkpoint_root's naming (config imports nothing above it)


def _check_resume_older(errors: list[str], cfg: Config) -> None:
    """``--load ROOT/iter_N`` into a ``--save`` that holds iterations above N: the run's saves would
    overwrite them one by one (it silently did). Refused unless ``--allow-resume-older``, with which
    ``runner.resume`` moves them into ``--save/superseded/`` before loading."""
    c = cfg.checkpoint
    if not (c.load and c.save):
        return
    named = _ITER_DIR.match(os.path.basename(os.path.normpath(c.load)))
    if named is None or c.no_auto_resume or not os.path.isdir(c.save):
        return
    step = int(named.group(1))
    newer = sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(c.save))
                   if m and int(m.group(1)) > step and os.path.isdir(os.path.join(c.save, m.group(0))))
    if newer and not c.allow_resume_older:
        names = ", ".join(f"iter_{s:07d}" for s in newer[:6]) + (f", ... ({len(newer)})" if len(newer) > 6 else "")
        errors.append(f"--load {c.load} resumes iteration {step}, but --save {c.save} holds newer ones ({names}), "
                      "which this run's saves would overwrite; add --allow-resume-older to move them aside into "
                      f"{os.path.join(c.save, 'superseded')}/ and continue from {step}, drop --load to resume from "
                      "the newest, or give another --save")


# What the fsdp backend (backends/fsdp) does not build yet: (flag, is it given?, why). Refused, never ignored.
_FSDP_NOT_BUILT = (
    ("--optimizer-offload-fraction", lambda c: c.optimizer.optimizer_offload_fraction != 1.0,
     "FSDP2's CPUOffloadPolicy (what --optimizer-cpu-offload maps to) offloads all of the sharded state"),
    ("--use-precision-aware-optimizer", lambda c: c.optimizer.use_precision_aware_optimizer,
     "a megatron-core optimizer feature; the fsdp backend's sharded fp32 parameters are the master weights"),
    ("--overlap-cpu-optimizer-d2h-h2d", lambda c: c.optimizer.overlap_cpu_optimizer_d2h_h2d,
     "a megatron-core hybrid-optimizer feature"),
    ("--recompute-granularity selective", lambda c: c.memory.recompute_granularity == "selective",
     "selective recompute (attention core only) is a megatron-core feature; fsdp recomputes whole decoder "
     "layers with --recompute-granularity full"),
    ("--recompute-method block", lambda c: c.memory.recompute_method == "block",
     "fsdp recomputes every decoder layer (uniform, one layer per unit)"),
    ("--recompute-num-layers", lambda c: c.memory.recompute_num_layers not in (None, 1),
     "fsdp recomputes one decoder layer per unit"),
)


def _teacher_of_its_own(cfg: Config, path: str) -> bool:
    """The backend builds the teacher at ``path`` as a frozen model of its own (other shapes than the policy's:
    ``role_models.own_model_dir``; backends/megatron/frozen_role.py, backends/fsdp/teacher.py), so it shares
    nothing with the student's LoRA adapters."""
    return own_model_dir(cfg.model.hf_checkpoint, path) is not None


def _check_fsdp(errors: list[str], cfg: Config) -> None:
    """``--train-backend fsdp``: what it cannot do (yet) is refused here, before any worker starts."""
    if cfg.precision.train_backend != "fsdp" or not cfg.has_training:
        return
    for flag, given, why in _FSDP_NOT_BUILT:
        if given(cfg):
            errors.append(f"{flag} with --train-backend fsdp: {why}; drop {flag} or use --train-backend megatron")
    for flag, path in (("--ref-load", cfg.checkpoint.ref_load), ("--opd-teacher-load", cfg.checkpoint.opd_teacher_load)):
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            errors.append(f"{flag} {path} with --train-backend fsdp: only HF model directories (config.json + "
                          "*.safetensors) load into the fsdp backend yet, not torch_dist checkpoints; convert it "
                          "(tools/convert_ckpt.py dist-to-hf) or use --train-backend megatron")
    for row in MEGATRON_FLAGS:
        if row.given(cfg):
            errors.append(f"{row.shown(cfg)} is a megatron-core setting; --train-backend fsdp does not read it: "
                          f"drop {row.flag} or use --train-backend megatron")


_LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_load_errors(lo) -> list[str]:
    """``--lora-load DIR``: a PEFT adapter dir whose settings are the run's (plain LoRA, same r, alpha, targets)."""
    path = lo.lora_load
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return [f"--lora-load {path}: no {' or '.join(missing)} there (a HF PEFT adapter dir, e.g. the output of "
                "tools/convert_ckpt.py dist-to-peft)"]
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as fh:
            ac = json.load(fh)
    except (OSError, ValueError) as e:
        return [f"--lora-load {path}: adapter_config.json is not readable JSON ({e})"]
    problems = []
    if str(ac.get("peft_type", "LORA")).upper() != "LORA" or ac.get("use_dora") or ac.get("use_rslora"):
        problems.append("only plain LoRA adapters load (not DoRA, rsLoRA or another PEFT type)")
    if ac.get("r") != lo.lora_rank:
        problems.append(f"its r is {ac.get('r')}: pass --lora-rank {ac.get('r')}")
    if ac.get("lora_alpha") is None or float(ac["lora_alpha"]) != lo.lora_alpha:
        problems.append(f"its lora_alpha is {ac.get('lora_alpha')}: pass --lora-alpha {ac.get('lora_alpha')}")
    targets = ac.get("target_modules")
    targets = [targets] if isinstance(targets, str) else sorted(targets or [])

    def linears(names) -> set[str]:  # the HF linears a target list adapts (all-linear: every one)
        return set(_LORA_LINEARS) if "all-linear" in names else {n.rsplit(".", 1)[-1] for n in names}

    if linears(targets) != linears(lo.lora_target_modules):
        problems.append(f"its target_modules are {' '.join(targets)}: pass --lora-target-modules {' '.join(targets)}")
    if ac.get("modules_to_save") or ac.get("rank_pattern") or ac.get("alpha_pattern"):
        problems.append("modules_to_save / rank_pattern / alpha_pattern are not built")
    return [f"--lora-load {path}: {p}" for p in problems]


def _lora_sync_errors(cfg: Config) -> list[str]:
    """``--lora-sync adapter``: the engines that take an adapter (the embedded one, in the driver's process or its
    own, merges it; SGLang serves it) and the transports that carry one (tensor and disk; SGLang: disk)."""
    r, s = cfg.rollout, cfg.sync
    if r.rollout_backend == "sglang":
        errors = []
        if s.update_weight_transport != "disk":
            errors.append(f"--lora-sync adapter with SGLang and --update-weight-transport {s.update_weight_transport}: "
                          "the adapter goes to SGLang as a PEFT dir (/load_lora_adapter) over the disk transport; "
                          "/load_lora_adapter_from_tensors is not built here: use --update-weight-transport disk or "
                          "--lora-sync merged")
        if cfg.memory.colocate:
            errors.append("--lora-sync adapter with SGLang and --colocate: a colocated SGLang engine gives its "
                          "weights back around each train step, so the base model would travel every step; use "
                          "separate engine GPUs or --lora-sync merged")
        if cfg.lora.lora_modules_to_save:
            errors.append(f"--lora-sync adapter with SGLang and --lora-modules-to-save "
                          f"{' '.join(cfg.lora.lora_modules_to_save)}: SGLang's /load_lora_adapter takes the adapters, "
                          "not the weights of modules trained in full; use --lora-sync merged")
        if s.check_weight_update_equal:
            errors.append("--lora-sync adapter with SGLang and --check-weight-update-equal: SGLang keeps an adapter "
                          "apart from the model's weights, which /weights_checker compares, so the adapter would go "
                          "unchecked; drop one of the two")
        return errors
    if s.update_weight_transport not in ("tensor", "disk"):
        return [f"--lora-sync adapter with --update-weight-transport {s.update_weight_transport}: the adapter goes "
                "to the embedded engine in-process (tensor) or as a PEFT dir on disk (disk); use one of those or "
                "--lora-sync merged"]
    return []


def _check_lora(errors: list[str], cfg: Config) -> None:
    """``--lora-*``: what the adapters cannot do (yet) is refused before any worker starts (docs/lora.md)."""
    lo = cfg.lora
    if lo.lora_rank < 0:
        errors.append(f"--lora-rank {lo.lora_rank} must be >= 0 (0: full fine-tuning)")
        return
    if lo.lora_rank == 0:
        for flag, given in (("--lora-alpha", lo.lora_alpha != 8.0), ("--lora-dropout", lo.lora_dropout != 0.0),
                            ("--lora-target-modules", list(lo.lora_target_modules) != ["all-linear"]),
                            ("--lora-load", lo.lora_load is not None),
                            ("--lora-modules-to-save", bool(lo.lora_modules_to_save))):
            if given:
                errors.append(f"{flag} shapes LoRA adapters, which are off: add --lora-rank R or drop {flag}")
        if lo.lora_sync != "merged":
            errors.append(f"--lora-sync {lo.lora_sync} sends LoRA adapters to the engine, and this run trains none: "
                          "add --lora-rank R or drop --lora-sync")
        return
    if lo.lora_sync == "adapter":
        errors.extend(_lora_sync_errors(cfg))
    bad = [t for t in lo.lora_target_modules
           if t != "all-linear" and t.rsplit(".", 1)[-1] not in _LORA_LINEARS]
    if bad:
        errors.append(f"--lora-target-modules {' '.join(bad)}: adaptable are {', '.join(_LORA_LINEARS)} (or a dotted "
                      "suffix ending in one, e.g. self_attn.q_proj) and all-linear")
    if "all-linear" in lo.lora_target_modules and len(lo.lora_target_modules) > 1:
        errors.append("--lora-target-modules all-linear already names every linear: give it alone")
    mlp = [t for t in lo.lora_target_modules if t == "all-linear" or t.rsplit(".", 1)[-1] in _LORA_LINEARS[4:]]
    if mlp and hf_is_moe(cfg):
        errors.append(f"--lora-target-modules {' '.join(mlp)} on an MoE model: adapters on expert linears are not "
                      "built; target the attention projections (q_proj k_proj v_proj o_proj)")
    if hf_model_type(cfg) in MLA_TYPES:
        errors.append(f"--lora-rank with a {hf_model_type(cfg)} model: adapters on multi-latent attention projections "
                      "are not built")
    if hf_model_type(cfg) in LINEAR_ATTENTION_TYPES:
        errors.append(f"--lora-rank with a {hf_model_type(cfg)} model: adapters on its gated attention (q_proj holds "
                      "each head's query and output gate) and gated delta-net projections are not built")
    if cfg.precision.train_backend == "fsdp" and importlib.util.find_spec("peft") is None:
        errors.append(f"--lora-rank {lo.lora_rank} with --train-backend fsdp injects HF PEFT's adapters, and peft is "
                      "not installed: pip install peft (megatron_rl's [lora] extra), or use the megatron backend, "
                      "whose adapters need no peft")
    for flag, value in (("--ref-load", cfg.checkpoint.ref_load), ("--opd-teacher-load", cfg.checkpoint.opd_teacher_load)):
        if value and not (flag == "--opd-teacher-load" and _teacher_of_its_own(cfg, value)):
            errors.append(f"{flag} with --lora-rank: a LoRA run's frozen weights are its base model (the reference is "
                          f"the base model, the adapters starting at zero); other weights of the policy's shapes "
                          f"under {flag} are not built (an --opd-teacher-load of other shapes than --hf-checkpoint "
                          "is a model of its own, built beside the adapters)")
    errors.extend(modules_to_save_errors(cfg))
    if lo.lora_load is not None:
        errors.extend(_lora_load_errors(lo))
    if cfg.precision.train_backend == "megatron" and importlib.util.find_spec("transformer_engine") is not None:
        errors.append("--lora-rank with transformer-engine installed: the adapters are built on megatron's local layer "
                      "spec, and the TE spec fuses the input norm into linear_qkv/linear_fc1 (the adapter would see "
                      "the un-normed input); run without transformer-engine")


def _check_true_on_policy(errors: list[str], cfg: Config) -> None:
    """--true-on-policy-mode: the layouts, engines and models not yet bitwise invariant (``on_policy_rules``)."""
    errors.extend(true_on_policy_errors(cfg))


def _check_speculative(errors: list[str], cfg: Config) -> None:
    """--speculative-*: the MTP draft's engine, model and weight sync (``speculative_rules``)."""
    errors.extend(speculative_errors(cfg))


CHECKS = (_check_positive, _check_parallel, _check_batching, _check_precision, _check_modes, _check_memory,
          _check_paths,
          _check_checkpoint_and_data, _check_rewards_and_dynamic_sampling, _check_rollout_functions,
          _check_sync_and_rollout, _check_algorithm, _check_critic, _check_megatron_flags,
          _check_wandb, _check_world, _check_fsdp, _check_lora, _check_true_on_policy, _check_speculative)


def collect_errors(cfg: Config) -> list[str]:
    errors: list[str] = []
    _check_positive(errors, cfg)
    if errors:  # later checks divide by these sizes; report the non-positive ones first
        return domain_errors(cfg) + errors
    errors.extend(domain_errors(cfg))  # the later checks only compare these: a NaN makes them say nothing
    for check in CHECKS[1:]:
        check(errors, cfg)
    if not errors:  # the planner re-derives placement; only meaningful once the flags are consistent
        errors.extend(plan_errors(cfg))
    unbuilt = refuse_unimplemented_rollout_and_sync(cfg)
    others = [e for e in unbuilt if not is_not_built_yet(e)]
    # a dry run of an otherwise valid script goes on to print its plan, then names these (dry_run.py)
    errors.extend(others if cfg.mode.dry_run and not errors and not others else unbuilt)
    return errors


def is_not_built_yet(error: str) -> bool:
    """A refusal that only says "this version does not build that" (``rollout_rules.NotBuilt``), not that
    the input is wrong: a --dry-run still checks and prints the plan of such a script, then names them
    and exits 2 (runner/dry_run.py), so a slime script shows its layout here."""
    return isinstance(error, NotBuilt)


def real_run_refusals(cfg: Config) -> list[str]:
    """What a real run of ``cfg`` would refuse that a --dry-run lets through (see ``_NOT_BUILT_YET``)."""
    return [e for e in refuse_unimplemented_rollout_and_sync(cfg) if is_not_built_yet(e)]


def validate_config(cfg: Config) -> None:
    """Raise one ``ConfigError`` listing every problem, or return None."""
    errors = collect_errors(cfg)
    if errors:
        if len(errors) == 1:
            raise ConfigError(errors[0])
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
