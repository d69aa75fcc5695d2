"""The WeightSynchronizer interface and the ``--update-weight-transport`` tables that pick a transport.

Two tables, because what a transport name means can depend on the engine: ``TRANSPORTS`` maps a
name to its synchronizer, and ``ENGINE_TRANSPORTS`` overrides a row for one ``--rollout-backend``
(``tensor`` is the in-process hand-over with the embedded engine, and flattened buckets over
``/update_weights_from_tensor`` with SGLang engines the run launched colocated).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Self, Type, Union

from megatron_rl.errors import SyncError
from megatron_rl.infra.registry import Refused, Registry

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.models.peft_adapter import AdapterExport
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine
    from megatron_rl.plan.engines import EnginePlacement
    from megatron_rl.weight_sync.delta import EngineUpdates
    from megatron_rl.weight_sync.sglang_verify import SGLangVerifier


class WeightSynchronizer(abc.ABC):
    """Moves the backend's weights into the rollout engine; algorithm code never branches on how.

    Every transport takes the same arguments: ``bucket_bytes`` (``--update-weight-buffer-size``),
    ``check_equal`` (``--check-weight-update-equal``) and ``driver_rank`` (the rank that holds the
    engine). ``from_config`` maps the flags; a transport that needs more flags overrides it.
    ``engines`` is where the run launched its SGLang engines (None: it launched none); only the
    transports that address engines rank by rank use it.
    """

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0, *,
                 adapter: bool = False, updates: Optional["EngineUpdates"] = None):
        from megatron_rl.weight_sync.delta import EngineUpdates  # lazy: torch; the table below loads without it

        self.bucket_bytes = bucket_bytes
        self.check_equal = check_equal
        self.driver_rank = driver_rank
        # --lora-sync adapter (the transports that carry one: tensor to the embedded engine, disk): each sync
        # sends the LoRA adapter, the first one (and any after the engine lost its weights) the base model too
        self.adapter = adapter
        self._base_sent = False
        # --update-weight-mode / --update-weight-verify, for the transports whose engine patches its weights in
        # this process (in_process, disk with the embedded engine): full or delta, and the checksum check after
        self.updates = updates if updates is not None else EngineUpdates()
        # --update-weight-verify checksum with SGLang engines (set by from_config): the driver taps the export and
        # compares the servers' /weights_checker checksums after the engine adopted the version
        self.sglang_verifier: Optional["SGLangVerifier"] = None

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0,
                    engines: Optional["EnginePlacement"] = None) -> "WeightSynchronizer":
        s = cfg.sync
        sync = cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank, adapter=cfg.lora.lora_sync == "adapter", updates=updates_from_config(cfg))
        return sync.with_verifier(cfg)

    def with_verifier(self, cfg: "Config") -> Self:
        """This synchronizer with the run's SGLang post-apply check (``--update-weight-verify checksum`` with SGLang
        engines; ``weight_sync.sglang_verify``), or none."""
        from megatron_rl.weight_sync.sglang_verify import SGLangVerifier  # lazy: the table below loads without it

        self.sglang_verifier = SGLangVerifier.from_config(cfg)
        return self

    def verify_tap(self, engine: "RolloutEngine | None") -> Optional[Callable[[str, Any, int], None]]:
        """On the driver with an SGLang engine to verify: the ``ExportStream.observe`` callback of this sync (it
        reads every server's /server_info the first time); None elsewhere."""
        from megatron_rl.rollout.sglang.engine import SGLangEngine  # lazy: the table below loads without it

        if self.sglang_verifier is None or engine is None or not self.on_driver():
            return None
        if not isinstance(engine, SGLangEngine):
            raise SyncError(f"--update-weight-verify checksum compares SGLang servers' checksums, but the engine is "
                            f"{type(engine).__name__}")
        return self.sglang_verifier.tap(engine)

    def on_driver(self) -> bool:
        """Whether this rank holds the engine (the driver): one process, or rank ``driver_rank``."""
        import torch.distributed as dist  # lazy: the table below loads without torch

        return not dist.is_initialized() or dist.get_rank() == self.driver_rank

    @abc.abstractmethod
    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        """Collective: push the backend's current weights as ``version``; return timing/size metrics.

        ``engine`` is None on ranks that hold no engine (they still take part in the export).
        """

    def base_wanted(self, engine: "RolloutEngine | None") -> bool:
        """Collective (``--lora-sync adapter``): whether this sync carries the base weights with the adapter:
        on the transport's first sync, and whenever an engine on any rank lost them (released without backup)."""
        from megatron_rl.infra.dist import gather_problems  # lazy: the table below loads without torch

        mine = not self._base_sent or (engine is not None and engine.adapter_base_needed())
        return bool(gather_problems(["base"] if mine else []))

    def export_adapter(self, backend: "TrainBackend", engine: "RolloutEngine | None"
                       ) -> tuple["AdapterExport", Optional["ExportStream"]]:
        """Collective: the backend's adapter, and the stream of its base weights when :meth:`base_wanted`
        (iterate or ``drain`` it on every rank)."""
        with_base = self.base_wanted(engine)
        adapter = backend.export_adapters()
        lora = getattr(getattr(backend, "cfg", None), "lora", None)  # the run's flags; else what the export declares
        unsent = adapter.unsent_modules_to_save(getattr(lora, "lora_modules_to_save", None) or adapter.modules_to_save)
        if unsent:  # they train: an engine keeping its old weights of them would serve another policy, silently
            raise SyncError(f"--lora-sync adapter: the adapter export of {type(backend).__name__} holds no weight of "
                            f"the modules to save {unsent} (--lora-modules-to-save); the engine would keep stale "
                            "copies of them. Use --lora-sync merged")
        return adapter, (ExportStream(backend, self.bucket_bytes, merge_adapters=False) if with_base else None)

    def adapter_metrics(self, adapter: "AdapterExport", base: Optional["ExportStream"], version: int,
                        seconds: float) -> dict[str, float]:
        """``sync/bytes``: what the sync sent (the adapter, plus the base model when it went along)."""
        self._base_sent = True
        base_bytes = base.bytes if base is not None else 0
        return {"sync/time_s": seconds, "sync/bytes": float(adapter.nbytes + base_bytes),
                "sync/adapter_bytes": float(adapter.nbytes), "sync/base_bytes": float(base_bytes),
                "sync/buckets": float(1 + (base.buckets if base is not None else 0)),
                "sync/weight_version": float(version)}

    def check_merged(self, backend: "TrainBackend", engine: "RolloutEngine | None") -> Optional[float]:
        """Collective (``--check-weight-update-equal`` with ``--lora-sync adapter``): the engine's weights against
        the trainer's merged export (an extra export, for the check only); the number checked where an engine is."""
        merged = ExportStream(backend, self.bucket_bytes, keep_copies=engine is not None)
        merged.drain()
        if engine is None:
            return None
        return float(check_engine_equals(engine, merged.sent, half_rtol=True))

    def shutdown(self) -> None:
        """Release what the transport holds between syncs (the distributed one: its process group with the
        servers); a no-op for transports that hold nothing. Safe to call more than once."""


class ExportStream:
    """``backend.export_weights(bucket_bytes)`` as one stream of ``(hf_name, tensor)``, counted as it goes
    (bytes, tensors, buckets); with ``keep_copies`` each tensor is also copied to the CPU into ``sent``
    (for ``--check-weight-update-equal``). The export is collective: every rank must run it to the end,
    through a consumer or ``drain()``."""

    def __init__(self, backend: "TrainBackend", bucket_bytes: int, *, keep_copies: bool = False,
                 stage_only: bool = False, merge_adapters: bool = True,
                 observe: Optional[Callable[[str, Any, int], None]] = None):
        self.bytes = self.tensors = self.buckets = 0
        self.sent: dict = {}
        # observe(name, tensor, bucket): sees every tensor as its bucket is exported, before the transport sends it
        # (--update-weight-verify checksum with SGLang hashes the engine's tensors from them: SGLangVerifier)
        self.observe = observe
        self._buckets = self._bucket_stream(backend, bucket_bytes, keep_copies, stage_only, merge_adapters)
        self._items = (item for bucket in self._buckets for item in bucket)

    def _bucket_stream(self, backend, bucket_bytes, keep_copies, stage_only, merge_adapters):
        # stage_only / merge_adapters: asked only when set, so a backend double without the keywords still
        # serves the whole-model transports (stage_only: this rank's pipeline stage, TrainBackend.export_scope;
        # merge_adapters False: a LoRA run's base weights, --lora-sync adapter)
        kwargs: dict[str, bool] = {}
        if stage_only:
            kwargs["stage_only"] = True
        if not merge_adapters:
            kwargs["merge_adapters"] = False
        buckets = backend.export_weights(bucket_bytes, **kwargs)
        for bucket in buckets:
            bucket = list(bucket)
            self.buckets += 1
            for name, tensor in bucket:
                self.bytes += tensor.numel() * tensor.element_size()
                self.tensors += 1
                if keep_copies:
                    self.sent[name] = tensor.detach().to("cpu", copy=True)
                if self.observe is not None:
                    self.observe(name, tensor, self.buckets)
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


def updates_from_config(cfg: "Config") -> "EngineUpdates":
    """The run's ``EngineUpdates`` (--update-weight-mode, --update-weight-delta-*, --update-weight-verify)."""
    from megatron_rl.weight_sync.delta import EngineUpdates  # lazy: torch

    return EngineUpdates.from_config(cfg)


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


def check_engine_equals(engine: "RolloutEngine", sent: dict, *, half_rtol: bool = False) -> int:
    """``--check-weight-update-equal``: every engine tensor equals what was sent (after casting to the
    sent dtype), and nothing the engine holds went unsent; returns the number checked, else SyncError.
    ``half_rtol`` (an engine that merged a LoRA adapter itself, against the trainer's merged export): a
    bf16/fp16 tensor may differ by ``peft_adapter.HALF_RTOL`` of the tensor's largest value (the trainer
    may merge in half precision, the engine merges in float32); float32 tensors must be equal."""
    import torch  # lazy: the table above loads without torch

    from megatron_rl.models.peft_adapter import HALF_RTOL  # lazy: with torch

    live = dict(engine.named_weights())
    differ = []
    for name, want in sent.items():
        got = live.get(name)
        if got is None or got.shape != want.shape:
            differ.append(name)
            continue
        got = got.to(want.dtype).cpu()
        if half_rtol and want.dtype in (torch.bfloat16, torch.float16) and want.numel():
            scale = want.float().abs().max().item()
            if (got.float() - want.float()).abs().max().item() > HALF_RTOL * scale:
                differ.append(name)
        elif not torch.equal(got, want):
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


