"""A bound on every collective of the training ranks, and the rank that did not answer it, by number.

Why: a training rank that freezes (SIGSTOP, a hung device call, a stalled NFS write) leaves the
others in a gloo collective until the group's timeout, which is torch's 30 min unless someone set
it, and what then ends them names a socket ("Timed out waiting 1800000ms for recv operation to
complete"), never the rank. Here:

* :func:`configure` sets the bound once (``--distributed-timeout-minutes``, Megatron-LM's flag) and
  :func:`timeout` hands it to the groups the training ranks make: the default group
  (``init_process_group``), megatron's model-parallel groups (``initialize_model_parallel``), the
  data-parallel leaders' groups, the distributed weight sync's agreement group;
* :func:`watched` wraps one phase of a step (the train step with its gradient all-reduce, the weight
  sync's gathers and broadcasts, the checkpoint save, the resume's load): a collective of the phase
  that times out is followed by a **roll call** through the rendezvous store (each rank that is
  still running writes its key and waits for the others', at most one more bound, since the ranks
  that are alive entered the phase at different times), and the phase ends with one
  :class:`~megatron_rl.errors.CollectiveTimeout` naming the phase, the ranks that did not answer
  (with their host and pid), the bound and the flag.

The store is the launcher's (torchrun's agent serves it), so a frozen rank 0 does not freeze it.
A wait is at most two bounds: the collective's, then the roll call's. Invariant: every rank calls
the same phases in the same order (they are collective), so the n-th call of a phase has the same
roll-call keys on every rank; the count is this process's, so nothing is exchanged to agree on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Iterator, Optional

from megatron_rl.errors import CollectiveTimeout

FLAG = "--distributed-timeout-minutes"
DEFAULT_MINUTES = 10.0  # Megatron-LM's default
_KEY = "mrl/collective_watch"
_POLL_S = 0.02  # the roll call's look at the store
# what a collective that ran out of time says: gloo's ("Timed out waiting 600ms for recv operation"), the store's
# ("wait timeout after"). Not a peer that left ("Connection closed by peer"): its process is gone, the launcher
# names it at once (train.peer_gone_report), and a roll call would only wait one more bound for it. Nor an HTTP
# or socket timeout (an engine's): only the driver meets it, the other ranks would wait for it at the roll call
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for (send|recv) operation|wait timeout after \d+ms|"
                        r"collective operation timeout")

# the phases a step's collectives are watched in: id (the roll call's key) -> what the error calls it
TRAIN_STEP, WEIGHT_SYNC, CHECKPOINT_SAVE, RESUME = "train_step", "weight_sync", "checkpoint_save", "resume"
PHASES: dict[str, str] = {
    TRAIN_STEP: "the train step (its forward, backward and gradient all-reduce)",
    WEIGHT_SYNC: "the weight sync (its gathers to the sender and broadcasts)",
    CHECKPOINT_SAVE: "the checkpoint save",
    RESUME: "the resume (the newest complete checkpoint's load)",
}

_bound_s = DEFAULT_MINUTES * 60.0
_entered: Counter = Counter()  # phase -> how many times this process entered it
_local = threading.local()  # depth of watched phases on this thread: an inner phase leaves the naming to the outer


def configure(minutes: float) -> None:
    """The bound of every collective from here on, in minutes (``--distributed-timeout-minutes``)."""
    global _bound_s
    if not minutes > 0:
        raise ValueError(f"{FLAG} {minutes}: must be > 0")
    _bound_s = float(minutes) * 60.0


def bound_s() -> float:
    return _bound_s


def timeout() -> timedelta:
    """The bound as ``init_process_group`` / ``new_group`` take it."""
    return timedelta(seconds=_bound_s)


def _flag_value() -> str:
    return f"{FLAG} {_bound_s / 60.0:g}"


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _register(rank: int) -> None:
    """This rank's host and pid in the store (one small write per phase, so a group made later, with a store
    of its own, has it too): what a roll call reports of a rank that did not answer."""
    _store().set(f"{_KEY}/who/{rank}", f"{socket.gethostname()} pid {os.getpid()}")


def is_collective_timeout(exc: BaseException) -> bool:
    """A collective (or the store under it) ran out of time: along the cause chain."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and _TIMED_OUT.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _answer_key(phase: str, rank: int) -> str:
    return f"{_KEY}/{phase}/{rank}"


