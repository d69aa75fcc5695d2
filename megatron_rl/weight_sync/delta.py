"""The trainer's end of ``--update-weight-mode delta`` and ``--update-weight-verify checksum``.

:class:`EngineUpdates` is held by a synchronizer, one per rank that holds an engine. Per sync it

* decides full or delta: delta only when it holds a host copy (``snapshot``) of exactly what this engine
  holds: the same engine object, at the version the copy was made for, with complete weights. Otherwise
  (the first sync, a replaced or fresh engine, one at another version, a failed update) the sync is full,
  logged with the reason and counted (``sync/delta_fallbacks``, the first sync not counted);
* turns the backend's export (HF-named tensors, any dtype) into what goes to the engine: each tensor cast
  to the engine's dtype, diffed against the copy (``rollout.weight_delta.encode``), the copy updated to the
  new bits, unchanged tensors left out; or, full, the exported tensors as they are;
* after the engine applied the update, compares the engine's checksum of every tensor it now holds
  (``RolloutEngine.weight_checksums``) with its own of the same bytes (the exported tensor in the engine's
  dtype), and raises ``WeightChecksumMismatch`` naming each differing tensor, its bucket and the version;
* adopts the new version for the copy only when the engine took the update (and verification passed).

An engine that refuses the delta (``DeltaBaseMismatch``: it holds another version than the one named) before
reading any of it gets the same export as a full update instead; after it read some (an apply that failed),
the error stands: the engine refuses to generate until a full update, which the next sync sends.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch

from megatron_rl.rollout.weight_delta import (
    DeltaBaseMismatch,
    TensorDelta,
    WeightChecksumMismatch,
    encode,
    tensor_checksum,
)

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine
    from megatron_rl.weight_sync.base import ExportStream

log = logging.getLogger(__name__)

FullApply = Callable[[Iterable[tuple[str, Any]]], None]
DeltaApply = Callable[[Iterable[TensorDelta], int], None]  # (deltas, base_version)


class EngineUpdates:
    """What one rank sends its engine each sync, and the check after (see the module docstring)."""

    _FIRST = "the first sync"

    def __init__(self, *, mode: str = "full", encoding: str = "xor", checksum: str = "xxh3-128",
                 verify: bool = False, verify_auto: bool = False):
        self.mode = mode
        self.encoding = encoding
        self.checksum = checksum
        self.verify = verify
        # --update-weight-verify auto: verify only an engine that reports checksums (the embedded one; not a test
        # double or an engine of a user's own that does not)
        self.verify_auto = verify_auto
        self._verifying = verify  # this sync: verify, with an engine that answers
        self.snapshot: dict[str, torch.Tensor] = {}  # delta mode: the engine's weights as last sent, its dtype
        self.version: Optional[int] = None  # the version ``snapshot`` holds (None: no usable copy)
        self._engine_id: Optional[int] = None  # the engine the copy is of
        self.fallbacks = 0  # full syncs sent in delta mode after the first (the engine was not at the copy's version)
        self._dtypes: dict[str, torch.dtype] = {}
        self._served: Optional[torch.dtype] = None  # an engine holding every floating tensor in one dtype (SGLang)

    @classmethod
    def from_config(cls, cfg: "Config") -> "EngineUpdates":
        s = cfg.sync
        return cls(mode=s.update_weight_mode, encoding=s.update_weight_delta_encoding,
                   checksum=s.update_weight_delta_checksum,
                   # an embedded engine (in this process or its own); SGLang engines are checked by
                   # weight_sync.sglang_verify instead
                   verify=cfg.weight_update_verify == "checksum" and cfg.rollout.rollout_backend == "embedded",
                   verify_auto=s.update_weight_verify == "auto")

    @property
    def carried_checksum(self) -> str:
        """The checksum each delta tensor carries for the engine to check after patching it: none when the trainer
        verifies every tensor after the update anyway (--update-weight-verify checksum)."""
        return "" if self._verifying else self.checksum

    @property
    def active(self) -> bool:
        """Whether this may do anything beyond handing the export over (delta mode or verification)."""
        return self.mode == "delta" or self.verify

    def _working(self) -> bool:
        """Whether this sync does more than hand the export over."""
        return self.mode == "delta" or self._verifying

    # ------------------------------------------------------------------ choice
    def delta_base(self, engine: "RolloutEngine") -> tuple[Optional[int], str]:
        """The version a delta to ``engine`` can be based on (None: send full), and why not when None."""
        if self.mode != "delta":
            return None, ""
        if self.version is None:
            return None, self._FIRST if not self.snapshot else "the last sync failed or was not verified"
        if self._engine_id != id(engine):
            return None, "the engine was replaced since the last sync"
        if engine.weight_version != self.version:
            return None, f"the engine holds version {engine.weight_version}, the copy is of version {self.version}"
        # an engine that says itself whether a delta on this base can land (SGLang: its servers' versions and the
        # host checkpoint's, without /health, which makes every SGLang server generate a token)
        refusal = getattr(engine, "delta_refusal", None)
        if callable(refusal):
            why = refusal(self.version)
            return (None, why) if why else (self.version, "")
        health = engine.health()
        if not health.weights_loaded or health.released:
            return None, f"the engine's weights are incomplete ({health.detail})"
        return self.version, ""

    # ---------------------------------------------------------------- the sync
    def send(self, engine: "RolloutEngine", exported: "ExportStream", version: int, *,
             full: FullApply, delta: DeltaApply) -> dict[str, float]:
        """Push ``exported`` into ``engine`` as ``version`` through ``full`` or ``delta`` (the transport's two
        ways in), verify, and return this part's metrics."""
        answers = getattr(engine, "reports_weight_checksums", None)
        self._verifying = self.verify and (not self.verify_auto or (callable(answers) and bool(answers())))
        served = getattr(engine, "served_dtype", None)  # SGLang: one dtype for every floating tensor, no weight list
        self._served = served() if callable(served) and self._working() else None
        if self._served is None and (not self._dtypes or self._engine_id != id(engine)):
            self._dtypes = {name: t.dtype for name, t in engine.named_weights()} if self._working() else {}
        base, why = self.delta_base(engine)
        self._digests: dict[str, tuple[str, int]] = {}  # name -> (checksum, bucket) of what the engine should hold
        self._sent = self._full_bytes = self._changed = self._elements = 0
        self._started = False
        self.version = None  # the copy is updated as the tensors go: it is of no version until the engine took them
        sent_delta = False
        if base is not None:
            try:
                delta(self._deltas(exported), base)
                sent_delta = True
            except DeltaBaseMismatch as e:
                if self._started:
                    raise
                why = str(e)
        if not sent_delta:
            if self.mode == "delta":
                if base is not None or why != self._FIRST:
                    self.fallbacks += 1
                    log.warning("weight sync to version %d: sending every tensor, not a delta: %s", version, why)
            full(self._full(exported))
        if self.mode == "delta":  # the engine took it: the copy is now of this version
            self.version, self._engine_id = version, id(engine)
        metrics = {"sync/full_bytes": float(self._full_bytes)}
        if self.mode == "delta":
            metrics.update({"sync/delta": float(sent_delta), "sync/delta_fallbacks": float(self.fallbacks),
                            "sync/changed_fraction": self._changed / max(self._elements, 1)})
            if sent_delta:
                metrics["sync/bytes"] = float(self._sent)
            metrics["sync/delta_fraction"] = (self._sent if sent_delta else self._full_bytes) / max(self._full_bytes, 1)
        if self._verifying:
            t0 = time.perf_counter()
            try:
                metrics["sync/verified_tensors"] = float(self.check(engine, version))
            except BaseException:
                self.version = None  # the engine holds something else than the copy: the next sync is full
                raise
            metrics["sync/verify_time_s"] = time.perf_counter() - t0
        return metrics

    def _engine_dtype(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the CPU in the engine's dtype for ``name``, contiguous (no copy when it already is)."""
        dtype = self._dtypes.get(name, tensor.dtype) if self._served is None else \
            self._served if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device="cpu", dtype=dtype).contiguous()

    def _record(self, exported: "ExportStream", name: str, new: torch.Tensor) -> Optional[str]:
        self._full_bytes += new.numel() * new.element_size()
        digest = tensor_checksum(new, self.checksum) if self._working() else None
        if digest is not None:
            self._digests[name] = (digest, exported.buckets)
        return digest

    def _deltas(self, exported: "ExportStream") -> Iterator[TensorDelta]:
        self._started = True
        for name, tensor in exported:
            new = self._engine_dtype(name, tensor)
            if new is tensor or new.data_ptr() == tensor.data_ptr():
                new = new.clone()  # the copy must not alias the trainer's (or the export's) buffer
            digest = self._record(exported, name, new)
            # verified after the apply: the engine need not check each patched tensor itself as well
            d = encode(name, new, self.snapshot.get(name), self.encoding, self.carried_checksum, digest)
            self._elements += new.numel()
            self.snapshot[name] = new
            if d is None:
                continue
            self._changed += new.numel() if d.indices is None else d.indices.numel()
            self._sent += d.nbytes
            yield d

    def _full(self, exported: "ExportStream") -> Iterator[tuple[str, Any]]:
        working = self._working()
        for name, tensor in exported:
            if working:
                new = self._engine_dtype(name, tensor)
                self._record(exported, name, new)
                self._elements += new.numel()
                self._changed += new.numel()
                if self.mode == "delta":
                    self.snapshot[name] = new.clone() if new.data_ptr() == tensor.data_ptr() else new
                yield name, new  # cast once, here: the engine's copy is then a plain one (the same rounding)
            else:
                yield name, tensor

    # ------------------------------------------------------------ verification
    def check(self, engine: "RolloutEngine", version: int) -> int:
        """The engine's checksum of every tensor it holds against ours of what it should hold; the number checked.

        In delta mode the tensors a sync left out are checked too (against the copy): a tensor that changed
        inside the engine since is caught the same way."""
        want = dict(self._digests)
        if self.mode == "delta":
            for name, t in self.snapshot.items():
                if name not in want:
                    want[name] = (tensor_checksum(t, self.checksum), 0)
        got = engine.weight_checksums(list(want), self.checksum)
        differ = [name for name, (digest, _) in want.items() if got.get(name) != digest]
        if differ:
            where = ", ".join(f"{n} (bucket {want[n][1]})" if want[n][1] else f"{n} (not in this sync)"
                              for n in differ[:8])
            raise WeightChecksumMismatch(
                f"--update-weight-verify: after the weight sync to version {version} the engine holds other bytes "
                f"than the trainer sent in {len(differ)} of {len(want)} tensor(s): {where}"
                f"{' ...' if len(differ) > 8 else ''} ({self.checksum} of each tensor in the engine's dtype); the "
                "engine's weights diverged from the trainer's: the next sync sends every tensor")
        return len(want)
