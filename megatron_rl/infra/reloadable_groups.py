"""Process groups that can be destroyed while the trainer sleeps and rebuilt before it trains.

Why: on a GPU every NCCL communicator holds device memory of its own (buffers per channel and
peer; hundreds of MiB for megatron's dozen-odd groups on a large node) that no tensor offload
gives back. A colocated engine wants that memory while it generates, so with
``--offload-train-groups on`` the trainer's sleep (tier "offload": grad buffers and optimizer
state to host) also destroys the groups, and the next wake rebuilds them (the source design's
tiers). Not by default: ``auto`` keeps the groups, on GPUs too, until scripts/gpu_check.sh has
run this over NCCL (so far it has run over gloo only; backends/sleep_tiers.py).

How: megatron (and this package) keep the group objects they got from ``new_group`` for the
whole run (``parallel_state``'s globals, every module's ``pg_collection``, DDP's and the
optimizer's groups), so a group cannot simply be replaced. After :func:`install`, every
``torch.distributed.new_group`` call is recorded and a member gets a :class:`ReloadableGroup`:
a ``ProcessGroup`` whose real group can be swapped. The ``torch.distributed`` functions that
take a group are wrapped to pass the real one on (torch looks groups up in its own tables, where
only the real one is registered). :func:`destroy` destroys every real group; :func:`reload`
replays the recorded ``new_group`` calls in their original order on every rank (creation is
collective), putting the new groups into the same wrappers. The default (WORLD) group is kept:
it carries the loop's own barriers and broadcasts while the others are gone.

A call on a destroyed group raises :class:`GroupsDestroyed` naming the group, instead of a
KeyError deep in torch or a hang. Queries of rank, size and member ranks are answered from the
record even then (they do not change).

The same code runs over gloo on CPU, where the groups hold no device memory: that is how CI
proves the rebuilt groups carry on training bit for bit (tests/infra/test_reloadable_groups.py).
Installed only when a run asks for the teardown; nothing else is patched otherwise.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger("megatron_rl")


class GroupsDestroyed(RuntimeError):
    """A collective on a process group that the trainer's sleep destroyed."""


@dataclass
class _Record:
    """One ``new_group`` call, replayed by :func:`reload`."""

    args: tuple
    kwargs: dict
    index: int
    wrapper: Optional["ReloadableGroup"] = None  # None: this rank is not a member
    retired: bool = False  # destroyed for good by destroy_process_group(group): not rebuilt


@dataclass
class _State:
    originals: dict[str, Callable] = field(default_factory=dict)
    aliases: list[tuple[Any, str, Callable]] = field(default_factory=list)
    records: list[_Record] = field(default_factory=list)
    destroyed: bool = False
    generation: int = 0


_STATE: Optional[_State] = None


class ReloadableGroup(dist.ProcessGroup):
    """A process group whose real group can be destroyed and replaced (see the module docstring).

    Methods called on the object itself (``group.size()``, ``group.allreduce(...)``) go to the
    real group; the patched ``torch.distributed`` functions unwrap it first."""

    def __init__(self, real: dist.ProcessGroup, record: _Record):
        super().__init__(real.rank(), real.size())  # type: ignore[call-arg]  # stub omits the (rank, size) overload
        self._real: Optional[dist.ProcessGroup] = real
        self._record = record
        self._ranks = tuple(_original("get_process_group_ranks")(real))
        self._rank = real.rank()
        self._desc = str(record.kwargs.get("group_desc") or f"new_group #{record.index}")

    @property
    def real(self) -> dist.ProcessGroup:
        if self._real is None:
            raise GroupsDestroyed(
                f"process group {self._desc} (global ranks {list(self._ranks)}) is destroyed while the trainer "
                "sleeps (--offload-train-groups): it is rebuilt when the trainer wakes for training; a "
                "collective between generation and training is a bug in the caller")
        return self._real

    @property
    def destroyed(self) -> bool:
        return self._real is None

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self._ranks)

    def name(self) -> str:
        return self.real.name()

    @property
    def group_name(self) -> c10d.GroupName:
        return self.real.group_name

    @property
    def group_desc(self) -> str:
        return self.real.group_desc

    @property
    def _device_types(self) -> list[torch.device]:  # a property on ProcessGroup, not a forwarded method
        return self.real._device_types

    @property
    def bound_device_id(self):
        return self.real.bound_device_id

    @bound_device_id.setter
    def bound_device_id(self, device):
        self.real.bound_device_id = device

    def __repr__(self) -> str:
        state = "destroyed" if self._real is None else "live"
        return f"ReloadableGroup({self._desc}, ranks={list(self._ranks)}, {state})"


