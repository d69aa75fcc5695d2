"""The WeightSynchronizer interface and the factory that picks a transport."""

from __future__ import annotations

import abc
from typing import Optional

from megatron_rl.errors import ConfigError


class WeightSynchronizer(abc.ABC):
    """Moves the backend's weights into the rollout engine; algorithm code never branches on how."""

    @abc.abstractmethod
    def sync(self, backend, engine, version: int) -> dict[str, float]:
        """Collective: push the backend's current weights as ``version``; return timing/size metrics.

        ``engine`` is None on ranks that hold no engine (they still take part in the export).
        """


def make_synchronizer(transport: str, *, bucket_bytes: int, check_equal: bool = False,
                      driver_rank: int = 0, disk_dir: Optional[str] = None) -> WeightSynchronizer:
    if transport == "tensor":
        from .in_process import InProcessSynchronizer

        return InProcessSynchronizer(bucket_bytes=bucket_bytes, check_equal=check_equal, driver_rank=driver_rank)
    raise ConfigError(f"--update-weight-transport {transport} is not available with the embedded engine yet; "
                      "use --update-weight-transport tensor (in-process hand-over of the exported tensors)")
