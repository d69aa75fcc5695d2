"""The disk transport (``--update-weight-transport disk``): versioned HF safetensors dirs the engine loads.

Every rank iterates the backend's ``export_weights`` (it is collective: TP/PP/EP gathers);
the driver writes the stream into ``<--update-weight-disk-dir>/v<version>/`` through
``rollout.weight_dir.VersionedWeightDir`` (a hidden temporary dir renamed into place when
complete, so a half-written version never loads), then asks the engine to load it
(``engine.update_weights_from_disk(path, version)``: every SGLang server's
``/update_weights_from_disk``, or the embedded engine reading the files), then prunes to the
newest 2 versions. If writing fails the driver still runs the export to the end, and the outcome
is agreed by every rank (``infra.dist.all_ranks_ok``) before anyone goes on: every rank raises the
same error, none is left alone in the next collective (the weights' temporary dir is removed by
``VersionedWeightDir.write``). A full disk or quota is a :class:`SyncDiskFull` naming the
directory, the bytes free and needed (the size of the previous version) and the fix; its exit code
is 3 when a complete checkpoint under ``--save`` is there to resume from (else 2).

Works with both engines: SGLang servers given by ``--rollout-engine-urls`` (which must be able
to read the directory: a shared filesystem when they run on other hosts), and the embedded
engine (the files are a record of every pushed version, and the path SGLang takes, testable
without a server).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Optional

from megatron_rl.infra.checkpoint_root import find_latest_complete, iter_dir
from megatron_rl.infra.disk_space import SyncDiskFull, disk_full_problem
from megatron_rl.infra.dist import all_ranks_ok
from megatron_rl.infra.wall_time import EXIT_WALL_TIME
from megatron_rl.rollout.sglang.engine import SGLangEngine
from megatron_rl.rollout.weight_delta import DELTA_FILE, DeltaHeader, disk_entries
from megatron_rl.rollout.weight_dir import VersionedWeightDir
from megatron_rl.weight_sync.base import ExportStream, WeightSynchronizer, check_engine_equals, updates_from_config

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine
    from megatron_rl.weight_sync.delta import EngineUpdates

KEEP_VERSIONS = 2  # the version the engine loaded and the one before it


class DiskSynchronizer(WeightSynchronizer):
    """Publish each sync as ``<disk_dir>/v<version>`` and have the engine load it."""

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0, *,
                 disk_dir: Optional[str] = None, hf_checkpoint: Optional[str] = None,
                 keep_versions: int = KEEP_VERSIONS, checkpoint_root: Optional[str] = None, adapter: bool = False,
                 updates: Optional["EngineUpdates"] = None):
        super().__init__(bucket_bytes, check_equal, driver_rank, adapter=adapter, updates=updates)
        self.weights = VersionedWeightDir(disk_dir, hf_checkpoint=hf_checkpoint, keep_versions=keep_versions)
        self.checkpoint_root = checkpoint_root  # --save: a full disk stops with exit 3 when it holds a checkpoint

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0, engines: Any = None) -> "DiskSynchronizer":
        s = cfg.sync
        return cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank, disk_dir=s.update_weight_disk_dir, hf_checkpoint=cfg.model.hf_checkpoint,
                   checkpoint_root=cfg.checkpoint.save, adapter=cfg.lora.lora_sync == "adapter",
                   updates=updates_from_config(cfg)).with_verifier(cfg)

    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        here = self.on_driver() and engine is not None
        # a replica of the embedded engine on another rank (--embedded-engine-ranks) takes the exported
        # tensors as they stream by: the bits the driver publishes, with no wait for the files
        replica = engine is not None and not here
        # an SGLang engine compares inside its servers (/weights_checker, the update to version 0); the
        # embedded one is compared here, tensor for tensor, after every sync
        in_engine = self.check_equal and here and hasattr(engine, "check_first_update")
        if in_engine:
            setattr(engine, "check_first_update", True)  # an SGLang engine's own switch (the hasattr above)
        adapter = None
        if self.adapter:  # --lora-sync adapter: a PEFT dir per version, the base model beside the first one
            adapter, exported = self.export_adapter(backend, engine)
        else:
            exported = ExportStream(backend, self.bucket_bytes, keep_copies=self.check_equal and not in_engine)
        timing = {"sync/write_s": 0.0, "sync/load_s": 0.0}
        updated: dict[str, float] = {}
        error: Optional[BaseException] = None
        path = ""
        managed = engine is not None and adapter is None and self.updates.active  # delta / verify: EngineUpdates
        verifying = here and adapter is None and self.sglang_verifier is not None  # SGLang: weight_sync.sglang_verify
        if verifying:
            assert exported is not None, "a whole-model sync (no adapter) always exports"
            try:
                exported.observe = self.verify_tap(engine)
            except Exception as e:  # noqa: BLE001 - a server that does not answer /server_info; agreed below
                error = e
        managed_here = here and managed and error is None  # the driver's sync through EngineUpdates
        if managed_here:
            assert engine is not None and exported is not None, "managed: an engine and a full export"
            updated = self._send_managed(engine, exported, version, t0, timing)
            if verifying:  # SGLang's post-apply check, after a full or a delta sync alike
                assert self.sglang_verifier is not None and isinstance(engine, SGLangEngine), "verify_tap checked it"
                updated.update(self.sglang_verifier.check(engine, version))
        elif here and error is not None:
            assert exported is not None, "set only by verify_tap, on a whole-model sync"
            exported.drain()  # the other ranks are in the collective export: let them finish it
        elif here:
            try:
                # shards of one bucket: the driver holds one at a time, not the whole model (a 30B model in bf16
                # would otherwise sit in its host memory whole, 60 GB)
                path = self.weights.write(exported if exported is not None else (), version,
                                          shard_bytes=self.bucket_bytes, adapter=adapter)
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError included; agreed below
                if exported is not None:
                    exported.drain()  # the other ranks are still in the collective export: let them finish it
                error = self._named(e, version)
        elif replica and managed:
            assert engine is not None and exported is not None, "managed: an engine and a full export"
            try:
                updated = self.updates.send(
                    engine, exported, version, full=lambda items: engine.update_weights(items, version),
                    delta=lambda deltas, base: engine.update_weights_delta(deltas, base, version))
            except Exception as e:  # noqa: BLE001 - agreed below, so no rank is left alone in a collective
                exported.drain()
                error = e
        elif replica:
            assert engine is not None, "a replica is a rank that holds an engine"
            if adapter is not None:
                engine.update_adapter(adapter, version, base=exported)
            else:
                assert exported is not None, "a full sync always exports"
                engine.update_weights(exported, version)
        elif exported is not None:
            exported.drain()
        if not managed_here:  # the driver agreed inside _send_managed, between writing and loading
            try:
                all_ranks_ok(error, reraise_own=True)  # every rank is past the export: all go on, or all raise
            except SyncDiskFull as e:  # on every rank: the same message and exit code
                raise self._with_resume(e) from e
        if here and not managed_here:
            t1 = time.perf_counter()
            timing["sync/write_s"] = t1 - t0  # export (gathers) + serialising + publishing: overlap per bucket
            assert engine is not None, "the driver syncs here only when it holds the engine"
            engine.update_weights_from_disk(path, version)
            timing["sync/load_s"] = time.perf_counter() - t1
            self.weights.prune(version)
            if verifying:
                assert self.sglang_verifier is not None and isinstance(engine, SGLangEngine), "verify_tap checked it"
                updated.update(self.sglang_verifier.check(engine, version))
        if adapter is not None:
            metrics = self.adapter_metrics(adapter, exported, version, time.perf_counter() - t0)
        else:
            assert exported is not None, "a full sync always exports"
            metrics = exported.metrics(version, time.perf_counter() - t0)
        metrics.update(timing)
        metrics.update(updated)
        if adapter is not None:
            if self.check_equal:  # an extra merged export, compared on each rank that holds an in-process engine
                checked = self.check_merged(backend, engine if (replica or here and not in_engine) else None)
                if checked is not None:
                    metrics["sync/checked_tensors"] = checked
        elif self.check_equal and (replica or here and not in_engine):
            assert engine is not None and exported is not None, "a replica, like the driver here, holds an engine"
            metrics["sync/checked_tensors"] = float(check_engine_equals(engine, exported.sent))
        return metrics

    def _send_managed(self, engine: "RolloutEngine", exported: ExportStream, version: int, t0: float,
                      timing: dict[str, float]) -> dict[str, float]:
        """The driver's sync through ``EngineUpdates`` (--update-weight-mode delta / --update-weight-verify):
        ``v<version>`` holds the full tensors or the delta (``rollout.weight_delta``: ``delta.json`` beside the
        patches), published, agreed by every rank (``all_ranks_ok``, once) and loaded."""
        agreed = False

        def publish(items: Any, header: Optional[DeltaHeader]) -> None:
            nonlocal agreed
            error: Optional[BaseException] = None
            path = ""
            try:
                extra = (lambda: {DELTA_FILE: header.to_json()}) if header is not None else None
                path = self.weights.write(disk_entries(items, header) if header is not None else items, version,
                                          shard_bytes=self.bucket_bytes, extra_files=extra)
            except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError included; agreed below
                exported.drain()
                error = self._named(e, version)
            agreed = True
            try:
                all_ranks_ok(error, reraise_own=True)
            except SyncDiskFull as e:
                raise self._with_resume(e) from e
            t1 = time.perf_counter()
            timing["sync/write_s"] = t1 - t0
            engine.update_weights_from_disk(path, version)
            timing["sync/load_s"] = time.perf_counter() - t1
            self.weights.prune(version)

        u = self.updates
        try:
            return u.send(engine, exported, version, full=lambda items: publish(items, None),
                          delta=lambda deltas, base: publish(deltas, DeltaHeader(base, version, u.encoding,
                                                                                 u.carried_checksum)))
        except Exception as e:
            if not agreed:  # failed before publishing: the other ranks still wait for the agreement
                exported.drain()
                all_ranks_ok(e, reraise_own=True)
            raise

    def _named(self, error: Exception, version: int) -> Exception:
        """A full disk under ``--update-weight-disk-dir`` as :class:`SyncDiskFull` (path, room, fix);
        any other error as it is."""
        problem = disk_full_problem(error, self.weights.path(version), self._previous_version_bytes())
        if problem is None:
            return error
        named = SyncDiskFull(f"weight update to version {version}: {problem}. Free space under "
                             f"--update-weight-disk-dir {self.weights.root} (it keeps the newest "
                             f"{self.weights.keep_versions} versions) or point it at a filesystem with room")
        named.__cause__ = error
        return named

    def _with_resume(self, error: SyncDiskFull) -> SyncDiskFull:
        """``error`` with what a relaunch resumes from, and exit code 3 when that is a complete checkpoint."""
        newest = find_latest_complete(self.checkpoint_root) if self.checkpoint_root else None
        if newest is None:
            return SyncDiskFull(f"{error}; no complete checkpoint under --save: a relaunch starts over")
        assert self.checkpoint_root is not None, "a complete checkpoint is looked for only under a given --save"
        out = SyncDiskFull(f"{error}; {iter_dir(self.checkpoint_root, newest)} is complete: relaunch the same "
                           "command once there is room and it resumes from there")
        out.exit_code = EXIT_WALL_TIME
        return out

    def _previous_version_bytes(self) -> Optional[int]:
        """Bytes of the newest published version: what the next one needs (the same tensors)."""
        versions = self.weights.versions()
        if not versions:
            return None
        top = self.weights.path(versions[-1])
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(top) for n in names) or None
