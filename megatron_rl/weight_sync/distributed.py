"""The distributed transport (``--update-weight-transport distributed``): broadcast into SGLang servers.

The trainer's driver rank and every TP rank of every SGLang server of ``--rollout-engine-urls``
form one process group (``update_group.UpdateGroup``: the driver is rank 0, server ``i``'s ranks
start at ``rank_offset`` = 1 + the ranks of the servers before it; gloo on CPU, NCCL when the
trainer and every server are on GPUs). The group is made once, at the first sync, and destroyed
by ``shutdown()`` (registered with ``atexit`` when the group is made, since the loop has no
end-of-run hook for synchronizers yet) and on every error path.

Per sync, every training rank runs the backend's ``export_weights(bucket_bytes)`` (collective:
TP/PP/EP gathers); the driver wraps the buckets in ``/begin_weight_update`` ...
``/end_weight_update`` (SGLang >= 0.5.21 refuses a distributed update outside them; the client
skips them on older servers) and, per bucket: starts ``/update_weights_from_distributed``
(names, dtypes, shapes, group_name; ``weight_version`` and ``flush_cache`` on the last bucket) on
every server in a thread, broadcasts the bucket, then waits for both. Over NCCL the bucket goes as
ONE broadcast (``load_format="flattened_bucket"``: the tensors' bytes back to back in a uint8
tensor, which SGLang 0.5.19-0.5.23 rebuild with ``FlattenedTensorBucket``; the tensors are
ordered by element size, largest first, so every offset is aligned to its dtype, which 0.5.21+
checks) when every server reports version 0.5.19 or later in ``/server_info``: one collective
per bucket instead of one per tensor, for a model's hundreds to thousands of tensors, at the
price of one device-to-device copy into the flat buffer. Otherwise one ``broadcast(src=0)`` per
name in the names' order, as older servers receive them and as gloo gets it: between CPU
processes the flattening copy into fresh host memory costs more than the per-tensor broadcasts
it saves (benchmarks/weight_sync.py: 201 MB in 99 tensors, 0.26 s flattened vs 0.12 s per tensor). The HTTP call
returns only after the server received and loaded the bucket, so the tensors stay referenced
until then (docs/peer-failures.md: buffers freed before the engine copied them). Afterwards every server's ``/model_info`` must report the version before
the engine adopts it, as on the disk route.

A pipeline-parallel trainer sends from every stage (``_sync_stages``): each stage's source rank
(``TrainBackend.export_scope``) makes its own group with the servers and broadcasts its stage's
tensors (``export_weights(stage_only=True)``), stage after stage; the driver still pauses, opens,
ends and adopts, and the training ranks agree after every step, so a failure anywhere is every
rank's error.

Failure rule (the same as the disk route): once a bucket may have landed, a failure leaves the
engine refusing to generate until a complete update (``SGLangEngine.mark_weights_incomplete``);
the group is torn down (its state is unknown: a broadcast may be half done) and made afresh,
under a new name, at the next sync. Every wait polls the HTTP calls and the trainer's end of
the group together with one deadline (``timeout_s``, default the engine's update timeout), so
a server that refuses, dies or never joins is named at once or at the deadline, never a hang.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_rl.errors import ConfigError, SyncError
from megatron_rl.infra import collective_watch
from megatron_rl.infra.daemon_call import DaemonCall
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.client import SGLangClient
from megatron_rl.weight_sync.base import ExportStream, WeightSynchronizer, with_last
from megatron_rl.weight_sync.update_group import BACKENDS, UpdateGroup, master_address_for

if TYPE_CHECKING:
    from megatron_rl.backends.base import ExportScope, TrainBackend
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine

log = logging.getLogger(__name__)

_POLL_S = 0.001  # between looks at the HTTP calls and the broadcasts
_GRACE_S = 5.0  # after the trainer's side failed: how long the HTTP calls get to say which server caused it
# (and what their own HTTP timeouts exceed the deadline by, so the deadline's message, naming every silent
# server, comes first)
_CLOSE_JOIN_S = 10.0  # teardown: the trainer's end of a broken group closes in the background past this
_GROUP_SERIAL = itertools.count(1)  # every group this process makes gets a fresh name (a server may keep a dead one)
FLATTENED_SINCE = (0, 5, 19)  # the oldest SGLang read (0.5.19-0.5.23 wheels) whose distributed receive takes it


def _version_tuple(version: Any) -> Optional[tuple[int, ...]]:
    """``"0.5.23"`` / ``"0.5.23.post1"`` -> ``(0, 5, 23)``; None when the server did not say or it does not parse."""
    parts = []
    for piece in str(version or "").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def flatten_bucket(names: list[str], tensors: list) -> tuple[list[str], list, Any]:
    """``(names, tensors, flat)`` as a flattened bucket carries them: ordered by element size, largest first
    (stable), so each tensor's byte offset is a multiple of its element size (SGLang's receive views each
    slice as its dtype, and 0.5.21+ refuses a misaligned one); ``flat`` is their bytes back to back (uint8)."""
    import torch  # lazy: this module's import stays light for the transport table

    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    names, tensors = [names[i] for i in order], [tensors[i] for i in order]
    return names, tensors, torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])


class DistributedSynchronizer(WeightSynchronizer):
    """``--update-weight-transport distributed``: NCCL/gloo broadcasts into external SGLang servers.

    ``group_backend``: "auto" (NCCL when CUDA is available here and every server reports device
    cuda, else gloo), "gloo" or "nccl". ``master_address``: where the servers reach the trainer's
    rendezvous store (None: 127.0.0.1 for local servers, else this host's address on the route to
    them). ``timeout_s``: the bound on every wait (None: the engine's ``update_timeout_s``).
    ``flattened``: one flattened broadcast per bucket when every server is SGLang 0.5.19+ and: None, the
    group is NCCL; True, on any group (the CPU tests and the real-SGLang check exercise it over gloo);
    False, never (one broadcast per tensor).
    """

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0, *,
                 group_backend: str = "auto", master_address: Optional[str] = None,
                 timeout_s: Optional[float] = None, flattened: Optional[bool] = None):
        super().__init__(bucket_bytes, check_equal, driver_rank)  # check_equal: SGLangEngine.check_first_update
        if group_backend not in ("auto", *BACKENDS):
            raise ConfigError(f"distributed weight sync: group backend {group_backend!r} is not auto, gloo or nccl")
        self.group_backend = group_backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self._group: Optional[UpdateGroup] = None
        self._engine: Optional[SGLangEngine] = None
        self._offsets: list[int] = []  # rank_offset per server
        if flattened not in (None, True, False):
            raise ConfigError(f"distributed weight sync: flattened={flattened!r} is not None, True or False")
        self.flattened = flattened
        self._flattened = False  # this group's servers take load_format="flattened_bucket" (one broadcast per bucket)
        self._atexit_registered = False
        # one sender per pipeline stage (_sync_stages): the plan every rank got from the driver, this rank's
        # group and clients when it sends a stage, and the gloo group of the training ranks' agreements
        self._stage_plan: Optional[dict] = None
        self._stage_own: Optional[UpdateGroup] = None
        self._stage_clients: list[SGLangClient] = []
        self._agree_group: Any = None

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0, engines: Any = None) -> "DistributedSynchronizer":
        s = cfg.sync
        return cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank).with_verifier(cfg)

    @property
    def group_name(self) -> Optional[str]:
        return self._group.group_name if self._group else None

    # ---------------------------------------------------------------- the sync
    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        scope = backend.export_scope() if hasattr(backend, "export_scope") else None
        if scope is not None and scope.stages > 1:
            if self.sglang_verifier is not None:  # validation refuses it; every rank raises alike, before the export
                raise ConfigError("--update-weight-verify checksum with the distributed transport from several "
                                  "pipeline stages: each stage sends its own tensors, which the driver does not see "
                                  "to hash (not built); use --update-weight-transport disk")
            return self._sync_stages(backend, engine, version, scope)
        t0 = time.perf_counter()
        exported = ExportStream(backend, self.bucket_bytes)
        timing = {"sync/connect_s": 0.0, "sync/broadcast_s": 0.0}
        if not (self.on_driver() and engine is not None):
            exported.drain()  # the export is collective: every rank iterates it to the end
            return {**exported.metrics(version, time.perf_counter() - t0), **timing}
        may_have_landed = False
        try:
            engine = self._sglang(engine)
            exported.observe = self.verify_tap(engine)  # --update-weight-verify checksum: hash as the buckets go
            engine.begin_update(version)
        except BaseException:
            exported.drain()
            raise
        try:
            if self._group is None or self._engine is not engine:
                self.shutdown()
                t = time.perf_counter()
                self._connect(engine)
                timing["sync/connect_s"] = time.perf_counter() - t
            self._on_servers(engine, "/begin_weight_update", SGLangClient.open_weight_update)
            may_have_landed = True
            t = time.perf_counter()
            sent = 0
            for bucket, last in with_last(exported.iter_buckets()):
                sent += 1
                self._send_bucket(engine, bucket, sent, str(version) if last else None, last)
            timing["sync/broadcast_s"] = time.perf_counter() - t
            if not sent:
                raise SyncError("distributed weight sync: the backend exported no tensors; nothing was sent")
            self._on_servers(engine, "/end_weight_update", lambda c: c.end_weight_update())
            # the last bucket carried flush_cache: SGLang flushed with it
            engine.adopt_weight_version(version, how=f"distributed, group {self.group_name}", flushed=True)
        except BaseException:
            exported.drain()  # the other ranks are still in the collective export: let them finish it
            if may_have_landed:
                engine.mark_weights_incomplete()
            self._teardown_after_failure(engine)
            raise
        finally:
            engine.end_update()  # begin_update paused the servers: continue them on every path (idempotent)
        metrics = {**exported.metrics(version, time.perf_counter() - t0), **timing}
        if self.sglang_verifier is not None:
            metrics.update(self.sglang_verifier.check(engine, version))
        return metrics

    def _sglang(self, engine: "RolloutEngine | None") -> SGLangEngine:
        if not isinstance(engine, SGLangEngine):
            raise ConfigError(f"--update-weight-transport distributed pushes into SGLang servers, but the engine is "
                              f"{type(engine).__name__}, which has no server process to join a process group: use "
                              "--update-weight-transport tensor or disk with it")
        if self.check_equal:  # SGLang compares inside the servers (/weights_checker): the update to version 0
            engine.check_first_update = True
        return engine

    def _timeout(self, engine: SGLangEngine) -> float:
        return float(self.timeout_s if self.timeout_s is not None else engine.update_timeout_s)

    # ------------------------------------------------------------ the group
    def _server_ranks(self, client: SGLangClient, timeout_s: float) -> tuple[int, str, Optional[tuple[int, ...]]]:
        """(TP ranks, device, SGLang version) of one server from ``/server_info``; refuses layouts SGLang cannot
        join."""
        info = client.server_info(timeout_s=timeout_s)
        tp, dp, pp = (int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
        if dp != 1:
            raise ConfigError(f"SGLang server {client.base_url} runs dp_size {dp}: SGLang's "
                              "/update_weights_from_distributed supports one data-parallel replica per server; "
                              "start one server per replica and list each in --rollout-engine-urls, or use "
                              "--update-weight-transport disk")
        if pp != 1:
            raise ConfigError(f"SGLang server {client.base_url} runs pp_size {pp}: SGLang 0.5.23 gives every "
                              "pipeline stage the group rank rank_offset + tp_rank, so stages would collide; use "
                              "--update-weight-transport disk with pipeline-parallel servers")
        return tp, str(info.get("device") or "cpu"), _version_tuple(info.get("version"))

    def _choose_backend(self, devices: list[str]) -> str:
        if self.group_backend != "auto":
            return self.group_backend
        import torch  # lazy: this module's import stays light for the transport table

        return "nccl" if torch.cuda.is_available() and all(d.startswith("cuda") for d in devices) else "gloo"

    def _server_layout(self, engine: SGLangEngine) -> dict:
        """Read every server's ``/server_info``: its group ranks (offsets), the group's backend and whether it
        takes flattened buckets; what every sender of the group needs (``_sync_stages`` broadcasts it)."""
        timeout = self._timeout(engine)
        clients = engine.clients
        layout = self._wait("reading /server_info of the SGLang servers", lambda: True, engine,
                            [(c, DaemonCall(functools.partial(self._server_ranks, c, timeout), "weight-sync-info"))
                             for c in clients], timeout)
        ranks = [tp for tp, _, _ in layout]
        offsets, world = [], 1
        for tp in ranks:
            offsets.append(world)
            world += tp
        backend = self._choose_backend([d for _, d, _ in layout])
        supported = all(v is not None and v >= FLATTENED_SINCE for _, _, v in layout)
        flattened = supported and (self.flattened or (self.flattened is None and backend == "nccl"))
        return {"urls": list(engine.urls), "ranks": ranks, "offsets": offsets, "world": world, "backend": backend,
                "flattened": flattened, "supported": supported, "timeout": timeout,
                "versions": [v and ".".join(map(str, v)) for _, _, v in layout]}

    def _make_group(self, clients: list[SGLangClient], plan: dict, name: str,
                    address: Optional[str] = None) -> UpdateGroup:
        """Host group ``name`` here (rank 0) and have every server join it at its offset; bounded by the plan's
        timeout, naming a server that refused or never joined; on failure nothing is left behind."""
        timeout, world, backend = plan["timeout"], plan["world"], plan["backend"]
        address = address or self.master_address or master_address_for(plan["urls"])
        group = UpdateGroup(group_name=name, world_size=world, backend=backend, master_address=address,
                            timeout_s=timeout)
        port = group.open_store()
        step = (f"making weights-update group {name} ({backend}, world_size {world}, rendezvous "
                f"{address}:{port})")
        joins = [(c, DaemonCall(functools.partial(
            c.init_weights_update_group, master_address=address, master_port=port, rank_offset=off, world_size=world,
            group_name=name, backend=backend, timeout_s=timeout + _GRACE_S), "weight-sync-join"))
            for c, off in zip(clients, plan["offsets"])]
        local = DaemonCall(group.connect, "weight-sync-group")

        def local_done() -> bool:
            if local.error is not None:
                raise local.error
            return local.done()

        try:
            self._wait(step, local_done, None, joins, timeout)
        except BaseException:
            self._close_in_background(group)
            joined = [c for c, call in joins if call.done() and call.error is None]
            self._destroy_on(joined, name, timeout)
            raise
        log.info("weights-update group %s: %s, world_size %d, rendezvous %s:%d; servers %s; %s", name, backend, world,
                 address, port, ", ".join(f"{u} (ranks {o}..{o + tp - 1}, SGLang {v})" for u, o, tp, v in zip(
                     plan["urls"], plan["offsets"], plan["ranks"], plan["versions"])),
                 "one flattened broadcast per bucket" if plan["flattened"] else "one broadcast per tensor" + (
                     "" if plan["supported"] else f" (flattened buckets need SGLang >= "
                                                  f"{'.'.join(map(str, FLATTENED_SINCE))} on every server)"))
        return group

    def _connect(self, engine: SGLangEngine) -> None:
        plan = self._server_layout(engine)
        group = self._make_group(engine.clients, plan, f"megatron_rl_weights_{os.getpid()}_{next(_GROUP_SERIAL)}")
        self._group, self._engine, self._offsets, self._flattened = group, engine, plan["offsets"], plan["flattened"]
        if not self._atexit_registered:
            atexit.register(self.shutdown)
            self._atexit_registered = True

    def _send_bucket(self, engine: SGLangEngine, bucket: list, index: int, weight_version: Optional[str],
                     last: bool) -> None:
        assert self._group is not None
        self._broadcast_bucket(engine.clients, self._group, self._flattened, self._timeout(engine), bucket, index,
                               weight_version, last)

    def _broadcast_bucket(self, clients: list[SGLangClient], group: UpdateGroup, flattened: bool, timeout: float,
                          bucket: list, index: int, weight_version: Optional[str], last: bool) -> None:
        """One bucket: ``/update_weights_from_distributed`` on every server (in threads) and its broadcast(s)
        from here, waited for together; the tensors stay referenced until every server answered
        (docs/peer-failures.md: buffers freed before the engine copied them)."""
        import torch  # lazy: this module's import stays light for the transport table

        device = torch.device("cuda", torch.cuda.current_device()) if group.backend_name == "nccl" else None
        names = [name for name, _ in bucket]
        tensors = [t.detach().to(device).contiguous() if device is not None else t.detach().contiguous()
                   for _, t in bucket]
        load_format = flat = None
        if flattened:
            names, tensors, flat = flatten_bucket(names, tensors)
            load_format = "flattened_bucket"
        dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
        shapes = [list(t.shape) for t in tensors]
        calls = [(c, DaemonCall(functools.partial(
            c.update_weights_from_distributed, names=names, dtypes=dtypes, shapes=shapes,
            group_name=group.group_name, flush_cache=last, weight_version=weight_version, load_format=load_format,
            timeout_s=timeout + _GRACE_S), "weight-sync-bucket")) for c in clients]
        # flattened: the bytes of every tensor back to back, what SGLang's FlattenedTensorBucket rebuilds
        works = [group.broadcast(flat)] if flat is not None else [group.broadcast(t) for t in tensors]

        def broadcast_done() -> bool:
            if not all(w.is_completed() for w in works):
                return False
            for w in works:
                w.wait()  # completed: returns at once, or raises the broadcast's error
            return True

        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._wait(f"bucket {index} ({len(tensors)} tensors, {nbytes} bytes, {len(works)} broadcast(s)) over group "
                   f"{group.group_name}", broadcast_done, None, calls, timeout)
        # ``tensors``, ``flat`` and ``works`` were referenced until here: every server answered

    # ------------------------------------------------ one sender per pipeline stage
    def _sync_stages(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int,
                     scope: "ExportScope") -> dict[str, float]:
        """Pipeline-parallel trainer: each stage's source rank (``TrainBackend.export_scope``) sends its own
        stage's tensors over a group of its own with the servers, so no tensor travels through the PP group
        to one sender. Collective over every training rank. The stages send one after another (a server
        serves one update at a time, and servers taking two groups' broadcasts in different orders would
        wait on each other); the driver pauses and resumes the servers, opens and ends the session and
        adopts the version, which travels with the last stage's last bucket. Every step ends with an
        agreement over the training ranks, so a failure anywhere stops every rank with the same error."""
        import torch.distributed as dist  # lazy: this module's import stays light for the transport table

        t0 = time.perf_counter()
        timing = {"sync/connect_s": 0.0, "sync/broadcast_s": 0.0}
        rank, driver = dist.get_rank(), self.on_driver()
        began = False
        sglang: Optional[SGLangEngine] = None  # the driver's engine, once it is known to be SGLang
        opening: dict[str, Any] = {"error": None, "plan": None}
        if driver:
            try:
                sglang = self._sglang(engine)
                sglang.begin_update(version)
                began = True
                if self._stage_plan is None or self._engine is not sglang:
                    opening["plan"] = dict(self._server_layout(sglang), serial=f"{os.getpid()}_{next(_GROUP_SERIAL)}",
                                           notes=[c.note for c in sglang.clients])
                self._on_servers(sglang, "/begin_weight_update", SGLangClient.open_weight_update)
            except BaseException as exc:  # noqa: BLE001 - said to every rank below
                opening["error"] = f"{type(exc).__name__}: {exc}"
        try:
            said = self._agree(opening if driver else None, "opening the update")[self.driver_rank]
            if said["error"]:
                self._stage_teardown(sglang if began else None)
                raise SyncError(f"distributed weight sync (one sender per pipeline stage) could not start: "
                                f"{said['error']}")
            if said["plan"] is not None:
                t = time.perf_counter()
                try:
                    self._stage_connect(said["plan"], scope)
                except BaseException:
                    self._stage_teardown(sglang if began else None)  # the servers' sessions end too
                    raise
                self._engine = sglang if driver else None
                timing["sync/connect_s"] = time.perf_counter() - t
            failure: Optional[str] = None
            counts = (0, 0, 0)
            t = time.perf_counter()
            for stage in range(scope.stages):
                result = None
                if scope.stage == stage:
                    stream = ExportStream(backend, self.bucket_bytes, stage_only=True)
                    try:
                        if scope.is_source and failure is None:
                            self._stage_send(stream, stage, stage == scope.stages - 1, version)
                    except BaseException as exc:  # noqa: BLE001 - said to every rank below
                        result = f"pipeline stage {stage} (rank {rank}): {type(exc).__name__}: {exc}"
                    finally:
                        stream.drain()  # the stage's other ranks are in the same export: it runs to its end
                    if scope.is_source:
                        counts = (stream.bytes, stream.tensors, stream.buckets)
                errors = [r for r in self._agree(result, f"pipeline stage {stage}'s buckets") if r]
                if errors and failure is None:
                    failure = "; ".join(errors)
            timing["sync/broadcast_s"] = time.perf_counter() - t
            sent = self._agree(counts, "counting what the stages sent")
            ending = None
            if driver:
                try:
                    assert sglang is not None, "the opening succeeded on the driver (else every rank raised above)"
                    if failure is None:
                        self._on_servers(sglang, "/end_weight_update", lambda c: c.end_weight_update())
                        sglang.adopt_weight_version(version, how=f"distributed, one group per pipeline stage "
                                                                 f"({scope.stages})", flushed=True)
                    else:
                        sglang.mark_weights_incomplete()
                except BaseException as exc:  # noqa: BLE001 - said to every rank below
                    ending = f"{type(exc).__name__}: {exc}"
            ending = self._agree(ending, "ending the update")[self.driver_rank]
            if failure or ending:
                self._stage_teardown(sglang if driver else None)
                raise SyncError("distributed weight sync (one sender per pipeline stage) failed: "
                                + "; ".join(x for x in (failure, ending) if x))
        finally:
            if began:
                assert sglang is not None, "began is set after _sglang returned"
                sglang.end_update()  # begin_update paused the servers: continue them on every path
        totals = [sum(c[i] for c in sent) for i in range(3)]
        return {"sync/time_s": time.perf_counter() - t0, "sync/bytes": float(totals[0]),
                "sync/buckets": float(totals[2]), "sync/weight_version": float(version), **timing}

    def _agree(self, value: Any, what: str) -> list:
        """Every training rank's ``value`` (one all_gather over a gloo group of the training ranks, made once);
        a rank that failed or did not arrive within ``--distributed-timeout-minutes`` is reported as a SyncError."""
        import torch.distributed as dist  # lazy: this module's import stays light for the transport table

        if self._agree_group is None:
            self._agree_group = dist.new_group(backend="gloo", timeout=collective_watch.timeout())
        out: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(out, value, group=self._agree_group)
        except Exception as exc:  # noqa: BLE001 - a peer died or hung
            raise SyncError(f"distributed weight sync, {what}: the training ranks did not all answer within "
                            f"{collective_watch.bound_s():g} s ({collective_watch.FLAG}) or one went away ({type(exc).__name__}: {exc})") from exc
        return out

    def _stage_connect(self, plan: dict, scope: "ExportScope") -> None:
        """Every rank, in stage order: the stage's source makes its group with every server (name ``..._pp<s>``),
        the others wait for it; a failure anywhere undoes every stage's group and stops every rank."""
        import torch.distributed as dist  # lazy: this module's import stays light for the transport table

        self._stage_close()
        self._stage_plan = plan
        for stage in range(scope.stages):
            result = None
            if dist.get_rank() == scope.sources[stage]:
                try:
                    self._stage_clients = [SGLangClient(u, timeout_s=plan["timeout"], note=n)
                                           for u, n in zip(plan["urls"], plan["notes"])]
                    self._stage_own = self._make_group(
                        self._stage_clients, plan, f"megatron_rl_weights_{plan['serial']}_pp{stage}")
                except BaseException as exc:  # noqa: BLE001 - said to every rank below
                    result = f"pipeline stage {stage} (rank {dist.get_rank()}): {type(exc).__name__}: {exc}"
            errors = [r for r in self._agree(result, f"making pipeline stage {stage}'s weights-update group") if r]
            if errors:
                self._stage_close()
                self._stage_plan = None
                raise SyncError("distributed weight sync: " + "; ".join(errors))
        if not self._atexit_registered:
            atexit.register(self.shutdown)
            self._atexit_registered = True

    def _stage_send(self, stream: ExportStream, stage: int, last_stage: bool, version: int) -> None:
        """The stage source: its stage's buckets over its group; the last stage's last bucket carries the
        version and the flush."""
        plan, group = self._stage_plan, self._stage_own
        assert plan is not None and group is not None
        sent = 0
        for bucket, last in with_last(stream.iter_buckets()):
            sent += 1
            final = last_stage and last
            self._broadcast_bucket(self._stage_clients, group, plan["flattened"], plan["timeout"], bucket, sent,
                                   str(version) if final else None, final)
        if not sent:
            raise SyncError(f"pipeline stage {stage} exported no tensors; nothing was sent")

    def _stage_close(self) -> None:
        """This rank's stage group, if it has one: destroyed on every server and closed here (best effort)."""
        group, clients = self._stage_own, self._stage_clients
        self._stage_own, self._stage_clients = None, []
        if group is not None:
            timeout = min(60.0, float(self._stage_plan["timeout"]) if self._stage_plan else 60.0)
            self._destroy_on(clients, group.group_name, timeout)
            self._close_in_background(group)
        for c in clients:
            c.close()

    def _stage_teardown(self, engine: Optional[SGLangEngine]) -> None:
        """After a failed staged sync, every rank: the driver ends the servers' sessions, each source drops its
        group; the next sync makes them afresh (their state is unknown)."""
        if engine is not None:
            for c in engine.clients:
                try:
                    c.end_weight_update()
                except Exception as exc:  # noqa: BLE001 - best effort; the next sync reopens the session
                    log.debug("after a failed sync, %s /end_weight_update: %s", c.base_url, exc)
        self._stage_close()
        self._stage_plan = None

    # ------------------------------------------------------------- waiting
    def _wait(self, step: str, local_done: Callable[[], bool], engine: Optional[SGLangEngine],
              calls: list[tuple[SGLangClient, DaemonCall]], timeout_s: float) -> list:
        """Until the trainer's side (``local_done``) and every server's call finished; a failed call is
        raised at once, naming its server; past ``timeout_s`` the servers that did not answer are named."""
        deadline = time.monotonic() + timeout_s
        local_error: Optional[BaseException] = None
        local_ok = False
        while True:
            if any(call.done() and call.error is not None for _, call in calls):
                break
            if not local_ok:
                try:
                    local_ok = local_done()
                except Exception as exc:  # noqa: BLE001 - the trainer's end failed (a peer went away, a timeout)
                    local_error = exc
                    break
            if local_ok and all(call.done() for _, call in calls):
                return [call.value for _, call in calls]
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        if local_error is not None:  # give the servers' replies a moment to say which of them caused it
            grace = time.monotonic() + min(_GRACE_S, max(0.0, deadline - time.monotonic()) + _GRACE_S)
            while time.monotonic() < grace and not all(call.done() for _, call in calls):
                time.sleep(0.01)
        failed = [(c, call.error) for c, call in calls if call.done() and call.error is not None]
        pending = [c.label for c, call in calls if not call.done()]
        parts = [f"SGLang server {c.base_url} failed: {err}" if c.base_url not in str(err) else str(err)
                 for c, err in failed]
        if pending:
            parts.append(f"no answer within {timeout_s:g} s from SGLang server(s) {', '.join(pending)}")
        if local_error is not None:
            parts.append(f"the trainer's end failed: {type(local_error).__name__}: {local_error}")
        elif not local_ok and not failed:
            parts.append(f"the trainer's end did not finish within {timeout_s:g} s")
        raise SyncError(f"distributed weight sync, {step}: " + "; ".join(parts))

    def _on_servers(self, engine: SGLangEngine, endpoint: str, fn: Callable[[SGLangClient], Any]) -> list:
        calls = [(c, DaemonCall(functools.partial(fn, c), "weight-sync-call")) for c in engine.clients]
        return self._wait(f"{endpoint} on every server", lambda: True, engine, calls, self._timeout(engine))

    # ------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Destroy the group on every server and here (end of run; safe to call again). With one sender per
        pipeline stage every source destroys its own stage's group."""
        self._stage_close()
        self._stage_plan = None
        group, engine = self._group, self._engine
        self._group = self._engine = None
        if group is None:
            return
        assert engine is not None, "_connect sets the group and its engine together"
        timeout = min(60.0, self._timeout(engine))
        self._destroy_on(engine.clients, group.group_name, timeout)
        self._close_in_background(group)

    def _teardown_after_failure(self, engine: SGLangEngine) -> None:
        """After a failed sync: our end first (servers blocked in a broadcast see it close and give up), then
        end the servers' sessions and destroy their ends; all best effort, bounded, and logged."""
        group = self._group
        self._group = self._engine = None
        if group is None:
            return
        self._close_in_background(group)
        timeout = min(30.0, self._timeout(engine))

        def tidy(c: SGLangClient) -> None:
            try:
                c.end_weight_update()
            except Exception as exc:  # noqa: BLE001 - best effort; the next sync reopens the session anyway
                log.debug("after a failed sync, %s /end_weight_update: %s", c.base_url, exc)

        calls = [DaemonCall(functools.partial(tidy, c), "weight-sync-tidy") for c in engine.clients]
        for call in calls:
            call.join(timeout)
        self._destroy_on(engine.clients, group.group_name, timeout)

    def _destroy_on(self, clients: list[SGLangClient], name: str, timeout_s: float) -> None:
        calls = [(c, DaemonCall(functools.partial(c.destroy_weights_update_group, name, timeout_s=timeout_s),
                                "weight-sync-destroy")) for c in clients]
        for c, call in calls:
            if not call.join(timeout_s + 1):
                log.warning("SGLang server %s did not answer /destroy_weights_update_group %s within %g s",
                            c.base_url, name, timeout_s)
            elif call.error is not None:
                log.warning("SGLang server %s: /destroy_weights_update_group %s failed: %s", c.base_url, name,
                            call.error)

    @staticmethod
    def _close_in_background(group: UpdateGroup) -> None:
        """Close our end; a broadcast stuck on a peer that left holds gloo's destructor until its timeout, so
        past a short wait the close finishes on its daemon thread."""
        closing = DaemonCall(group.close, "weight-sync-close")
        if not closing.join(_CLOSE_JOIN_S):
            log.warning("weights-update group %s: the trainer's end is still closing after %g s (a broadcast waits "
                        "on a server that left); it finishes in the background", group.group_name, _CLOSE_JOIN_S)
