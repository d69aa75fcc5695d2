"""Small ``torch.distributed`` helpers that also work without a process group (one process).

* :func:`rank`, :func:`world`, :func:`barrier` - 0, 1 and a no-op when
  ``torch.distributed`` is not initialised;
* :func:`rank0_do` - run a step on rank 0 only (file-system work: create, check,
  publish a dir); its result or its error reaches every rank;
* :func:`all_ranks_ok` - every rank raises when any rank failed;
* :func:`send_sized` / :func:`recv_sized` - a byte buffer point to point, its sizes first (the
  receiver allocates from them): how ``sample_codec`` buffers travel.

Why every helper raises on every rank: a rank that raises while the others wait in
the next collective hangs the job until the timeout; an error reported everywhere
ends it at once with the message of the rank that failed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import CorruptCheckpoint


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rank0_do(fn: Callable[[], Any], what: str, unexpected: type[CheckpointError] = CheckpointError) -> Any:
    """Collective: ``fn()`` on rank 0; its result (broadcast: it must pickle) or its error on every rank.

    A CheckpointError keeps its class (:class:`CorruptCheckpoint` stays one) and message;
    any other exception becomes ``unexpected`` (default CheckpointError) saying
    "``what`` failed: Type: message"."""
    box: list = [None, None, None]  # result, error is CorruptCheckpoint, error message
    if rank() == 0:
        try:
            box[0] = fn()
        except CheckpointError as e:
            box[1], box[2] = isinstance(e, CorruptCheckpoint), str(e)
        except Exception as e:  # noqa: BLE001 - every rank must raise, not wait in a collective
            box[1], box[2] = issubclass(unexpected, CorruptCheckpoint), f"{what} failed: {type(e).__name__}: {e}"
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[2] is not None:
        raise (CorruptCheckpoint if box[1] else CheckpointError)(box[2])
    return box[0]


def all_ranks_ok(error: Optional[BaseException], reraise_own: bool = False) -> None:
    """Collective: raise on every rank if any rank hit ``error``: a CheckpointError with the
    first message (lowest failing rank). ``reraise_own``: a rank that hit one raises it as is
    (its type and traceback kept); only the others get the CheckpointError."""
    msgs = [None if error is None else str(error) or type(error).__name__]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, msgs[0])
        msgs = [m for m in gathered if m is not None] or [None]
    if reraise_own and error is not None:
        raise error
    if msgs[0] is not None:
        raise CheckpointError(msgs[0])


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

