"""The in-process transport: the driver's engine lives in the trainer's process.

The backend's ``export_weights`` yields full HF-layout tensors bucket by bucket
on every rank (gathered over TP/PP/EP); the driver rank (and, with the embedded
engine replicated on every rank, each rank) streams them straight into
``engine.update_weights`` without a copy to disk or a second process. On
GPUs with a colocated SGLang engine the ``tensor`` transport hands CUDA IPC
handles instead; the bucketing and versioning are the same.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from megatron_rl.weight_sync.base import ExportStream, WeightSynchronizer, check_engine_equals

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.rollout.base import RolloutEngine


class InProcessSynchronizer(WeightSynchronizer):
    """``--update-weight-transport tensor``: each rank that holds an engine (the driver; every rank with
    ``--embedded-engine-ranks all``) streams the export into it."""

    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        exported = ExportStream(backend, self.bucket_bytes, keep_copies=self.check_equal)
        if engine is not None:
            engine.update_weights(exported, version)
        else:
            exported.drain()  # the export is collective: every rank iterates it to the end
        metrics = exported.metrics(version, time.perf_counter() - t0)
        if self.check_equal and engine is not None:
            metrics["sync/checked_tensors"] = float(check_engine_equals(engine, exported.sent))
        return metrics
