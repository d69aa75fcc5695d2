"""The training-backend contract and the machinery every backend shares.

A ``TrainBackend`` owns one policy model spread over this process's ranks. The
RL loop talks to it only through the abstract methods below plus the shared
concretes (``forward_only``, ``maybe_compute_ref_log_probs``,
``maybe_compute_teacher_log_probs``, ``snapshot_weights``, ``swap_seconds``);
it never sees megatron-core or FSDP types. A new backend (FSDP2, ...) is one
module: implement the abstract methods, set the four layout attributes in
``initialize`` (``dp_size``, ``dp_rank``, ``pad_to_multiple``, ``holds_results``)
and add a row to ``BACKENDS``; planning the data-parallel split of a rollout
batch, packing, loss denominators and the per-sample gather are shared here
(``preprocess_rollout_data``, ``gather_per_sample``). docs/architecture.md.

Invariants:
* Every rank of the training world calls every method, in the same order, with
  the same ``samples`` (collectives inside). ``broadcast_samples`` gets the
  driver rank's rollout to all ranks.
* Per-sample per-token results are response-aligned (see ``data.types``) and
  returned for the WHOLE batch on every rank, so algorithm code never needs to
  know how samples were sharded over data parallelism.
* The backend never knows the algorithm: losses and advantages come from the
  ``Spec`` it is handed.
* Reference / teacher weights are *tags* held by a ``WeightManager``: a frozen
  copy of this rank's parameter shards swapped in place, so no second model is
  built and the same code serves every parallel layout.
"""

from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Optional, Sequence

import torch

from megatron_rl.backends.per_sample import find_holder_ranks, gather_per_sample
from megatron_rl.data import sample_codec
from megatron_rl.data.packing import (LossDenominators, MicroBatchPlan, PackedBatch, pack_plan_rank,
                                      plan_dynamic_micro_batches, plan_fixed_micro_batches,
                                      plan_loss_denominators)
from megatron_rl.data.types import Sample
from megatron_rl.errors import BackendError, ConfigError
from megatron_rl.infra.registry import Refused, Registry

if TYPE_CHECKING:
    from megatron_rl.algorithms.spec import Spec
    from megatron_rl.config import Config


@dataclass
class TrainBatch:
    """One rollout batch with every per-token field the loss needs (whole batch, all ranks)."""

    samples: list[Sample]
    advantages: list[torch.Tensor]
    old_logprobs: Optional[list[torch.Tensor]] = None
    ref_logprobs: Optional[list[torch.Tensor]] = None
    teacher_logprobs: Optional[list[torch.Tensor]] = None


class RankBatch(NamedTuple):
    """This data-parallel rank's part of a rollout batch (``TrainBackend.preprocess_rollout_data``)."""

    plan: MicroBatchPlan  # every DP rank's micro-batches (sample indices), the same on all ranks
    micro_batches: list[PackedBatch]  # this DP rank's, packed
    denominators: Optional[LossDenominators]  # this DP rank's loss denominators (training only)


