"""The few model facts that decide whether a parallel layout can shard a model.

Read straight from an HF ``config.json`` with the json module (no transformers,
no torch), so ``check_plan`` stays instant. Key names follow the HF families we
support; MoE expert counts go by three names across families
(``num_experts`` Qwen-MoE, ``num_local_experts`` Mixtral, ``n_routed_experts``
DeepSeek). Multimodal configs keep the language model under ``text_config``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_rl.errors import PlanError

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """Shape facts of one model. ``num_experts == 0`` means dense."""

    num_attention_heads: int
    num_query_groups: int
    num_layers: int
    vocab_size: int
    num_experts: int = 0
    max_position_embeddings: int | None = None
    source: str = ""
    # hybrid models (Qwen3-Next, Qwen3.5): the gated delta-net layers' key heads (0: no such layers). TP shards
    # them in whole key-head groups; their recurrent state has no context parallelism in this build
    linear_num_key_heads: int = 0

    def __post_init__(self):
        for key in ("num_attention_heads", "num_query_groups", "num_layers", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"model {key}={value!r}{self._from()} must be a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise PlanError(
                f"model num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}{self._from()}; the config is inconsistent")

    def _from(self) -> str:
        return f" (from {self.source})" if self.source else ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Vocab as megatron pads it: up to a multiple of ``divisible_by * tp``."""
        unit = divisible_by * tp
        return -(-self.vocab_size // unit) * unit

    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict) -> "ModelShape":
        """Build from a checkpoint dir (its ``config.json``), a ``config.json`` path, or a dict."""
        if isinstance(path_or_dict, dict):
            cfg, source = path_or_dict, ""
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise PlanError(f"model config {path!r} does not exist; pass an HF checkpoint "
                                f"directory (with config.json) or the config.json file itself")
            try:
                with open(path, encoding="utf-8") as fh:
                    cfg = json.load(fh)
            except (OSError, ValueError) as exc:
                raise PlanError(f"cannot read model config {path!r}: {exc}") from None
            source = path
        if not isinstance(cfg, dict):
            raise PlanError(f"model config {source or '<dict>'} is not a JSON object")
        if "num_attention_heads" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]

        def need(key: str) -> int:
            if key not in cfg:
                raise PlanError(f"model config {source or '<dict>'} has no {key!r}; it is needed "
                                f"to check the parallel layout (is this an HF causal-LM config?)")
            return cfg[key]

        heads = need("num_attention_heads")
        experts = next((cfg[k] for k in _EXPERT_KEYS if cfg.get(k)), 0)
        return cls(
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            num_layers=need("num_hidden_layers"),
            vocab_size=need("vocab_size"),
            num_experts=int(experts),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            source=source,
            linear_num_key_heads=int(cfg.get("linear_num_key_heads") or 0)
            if "linear_attention" in (cfg.get("layer_types") or ["linear_attention"]) else 0,
        )
