"""MoE routing replay on megatron-core's ``RouterReplay``: the trainer routes each token as recorded.

Why: when the router of a forward pass picks other experts than the pass the
behaviour log-probs came from, the log-prob ratio of that token is not a policy
ratio any more; in MoE RL runs the mismatch grows until importance ratios blow up.
``--use-routing-replay r2`` records the routes of the old-log-prob pass (the first
forward of a step's samples) and replays them in the reference pass and in every
training forward and backward (activation recompute included), so the ratio of the
PPO loss compares the same experts.

The records are per sample, ``[tokens, moe_layers_here, topk]`` (int16, row ``t``:
the experts input token ``t`` went to, in every MoE layer of this rank's pipeline
stage), independent of how a pass packs the samples: the training steps pack and
shard them differently from the old-log-prob pass. Within a pass the routers see
this rank's tokens: the packed micro-batch, its context-parallel shard
(``cp_utils.cp_local_index``), and under sequence parallelism this tensor-parallel
rank's contiguous slice of that; recording gathers those slices back (TP, then CP)
and replaying cuts them again. Pad tokens replay experts ``0..topk-1`` (their
outputs are never read); the data-parallel owner of a sample keeps its record (the
owner-aligned forward plan sends each rank the samples it trains on).

Replay through megatron-core: each router of the model gets its targets for the
micro-batch before the forward (``REPLAY_FORWARD``); a forward that megatron
re-runs inside the backward (``--recompute-granularity full``) reads the same
targets again in order (``REPLAY_BACKWARD``, megatron's FIFO of the step's targets).

``--use-rollout-routing-replay`` (R3) replays the rollout engine's routes instead:
every pass (old log-probs, reference, training) takes each sample's
``Sample.routed_experts`` (``[total_length - 1, moe_layers, topk]`` over all the
model's MoE layers, data/types.py), keeps this stage's layers (a router's global
layer number -> its index among the model's MoE layers) and replays them; nothing
is recorded. The last token has no route (no engine forward reads it): it replays
experts ``0..topk-1`` like a pad row, and its output carries no loss.

The routers of the multi-token-prediction block (``--mtp-num-layers``) are not replayed: they route on
their own in both modes (:func:`is_mtp_module` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.data.packing import PackedBatch
from megatron_rl.models import cp_utils

ROUTE_DTYPE = torch.int16  # expert ids: up to 32,767 experts


@dataclass
class RouteAgreement:
    """How often the trainer's own router picked the replayed experts (as a set), over real tokens.
    Counted on the routers' device and read once per pass (no host sync per layer)."""

    counts: Optional[torch.Tensor] = None  # [agreed, total]

    def add(self, own: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor) -> None:
        same = (own.sort(dim=1).values == replayed.sort(dim=1).values).all(dim=1) & valid
        step = torch.stack([same.sum(), valid.sum()]).to(torch.float64)
        self.counts = step if self.counts is None else self.counts + step

    @property
    def agreed(self) -> int:
        return 0 if self.counts is None else int(self.counts[0])

    @property
    def total(self) -> int:
        return 0 if self.counts is None else int(self.counts[1])


@dataclass
class _Router:
    """One MoE layer's router on this rank: its ordinal among this stage's MoE layers, the chunk holding it."""

    chunk: int
    ordinal: int
    router: Any  # megatron-core's TopKRouter (its ``router_replay`` is a RouterReplay)


