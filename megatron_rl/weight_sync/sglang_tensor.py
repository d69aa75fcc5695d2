"""The SGLang tensor transport (``--update-weight-transport tensor`` with ``--rollout-backend sglang``):
flattened buckets handed to SGLang engines the run launched on the trainer's own devices.

What travels: per export bucket and per dtype, one flattened bucket in the layout of SGLang's
``FlattenedTensorBucket`` (``srt/weight_sync/tensor_bucket.py``): the tensors of that dtype
concatenated as raw bytes into one new uint8 buffer, plus one record per tensor (name, shape,
dtype, byte range). It is pickled as SGLang's ``MultiprocessingSerializer`` does (torch's
``ForkingPickler``, base64 for JSON), so what crosses HTTP is a handle, not the bytes: a CUDA
IPC handle on GPU (the engine maps the trainer's memory on the device they share), a
shared-memory file name on CPU (``file_system`` sharing; ``protocol.serialize_named_tensors``
says why not file descriptors). ``/update_weights_from_tensor`` takes one entry per engine TP
rank (``serialized_named_tensors[tp_rank]``) with ``load_format="flattened_bucket"``: engine TP
rank ``i`` opens the entry of trainer rank ``trainer_ranks[i]``, which shares its device. One
buffer per dtype because each tensor is read back as ``buffer[start:end].view(dtype)``, which
needs its start aligned to the dtype's size: in a one-dtype buffer every start is.
``load_format=None`` (``(name, tensor)`` pairs, each tensor its own shared copy) is the plain route.

Who sends: every trainer rank iterates the export (``ExportStream``: full HF tensors on every
rank, whole tensors only: one tensor is never split across buckets: docs/peer-failures.md). The ranks of an
engine's ``trainer_ranks`` each flatten and serialise their own copy; the engine's first trainer
rank (its *leader*) gathers the entries over a gloo group of those ranks and POSTs them. Ranks
that share no engine only run the export.

Buffers stay alive until the engine replied (a buffer freed or reused before the engine copied
it corrupts the weights: docs/peer-failures.md): the leader drops its own after the reply; the other
ranks keep bucket ``k``'s until the lockstep after bucket ``k``, which a leader enters only once
it has that bucket's replies.

The records are ``types.SimpleNamespace``: SGLang 0.5.23 unpickles with an allowlist
(``SafeUnpickler``) that admits it, and reads the records by attribute
(``model_runner_components/weight_updater.py``, ``_update_weights_from_flattened_bucket``), so
the trainer needs no SGLang import; a class of ours would be refused ("Blocked unsafe global").
A CUDA tensor names its device by UUID instead of index, as SGLang's ``patch_torch`` does on its
side: the engine may number the shared device differently (its own ``CUDA_VISIBLE_DEVICES``).

One sync, collective over the training world:

1. begin: the driver checks its engine (``SGLangEngine.begin_update``: not released, version
   forward) and each leader opens ``/begin_weight_update`` (SGLang >= 0.5.21 refuses a tensor
   update outside it; the client skips it on older servers); then an agreement (a gloo
   ``all_gather_object`` over every rank), so a refusal anywhere stops every rank before
   anything is sent;
2. per bucket: flatten and serialise, gather, one POST per dtype (the sync's last POST carries
   ``weight_version`` and ``flush_cache``), then a lockstep over every rank (a gloo all_gather of
   the bucket index and a failed flag): the ranks stay within one bucket of each other, after a
   failure on any engine no rank sends more (the export still runs to its end), and exports with
   different bucket counts are caught instead of pairing the wrong collectives;
3. end: each leader closes its session; an agreement naming every failure (engine, URL, log,
   bucket, dtype); the driver adopts the version (only if every engine reports it:
   ``SGLangEngine.adopt_weight_version``) or marks the weights incomplete (the engine refuses to
   generate until a complete update); a last agreement, so every rank raises the same
   ``SyncError`` or none does.

Every wait is bounded: one bucket's requests together by ``timeout_s``, the gloo groups by
``timeout_s`` plus a margin (a rank waits for a leader's bucket at most that long; a dead rank
is named by the timeout, not waited for forever).
"""

