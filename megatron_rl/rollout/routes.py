"""The experts an HF MoE model routes each token to, read off its routers during the engine's forwards.

Why: MoE routing replay from the rollout (R3, ``--use-rollout-routing-replay``) trains on the experts
the engine used, so the engine has to say which. transformers' MoE routers (``mlp.gate`` of every
MoE layer: Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V3; ``mlp.router`` of gpt-oss) return ``(router_logits, weights, indices)``;
a forward hook keeps the indices of the last forward, ``[batch x seq, topk]`` per MoE layer, which
:class:`RouteCapture` hands back as ``[batch, seq, moe_layers, topk]``. The engine files each row of
it under the token that was the input there (module docstring of ``rollout.embedded``).

The SGLang wire format (``meta_info["routed_experts"]``: base64 of int32 ``[tokens,
num_hidden_layers, topk]``, dense layers' rows zero) converts to and from the per-MoE-layer
``RoutedExperts`` with :func:`to_sglang` / :func:`from_sglang`.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.config.architecture import moe_layer_pattern, text_config
from megatron_rl.data.types import RoutedExperts
from megatron_rl.errors import ConfigError, EngineError

_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)$")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_experts(config: Any) -> int:
    """The routed experts of an HF (text) config, 0 for a dense model."""
    return int(next((getattr(config, k) for k in _EXPERT_KEYS if getattr(config, k, None)), 0))


class RouteCapture:
    """Forward hooks on every MoE router of ``model``; :meth:`take` returns what the last forward routed."""

    def __init__(self, model: Any):
        config = getattr(model.config, "text_config", None) or model.config  # a transformers PreTrainedModel
        self.num_experts = num_experts(config)
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.topk = int(getattr(config, "num_experts_per_tok", 0) or 0)
        gates = sorted((int(m.group(1)), module) for name, module in model.named_modules()
                       if (m := _GATE.search(name)))
        self.moe_layers = [layer for layer, _ in gates]  # HF layer index of each MoE layer, in order
        if not gates or not self.num_experts or not self.topk:
            raise ValueError(f"{type(model).__name__} has no MoE routers to record (routes exist for MoE models "
                             "only)")
        self._last: list[Optional[torch.Tensor]] = [None] * len(gates)
        self._handles = [module.register_forward_hook(self._hook(k)) for k, (_, module) in enumerate(gates)]

    def _hook(self, k: int):
        def hook(module, args, output):
            indices = output[-1] if isinstance(output, tuple) else None
            if not isinstance(indices, torch.Tensor) or indices.is_floating_point():
                raise RuntimeError(f"{type(module).__name__} (MoE layer {self.moe_layers[k]}) did not return top-k "
                                   "expert indices as its last output; this transformers router cannot be recorded")
            self._last[k] = indices.detach().reshape(-1, indices.shape[-1])
        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """``[batch, seq, moe_layers, topk]`` (int16, CPU) of the last forward over ``batch x seq`` tokens."""
        if any(t is None for t in self._last):
            raise RuntimeError("route capture: a forward ran without reaching every MoE router")
        routes = torch.stack([t.to("cpu", torch.int16) for t in self._last], dim=1)  # type: ignore[union-attr]
        self._last = [None] * len(self._last)
        return routes.reshape(batch, seq, len(self.moe_layers), self.topk)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def routed_experts(rows: list[torch.Tensor], total_length: int, num: int) -> RoutedExperts:
    """A row's routes (its prompt's, then one per fed token) as the sample's ``RoutedExperts``: the first
    ``total_length - 1`` tokens (the last token is never an input)."""
    routes = torch.cat(rows) if rows else torch.zeros(0, 0, 0, dtype=torch.int16)
    return RoutedExperts.from_indices(routes[:max(0, total_length - 1)].numpy(), num)


def to_sglang(routes: RoutedExperts, moe_layers: list[int], num_hidden_layers: int) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of int32 ``[tokens, num_hidden_layers, topk]``."""
    full = np.zeros((routes.tokens, num_hidden_layers, routes.topk), np.int32)
    full[:, moe_layers] = routes.array
    return base64.b64encode(full.tobytes()).decode("ascii")


def from_sglang(text: str, moe_layers: list[int], num_hidden_layers: int, topk: int, num: int) -> RoutedExperts:
    """Inverse of :func:`to_sglang`: the MoE layers' rows of SGLang's all-layer array."""
    raw = np.frombuffer(base64.b64decode(text), np.int32)
    if raw.size % (num_hidden_layers * topk):
        raise ValueError(f"routed_experts holds {raw.size} ids, not a multiple of num_hidden_layers "
                         f"{num_hidden_layers} x topk {topk}")
    full = raw.reshape(-1, num_hidden_layers, topk)
    return RoutedExperts.from_indices(full[:, moe_layers], num)


@dataclass(frozen=True)
class RouteLayout:
    """What an SGLang server's routes mean for one model: its MoE layers among ``num_hidden_layers``, the
    top-k, the expert count (read from config.json, as the bridges build the model)."""

    moe_layers: tuple[int, ...]
    num_hidden_layers: int
    topk: int
    num_experts: int

    @classmethod
    def of_checkpoint(cls, hf_dir: str) -> "RouteLayout":
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as fh:
            hf = json.load(fh)
        c = text_config(hf)
        pattern = moe_layer_pattern(hf)
        experts = int(next((c[k] for k in _EXPERT_KEYS if c.get(k)), 0))
        if not any(pattern) or not experts:
            raise ConfigError(f"{hf_dir}/config.json describes a dense model: it has no expert routes to return")
        return cls(tuple(i for i, m in enumerate(pattern) if m), len(pattern), int(c["num_experts_per_tok"]), experts)

    def read(self, text: Optional[str], total_length: int, *, where: str) -> RoutedExperts:
        """One row's ``meta_info.routed_experts`` as the sample's routes, checked (``total_length - 1`` tokens)."""
        if text is None:
            raise EngineError(f"{where}: asked for return_routed_experts, the server sent no meta_info.routed_experts; "
                              "start SGLang with --enable-return-routed-experts (this run's launcher adds it; a "
                              "server of --rollout-engine-urls needs it on its own command line)")
        try:
            routes = from_sglang(text, list(self.moe_layers), self.num_hidden_layers, self.topk, self.num_experts)
        except (ValueError, TypeError) as exc:
            raise EngineError(f"{where}: meta_info.routed_experts is not SGLang's base64 int32 [tokens, "
                              f"num_hidden_layers {self.num_hidden_layers}, topk {self.topk}] ({exc})") from exc
        if routes.tokens != total_length - 1:
            raise EngineError(f"{where}: meta_info.routed_experts covers {routes.tokens} tokens; the prompt + output "
                              f"have {total_length}, so {total_length - 1} were expected (the last token is never "
                              "an input)")
        return routes
