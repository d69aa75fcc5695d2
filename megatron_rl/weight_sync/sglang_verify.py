"""``--update-weight-verify checksum`` with SGLang engines, for the transports whose driver sees the whole export
(disk, distributed with one sender, tensor).

Per sync, on the driver: before the export, every server's ``/server_info`` (TP size, dtype, device; read once per
engine) gives its layout; the export is tapped (``ExportStream.observe``) and each HF tensor becomes the engine
tensors every rank of every distinct layout should hold, hashed as SGLang hashes them
(``rollout.sglang.checksums``). After the engine adopted the version, every server answers ``/weights_checker``
``checksum`` (every TP rank's checksum of every tensor it holds), compared tensor for tensor: a difference, a tensor
on one side only, or a rank that did not answer is a ``WeightChecksumMismatch`` naming the server, the engine rank,
the tensors (with their buckets) and the version, and the engine refuses to generate until a complete update.

Metrics: ``sync/verified_tensors`` (rank-tensor checksums compared, over every server), ``sync/verify_hash_s`` (the
trainer's side: cutting, casting and hashing, inside ``sync/time_s``), ``sync/verify_time_s`` (the servers'
checksums and the compare, after the sync).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from megatron_rl.errors import EngineError, SyncError
from megatron_rl.plan.sglang_weights import SGLangWeightLayout, layout_problem, read_hf_config

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.sglang.checksums import SGLangChecksums, ServerLayout
    from megatron_rl.rollout.sglang.engine import SGLangEngine


class SGLangVerifier:
    """One run's post-apply check of SGLang engines (module docstring); ``hf_config``: the model's config.json."""

    def __init__(self, hf_config: dict, *, timeout_s: Optional[float] = None):
        problem = layout_problem(hf_config)
        if problem:
            raise SyncError(f"--update-weight-verify checksum with SGLang: {problem}")
        self.hf_config = hf_config
        self.timeout_s = timeout_s
        self._servers: Optional[list["ServerLayout"]] = None
        self._urls: list[str] = []
        self._checksums: Optional["SGLangChecksums"] = None
        self._hash_s = 0.0

    @classmethod
    def from_config(cls, cfg: "Config") -> Optional["SGLangVerifier"]:
        """The run's verifier: with SGLang engines and --update-weight-verify checksum, else None."""
        if cfg.rollout.rollout_backend != "sglang" or cfg.weight_update_verify != "checksum":
            return None
        return cls(read_hf_config(str(cfg.model.hf_checkpoint or "")))

    def _layouts(self, engine: "SGLangEngine") -> list["ServerLayout"]:
        from megatron_rl.rollout.sglang.checksums import HASHES, ServerLayout, engine_dtype  # lazy: torch

        if self._servers is not None and self._urls == engine.urls:
            return self._servers
        servers = []
        for client in engine.clients:
            info = client.server_info(timeout_s=self.timeout_s)
            device = str(info.get("device") or "cpu").split(":")[0]
            if device not in HASHES:
                raise SyncError(f"--update-weight-verify checksum: SGLang server {client.base_url} runs on device "
                                f"{device!r}; the trainer reproduces SGLang's checksum on {', '.join(HASHES)} only")
            pp, dp = int(info.get("pp_size") or 1), int(info.get("dp_size") or 1)
            if pp != 1 or dp != 1:
                raise SyncError(f"--update-weight-verify checksum: SGLang server {client.base_url} runs pp_size {pp}, "
                                f"dp_size {dp}; the trainer builds the layout of tensor-parallel servers only "
                                "(pp_size 1, dp_size 1)")
            layout = SGLangWeightLayout.from_hf_config(self.hf_config, int(info.get("tp_size") or 1))
            servers.append(ServerLayout(layout, engine_dtype(str(info.get("dtype") or "auto"), self.hf_config),
                                        device))
        self._servers, self._urls = servers, list(engine.urls)
        return servers

    def tap(self, engine: "SGLangEngine") -> Any:
        """Before the export: the ``ExportStream(observe=...)`` callback that hashes this sync's tensors."""
        from megatron_rl.rollout.sglang.checksums import SGLangChecksums  # lazy: torch

        checksums = SGLangChecksums(self._layouts(engine))
        self._checksums, self._hash_s = checksums, 0.0

        def observe(name: str, tensor: Any, bucket: int) -> None:
            t = time.perf_counter()
            checksums.add(name, tensor, bucket)
            self._hash_s += time.perf_counter() - t

        return observe

    def check(self, engine: "SGLangEngine", version: int) -> dict[str, float]:
        """After the engine adopted ``version``: every server's checksums against the trainer's (module docstring);
        on a mismatch the engine refuses to generate until a complete update, and the error is raised."""
        checksums, self._checksums = self._checksums, None
        if checksums is None:
            raise SyncError("--update-weight-verify checksum: check() without tap() for this sync")
        t0 = time.perf_counter()
        try:
            unfinished = checksums.unfinished()
            if unfinished:
                raise SyncError(f"--update-weight-verify checksum: after the sync to version {version} the export "
                                f"left fused tensors incomplete: {', '.join(unfinished[:8])}; SGLang fuses them on "
                                "load, so the trainer cannot say what the engine holds")
            servers = self._layouts(engine)
            replies = engine.map_servers(lambda c: c.weight_checksums(timeout_s=self.timeout_s))
            checked = sum(checksums.compare(server, client.base_url, reply, version)
                          for server, client, reply in zip(servers, engine.clients, replies))
        except (SyncError, EngineError) as exc:
            engine.mark_weights_incomplete(f"--update-weight-verify found the update to version {version} wrong: "
                                           f"{str(exc)[:300]}")
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"--update-weight-verify checksum after the sync to version {version}: {exc}") from exc
        return {"sync/verified_tensors": float(checked), "sync/verify_hash_s": self._hash_s,
                "sync/verify_time_s": time.perf_counter() - t0}
