"""The WeightSynchronizer interface and the ``--update-weight-transport`` tables that pick a transport.

Two tables, because what a transport name means can depend on the engine: ``TRANSPORTS`` maps a
name to its synchronizer, and ``ENGINE_TRANSPORTS`` overrides a row for one ``--rollout-backend``
(``tensor`` is the in-process hand-over with the embedded engine, and flattened buckets over
``/update_weights_from_tensor`` with SGLang engines the run launched colocated).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Type, Union

from megatron_rl.errors import SyncError
from megatron_rl.infra.registry import Refused, Registry

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine
    from megatron_rl.plan.engines import EnginePlacement


class WeightSynchronizer(abc.ABC):
    """Moves the backend's weights into the rollout engine; algorithm code never branches on how.

    Every transport takes the same arguments: ``bucket_bytes`` (``--update-weight-buffer-size``),
    ``check_equal`` (``--check-weight-update-equal``) and ``driver_rank`` (the rank that holds the
    engine). ``from_config`` maps the flags; a transport that needs more flags overrides it.
    ``engines`` is where the run launched its SGLang engines (None: it launched none); only the
    transports that address engines rank by rank use it.
    """

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0):
        self.bucket_bytes = bucket_bytes
        self.check_equal = check_equal
        self.driver_rank = driver_rank

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0,
                    engines: Optional["EnginePlacement"] = None) -> "WeightSynchronizer":
        s = cfg.sync
        return cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank)

    def on_driver(self) -> bool:
        """Whether this rank holds the engine (the driver): one process, or rank ``driver_rank``."""
        import torch.distributed as dist  # lazy: the table below loads without torch

        return not dist.is_initialized() or dist.get_rank() == self.driver_rank

    @abc.abstractmethod
    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        """Collective: push the backend's current weights as ``version``; return timing/size metrics.

        ``engine`` is None on ranks that hold no engine (they still take part in the export).
        """

    def shutdown(self) -> None:
        """Release what the transport holds between syncs (the distributed one: its process group with the
        servers); a no-op for transports that hold nothing. Safe to call more than once."""


class ExportStream:
    """``backend.export_weights(bucket_bytes)`` as one stream of ``(hf_name, tensor)``, counted as it goes
    (bytes, tensors, buckets); with ``keep_copies`` each tensor is also copied to the CPU into ``sent``
    (for ``--check-weight-update-equal``). The export is collective: every rank must run it to the end,
    through a consumer or ``drain()``."""

    def __init__(self, backend: "TrainBackend", bucket_bytes: int, *, keep_copies: bool = False,
                 stage_only: bool = False):
        self.bytes = self.tensors = self.buckets = 0
        self.sent: dict = {}
        self._buckets = self._bucket_stream(backend, bucket_bytes, keep_copies, stage_only)
        self._items = (item for bucket in self._buckets for item in bucket)

    def _bucket_stream(self, backend, bucket_bytes, keep_copies, stage_only):
        # stage_only: this rank's pipeline stage (TrainBackend.export_scope); asked only then, so a
        # backend double without the keyword still serves the whole-model transports
        buckets = backend.export_weights(bucket_bytes, stage_only=True) if stage_only else \
            backend.export_weights(bucket_bytes)
        for bucket in buckets:
            bucket = list(bucket)
            self.buckets += 1
            for name, tensor in bucket:
                self.bytes += tensor.numel() * tensor.element_size()
                self.tensors += 1
                if keep_copies:
                    self.sent[name] = tensor.detach().to("cpu", copy=True)
            yield bucket

    def __iter__(self):
        return self._items

    def iter_buckets(self):
        """The same export bucket by bucket (``[(hf_name, tensor), ...]`` each), for transports that send a
        bucket as one unit (the distributed one: one HTTP call and its broadcasts per bucket). Use either
        this or plain iteration, not both."""
        return self._buckets

    def drain(self) -> None:
        """Run the rest of the export (a rank with no engine, or after the consumer failed)."""
        for _ in self._buckets:
            pass

    def metrics(self, version: int, seconds: float) -> dict[str, float]:
        return {"sync/time_s": seconds, "sync/bytes": float(self.bytes), "sync/buckets": float(self.buckets),
                "sync/weight_version": float(version)}


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)``: one item of lookahead, so a transport's last bucket can carry the weight version."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


# --update-weight-transport -> WeightSynchronizer subclass (or "module:Class", imported on first use).
TRANSPORTS: Registry[Type[WeightSynchronizer]] = Registry("--update-weight-transport", "weight-sync transport", {
    "tensor": "megatron_rl.weight_sync.in_process:InProcessSynchronizer",  # a path: in_process imports this module
    "disk": "megatron_rl.weight_sync.disk:DiskSynchronizer",
    "distributed": "megatron_rl.weight_sync.distributed:DistributedSynchronizer",
})


def check_engine_equals(engine: "RolloutEngine", sent: dict) -> int:
    """``--check-weight-update-equal``: every engine tensor equals what was sent (after casting to the
    sent dtype), and nothing the engine holds went unsent; returns the number checked, else SyncError."""
    import torch  # lazy: the table above loads without torch

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


# "<--update-weight-transport>/<--rollout-backend>" -> the synchronizer for that engine, where it is not the
# transport's own row above.
ENGINE_TRANSPORTS: Registry[Type[WeightSynchronizer]] = Registry(
    "--update-weight-transport with --rollout-backend", "weight-sync transport for this engine", {
        "tensor/sglang": "megatron_rl.weight_sync.sglang_tensor:SGLangTensorSynchronizer",
    })


def transport_class(transport: str, rollout_backend: str = "embedded") -> Type[WeightSynchronizer]:
    """The synchronizer class of ``--update-weight-transport transport`` with ``--rollout-backend rollout_backend``:
    the engine's own row when ``ENGINE_TRANSPORTS`` has one, else the transport's; unknown names raise ConfigError."""
    key = f"{transport}/{rollout_backend}"
    if key in ENGINE_TRANSPORTS:
        return ENGINE_TRANSPORTS.get(key)
    return TRANSPORTS.get(transport)


def register_transport(name: str, transport: Union[str, Type[WeightSynchronizer], Refused], *,
                       rollout_backend: Optional[str] = None) -> None:
    """Make ``--update-weight-transport name`` build ``transport`` (a WeightSynchronizer subclass or "module:Class");
    with ``rollout_backend``, only for that engine (the row of ``ENGINE_TRANSPORTS``)."""
    if rollout_backend is None:
        TRANSPORTS.register(name, transport)
    else:
        ENGINE_TRANSPORTS.register(f"{name}/{rollout_backend}", transport)


def make_synchronizer(transport: str, *, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0,
                      rollout_backend: str = "embedded", **options: Any) -> WeightSynchronizer:
    """The synchronizer for ``transport`` with ``rollout_backend``; ``options`` go to its constructor (e.g. the
    SGLang tensor transport's ``engines``). An unknown or not-yet-implemented name raises ConfigError."""
    cls = transport_class(transport, rollout_backend)
    return cls(bucket_bytes=bucket_bytes, check_equal=check_equal, driver_rank=driver_rank, **options)


def make_synchronizer_from_config(cfg: "Config", *, driver_rank: int = 0,
                                  engines: Optional["EnginePlacement"] = None) -> WeightSynchronizer:
    """The synchronizer the run's flags ask for (``--update-weight-transport`` with ``--rollout-backend``,
    ``--update-weight-buffer-size``, ``--check-weight-update-equal``); ``engines``: the placement of the SGLang
    engines the run launched (the SGLang tensor transport needs it to know which ranks feed which engine)."""
    cls = transport_class(cfg.sync.update_weight_transport, cfg.rollout.rollout_backend)
    return cls.from_config(cfg, driver_rank=driver_rank, engines=engines)