def _forward(name: str) -> Callable:
    def method(self, *args, **kwargs):
        return getattr(self.real, name)(*args, **kwargs)

    method.__name__ = name
    return method


# ProcessGroup's own methods, forwarded to the real group (megatron and torch call some directly)
for _name in ("barrier", "broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather", "_allgather_base",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter",
              "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "send", "recv",
              "recv_anysource", "monitored_barrier", "_start_coalescing", "_end_coalescing", "_get_backend_name",
              "_get_backend", "_set_default_backend", "_get_sequence_number_for_group",
              "get_group_store", "set_timeout", "all_gather_single", "reduce_scatter_single", "abort", "shutdown"):
    if hasattr(dist.ProcessGroup, _name):
        setattr(ReloadableGroup, _name, _forward(_name))

#: ``torch.distributed`` functions that take a group: their group arguments are unwrapped
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
                "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
                "reduce_scatter_tensor", "_reduce_scatter_base", "_all_gather_base", "scatter", "scatter_object_list",
                "gather", "gather_object", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
                "send_object_list", "recv_object_list", "_coalescing_manager", "get_backend")
#: the same, answered from the record when the group is destroyed
_QUERIES = ("get_rank", "get_world_size", "get_process_group_ranks", "get_global_rank", "get_group_rank")
#: modules that bound a patched function by name at import (``from torch.distributed import X``)
_ALIASES = (("megatron.core.distributed.param_and_grad_buffer", "_coalescing_manager"),)


def _original(name: str) -> Callable:
    return _STATE.originals[name] if _STATE is not None and name in _STATE.originals else getattr(dist, name)


def _unwrap(value: Any) -> Any:
    return value.real if isinstance(value, ReloadableGroup) else value


def _unwrapping(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})

    return call


def _query(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        group = kwargs.get("group", args[0] if args else None)
        if isinstance(group, ReloadableGroup) and group.destroyed:
            return _answer_destroyed(name, group, args[1:] if args and args[0] is group else args, kwargs)
        return fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})

    return call


def _answer_destroyed(name: str, group: ReloadableGroup, rest: tuple, kwargs: dict) -> Any:
    ranks = list(group._ranks)
    if name == "get_rank":
        return group._rank
    if name == "get_world_size":
        return len(ranks)
    if name == "get_process_group_ranks":
        return ranks
    if name == "get_global_rank":
        return ranks[rest[0] if rest else kwargs["group_rank"]]
    return ranks.index(rest[0] if rest else kwargs["global_rank"])  # get_group_rank


