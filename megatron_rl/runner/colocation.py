"""Memory hand-over between trainer and engine when they share accelerators (``--colocate``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_rl.backends.base import TrainBackend
from megatron_rl.rollout.manager import RolloutManager


@dataclass
class Colocation:
    """Off (separate placement): nothing moves. On: the engine drops its weights
    before training and the trainer offloads before the engine resumes; the
    engine then gets a complete weight update (the sync that follows). On CPU the
    same calls run; they just free host memory.
    """

    offload_train: bool
    offload_rollout: bool

    def before_train(self, backend: TrainBackend, rollout: Optional[RolloutManager]) -> None:
        if self.offload_rollout and rollout is not None:
            rollout.engine.release()
        if self.offload_train:
            backend.wake()

    def before_rollout(self, backend: TrainBackend, rollout: Optional[RolloutManager]) -> None:
        if self.offload_train:
            backend.sleep()
        if self.offload_rollout and rollout is not None:
            rollout.engine.resume()
