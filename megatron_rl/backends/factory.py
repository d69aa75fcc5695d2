"""``--train-backend`` -> a backend: the table of training backends (``BACKENDS``) and ``make_backend``.

Why a module of its own: the table names every backend, and every backend imports ``base.py``; kept in ``base.py``
it made each backend and the contract import each other. Each backend's module is imported on first use
(megatron-core alone costs ~15 s).
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.backends.base import TrainBackend
from megatron_rl.infra.registry import Registry


def _megatron_backend() -> TrainBackend:
    from megatron_rl.compat import megatron_import  # lazy: torch; its finder hides wandb and dynamo from megatron

    megatron_import.install()
    from megatron_rl.backends.megatron.backend import MegatronBackend  # lazy: imports megatron-core (~15 s)

    return MegatronBackend()


def _fsdp_backend() -> TrainBackend:
    from megatron_rl.backends.fsdp.backend import FSDPBackend  # lazy: imports transformers, FSDP2

    return FSDPBackend()


# --train-backend -> a factory of the backend (its module is imported on first use)
BACKENDS: Registry[Callable[[], TrainBackend]] = Registry("--train-backend", "training backend", {
    "megatron": _megatron_backend,
    "fsdp": _fsdp_backend,
})


def make_backend(name: str) -> TrainBackend:
    """The backend named by ``--train-backend``."""
    return BACKENDS.get(name)()
