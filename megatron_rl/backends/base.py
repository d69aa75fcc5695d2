"""The training-backend contract and the machinery every backend shares.

A ``TrainBackend`` holds the run's models on this process's ranks, each a role (``roles.py``): the
actor (the policy), under ``--advantage-estimator ppo`` the critic (the ``roles.Critic`` interface:
``backends/megatron/critic.py``, ``backends/fsdp/critic.py``), and frozen roles (reference, OPD
teacher). The RL loop talks to it only through the abstract methods below plus the shared concretes
(``forward_only``, ``compute_values``, ``maybe_compute_ref_log_probs``, ``maybe_compute_teacher_log_probs``,
``snapshot_weights``, ``swap_seconds``); it never sees megatron-core or FSDP types. A backend is
one module (two exist: ``megatron``, ``fsdp``): implement the abstract methods, set the layout
attributes in ``initialize`` (``dp_size``, ``dp_rank``, ``pad_to_multiple``, ``holds_results``)
and add a row to ``factory.BACKENDS``. Planning the data-parallel split of a rollout batch, packing, loss
denominators and the per-sample gather live in ``DataParallelShare`` (``plan_rollout``,
``preprocess_rollout_data``, ``gather_per_sample``), which every backend is, and so is a second role
with a layout of its own (``backends/megatron/role_model.py::RoleShare``). docs/architecture.md.

Invariants:
* Every rank of the training world calls every method, in the same order, with
  the same batch (collectives inside). In the loop each data-parallel rank
  receives in full only the samples it trains on and a ``SampleStub`` (lengths,
  reward, group, loss mask) of the others (``rollout_shards.distribute_rollout``);
  ``broadcast_samples`` gives every rank everything when an algorithm needs it.
* Per-sample per-token results are response-aligned (see ``data.types``) and
  indexed like the batch. ``forward`` (and ``compute_values``) returns them for the
  whole batch on every rank, or, with ``owned_only`` and a plan that follows the
  training steps (``plan_rollout``), only for the samples of this rank's DP share
  (None for the rest): then nothing crosses data-parallel ranks. Algorithm code sees
  the whole batch's rewards and masks either way (advantages are whole-batch).
* The backend computes no loss and no advantage: the policy and value losses come
  from the ``Spec`` it is handed (``compute_loss``, ``compute_value_loss``), the
  advantages and returns from the same ``Spec`` in the loop (``runner/step.py``).
  What it reads of the algorithm is what to build (a critic under
  ``--advantage-estimator ppo``) and, per step, whether the ``TrainBatch`` carries
  ``returns`` for a critic step beside the actor's.
* Reference / teacher weights of the actor's shapes are *tags* held by a
  ``WeightManager``: a frozen copy of this rank's parameter shards swapped in
  place, so no model is built for them and the same code serves every parallel
  layout. Weights of other shapes (a larger teacher: ``roles.needs_own_model``)
  are a model of their own, frozen, kept in ``frozen_roles`` by role name
  (``roles.FrozenRole``), and consulted before the tags; it is never saved in a
  checkpoint (its flag reloads it at resume).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

import torch

from megatron_rl.backends.per_sample import find_holder_ranks, gather_per_sample, share_with_peers
from megatron_rl.compat.memo import IdentityMemo
from megatron_rl.data import sample_codec
from megatron_rl.data.packing import (ImageTokens, LossDenominators, MicroBatchPlan, PackedBatch, pack_plan_rank,
                                      plan_dynamic_micro_batches, plan_fixed_micro_batches,
                                      plan_loss_denominators, plan_owner_aligned, step_bounds)
from megatron_rl.data.types import AnySample, Sample
from megatron_rl.errors import BackendError, ConfigError
from megatron_rl.infra import collective_watch, dist as dist_util
from megatron_rl.models.fused_loads import load_units
from megatron_rl.plan.memory import DEVICE_TAG_SHARE, resolve_weights_location  # noqa: F401 - this module's names too

if TYPE_CHECKING:
    from megatron_rl.algorithms.spec import Spec
    from megatron_rl.backends.roles import Critic, FrozenRole
    from megatron_rl.models.peft_adapter import AdapterExport
    from megatron_rl.config import Config

log = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """One training step's samples with every per-token field the loss needs.

    ``samples`` and ``advantages`` cover the whole step on every rank. The log-prob
    lists are indexed like ``samples``; when they come from an owner-aligned forward
    (``RolloutPlan``) only the entries of this rank's data-parallel share are set
    and the rest are None (no rank reads another DP rank's entries).
    """

    samples: list[AnySample]
    advantages: list[torch.Tensor]
    old_logprobs: Optional[list[Optional[torch.Tensor]]] = None
    ref_logprobs: Optional[list[Optional[torch.Tensor]]] = None
    teacher_logprobs: Optional[list[Optional[torch.Tensor]]] = None
    plan: Optional[MicroBatchPlan] = None  # the step's plan when already made (RolloutPlan.steps)
    # ppo's critic (indexed like ``samples``): its values before the step and its regression targets; with
    # ``returns`` set the step also takes one critic optimizer step. ``train_actor=False``: the critic only
    # (--num-critic-only-steps): the actor's weights and optimizer do not move.
    old_values: Optional[list[Optional[torch.Tensor]]] = None
    returns: Optional[list[Optional[torch.Tensor]]] = None
    train_actor: bool = True


@dataclass(frozen=True)
class ExportScope:
    """Who holds which full HF tensors when the export runs per pipeline stage (``stage_only``).

    After the TP/EP gathers every rank of a stage holds its stage's full tensors, so one rank per
    stage can send them (a weight transport with one sender per stage: no hop through the PP
    group to a single sender). ``sources[s]`` is the global rank that sends stage ``s`` (its
    data-, tensor- and context-parallel rank 0); with one stage the driver sends everything.
    """

    stages: int
    stage: int  # this rank's
    sources: tuple[int, ...]

    @property
    def is_source(self) -> bool:
        import torch.distributed as dist  # lazy: a one-process scope needs no process group

        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.sources[self.stage] == rank


class RolloutPlan(NamedTuple):
    """How one rollout batch is trained (``DataParallelShare.plan_rollout``).

    ``steps[k] = (offset, plan)``: training step ``k`` takes ``samples[offset:offset + n]``
    and ``plan`` splits them over DP ranks and micro-batches (indices relative to
    ``offset``), exactly as ``train_step`` will plan them. ``forward`` gives every DP rank
    the samples it trains on in those steps, so the old / reference / teacher log-probs
    it computes are the ones it needs and never cross data-parallel ranks.
    """

    forward: MicroBatchPlan
    steps: list[tuple[int, MicroBatchPlan]]


class RankBatch(NamedTuple):
    """This data-parallel rank's part of a rollout batch (``DataParallelShare.preprocess_rollout_data``)."""

    plan: MicroBatchPlan  # every DP rank's micro-batches (sample indices), the same on all ranks
    micro_batches: list[PackedBatch]  # this DP rank's, packed
    denominators: Optional[LossDenominators]  # this DP rank's loss denominators (training only)


class WeightManager:
    """Named copies of this rank's parameter shards, swapped in place by tag.

    ``backup(tag)`` snapshots the current values; ``switch(tag)`` copies a
    snapshot into the live parameters (after saving the live values under
    ``"actor"`` if nothing holds them yet); ``restore()`` puts the actor back.
    ``swap_seconds`` accumulates the time spent copying (logged as ``perf/weight_swap_s``);
    the actor's copy reuses its buffers from one swap to the next (no allocation per call).

    Where the copies live (``--ref-weights-location``, resolved by
    ``resolve_weights_location``): ``"host"`` keeps them in CPU memory (pinned when
    CUDA is present, so the copies run at full PCIe speed): a reference costs host
    memory, but every reference forward moves the model across the bus three times
    (actor out, reference in, actor back). ``"device"`` keeps them beside the
    parameters: the same three copies run at device-memory speed, for one more model
    copy of device memory. On a CPU-only run both are host memory.
    """

    ACTOR = "actor"
    LOCATIONS = ("host", "device")

    def __init__(self, named_params: Callable[[], Iterator[tuple[str, torch.Tensor]]], location: str = "host"):
        if location not in self.LOCATIONS:
            raise BackendError(f"weight tags live on 'host' or 'device', not {location!r}")
        self._named_params = named_params
        self._tags: dict[str, dict[str, torch.Tensor]] = {}
        self.active = self.ACTOR
        self.location = location
        self.swap_seconds = 0.0

    def _store(self, p: torch.Tensor) -> torch.Tensor:
        """A new copy of ``p`` where this manager keeps its tags."""
        if self.location == "device" or p.device.type == "cpu":
            return p.detach().clone()
        host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        return host.copy_(p.detach())

    def nbytes(self, tag: str) -> int:
        """Bytes held by one tag's copies (0 when the tag does not exist)."""
        return sum(t.numel() * t.element_size() for t in self._tags.get(tag, {}).values())

    @property
    def tags(self) -> list[str]:
        return sorted(self._tags)

    def backup(self, tag: str) -> None:
        start = time.perf_counter()
        params = list(self._named_params())
        kept = self._tags.get(tag)
        if kept is not None and len(kept) == len(params) and all(
                n in kept and kept[n].shape == p.shape and kept[n].dtype == p.dtype for n, p in params):
            with torch.no_grad():
                for n, p in params:
                    kept[n].copy_(p.detach())
        else:
            self._tags[tag] = {n: self._store(p) for n, p in params}
        self.swap_seconds += time.perf_counter() - start

    def has(self, tag: str) -> bool:
        return tag in self._tags

    @classmethod
    def resolved(cls, named_params: Callable[[], Iterator[tuple[str, torch.Tensor]]], requested: str, *,
                 offload_train: bool) -> "WeightManager":
        """A manager whose copies live where ``--ref-weights-location`` ``requested`` resolves to, measured
        now, once the model and optimizer hold their memory (``resolve_weights_location``; logged once)."""
        cuda = torch.cuda.is_available()
        tag_bytes = sum(p.numel() * p.element_size() for _, p in named_params())
        where, why = resolve_weights_location(requested, cuda=cuda, offload_train=offload_train, tag_bytes=tag_bytes,
                                              free_bytes=torch.cuda.mem_get_info()[0] if cuda else None)
        if dist_util.rank() == 0:
            log.info("reference/teacher weight copies live on the %s (%s)", where, why)
        return cls(named_params, where)

    def load_tag(self, tag: str, load_into_live: Callable[[], None]) -> None:
        """Store other weights as ``tag`` by passing them through the live parameters: the actor's values
        are kept aside, ``load_into_live`` writes the tag's weights with the backend's own loaders (so
        every layout and strictness check of a checkpoint load applies), they are backed up as ``tag``,
        and the actor's values are put back. A tag is a swap of the same parameters, not a second model."""
        actor = {n: p.detach().clone() for n, p in self._named_params()}
        load_into_live()
        self.backup(tag)
        with torch.no_grad():
            for name, p in self._named_params():
                p.copy_(actor[name])

    def _load(self, tag: str) -> None:
        start = time.perf_counter()
        stored = self._tags[tag]
        with torch.no_grad():
            for name, p in self._named_params():
                if name not in stored:
                    raise BackendError(f"weight tag {tag!r} has no copy of parameter {name!r}; "
                                       "it was backed up from a different model layout")
                p.copy_(stored[name], non_blocking=True)  # pinned host -> device: async on the stream
        self.swap_seconds += time.perf_counter() - start

    def switch(self, tag: str) -> None:
        if tag == self.active:
            return
        if tag not in self._tags:
            raise BackendError(f"no weights are stored under tag {tag!r} (have: {self.tags}); "
                               "load them first (--ref-load / --opd-teacher-load)")
        if self.active == self.ACTOR:
            self.backup(self.ACTOR)  # the live values are the trained actor: keep them
        self._load(tag)
        self.active = tag

    def restore(self) -> None:
        if self.active != self.ACTOR:
            self._load(self.ACTOR)
            self.active = self.ACTOR

    @contextlib.contextmanager
    def use(self, tag: str):
        self.switch(tag)
        try:
            yield
        finally:
            self.restore()


def bucketed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``export_weights``' buckets from one stream of ``(name, tensor)``: a bucket closes once it holds at
    least ``bucket_bytes`` (``--update-weight-buffer-size``), so no tensor is split across buckets (an
    engine loads whole tensors) and one larger than the budget is a bucket of its own; the rest last.

    Tensors the engine loads together (q/k/v, gate/up, MLA's down-projections: ``models.fused_loads``) are
    added as one unit, so no bucket boundary falls between them at any budget: SGLang loads each bucket with
    its own ``load_weights`` call and some loaders keep half a pair only while the call lasts."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for unit in load_units(named):
        bucket.extend(unit)
        size += sum(tensor.numel() * tensor.element_size() for _, tensor in unit)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def finish_step_metrics(metrics: dict[str, float], *, grad_norm: Optional[float], lr: float, update_ok: bool,
                        loss_scale: Optional[float], micro_batches: int, started: float) -> dict[str, float]:
    """The optimizer-step half of ``train_step``'s metrics, the same keys from every backend
    (docs/metrics.md): ``metrics`` are the reduced loss metrics, already ``train/``-prefixed."""
    metrics["train/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
    metrics["train/lr"] = lr
    metrics["train/update_skipped"] = float(not update_ok)
    if loss_scale is not None:
        metrics["train/loss_scale"] = loss_scale
    metrics["train/micro_batches"] = float(micro_batches)
    metrics["train/step_time_s"] = time.perf_counter() - started
    return metrics


class DataParallelShare:
    """How a rollout batch is split over a model's data-parallel ranks: the plans, this rank's packed
    micro-batches and the per-sample gather. Every ``TrainBackend`` is one; so is PPO's critic when it has a
    layout of its own (its DP size differs from the actor's: ``backends/megatron/critic.py``)."""

    cfg: "Config"
    dp_size: int
    dp_rank: int
    pad_to_multiple: int  # every packed sequence is padded to this (TP x CP x sequence-parallel needs)
    holds_results: bool  # this rank holds its DP rank's full per-sample results (one rank per DP rank)
    pad_token_id: int = 0
    # a vision-language model's image-pad token and merge size: micro-batches carry their samples' images and
    # M-RoPE positions (data.packing.pack_samples); None: a text-only model
    image_tokens: Optional[ImageTokens] = None

    @property
    def context_parallel_size(self) -> int:
        """The CP size the token budgets are planned for (``--context-parallel-size``; the critic's own: 1)."""
        return self.cfg.parallel.context_parallel_size

    # ---- the rollout batch over data parallelism ----

    def plan_micro_batches(self, samples: Sequence[AnySample]) -> MicroBatchPlan:
        """Split the batch over DP ranks and micro-batches: token-budgeted (``--use-dynamic-batch-size``)
        or ``--micro-batch-size`` samples each; the same plan on every rank (a pure function of lengths)."""
        b = self.cfg.batching
        if b.use_dynamic_batch_size:
            lengths = [s.total_length for s in samples]
            return plan_dynamic_micro_batches(lengths, dp_size=self.dp_size, max_tokens_per_gpu=_token_budget(b),
                                              cp_size=self.context_parallel_size,
                                              pad_to_multiple=self.pad_to_multiple)
        plan = plan_fixed_micro_batches(len(samples), dp_size=self.dp_size, micro_batch_size=b.micro_batch_size,
                                        ragged=any(getattr(s, "branch", 0) for s in samples))
        return MicroBatchPlan(micro_batches=plan.micro_batches, token_budget=None, pad_to_multiple=self.pad_to_multiple)

    def plan_rollout(self, samples: Sequence[AnySample], global_batch_size: int) -> RolloutPlan:
        """The training steps' plans (``samples`` cut into steps of ``global_batch_size``) and the
        owner-aligned forward plan over the whole batch (``RolloutPlan``); no communication."""
        bounds = step_bounds(samples, global_batch_size)
        steps = [(start, self.plan_micro_batches(samples[start:end])) for start, end in bounds]
        b = self.cfg.batching
        lengths = [s.total_length for s in samples]

        def cut(parts: list[list[int]]) -> MicroBatchPlan:
            if b.use_dynamic_batch_size:
                return plan_dynamic_micro_batches(lengths, dp_size=self.dp_size,
                                                  max_tokens_per_gpu=_token_budget(b),
                                                  cp_size=self.context_parallel_size,
                                                  pad_to_multiple=self.pad_to_multiple, rank_parts=parts)
            size = b.micro_batch_size
            count = max(-(-len(p) // size) for p in parts)  # ragged steps (branches): empty ones even it out
            return MicroBatchPlan(micro_batches=tuple(tuple(tuple(p[j * size:(j + 1) * size]) for j in range(count))
                                                      for p in parts),
                                  token_budget=None, pad_to_multiple=self.pad_to_multiple)

        return RolloutPlan(plan_owner_aligned(steps, len(samples), cut), steps)

    def preprocess_rollout_data(self, samples: Sequence[AnySample], batch: Optional[TrainBatch] = None,
                                plan: Optional[MicroBatchPlan] = None) -> RankBatch:
        """Plan the batch (or take ``plan``), pack this DP rank's micro-batches (with the loss inputs of
        ``batch`` when training) and, when training, compute this rank's share of the step's global
        loss denominators."""
        plan = plan or (batch and batch.plan) or self.plan_micro_batches(samples)
        if batch is None:
            # the old- and ref-log-prob passes of a step run over the same batch and plan: they share the
            # packed micro-batches, and with them every per-micro-batch derivation the model memoises
            # (RoPE rows, attention buckets: compat/memo.py). A batch is not changed between its passes.
            packs = self.__dict__.setdefault("_forward_packs", IdentityMemo())
            micro_batches = packs.get((samples, plan), (self.dp_rank, self.pad_token_id), lambda: pack_plan_rank(
                samples, plan, self.dp_rank, pad_token_id=self.pad_token_id, image_tokens=self.image_tokens))
            return RankBatch(plan, micro_batches, None)
        _check_owned(batch, plan.rank_samples(self.dp_rank))
        micro_batches = pack_plan_rank(samples, plan, self.dp_rank, pad_token_id=self.pad_token_id,
                                       advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                                       ref_logprobs=batch.ref_logprobs, teacher_logprobs=batch.teacher_logprobs,
                                       old_values=batch.old_values if batch.returns is not None else None,
                                       returns=batch.returns, image_tokens=self.image_tokens)
        return RankBatch(plan, micro_batches, plan_loss_denominators(samples, plan)[self.dp_rank])

    def data_parallel_peers(self) -> tuple[list[int], object]:
        """``(leaders, group)`` of ``data_parallel_peers`` for this backend's layout; found on first use
        (a collective: the first call happens on every rank at the same point of the loop)."""
        if getattr(self, "_dp_peers", None) is None:
            self._dp_peers = data_parallel_peers(self.dp_rank, self.dp_size)
        return self._dp_peers

    def gather_per_sample(self, local: dict[int, torch.Tensor], samples: Sequence[AnySample],
                          plan: MicroBatchPlan, owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        """Every rank gets every sample's tensor from the ranks that hold them (``holds_results``),
        or with ``owned_only`` only its own DP rank's samples (from that DP rank's holder; None elsewhere).

        The holders (one per DP rank) hold the full results of their DP rank's micro-batches; the
        plan says which samples each holds, so only the values move (``per_sample``). Which global
        rank holds which DP rank's results is fixed by the layout: found once, on first use, with
        the groups of each DP rank's model-parallel peers.
        """
        if getattr(self, "_holder_ranks", None) is None:
            self._holder_ranks = find_holder_ranks(self.dp_rank if self.holds_results else None, self.dp_size)
        holdings = [[i for mb in plan.rank(d) for i in mb] for d in range(plan.dp_size)]
        lengths = [s.response_length for s in samples]
        if owned_only:
            return share_with_peers(local, holdings[self.dp_rank], self._holder_ranks[self.dp_rank], lengths,
                                    group=self.data_parallel_peers()[1])
        return list(gather_per_sample(local, holdings, self._holder_ranks, lengths))  # as list[Optional[Tensor]]


class TrainBackend(DataParallelShare, abc.ABC):
    """The run's roles (the actor; under ppo its critic; frozen roles) on this process's ranks; see the module
    docstring for invariants."""

    weights: WeightManager
    spec: "Spec"
    critic: Optional["Critic"] = None  # ppo's value model (roles.Critic), built by initialize under ppo
    # initialize() sets DataParallelShare's fields: the data-parallel layout the shared batch machinery plans for

    @abc.abstractmethod
    def initialize(self, cfg: "Config", spec: "Spec") -> None:
        """Build model + optimizer from the frozen ``Config``; load HF or checkpoint weights."""

    @abc.abstractmethod
    def forward(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        """No-grad response-aligned log-probs of every sample under the live weights.

        ``plan`` (default ``plan_micro_batches(samples)``) says which DP rank computes which
        sample. Every rank gets every sample's result, or with ``owned_only`` only the
        samples of its own DP rank (``gather_per_sample``; the rest are None).
        """

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over ``batch`` (split into micro-batches); returns reduced metrics."""

    @abc.abstractmethod
    def save(self, path: str, extra_state: dict) -> None:
        """Write model, optimizer, scheduler and RNG state (plus ``extra_state``) to ``path``."""

    @abc.abstractmethod
    def load(self, path: str) -> dict:
        """Restore everything ``save`` wrote; return its ``extra_state``."""

    @abc.abstractmethod
    def load_frozen_weights(self, tag: str, path: str) -> None:
        """Store the weights at ``path`` (HF dir or torch_dist checkpoint) under ``tag`` (``--ref-load``,
        ``--opd-teacher-load``), leaving the live actor weights as they were."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (colocated rollout is about to run)."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Undo ``sleep`` before the next forward/train."""

    def release_comm_groups(self) -> int:
        """Collective: destroy this trainer's process groups (their communicators' device memory) while the
        engine generates (``--offload-train-groups``). Returns how many this rank destroyed; 0 where the
        backend keeps its groups (the default)."""
        return 0

    def restore_comm_groups(self) -> int:
        """Collective: rebuild what :meth:`release_comm_groups` destroyed, before any collective of training
        or weight sync. Returns how many this rank rebuilt."""
        return 0

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False,
                       merge_adapters: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-layout tensors in buckets of about ``bucket_bytes`` (collective on all ranks).

        ``stage_only``: only this rank's pipeline stage's tensors (collective within the stage; no
        pipeline broadcast), for transports that send from every stage (``export_scope``).
        ``merge_adapters`` (a LoRA run): the adapters folded into the weights (what an engine without
        LoRA serves); False: the frozen base weights, for an engine that merges them itself
        (``--lora-sync adapter``)."""

    def export_adapters(self, *, stage_only: bool = False) -> "AdapterExport":
        """A LoRA run's adapters, whole, under HF PEFT's saved keys, with ``r`` and ``lora_alpha``
        (``--lora-sync adapter``; collective like ``export_weights``, ``stage_only`` likewise)."""
        from megatron_rl.errors import SyncError  # lazy: only a misconfigured run gets here

        raise SyncError(f"{type(self).__name__} trains no LoRA adapters to export: --lora-sync adapter needs "
                        "--lora-rank R")

    def export_scope(self) -> ExportScope:
        """The pipeline stages of the export and their senders (one stage: the driver, rank 0)."""
        return ExportScope(stages=1, stage=0, sources=(0,))

    @property
    def frozen_roles(self) -> dict[str, "FrozenRole"]:
        """Frozen roles with a model of their own, by tag (``"teacher"``, ``"ref"``): weights of other shapes than
        the actor's (``roles.needs_own_model``), which a weight tag cannot hold. Consulted before the tags."""
        return self.__dict__.setdefault("_frozen_roles", {})

    # ---- shared concretes -------------------------------------------------

    def forward_only(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                     owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        with torch.no_grad():
            return self.forward(samples, plan, owned_only)

    def switch_weights(self, tag: str) -> contextlib.AbstractContextManager:
        return self.weights.use(tag)

    def snapshot_weights(self, tag: str) -> None:
        """Keep the live weights as the frozen ``tag`` (the initial policy as the KL reference; the actor replacing
        it under --ref-update-interval, which also replaces a reference model of its own)."""
        self.frozen_roles.pop(tag, None)
        self.weights.backup(tag)

    @property
    def swap_seconds(self) -> float:
        """Seconds spent copying weight tags in and out so far (``perf/weight_swap_s`` per step)."""
        return self.weights.swap_seconds

    def frozen_log_probs(self, tag: str, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                         owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        """Log-probs under the frozen role ``tag``: its own model when it has one (``frozen_roles``), else its
        weight tag swapped into the actor's parameters for the pass."""
        if tag in self.frozen_roles:
            with torch.no_grad():
                return self.frozen_roles[tag].log_probs(samples, plan or self.plan_micro_batches(samples), owned_only)
        if not self.weights.has(tag):
            raise ConfigError(_MISSING_FROZEN.get(tag, f"no frozen weights are loaded under {tag!r}"))
        with self.switch_weights(tag):
            return self.forward_only(samples, plan, owned_only)

    def maybe_compute_ref_log_probs(self, samples: Sequence[AnySample], needed: bool,
                                    plan: Optional[MicroBatchPlan] = None,
                                    owned_only: bool = False) -> Optional[list[Optional[torch.Tensor]]]:
        return self.frozen_log_probs("ref", samples, plan, owned_only) if needed else None

    def maybe_compute_teacher_log_probs(self, samples: Sequence[AnySample], needed: bool,
                                        plan: Optional[MicroBatchPlan] = None,
                                        owned_only: bool = False) -> Optional[list[Optional[torch.Tensor]]]:
        return self.frozen_log_probs("teacher", samples, plan, owned_only) if needed else None

    def compute_values(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                       owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        """The critic's no-grad response-aligned values of every sample (``forward``'s contract, the value model
        instead of the policy): over the actor's packed micro-batches of the pass, or, for a critic of a layout of
        its own, over its own plan of the batch, whole on every rank."""
        critic = self.critic
        if critic is None:
            raise ConfigError(f"values need the critic that --advantage-estimator ppo builds; this "
                              f"{type(self).__name__} was initialised without one (another --advantage-estimator)")
        share = critic.share
        if share is None:
            plan, mbs, _ = self.preprocess_rollout_data(samples, plan=plan)
            return self.gather_per_sample(critic.values(mbs), samples, plan, owned_only)
        if owned_only:
            raise BackendError("compute_values(owned_only=True): a critic of its own layout has other data-parallel "
                               "shares than the actor's; PPO holds the whole batch on every rank")
        own, mbs, _ = share.preprocess_rollout_data(samples)
        return share.gather_per_sample(critic.values(mbs), samples, own)

    def critic_step(self, batch: TrainBatch, micro_batches: list[PackedBatch],
                    denoms: Optional[LossDenominators]) -> dict[str, float]:
        """ppo: the critic's optimizer step beside the actor's, when ``batch`` carries returns (``critic/*``)."""
        if batch.returns is None:
            return {}
        if self.critic is None:
            raise BackendError("train_step got critic returns but this backend built no critic "
                               "(--advantage-estimator ppo builds one)")
        assert denoms is not None, "a training batch has loss denominators"
        return self.critic.train_on(batch, micro_batches, denoms, self.spec)


_MISSING_FROZEN = {
    "ref": "the algorithm needs reference log-probs (KL term) but no reference weights are loaded; the initial "
           "policy is used unless --ref-load is given",
    "teacher": "on-policy distillation needs teacher weights: give --opd-teacher-load PATH",
}


def critic_step_metrics(metrics: dict[str, float], *, grad_norm, lr: float, update_ok: bool,
                        started: float) -> dict[str, float]:
    """A critic step's ``critic/*`` metrics, the same keys from every backend (docs/metrics.md): ``metrics`` are
    its reduced loss metrics, unprefixed."""
    out = {f"critic/{k}": v for k, v in metrics.items()}
    out["critic/grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
    out["critic/lr"] = float(lr)
    out["critic/update_skipped"] = float(not update_ok)
    out["critic/step_time_s"] = time.perf_counter() - started
    return out



def _check_owned(batch: TrainBatch, owned: Sequence[int]) -> None:
    """A clear error, not a TypeError deep in packing, when a log-prob of this rank's share is missing."""
    for name in ("old_logprobs", "ref_logprobs", "teacher_logprobs", "old_values", "returns"):
        values = getattr(batch, name)
        missing = [i for i in owned if values is not None and values[i] is None]
        if missing:
            raise BackendError(f"train_step: {name} of samples {missing[:8]} (this data-parallel rank's share of "
                               "the step) were not computed here: the forward pass must follow the training "
                               "steps' split (TrainBackend.plan_rollout) or gather every sample")


def data_parallel_peers(dp_rank: int, dp_size: int) -> tuple[list[int], object]:
    """``(leaders, group)``: the lowest global rank of each data-parallel index, and the process
    group of the ranks sharing this rank's index (its TP/PP/CP peers; None when it has none).
    Collective: every rank calls it once, at the same point (one tiny all_gather, then
    ``new_group`` for every index with peers, in the same order on all ranks)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [0] * dp_size, None
    every = torch.empty(dist.get_world_size(), dtype=torch.int64)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, torch.tensor([dp_rank]))
    leaders, mine = [], None
    for d in range(dp_size):
        ranks = [r for r, x in enumerate(every.tolist()) if x == d]
        if not ranks:
            raise BackendError(f"no rank reports data-parallel rank {d} of {dp_size}")
        leaders.append(ranks[0])
        group = dist.new_group(ranks, timeout=collective_watch.timeout()) if len(ranks) > 1 else None
        if d == dp_rank:
            mine = group
    return leaders, mine


def _token_budget(batching) -> int:
    """``--max-tokens-per-gpu``, which config validation requires with ``--use-dynamic-batch-size``."""
    budget = batching.max_tokens_per_gpu
    assert budget is not None, "config validation: --use-dynamic-batch-size needs --max-tokens-per-gpu"
    return budget


def broadcast_samples(samples: Optional[list[Sample]], src: int = 0, group=None) -> list[Sample]:
    """Give every rank the driver's rollout batch (a no-op without torch.distributed).

    Two tensor broadcasts (2 byte counts, then one flat buffer from
    ``data.sample_codec``) instead of ``broadcast_object_list`` of the dataclasses:
    the ids, masks, rewards and log-probs move as raw int32/int64/float64 bytes and
    only the non-numeric fields are pickled.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if samples is None:
            raise BackendError("broadcast_samples: the driver rank passed no samples")
        return list(samples)
    if dist.get_rank() == src:
        # no samples: the counts say so (-1), so every rank raises instead of waiting for a buffer
        sizes, buffer = sample_codec.encode(samples) if samples is not None else (torch.full((2,), -1), None)
    else:
        sizes = torch.empty(2, dtype=torch.int64)
    dist.broadcast(sizes, src=src, group=group)
    if int(sizes[0]) < 0:
        raise BackendError(f"broadcast_samples: the driver rank (rank {src}) passed no samples")
    if dist.get_rank() != src:
        buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8)
    assert buffer is not None, "the counts are not -1: the driver encoded its samples"
    dist.broadcast(buffer, src=src, group=group)
    if dist.get_rank() != src:
        return sample_codec.decode(sizes, buffer)
    assert samples is not None, "the counts are not -1: the driver had samples"
    return list(samples)
