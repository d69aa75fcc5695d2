"""HF checkpoint names <-> the live parameters of a ``transformers`` model.

Weight updates arrive in *checkpoint* layout (the names and shapes in
``model.safetensors``), which is what the trainer's ``export_weights`` and the
disk transport produce. ``transformers`` >= 5 keeps some weights in a different
in-memory layout: MoE experts are fused into 3-D parameters
(``mlp.experts.gate_up_proj[e] = cat(gate_proj_e, up_proj_e)``,
``mlp.experts.down_proj[e] = down_proj_e``), and some families rename the MoE
block in memory (Mixtral: checkpoint ``block_sparse_moe.experts.{e}.w1/w3/w2`` and
``block_sparse_moe.gate``, module ``mlp``; MiniMax-M2 likewise, its ``block_sparse_moe.e_score_correction_bias``
too; :data:`CHECKPOINT_MOE_NAMES`, after
transformers' ``conversion_mapping.py``); gpt-oss checkpoints hold the stacked experts
as memory does (:data:`STACKED_EXPERT_CHECKPOINTS`). Persistent buffers are checkpoint tensors
too (GLM's router ``e_score_correction_bias``). ``HFParamMap`` resolves every
checkpoint name to a view of the live storage, so an update writes in place and
``named_weights`` reads without copies.

Invariant: the checkpoint names this map accepts are exactly those
``save_pretrained`` writes (plus ``lm_head.weight`` aliasing the embedding when
embeddings are tied), each with the checkpoint's shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
# a layer's router / experts / selection bias in memory (MiniMax-M2 keeps its bias on the block itself)
_MOE_BLOCK = re.compile(r"\.mlp\.(?=gate\.|experts\.|e_score_correction_bias$)")


@dataclass(frozen=True)
class CheckpointMoeNames:
    """Where a family's checkpoint keeps a MoE layer's router and experts."""

    block: str = "mlp"  # checkpoint module of the router (``gate``) and ``experts``
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


#: model_type -> its checkpoint's MoE names, where they are not the Qwen-MoE ones
_MIXTRAL_NAMES = CheckpointMoeNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
CHECKPOINT_MOE_NAMES = {"mixtral": _MIXTRAL_NAMES, "minimax_m2": _MIXTRAL_NAMES}
#: model types whose checkpoint stores each layer's experts stacked, under the in-memory names and layout
STACKED_EXPERT_CHECKPOINTS = ("gpt_oss",)
#: model_type -> (in-memory prefix, checkpoint prefix) pairs: transformers >= 5 nests a vision-language model's
#: language model and vision tower under ``model.`` (``model.language_model.*``, ``model.visual.*``), the hub
#: checkpoints (and the trainer's export) keep ``model.*`` and ``visual.*`` (transformers' load-time conversion)
CHECKPOINT_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


#: where the embedded engine attaches its speculative MTP draft (rollout/mtp_draft.DRAFT_MODULE), names below it
#: being the checkpoint's
DRAFT_PREFIX = "mtp_draft."


def _view(live: Callable[[], torch.Tensor], index: int | tuple[int, slice]) -> Callable[[], torch.Tensor]:
    """``live()[index]`` on every call, so a swapped storage is followed (``index`` is bound now)."""
    return lambda: live()[index]


class HFParamMap:
    """Maps each checkpoint tensor name to a function returning a view of the live parameter."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._views: dict[str, Callable[[], torch.Tensor]] = {}
        model_type = getattr(model.config, "model_type", "")
        self._moe = CHECKPOINT_MOE_NAMES.get(model_type, CheckpointMoeNames())
        self._prefixes = CHECKPOINT_PREFIXES.get(model_type, ())
        stacked = model_type in STACKED_EXPERT_CHECKPOINTS
        params = dict(model.named_parameters())
        for name, param in params.items():
            fused = None if stacked else _FUSED_EXPERTS.match(name)
            if fused and param.dim() == 3:
                self._add_fused_experts(fused["prefix"], fused["kind"], name)
            else:
                self._views[self._checkpoint_name(name)] = self._getter(name)
        for module_name, module in model.named_modules():  # persistent buffers are checkpoint tensors too
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    full = f"{module_name}.{name}" if module_name else name
                    self._views[self._checkpoint_name(full)] = self._buffer_getter(full)
        tied = getattr(model.config, "tie_word_embeddings", False)
        if tied and "lm_head.weight" not in self._views and "model.embed_tokens.weight" in self._views:
            self._aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        else:
            self._aliases = {}

    def add_aliases(self, aliases: dict[str, str]) -> None:
        """Accept each key as another name of the tensor its value names (a speculative draft's MTP copies of the
        embedding and output head: rollout/mtp_draft.py), where that tensor is in the map."""
        for alias, target in aliases.items():
            target = self._aliases.get(target, target)
            if target in self._views:
                self._aliases[alias] = target

    def _getter(self, param_name: str) -> Callable[[], torch.Tensor]:
        # Resolve on every call: release()/resume() swap the parameter's storage.
        return lambda: self._model.get_parameter(param_name).data

    def _buffer_getter(self, buffer_name: str) -> Callable[[], torch.Tensor]:
        return lambda: self._model.get_buffer(buffer_name)

    def _checkpoint_name(self, name: str) -> str:
        if name.startswith(DRAFT_PREFIX):  # the engine's MTP draft holds its layers under the checkpoint's names
            name = name[len(DRAFT_PREFIX):]
        for memory, checkpoint in self._prefixes:
            if name.startswith(memory):
                name = checkpoint + name[len(memory):]
                break
        return _MOE_BLOCK.sub(f".{self._moe.block}.", name)

    def _add_fused_experts(self, prefix: str, kind: str, param_name: str) -> None:
        live = self._getter(param_name)
        num_experts = live().shape[0]
        prefix, names = self._checkpoint_name(prefix + "."), self._moe
        for e in range(num_experts):
            if kind == "down_proj":
                self._views[f"{prefix}{e}.{names.down}.weight"] = _view(live, e)
            else:
                half = live().shape[1] // 2
                self._views[f"{prefix}{e}.{names.gate}.weight"] = _view(live, (e, slice(None, half)))
                self._views[f"{prefix}{e}.{names.up}.weight"] = _view(live, (e, slice(half, None)))

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
