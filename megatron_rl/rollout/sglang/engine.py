"""``SGLangEngine``: the ``RolloutEngine`` over one or more running SGLang servers, given by URL.

Routing: request ``i`` of a ``generate`` call goes to server ``(cursor + i) % len(urls)``
(round robin by request, the cursor advancing across calls); the ``n`` samples of one
prompt stay on one server, so its radix cache serves the shared prompt. Each server
gets one batched ``POST /generate`` per call, all servers in parallel; each sample is
its own batch row with its own ``sampling_seed`` (``protocol.row_seed``, the embedded
engine's formula), so a seeded call is reproducible whatever the routing.

Weights, two routes. The distributed transport (``weight_sync.distributed``) drives the
servers itself and uses ``begin_update`` / ``mark_weights_incomplete`` / ``adopt_weight_version``
for the engine's state. The disk route: ``update_weights`` writes the tensors as HF safetensors
into ``<weight_dir>/v<version>`` (``rollout.weight_dir.VersionedWeightDir``: written under
a hidden temporary name and renamed into place complete, so a half-written version never
loads; older versions pruned beyond ``keep_versions``), then loads it with
``update_weights_from_disk(path, version)``, which the disk transport
(``weight_sync.disk``) calls directly after writing the dir itself:
``POST /update_weights_from_disk`` with
``weight_version=str(version)`` to every server, then checks each server's
``/model_info`` reports that version. The engine adopts ``version`` only when every
server has it; otherwise ``SyncError`` names the servers that failed, and the engine
keeps its old version (servers that did load keep the new weights: the next update
overwrites them all). The disk route needs no ``/begin_weight_update`` (SGLang exempts it).

Seeds: SGLang honours ``sampling_seed`` only on a server started with
``--enable-deterministic-inference`` (0.5.23: ``SamplingBatchInfo`` drops the seeds otherwise;
that mode needs a GPU attention backend, fa3 / flashinfer / triton, so never on the CPU route);
elsewhere a seeded call samples freshly each time. The first seeded ``generate`` asks each
server's ``/server_info`` and logs one warning per server that will ignore the seed.

Weight versions: each sample carries the version of its first output token
(``meta_info.weight_versions`` spans); a row that spans an update keeps its spans in
``metadata["weight_version_spans"]``.

``named_weights`` raises: SGLang's ``/get_weights_by_name`` is missing for most model
classes (Qwen2 on CPU among them), and reading back our own files would check nothing.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout.base import EngineHealth, GenerateRequest, RolloutEngine, SamplingParams, load_tokenizer
from megatron_rl.rollout.sglang import protocol
from megatron_rl.rollout.sglang.client import SGLangClient
from megatron_rl.rollout.weight_dir import VersionedWeightDir

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config

__all__ = ["SGLangEngine"]

log = logging.getLogger(__name__)


class SGLangEngine(RolloutEngine):
    """Generation on external SGLang servers; weights pushed through versioned safetensors dirs, or by
    the distributed transport (a process group with the servers)."""

    def __init__(self, urls: Sequence[str], *, weight_dir: Optional[str] = None, hf_checkpoint: Optional[str] = None,
                 timeout_s: float = 60.0, generate_timeout_s: float = 600.0, update_timeout_s: float = 600.0,
                 connect_retries: int = 3, backoff_s: float = 0.5, keep_versions: int = 2,
                 release_tags: Optional[Sequence[str]] = None, tokenizer: Any = None):
        urls = [str(u) for u in urls]
        if not urls:
            raise ConfigError("SGLangEngine needs at least one server URL (http://host:port)")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"SGLangEngine got a server URL twice: {urls}; list each server once")
        self.clients = [SGLangClient(u, timeout_s=timeout_s, connect_retries=connect_retries, backoff_s=backoff_s)
                        for u in urls]
        self.weights = VersionedWeightDir(weight_dir, hf_checkpoint=hf_checkpoint, keep_versions=keep_versions) \
            if weight_dir else None  # where update_weights publishes; the disk transport brings its own
        self.tokenizer = tokenizer  # for text prompts and rewards that decode; None: token-id prompts only
        self.generate_timeout_s = generate_timeout_s
        self.update_timeout_s = update_timeout_s
        self.release_tags = protocol.check_tags(release_tags)
        self._cursor = 0
        self._released = False
        self._weights_loaded = True
        self._weight_version = 0
        self._seed_checked: set[str] = set()  # servers whose deterministic-inference setting was looked up
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="sglang") \
            if len(self.clients) > 1 else None

    @classmethod
    def from_config(cls, cfg: "Config") -> "SGLangEngine":
        """The loop's engine: the running servers of ``--rollout-engine-urls`` (validation refuses sglang
        without them: the launcher is not built), weights under ``--update-weight-disk-dir``, config files
        and tokenizer from ``--hf-checkpoint``."""
        urls = list(cfg.rollout.rollout_engine_urls)
        if not urls:
            raise ConfigError("--rollout-backend sglang without --rollout-engine-urls: launching SGLang engines is "
                              "not built yet (issue 14); give --rollout-engine-urls of running servers")
        hf = cfg.model.hf_checkpoint
        return cls(urls, weight_dir=cfg.sync.update_weight_disk_dir, hf_checkpoint=hf,
                   tokenizer=load_tokenizer(hf) if hf else None)

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def _warn_if_seed_ignored(self, client: SGLangClient) -> None:
        """Once per server: warn when it will ignore ``sampling_seed`` (no deterministic inference)."""
        if client.base_url in self._seed_checked:
            return
        self._seed_checked.add(client.base_url)
        try:
            deterministic = client.server_info().get("enable_deterministic_inference")
        except EngineError as exc:
            log.debug("could not read %s /server_info to check the sampling seed: %s", client.base_url, exc)
            return
        if deterministic is False:
            log.warning("SGLang server %s runs without --enable-deterministic-inference, so it ignores "
                        "sampling_seed: seeded rollouts (--rollout-seed) are not reproducible there. Start it with "
                        "--enable-deterministic-inference (needs a GPU attention backend: fa3, flashinfer or "
                        "triton) if they must be", client.base_url)

    def _map(self, fn, items: list) -> list:
        """Run ``fn`` on each item, on all servers at once; the first error (in item order) is raised."""
        if self._pool is None or len(items) <= 1:
            return [fn(x) for x in items]
        futures = [self._pool.submit(fn, x) for x in items]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below after every call finished
                results.append(None)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    # ------------------------------------------------------------------ state
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def health(self) -> EngineHealth:
        problems, versions = [], []
        for client in self.clients:
            try:
                if not client.health():
                    problems.append(f"{client.base_url}: /health answered 503 (starting or shutting down)")
                    continue
                versions.append(protocol.parse_weight_version(client.weight_version(), where=client.base_url))
            except EngineError as exc:
                problems.append(str(exc))
        if self._released:
            problems.insert(0, "released: call resume()")
        elif not self._weights_loaded:
            problems.insert(0, "weights incomplete: the last update failed on some server; send a complete update")
        stale = sorted({v for v in versions if v != self._weight_version})
        if stale and not problems:
            problems.append(f"server weight_version(s) {stale} differ from the engine's {self._weight_version}")
        return EngineHealth(ok=not problems, weight_version=self._weight_version, released=self._released,
                            weights_loaded=self._weights_loaded,
                            detail="; ".join(problems) if problems else f"ready ({len(self.clients)} server(s))")

    def release(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/release_memory_occupation`` on every server (tags: the constructor's ``release_tags``; None = all)."""
        if self._released:
            return
        chosen = protocol.check_tags(tags) if tags is not None else self.release_tags
        self._map(lambda c: c.release_memory_occupation(chosen, timeout_s=self.update_timeout_s), self.clients)
        self._released = True

    def resume(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/resume_memory_occupation`` on every server; SGLang keeps the weights' content across release."""
        if not self._released:
            return
        chosen = protocol.check_tags(tags) if tags is not None else self.release_tags
        self._map(lambda c: c.resume_memory_occupation(chosen, timeout_s=self.update_timeout_s), self.clients)
        self._released = False

    def abort(self) -> None:
        """Abort every request in flight on every server; those rows come back with finish_reason "abort"."""
        self._map(lambda c: c.abort_request(abort_all=True), self.clients)

    # ------------------------------------------------------------- generation
    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        if self._released:
            raise EngineError("SGLang engine cannot generate: released: call resume()")
        if not self._weights_loaded:
            raise EngineError("SGLang engine cannot generate: the last weight update failed on some server, so the "
                              "servers' weights differ; send a complete update_weights first")
        if not requests:
            return []
        base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        call_id = uuid.uuid4().hex[:12]
        start = self._cursor
        self._cursor = (self._cursor + len(requests)) % len(self.clients)
        per_server: list[list[int]] = [[] for _ in self.clients]
        for i in range(len(requests)):
            per_server[(start + i) % len(self.clients)].append(i)

        def run(server: int) -> dict[tuple[int, int], protocol.GenerateOutput]:
            indices = per_server[server]
            if not indices:
                return {}
            client = self.clients[server]
            if sampling.seed is not None and sampling.temperature > 0:
                self._warn_if_seed_ignored(client)
            rows = [(i, j) for i in indices for j in range(sampling.n)]
            entries = client.generate(
                [requests[i].prompt_ids for i, _ in rows],
                [protocol.sampling_params_dict(sampling, seed=protocol.row_seed(base_seed, i, j)) for i, j in rows],
                rids=[f"mrl-{call_id}-{i}-{j}" for i, j in rows], timeout_s=self.generate_timeout_s)
            return {row: protocol.parse_generate_output(e, where=f"SGLang server {client.base_url}")
                    for row, e in zip(rows, entries)}

        outputs: dict[tuple[int, int], protocol.GenerateOutput] = {}
        for part in self._map(run, list(range(len(self.clients)))):
            outputs.update(part)
        samples = []
        for i, req in enumerate(requests):
            for j in range(sampling.n):
                out = outputs[(i, j)]
                metadata = dict(req.metadata)
                if len(out.weight_version_spans) > 1:  # an update landed while this row was generating
                    metadata["weight_version_spans"] = [list(span) for span in out.weight_version_spans]
                samples.append(Sample(
                    group_index=req.group_index, prompt_ids=list(req.prompt_ids), response_ids=out.output_ids,
                    rollout_logprobs=out.logprobs, finish_reason=out.finish_reason, weight_version=out.weight_version,
                    label=req.label, prompt_text=req.prompt_text, response_text=out.text,
                    metadata=metadata))
        return samples

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, Any]]:
        raise EngineError("SGLang engine cannot list its weights: SGLang's /get_weights_by_name is missing for most "
                          "model classes (Qwen2 on CPU among them), so --check-weight-update-equal is refused in "
                          "validation with --rollout-backend sglang")

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Disk route: publish ``<weight_dir>/v<version>``, load it on every server, prune old versions."""
        self._check_update(version)
        if self.weights is None:
            raise ConfigError("SGLangEngine.update_weights needs weight_dir (a directory every server can read, "
                              "e.g. a shared filesystem path): pass weight_dir=... to the constructor")
        path = self.weights.write(named_tensors, version)
        self.update_weights_from_disk(path, version)
        self.weights.prune(version)

    def _check_update(self, version: int) -> None:
        if self._released:
            raise EngineError("SGLang engine cannot update weights: released: call resume() first")
        if version < self._weight_version:
            raise SyncError(f"update_weights(version={version}) is older than the engine's weight_version "
                            f"{self._weight_version}; versions only move forward (check the trainer's step counter)")

    # ------------------------------------------ updates a transport drives server by server
    def begin_update(self, version: int) -> None:
        """Before a transport sends ``version``: the engine is not released and versions only move forward."""
        self._check_update(version)

    def mark_weights_incomplete(self) -> None:
        """A transport failed part-way, so the servers' weights may be a mix: ``generate`` refuses until a
        complete update is adopted (the same rule as a failed disk load)."""
        self._weights_loaded = False

    def adopt_weight_version(self, version: int, *, how: str) -> None:
        """After ``how`` pushed ``version`` to every server: adopt it only if each server's ``/model_info``
        reports it; otherwise ``SyncError`` names the servers and the engine refuses to generate."""

        def check(client: SGLangClient) -> Optional[str]:
            try:
                got = client.weight_version()
            except (EngineError, SyncError) as exc:
                return str(exc)
            if got != str(version):
                return f"SGLang server {client.base_url} reports weight_version {got!r}, not {str(version)!r}"
            return None

        failures = [f for f in self._map(check, self.clients) if f]
        if failures:
            self._weights_loaded = False
            raise SyncError(f"weight update to version {version} ({how}) did not land on {len(failures)} of "
                            f"{len(self.clients)} server(s); the engine stays at version {self._weight_version} and "
                            "refuses to generate until a complete update: " + " | ".join(failures))
        self._weights_loaded = True
        self._weight_version = version

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """``POST /update_weights_from_disk`` of the published dir ``path`` on every server (with
        ``weight_version=str(version)``), then check each reports ``version``; adopt it only if all do."""
        self._check_update(version)

        def load(client: SGLangClient) -> Optional[str]:
            try:
                client.update_weights_from_disk(path, weight_version=str(version), timeout_s=self.update_timeout_s)
                got = client.weight_version()
            except (EngineError, SyncError) as exc:
                return str(exc)
            if got != str(version):
                return (f"SGLang server {client.base_url} loaded {path} but /model_info reports weight_version "
                        f"{got!r}, not {str(version)!r}")
            return None

        failures = [f for f in self._map(load, self.clients) if f]
        if failures:
            self._weights_loaded = False
            raise SyncError(f"weight update to version {version} from {path} failed on {len(failures)} of "
                            f"{len(self.clients)} server(s); the engine stays at version {self._weight_version}: "
                            + " | ".join(failures))
        self._weights_loaded = True
        self._weight_version = version