from __future__ import annotations

import base64
import datetime
import io
import logging
import time
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.multiprocessing import reductions as mp_reductions

from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.infra.dist import gather_problems
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.client import SGLangClient, normalize_base_url
from megatron_rl.weight_sync.base import ExportStream, WeightSynchronizer, with_last

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine
    from megatron_rl.plan.engines import EnginePlacement, EngineSlot

__all__ = ["FLATTENED_BUCKET", "SGLangTensorSynchronizer", "flatten_tensors", "serialize_for_sglang"]

log = logging.getLogger(__name__)

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for a flattened bucket
LOAD_FORMATS = (FLATTENED_BUCKET, None)
_GROUP_MARGIN_S = 60.0  # gloo groups wait this much longer than one bucket's requests may take
_END = -1  # the lockstep's index once a rank's export has ended
_CUDA_DEVICE_ARG = 6  # position of the device index in torch's reduce_tensor args for a CUDA tensor


# ------------------------------------------------------------------------------------- wire format
def _file_system_sharing() -> None:
    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")


class ShmBuffers:
    """The CPU route's flattened buffers in ``/dev/shm``, kept from one sync to the next.

    Why: a new 200 MB shared buffer per sync spends most of the sync in first-touch page faults
    (docs/benchmarks.md: 0.19 s of 0.30 s flattening, 0.04 s of it the copy itself). Safe because a
    buffer is rewritten only in the next sync, after its engine answered for it in this one (the
    engine copies the bytes into its weights before it replies; the failure to avoid is reuse before
    the reply); a sync that failed drops them all, so nothing an engine might still read is rewritten.
    Keyed by (bucket, dtype); a size change reallocates. GPU buffers are not kept: a second copy of
    the weights in device memory would sit there through the rollout, and IPC buffers are cheap to
    make from the caching allocator. The cost: one copy of the model's bytes stays in shared memory
    on each sending rank for the run."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}

    def get(self, key: tuple[int, str], nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            _file_system_sharing()
            buffer.share_memory_()
            self._buffers[key] = buffer
        return buffer

    def clear(self) -> None:
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)


def flatten_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                    buffer_of: Optional[Callable[[int], torch.Tensor]] = None) -> tuple[torch.Tensor, list]:
    """``(buffer, records)`` in SGLang's ``FlattenedTensorBucket`` layout: every tensor's bytes back to
    back in one new uint8 buffer (on the first tensor's device; in shared memory already on CPU, so
    pickling it does not copy it again), one record per tensor with ``name, shape, dtype, start_idx,
    end_idx, numel`` (byte offsets, ``numel`` = bytes, as SGLang's constructor sets it).

    New memory on purpose: sharing moves a CPU storage into shared memory in place, which must not
    happen to the trainer's parameters, and the engine must read a buffer nobody else writes.
    ``buffer_of(nbytes)``: a shared CPU buffer of that size to write into instead (``ShmBuffers``)."""
    named = [(str(n), torch.as_tensor(t).detach()) for n, t in named_tensors]
    if not named:
        raise ValueError("flatten_tensors: no tensors to flatten")
    device = named[0][1].device
    parts, records, offset = [], [], 0
    for name, tensor in named:
        raw = tensor.to(device).reshape(-1).view(torch.uint8)
        records.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                             end_idx=offset + raw.numel(), numel=raw.numel()))
        parts.append(raw)
        offset += raw.numel()
    if device.type == "cpu" and offset and buffer_of is not None:
        buffer = buffer_of(offset)
    else:
        buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        if device.type == "cpu" and offset:
            _file_system_sharing()
            buffer.share_memory_()
    torch.cat(parts, out=buffer)
    return buffer, records


def _shareable_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` the engine may map (the plain, not flattened, route)."""
    tensor = torch.as_tensor(tensor).detach()
    if tensor.is_cuda:
        return tensor.clone(memory_format=torch.contiguous_format)
    copy = torch.empty(tensor.shape, dtype=tensor.dtype)
    if copy.numel():
        _file_system_sharing()
        copy.share_memory_()
    return copy.copy_(tensor)


def _reduce_tensor(tensor: torch.Tensor):
    """torch's reducer, with a CUDA tensor's device index replaced by the device's UUID (what SGLang's
    patched ``rebuild_cuda_tensor`` maps back to its own index); left alone if already a UUID."""
    rebuild, args = mp_reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_CUDA_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args


class _SGLangPickler(ForkingPickler):
    """The pickler of SGLang's ``MultiprocessingSerializer`` (torch's ``ForkingPickler``: storages travel
    as shared-memory / CUDA IPC handles), with CUDA devices named by UUID."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_tensor


def serialize_for_sglang(obj: Any) -> str:
    """``obj`` as one ``serialized_named_tensors`` entry: ``MultiprocessingSerializer.serialize(obj,
    output_str=True)``'s format (ForkingPickler bytes, base64). The tensors in ``obj`` must stay alive
    until the engine answered."""
    _file_system_sharing()
    buf = io.BytesIO()
    _SGLangPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass(frozen=True)
class _Entry:
    """What one trainer rank sends for one dtype of one bucket (gathered to the leader; the buffers stay)."""

    dtype: str
    names: tuple[str, ...]
    nbytes: int
    payload: str


def _bucket_entries(bucket: list, load_format: Optional[str], shm: Optional[ShmBuffers] = None,
                    index: int = 0) -> tuple[list[_Entry], list[torch.Tensor]]:
    """This rank's entries for ``bucket``, one per dtype in order of first appearance, and the buffers
    they point at (to keep alive until the engine answered). ``shm``: CPU buffers kept across syncs,
    keyed by (``index``, dtype)."""
    by_dtype: dict[torch.dtype, list] = {}
    for name, tensor in bucket:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    entries, buffers = [], []
    for dtype, named in by_dtype.items():
        if load_format == FLATTENED_BUCKET:
            buffer_of = (lambda n, key=(index, str(dtype)): shm.get(key, n)) if shm is not None else None
            buffer, records = flatten_tensors(named, buffer_of)
            obj: Any = {"flattened_tensor": buffer, "metadata": records}
            buffers.append(buffer)
        else:
            obj = [(str(n), _shareable_copy(t)) for n, t in named]
            buffers.extend(t for _, t in obj)
        entries.append(_Entry(str(dtype).replace("torch.", ""), tuple(str(n) for n, _ in named),
                              sum(t.numel() * t.element_size() for _, t in named), serialize_for_sglang(obj)))
    return entries, buffers


def _release(buffers: list) -> None:
    """Drop buffers the engine has answered for; CUDA ones also leave torch's IPC cache."""
    cuda = any(t.is_cuda for t in buffers)
    buffers.clear()
    if cuda:
        torch.cuda.ipc_collect()


def _checked_placement(engines: Optional["EnginePlacement"]) -> "EnginePlacement":
    """Refuse placements this transport cannot feed, naming the fix."""
    if engines is None:
        raise ConfigError("--update-weight-transport tensor with --rollout-backend sglang hands each SGLang engine the "
                          "weights of the trainer ranks on its own devices, so it needs the placement of the engines "
                          "this run launched, and none was given (servers of --rollout-engine-urls are not placed by "
                          "this run): use --update-weight-transport distributed or disk with them")
    if not engines.engines:
        raise ConfigError("--update-weight-transport tensor with --rollout-backend sglang: the placement has no engines")
    apart = [e for e in engines.engines if not e.trainer_ranks]
    if not engines.colocated or apart:
        names = "; ".join(e.describe() for e in (apart or engines.engines))
        raise ConfigError(f"--update-weight-transport tensor hands SGLang engines CUDA IPC / shared-memory handles, which "
                          f"only open on the device and host they were made on, but {names} "
                          "share(s) no trainer devices (not colocated): add --colocate, or use "
                          "--update-weight-transport distributed (or disk) for engines on their own GPUs")
    unstarted = [e.describe() for e in engines.engines if not e.url]
    if unstarted:
        raise ConfigError(f"tensor weight sync: {'; '.join(unstarted)} has no URL yet; the launcher fills the URLs in "
                          "before the synchronizer is built")
    seen: dict[int, int] = {}
    for e in engines.engines:
        for r in e.trainer_ranks:
            if r in seen:
                raise ConfigError(f"tensor weight sync: trainer rank {r} is placed with engines {seen[r]} and {e.index}; "
                                  "a rank shares its device with one engine")
            seen[r] = e.index
    return engines


# ------------------------------------------------------------------------------------ the transport
class SGLangTensorSynchronizer(WeightSynchronizer):
    """``--update-weight-transport tensor`` into colocated SGLang engines (see the module docstring).

    ``engines``: the run's ``EnginePlacement`` (colocated: every engine lists its trainer ranks).
    ``load_format``: ``"flattened_bucket"`` (default) or None (``(name, tensor)`` pairs).
    ``timeout_s``: the bound on one bucket's requests together; the gloo groups wait ``timeout_s`` + 60 s.
    ``connect_retries``: the sending rank's client retries a refused connection this often (backoff).
    """

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0, *,
                 engines: Optional["EnginePlacement"] = None, load_format: Optional[str] = FLATTENED_BUCKET,
                 timeout_s: float = 600.0, connect_retries: int = 3):
        super().__init__(bucket_bytes, check_equal, driver_rank)  # check_equal: SGLangEngine.check_first_update
        if load_format not in LOAD_FORMATS:
            raise ConfigError(f"tensor weight sync: load_format {load_format!r} is not one of {LOAD_FORMATS}")
        self.placement = _checked_placement(engines)
        self.load_format = load_format
        self.timeout_s = float(timeout_s)
        self.connect_retries = int(connect_retries)
        self._connected = False
        self._rank = 0
        self._slot: Optional["EngineSlot"] = None  # the engine sharing this rank's device
        self._leader = False  # whether this rank sends to that engine (its first trainer rank)
        self._layout_checked = False  # the leader read its server's /server_info once
        self._http: Optional[SGLangClient] = None
        self._gather_group: Any = None  # this rank's engine's trainer ranks (when more than one)
        self._agree_group: Any = None  # every rank (when more than one)
        self._shm = ShmBuffers()  # the CPU route's flattened buffers, rewritten sync after sync

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0,
                    engines: Optional["EnginePlacement"] = None) -> "SGLangTensorSynchronizer":
        s = cfg.sync
        return cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank, engines=engines).with_verifier(cfg)

    @property
    def leads(self) -> Optional["EngineSlot"]:
        """The engine this rank sends to (None: it only feeds its copy to another rank, or shares no engine)."""
        return self._slot if self._leader else None

    @property
    def _client(self) -> Optional[SGLangClient]:
        """The leader's client of its engine (made again after ``shutdown``); None on other ranks."""
        if not self._leader:
            return None
        if self._http is None:
            self._http = SGLangClient(self._leader_slot().url, timeout_s=self.timeout_s, connect_retries=self.connect_retries)
        return self._http

    def _leader_slot(self) -> "EngineSlot":
        """The engine a leader sends to (a leader is the first trainer rank of an engine, so it has one)."""
        assert self._leader and self._slot is not None, "only a leader rank talks to its engine"
        return self._slot

    def _leader_client(self) -> SGLangClient:
        client = self._client
        assert client is not None, "only a leader rank has a client of its engine"
        return client

    # ---------------------------------------------------------------- groups
    def _connect(self) -> None:
        """First sync, every rank: the gloo groups (collective: every rank makes every group, in engine order)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        outside = [e.describe() + f" (trainer ranks {list(e.trainer_ranks)})" for e in self.placement.engines
                   if max(e.trainer_ranks) >= world]
        if outside:
            raise ConfigError(f"tensor weight sync: {'; '.join(outside)} lists trainer ranks beyond this run's "
                              f"world of {world}: the placement was made for another world size")
        if world > 1:
            timeout = datetime.timedelta(seconds=self.timeout_s + _GROUP_MARGIN_S)
            self._agree_group = dist.new_group(backend="gloo", timeout=timeout)
            for slot in self.placement.engines:
                if len(slot.trainer_ranks) > 1:
                    group = dist.new_group(ranks=list(slot.trainer_ranks), backend="gloo", timeout=timeout)
                    if rank in slot.trainer_ranks:
                        self._gather_group = group
        self._rank = rank
        self._slot = self.placement.engine_of_rank(rank)
        self._leader = self._slot is not None and self._slot.trainer_ranks[0] == rank
        self._connected = True

    def _agree(self, mine: list[str], step: str) -> list[str]:
        """Every rank's problems, on every rank (rank order)."""
        if self._agree_group is None:
            return list(mine)
        try:
            return gather_problems(mine, group=self._agree_group)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung: say so instead of a gloo trace
            raise SyncError(f"tensor weight sync, {step}: the trainer ranks did not all arrive within "
                            f"{self.timeout_s + _GROUP_MARGIN_S:g} s ({type(exc).__name__}: {exc}); a rank died or is "
                            "stuck: check every rank's log") from exc

    # --------------------------------------------------------------- the sync
    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        exported = ExportStream(backend, self.bucket_bytes)
        if not self._connected:
            self._connect()  # raises alike on every rank, before the export started
        timing = {"sync/serialize_s": 0.0, "sync/gather_s": 0.0, "sync/post_s": 0.0, "sync/requests": 0.0}
        driver: Optional[SGLangEngine] = None  # on the driver, once its engine began the update
        problems: list[str] = []
        if self.on_driver() and engine is not None:
            try:
                sglang = self._driver_engine(engine)
                exported.observe = self.verify_tap(sglang)  # --update-weight-verify checksum: hash as buckets go
                sglang.begin_update(version)  # pauses generation on every server
                driver = sglang
            except (ConfigError, EngineError, SyncError) as exc:
                problems.append(f"the driver's engine: {exc}")
        session = False  # this rank (a leader) has a session open on its engine
        if self._leader and not problems:
            try:
                if not self._layout_checked:
                    self._check_layout(self._leader_client())
                self._leader_client().open_weight_update()
                session = True
            except ConfigError as exc:
                problems.append(str(exc))
            except (EngineError, SyncError) as exc:
                problems.append(f"{self._leader_slot().describe()}: /begin_weight_update failed: {exc}")
        try:
            problems = self._agree(problems, "opening the update")
        except SyncError:
            if driver is not None:
                driver.end_update()
            raise
        if problems:
            if session:
                self._end_quietly()
            if driver is not None:
                driver.end_update()  # nothing was sent: the engine keeps its weights and generates again
            exported.drain()  # every rank takes this branch: the export runs to its end everywhere
            raise SyncError(self._message(version, problems))

        engine_error: Optional[str] = None
        held: list = []  # this rank's buffers of the current bucket, until every leader has its replies
        stopped = False  # some engine failed: the rest of the export is only run, not sent
        try:
            for index, (bucket, last) in enumerate(with_last(exported.iter_buckets()), 1):
                if not stopped:
                    held, engine_error = self._bucket(bucket, index, last, version, engine_error, timing)
                stopped = self._lockstep(index, stopped or engine_error is not None)
                _release(held)  # past the lockstep every leader has this bucket's replies
            self._lockstep(_END, stopped)
            if session:
                session = False
                if engine_error is None:
                    try:
                        self._leader_client().end_weight_update()
                    except (EngineError, SyncError) as exc:
                        engine_error = f"{self._leader_slot().describe()}: /end_weight_update failed: {exc}"
                else:
                    self._end_quietly()
            mine = [engine_error] if engine_error else []
            if not exported.buckets:
                mine.append(f"trainer rank {self._rank}: the backend exported no tensors; nothing was sent")
            problems = self._agree(mine, "sending the buckets")
        except BaseException:
            self._shm.clear()  # an engine may not have answered for them: never rewritten
            if driver is not None:
                driver.mark_weights_incomplete(f"the tensor update to version {version} broke off")
            if session:
                self._end_quietly()
            raise
        finally:
            _release(held)
        outcome: list[str] = []
        if driver is not None:
            if problems:
                driver.mark_weights_incomplete(f"the tensor update to version {version} failed on an engine")
            else:
                try:  # the last request flushed every engine's cache (flush_cache=True)
                    driver.adopt_weight_version(version, how=f"tensor, load_format {self.load_format}", flushed=True)
                    if self.sglang_verifier is not None:
                        timing.update(self.sglang_verifier.check(driver, version))
                except (EngineError, SyncError) as exc:
                    outcome.append(str(exc))
        if not problems:
            problems = self._agree(outcome, "adopting the version")
        if problems:
            self._shm.clear()
            raise SyncError(self._message(version, problems))
        return {**exported.metrics(version, time.perf_counter() - t0), **timing}

    def _lockstep(self, index: int, failed: bool) -> bool:
        """After each bucket (and once at the end, ``_END``), every rank: whether any engine failed so far.
        It keeps the ranks within one bucket of each other (so each wait is bounded by one bucket's
        requests, and the buffers of a bucket are released once it returns), stops every rank's sends
        after a failure, and catches ranks whose exports have different bucket counts."""
        if self._agree_group is None:
            return failed
        mine = torch.tensor([index, int(failed)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(every, mine, group=self._agree_group)
        except Exception as exc:  # noqa: BLE001 - a rank died or hung
            where = "after the last bucket" if index == _END else f"after bucket {index}"
            raise SyncError(f"tensor weight sync, {where}: the trainer ranks did not all arrive within "
                            f"{self.timeout_s + _GROUP_MARGIN_S:g} s ({type(exc).__name__}: {exc}); a rank died or "
                            "is stuck: check every rank's log") from exc
        indices = [int(t[0]) for t in every]
        if len(set(indices)) != 1:
            said = ", ".join(f"rank {r}: {'done' if i == _END else f'bucket {i}'}" for r, i in enumerate(indices))
            raise SyncError(f"tensor weight sync: the trainer ranks' exports have different bucket counts ({said}); "
                            "every rank must export the same full tensors in the same buckets")
        return any(int(t[1]) for t in every)

    def _bucket(self, bucket: list, index: int, last: bool, version: int,
                engine_error: Optional[str], timing: dict) -> tuple[list, Optional[str]]:
        """One bucket on this rank; returns (buffers to keep until the lockstep, the engine's error so far)."""
        slot = self._slot
        if slot is None:
            return [], engine_error  # shares no engine: the export alone
        t = time.perf_counter()
        entries: list[_Entry] = []
        buffers: list = []
        error: Optional[str] = None
        try:
            entries, buffers = _bucket_entries(bucket, self.load_format, self._shm, index)
        except Exception as exc:  # noqa: BLE001 - reported through the leader and the agreement
            error = f"trainer rank {self._rank} could not serialise its copy of bucket {index}: " \
                    f"{type(exc).__name__}: {exc}"
        t1 = time.perf_counter()
        timing["sync/serialize_s"] += t1 - t
        leader = self._leader
        if self._gather_group is not None:
            gathered: Optional[list] = [None] * len(slot.trainer_ranks) if leader else None
            try:
                dist.gather_object((entries, error), gathered, dst=slot.trainer_ranks[0], group=self._gather_group)
            except Exception as exc:  # noqa: BLE001 - a peer died: the agreement names the rest
                raise SyncError(f"tensor weight sync, bucket {index}: gathering the entries of {slot.describe()} "
                                f"from trainer ranks {list(slot.trainer_ranks)} failed ({type(exc).__name__}: {exc})") \
                    from exc
        else:
            gathered = [(entries, error)]
        t2 = time.perf_counter()
        timing["sync/gather_s"] += t2 - t1
        if not leader:
            return buffers, engine_error
        assert gathered is not None, "a leader gathers its peers' entries"
        if engine_error is None:
            engine_error = self._post(gathered, index, last, version, timing)
        timing["sync/post_s"] += time.perf_counter() - t2
        _release(buffers)
        return [], engine_error

    def _post(self, gathered: list, index: int, last: bool, version: int, timing: dict) -> Optional[str]:
        """The leader: one ``/update_weights_from_tensor`` per dtype, one entry per engine TP rank."""
        slot, client = self._leader_slot(), self._leader_client()
        failed = [err for _, err in gathered if err]
        if failed:
            return f"{slot.describe()}: bucket {index} not sent: {'; '.join(failed)}"
        layouts = [[(e.dtype, e.names) for e in entries] for entries, _ in gathered]
        if any(layout != layouts[0] for layout in layouts):
            return (f"{slot.describe()}: bucket {index} not sent: trainer ranks {list(slot.trainer_ranks)} exported "
                    "different tensors (names or dtypes), so the engine's TP ranks would load different weights")
        per_rank = [entries for entries, _ in gathered]
        count = len(per_rank[0])
        deadline = time.monotonic() + self.timeout_s  # one bound for the bucket's requests together
        for i, entry in enumerate(per_rank[0]):
            final = last and i == count - 1
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SyncError(f"no time left of the {self.timeout_s:g} s a bucket may take")
                client.update_weights_from_tensor([entries[i].payload for entries in per_rank],
                                                  load_format=self.load_format, flush_cache=final,
                                                  weight_version=str(version) if final else None,
                                                  timeout_s=left)
            except (EngineError, SyncError) as exc:
                return (f"{slot.describe()}: bucket {index}, {entry.dtype} ({len(entry.names)} tensor(s) from "
                        f"{entry.names[0]}, {entry.nbytes} bytes): {exc}")
            timing["sync/requests"] += 1
        return None

    # -------------------------------------------------------------- helpers
    def _driver_engine(self, engine: "RolloutEngine") -> SGLangEngine:
        if not isinstance(engine, SGLangEngine):
            raise ConfigError(f"--update-weight-transport tensor with SGLang engines got a {type(engine).__name__}; "
                              "the embedded engine takes --update-weight-transport tensor with --rollout-backend "
                              "embedded (the in-process hand-over)")
        want = sorted(normalize_base_url(u) for u in self.placement.urls)
        if sorted(engine.urls) != want:
            raise ConfigError(f"the driver's SGLang engine talks to {engine.urls}, but the placement's engines are "
                              f"{want}: build both from the same launch")
        if self.check_equal:  # SGLang compares inside the servers (/weights_checker): the update to version 0
            engine.check_first_update = True
        return engine

    def _check_layout(self, client: SGLangClient) -> None:
        """The leader's engine takes one entry per TP rank from exactly its trainer ranks: its ``tp_size`` must
        be their count, and SGLang's tensor route asserts ``dp_size`` 1."""
        info = client.server_info(timeout_s=self.timeout_s)
        tp, dp = int(info.get("tp_size") or 1), int(info.get("dp_size") or 1)
        slot = self._leader_slot()
        ranks = list(slot.trainer_ranks)
        if dp != 1:
            raise ConfigError(f"{slot.describe()} runs dp_size {dp}: SGLang's /update_weights_from_tensor "
                              "takes one data-parallel replica per server; launch one engine per replica")
        if tp != len(ranks):
            raise ConfigError(f"{slot.describe()} runs tp_size {tp}, but the placement gives it {len(ranks)} "
                              f"trainer rank(s) {ranks} (one per engine TP rank, each sending its copy): the engine "
                              "was not started with --rollout-num-gpus-per-engine of this run")
        self._layout_checked = True

    def _end_quietly(self) -> None:
        try:
            self._leader_client().end_weight_update()
        except Exception as exc:  # noqa: BLE001 - best effort after a failure; the next sync reopens it
            log.debug("after a failed sync, %s /end_weight_update: %s", self._leader_slot().url, exc)

    @staticmethod
    def _message(version: int, problems: list[str]) -> str:
        return (f"tensor weight sync to version {version} failed ({len(problems)} problem(s)); the engine keeps its "
                "previous version and refuses to generate until a complete update if anything landed: "
                + " | ".join(problems))

    def shutdown(self) -> None:
        """Close this rank's HTTP client (a later sync opens it again; the gloo groups stay, as torch's
        groups go with the process); safe to repeat."""
        http, self._http = self._http, None
        if http is not None:
            http.close()
        self._shm.clear()
