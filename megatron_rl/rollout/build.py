"""Build the driver's rollout side from the run's flags: engine, prompt data, reward.

The engine comes from the ``--rollout-backend`` table (``base.ENGINES``); this
module never names an engine. Errors come in the order that costs least: an
unknown or not-yet-wired backend, missing ``--prompt-data``, a bad reward
(``--rm-type`` / ``--custom-rm-path`` / ``--rm-url``) and a bad ``--dynamic-sampling-filter-path``
all fail before the engine loads a model, as do the rollout functions (``--custom-generate-function-path``,
``--rollout-function-path``, ``--tools``: imported here);
bad prompt lines are then reported by ``PromptDataset`` (it needs the engine's
tokenizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_rl.config.multimodal import parse_multimodal_keys
from megatron_rl.data.images import ImageProcessor
from megatron_rl.data.prompts import MIB, PromptDataset, PromptIterator
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.base import ENGINES, RolloutEngine
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.replicas import ReplicaWorker, replicate_on_every_rank, worker_for_this_rank
from megatron_rl.rollout.dynamic_sampling import DynamicSampler
from megatron_rl.rollout.agent import check_tools
from megatron_rl.rollout.endpoint.agent import rollout_functions_from_config
from megatron_rl.rollout.rewards import reward_fn_from_config

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.plan.engines import EnginePlacement


def build_rollout(cfg: "Config", placement: "Optional[EnginePlacement]" = None) -> RolloutManager:
    """The driver's rollout side: engine (from ``--rollout-backend``; ``placement``: the SGLang engines this
    run launched), prompt iterator, eval prompts, reward."""
    engine_type = ENGINES.get(cfg.rollout.rollout_backend)  # unknown / refused names fail before anything loads
    prompt_data = cfg.data.prompt_files
    if not prompt_data:
        raise ConfigError("a rollout needs prompts: give --prompt-data FILE.jsonl")
    reward_fn = reward_fn_from_config(cfg)  # fail fast
    dynamic_sampler = DynamicSampler.from_config(cfg)  # None without --dynamic-sampling-filter-path
    functions = rollout_functions_from_config(cfg)  # --custom-generate-function-path / --rollout-function-path /
    # --agent-function-path
    check_tools(cfg)  # --tools imported and checked here (and the sandbox, for sandboxed tools), not at a call
    if cfg.embedded_placement == "process":  # its own process, spoken to as an SGLang server is
        # lazy: a subprocess and an HTTP client, only for runs that serve the embedded engine from a process
        from megatron_rl.rollout.embedded_process import start_embedded_engine

        engine: RolloutEngine = start_embedded_engine(cfg)
    else:
        engine = engine_type.from_config(cfg, placement) if placement is not None else engine_type.from_config(cfg)
    if cfg.embedded_replicas:  # --embedded-engine-ranks: the other ranks hold replicas (rollout.replicas)
        engine = replicate_on_every_rank(engine)
    d, b = cfg.data, cfg.batching
    tokenizer = getattr(engine, "tokenizer", None)
    # --multimodal-keys: the prompts' images through the checkpoint's own image processor, once, here on the
    # driver (validation still refuses such runs until training with images is built: docs/vlm.md)
    multimodal_keys = parse_multimodal_keys(d.multimodal_keys)
    image_processor = (ImageProcessor(cfg.model.hf_checkpoint) if multimodal_keys and cfg.model.hf_checkpoint
                       else None)

    def dataset(path: "str | tuple[str, ...]") -> PromptDataset:
        return PromptDataset(path, tokenizer=tokenizer, input_key=d.input_key, label_key=d.label_key,
                             metadata_key=d.metadata_key, tool_key=d.tool_key,
                             apply_chat_template=d.apply_chat_template,
                             max_prompt_len=cfg.rollout.rollout_max_prompt_len,
                             max_line_bytes=d.max_prompt_line_mib * MIB,  # a file changed since the pre-flight
                             multimodal_keys=multimodal_keys, image_processor=image_processor)

    prompts = PromptIterator(dataset(prompt_data), rollout_batch_size=b.rollout_batch_size,
                             n_samples_per_prompt=b.n_samples_per_prompt, shuffle=d.rollout_shuffle,
                             seed=cfg.rollout.rollout_seed)
    eval_datasets = {name: dataset(path) for name, path in d.eval_sets}  # --eval-prompt-data
    return RolloutManager(cfg, engine, prompts, reward_fn, eval_datasets, dynamic_sampler=dynamic_sampler,
                          rollout_functions=functions)


def build_replica_worker(cfg: "Config") -> Optional[ReplicaWorker]:
    """A non-driver rank's replica of the embedded engine (``--embedded-engine-ranks``), or None when this
    rank holds none; its engine loads ``--hf-checkpoint`` as the driver's does."""
    if not cfg.embedded_replicas:
        return None
    return worker_for_this_rank(cfg, ENGINES.get(cfg.rollout.rollout_backend))
