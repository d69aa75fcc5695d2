"""verl's config keys -> this engine's flags: ``--verl-overrides 'KEY=VALUE ...'`` and ``--verl-config FILE.yaml``.

A verl launch script is a list of Hydra overrides to ``verl.trainer.main_ppo`` (``actor_rollout_ref.actor.megatron.
tensor_model_parallel_size=2 algorithm.adv_estimator=grpo data.train_batch_size=1024 ...``). Each key has one row in
:data:`VERL_KEYS`: **mapped** (the flag tokens it becomes), **ignored** (why it changes nothing here) or **refused**
(why, with what to do instead); a key without a row is refused by name. Several rows depend on another key's value
(verl's ``ppo_mini_batch_size`` counts prompts, our ``--global-batch-size`` samples: it is multiplied by
``rollout.n``), so a row's converter sees every key given. The translation becomes command-line tokens placed
*before* the user's own flags, so the parser converts and checks them as any flag, and a flag given on the command
line wins. ``--dry-run`` prints the translation (:func:`translation_lines`); docs/migrating-from-verl.md is rendered
from the table (:func:`render`), so the page cannot drift from it.

Keys a script does not give take this engine's defaults, not verl's; the page lists the defaults that differ.
Values are read as Hydra reads simple ones (YAML scalars and ``[a, b]`` lists); a leading ``+`` (Hydra's "add
this key") is dropped, ``~KEY`` (delete) is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_rl.errors import ConfigError

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-verl.md"

Values = dict[str, Any]  # every key given, by its dotted name, with its parsed value
Convert = Callable[[Any, Values], list[str]]


@dataclass(frozen=True)
class VerlKey:
    key: str
    status: str  # "mapped", "ignored" or "refused"
    doc: str  # what the row does here (mapped: the flags and any difference; otherwise why)
    convert: Optional[Convert] = None  # mapped: (value, all values) -> flag tokens; raises ConfigError for a value
    # it cannot take


class _Refused(Exception):
    """A value a mapped row cannot take (the message says why); becomes a ConfigError naming the key."""


def _flag(name: str, cast: Callable[[Any], Any] = str) -> Convert:
    return lambda v, _: [name, str(cast(v))]


def _switch(name: str) -> Convert:
    """A boolean key -> a store_true flag (False: nothing, this engine's default)."""
    return lambda v, _: [name] if _bool(v) else []


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("true", "false"):
        return str(v).lower() == "true"
    raise _Refused(f"{v!r} is not true or false")


def _only(expected: Any, why: str) -> Convert:
    """Accepted at ``expected`` (what this engine does anyway), refused otherwise with ``why``."""
    def convert(v: Any, _: Values) -> list[str]:
        if (_bool(v) if isinstance(expected, bool) else v) != expected:
            raise _Refused(why)
        return []
    return convert


def _as_list(v: Any) -> list[str]:
    files = v if isinstance(v, list) else [v]
    if not files or not all(isinstance(f, str) and f for f in files):
        raise _Refused("expected a file path or a list of them")
    return [os.path.expanduser(f) for f in files]


def _train_files(v: Any, _: Values) -> list[str]:
    return ["--prompt-data", *_as_list(v)]


def _val_files(v: Any, _: Values) -> list[str]:
    """One file: the unnamed evaluation set; several: named sets, each named by its directory and stem
    (``gsm8k/test.parquet`` -> ``gsm8k_test``; metrics ``eval/gsm8k_test/...``)."""
    files = _as_list(v)
    if len(files) == 1:
        return ["--eval-prompt-data", files[0]]
    names = [f"{os.path.basename(os.path.dirname(f))}_{os.path.splitext(os.path.basename(f))[0]}".strip("_")
             for f in files]
    if len(set(names)) != len(names):
        names = [f"{name}_{i}" for i, name in enumerate(names)]
    return ["--eval-prompt-data", *[t for pair in zip(names, files) for t in pair]]


def _mini_batch(v: Any, values: Values) -> list[str]:
    n = int(values.get("actor_rollout_ref.rollout.n", 1))
    return ["--global-batch-size", str(int(v) * n)]


def _every(v: Any, values: Values, flag: str) -> list[str]:
    every = int(v)
    return [flag, str(every)] if every > 0 else []


_KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "k3"}


