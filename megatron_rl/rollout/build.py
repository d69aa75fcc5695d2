"""Build the driver's rollout side from the run's flags: engine, prompt data, reward.

The engine comes from the ``--rollout-backend`` table (``base.ENGINES``); this
module never names an engine. Errors come in the order that costs least: an
unknown or not-yet-wired backend, missing ``--prompt-data`` and a bad reward
(``--rm-type`` / ``--custom-rm-path``) all fail before the engine loads a model;
bad prompt lines are then reported by ``PromptDataset`` (it needs the engine's
tokenizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_rl.data.prompts import MIB, PromptDataset, PromptIterator
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.base import ENGINES
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.replicas import ReplicaWorker, replicate_on_every_rank, worker_for_this_rank
from megatron_rl.rollout.rewards import get_reward_fn

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.plan.engines import EnginePlacement


def build_rollout(cfg: "Config", placement: "Optional[EnginePlacement]" = None) -> RolloutManager:
    """The driver's rollout side: engine (from ``--rollout-backend``; ``placement``: the SGLang engines this
    run launched), prompt iterator, eval prompts, reward."""
    engine_type = ENGINES.get(cfg.rollout.rollout_backend)  # unknown / refused names fail before anything loads
    prompt_data = cfg.data.prompt_data
    if not prompt_data:
        raise ConfigError("a rollout needs prompts: give --prompt-data FILE.jsonl")
    reward_fn = get_reward_fn(rm_type=cfg.data.rm_type, custom_rm_path=cfg.data.custom_rm_path)  # fail fast
    engine = engine_type.from_config(cfg, placement) if placement is not None else engine_type.from_config(cfg)
    if cfg.embedded_replicas:  # --embedded-engine-ranks: the other ranks hold replicas (rollout.replicas)
        engine = replicate_on_every_rank(engine)
    d, b = cfg.data, cfg.batching
    tokenizer = getattr(engine, "tokenizer", None)

    def dataset(path: str) -> PromptDataset:
        return PromptDataset(path, tokenizer=tokenizer, input_key=d.input_key, label_key=d.label_key,
                             apply_chat_template=d.apply_chat_template,
                             max_prompt_len=cfg.rollout.rollout_max_prompt_len,
                             max_line_bytes=d.max_prompt_line_mib * MIB)  # a file changed since the pre-flight

    prompts = PromptIterator(dataset(prompt_data), rollout_batch_size=b.rollout_batch_size,
                             n_samples_per_prompt=b.n_samples_per_prompt, shuffle=d.rollout_shuffle,
                             seed=cfg.rollout.rollout_seed)
    eval_datasets = {name: dataset(path) for name, path in d.eval_sets}  # --eval-prompt-data
    return RolloutManager(cfg, engine, prompts, reward_fn, eval_datasets)


def build_replica_worker(cfg: "Config") -> Optional[ReplicaWorker]:
    """A non-driver rank's replica of the embedded engine (``--embedded-engine-ranks``), or None when this
    rank holds none; its engine loads ``--hf-checkpoint`` as the driver's does."""
    if not cfg.embedded_replicas:
        return None
    return worker_for_this_rank(cfg, ENGINES.get(cfg.rollout.rollout_backend))
