"""``SGLangEngine``: the ``RolloutEngine`` over one or more running SGLang servers, given by URL.

Routing: request ``i`` of a ``generate`` call goes to server ``(cursor + i) % len(urls)``
(round robin by request, the cursor advancing across calls); the ``n`` samples of one
prompt stay on one server, so its radix cache serves the shared prompt. Each server
gets one batched ``POST /generate`` per call, all servers in parallel; each sample is
its own batch row with its own ``sampling_seed`` (``protocol.row_seed``, the embedded
engine's formula), so a seeded call is reproducible whatever the routing.

Through an sglang-router (``router_url``; ``from_config`` finds one when a
``--rollout-engine-urls`` address answers ``GET /workers``): generation goes to the router, one
request per sample row (its typed schema takes one ``sampling_params`` map per request, so rows
with their own ``sampling_seed`` cannot share a batch), ``router_concurrency`` in flight; the
router picks the worker (cache-aware by default, so a prompt's rows meet its radix cache). Every
other call (weights, pause / flush / continue, abort, health, versions) goes to the workers the
router lists, which must be reachable from this process at the URLs the router knows them by:
the router forwards none of those endpoints (404 on sglang-router 0.3.2).

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

Sync hygiene (``begin_update`` ... ``end_update``, or the ``weight_update(version)`` context
manager; every route goes through it, so transports do not repeat it): health polls pause,
``/pause_generation`` (``pause_mode``, default "abort": requests in flight come back
finish_reason "abort", new ones wait; skipped on a server without the endpoint) on every
server, the transport's sends, ``/flush_cache`` where the route did not flush already (the
disk route loads with ``flush_cache=False`` and flushes here, retried for ``flush_retry_s``
while SGLang answers 400 because requests are pending; the distributed route flushes with its
last bucket), the ``/model_info`` version check (``adopt_weight_version``), then
``/continue_generation`` and health polls resume, on success and on failure alike. A server
whose continue failed is listed as paused: ``generate`` retries it and refuses while it fails,
so nothing waits on a paused server.

Health (``health.py``): a monitor thread polls every server's ``/health`` each
``health_interval_s`` (0: off), paused while released or updating; ``health_failures``
failures in a row declare a server dead (``dead_servers()``). ``generate`` and the update
paths refuse at once while a server is dead, naming it, what failed and its ``server_notes``
entry (the launcher's "engine 1 on node 0, log ..."), which every error naming a server
carries; a ``generate`` waiting on a server declared dead meanwhile is abandoned with that
error. A dead server that answers again has its weight version read before it is used: one
that restarted (initial weights) leaves the engine refusing to generate until a complete update.

Seeds: SGLang honours ``sampling_seed`` only on a server started with
``--enable-deterministic-inference`` (0.5.23: ``SamplingBatchInfo`` drops the seeds otherwise;
that mode needs a GPU attention backend, fa3 / flashinfer / triton, so never on the CPU route);
elsewhere a seeded call samples freshly each time. The first seeded ``generate`` asks each
server's ``/server_info`` and logs one warning per server that will ignore the seed.

Weight versions: each sample carries the version of its first output token
(``meta_info.weight_versions`` spans, which must cover the output tokens exactly); a row that
spans an update also carries every token's version in ``Sample.token_versions`` (empty when
all its tokens share one, so the usual sample is unchanged) and keeps its spans in
``metadata["weight_version_spans"]``.

``named_weights`` raises: SGLang's ``/get_weights_by_name`` is missing for most model
classes (Qwen2 on CPU among them), and reading back our own files would check nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence
from urllib.parse import urlsplit

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.infra.daemon_call import DaemonCall
from megatron_rl.plan.engines import EnginePlacement
from megatron_rl.plan.sglang_weights import read_hf_config
from megatron_rl.rollout.base import EngineHealth, GenerateRequest, RolloutEngine, SamplingParams, load_tokenizer
from megatron_rl.rollout.routes import RouteLayout
from megatron_rl.rollout.sglang import protocol
from megatron_rl.rollout.sglang.client import SGLangClient, SGLangEngineError, normalize_base_url
from megatron_rl.rollout.sglang.health import HealthMonitor
from megatron_rl.rollout.sglang.host_checkpoint import HostCheckpoint
from megatron_rl.rollout.weight_delta import DeltaBaseMismatch, is_delta_dir, read_delta_dir
from megatron_rl.rollout.weight_dir import ADAPTER_BASE_DIR, VersionedWeightDir

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config

__all__ = ["SGLangEngine"]

log = logging.getLogger(__name__)

#: SGLang's status for a row aborted with "retry later" meaning (see SGLangEngine._unavailable_row)
UNAVAILABLE = 503


class SGLangEngine(RolloutEngine):
    """Generation on external SGLang servers; weights pushed through versioned safetensors dirs, or by
    the distributed transport (a process group with the servers)."""

    def __init__(self, urls: Sequence[str], *, weight_dir: Optional[str] = None, hf_checkpoint: Optional[str] = None,
                 timeout_s: float = 60.0, generate_timeout_s: float = 600.0, update_timeout_s: float = 600.0,
                 connect_retries: int = 3, backoff_s: float = 0.5, keep_versions: int = 2,
                 release_tags: Optional[Sequence[str]] = None, releases_memory: bool = True, tokenizer: Any = None,
                 health_interval_s: float = 10.0, health_timeout_s: float = 30.0, health_failures: int = 3,
                 server_notes: Optional[dict[str, str]] = None, pause_mode: str = "abort",
                 flush_retry_s: float = 5.0, router_url: Optional[str] = None, router_concurrency: int = 64,
                 check_first_update: bool = False, route_layout: Optional[RouteLayout] = None,
                 host_checkpoint: Optional[HostCheckpoint] = None):
        urls = [normalize_base_url(u) for u in urls]
        if not urls:
            raise ConfigError("SGLangEngine needs at least one server URL (http://host:port)")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"SGLangEngine got a server URL twice: {urls}; list each server once")
        notes = {normalize_base_url(u): str(note) for u, note in (server_notes or {}).items()}
        unknown = sorted(set(notes) - set(urls))
        if unknown:
            raise ConfigError(f"SGLangEngine server_notes name {unknown}, which are not among its servers {urls}")
        if pause_mode not in protocol.PAUSE_MODES:
            raise ConfigError(f"SGLangEngine pause_mode {pause_mode!r} is not one of {list(protocol.PAUSE_MODES)}")
        if health_interval_s < 0 or health_timeout_s <= 0 or health_failures < 1:
            raise ConfigError(f"SGLangEngine health monitor: interval {health_interval_s} s (0 = off), timeout "
                              f"{health_timeout_s} s (> 0) and failures {health_failures} (>= 1) out of range")
        self.clients = [SGLangClient(u, timeout_s=timeout_s, connect_retries=connect_retries, backoff_s=backoff_s,
                                     note=notes.get(u)) for u in urls]
        self.weights = VersionedWeightDir(weight_dir, hf_checkpoint=hf_checkpoint, keep_versions=keep_versions) \
            if weight_dir else None  # where update_weights publishes; the disk transport brings its own
        self.tokenizer = tokenizer  # for text prompts and rewards that decode; None: token-id prompts only
        self.hf_checkpoint = hf_checkpoint  # a vision-language one's image-pad token id: image_pad_id
        self._image_pad: Optional[int] = None
        self.generate_timeout_s = generate_timeout_s
        self.update_timeout_s = update_timeout_s
        self.release_tags = protocol.check_tags(release_tags)
        # SGLang on CPU dies on release/resume (CUDA synchronize): there the engine keeps its memory, and
        # release()/resume() say so once instead (engine and trainer share host memory anyway)
        self.releases_memory = releases_memory
        self._said_no_release = False
        # --check-weight-update-equal: the update to version 0 (the trainer's initial weights) is compared inside
        # every server with the server's own load of the checkpoint (begin_update / adopt_weight_version)
        self.check_first_update = check_first_update
        self._checking_update = False
        self._cursor = 0
        self._released_tags: set[str] = set()  # what /release_memory_occupation took and no resume gave back
        self._weights_loaded = True
        self._weight_version = 0
        self._seed_checked: set[str] = set()  # servers whose deterministic-inference setting was looked up
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="sglang") \
            if len(self.clients) > 1 else None
        self.pause_mode = pause_mode
        self.flush_retry_s = float(flush_retry_s)
        self._incomplete_reason = _FAILED_UPDATE  # what generate says while _weights_loaded is False
        self._state_lock = threading.Lock()  # _paused is changed from the pool's threads
        self._update_version: Optional[int] = None  # between begin_update and end_update
        self._update_thread: Optional[int] = None  # the thread that began it
        self._update_ended = threading.Condition()  # notified by end_update
        self._paused: set[str] = set()  # servers this engine paused and has not continued yet
        self._no_pause: set[str] = set()  # servers without /pause_generation (404): nothing to pause there
        self._monitor = HealthMonitor(urls, interval_s=health_interval_s, timeout_s=health_timeout_s,
                                      failures=health_failures, notes=notes)
        self.router = SGLangClient(router_url, timeout_s=timeout_s, connect_retries=connect_retries,
                                   backoff_s=backoff_s, note="sglang-router") if router_url else None
        self._router_pool = ThreadPoolExecutor(max_workers=max(1, int(router_concurrency)),
                                               thread_name_prefix="sglang-router") if router_url else None
        # MoE routing replay R3: ask every /generate for its routes, read them in the model's MoE layers
        self.route_layout = route_layout
        # --lora-sync adapter: the adapter every /generate names (lora_path), loaded on every server; None: the base
        self._lora_name: Optional[str] = None
        # --update-weight-mode delta: the servers' weights kept on their host, patched with each delta and reloaded
        self.host_checkpoint = host_checkpoint
        self.hf_checkpoint = hf_checkpoint
        self._served_dtype: Any = None

    @classmethod
    def from_config(cls, cfg: "Config", placement: Optional[EnginePlacement] = None) -> "SGLangEngine":
        """The loop's engine: the servers this run launched (``placement``, from ``launcher.launch_engines``),
        or the running servers of ``--rollout-engine-urls``; weights under ``--update-weight-disk-dir``,
        config files and tokenizer from ``--hf-checkpoint``."""
        urls = placement.urls if placement is not None else list(cfg.rollout.rollout_engine_urls)
        if not urls:
            raise ConfigError("--rollout-backend sglang needs servers: the engines this run launches, or "
                              "--rollout-engine-urls of running servers")
        router = placement.router_url if placement is not None else None  # the one this run launched
        if placement is None:  # servers the user runs: one of them may be an sglang-router in front of the rest
            urls, router = discover_router(urls)
        hf = cfg.model.hf_checkpoint
        on_cpu = str(cfg.rollout.sglang_args.get("device", "")).lower() == "cpu"
        routes = RouteLayout.of_checkpoint(hf) if hf and cfg.megatron.use_rollout_routing_replay else None
        per_engine = cfg.rollout.sglang_server_concurrency  # slime's cap per engine, in flight through a router
        host = None
        if cfg.sync.update_weight_mode == "delta":  # validation: servers on this host, the disk transport
            assert cfg.sync.update_weight_disk_dir, "validation: delta with SGLang needs --update-weight-disk-dir"
            remote = [u for u in urls if (urlsplit(u).hostname or "") not in LOOPBACK_HOSTS]
            if remote and placement is None:  # workers an sglang-router listed (validation saw the router only)
                raise ConfigError(f"--update-weight-mode delta: the sglang-router at {router} lists workers on other "
                                  f"hosts ({', '.join(remote)}); the host checkpoint the driver patches must be on "
                                  "the servers' host: use servers on this host or --update-weight-mode full")
            host = HostCheckpoint(os.path.join(cfg.sync.update_weight_disk_dir, HOST_CHECKPOINT_DIR), hf_checkpoint=hf,
                                  shard_bytes=cfg.sync.update_weight_buffer_size)
        return cls(urls, weight_dir=cfg.sync.update_weight_disk_dir, hf_checkpoint=hf,
                   router_concurrency=per_engine * len(urls) if per_engine else 64,
                   tokenizer=load_tokenizer(hf) if hf else None, releases_memory=not on_cpu,
                   server_notes=placement.notes() if placement is not None else None, router_url=router,
                   check_first_update=cfg.sync.check_weight_update_equal, route_layout=routes,
                   pause_mode=cfg.rollout.pause_generation_mode, host_checkpoint=host,
                   generate_timeout_s=cfg.rollout.rollout_generate_timeout,
                   update_timeout_s=cfg.rollout.rollout_update_timeout)

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def close(self) -> None:
        self._monitor.close()
        for client in self.clients:
            client.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self.router is not None:
            self.router.close()
            assert self._router_pool is not None, "the router's pool is made together with the router"
            self._router_pool.shutdown(wait=False)

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

    def map_servers(self, fn: Callable[[SGLangClient], Any]) -> list:
        """``fn(client)`` on every server at once, results in server order; the first error is raised (a transport's
        or a check's per-server call, e.g. ``--update-weight-verify``'s ``/weights_checker``)."""
        return self._map(fn, self.clients)

    # ------------------------------------------------------------------ state
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def dead_servers(self) -> list[str]:
        """URLs (in ``urls`` order) of the servers the health monitor declared dead: ``health_failures``
        failed ``/health`` polls in a row and no answer since; [] with the monitor off. A fault-tolerant
        runner restarts them, calls ``poll_health()`` (so they count as alive again) and then runs a
        complete weight sync (a restarted server serves its initial weights)."""
        dead = self._monitor.dead()
        return [c.base_url for c in self.clients if c.base_url in dead]

    def poll_health(self) -> bool:
        """One ``/health`` round on every server now (the monitor's thread runs one every
        ``health_interval_s``); False when skipped because the engine is released or updating."""
        return self._monitor.poll()

    def health(self) -> EngineHealth:
        problems, versions = [], []
        dead = self._monitor.dead()
        for client in self.clients:
            if client.base_url in dead:
                problems.append(f"{client.label} is dead: {dead[client.base_url].describe()}")
                continue
            try:
                if not client.health():
                    problems.append(f"{client.label}: /health answered 503 (starting or shutting down)")
                    continue
                versions.append(protocol.parse_weight_version(client.weight_version(), where=client.label))
            except EngineError as exc:
                problems.append(str(exc))
        if self._released:
            problems.insert(0, "released: call resume()")
        elif not self._weights_loaded:
            problems.insert(0, f"weights incomplete: {self._incomplete_reason}; send a complete update")
        stale = sorted({v for v in versions if v != self._weight_version})
        if stale and not problems:
            problems.append(f"server weight_version(s) {stale} differ from the engine's {self._weight_version}")
        return EngineHealth(ok=not problems, weight_version=self._weight_version, released=self._released,
                            weights_loaded=self._weights_loaded,
                            detail="; ".join(problems) if problems else f"ready ({len(self.clients)} server(s))")

    def _check_servers(self, action: str, *, for_update: bool = False) -> None:
        """Before ``action``: a server the monitor declared dead raises at once (its name, what failed,
        its note); one that answers again after being dead has its weight version read first. A version
        other than the engine's means it restarted: the engine's weights are incomplete (generate refuses;
        an update goes on, as it is what heals it)."""
        dead = self._monitor.dead()
        gone = [c for c in self.clients if c.base_url in dead]
        if gone:
            raise EngineError(f"SGLang engine cannot {action}: " + "; ".join(
                f"{c.label} is dead: {dead[c.base_url].describe()}" for c in gone)
                + ". Check its log; restart it (or leave it out of --rollout-engine-urls), then a complete weight "
                  "sync brings it to the trainer's weights")
        for url in self._monitor.take_recovered():
            client = next(c for c in self.clients if c.base_url == url)
            try:
                got: Optional[int] = protocol.parse_weight_version(client.weight_version(), where=client.label)
            except EngineError as exc:
                got, why = None, f"its weight version could not be read: {exc}"
            else:
                why = f"it reports weight_version {got}, the engine is at {self._weight_version}"
            if got == self._weight_version:
                log.warning("%s answers again after being declared dead, at the engine's weight version %d: "
                            "using it again", client.label, got)
                continue
            self._set_incomplete(f"{client.label} was declared dead and answers again, but {why}: it restarted "
                                 "with other weights")
            if not for_update:
                raise EngineError(f"SGLang engine cannot {action}: {self._incomplete_reason}; a complete weight "
                                  "update (the next sync) brings it back to the trainer's weights")
            log.warning("%s; the update to come brings it back", self._incomplete_reason)

    @property
    def _released(self) -> bool:
        return bool(self._released_tags)

    def release(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/release_memory_occupation`` on every server (tags: the constructor's ``release_tags``; None = all).
        Health polls pause first (a health generation on released memory would run on nothing)."""
        if self._released:
            return
        if not self.releases_memory:
            if not self._said_no_release:
                log.info("SGLang engine keeps its memory while the trainer trains: its servers run on CPU "
                         "(--sglang-device cpu), where SGLang cannot release memory")
                self._said_no_release = True
            return
        chosen = protocol.check_tags(tags) if tags is not None else self.release_tags
        self._monitor.pause("released")
        try:
            self._map(lambda c: c.release_memory_occupation(chosen, timeout_s=self.update_timeout_s), self.clients)
        except BaseException:
            log.warning("SGLang release failed part-way: health polls stay paused (some server may be released) "
                        "until resume()")
            raise
        self._released_tags = set(protocol.MEMORY_TAGS if chosen is None else chosen)

    def resume(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/resume_memory_occupation`` on every server for ``tags`` (None: everything released);
        SGLang keeps the weights' content across release. Health polls resume once nothing is
        released any more."""
        if not self._released:
            self._monitor.resume("released")  # after a release that failed part-way
            return
        wanted = set(protocol.check_tags(tags)) if tags is not None else set(self._released_tags)
        chosen = [t for t in protocol.MEMORY_TAGS if t in wanted & self._released_tags]
        if chosen:
            self._map(lambda c: c.resume_memory_occupation(chosen, timeout_s=self.update_timeout_s), self.clients)
            self._released_tags -= set(chosen)
        if not self._released:
            self._monitor.resume("released")

    def resume_weights(self) -> None:
        """Only the weights' memory (the sync writes into it); the KV cache and CUDA graphs stay
        released until :meth:`resume_kv_cache`, after the sync (``RolloutEngine.resume_weights``)."""
        if "weights" in self._released_tags:
            self.resume(["weights"])

    def resume_kv_cache(self) -> None:
        """Everything still released after :meth:`resume_weights` (KV cache, CUDA graphs)."""
        self.resume()

    def abort(self) -> None:
        """Abort every request in flight on every server; those rows come back with finish_reason "abort"."""
        self._map(lambda c: c.abort_request(abort_all=True), self.clients)

    # ------------------------------------------------------------- generation
    def _wait_for_update_elsewhere(self) -> None:
        """A generate while another thread's weight update is in flight (an async rollout, or an abort's
        retry) waits for it to end, at most ``update_timeout_s``; on the updating thread itself it would
        wait forever (the servers stay paused until that thread ends the update), so it is refused."""
        with self._update_ended:
            if self._update_version is None or self._update_thread == threading.get_ident():
                return
            version = self._update_version
            if not self._update_ended.wait_for(lambda: self._update_version is None, timeout=self.update_timeout_s):
                raise EngineError(f"SGLang engine cannot generate: the weight update to version {version} begun by "
                                  f"another thread has not ended within {self.update_timeout_s:g} s (its transport "
                                  "is stuck or died without end_update())")

    def _check_can_generate(self) -> None:
        self._wait_for_update_elsewhere()
        if self._released:
            raise EngineError("SGLang engine cannot generate: released: call resume()")
        self._check_servers("generate")
        if not self._weights_loaded:
            raise EngineError(f"SGLang engine cannot generate: {self._incomplete_reason}; send a complete "
                              "update_weights first")
        if self._update_version is not None:
            raise EngineError(f"SGLang engine cannot generate: the weight update to version {self._update_version} "
                              "has begun (begin_update) and not ended, so its servers are paused and the request "
                              "would wait; a transport ends it with end_update() (or use engine.weight_update())")
        if self._paused:
            failures = self._continue_paused()
            if failures:
                raise EngineError("SGLang engine cannot generate: server(s) still paused since the last weight "
                                  "update, /continue_generation failed again: " + " | ".join(failures))

    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        self._check_can_generate()
        if not requests:
            return []
        base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        call_id = uuid.uuid4().hex[:12]
        images = request_images(requests)
        prompts = [req.prompt_ids for req in requests] if images is None else \
            [one_pad_per_image(req.prompt_ids, self.image_pad_id()) if req.multimodal_inputs is not None
             else req.prompt_ids for req in requests]
        if self.router is not None:
            return self._samples(requests, sampling, self._generate_via_router(requests, sampling, base_seed,
                                                                               call_id, prompts, images))
        start = self._cursor
        self._cursor = (self._cursor + len(requests)) % len(self.clients)
        per_server: list[list[int]] = [[] for _ in self.clients]
        for i in range(len(requests)):
            per_server[(start + i) % len(self.clients)].append(i)

        def run(server: int) -> dict[tuple[int, int], protocol.GenerateOutput]:
            indices = per_server[server]
            client = self.clients[server]
            if sampling.seed is not None and sampling.temperature > 0:
                self._warn_if_seed_ignored(client)
            rows = [(i, j) for i in indices for j in range(sampling.n)]
            # image_data only in calls with images: a text rollout calls the client as it always did
            with_images: dict[str, Any] = {} if images is None else {"image_data": [images[i] for i, _ in rows]}
            try:
                entries = client.generate(
                    [prompts[i] for i, _ in rows],
                    [protocol.sampling_params_dict(sampling, seed=protocol.row_seed(base_seed, i, j),
                                                  max_new_tokens=requests[i].budget(sampling)) for i, j in rows],
                    rids=[f"mrl-{call_id}-{i}-{j}" for i, j in rows], timeout_s=self.generate_timeout_s,
                    return_routed_experts=self.route_layout is not None, lora_path=self._lora_name,
                    **with_images)
            except SGLangEngineError as exc:
                if exc.status != UNAVAILABLE:
                    raise
                return {row: self._unavailable_row(client, exc) for row in rows}
            return {row: protocol.parse_generate_output(e, where=client.label)
                    for row, e in zip(rows, entries)}

        outputs: dict[tuple[int, int], protocol.GenerateOutput] = {}
        for part in self._run_watched(run, [s for s in range(len(self.clients)) if per_server[s]]):
            outputs.update(part)
        return self._samples(requests, sampling, outputs)

    def image_pad_id(self) -> int:
        """The checkpoint's image-pad token id (``image_token_id`` in its config.json), read once."""
        if self._image_pad is None:
            try:
                config = read_hf_config(self.hf_checkpoint) if self.hf_checkpoint else {}
            except (OSError, ValueError):
                config = {}
            if config.get("image_token_id") is None:
                raise EngineError(f"SGLang engine: prompts with images need the vision-language checkpoint's "
                                  f"image_token_id, but hf_checkpoint {self.hf_checkpoint!r} gives none; pass "
                                  "--hf-checkpoint of the served vision-language model")
            self._image_pad = int(config["image_token_id"])
        return self._image_pad

    def _generate_via_router(self, requests: list[GenerateRequest], sampling: SamplingParams, base_seed: int,
                             call_id: str, prompts: list[list[int]], images: Optional[list[list[str]]] = None
                             ) -> dict[tuple[int, int], protocol.GenerateOutput]:
        """Every row as its own request to the router, ``router_concurrency`` at a time; the first error
        is raised once the rows in flight finished (each has the client's timeout)."""
        router, router_pool = self.router, self._router_pool
        assert router is not None and router_pool is not None, "called only with a router, made with its pool"
        rows = [(i, j) for i in range(len(requests)) for j in range(sampling.n)]
        if sampling.seed is not None and sampling.temperature > 0:
            for client in self.clients:  # the router may send a row to any of them
                self._warn_if_seed_ignored(client)

        def one(row: tuple[int, int]) -> protocol.GenerateOutput:
            i, j = row
            with_images: dict[str, Any] = {} if images is None else {"image_data": images[i]}
            try:
                entry = router.generate_one(
                    prompts[i],
                    protocol.sampling_params_dict(sampling, seed=protocol.row_seed(base_seed, i, j),
                                                  max_new_tokens=requests[i].budget(sampling)),
                    rid=f"mrl-{call_id}-{i}-{j}", timeout_s=self.generate_timeout_s,
                    return_routed_experts=self.route_layout is not None, lora_path=self._lora_name,
                    **with_images)
            except SGLangEngineError as exc:
                if exc.status != UNAVAILABLE:
                    raise
                return self._unavailable_row(router, exc)
            return protocol.parse_generate_output(entry, where=router.label)

        futures = [router_pool.submit(one, row) for row in rows]
        outputs, first_error = {}, None
        for row, future in zip(rows, futures):
            try:
                outputs[row] = future.result()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the rest finished
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return outputs

    def _unavailable_row(self, client: SGLangClient, exc: SGLangEngineError) -> protocol.GenerateOutput:
        """A ``/generate`` answered 503: SGLang aborted a row of it with that status (a decode retraction
        under memory pressure without a KV backup, "Retry later."; a request timeout; a priority
        preemption), which fails the whole non-streamed request. Its rows come back as aborted, and
        the rollout generates their groups again (``--rollout-abort-retries``), as for any abort."""
        message = f"{client.label} answered 503: {exc.server_message or exc}"
        return protocol.GenerateOutput(output_ids=[], logprobs=[], finish_reason="abort",
                                       weight_version=self.weight_version, text=None, finish_message=message)

    def _samples(self, requests: list[GenerateRequest], sampling: SamplingParams,
                 outputs: dict[tuple[int, int], protocol.GenerateOutput]) -> list[Sample]:
        samples = []
        for i, req in enumerate(requests):
            for j in range(sampling.n):
                out = outputs[(i, j)]
                if req.multimodal_inputs is not None and out.prompt_tokens is not None \
                        and out.prompt_tokens != len(req.prompt_ids):
                    raise EngineError(
                        f"/generate row {i}/{j} (group_index {req.group_index}): the server ran a prompt of "
                        f"{out.prompt_tokens} tokens, but with its {req.multimodal_inputs.num_images} image(s) "
                        f"expanded it has {len(req.prompt_ids)}: the server did not put the images in (SGLang warns "
                        "'More image data items provided than corresponding tokens found in the prompt' and "
                        "generates without them). Start SGLang with --mm-preprocess-cache-size-mb > 0 (docs/vlm.md)")
                metadata = dict(req.metadata)
                if len(out.weight_version_spans) > 1:  # an update landed while this row was generating
                    metadata["weight_version_spans"] = [list(span) for span in out.weight_version_spans]
                if out.finish_reason == "abort" and out.finish_message:
                    metadata["finish_message"] = out.finish_message  # why the server aborted it
                routes = None
                if self.route_layout is not None and out.output_ids:  # (an aborted empty row trains on nothing)
                    routes = self.route_layout.read(out.routed_experts, len(req.prompt_ids) + len(out.output_ids),
                                                    where=f"/generate row {i}/{j}")
                samples.append(Sample(
                    group_index=req.group_index, prompt_ids=list(req.prompt_ids), response_ids=out.output_ids,
                    rollout_logprobs=out.logprobs, finish_reason=out.finish_reason, weight_version=out.weight_version,
                    label=req.label, prompt_text=req.prompt_text, response_text=out.text,
                    metadata=metadata, token_versions=out.token_versions(), routed_experts=routes,
                    multimodal_inputs=req.multimodal_inputs))
        return samples

    def _run_watched(self, fn, servers: list[int]) -> list:
        """``fn(server)`` for each server on its own daemon thread, watched: the first error is raised as
        soon as it happens, and a server the health monitor declares dead meanwhile abandons the call at
        once (its thread ends with its own request timeout) instead of waiting up to that timeout."""
        calls = [(s, DaemonCall(functools.partial(fn, s), name="sglang-generate")) for s in servers]
        while True:
            for _, call in calls:
                if call.done() and call.error is not None:
                    raise call.error
            pending = [(s, call) for s, call in calls if not call.done()]
            if not pending:
                return [call.value for _, call in calls]
            dead = self._monitor.dead() if self._monitor.enabled else {}
            hung = [self.clients[s] for s, _ in pending if self.clients[s].base_url in dead]
            if hung:
                raise EngineError("SGLang engine: generate abandoned, " + "; ".join(
                    f"{c.label} was declared dead while its /generate was in flight: "
                    f"{dead[c.base_url].describe()}" for c in hung) + ". Check its log")
            pending[0][1].join(0.05)

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, Any]]:
        raise EngineError("SGLang engine cannot list its weights: SGLang's /get_weights_by_name is missing for most "
                          "model classes (Qwen2 on CPU among them), so --check-weight-update-equal is refused in "
                          "validation with --rollout-backend sglang")

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Disk route: publish ``<weight_dir>/v<version>``, load it on every server, prune old versions."""
        self._check_update(version)
        self._check_servers(f"update weights to version {version}", for_update=True)  # before writing
        if self.weights is None:
            raise ConfigError("SGLangEngine.update_weights needs weight_dir (a directory every server can read, "
                              "e.g. a shared filesystem path): pass weight_dir=... to the constructor")
        path = self.weights.write(named_tensors, version)
        self.update_weights_from_disk(path, version)
        self.weights.prune(version)

    def _check_update(self, version: int) -> None:
        if "weights" in self._released_tags:  # a released KV cache does not stop an update (slime's order)
            raise EngineError("SGLang engine cannot update weights: weights released: call resume_weights() "
                              "or resume() first")
        if version < self._weight_version:
            raise SyncError(f"update_weights(version={version}) is older than the engine's weight_version "
                            f"{self._weight_version}; versions only move forward (check the trainer's step counter)")

    def _set_incomplete(self, reason: str) -> None:
        self._weights_loaded = False
        self._incomplete_reason = reason
        self._checking_update = False

    def _check_weights(self, action: str, version: int) -> None:
        """``/weights_checker`` ``action`` on every server; a failure names the servers and what they said."""
        failures = [f for f in self._map(lambda c: self._checker_call(c, action), self.clients) if f]
        if not failures:
            return
        if action == "compare" and any("check tensor equality failed" in f for f in failures):
            raise SyncError(f"--check-weight-update-equal: the weights SGLang holds after the update to version "
                            f"{version} differ from its own load of the checkpoint ({len(failures)} of "
                            f"{len(self.clients)} server(s)); the trainer's initial weights are not the checkpoint's "
                            "as the engine reads it (a conversion or name-mapping error, or --load of other "
                            "weights than --hf-checkpoint): " + " | ".join(failures))
        raise SyncError(f"--check-weight-update-equal: SGLang's /weights_checker {action} could not run for the "
                        f"update to version {version} on {len(failures)} of {len(self.clients)} server(s), so nothing "
                        "was compared (it needs SGLang >= 0.5.19, and its compare moves tensors to CUDA: GPU servers "
                        "only); drop the flag for these servers: " + " | ".join(failures))

    @staticmethod
    def _checker_call(client: SGLangClient, action: str) -> Optional[str]:
        try:
            client.check_weights(action)
            return None
        except (EngineError, SyncError) as exc:
            message = getattr(exc, "server_message", None) or str(exc)
            lines = message.splitlines()
            more = f" (+{len(lines) - 8} more lines)" if len(lines) > 8 else ""
            return f"{client.label}: " + " / ".join(lines[:8]) + more

    # ------------------------------------------ updates a transport drives server by server
    def begin_update(self, version: int) -> None:
        """Before a transport sends ``version``: the engine is not released, versions only move forward, no
        server is dead; then health polls pause and every server is paused (``/pause_generation`` with
        ``pause_mode``; nothing on a server without it). Pair it with ``end_update()`` in a ``finally``
        (``adopt_weight_version`` and ``mark_weights_incomplete`` end it too), or use ``weight_update``."""
        self._check_update(version)
        self._check_servers(f"update weights to version {version}", for_update=True)
        self._monitor.pause("update")
        with self._update_ended:
            self._update_version, self._update_thread = version, threading.get_ident()
        failures = [f for f in self._map(self._pause_server, self.clients) if f]
        if failures:
            self.end_update()
            raise SyncError(f"weight update to version {version} could not start: /pause_generation failed on "
                            f"{len(failures)} of {len(self.clients)} server(s); nothing was sent: "
                            + " | ".join(failures))
        if self.check_first_update and version == 0:
            # the servers loaded --hf-checkpoint themselves: keep that, scramble the live weights, and after the
            # update compare (adopt_weight_version): every tensor must come back bit for bit through the transport
            try:
                self._check_weights("snapshot", version)
                self._set_incomplete(f"--check-weight-update-equal scrambled the weights before the update to "
                                     f"version {version}")
                self._check_weights("reset_tensors", version)
                self._checking_update = True
            except BaseException:
                self.end_update()
                raise

    def _pause_server(self, client: SGLangClient) -> Optional[str]:
        if client.base_url in self._no_pause:
            return None
        try:
            client.pause_generation(self.pause_mode, timeout_s=self.update_timeout_s)
        except SGLangEngineError as exc:
            if exc.status == 404:  # an SGLang without the endpoint: nothing to pause
                self._no_pause.add(client.base_url)
                log.info("%s has no /pause_generation: weight updates there run without pausing", client.label)
                return None
            return str(exc)
        except EngineError as exc:
            return str(exc)
        with self._state_lock:
            self._paused.add(client.base_url)
        return None

    def end_update(self) -> None:
        """After a transport's update, whatever its outcome; idempotent: ``/continue_generation`` on every
        server ``begin_update`` paused, then health polls resume. A server whose continue fails stays
        listed as paused: ``generate`` retries it and refuses while it fails (never waits on it)."""
        if self._update_version is None and not self._paused:
            return
        try:
            self._continue_paused()
        finally:
            self._monitor.resume("update")
            with self._update_ended:  # generates waiting on other threads go on (the servers run again)
                self._update_version = self._update_thread = None
                self._update_ended.notify_all()

    def _continue_paused(self) -> list[str]:
        def go(client: SGLangClient) -> Optional[str]:
            try:
                client.continue_generation()
            except EngineError as exc:
                return str(exc)
            with self._state_lock:
                self._paused.discard(client.base_url)
            return None

        failures = [f for f in self._map(go, [c for c in self.clients if c.base_url in self._paused]) if f]
        if failures:
            log.warning("SGLang server(s) still paused, /continue_generation failed: %s", " | ".join(failures))
        return failures

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator["SGLangEngine"]:
        """``begin_update(version)`` ... ``end_update()`` around a transport's sends, on every exit path."""
        self.begin_update(version)
        try:
            yield self
        finally:
            self.end_update()

    def mark_weights_incomplete(self, reason: Optional[str] = None) -> None:
        """A transport failed part-way, so the servers' weights may be a mix: ``generate`` refuses until a
        complete update is adopted (the same rule as a failed disk load). Ends the update (``end_update``)."""
        self._set_incomplete(reason or _FAILED_UPDATE)
        self.end_update()

    def _flush(self, client: SGLangClient, version: int) -> Optional[str]:
        """``/flush_cache`` after an update that did not flush; SGLang answers 400 while requests are running or
        waiting, so a 400 is retried (backoff from 50 ms to 0.5 s) for ``flush_retry_s``; None when flushed."""
        started = time.monotonic()
        delay, attempts = 0.05, 0
        while True:
            attempts += 1
            try:
                client.flush_cache()
                return None
            except EngineError as exc:
                status = getattr(exc, "status", None)
                if status != 400 or time.monotonic() + delay > started + self.flush_retry_s:
                    if status != 400:
                        return str(exc)
                    hint = ("it has no /pause_generation, so requests kept running through the update: is "
                            "another client using it?" if client.base_url in self._no_pause else
                            "requests reached it while it was paused for the update: is another client using it?")
                    return (f"{client.label} refused /flush_cache after the update to version {version}: "
                            f"{attempts} attempt(s) over {time.monotonic() - started:.1f} s, the last answered HTTP "
                            f"400 {getattr(exc, 'server_message', None)!r} (requests still running or waiting; "
                            f"{hint}); its new weights are loaded but its cache may hold prefixes computed by the "
                            "old ones")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def adopt_weight_version(self, version: int, *, how: str, flushed: bool = False) -> None:
        """After ``how`` pushed ``version`` to every server: ``/flush_cache`` on each unless the route
        ``flushed`` already, then adopt ``version`` only if each server's ``/model_info`` reports it;
        otherwise ``SyncError`` names the servers and the engine refuses to generate. Ends the update."""
        try:
            # in_place: the rows parked across the update keep the cache the old weights built (SGLang refuses the
            # flush while they run); their later tokens record the new version (docs/async.md)
            if not flushed and self.pause_mode != "in_place":
                failures = [f for f in self._map(lambda c: self._flush(c, version), self.clients) if f]
                if failures:
                    self._set_incomplete(f"the update to version {version} ({how}) left a cache unflushed on "
                                         f"{len(failures)} server(s)")
                    raise SyncError(f"weight update to version {version} ({how}): the cache flush failed on "
                                    f"{len(failures)} of {len(self.clients)} server(s); the engine stays at version "
                                    f"{self._weight_version} and refuses to generate until a complete update: "
                                    + " | ".join(failures))

            def check(client: SGLangClient) -> Optional[str]:
                try:
                    got = client.weight_version()
                except (EngineError, SyncError) as exc:
                    return str(exc)
                if got != str(version):
                    return f"{client.label} reports weight_version {got!r}, not {str(version)!r}"
                return None

            failures = [f for f in self._map(check, self.clients) if f]
            if failures:
                self._set_incomplete(_FAILED_UPDATE)
                raise SyncError(f"weight update to version {version} ({how}) did not land on {len(failures)} of "
                                f"{len(self.clients)} server(s); the engine stays at version {self._weight_version} "
                                "and refuses to generate until a complete update: " + " | ".join(failures))
            if self._checking_update:
                try:
                    self._check_weights("compare", version)
                except SyncError:
                    self._set_incomplete(f"--check-weight-update-equal found the update to version {version} ({how}) "
                                         "different from the checkpoint")
                    raise
                self._checking_update = False
                log.info("--check-weight-update-equal: the update to version %d (%s) equals every server's own load "
                         "of the checkpoint, tensor for tensor (/weights_checker compare)", version, how)
            self._weights_loaded = True
            self._weight_version = version
        finally:
            self.end_update()

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """``POST /update_weights_from_disk`` of the published dir ``path`` on every server (with
        ``weight_version=str(version)``, ``flush_cache=False``: the flush follows, retried), inside
        ``weight_update``; adopt ``version`` only if every server then reports it. A PEFT dir
        (``--lora-sync adapter``) goes to :meth:`_update_adapter_from_disk`."""
        if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            self._update_adapter_from_disk(path, version)
            return
        if is_delta_dir(path):
            self._update_from_delta(path, version)
            return
        with self.weight_update(version):
            self._load_everywhere(lambda client: client.update_weights_from_disk(
                path, weight_version=str(version), flush_cache=False, timeout_s=self.update_timeout_s),
                f"weight update to version {version} from {path}")
            self.adopt_weight_version(version, how=f"disk, {path}")
        if self.host_checkpoint is not None:
            try:  # the servers hold this version whole: the host checkpoint the next delta patches
                self.host_checkpoint.adopt_full(path, version)
            except Exception as exc:  # noqa: BLE001 - the servers took the update; only the next delta is lost
                self.host_checkpoint.forget()
                log.warning("host checkpoint %s could not take version %d (%s): the next sync sends every tensor",
                            self.host_checkpoint.root, version, exc)

    # ------------------------------------------------- --update-weight-mode delta
    def served_dtype(self) -> Any:
        """The torch dtype every server holds the model's floating tensors in (``/server_info`` ``dtype``, ``auto``
        resolved as SGLang does from config.json): what a delta is computed in. Read once."""
        if self._served_dtype is None:
            from megatron_rl.rollout.sglang.checksums import engine_dtype  # lazy: torch

            config = read_hf_config(self.hf_checkpoint or "")
            dtypes = {c.base_url: engine_dtype(str(c.server_info().get("dtype") or "auto"), config)
                      for c in self.clients}
            if len(set(dtypes.values())) != 1:
                raise SyncError(f"--update-weight-mode delta: the SGLang servers hold the model in different dtypes "
                                f"({dtypes}); one delta fits one dtype: start them with the same --dtype")
            self._served_dtype = next(iter(dtypes.values()))
        return self._served_dtype

    def delta_refusal(self, base_version: int) -> str:
        """Why a delta based on ``base_version`` cannot be applied here ("" when it can): the patch is applied to
        the servers' host checkpoint, which must hold exactly that version."""
        if self.host_checkpoint is None:
            return "this SGLang engine keeps no host checkpoint to patch (built without --update-weight-mode delta)"
        if self._released:
            return "the engine is released"
        if not self._weights_loaded:
            return f"the servers' weights are incomplete ({self._incomplete_reason})"
        dead = self.dead_servers()
        if dead:
            return f"server(s) {dead} were declared dead (a restarted one serves its initial weights)"
        try:  # a server that restarted unseen reports another version: it must not get a patch of a few tensors
            versions = {c.base_url: c.weight_version() for c in self.clients}
        except (EngineError, SyncError) as exc:
            return f"a server's version could not be read ({exc})"
        other = {u: v for u, v in versions.items() if v != str(base_version)}
        if other:
            return f"server(s) report weight_version {other}, not {base_version}"
        held = self.host_checkpoint.version
        if held != base_version:
            return (f"the servers' host checkpoint ({self.host_checkpoint.root}) holds "
                    f"{'no version' if held is None else f'version {held}'}, the delta would be based on version "
                    f"{base_version}")
        return ""

    def _update_from_delta(self, path: str, version: int) -> None:
        """A delta version (``delta.json``): patched into the host checkpoint, whose changed tensors, whole, every
        server then loads with ``/update_weights_from_disk`` (SGLang replaces exactly the tensors in the dir it is
        given); no tensor changed: the servers only move to ``version`` (``/update_weight_version``). A delta on
        another base than the version the servers and the host checkpoint hold is refused before anything."""
        header, _ = read_delta_dir(path)
        if header.version != version:
            raise SyncError(f"{path} holds the delta to version {header.version}, loaded as version {version}")
        if not self._weights_loaded or header.base_version != self._weight_version:
            held = f"version {self._weight_version}" + ("" if self._weights_loaded else " (incomplete)")
            raise DeltaBaseMismatch(f"the delta to version {version} is based on version {header.base_version}; the "
                                    f"SGLang servers hold {held}: it needs a full sync")
        if self.host_checkpoint is None:
            raise SyncError(f"{path} is a delta version, which SGLang cannot load itself; this engine keeps no host "
                            "checkpoint to patch (--update-weight-mode delta builds one)")
        self._check_update(version)
        self._check_servers(f"update weights to version {version}", for_update=True)  # before patching
        patch_dir, changed = self.host_checkpoint.patch(path)  # refuses another base before writing anything
        with self.weight_update(version):
            if patch_dir:
                self._load_everywhere(lambda client: client.update_weights_from_disk(
                    patch_dir, weight_version=str(version), flush_cache=False, timeout_s=self.update_timeout_s),
                    f"weight update to version {version} from {patch_dir} (the {len(changed)} tensor(s) the delta "
                    "changed)")
            else:
                self._load_everywhere(lambda client: client.update_weight_version(str(version),
                                                                                  abort_all_requests=False),
                                      f"weight version {version} (the delta changed no tensor)")
            self.adopt_weight_version(version, how=f"delta, {patch_dir or 'no tensor changed'}",
                                      flushed=not patch_dir)

    def _load_everywhere(self, load, what: str) -> None:
        """``load(client)`` on every server at once; any failure marks the servers' weights a mix
        (``_FAILED_UPDATE``) and raises ``SyncError`` naming ``what``, the servers and their words."""
        def attempt(client: SGLangClient) -> Optional[str]:
            try:
                load(client)
            except (EngineError, SyncError) as exc:
                return str(exc)
            return None

        failures = [f for f in self._map(attempt, self.clients) if f]
        if failures:
            self._set_incomplete(_FAILED_UPDATE)
            raise SyncError(f"{what} failed on {len(failures)} of {len(self.clients)} server(s); the engine stays at "
                            f"version {self._weight_version}: " + " | ".join(failures))


    def _update_adapter_from_disk(self, path: str, version: int) -> None:
        """``--lora-sync adapter`` over the disk transport: the PEFT dir ``path`` served as the adapter
        ``mrl-lora-v<version>`` on every server (``/load_lora_adapter``), which every later ``/generate`` names;
        the previous version's adapter is unloaded after. The base weights in its ``base`` subdir (the first
        sync carries them; SGLang's LoRA loader reads every file of the adapter's own dir) are loaded first with
        ``/update_weights_from_disk``; an adapter-only version sets the servers' ``weight_version`` with
        ``/update_weight_version``. A name a server still holds (it outlived an earlier run of this trainer)
        is unloaded and loaded again. Adopted, as every route, only when every server reports ``version``; a
        server that failed leaves the engine refusing to generate (``_FAILED_UPDATE``)."""
        name = f"{LORA_NAME_PREFIX}{version}"
        base_dir = os.path.join(path, ADAPTER_BASE_DIR)
        with_base = os.path.isdir(base_dir)
        with self.weight_update(version):
            def load(client: SGLangClient) -> None:
                if with_base:
                    client.update_weights_from_disk(base_dir, weight_version=str(version), flush_cache=False,
                                                    timeout_s=self.update_timeout_s)
                try:
                    client.load_lora_adapter(name, path, timeout_s=self.update_timeout_s)
                except SyncError as exc:
                    if "already loaded" not in str(getattr(exc, "server_message", "")):
                        raise
                    client.unload_lora_adapter(name, timeout_s=self.update_timeout_s)
                    client.load_lora_adapter(name, path, timeout_s=self.update_timeout_s)
                if not with_base:  # the paused server has nothing in flight to abort
                    client.update_weight_version(str(version), abort_all_requests=False)

            self._load_everywhere(load, f"LoRA adapter update to version {version} from {path}")
            previous, self._lora_name = self._lora_name, name
            self.adopt_weight_version(version, how=f"LoRA adapter {name}, {path}")
        if previous is not None and previous != name:
            def unload(client: SGLangClient) -> Optional[str]:
                try:
                    client.unload_lora_adapter(previous, timeout_s=self.update_timeout_s)
                except (EngineError, SyncError) as exc:  # e.g. a server restarted since: it never had it
                    return str(exc)
                return None

            for failure in (f for f in self._map(unload, self.clients) if f):
                log.warning("the previous LoRA adapter stays loaded (requests no longer name it): %s", failure)