def _batch_isend_irecv(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(p2p_op_list):
        ops = []
        for op in p2p_op_list:
            if isinstance(op.group, ReloadableGroup):
                op = copy.copy(op)
                op.group = op.group.real
            ops.append(op)
        return fn(ops)

    return call


def _new_group(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        group = fn(*args, **kwargs)
        record = _Record(args=args, kwargs=dict(kwargs), index=len(_STATE.records))
        _STATE.records.append(record)
        if isinstance(group, dist.ProcessGroup) and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            record.wrapper = ReloadableGroup(group, record)
            return record.wrapper
        return group

    return call


def _destroy_process_group(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(group=None):
        if group is None:  # everything goes: nothing is rebuilt any more
            for record in _STATE.records:
                record.retired = True
                if record.wrapper is not None:
                    record.wrapper._real = None
            return fn(None)
        if isinstance(group, ReloadableGroup):
            group._record.retired = True
            real, group._real = group._real, None
            return fn(real) if real is not None else None
        return fn(group)

    return call


def install() -> None:
    """Record every later ``new_group`` and wrap ``torch.distributed`` (idempotent). Call it before
    the groups to be torn down exist (megatron's ``initialize_model_parallel``)."""
    global _STATE
    if _STATE is not None:
        return
    _STATE = state = _State()
    patches: dict[str, Callable] = {}
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            patches[name] = _unwrapping(getattr(dist, name))
    for name in _QUERIES:
        if hasattr(dist, name):
            patches[name] = _query(name, getattr(dist, name))
    patches["batch_isend_irecv"] = _batch_isend_irecv(dist.batch_isend_irecv)
    patches["new_group"] = _new_group(dist.new_group)
    patches["destroy_process_group"] = _destroy_process_group(dist.destroy_process_group)
    for name, patched in patches.items():
        state.originals[name] = getattr(dist, name)
        setattr(dist, name, patched)
    # P2POp resolves its peer in its group at construction (torch's tables know only the real group)
    init = dist.P2POp.__init__
    state.aliases.append((dist.P2POp, "__init__", init))
    setattr(dist.P2POp, "__init__", _unwrapping(init))
    # P2POp checks its op against distributed_c10d's own isend/irecv: they must be the patched ones
    for name in ("isend", "irecv"):
        state.aliases.append((c10d, name, getattr(c10d, name)))
        setattr(c10d, name, patches[name])
    for module_name, attr in _ALIASES:
        module = sys.modules.get(module_name)
        if module is not None and getattr(module, attr, None) is state.originals.get(attr):
            state.aliases.append((module, attr, getattr(module, attr)))
            setattr(module, attr, patches[attr])
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("process groups created from here on can be destroyed and rebuilt (--offload-train-groups)")


def uninstall() -> None:
    """Undo :func:`install` (tests; a run keeps it to the end). Groups already wrapped stay wrapped."""
    global _STATE
    if _STATE is None:
        return
    for name, fn in _STATE.originals.items():
        setattr(dist, name, fn)
    for module, attr, fn in _STATE.aliases:
        setattr(module, attr, fn)
    _STATE = None


def installed() -> bool:
    return _STATE is not None


def is_destroyed() -> bool:
    return _STATE is not None and _STATE.destroyed


def live_groups() -> list[ReloadableGroup]:
    """This rank's wrapped groups that are not retired (live or destroyed by :func:`destroy`)."""
    if _STATE is None:
        return []
    return [r.wrapper for r in _STATE.records if r.wrapper is not None and not r.retired]


def retire_all() -> None:
    """Stop tracking every group recorded so far (megatron's groups were dropped for a new layout:
    they are never destroyed or rebuilt again). Later ``new_group`` calls are still recorded.

    Each wrapper lets go of its real group too: the caller (``models.parallel.destroy_parallel``) destroys
    the real groups next, and a group torch has destroyed but something still references keeps its
    worker threads (gloo: three per group) until the last reference goes."""
    if _STATE is not None:
        for record in _STATE.records:
            record.retired = True
            if record.wrapper is not None:
                record.wrapper._real = None
        _STATE.destroyed = False


def destroy() -> int:
    """Collective (every rank, same point): destroy the real group of every recorded group this rank
    is a member of; WORLD stays. Returns how many were destroyed here (0 when already destroyed)."""
    if _STATE is None or _STATE.destroyed:
        return 0
    _original("barrier")()  # no rank destroys a group a peer is still communicating on
    count = 0
    for wrapper in live_groups():
        real, wrapper._real = wrapper._real, None
        _original("destroy_process_group")(real)
        count += 1
    _STATE.destroyed = True
    return count


def reload() -> int:
    """Collective: rebuild every recorded group by replaying its ``new_group`` call, in creation
    order on every rank (members and non-members alike, as the first time). Returns how many
    groups of this rank were rebuilt (0 when nothing was destroyed)."""
    if _STATE is None or not _STATE.destroyed:
        return 0
    _original("barrier")()
    new_group = _original("new_group")
    count = 0
    for record in _STATE.records:
        if record.retired:
            continue
        group = new_group(*record.args, **record.kwargs)
        if record.wrapper is not None:
            if not isinstance(group, dist.ProcessGroup) or group is c10d.GroupMember.NON_GROUP_MEMBER:
                raise GroupsDestroyed(f"rebuilding {record.wrapper!r}: this rank is no longer a member")
            record.wrapper._real = group
            count += 1
    _STATE.destroyed = False
    _STATE.generation += 1
    return count
