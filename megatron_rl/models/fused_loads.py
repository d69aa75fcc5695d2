"""Which exported HF tensors an inference engine loads together, and the stream cut into such load units.

SGLang builds fused parameters from several checkpoint tensors (its models' ``stacked_params_mapping``):
q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj`` (dense MLPs, shared experts, and each routed
expert's slice of the MoE layer's ``w13``), the gated delta-net's split projections (Qwen3.5) into
``in_proj_qkvz`` / ``in_proj_ba``, and MLA's two down-projections (DeepSeek-V2/V3, Kimi-K2 with a q latent)
into ``fused_qkv_a_proj_with_mqa``, and DeepSeek-V3.2's indexer key and head-weight projections (``wk``,
``weights_proj``) into ``fused_wk_and_weights_proj``. A weight update over ``/update_weights_from_tensor`` or the
distributed group calls the model's ``load_weights`` once per bucket, and some loaders only keep a pair
while that one call lasts (DeepSeek's loader caches ``q_a_proj`` until ``kv_a_proj_with_mqa`` arrives and
drops it when the call ends): a bucket boundary between members can leave the engine with a stale half.

The rule is one table (:data:`FUSED_LOADS`, by the HF name's module component, the same for every family we
map) and one streaming function (:func:`load_units`). A unit is one tensor, or the stretch of the stream
from a fused group's first member to its last; ``backends.base.bucketed`` and the disk transport's shard
files add whole units only, so no bucket size (one byte included) splits a group, and the order of the
export is kept.

Pure Python over names: no torch (the tensors pass through untouched).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class FusedLoad:
    """Checkpoint tensors named ``<module>.<member>.<param>`` that the engine loads into one
    ``<module>.<fused>.<param>``."""

    fused: str
    members: tuple[str, ...]
    families: str  # where the engine fuses them (documentation; the rule holds wherever the names occur)


FUSED_LOADS: tuple[FusedLoad, ...] = (
    FusedLoad("qkv_proj", ("q_proj", "k_proj", "v_proj"), "every family with q/k/v projections"),
    FusedLoad("gate_up_proj", ("gate_proj", "up_proj"), "dense MLPs, shared experts, each routed expert (w13)"),
    FusedLoad("w13", ("w1", "w3"), "Mixtral's routed experts (gate w1, up w3 into w13)"),
    FusedLoad("fused_qkv_a_proj_with_mqa", ("q_a_proj", "kv_a_proj_with_mqa"), "MLA with a q latent (DeepSeek)"),
    FusedLoad("in_proj_qkvz", ("in_proj_qkv", "in_proj_z"), "the gated delta-net of Qwen3.5"),
    FusedLoad("in_proj_ba", ("in_proj_b", "in_proj_a"), "the gated delta-net of Qwen3.5"),
    FusedLoad("fused_wk_and_weights_proj", ("wk", "weights_proj"),
              "DeepSeek-V3.2's sparse-attention indexer (SGLang's NSA indexer with fuse_wk_and_weights_proj)"),
)

_MEMBER_OF: dict[str, FusedLoad] = {m: f for f in FUSED_LOADS for m in f.members}


_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


@dataclass(frozen=True)
class GroupOf:
    """The fused group a tensor belongs to: ``key`` names the engine's fused tensor, ``scope`` the decoder
    layer (or, outside the layers, the module) that holds every member: a stream that has left it sends no
    more of them. The layer, not the module: an export in the HF module's order sends every expert's
    ``gate_proj`` before the first ``up_proj`` (transformers' conversion back from its stacked experts)."""

    key: str
    scope: str
    member: str
    load: FusedLoad


def group_of(name: str) -> Optional[GroupOf]:
    """The fused group of HF tensor ``name``, None for a tensor the engine loads alone. The member is the
    last module component of the name found in the table (``...experts.3.gate_proj.weight``: gate_proj)."""
    parts = name.split(".")
    for i in range(len(parts) - 2, -1, -1):  # the last part is the parameter (weight, bias), never a member
        load = _MEMBER_OF.get(parts[i])
        if load is not None:
            layer = _LAYER.match(name)
            scope = layer.group(1) if layer else ".".join(parts[:i])
            return GroupOf(".".join(parts[:i] + [load.fused] + parts[i + 1:]), scope, parts[i], load)
    return None


def load_units(named: Iterable[tuple[str, T]]) -> Iterator[list[tuple[str, T]]]:
    """``named`` cut into load units, in order, every tensor exactly once: a tensor alone, except from the
    first member of a fused group to its last, which is one unit together with whatever the exporter sends
    between them (MLA: ``q_a_layernorm`` and ``q_b_proj`` come between ``q_a_proj`` and
    ``kv_a_proj_with_mqa``). A group is over once all its members arrived, or once the stream left the
    group's decoder layer (a family without some member: DeepSeek without a q latent sends ``q_proj``
    alone), or at the end. A unit is yielded as soon as it is whole: no tensor waits for the next one."""
    run: list[tuple[str, T]] = []
    open_groups: dict[str, tuple[GroupOf, set[str]]] = {}
    for name, tensor in named:
        for key in [k for k, (g, _) in open_groups.items() if not name.startswith(g.scope + ".")]:
            del open_groups[key]  # the stream left the layer: no more members will come
        if run and not open_groups:
            yield run
            run = []
        run.append((name, tensor))
        group = group_of(name)
        if group is not None:
            _, seen = open_groups.setdefault(group.key, (group, set()))
            seen.add(group.member)
            if len(seen) == len(group.load.members):
                del open_groups[group.key]
        if not open_groups:
            yield run
            run = []
    if run:
        yield run
