"""The embedded engine on every rank: each replica generates a contiguous part of a rollout.

Why: with one engine on the driver, generation (a quarter to a third of the CPU demo's RL
step) runs on one rank while every other rank waits for the batch; with N ranks the
rollout can be N times narrower per engine. Every rank already receives the full
weights at each sync (the in-process export is gathered on all ranks), so a replica
per rank costs one model copy per rank and no extra communication for the weights.

The protocol, on ``torch.distributed``'s default group (kept when trainer groups are
torn down for generation):

* the driver's :class:`ReplicatedEngine` is the ``RolloutEngine`` the rollout manager
  holds; inside ``serving()`` each ``generate`` broadcasts the whole call (requests,
  sampling with a fixed seed, the part boundaries, the longest prompt) and generates
  part 0 itself; each other rank's :class:`ReplicaWorker` (``serve()``) generates its
  part and sends it back as a ``sample_codec`` buffer (an error as its message);
* leaving ``serving()`` sends ``done`` (the workers go on to the training half) or, when
  the driver's rollout failed, ``abort`` with its message, so no rank waits for a
  command that never comes;
* outside ``serving()`` (evaluation: its schedule reads the driver's wall clock, which
  the other ranks cannot see) the driver's replica generates alone.

Same samples as one engine: a row's sampling stream is seeded by its index in the
whole call (``EmbeddedEngine.generate_part``), so its tokens do not depend on which
replica drew it; every part's prompts are padded to the call's longest prompt, so a
row sees the prefill shape of one call. Its log-probs are the same bits only where
the CPU's GEMMs give a row the same bits at any row count: a part is a smaller batch,
and oneDNN's sgemm on an AVX-512 Xeon takes another kernel for few rows (~1 ulp;
tests/dist/test_engine_replicas.py: each part bit for bit what one engine draws for
it, the whole rollout's tokens one engine's, log-probs within float32 rounding).
Weights, release and resume act on this rank's replica: every rank reaches those
points of the loop itself (weight sync, colocation) and passes its own replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.data import sample_codec
from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import EngineError
from megatron_rl.infra.dist import rank, recv_sized, send_sized, world
from megatron_rl.infra.wall_time import record_refusal_now
from megatron_rl.rollout.base import EngineHealth, RolloutEngine

DONE, ABORT, GENERATE = "done", "abort", "generate"
_FAILED = -1  # first entry of a worker's reply sizes: the buffer is its error message, not samples


def part_bounds(num_requests: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``num_requests`` requests into contiguous parts whose sizes
    differ by at most one (the first parts get the extra ones); a request's samples stay together."""
    base, extra = divmod(num_requests, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def _broadcast_command(command: Optional[tuple], src: int) -> tuple:
    box = [command]
    dist.broadcast_object_list(box, src=src)
    received = box[0]
    assert received is not None, "the driver rank always broadcasts a command tuple"
    return received


class ReplicatedEngine(RolloutEngine):
    """The driver's engine: its own replica plus one on every other rank (``ReplicaWorker``)."""

    def __init__(self, local: Any, *, rank: int, world_size: int):
        self.local = local  # an EmbeddedEngine (generate_part)
        self.rank, self.world_size = rank, world_size
        self._serving = False

    @classmethod
    def from_config(cls, cfg, placement=None):  # built by rollout.build around the configured engine
        raise EngineError("ReplicatedEngine wraps the driver's engine in rollout.build; it is not a --rollout-backend")

    @property
    def tokenizer(self) -> Any:
        return getattr(self.local, "tokenizer", None)

    # -------------------------------------------------------------- generation
    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While the driver generates a rollout the other ranks serve their parts; on leaving, they go on
        (``done``) or raise the driver's error (``abort``)."""
        self._serving = True
        try:
            yield
        except BaseException as exc:
            self._serving = False
            record_refusal_now(exc)  # the launcher prints this rank's line, not a peer's report of it
            with contextlib.suppress(Exception):  # a broken group: the workers' collective fails on its own
                _broadcast_command((ABORT, f"{type(exc).__name__}: {exc}"), self.rank)
            raise
        self._serving = False
        _broadcast_command((DONE,), self.rank)

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        if not self._serving or not requests:
            return self.local.generate(requests, sampling)
        if sampling.seed is None:  # every replica must draw from the same base seed
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        bounds = part_bounds(len(requests), self.world_size)
        pad_to = max(len(r.prompt_ids) for r in requests)
        _broadcast_command((GENERATE, requests, sampling, bounds, pad_to), self.rank)
        own_error: Optional[Exception] = None
        try:
            samples = self.local.generate_part(requests[:bounds[1]], sampling, first_request=0, pad_to=pad_to)
        except Exception as exc:  # noqa: BLE001 - raised below, once every worker's reply is read
            own_error, samples = exc, []
        failures = []
        for peer in range(self.world_size):  # every reply is read, so no worker is left blocked in its send
            if peer == self.rank:
                continue
            sizes, buffer = recv_sized(peer, nbytes=_reply_bytes)
            if int(sizes[0]) == _FAILED:
                failures.append(f"rank {peer}: {bytes(buffer.numpy()).decode()}")
            else:
                samples.extend(sample_codec.decode(sizes, buffer))
        if own_error is not None:
            raise own_error
        if failures:
            raise EngineError("the embedded engine replica(s) failed to generate their part of the rollout: "
                              + "; ".join(failures))
        return samples

    # ------------------------------------------------ this rank's replica only
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        self.local.update_weights(named_tensors, version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self.local.update_weights_from_disk(path, version)

    def update_adapter(self, adapter: Any, version: int, base: Optional[Iterable[tuple[str, Any]]] = None) -> None:
        self.local.update_adapter(adapter, version, base)

    def update_weights_delta(self, deltas: Iterable[Any], base_version: int, version: int) -> None:
        self.local.update_weights_delta(deltas, base_version, version)

    def reports_weight_checksums(self) -> bool:
        return self.local.reports_weight_checksums()

    def weight_checksums(self, names: Iterable[str], algorithm: str) -> dict[str, str]:
        return self.local.weight_checksums(names, algorithm)

    def adapter_base_needed(self) -> bool:
        return self.local.adapter_base_needed()

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        return self.local.named_weights()

    def release(self) -> None:
        self.local.release()

    def resume(self) -> None:
        self.local.resume()

    def resume_weights(self) -> None:
        self.local.resume_weights()

    def resume_kv_cache(self) -> None:
        self.local.resume_kv_cache()

    def health(self) -> EngineHealth:
        return self.local.health()

    @property
    def weight_version(self) -> int:
        return self.local.weight_version

    def close(self) -> None:
        self.local.close()


class ReplicaWorker:
    """A non-driver rank's replica: generates its part of each rollout the driver serves.

    ``engine`` is this rank's replica (the weight sync and colocation act on it); ``serve()``
    runs from the driver's ``serving()`` entry to its exit."""

    def __init__(self, engine: Any, *, rank: int, world_size: int, driver_rank: int = 0):
        self.engine = engine
        self.rank, self.world_size, self.driver_rank = rank, world_size, driver_rank
        # part index of this rank: the driver's part is 0, the others follow in rank order
        self.part = 1 + [r for r in range(world_size) if r != driver_rank].index(rank)

    def serve(self) -> int:
        """Generate parts until the driver says ``done`` (returns how many were asked of this rank); raise
        its error on ``abort``."""
        served = 0
        while True:
            command = _broadcast_command(None, self.driver_rank)
            if command[0] == DONE:
                return served
            if command[0] == ABORT:
                raise EngineError(f"rank {self.driver_rank}'s rollout stopped: {command[1]}")
            _, requests, sampling, bounds, pad_to = command
            lo, hi = bounds[self.part], bounds[self.part + 1]
            try:
                samples = self.engine.generate_part(requests[lo:hi], sampling, first_request=lo, pad_to=pad_to)
                sizes, buffer = sample_codec.encode(samples)
            except Exception as exc:  # noqa: BLE001 - the driver names it and stops every rank
                message = f"{type(exc).__name__}: {exc}".encode()
                sizes = torch.tensor([_FAILED, len(message)], dtype=torch.int64)
                buffer = torch.frombuffer(bytearray(message), dtype=torch.uint8)  # never empty: the type's name
            send_sized(sizes, buffer, self.driver_rank)
            served += 1


def _reply_bytes(sizes: torch.Tensor) -> int:
    """A reply's byte count: an error message's length, or a ``sample_codec`` buffer's."""
    return int(sizes[1]) if int(sizes[0]) == _FAILED else int(sizes.sum())


def replicate_on_every_rank(engine: Any) -> RolloutEngine:
    """The driver's engine with a replica on every other rank (``ReplicatedEngine``), or ``engine``
    itself in a one-rank run."""
    return engine if world() == 1 else ReplicatedEngine(engine, rank=rank(), world_size=world())


def worker_for_this_rank(cfg, engine_type) -> Optional[ReplicaWorker]:
    """A non-driver rank's replica of the driver's engine (``--embedded-engine-ranks``), or None when
    the run puts none there."""
    if not cfg.embedded_replicas or world() == 1 or rank() == 0:
        return None
    return ReplicaWorker(engine_type.from_config(cfg), rank=rank(), world_size=world())