_FAILED_UPDATE = "the last weight update failed on some server, so the servers' weights differ"
# the adapter of weight version V on the servers (--lora-sync adapter); requests name it in lora_path
LORA_NAME_PREFIX = "mrl-lora-v"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")  # servers on the driver's host (urlsplit's hostname)
HOST_CHECKPOINT_DIR = "host_checkpoint"  # under --update-weight-disk-dir: the servers' weights patched by deltas
ADAPTER_CONFIG = "adapter_config.json"  # models.peft_adapter's (imported here without torch)


def one_pad_per_image(prompt_ids: list[int], pad: int) -> list[int]:
    """``prompt_ids`` with each run of image-pad tokens cut to one: what SGLang expands itself. Why: SGLang 0.5.23's
    Qwen-VL processor builds the prompt from token ids (``build_input_ids``, no detokenizing) only when each image
    has one pad token; given the expanded runs it decodes the ids to text and tokenizes that again, which finds
    the images only when the tokenizer's decode gives the image slot's text back exactly."""
    return [t for k, t in enumerate(prompt_ids) if t != pad or k == 0 or prompt_ids[k - 1] != pad]


def request_images(requests: list[GenerateRequest]) -> Optional[list[list[str]]]:
    """Each request's images as SGLang's ``image_data`` items (``data:`` URLs of their encoded bytes; ``[]`` for a
    request without), or None when no request has any (a text rollout sends no ``image_data``)."""
    if all(req.multimodal_inputs is None for req in requests):
        return None
    out = []
    for req in requests:
        try:
            out.append(req.multimodal_inputs.data_urls() if req.multimodal_inputs is not None else [])
        except ValueError as exc:
            raise EngineError(f"prompt of group_index {req.group_index}: {exc}") from None
    return out


def discover_router(urls: Sequence[str], *, timeout_s: float = 10.0) -> tuple[list[str], Optional[str]]:
    """``(worker URLs, router URL or None)`` for the servers of ``--rollout-engine-urls``: an address
    that answers ``GET /workers`` is an sglang-router, replaced by the workers it lists (it must be
    the only address given: the engine talks to one router, or to the servers themselves)."""
    found = {}
    for url in urls:
        with SGLangClient(url, timeout_s=timeout_s, connect_retries=1) as client:
            workers = client.router_workers()
        if workers is not None:
            found[url] = workers
    if not found:
        return list(urls), None
    if len(urls) > 1:
        raise ConfigError(f"--rollout-engine-urls {' '.join(urls)}: {', '.join(found)} is an sglang-router; give "
                          "the router alone (its workers are found through it) or the servers alone")
    router, workers = next(iter(found.items()))
    if not workers:
        raise EngineError(f"sglang-router {router} lists no workers (GET /workers): start its SGLang servers, or "
                          "register them with the router, before this run")
    log.info("sglang-router %s: generation through it; weights, pauses and health go to its %d worker(s) %s",
             router, len(workers), workers)
    return workers, router
