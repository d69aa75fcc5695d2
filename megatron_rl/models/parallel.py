"""Parallel layout and process-group set-up for megatron-core models.

Used by the MegatronBackend (training) and the HF <-> torch_dist converters (``tools/convert_ckpt.py``):

* :class:`ParallelLayout` - frozen tp/pp/vpp/cp/ep/etp/sequence_parallel; ``dp`` is
  derived from the world size by :meth:`ParallelLayout.data_parallel_size`.
* :func:`initialize_parallel(layout, seed, backend=None)` - applies the CPU shim,
  initialises ``torch.distributed`` if needed (gloo on CPU, nccl on GPU, env:// as
  torchrun sets it), ``parallel_state.initialize_model_parallel`` and seeds torch
  plus megatron's model-parallel RNG tracker. Validates the layout first and
  raises :class:`~megatron_rl.errors.ConfigError` *before any collective*, so a bad
  flag never hangs a job.
* :func:`destroy_parallel()` - tears megatron's groups down (the default process
  group is kept so a test can loop over layouts in one launch).
* :class:`LayoutScope` - one role's layout on the same ranks: its ``ProcessGroupCollection``
  for the megatron-core calls that take one, and its ``parallel_state`` globals for those
  that still read them.

Invariants: world = tp * pp * cp * dp; the expert groups satisfy
world = etp * ep * expert_dp with tp*cp divisible appropriately (megatron decides
the exact rule; we check the divisibility it asserts so the error is readable).
"""

from __future__ import annotations

import functools
import os
import random
import weakref
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from megatron_rl.compat import apply_cpu_compat
from megatron_rl.infra import collective_watch, reloadable_groups
from megatron_rl.infra.ports import free_port
from megatron_rl.errors import ConfigError

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class ParallelLayout:
    """How one model replica is split. Flags: ``--tensor-model-parallel-size`` (tp),
    ``--pipeline-model-parallel-size`` (pp), ``--virtual-pipeline-model-parallel-size``
    (vpp: model chunks per PP rank, None = not interleaved),
    ``--context-parallel-size`` (cp), ``--expert-model-parallel-size`` (ep),
    ``--expert-tensor-parallel-size`` (etp, None = same as tp),
    ``--sequence-parallel``."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    sequence_parallel: bool = False

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    def data_parallel_size(self, world_size: int) -> int:
        self.validate(world_size)
        return world_size // (self.tp * self.pp * self.cp)

    def validate(self, world_size: Optional[int] = None, num_layers: Optional[int] = None) -> None:
        """Raise ConfigError naming the flag if this layout cannot run on ``world_size`` ranks
        (world checks skipped when None) or cannot split ``num_layers``."""
        problems = []
        for flag, value in (("--tensor-model-parallel-size", self.tp),
                            ("--pipeline-model-parallel-size", self.pp),
                            ("--context-parallel-size", self.cp),
                            ("--expert-model-parallel-size", self.ep),
                            ("--expert-tensor-parallel-size", self.expert_tp)):
            if not isinstance(value, int) or value < 1:
                problems.append(f"{flag}={value!r} must be a positive integer")
        if problems:
            raise ConfigError("; ".join(problems))
        model_parallel = self.tp * self.pp * self.cp
        if world_size is not None and world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} "
                f"= {model_parallel}; change --tensor-model-parallel-size / "
                f"--pipeline-model-parallel-size / --context-parallel-size or the number of ranks")
        expert_parallel = self.expert_tp * self.ep * self.pp
        if world_size is not None and world_size % expert_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.expert_tp}*{self.ep}*"
                f"{self.pp}; change --expert-model-parallel-size / --expert-tensor-parallel-size")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ConfigError(f"--virtual-pipeline-model-parallel-size={self.vpp!r} must be >= 1 or unset")
            if self.vpp > 1 and self.pp < 2:
                raise ConfigError("--virtual-pipeline-model-parallel-size > 1 needs "
                                  "--pipeline-model-parallel-size >= 2")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size >= 2")
        if num_layers is not None and num_layers % (self.pp * self.num_model_chunks):
            raise ConfigError(
                f"num_hidden_layers={num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.num_model_chunks}; change --pipeline-model-parallel-size / "
                f"--virtual-pipeline-model-parallel-size")

    def megatron_sizes(self) -> dict:
        """The parallel sizes as megatron-core's keyword arguments (``initialize_model_parallel``
        and ``TransformerConfig`` take the same names)."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if (self.vpp or 1) > 1 else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )

    def describe(self) -> dict:
        return asdict(self)


