"""What a run with a vision-language ``--hf-checkpoint`` may combine (docs/vlm.md), checked at validation, before
any worker starts.

Built: the megatron backend's passes with images (packed THD micro-batches carrying pixels, grids and M-RoPE
positions, at every layout the model is proven at), the embedded engine generating with images on the driver (or
its replicas on every rank: requests travel whole) or served from its own process (``--embedded-engine-ranks
process``, the asynchronous modes' default: the images go in SGLang's ``image_data``), SGLang with the disk weight
transport (the same ``image_data``), the weight sync of every tensor, the vision tower's included,
and ``--freeze-vision-tower``. The rest is refused by name, one row of :data:`NOT_BUILT` each, so a run never
starts on a path that would drop the images or train them wrongly.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional

from .architecture import VISION_LANGUAGE_TYPES, read_hf_config
from .schema import Config


class NotBuilt(NamedTuple):
    """A combination refused with a vision-language checkpoint: which flags, whether this run has them, and why."""

    flags: Callable[[Config], str]  # the flags as the run gives them
    applies: Callable[[Config], bool]
    why: str


NOT_BUILT: tuple[NotBuilt, ...] = (
    NotBuilt(lambda c: "--train-backend fsdp", lambda c: c.has_training and c.precision.train_backend == "fsdp",
             "the FSDP backend has no image path (its HF model would take pixels, but its packing does not carry "
             "them); use --train-backend megatron"),
    NotBuilt(lambda c: f"--rollout-backend sglang with --update-weight-transport {c.sync.update_weight_transport}",
             lambda c: c.has_rollout_engine and c.rollout.rollout_backend == "sglang"
             and c.sync.update_weight_transport != "disk",
             "SGLang serving a vision-language model is checked with the disk weight transport only (scripts/"
             "test_sglang_real.sh --vlm); add --update-weight-transport disk, or use --rollout-backend embedded"),
    NotBuilt(lambda c: "--rollout-engine-urls (servers started elsewhere) without --freeze-vision-tower",
             lambda c: c.has_rollout_engine and c.rollout.rollout_backend == "sglang"
             and bool(c.rollout.rollout_engine_urls) and not c.model.freeze_vision_tower,
             "SGLang keeps each image's vision-tower output across weight updates unless started with "
             "SGLANG_VLM_CACHE_SIZE_MB=0, which this run cannot see on a server it did not start; let the run "
             "launch the engines (it sets it), or add --freeze-vision-tower (docs/vlm.md)"),
    NotBuilt(lambda c: "--advantage-estimator ppo", lambda c: c.algorithm.advantage_estimator == "ppo",
             "the critic (a value model with images) is not built; use grpo or another critic-free estimator"),
    NotBuilt(lambda c: f"--lora-rank {c.lora.lora_rank}", lambda c: c.lora.lora_rank > 0,
             "LoRA adapters on a vision-language model are not built; train in full, or --freeze-vision-tower"),
    NotBuilt(lambda c: "--custom-generate-function-path / --rollout-function-path / --agent-function-path",
             lambda c: bool(c.rollout.custom_generate_function_path or c.rollout.rollout_function_path
                            or c.rollout.agent_function_path),
             "user rollout functions speak token ids to the engine (generate(input_ids)); images do not reach it"),
)


#: vision-language model types whose model is proven (parity, conversion) but whose runs are not built yet, and why
RUNS_NOT_BUILT: dict[str, str] = {
    "qwen3_vl_moe": "the embedded engine's weight sync of its stacked experts (the checkpoint's [E, hidden, 2 * ffn] "
                    "gate_up_proj, transposed in transformers' memory) is not built; the model in megatron-core and "
                    "its HF <-> torch_dist conversion are (docs/vlm.md). Use a dense qwen3_vl checkpoint",
}


def _vision_language_type(path: str) -> Optional[str]:
    """The checkpoint's model_type when it is a vision-language one, else None (unreadable: reported elsewhere)."""
    try:
        model_type = read_hf_config(path).get("model_type")
    except (OSError, ValueError):
        return None
    return model_type if model_type in VISION_LANGUAGE_TYPES else None


def vision_language_errors(cfg: Config) -> list[str]:
    """The refusals of this run's vision-language combinations (none for a text checkpoint, except the flags that
    need a vision-language one)."""
    path = cfg.model.hf_checkpoint
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return []  # no config.json: the checkpoint check reports it (a dry run plans from the flags)
    model_type = _vision_language_type(path)
    where = f"--hf-checkpoint {path}"
    if model_type is None:
        flags = [f for f, on in (("--freeze-vision-tower", cfg.model.freeze_vision_tower),
                                 ("--multimodal-keys", cfg.data.multimodal_keys is not None)) if on]
        return [f"{flag}: {where} is not a vision-language checkpoint (model_types "
                f"{', '.join(VISION_LANGUAGE_TYPES)}); drop {flag} or use a vision-language checkpoint"
                for flag in flags]
    if model_type in RUNS_NOT_BUILT:
        return [f"{where}: model_type {model_type!r} runs are not built: {RUNS_NOT_BUILT[model_type]}"]
    errors = [f"{rule.flags(cfg)} with {where} (model_type {model_type!r}, vision-language): {rule.why} "
              "(docs/vlm.md)" for rule in NOT_BUILT if rule.applies(cfg)]
    if cfg.model.freeze_vision_tower and cfg.memory.effective_offload_rollout:
        errors.append(f"--freeze-vision-tower with {'--colocate' if cfg.memory.colocate else '--offload-rollout'}: "
                      "a released engine needs every tensor back, and a frozen tower is synced once only; drop one")
    return errors
