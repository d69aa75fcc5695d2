"""The WeightSynchronizer interface and the ``--update-weight-transport`` table that picks a transport."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Type, Union

from megatron_rl.infra.registry import Refused, Registry

if TYPE_CHECKING:
    from megatron_rl.backends.base import TrainBackend
    from megatron_rl.config.schema import Config
    from megatron_rl.rollout.base import RolloutEngine


class WeightSynchronizer(abc.ABC):
    """Moves the backend's weights into the rollout engine; algorithm code never branches on how.

    Every transport takes the same arguments: ``bucket_bytes`` (``--update-weight-buffer-size``),
    ``check_equal`` (``--check-weight-update-equal``) and ``driver_rank`` (the rank that holds the
    engine). ``from_config`` maps the flags; a transport that needs more flags overrides it.
    """

    def __init__(self, bucket_bytes: int, check_equal: bool = False, driver_rank: int = 0):
        self.bucket_bytes = bucket_bytes
        self.check_equal = check_equal
        self.driver_rank = driver_rank

    @classmethod
    def from_config(cls, cfg: "Config", *, driver_rank: int = 0) -> "WeightSynchronizer":
        s = cfg.sync
        return cls(bucket_bytes=s.update_weight_buffer_size, check_equal=s.check_weight_update_equal,
                   driver_rank=driver_rank)

    @abc.abstractmethod
    def sync(self, backend: "TrainBackend", engine: "RolloutEngine | None", version: int) -> dict[str, float]:
        """Collective: push the backend's current weights as ``version``; return timing/size metrics.

        ``engine`` is None on ranks that hold no engine (they still take part in the export).
        """


def _not_yet(transport: str) -> Refused:
    return Refused(f"--update-weight-transport {transport} is not available with the embedded engine yet; "
                   "use --update-weight-transport tensor (in-process hand-over of the exported tensors)")


# --update-weight-transport -> WeightSynchronizer subclass (or "module:Class", imported on first use).
TRANSPORTS: Registry[Type[WeightSynchronizer]] = Registry("--update-weight-transport", "weight-sync transport", {
    "tensor": "megatron_rl.weight_sync.in_process:InProcessSynchronizer",  # a path: in_process imports this module
    "disk": _not_yet("disk"),
    "distributed": _not_yet("distributed"),
})


def register_transport(name: str, transport: Union[str, Type[WeightSynchronizer], Refused]) -> None:
    """Make ``--update-weight-transport name`` build ``transport`` (a WeightSynchronizer subclass or "module:Class")."""
    TRANSPORTS.register(name, transport)


def make_synchronizer(transport: str, *, bucket_bytes: int, check_equal: bool = False,
                      driver_rank: int = 0) -> WeightSynchronizer:
    """The synchronizer for ``transport``; an unknown or not-yet-implemented name raises ConfigError."""
    return TRANSPORTS.get(transport)(bucket_bytes=bucket_bytes, check_equal=check_equal, driver_rank=driver_rank)


def make_synchronizer_from_config(cfg: "Config", *, driver_rank: int = 0) -> WeightSynchronizer:
    """The synchronizer the run's flags ask for (``--update-weight-transport``, ``--update-weight-buffer-size``,
    ``--check-weight-update-equal``)."""
    return TRANSPORTS.get(cfg.sync.update_weight_transport).from_config(cfg, driver_rank=driver_rank)


