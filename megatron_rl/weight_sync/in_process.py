"""The in-process transport: the driver's engine lives in the trainer's process.

The backend's ``export_weights`` yields full HF-layout tensors bucket by bucket
on every rank (gathered over TP/PP/EP); the driver rank streams them straight
into ``engine.update_weights`` without a copy to disk or a second process. On
GPUs with a colocated SGLang engine the ``tensor`` transport hands CUDA IPC
handles instead; the bucketing and versioning are the same.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rl.errors import SyncError
from megatron_rl.weight_sync.base import WeightSynchronizer

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.rollout.base import RolloutEngine


class InProcessSynchronizer(WeightSynchronizer):
    """``--update-weight-transport tensor``: the driver streams the export into its own engine."""

    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        is_driver = not dist.is_initialized() or dist.get_rank() == self.driver_rank
        sent: dict[str, torch.Tensor] = {}
        stats = {"bytes": 0, "tensors": 0, "buckets": 0}

        def stream():
            for bucket in backend.export_weights(self.bucket_bytes):
                stats["buckets"] += 1
                for name, tensor in bucket:
                    stats["bytes"] += tensor.numel() * tensor.element_size()
                    stats["tensors"] += 1
                    if self.check_equal:
                        sent[name] = tensor.detach().to("cpu", copy=True)
                    yield name, tensor

        if is_driver and engine is not None:
            engine.update_weights(stream(), version)
        else:
            for _ in stream():  # the export is collective: every rank iterates it to the end
                pass
        metrics = {"sync/time_s": time.perf_counter() - t0, "sync/bytes": float(stats["bytes"]),
                   "sync/buckets": float(stats["buckets"]), "sync/weight_version": float(version)}
        if self.check_equal and is_driver and engine is not None:
            metrics["sync/checked_tensors"] = float(self._check(engine, sent))
        return metrics

    @staticmethod
    def _check(engine: "RolloutEngine", sent: dict[str, torch.Tensor]) -> int:
        live = dict(engine.named_weights())
        differ = []
        for name, want in sent.items():
            got = live.get(name)
            if got is None or got.shape != want.shape or not torch.equal(got.to(want.dtype).cpu(), want):
                differ.append(name)
        missing = sorted(set(live) - set(sent))
        if differ or missing:
            raise SyncError("--check-weight-update-equal: after the sync the engine differs from the trainer in "
                            f"{len(differ)} tensor(s) {differ[:8]} and was not sent {len(missing)} {missing[:8]}; "
                            "the bridge's export and the engine's HF names disagree")
        return len(sent)