def _kl_type(v: Any, _: Values) -> list[str]:
    base, plus = (str(v)[:-1], "+") if str(v).endswith("+") else (str(v), "")
    if base not in _KL_TYPES:
        raise _Refused(f"{v!r} is not built here; the estimators are {', '.join(_KL_TYPES)} (and their '+' forms)")
    return ["--kl-loss-type", _KL_TYPES[base] + plus]


def _agg_mode(v: Any, _: Values) -> list[str]:
    return ["--loss-agg-mode", str(v).replace("-", "_")]


def _rollout_name(v: Any, _: Values) -> list[str]:
    if v in ("sglang", "vllm"):
        return ["--rollout-backend", "sglang"]
    raise _Refused(f"{v!r} is not an engine here: generation is served by SGLang (name=sglang or vllm) or the "
                   "embedded engine (no key: --rollout-backend embedded)")


def _loggers(v: Any, values: Values) -> list[str]:
    out: list[str] = []
    for name in v if isinstance(v, list) else [v]:
        if name == "wandb":
            out.append("--use-wandb")
        elif name == "tensorboard":  # verl's default directory: tensorboard_log/<project>/<experiment>
            out += ["--tensorboard-dir", f"tensorboard_log/{values.get('trainer.project_name', 'verl')}/"
                                         f"{values.get('trainer.experiment_name', 'run')}"]
        elif name != "console":
            raise _Refused(f"logger {name!r} is not built here (console, wandb and tensorboard are)")
    return out


def _gpus(v: Any, _: Values) -> list[str]:
    return ["--actor-num-gpus-per-node", str(int(v)), "--colocate"]


def _save_freq(v: Any, values: Values) -> list[str]:
    tokens = _every(v, values, "--save-interval")
    if tokens and "trainer.default_local_dir" not in values:  # verl's default: checkpoints/<project>/<experiment>
        tokens += ["--save", f"checkpoints/{values.get('trainer.project_name', 'verl_examples')}/"
                             f"{values.get('trainer.experiment_name', 'gsm8k')}"]
    return tokens


def _total_epochs(v: Any, values: Values) -> list[str]:
    if "trainer.total_training_steps" not in values:
        raise _Refused("a run's length here is --num-rollout (rollout steps), and the epochs' step count needs the "
                       "data's row count: add trainer.total_training_steps=N (verl uses it in place of "
                       "total_epochs too)")
    return []


def _reward_path(v: Any, values: Values) -> list[str]:
    if v in (None, "", "null"):
        return []
    name = values.get("custom_reward_function.name") or "compute_score"
    return ["--custom-reward-function-path", f"{v}:{name}"]


def _reward_kwargs(v: Any, _: Values) -> list[str]:
    import json

    if not isinstance(v, dict):
        raise _Refused(f"{v!r} is not a mapping of keyword arguments")
    return ["--custom-reward-function-kwargs", json.dumps(v)] if v else []


def _same_as_actor(actor_key: str) -> Convert:
    def convert(v: Any, values: Values) -> list[str]:
        if int(v) != int(values.get(actor_key, 1)):
            raise _Refused(f"the reference model runs in the actor's layout here (a weight tag on the actor's ranks); "
                           f"give it the actor's {actor_key.rsplit('.', 1)[1]} ({values.get(actor_key, 1)})")
        return []
    return convert


def _resume(v: Any, _: Values) -> list[str]:
    if v == "auto":
        return []
    if v == "disable":
        return ["--no-auto-resume"]
    raise _Refused(f"{v!r}: resume_path is not built; runs resume from --save (auto) or start afresh (disable)")


def _truncation(v: Any, _: Values) -> list[str]:
    if v != "error":
        raise _Refused(f"{v!r}: prompts are never truncated here; one over --rollout-max-prompt-len is refused by "
                       "its row before the run starts (truncation=error)")
    return []


_A = "actor_rollout_ref.actor."
_M = _A + "megatron."
_R = "actor_rollout_ref.rollout."
_REF = "actor_rollout_ref.ref."
_MICRO = "old and reference log-probs are computed with the training micro-batching (--micro-batch-size, or " \
         "--max-tokens-per-gpu with --use-dynamic-batch-size)"