@dataclass
class RoutingReplay:
    """The replay state of one backend: which routers, what was recorded, what is being replayed."""

    routers: list[_Router]
    tp_group: object
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    cp_group: object
    cp_size: int
    cp_rank: int
    topk: int
    records: dict[int, torch.Tensor] = field(default_factory=dict)  # id(sample) -> [tokens, layers, topk]
    recording: bool = False
    # R3: each local router's index among the model's MoE layers (the sample routes' layer axis); None: R2
    rollout_layers: Optional[list[int]] = None
    num_moe_layers: int = 0
    agreement: RouteAgreement = field(default_factory=RouteAgreement)
    _valid: dict[int, torch.Tensor] = field(default_factory=dict)  # router ordinal -> this forward's real rows

    @classmethod
    def attach(cls, chunks: Sequence[torch.nn.Module], ps, layout, topk: int,
               moe_pattern: Optional[Sequence[int]] = None) -> "RoutingReplay":
        """Find every MoE router of ``chunks`` (built with ``moe_enable_routing_replay``) and wrap its replay.
        ``moe_pattern`` (1 per MoE layer of the whole model, megatron's ``moe_layer_freq`` as a list):
        replay the rollout's routes (R3) instead of recording the old-log-prob pass's."""
        routers: list[_Router] = []
        for c, chunk in enumerate(chunks):
            for name, module in chunk.named_modules():
                replay = getattr(module, "router_replay", None)
                if replay is not None and not is_mtp_module(name):
                    routers.append(_Router(c, len(routers), module))
        state = cls(routers=routers, tp_group=ps.get_tensor_model_parallel_group(), tp_size=layout.tp,
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    sequence_parallel=bool(layout.sequence_parallel and layout.tp > 1),
                    cp_group=ps.get_context_parallel_group(), cp_size=layout.cp,
                    cp_rank=ps.get_context_parallel_rank(), topk=topk)
        for r in routers:
            r.router.router_replay.get_replay_topk = MethodType(_replay_topk(state, r.ordinal),
                                                               r.router.router_replay)
        if moe_pattern is not None:
            state.use_rollout_routes(moe_pattern)
        return state

    def use_rollout_routes(self, moe_pattern: Sequence[int]) -> None:
        """Replay the samples' ``routed_experts`` from now on (R3): map each local router to its index among
        the model's MoE layers (``moe_pattern``: 1 per MoE layer)."""
        moe_layers = [i for i, is_moe in enumerate(moe_pattern) if is_moe]
        self.num_moe_layers = len(moe_layers)
        self.rollout_layers = [moe_layers.index(int(r.router.layer_number) - 1) for r in self.routers]
        self.records = {}

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    # ---- a pass ---------------------------------------------------------------

    def start_pass(self, samples: Sequence, record: bool) -> None:
        """Before a forward pass over ``samples``: record their routes (dropping older records) or replay them."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction  # lazy: megatron-core

        self.agreement = RouteAgreement()
        if self.rollout_layers is not None:  # R3: every pass replays the engine's routes
            record = False
            if self.routers:
                self.records = {id(s): self._rollout_record(i, s) for i, s in enumerate(samples)}
        self.recording = record
        if not self.routers:  # a pipeline stage without MoE layers: nothing to record or replay
            return
        if record:
            self.records = {}
        else:
            missing = [i for i, s in enumerate(samples) if id(s) not in self.records]
            if missing:
                raise RuntimeError(f"routing replay: no recorded routes for samples {missing[:5]} of this pass; the "
                                   "old-log-prob pass records them (a pass that replays must follow it)")
        action = RouterReplayAction.RECORD if record else RouterReplayAction.REPLAY_FORWARD
        for r in self.routers:
            r.router.router_replay.clear_indices()
            r.router.router_replay.set_router_replay_action(action)

    def _rollout_record(self, i: int, sample) -> torch.Tensor:
        """This stage's layers of ``sample.routed_experts``, checked against the model (R3)."""
        routes = sample.routed_experts
        assert self.rollout_layers is not None
        want = (sample.total_length - 1, self.num_moe_layers, self.topk)
        if routes is None:
            raise RuntimeError(f"routing replay from the rollout: sample {i} (group {sample.group_index}) has no "
                               "routed_experts; the rollout engine did not return routes for it (it must record "
                               "them: --use-rollout-routing-replay)")
        if (routes.tokens, routes.layers, routes.topk) != want:
            raise RuntimeError(f"routing replay from the rollout: sample {i} (group {sample.group_index}) has routes "
                               f"of [tokens, moe_layers, topk] = {[routes.tokens, routes.layers, routes.topk]}, the "
                               f"model needs {list(want)} (total_length - 1 tokens); the engine served another model "
                               "or the sample was edited after generation")
        return torch.from_numpy(routes.array[:, self.rollout_layers].astype("int16"))

    def end_pass(self) -> None:
        for r in self.routers:
            r.router.router_replay.clear_indices()
            r.router.router_replay.clear_router_replay_action()
        self._valid = {}

    # ---- a micro-batch ----------------------------------------------------------

    def _local_rows(self, mb: PackedBatch) -> torch.Tensor:
        """Packed positions the routers of this rank see, in their order (CP shard, then the SP slice)."""
        index = cp_utils.cp_local_index(mb.cu_seqlens, self.cp_rank, self.cp_size)
        if self.sequence_parallel:
            n = index.numel() // self.tp_size
            index = index[self.tp_rank * n:(self.tp_rank + 1) * n]
        return index

    def before_forward(self, chunk: int, mb: PackedBatch, samples: Sequence) -> None:
        """Give each router of ``chunk`` the micro-batch's recorded routes (replay passes)."""
        if self.recording:
            return
        mine = [r for r in self.routers if r.chunk == chunk]
        if not mine:
            return
        packed, valid = self._packed_routes(mb, samples, [r.ordinal for r in mine])
        rows = self._local_rows(mb)
        device = next(mine[0].router.parameters()).device
        packed, valid = packed[rows].to(device), valid[rows].to(device)
        for j, r in enumerate(mine):
            r.router.router_replay.set_target_indices(packed[:, j].long())
            self._valid[r.ordinal] = valid

    def after_forward(self, chunk: int, mb: PackedBatch, samples: Sequence) -> None:
        """Gather what each router of ``chunk`` recorded and keep it per sample (recording passes)."""
        if not self.recording:
            return
        mine = [r for r in self.routers if r.chunk == chunk]
        if not mine:
            return
        # int32 on the routers' device for the collectives (gloo has no int16; NCCL groups take device tensors)
        local = torch.stack([r.router.router_replay.get_recorded_indices().to(torch.int32) for r in mine], dim=1)
        full = self._gather(local, mb).to("cpu", ROUTE_DTYPE)  # [T, layers_of_chunk, topk], packed order
        cu = mb.cu_seqlens.tolist()
        for i, idx in enumerate(mb.sample_indices.tolist()):
            s = samples[idx]
            part = full[cu[i]:cu[i] + s.total_length]
            have = self.records.get(id(s))
            self.records[id(s)] = part if have is None else torch.cat([have, part], dim=1)

    def _gather(self, local: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
        if self.sequence_parallel:
            parts = [torch.empty_like(local) for _ in range(self.tp_size)]
            dist.all_gather(parts, local, group=self.tp_group)
            local = torch.cat(parts)
        if self.cp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.cp_size)]
            dist.all_gather(parts, local, group=self.cp_group)
            perm = cp_utils.cp_gather_permutation(mb.cu_seqlens, self.cp_size)
            local = torch.cat(parts).index_select(0, perm.to(local.device))
        return local

    def _packed_routes(self, mb: PackedBatch, samples: Sequence, ordinals: list[int]):
        """``[T, len(ordinals), topk]`` routes over the packed tokens, and which rows are real tokens."""
        T = mb.num_tokens
        packed = torch.arange(self.topk, dtype=ROUTE_DTYPE).expand(T, len(ordinals), self.topk).clone()
        valid = torch.zeros(T, dtype=torch.bool)
        cu = mb.cu_seqlens.tolist()
        for i, idx in enumerate(mb.sample_indices.tolist()):
            rec = self.records[id(samples[idx])][:, ordinals]
            packed[cu[i]:cu[i] + rec.shape[0]] = rec
            valid[cu[i]:cu[i] + rec.shape[0]] = True
        return packed, valid


