"""The ``args`` namespace a slime function is called with: slime's names for the run's settings.

Every flag of the run is there under its own name (our flags keep slime's names where they share one:
``rollout_max_response_len``, ``n_samples_per_prompt``, ``hf_checkpoint``, ``partial_rollout``, ``rm_type``,
``custom_rm_path``, ...), then slime's names that have no flag here, set to what this run does:
``sglang_router_ip`` / ``sglang_router_port`` (the gateway: ``gateway.py``), ``rollout_stop`` (None: stop
strings are a function's own), ``rollout_skip_special_tokens``, ``sglang_server_concurrency``, ``group_rm``,
``rollout_global_dataset``, ``over_sampling_batch_size``, ``ci_test``, ..."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from typing import Any


def slime_args(cfg: Any, router_ip: str, router_port: int) -> Namespace:
    """A fresh namespace for one call (a function may write to it without touching another call's)."""
    ns = Namespace()
    if cfg is not None and dataclasses.is_dataclass(cfg):
        for group in dataclasses.fields(cfg):
            section = getattr(cfg, group.name)
            if dataclasses.is_dataclass(section):
                for f in dataclasses.fields(section):
                    setattr(ns, f.name, getattr(section, f.name))
    defaults: dict[str, Any] = {
        "rollout_stop": None, "rollout_skip_special_tokens": False, "sglang_server_concurrency": 512,
        "rollout_num_gpus": 1, "rollout_num_gpus_per_engine": 1, "rollout_num_engines": 1, "sglang_dp_size": 1,
        "group_rm": False, "rollout_global_dataset": True, "ci_test": False, "use_distributed_post": False,
        "mask_offpolicy_in_partial_rollout": False, "sglang_enable_deterministic_inference": False,
        "rollout_sample_filter_path": None, "rollout_all_samples_process_path": None, "reward_key": None,
        "use_rollout_routing_replay": False, "num_gpus_per_node": 1, "sglang_model_routers": None,
        "partial_rollout": False, "rollout_top_k": -1, "rollout_top_p": 1.0, "rollout_temperature": 1.0,
        "rollout_stop_token_ids": [], "custom_generate_function_path": None, "custom_rm_path": None,
        "rm_type": None, "dynamic_sampling_filter_path": None,
        # slime's context caps (retool, multi_agent read them): None = not capped beyond the response length
        "rollout_max_context_len": None, "eval_max_context_len": None,
    }
    for name, value in defaults.items():
        if not hasattr(ns, name):
            setattr(ns, name, value)
    if getattr(ns, "over_sampling_batch_size", None) is None:
        ns.over_sampling_batch_size = getattr(ns, "rollout_batch_size", 1)
    if getattr(ns, "rollout_stop_token_ids", None) is None:
        ns.rollout_stop_token_ids = []
    ns.sglang_router_ip, ns.sglang_router_port = router_ip, int(router_port)
    return ns


__all__ = ["slime_args"]
