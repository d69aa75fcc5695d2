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
        if self.adapter:
            return self._sync_adapter(backend, engine, version, t0)
        exported = ExportStream(backend, self.bucket_bytes, keep_copies=self.check_equal)
        updated: dict[str, float] = {}
        if engine is not None and self.updates.active:  # delta and/or the checksum check after
            try:
                updated = self.updates.send(
                    engine, exported, version, full=lambda items: engine.update_weights(items, version),
                    delta=lambda deltas, base: engine.update_weights_delta(deltas, base, version))
            finally:
                exported.drain()  # a failed update still lets the other ranks finish the collective export
        elif engine is not None:
            engine.update_weights(exported, version)
        else:
            exported.drain()  # the export is collective: every rank iterates it to the end
        metrics = exported.metrics(version, time.perf_counter() - t0)
        metrics.update(updated)
        if self.check_equal and engine is not None:
            metrics["sync/checked_tensors"] = float(check_engine_equals(engine, exported.sent))
        return metrics

    def _sync_adapter(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int,
                      t0: float) -> dict[str, float]:
        """``--lora-sync adapter``: the adapter tensors into each engine (which merges them into its kept base),
        the base model along on the first sync."""
        adapter, base = self.export_adapter(backend, engine)
        if engine is not None:
            try:
                engine.update_adapter(adapter, version, base=base)
            finally:
                if base is not None:
                    base.drain()  # a failed update still lets the other ranks finish the collective export
        elif base is not None:
            base.drain()
        metrics = self.adapter_metrics(adapter, base, version, time.perf_counter() - t0)
        if self.check_equal:
            checked = self.check_merged(backend, engine)
            if checked is not None:
                metrics["sync/checked_tensors"] = checked
        return metrics