def is_mtp_module(name: str) -> bool:
    """Whether a module of a model chunk belongs to megatron's multi-token-prediction block (``mtp.``).

    Its MoE routers are left out of routing replay and route on their own: the rollout engine reports routes of
    the decoder's MoE layers only (an MTP layer is the draft of speculative decoding, never the sampled policy),
    the old-log-prob pass that R2 records does not run the MTP block, and the MTP loss
    (``--enable-mtp-training``) is a cross-entropy of the data's tokens with no importance ratio for a changed
    route to break."""
    return "mtp" in name.split(".")


def _replay_topk(state: RoutingReplay, ordinal: int):
    """megatron-core's ``RouterReplay.get_replay_topk``, plus: a forward re-run inside the backward (activation
    recompute) replays from the step's FIFO, and each replay counts whether the router's own top-k agreed."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction  # lazy: megatron-core

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action == RouterReplayAction.REPLAY_FORWARD and torch._C._current_graph_task_id() != -1:
            self.router_replay_action = RouterReplayAction.REPLAY_BACKWARD  # megatron's recompute, in the backward
            try:
                return RouterReplay.get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                self.router_replay_action = action
        if action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups, group_topk)
            valid = state._valid.get(ordinal)
            if valid is not None:
                state.agreement.add(own, self.target_topk_idx.to(own.device), valid)
        return RouterReplay.get_replay_topk(self, scores, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


def moe_pattern(config) -> list[int]:
    """1 per MoE layer of the whole model, from a megatron ``TransformerConfig`` (``moe_layer_freq`` a list, or
    every N-th layer)."""
    freq = config.moe_layer_freq
    return list(freq) if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]


def moe_topk(config) -> Optional[int]:
    """The router's top-k of a megatron ``TransformerConfig`` (None for a dense model)."""
    return int(config.moe_router_topk) if getattr(config, "num_moe_experts", None) else None