class WeightManager:
    """Named copies of this rank's parameter shards, swapped in place by tag.

    ``backup(tag)`` snapshots the current values; ``switch(tag)`` copies a
    snapshot into the live parameters (after saving the live values under
    ``"actor"`` if nothing holds them yet); ``restore()`` puts the actor back.
    Copies live on CPU so a reference model costs host memory, not GPU memory.
    ``swap_seconds`` accumulates the time spent copying (logged as ``perf/weight_swap_s``);
    the actor's copy reuses its buffers from one swap to the next (no allocation per call).
    """

    ACTOR = "actor"

    def __init__(self, named_params: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self._named_params = named_params
        self._tags: dict[str, dict[str, torch.Tensor]] = {}
        self.active = self.ACTOR
        self.swap_seconds = 0.0

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
            self._tags[tag] = {n: p.detach().to("cpu", copy=True) for n, p in params}
        self.swap_seconds += time.perf_counter() - start

    def has(self, tag: str) -> bool:
        return tag in self._tags

    def _load(self, tag: str) -> None:
        start = time.perf_counter()
        stored = self._tags[tag]
        with torch.no_grad():
            for name, p in self._named_params():
                if name not in stored:
                    raise BackendError(f"weight tag {tag!r} has no copy of parameter {name!r}; "
                                       "it was backed up from a different model layout")
                p.copy_(stored[name].to(p.device, non_blocking=True))
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


class TrainBackend(abc.ABC):
    """One policy model on this process's ranks; see the module docstring for invariants."""

    weights: WeightManager
    cfg: "Config"
    # set by initialize(): the data-parallel layout the shared batch machinery plans for
    dp_size: int
    dp_rank: int
    pad_to_multiple: int  # every packed sequence is padded to this (TP x CP x sequence-parallel needs)
    holds_results: bool  # this rank holds its DP rank's full per-sample results (one rank per DP rank)
    pad_token_id: int = 0

    @abc.abstractmethod
    def initialize(self, cfg: "Config", spec: "Spec") -> None:
        """Build model + optimizer from the frozen ``Config``; load HF or checkpoint weights."""

    @abc.abstractmethod
    def forward(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """No-grad response-aligned log-probs of every sample under the live weights."""

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

    @abc.abstractmethod
    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-layout tensors in buckets of about ``bucket_bytes`` (collective on all ranks)."""

    # ---- shared concretes -------------------------------------------------

    def forward_only(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        with torch.no_grad():
            return self.forward(samples)

    def switch_weights(self, tag: str) -> contextlib.AbstractContextManager:
        return self.weights.use(tag)

    def snapshot_weights(self, tag: str) -> None:
        """Keep the live weights as the frozen ``tag`` (the initial policy as the KL reference)."""
        self.weights.backup(tag)

    @property
    def swap_seconds(self) -> float:
        """Seconds spent copying weight tags in and out so far (``perf/weight_swap_s`` per step)."""
        return self.weights.swap_seconds

    def maybe_compute_ref_log_probs(self, samples: Sequence[Sample], needed: bool) -> Optional[list[torch.Tensor]]:
        if not needed:
            return None
        if not self.weights.has("ref"):
            raise ConfigError("the algorithm needs reference log-probs (KL term) but no reference weights are "
                              "loaded; the initial policy is used unless --ref-load is given")
        with self.switch_weights("ref"):
            return self.forward_only(samples)

    def maybe_compute_teacher_log_probs(self, samples: Sequence[Sample], needed: bool) -> Optional[list[torch.Tensor]]:
        if not needed:
            return None
        if not self.weights.has("teacher"):
            raise ConfigError("on-policy distillation needs teacher weights: give --opd-teacher-load PATH")
        with self.switch_weights("teacher"):
            return self.forward_only(samples)

    # ---- the rollout batch over data parallelism (shared by every backend) ----

    def plan_micro_batches(self, samples: Sequence[Sample]) -> MicroBatchPlan:
        """Split the batch over DP ranks and micro-batches: token-budgeted (``--use-dynamic-batch-size``)
        or ``--micro-batch-size`` samples each; the same plan on every rank (a pure function of lengths)."""
        b = self.cfg.batching
        if b.use_dynamic_batch_size:
            lengths = [s.total_length for s in samples]
            return plan_dynamic_micro_batches(lengths, dp_size=self.dp_size, max_tokens_per_gpu=b.max_tokens_per_gpu,
                                              cp_size=self.cfg.parallel.context_parallel_size,
                                              pad_to_multiple=self.pad_to_multiple)
        plan = plan_fixed_micro_batches(len(samples), dp_size=self.dp_size, micro_batch_size=b.micro_batch_size)
        return MicroBatchPlan(micro_batches=plan.micro_batches, token_budget=None, pad_to_multiple=self.pad_to_multiple)

    def preprocess_rollout_data(self, samples: Sequence[Sample], batch: Optional[TrainBatch] = None) -> RankBatch:
        """Plan the batch, pack this DP rank's micro-batches (with the loss inputs of ``batch`` when training)
        and, when training, compute this rank's share of the step's global loss denominators."""
        plan = self.plan_micro_batches(samples)
        if batch is None:
            return RankBatch(plan, pack_plan_rank(samples, plan, self.dp_rank, pad_token_id=self.pad_token_id), None)
        micro_batches = pack_plan_rank(samples, plan, self.dp_rank, pad_token_id=self.pad_token_id,
                                       advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                                       ref_logprobs=batch.ref_logprobs, teacher_logprobs=batch.teacher_logprobs)
        return RankBatch(plan, micro_batches, plan_loss_denominators(samples, plan)[self.dp_rank])

    def gather_per_sample(self, local: dict[int, torch.Tensor], samples: Sequence[Sample],
                          plan: MicroBatchPlan) -> list[torch.Tensor]:
        """Every rank gets every sample's tensor from the ranks that hold them (``holds_results``).

        The holders (one per DP rank) hold the full results of their DP rank's micro-batches; the
        plan says which samples each holds, so only the values move (``per_sample``). Which global
        rank holds which DP rank's results is fixed by the layout: found once, on first use.
        """
        if getattr(self, "_holder_ranks", None) is None:
            self._holder_ranks = find_holder_ranks(self.dp_rank if self.holds_results else None, self.dp_size)
        holdings = [[i for mb in plan.rank(d) for i in mb] for d in range(plan.dp_size)]
        return gather_per_sample(local, holdings, self._holder_ranks, [s.response_length for s in samples])


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
    dist.broadcast(buffer, src=src, group=group)
    return list(samples) if dist.get_rank() == src else sample_codec.decode(sizes, buffer)


def import_megatron_core_without_wandb() -> None:
    """Import megatron-core with ``wandb`` hidden, unless something already imported wandb.

    ``megatron.core.timers`` runs ``try: import wandb`` at import time (about 1 s of start-up on
    every rank here) only to write megatron's own timers to W&B when handed a writer, which this
    engine never does: metrics go through ``infra.tracking``, which imports wandb itself on the
    driver when ``--wandb-project`` asks (before this runs). The hiding lasts for this one import.
    """
    import sys

    if "wandb" in sys.modules or "megatron.core" in sys.modules:
        return
    sys.modules["wandb"] = None  # `import wandb` raises ImportError: megatron falls back to wandb = None
    try:
        import megatron.core.timers  # noqa: F401  (lazy: megatron-core is the heavy import this exists for)
    finally:
        if "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


def _megatron_backend() -> TrainBackend:
    import_megatron_core_without_wandb()
    from megatron_rl.backends.megatron.backend import MegatronBackend  # lazy: imports megatron-core (~15 s)

    return MegatronBackend()


# --train-backend -> a factory of the backend (its module is imported on first use)
BACKENDS: Registry[Callable[[], TrainBackend]] = Registry("--train-backend", "training backend", {
    "megatron": _megatron_backend,
    "fsdp": Refused("--train-backend fsdp is not built yet (the FSDP2 backend issue); use --train-backend megatron"),
})


def make_backend(name: str) -> TrainBackend:
    """The backend named by ``--train-backend``."""
    return BACKENDS.get(name)()