_ROWS: list[VerlKey] = [
    # algorithm
    VerlKey("algorithm.adv_estimator", "mapped", "--advantage-estimator (gae is ppo: GAE with a critic)",
            _flag("--advantage-estimator")),
    VerlKey("algorithm.use_kl_in_reward", "mapped", "false only: the KL penalty is a loss term here "
            "(actor.use_kl_loss)", _only(False, "a KL penalty in the reward is not built; use actor.use_kl_loss")),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "mapped", "false -> --disable-grpo-std-normalization",
            lambda v, _: [] if _bool(v) else ["--disable-grpo-std-normalization"]),
    # data
    VerlKey("data.train_files", "mapped", "--prompt-data FILE ... (parquet files in verl's schema, one dataset in "
            "order)", _train_files),
    VerlKey("data.val_files", "mapped", "--eval-prompt-data: one file, or named sets DIR_STEM FILE ... (metrics "
            "eval/DIR_STEM/...)", _val_files),
    VerlKey("data.prompt_key", "mapped", "--input-key", _flag("--input-key")),
    VerlKey("data.image_key", "mapped", "--multimodal-keys '{\"image\": KEY}': the parquet column holding each "
            "prompt's images (docs/vlm.md; a run with images is still refused at validation)",
            lambda v, _: ["--multimodal-keys", json.dumps({"image": str(v)})]),
    VerlKey("data.reward_fn_key", "mapped", "data_source only: the reward function gets the data_source column",
            _only("data_source", "the reward's data source is the data_source column here")),
    VerlKey("data.train_batch_size", "mapped", "--rollout-batch-size (prompts per step)",
            _flag("--rollout-batch-size", int)),
    VerlKey("data.max_prompt_length", "mapped", "--rollout-max-prompt-len", _flag("--rollout-max-prompt-len", int)),
    VerlKey("data.max_response_length", "mapped", "--rollout-max-response-len",
            _flag("--rollout-max-response-len", int)),
    VerlKey("data.shuffle", "mapped", "--rollout-shuffle (verl shuffles by default, this engine does not)",
            _switch("--rollout-shuffle")),
    VerlKey("data.seed", "mapped", "--rollout-seed", _flag("--rollout-seed", int)),
    VerlKey("data.truncation", "mapped", "error only: an over-long prompt is refused by its row before the run",
            _truncation),
    VerlKey("data.filter_overlong_prompts", "ignored", "no prompt is dropped here: one over --rollout-max-prompt-len "
            "is refused by its row before the run starts, so data that passes has none to filter"),
    VerlKey("data.return_raw_chat", "ignored", "the chat messages are always rendered by the tokenizer's chat "
            "template (--apply-chat-template) on the driver"),
    VerlKey("data.trust_remote_code", "ignored", "tokenizers load with transformers' defaults"),
    VerlKey("data.dataloader_num_workers", "ignored", "the prompt file is read once, up front, on the driver"),
    # model
    VerlKey("actor_rollout_ref.model.path", "mapped", "--hf-checkpoint (a local HF directory)",
            _flag("--hf-checkpoint")),
    VerlKey("actor_rollout_ref.model.use_fused_kernels", "ignored", "the fused log-prob kernels are used wherever "
            "built (docs/kernels.md)"),
    VerlKey("actor_rollout_ref.model.trust_remote_code", "ignored", "models are built by this engine's bridges"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", "mapped", "true -> --recompute-granularity full",
            lambda v, _: ["--recompute-granularity", "full"] if _bool(v) else []),
    VerlKey("actor_rollout_ref.model.lora.rank", "mapped", "--lora-rank", _flag("--lora-rank", int)),
    VerlKey("actor_rollout_ref.model.lora.alpha", "mapped", "--lora-alpha", _flag("--lora-alpha", float)),
    # actor
    VerlKey(_A + "optim.lr", "mapped", "--lr", _flag("--lr", float)),
    VerlKey(_A + "optim.min_lr", "mapped", "--min-lr", _flag("--min-lr", float)),
    VerlKey(_A + "optim.weight_decay", "mapped", "--weight-decay", _flag("--weight-decay", float)),
    VerlKey(_A + "optim.lr_warmup_steps", "mapped", "--lr-warmup-iters (-1: none)",
            lambda v, vals: _every(v, vals, "--lr-warmup-iters")),
    VerlKey(_A + "optim.clip_grad", "mapped", "--grad-clip", _flag("--grad-clip", float)),
    VerlKey(_A + "ppo_mini_batch_size", "mapped", "--global-batch-size = ppo_mini_batch_size x rollout.n (verl counts "
            "prompts, this engine samples per optimizer step)", _mini_batch),
    VerlKey(_A + "ppo_micro_batch_size_per_gpu", "mapped", "--micro-batch-size", _flag("--micro-batch-size", int)),
    VerlKey(_A + "use_dynamic_bsz", "mapped", "--use-dynamic-batch-size", _switch("--use-dynamic-batch-size")),
    VerlKey(_A + "ppo_max_token_len_per_gpu", "mapped", "--max-tokens-per-gpu", _flag("--max-tokens-per-gpu", int)),
    VerlKey(_A + "ppo_epochs", "mapped", "1 only", _only(1, "several passes over one rollout batch are not built; "
                                                           "ppo_epochs=1")),
    VerlKey(_A + "shuffle", "mapped", "false only", _only(False, "mini-batches are taken in rollout order here")),
    VerlKey(_A + "clip_ratio", "mapped", "--eps-clip", _flag("--eps-clip", float)),
    VerlKey(_A + "clip_ratio_low", "mapped", "--eps-clip", _flag("--eps-clip", float)),
    VerlKey(_A + "clip_ratio_high", "mapped", "--eps-clip-high", _flag("--eps-clip-high", float)),
    VerlKey(_A + "clip_ratio_c", "mapped", "--eps-clip-c (dual-clip)", _flag("--eps-clip-c", float)),
    VerlKey(_A + "loss_agg_mode", "mapped", "--loss-agg-mode (token-mean -> token_mean, ...)", _agg_mode),
    VerlKey(_A + "entropy_coeff", "mapped", "--entropy-coef", _flag("--entropy-coef", float)),
    VerlKey(_A + "use_kl_loss", "mapped", "--use-kl-loss", _switch("--use-kl-loss")),
    VerlKey(_A + "kl_loss_coef", "mapped", "--kl-loss-coef", _flag("--kl-loss-coef", float)),
    VerlKey(_A + "kl_loss_type", "mapped", "--kl-loss-type (kl -> k1, mse -> k2, low_var_kl, k3; abs and full refused)",
            _kl_type),
    VerlKey(_M + "tensor_model_parallel_size", "mapped", "--tensor-model-parallel-size",
            _flag("--tensor-model-parallel-size", int)),
    VerlKey(_M + "pipeline_model_parallel_size", "mapped", "--pipeline-model-parallel-size",
            _flag("--pipeline-model-parallel-size", int)),
    VerlKey(_M + "virtual_pipeline_model_parallel_size", "mapped", "--virtual-pipeline-model-parallel-size",
            lambda v, _: [] if v in (None, "null") else ["--virtual-pipeline-model-parallel-size", str(int(v))]),
    VerlKey(_M + "context_parallel_size", "mapped", "--context-parallel-size", _flag("--context-parallel-size", int)),
    VerlKey(_M + "expert_model_parallel_size", "mapped", "--expert-model-parallel-size",
            _flag("--expert-model-parallel-size", int)),
    VerlKey(_M + "expert_tensor_parallel_size", "mapped", "--expert-tensor-parallel-size",
            _flag("--expert-tensor-parallel-size", int)),
    VerlKey(_M + "sequence_parallel", "mapped", "--sequence-parallel", _switch("--sequence-parallel")),
    VerlKey(_M + "param_offload", "mapped", "true -> --offload-train (the trainer's weights, gradients and optimizer "
            "leave the GPU during generation)", _switch("--offload-train")),
    VerlKey(_M + "optimizer_offload", "mapped", "true -> --offload-train", _switch("--offload-train")),
    VerlKey(_M + "grad_offload", "mapped", "true -> --offload-train", _switch("--offload-train")),
    VerlKey(_M + "use_mbridge", "ignored", "HF <-> megatron-core conversion is this engine's own bridges"),
    VerlKey(_M + "vanilla_mbridge", "ignored", "HF <-> megatron-core conversion is this engine's own bridges"),
    VerlKey(_M + "use_dist_checkpointing", "refused", "the initial weights load from --hf-checkpoint; a converted "
            "torch_dist dir is --load DIR (tools/convert_ckpt.py hf-to-dist)"),
    VerlKey(_M + "dist_checkpointing_path", "refused", "give the converted torch_dist dir as --load DIR"),
    # rollout
    VerlKey(_R + "name", "mapped", "sglang or vllm -> --rollout-backend sglang (vLLM is not built: SGLang serves "
            "the same sampling); others refused", _rollout_name),
    VerlKey(_R + "mode", "ignored", "generation is always served per request (verl's async mode)"),
    VerlKey(_R + "n", "mapped", "--n-samples-per-prompt", _flag("--n-samples-per-prompt", int)),
    VerlKey(_R + "tensor_model_parallel_size", "mapped", "--rollout-num-gpus-per-engine",
            _flag("--rollout-num-gpus-per-engine", int)),
    VerlKey(_R + "gpu_memory_utilization", "mapped", "--sglang-mem-fraction-static",
            _flag("--sglang-mem-fraction-static", float)),
    VerlKey(_R + "temperature", "mapped", "--rollout-temperature", _flag("--rollout-temperature", float)),
    VerlKey(_R + "top_p", "mapped", "--rollout-top-p", _flag("--rollout-top-p", float)),
    VerlKey(_R + "top_k", "mapped", "--rollout-top-k", _flag("--rollout-top-k", int)),
    VerlKey(_R + "log_prob_micro_batch_size_per_gpu", "ignored", _MICRO),
    VerlKey(_R + "log_prob_use_dynamic_bsz", "ignored", _MICRO),
    VerlKey(_R + "enforce_eager", "ignored", "an SGLang setting here: give --sglang-disable-cuda-graph for eager "
            "generation"),
    VerlKey(_R + "free_cache_engine", "ignored", "with --colocate the engine releases its KV cache during training"),
    # reference
    VerlKey(_REF + "log_prob_micro_batch_size_per_gpu", "ignored", _MICRO),
    VerlKey(_REF + "log_prob_use_dynamic_bsz", "ignored", _MICRO),
    VerlKey(_REF + "megatron.tensor_model_parallel_size", "mapped", "must equal the actor's",
            _same_as_actor(_M + "tensor_model_parallel_size")),
    VerlKey(_REF + "megatron.pipeline_model_parallel_size", "mapped", "must equal the actor's",
            _same_as_actor(_M + "pipeline_model_parallel_size")),
    VerlKey(_REF + "megatron.expert_model_parallel_size", "mapped", "must equal the actor's",
            _same_as_actor(_M + "expert_model_parallel_size")),
    VerlKey(_REF + "megatron.param_offload", "ignored", "the reference is a weight tag of the actor's "
            "(--ref-weights-location)"),
    # reward
    VerlKey("custom_reward_function.path", "mapped", "--custom-reward-function-path PATH:NAME",
            _reward_path),
    VerlKey("custom_reward_function.name", "mapped", "the NAME of --custom-reward-function-path (default "
            "compute_score)", lambda v, _: []),
    VerlKey("custom_reward_function.reward_kwargs", "mapped", "--custom-reward-function-kwargs (JSON)",
            _reward_kwargs),
    VerlKey("reward_model.reward_manager", "mapped", "naive only: one compute_score call per sample",
            _only("naive", "verl's batch / prime / dapo reward managers are not built: the naive manager's "
                           "contract (--custom-reward-function-path) is")),
    # trainer
    VerlKey("trainer.total_training_steps", "mapped", "--num-rollout", _flag("--num-rollout", int)),
    VerlKey("trainer.total_epochs", "mapped", "accepted with trainer.total_training_steps (which wins, as in verl); "
            "alone refused: the step count needs the data's size", _total_epochs),
    VerlKey("trainer.save_freq", "mapped", "--save-interval (-1: none); without trainer.default_local_dir also "
            "--save checkpoints/PROJECT/EXPERIMENT (verl's default)", _save_freq),
    VerlKey("trainer.test_freq", "mapped", "--eval-interval (-1: none)",
            lambda v, vals: _every(v, vals, "--eval-interval")),
    VerlKey("trainer.default_local_dir", "mapped", "--save", _flag("--save")),
    VerlKey("trainer.critic_warmup", "mapped", "--num-critic-only-steps", _flag("--num-critic-only-steps", int)),
    VerlKey("trainer.logger", "mapped", "wandb -> --use-wandb, tensorboard -> --tensorboard-dir "
            "tensorboard_log/PROJECT/EXPERIMENT; console always", _loggers),
    VerlKey("trainer.project_name", "mapped", "--wandb-project", _flag("--wandb-project")),
    VerlKey("trainer.experiment_name", "mapped", "--wandb-group", _flag("--wandb-group")),
    VerlKey("trainer.n_gpus_per_node", "mapped", "--actor-num-gpus-per-node N --colocate (verl's hybrid engine: "
            "generation on the trainer's GPUs)", _gpus),
    VerlKey("trainer.nnodes", "mapped", "--actor-num-nodes", _flag("--actor-num-nodes", int)),
    VerlKey("trainer.resume_mode", "mapped", "auto (resume from --save), disable -> --no-auto-resume", _resume),
    VerlKey("trainer.val_before_train", "ignored", "evaluation runs every --eval-interval rollouts"),
]