def _default_backend() -> str:
    """gloo on CPU; on GPUs NCCL for device tensors plus gloo for host ones (``cpu:gloo,cuda:nccl``).

    Why both: the rollout batch reaches the training ranks, and the embedded engine replicas send their
    parts back, as host byte buffers (``data/sample_codec.py``; ``backends/rollout_shards.py``,
    ``rollout/replicas.py``), and a NCCL-only group refuses a CPU tensor (no backend for device type
    cpu). The FSDP backend initialises the same pair for its host collectives."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def initialize_parallel(layout: ParallelLayout, seed: int = 1234, backend: Optional[str] = None) -> int:
    """Set up torch.distributed and megatron's parallel groups for ``layout``.

    Returns the data-parallel size. Re-entrant across layouts: call
    :func:`destroy_parallel` in between. ``seed`` seeds python/torch identically on
    every rank and megatron's model-parallel RNG tracker (which offsets it per TP/PP
    rank, as megatron does).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    layout.validate(world_size)  # before any collective
    apply_cpu_compat()

    if not torch.distributed.is_initialized():
        backend = backend or _default_backend()
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" not in os.environ:
            # A plain single-process run, not launched by torchrun. Use a private TCP store and
            # leave os.environ alone: subprocesses started later (a converter, a test's torchrun)
            # must not inherit a RANK/MASTER_PORT that points at this process's store.
            torch.distributed.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                                 rank=0, world_size=1, timeout=collective_watch.timeout())
        else:  # every collective bounded by --distributed-timeout-minutes (infra/collective_watch.py)
            torch.distributed.init_process_group(backend=backend, init_method="env://",
                                                 timeout=collective_watch.timeout())

    from megatron.core import parallel_state, tensor_parallel

    _track_ddp()
    # the previous layout's groups go with it (destroy_parallel: every group but the default one); forgetting
    # them (destroy_model_parallel alone) leaks each gloo group's threads: the converters and the test
    # workers build a layout per conversion or case, ~1,500 threads per process after two dozen of them
    destroy_parallel()
    parallel_state.initialize_model_parallel(**layout.megatron_sizes(),
                                             distributed_timeout_minutes=collective_watch.bound_s() / 60.0)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return parallel_state.get_data_parallel_world_size()


