"""HF checkpoint names <-> the live parameters of a ``transformers`` model.

Weight updates arrive in *checkpoint* layout (the names and shapes in
``model.safetensors``), which is what the trainer's ``export_weights`` and the
disk transport produce. ``transformers`` >= 5 keeps some weights in a different
in-memory layout: MoE experts are fused into 3-D parameters
(``mlp.experts.gate_up_proj[e] = cat(gate_proj_e, up_proj_e)``,
``mlp.experts.down_proj[e] = down_proj_e``). ``HFParamMap`` resolves every
checkpoint name to a view of the live storage, so an update writes in place and
``named_weights`` reads without copies.

Invariant: the checkpoint names this map accepts are exactly those
``save_pretrained`` writes (plus ``lm_head.weight`` aliasing the embedding when
embeddings are tied), each with the checkpoint's shape.
"""

from __future__ import annotations

import re
from typing import Callable, Iterator

import torch

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _view(live: Callable[[], torch.Tensor], index: int | tuple[int, slice]) -> Callable[[], torch.Tensor]:
    """``live()[index]`` on every call, so a swapped storage is followed (``index`` is bound now)."""
    return lambda: live()[index]


class HFParamMap:
    """Maps each checkpoint tensor name to a function returning a view of the live parameter."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._views: dict[str, Callable[[], torch.Tensor]] = {}
        params = dict(model.named_parameters())
        for name, param in params.items():
            fused = _FUSED_EXPERTS.match(name)
            if fused and param.dim() == 3:
                self._add_fused_experts(fused["prefix"], fused["kind"], name)
            else:
                self._views[name] = self._getter(name)
        tied = getattr(model.config, "tie_word_embeddings", False)
        if tied and "lm_head.weight" not in self._views and "model.embed_tokens.weight" in self._views:
            self._aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        else:
            self._aliases = {}

    def _getter(self, param_name: str) -> Callable[[], torch.Tensor]:
        # Resolve on every call: release()/resume() swap the parameter's storage.
        return lambda: self._model.get_parameter(param_name).data

    def _add_fused_experts(self, prefix: str, kind: str, param_name: str) -> None:
        live = self._getter(param_name)
        num_experts = live().shape[0]
        for e in range(num_experts):
            if kind == "down_proj":
                self._views[f"{prefix}.{e}.down_proj.weight"] = _view(live, e)
            else:
                half = live().shape[1] // 2
                self._views[f"{prefix}.{e}.gate_proj.weight"] = _view(live, (e, slice(None, half)))
                self._views[f"{prefix}.{e}.up_proj.weight"] = _view(live, (e, slice(half, None)))

    def names(self) -> list[str]:
        """Canonical checkpoint names (no aliases), in model order."""
        return list(self._views)

    def __contains__(self, name: str) -> bool:
        return name in self._views or name in self._aliases

    def view(self, name: str) -> torch.Tensor:
        """A view of the live storage for checkpoint ``name`` (writes go into the model)."""
        return self._views[self._aliases.get(name, name)]()

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, get in self._views.items():
            yield name, get()
