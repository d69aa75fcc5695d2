"""Small ``torch.distributed`` helpers that also work without a process group (one process).

* :func:`rank`, :func:`world`, :func:`barrier` - 0, 1 and a no-op when
  ``torch.distributed`` is not initialised;
* :func:`rank0_do` - run a step on rank 0 only (file-system work: create, check,
  publish a dir); its result or its error reaches every rank;
* :func:`all_ranks_ok` - every rank raises when any rank failed (our error classes, e.g. a
  disk-full error, stay what they are on every rank; ``prefer`` names the class that is the cause);
* :func:`gather_problems` - every rank's list of problems, on every rank;
* :func:`send_sized` / :func:`recv_sized` - a byte buffer point to point, its sizes first (the
  receiver allocates from them): how ``sample_codec`` buffers travel.

Why every helper raises on every rank: a rank that raises while the others wait in
the next collective hangs the job until the timeout; an error reported everywhere
ends it at once with the message of the rank that failed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.errors import CheckpointError, MegatronRLError


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:  # one rank: nothing to wait for (gloo's costs ~10 ms)
        dist.barrier()


def _rebuild(cls: Optional[type], message: str, default: type[Exception] = CheckpointError) -> Exception:
    """The error another rank raised, on this rank: its class where it is one of ours (a
    ``CorruptCheckpoint``, a disk-full error: callers decide by the class), else ``default``."""
    if isinstance(cls, type) and issubclass(cls, MegatronRLError):
        try:
            return cls(message)
        except TypeError:  # a class whose constructor wants more than the message
            pass
    return default(message)


def rank0_do(fn: Callable[[], Any], what: str, unexpected: type[CheckpointError] = CheckpointError) -> Any:
    """Collective: ``fn()`` on rank 0; its result (broadcast: it must pickle) or its error on every rank.

    One of our errors (a CheckpointError, ``CorruptCheckpoint``, a disk-full error ...) keeps
    its class and message on every rank; any other exception becomes ``unexpected`` (default
    CheckpointError) saying "``what`` failed: Type: message"."""
    box: list = [None, None, None]  # result, error class, error message
    if rank() == 0:
        try:
            box[0] = fn()
        except MegatronRLError as e:
            box[1], box[2] = type(e), str(e)
        except Exception as e:  # noqa: BLE001 - every rank must raise, not wait in a collective
            box[1], box[2] = unexpected, f"{what} failed: {type(e).__name__}: {e}"
    if dist.is_initialized() and dist.get_world_size() > 1:  # one rank: it has the box already
        dist.broadcast_object_list(box, src=0)
    if box[2] is not None:
        raise _rebuild(box[1], box[2])
    return box[0]


def all_ranks_ok(error: Optional[BaseException], reraise_own: bool = False,
                 prefer: Optional[type[MegatronRLError]] = None) -> None:
    """Collective: raise on every rank if any rank hit ``error``: the first failing rank's (lowest)
    message, as its class where that is one of ours (a disk-full error stays one on every rank),
    else a CheckpointError. ``reraise_own``: a rank that hit one raises it as is (its type and
    traceback kept); only the others get the rebuilt error. ``prefer``: an error of this class on
    any rank is the cause: it wins over the others' and is raised on every rank, a rank's own other
    error chained to it (a rank whose collective failed because another rank's disk is full)."""
    mine: tuple[Optional[type[BaseException]], Optional[str]] = (
        (None, None) if error is None else (type(error), str(error) or type(error).__name__))
    gathered: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine if mine[0] is None or issubclass(mine[0], MegatronRLError)
                               else (None, mine[1]))  # a foreign class may not unpickle on another rank
    failed = [g for g in gathered if g[1] is not None]
    cause = next((g for g in failed if prefer is not None and isinstance(g[0], type) and issubclass(g[0], prefer)),
                 None)
    if cause is not None:
        assert prefer is not None, "a rank's error is the cause only when it is of the preferred class"
        if not (reraise_own and isinstance(error, prefer)):
            raise _rebuild(cause[0], cause[1]) from error
    if reraise_own and error is not None:
        raise error
    if failed:
        raise _rebuild(failed[0][0], failed[0][1])


def gather_problems(mine: Sequence[str], group: Any = None) -> list[str]:
    """Collective: every rank's problems (short strings), in rank order, on every rank (``mine`` alone
    without a process group). The one way a check that each rank runs on its share (files, tensors,
    a transport's step) learns whether any rank failed, so every rank decides alike and none waits
    alone in the next collective. ``group``: a process group of the ranks taking part (default: all)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(mine)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(mine), group=group)
    return [p for part in gathered for p in part]


def send_sized(sizes: torch.Tensor, buffer: torch.Tensor, dst: int) -> None:
    """Point to point: ``sizes`` (a small int64 tensor), then ``buffer`` (uint8) to rank ``dst``."""
    dist.send(sizes, dst)
    dist.send(buffer, dst)


def recv_sized(src: int, slots: int = 2,
               nbytes: Callable[[torch.Tensor], int] = lambda sizes: int(sizes.sum())) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`send_sized` sent from ``src``: ``sizes`` (``slots`` int64 values), then a buffer of
    ``nbytes(sizes)`` bytes (default: their sum, ``sample_codec``'s layout)."""
    sizes = torch.empty(slots, dtype=torch.int64)
    dist.recv(sizes, src)
    buffer = torch.empty(nbytes(sizes), dtype=torch.uint8)
    dist.recv(buffer, src)
    return sizes, buffer