def destroy_parallel() -> None:
    """Destroy megatron's model-parallel groups and every other process group but the default one.

    Why every group: ``destroy_model_parallel`` only forgets megatron's groups, and each gloo group keeps its
    worker threads until torch.distributed destroys it. A process that builds layout after layout (the parity
    and conversion tools, the tests' workers) had ~1,900 threads per rank after ~60 layouts, and two such
    launches side by side drove a 2-core machine's load average to 300."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _clear_megatron_holds()
    if _release_ddp_models():
        import gc

        gc.collect()  # the released models go now, with their groups, not at some later collection
    reloadable_groups.retire_all()  # a later layout's groups are the ones a sleep tears down
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d as c10d  # lazy: the group map (no public listing)

        world = c10d._get_default_group()
        for group in [g for g in list(c10d._world.pg_map) if g is not world]:
            dist.destroy_process_group(group)


def _clear_megatron_holds() -> None:
    """What megatron-core keeps past ``destroy_model_parallel``, each holding a layout's models or groups: every
    RouterReplay it made (and through it its router), the rotary embeddings' ``lru_cache`` on ``forward`` (32
    entries keyed by the module: the module and its context-parallel group), and two globals that
    ``destroy_model_parallel`` does not reset (0.16.1)."""
    from megatron.core import parallel_state  # lazy: megatron-core
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()
    for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


_LIVE_DDP: "weakref.WeakSet" = weakref.WeakSet()  # every megatron-core DDP wrapper made (and not yet freed)


def _track_ddp() -> None:
    """Record each megatron-core DDP wrapper as it is made (``_LIVE_DDP``); patched once, at the first
    :func:`initialize_parallel` (every DDP is built after one)."""
    from megatron.core.distributed import DistributedDataParallel  # lazy: megatron-core

    original = DistributedDataParallel.__init__
    if getattr(original, "_mrl_tracked", False):
        return

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _LIVE_DDP.add(self)

    init._mrl_tracked = True  # type: ignore[attr-defined]  # the patch's own mark (idempotence)
    DistributedDataParallel.__init__ = init


def _release_ddp_models() -> int:
    """Empty every megatron-core DDP wrapper still alive (the models of the layout being torn down); how many.

    Why: megatron's DDP registers its gradient hooks on autograd's accumulator nodes (C++), which hold the
    hooks' closures and through them the DDP, its model and the process groups the model's layers keep: a
    cycle Python's collector cannot see. A process that builds layout after layout (the tests' workers, the
    parity checks) kept every model it ever built and every gloo group's worker threads with it (a backend
    job's 17 layouts: 620 threads per rank, measured); once its groups are destroyed such a model cannot run
    anyway."""
    live = list(_LIVE_DDP)
    for ddp in live:
        vars(ddp).clear()
    _LIVE_DDP.clear()
    return len(live)


class LayoutScope:
    """One role's layout over this process's ranks: its megatron-core ``ProcessGroupCollection``
    (``pg_collection``) and, for the calls that still read them, megatron's ``parallel_state`` globals of that
    layout, swapped in while a ``with scope:`` block runs (PPO's critic with its own TP/PP beside the actor's
    layout, a teacher of other shapes at its own DP).

    The collection is what the role hands megatron-core wherever a call takes one (0.16.1): ``GPTModel`` (and
    through it every block, layer, embedding and output layer), ``DistributedDataParallel``,
    ``get_megatron_optimizer``, the pipeline schedules with their ``P2PCommunicator`` and, through the schedules,
    ``finalize_model_grads``. Its modules, DDP and optimizer hold the role's groups whatever the globals are.

    Why a swap as well: some of megatron-core 0.16.1 still reads ``parallel_state``'s module globals at call time
    (and so do our weight loaders); each ``with scope:`` names what it covers where it is used
    (``backends/megatron/role_model.py``, ``checkpoint.py``; docs/architecture.md lists them). Building the second
    layout's groups once (``initialize_model_parallel`` is collective over every rank, so every rank builds both)
    and swapping the globals around those calls lets that code run unchanged for the second model. Not swapped:
    megatron's model-parallel RNG tracker (one per process in megatron-core: the first layout's offsets serve
    dropout in both models) and torch's default RNG. ``same`` (the layouts are equal): no second set of groups,
    the block runs in the first layout and the collection holds the first layout's groups.

    The first layout must be initialised (``initialize_parallel``) before, and its globals be the current ones
    when a scope is made; the scope's groups are destroyed with every other group by :func:`destroy_parallel`."""

    pg_collection: "ProcessGroupCollection"

    def __init__(self, layout: ParallelLayout, outer: ParallelLayout) -> None:
        from megatron.core import parallel_state as ps  # lazy: megatron-core
        from megatron.core.process_groups_config import ProcessGroupCollection  # lazy: megatron-core

        self.layout = layout
        self.same = layout == outer
        self._states: Optional[dict] = None
        self._saved: list[dict] = []
        if self.same:
            self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            return
        world = torch.distributed.get_world_size()
        layout.validate(world)
        outer_states = _parallel_state_globals(ps)
        try:
            ps.destroy_model_parallel()  # forgets the outer groups (they live on in outer_states)
            ps.initialize_model_parallel(**layout.megatron_sizes())
            self._states = _parallel_state_globals(ps)
            self.pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        finally:
            vars(ps).update(outer_states)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel_size(torch.distributed.get_world_size())

    def __enter__(self) -> "LayoutScope":
        if self._states is not None:
            from megatron.core import parallel_state as ps  # lazy: megatron-core

            self._saved.append(_parallel_state_globals(ps))
            vars(ps).update(self._states)
        return self

    def __exit__(self, *exc) -> None:
        if self._states is not None:
            from megatron.core import parallel_state as ps  # lazy: megatron-core

            vars(ps).update(self._saved.pop())


def _parallel_state_globals(ps) -> dict:
    """Every layout-holding global of ``parallel_state`` (``_TENSOR_MODEL_PARALLEL_GROUP``, ``_MPU_*`` sizes,
    rank lists, the memory buffer): its module globals named ``_UPPER_CASE``."""
    return {k: v for k, v in vars(ps).items() if k[:1] == "_" and k[1:2].isupper() and not callable(v)}
