"""Memory hand-over between trainer and engine when they share accelerators (``--colocate``).

The order, per rollout (as slime's train loop):

    [trainer groups destroyed] -> generate -> engine release -> [every rank] barrier -> wait until
    the device memory is free -> [trainer groups rebuilt] -> trainer wake -> train -> trainer sleep
    -> [every rank] barrier -> engine resume weights -> weight sync -> engine resume KV cache (and
    CUDA graphs) -> next generate

Why each step:
* The barriers: only the driver rank talks to the engines, but every trainer rank shares a GPU
  with an engine. Without the first, rank 1 wakes (and allocates) while the driver is still
  asking the engines to release; without the second, the driver resumes the engines while
  rank 1 still holds its training memory. Either is an OOM on a full GPU.
* The wait (GPU only): SGLang's release can answer before the memory is back in the driver's
  pool (docs/peer-failures.md: the trainer woke before the engine's memory was free), so each rank polls its own device's free memory until
  it has risen by what the engine is expected to give back, or a timeout passes (then a
  warning names the engines and the run goes on: the wake may still fit).
* The groups (``--offload-train-groups``, on by default on GPUs): their NCCL communicators'
  memory is freed only while the engine generates, because the weight sync after the sleep,
  an evaluation and a checkpoint save all use them; nothing between the destruction and the
  rebuild runs a collective on them (the loop's own barriers and broadcasts use WORLD, kept).
* Resume in two halves: the sync writes into the resumed weights while the KV cache (an
  engine's largest allocation) is still released, so the peak is never trainer + engine
  weights + KV cache.
On CPU the same calls run (the embedded engine drops and restores its weights; SGLang on CPU
cannot release memory, which its engine logs once); there is no device memory to wait for.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from megatron_rl.backends.base import TrainBackend
from megatron_rl.infra.dist import barrier
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.replicas import ReplicaWorker

log = logging.getLogger("megatron_rl")

#: this rank's rollout side: the driver's manager, or another rank's engine replica (--embedded-engine-ranks)
RolloutSide = Union[RolloutManager, ReplicaWorker]

GIB = 1 << 30


def device_free_bytes() -> Optional[tuple[int, int]]:
    """``(free, total)`` bytes of this rank's CUDA device, or None without one."""
    import torch  # lazy: heavy, and only a GPU run reads it

    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()


def wait_for_release(free_before: int, expected_bytes: int, probe: Callable[[], Optional[tuple[int, int]]], *,
                     timeout_s: float, poll_s: float = 0.05, who: str = "the rollout engines") -> bool:
    """Poll ``probe`` until free device memory rose by ``expected_bytes`` over ``free_before``.
    True when it did; False (after a warning naming ``who``) when ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    risen = 0
    while True:
        now = probe()
        if now is None:
            return True
        risen = now[0] - free_before
        if risen >= expected_bytes:
            return True
        if time.monotonic() >= deadline:
            log.warning("%s answered the memory release, but after %.0f s this GPU has only %.2f GiB more free "
                        "(expected >= %.2f GiB): the trainer wakes anyway and may run out of memory; a server "
                        "may still be freeing (SGLang answers the release early: docs/peer-failures.md) or run without "
                        "--enable-memory-saver", who, timeout_s,
                        risen / GIB, expected_bytes / GIB)
            return False
        time.sleep(poll_s)


#: SGLang picks --mem-fraction-static itself when not given (about 0.8-0.9 of a large GPU); wait for a
#: quarter of the GPU then, half of a conservative 0.5
UNKNOWN_ENGINE_FRACTION = 0.5


def expected_release_fraction(cfg) -> Optional[float]:
    """What share of a colocated GPU an engine release should free, for :func:`wait_for_release`:
    half of the engines' static memory fraction (``--sglang-mem-fraction-static``), or None when no
    engine of this run releases device memory (no SGLang engines this run launches, or they run
    on CPU, or nothing is colocated)."""
    r = cfg.rollout
    if not cfg.memory.effective_offload_rollout or r.rollout_backend != "sglang" or r.rollout_engine_urls:
        return None
    if str(r.sglang_args.get("device", "")).lower() == "cpu":
        return None
    fraction = r.sglang_args.get("mem_fraction_static")
    return 0.5 * (float(fraction) if fraction is not None else UNKNOWN_ENGINE_FRACTION)


@dataclass
class Colocation:
    """Off (separate placement): nothing moves. On: see the module docstring.

    ``expected_release_fraction``: the share of a GPU an engine's release should free (half of
    its ``--sglang-mem-fraction-static``, when engines that release device memory share this
    rank's GPU), or None: nothing to wait for (the embedded engine releases inside this
    process, synchronously)."""

    offload_train: bool
    offload_rollout: bool
    expected_release_fraction: Optional[float] = None
    release_timeout_s: float = 60.0
    probe: Callable[[], Optional[tuple[int, int]]] = device_free_bytes

    @property
    def active(self) -> bool:
        return self.offload_train or self.offload_rollout

    def before_generate(self, backend: Optional[TrainBackend]) -> None:
        """The trainer's process groups go for the generation (a no-op unless the backend tears them down)."""
        if self.offload_train and backend is not None:
            backend.release_comm_groups()

    def before_train(self, backend: TrainBackend, rollout: Optional[RolloutSide]) -> dict[str, float]:
        """Engine release, the groups rebuilt, trainer wake; returns ``perf/groups_rebuild_s`` when groups were."""
        if not self.active:
            return {}
        waiting = self.offload_rollout and self.expected_release_fraction is not None
        before = self.probe() if waiting else None
        if before is not None:
            barrier()  # every rank measured its free memory before any engine releases
        if self.offload_rollout and rollout is not None:
            rollout.engine.release()
        barrier()  # the engines have answered the release: no rank wakes before that
        if before is not None:
            fraction = self.expected_release_fraction
            assert fraction is not None, "free memory is probed only when a release fraction is expected"
            wait_for_release(before[0], int(fraction * before[1]), self.probe,
                             timeout_s=self.release_timeout_s)
        metrics = {}
        if self.offload_train:
            t = time.perf_counter()
            if backend.restore_comm_groups():
                metrics["perf/groups_rebuild_s"] = time.perf_counter() - t
            backend.wake()
        return metrics

    def before_rollout(self, backend: TrainBackend, rollout: Optional[RolloutSide]) -> None:
        """Trainer sleep, then (after every rank slept) the engines' weights back for the sync."""
        if not self.active:
            return
        if self.offload_train:
            backend.sleep()
        barrier()  # every trainer rank has released its memory before any engine takes memory back
        if self.offload_rollout and rollout is not None:
            rollout.engine.resume_weights()

    def after_sync(self, rollout: Optional[RolloutSide]) -> None:
        """The rest of the engines' memory (KV cache, CUDA graphs), once the sync wrote the weights."""
        if self.offload_rollout and rollout is not None:
            rollout.engine.resume_kv_cache()