def _answer(phase: str, n: int, rank: int) -> None:
    """Rank ``rank`` got to the end of the n-th call of ``phase`` (done or failed, so it is running): one key per
    phase and rank, overwritten, so a long run's store holds a handful of them. Best effort: a store that does
    not answer is the roll call's to name."""
    try:
        _store().set(_answer_key(phase, rank), str(n))
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _answered(store, phase: str, n: int, rank: int) -> bool:
    key = _answer_key(phase, rank)
    return bool(store.check([key])) and int(store.get(key).decode()) >= n


def roll_call(phase: str, n: int, rank: int, world: int) -> tuple[list[int], dict[int, str]]:
    """The ranks that did not get to the end of the n-th call of ``phase`` (:func:`_answer`) within one bound,
    and who each is (host and pid where it registered). The ranks that are alive all answer: those that timed
    out here, those that failed otherwise (an agreed error) and those that finished the phase. A store that
    does not answer either: every other rank is named."""
    try:
        store = _store()
        store.set(_answer_key(phase, rank), str(n))
        deadline = time.monotonic() + _bound_s
        missing = [r for r in range(world) if r != rank]
        while True:
            missing = [r for r in missing if not _answered(store, phase, n, r)]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        who = {}
        for r in missing:
            if store.check([f"{_KEY}/who/{r}"]):
                who[r] = store.get(f"{_KEY}/who/{r}").decode()
        return missing, who
    except Exception:  # noqa: BLE001 - the store itself did not answer (outside torchrun it lives on rank 0)
        return [r for r in range(world) if r != rank], {}


def _message(phase_id: str, rank: int, missing: list[int], who: dict[int, str], cause: BaseException) -> str:
    phase = PHASES.get(phase_id, phase_id)
    said = (str(cause).strip().splitlines() or [type(cause).__name__])[-1][:200]
    if not missing:
        return (f"{phase}: a collective did not complete within {_bound_s:g} s ({_flag_value()}), yet every "
                f"training rank answered the roll call after it: a rank was slower than the bound; raise "
                f"{FLAG} (rank {rank} saw: {said})")
    names = ", ".join(f"rank {r}" + (f" ({who[r]})" if r in who else "") for r in missing)
    return (f"{phase}: training {names} did not answer within {_bound_s:g} s ({_flag_value()}) and not at the "
            f"roll call after it: frozen, stopped or lost. Rank {rank} stops here (it saw: {said}); the "
            "checkpoint root keeps its last published checkpoint, which a relaunch resumes from")


@contextlib.contextmanager
def watched(phase: str) -> Iterator[None]:
    """One collective phase of the training ranks (``phase``: a key of :data:`PHASES`, or words of its own): a
    collective of it that times out ends in a :class:`CollectiveTimeout` naming the ranks that did not answer.
    Without a process group (or one rank) it only runs the body."""
    import torch.distributed as dist

    depth = getattr(_local, "depth", 0)
    multi = depth == 0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if multi:
        _entered[phase] += 1
        _register(dist.get_rank())
    n = _entered[phase]
    _local.depth = depth + 1
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised as it is unless a collective ran out of time
        if not multi:
            raise
        rank, world = dist.get_rank(), dist.get_world_size()
        if isinstance(exc, CollectiveTimeout) or not is_collective_timeout(exc):
            _answer(phase, n, rank)  # running: a rank that timed out in this phase need not wait for this one
            raise
        missing, who = roll_call(phase, n, rank, world)
        error = CollectiveTimeout(_message(phase, rank, missing, who, exc))
        error.missing_ranks = tuple(missing)
        raise error from exc
    else:
        if multi:
            _answer(phase, n, dist.get_rank())
    finally:
        _local.depth = depth
