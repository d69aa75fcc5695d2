"""Validation of ``--speculative-*`` (speculative decoding with the model's MTP head as the draft,
rollout/speculative.py): what the embedded engine runs, what the weight sync must carry, what SGLang gets."""

from __future__ import annotations

from .architecture import read_hf_config, text_config
from .schema import Config

SPEC_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
_DEFAULTS = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": None}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def speculative_errors(cfg: Config) -> list[str]:
    r = cfg.rollout
    if r.speculative_algorithm is None:
        return [f"{_flag(n)} {getattr(r, n)} needs --speculative-algorithm NEXTN (it sizes the draft): add it or drop "
                f"{_flag(n)}" for n in SPEC_FLAGS if getattr(r, n) != _DEFAULTS[n]]
    algo = f"--speculative-algorithm {r.speculative_algorithm}"
    errors = []
    both = sorted(k for k in r.sglang_args if k.startswith("speculative_"))
    if both:
        errors.append(f"{algo} and --sglang-{both[0].replace('_', '-')}: the --speculative-* flags set SGLang's "
                      "arguments of the same names; give them one way, not both")
    if r.speculative_num_steps < 1:
        errors.append(f"--speculative-num-steps {r.speculative_num_steps}: use a value >= 1")
    if r.rollout_backend == "embedded":
        errors.extend(_embedded_errors(cfg, algo))
    depths = _mtp_depths(cfg)
    if depths == 0:
        errors.append(f"{algo}: {cfg.model.hf_checkpoint} has no MTP layers (config.json num_nextn_predict_layers); "
                      "the draft is the model's own MTP head (DeepSeek-V3, GLM-4.5 checkpoints): drop the flag")
    if cfg.has_training and cfg.precision.train_backend == "fsdp":
        errors.append(f"{algo} with --train-backend fsdp: transformers' model drops the MTP layers, so the weight "
                      "sync cannot carry the draft; use --train-backend megatron with --mtp-num-layers")
    elif cfg.has_training and not cfg.megatron.mtp_num_layers:
        errors.append(f"{algo}: the weight sync carries the draft's MTP layers from the trainer, which holds them only "
                      f"with --mtp-num-layers; add --mtp-num-layers {depths or 1} (and --enable-mtp-training to train "
                      "them)")
    return errors


def _embedded_errors(cfg: Config, algo: str) -> list[str]:
    r = cfg.rollout
    errors = []
    if r.speculative_eagle_topk != 1:
        errors.append(f"--speculative-eagle-topk {r.speculative_eagle_topk}: the embedded engine drafts a chain "
                      "(top-k 1), not a tree; use --speculative-eagle-topk 1")
    steps, tokens = r.speculative_num_steps, r.speculative_num_draft_tokens
    if tokens is not None and tokens != steps + 1:
        errors.append(f"--speculative-num-draft-tokens {tokens}: a chain of --speculative-num-steps {steps} verifies "
                      f"{steps + 1} tokens; use {steps + 1} (or leave it unset)")
    conflicts = [(cfg.megatron.use_rollout_routing_replay, "--use-rollout-routing-replay (a rejected draft's routes "
                  "would be recorded)"),
                 (cfg.algorithm.true_on_policy_mode, "--true-on-policy-mode (a verify forward of several positions is "
                  "not bitwise the one-token forward)"),
                 (cfg.embedded_placement == "process", "--embedded-engine-ranks process (the engine process is "
                  "started without a draft)")]
    errors.extend(f"{algo} with {what}: not built in the embedded engine; drop one" for bad, what in conflicts if bad)
    return errors


def _mtp_depths(cfg: Config) -> int | None:
    """config.json's ``num_nextn_predict_layers`` of ``--hf-checkpoint`` (None: unreadable, named elsewhere)."""
    if not cfg.model.hf_checkpoint:
        return None
    try:
        return int(text_config(read_hf_config(cfg.model.hf_checkpoint)).get("num_nextn_predict_layers") or 0)
    except (OSError, ValueError):
        return None