VERL_KEYS: dict[str, VerlKey] = {row.key: row for row in _ROWS}


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """``[(key, value)]`` of Hydra-style ``KEY=VALUE`` overrides: one item per override (as a verl launch script's
    arguments arrive), or a single item holding them all, split as a shell splits words."""
    import yaml  # lazy: only a run given verl keys reads them

    out: list[tuple[str, Any]] = []
    if not items:
        return out
    for token in shlex.split(items[0]) if len(items) == 1 else items:
        if token.startswith("~"):
            raise ConfigError(f"--verl-overrides {token}: deleting a key (~) has no meaning here; drop it")
        key, eq, text = token.lstrip("+").partition("=")
        if not eq or not key:
            raise ConfigError(f"--verl-overrides {token!r}: expected KEY=VALUE (verl's Hydra overrides)")
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = text
        out.append((key, value))
    return out


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict):
        return [kv for k, v in data.items() for kv in _flatten(v, f"{prefix}{k}.")]
    return [(prefix[:-1], data)]


def read_verl_config(path: str) -> list[tuple[str, Any]]:
    """The (key, value) leaves of a YAML of verl keys."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--verl-config {path}: no such file")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--verl-config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--verl-config {path}: expected a mapping of verl's config keys at the top level")
    return _flatten(data)


@dataclass(frozen=True)
class Translated:
    key: str
    value: Any
    status: str
    tokens: tuple[str, ...]
    doc: str


def translate(pairs: list[tuple[str, Any]], source: str = "--verl-overrides") -> list[Translated]:
    """Every (key, value) through :data:`VERL_KEYS` (a later duplicate wins); ``ConfigError`` naming the key for an
    unknown or refused key or a value its row cannot take."""
    values: Values = {}
    for key, value in pairs:
        values[key] = value
    out = []
    for key, value in values.items():
        row = VERL_KEYS.get(key)
        if row is None:
            raise ConfigError(f"{source}: verl key {key!r} is not in the translation table "
                              "(docs/migrating-from-verl.md lists the keys it maps, ignores and refuses); drop it, "
                              "or give this engine's flag for it (docs/flags.md)")
        if row.status == "refused":
            raise ConfigError(f"{source}: verl key {key}={value!r} is refused: {row.doc}")
        tokens: list[str] = []
        if row.convert is not None:
            try:
                tokens = row.convert(value, values)
            except (_Refused, TypeError, ValueError) as exc:
                raise ConfigError(f"{source}: verl key {key}={value!r} is refused: {exc}") from None
        out.append(Translated(key, value, row.status, tuple(tokens), row.doc))
    return out


def _gather(verl_overrides: list[str], verl_config: Optional[str]) -> list[tuple[str, Any]]:
    pairs = read_verl_config(verl_config) if verl_config else []
    return pairs + parse_overrides(list(verl_overrides or []))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # noqa: D102 - argparse hook: a ConfigError, never a usage print and exit
        raise ConfigError(f"{message}: --verl-overrides takes verl's KEY=VALUE overrides (docs/migrating-from-verl.md)")


def translated_tokens(argv: list[str]) -> list[str]:
    """``argv`` with the flag tokens of its ``--verl-overrides`` / ``--verl-config`` placed in front (so the
    command line's own flags win); unchanged when neither is given."""
    pre = _Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--verl-overrides", nargs="+", default=[])
    pre.add_argument("--verl-config", default=None)
    ns, _ = pre.parse_known_args(argv)
    if not ns.verl_overrides and not ns.verl_config:
        return argv
    source = "--verl-config" if ns.verl_config and not ns.verl_overrides else "--verl-overrides"
    tokens = [t for row in translate(_gather(ns.verl_overrides, ns.verl_config), source) for t in row.tokens]
    if "--colocate" in tokens and "--colocate" in argv:
        tokens.remove("--colocate")
    return tokens + argv


def translation_lines(verl_overrides: list[str], verl_config: Optional[str]) -> list[str]:
    """What ``--dry-run`` prints: one line per verl key, the flags it became or why it changed nothing."""
    if not verl_overrides and not verl_config:
        return []
    rows = translate(_gather(verl_overrides, verl_config))
    lines = [f"verl keys: {len(rows)} translated ({sum(r.status == 'mapped' for r in rows)} mapped, "
             f"{sum(r.status == 'ignored' for r in rows)} ignored); flags on the command line win"]
    for r in rows:
        shown = " ".join(r.tokens) if r.tokens else f"(nothing: {r.doc})"
        lines.append(f"  {r.key}={r.value!r} -> {shown}")
    return lines


_DEFAULTS = """## Defaults that differ from verl

A key a script does not give takes this engine's default:

| verl | here |
|---|---|
| `data.shuffle: true` | no shuffle unless `--rollout-shuffle` (`data.shuffle=True`) |
| `data.max_prompt_length: 512`, `max_response_length: 512` | 1024 each |
| `actor.optim.lr: 1e-6` | the same |
| `actor.clip_ratio: 0.2` | the same (`--eps-clip 0.2`) |
| `actor.loss_agg_mode: token-mean` | the same unless the estimator asks for another |
| `actor.kl_loss_type: low_var_kl` | `k3` (the same estimator, another name) |
| `rollout.n: 1` | `--n-samples-per-prompt 1` |
| the reward from `data_source` (`default_compute_score`) | `--rm-type verl` scores by `data_source` with the rules built here (gsm8k, MATH, math_dapo); other sources need `--custom-reward-function-path` |
"""


def render() -> str:
    lines = [
        "# Migrating from verl",
        "",
        "Generated by `python -m megatron_rl.config.docs` from the table in `megatron_rl/config/verl_keys.py` and "
        "the prose in it; do not edit by hand (a test fails when this file is stale).",
        "",
        "## The command",
        "",
        "A verl launch script's overrides go to `--verl-overrides` unchanged (one argument each, as the script "
        "passes them, or all in one quoted argument); `--dry-run` prints what each became:",
        "",
        "```bash",
        "python -m megatron_rl.train --dry-run --verl-overrides \\",
        "    algorithm.adv_estimator=grpo \"data.train_files=['$HOME/data/gsm8k/train.parquet', "
        "'$HOME/data/math/train.parquet']\" \\",
        "    actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct data.train_batch_size=1024 \\",
        "    actor_rollout_ref.rollout.n=5 actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 \\",
        "    trainer.n_gpus_per_node=8 trainer.total_training_steps=100 \\",
        "  --apply-chat-template --rm-type verl",
        "```",
        "",
        "A verl script runs unchanged when its `python3 -m verl.trainer.main_ppo --config-path=... "
        "--config-name=...` line reaches this engine instead, e.g. through a shell function defined before "
        "sourcing it (the first four words are verl's module and config name):",
        "",
        "```bash",
        "python3() { python -m megatron_rl.train --apply-chat-template --rm-type verl --verl-overrides \"${@:5}\"; }",
        "source examples/grpo_trainer/run_qwen2-7b_math_megatron.sh trainer.total_training_steps=100 "
        "actor_rollout_ref.model.path=/models/Qwen2-7B-Instruct",
        "```",
        "",
        "Flags given beside `--verl-overrides` win over the translation. `--verl-config FILE.yaml` takes the same "
        "keys nested as verl's config (the keys you set, not verl's whole generated config).",
        "",
        "## Data: verl's parquet schema",
        "",
        "`--prompt-data FILE.parquet [FILE ...]` (several files, verl's `data.train_files` list, are one dataset in "
        "the order given) and `--eval-prompt-data` read verl's rows as its preprocessing scripts "
        "write them (`examples/data_preprocess/gsm8k.py`): `prompt` (the `--input-key` column, verl's "
        "`data.prompt_key`) is a list of chat messages rendered through the tokenizer's chat template "
        "(`--apply-chat-template`, required); `reward_model.ground_truth` is the label; `data_source`, "
        "`extra_info` and `ability` go into every sample's metadata. A row with a prompt that is not chat "
        "messages, an empty `data_source`, no ground truth or an `extra_info` that is not a dict is refused naming "
        "the file, the row (counted from 1) and the column; so is a column outside that schema (its values would "
        "reach no reward function) and `videos`; verl's `images` column is read with `--multimodal-keys "
        "'{\"image\": \"images\"}'` (docs/vlm.md; runs with images are still refused) and refused without it. "
        "`--label-key`, `--metadata-key` and "
        "`--tool-key` do not apply to a parquet file (refused when set). Reading needs pyarrow (a dependency of "
        "this package).",
        "",
        "## Rewards",
        "",
        "`--custom-reward-function-path file.py:compute_score` (verl's `custom_reward_function.path` / `.name`; "
        "`file.py` alone names its `compute_score`) calls the function per sample with verl's keywords "
        "`data_source`, `solution_str` (the response decoded without special tokens), `ground_truth`, "
        "`extra_info`, plus `--custom-reward-function-kwargs` (verl's `reward_kwargs`, a JSON object), passing "
        "only those its signature takes: verl's own per-dataset scorers (`verl/utils/reward_score/gsm8k.py`'s "
        "`compute_score(solution_str, ground_truth, method=...)`) run unchanged. `async def` functions run "
        "concurrently within a batch. A number is the reward; verl's dict result gives its `score` as the reward "
        "and every other numeric or bool key as a metric `reward/<key>` (batch mean); text values are dropped. "
        "One batch is one call bounded by `--user-function-timeout`; the function is imported and its signature "
        "checked before the workers start.",
        "",
        "Built-in rules with verl's scores (checked on a corpus against verl's functions, "
        "tests/rollout/test_verl_scores.py): `--rm-type gsm8k` (verl's `gsm8k.py`, strict `#### N`), "
        "`--rm-type verl_math` (verl's `math_reward.py`, the Hendrycks MATH normalisation of the last `\\boxed{}`), "
        "`--rm-type math_dapo` (verl's `math_dapo.py`: 1 / -1 on the `Answer:` line, metric `reward/acc`), and "
        "`--rm-type verl`, which picks one of them by each sample's `data_source` as verl's "
        "`default_compute_score` does (`openai/gsm8k`; `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, "
        "`HuggingFaceH4/MATH-500`; `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`) and refuses another "
        "source by name. `--rm-type math` is this engine's own, more lenient rule (numeric comparison: `1,000` "
        "equals `1000`, `0.50` equals `1/2`), not verl's.",
        "",
        "## Config keys",
        "",
        "Statuses: **mapped** (becomes the flags shown, or accepted at the value verl's behaviour equals this "
        "engine's), **ignored** (changes nothing here, for the reason shown), **refused** (the run is refused "
        "naming the key). A key not listed is refused by name.",
        "",
        "| verl key | status | here |",
        "|---|---|---|",
    ]
    for row in _ROWS:
        lines.append(f"| `{row.key}` | {row.status} | {row.doc.replace('|', '/')} |")
    lines += ["", _DEFAULTS]
    return "\n".join(lines)


__all__ = ["DOC_PATH", "VERL_KEYS", "VerlKey", "parse_overrides", "read_verl_config", "render", "translate",
           "translated_tokens", "translation_lines"]
