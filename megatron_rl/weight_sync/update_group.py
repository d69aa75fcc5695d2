"""The trainer's end (rank 0) of a weights-update process group shared with rollout-server processes.

Why not ``torch.distributed.new_group``: that needs every member in the trainer's default group,
and SGLang servers are other programs with their own default group. SGLang's
``init_weights_update_group`` joins a group of its own instead
(``sglang.srt.utils.common.init_custom_process_group``, copied from OpenRLHF and used by slime's
trainer side too): a ``tcp://master_address:master_port`` rendezvous, a ``PrefixStore(group_name)``
over that store, then torch's internal ``_new_process_group_helper`` with no rank list, which adds
``<group_name>/`` and ``<device>/`` prefixes and builds the backend on them.

We build the same thing without that helper, for two reasons: it registers the group in torch's
global table (``_world``), where a second group of the same name in one process is refused, so a
trainer and an in-process test server could not both hold it; and it is private API whose
signature changed across torch versions. Here: rank 0 hosts the ``TCPStore`` (port 0: the OS picks
a free one, so no port race), and the backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``)
is built on the same prefix chain and used directly (``backend.broadcast``). The default group is
never touched; the key layout is checked against torch 2.13's helper by the stand-in tests and
against SGLang 0.5.23 on torch 2.14.1 by ``scripts/test_sglang_real.sh``.

Every blocking step here returns at once (``open_store``) or runs in a caller's thread with a
timeout (``connect``, the broadcasts' ``Work``): the synchronizer polls them alongside the HTTP
calls, so a server that never joins is named instead of hanging the trainer
(docs/peer-failures.md: a receiver that never joined the broadcast).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import Any, Optional
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
LOOPBACK_NAMES = ("localhost", "localhost.localdomain")


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def master_address_for(urls: list[str]) -> str:
    """The address the servers of ``urls`` can reach this process on: 127.0.0.1 when they are all
    local, else this host's address on the route to the first remote one (a UDP ``connect`` sends
    nothing; it only asks the kernel which interface it would use)."""
    hosts = [urlsplit(u if "://" in u else f"http://{u}").hostname or "" for u in urls]
    remote = [h for h in hosts if not is_loopback(h)]
    if not remote:
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in remote[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return s.getsockname()[0]


class UpdateGroup:
    """Rank 0 of ``group_name`` (``world_size`` = 1 + every server TP rank), backend gloo or nccl.

    Use: ``open_store()`` (returns the port to send the servers), ask the servers to join (HTTP,
    in threads), ``connect()`` (blocks until all ``world_size`` ranks joined, or ``timeout_s``),
    then ``broadcast`` per tensor, ``close()`` at the end.
    """

    def __init__(self, *, group_name: str, world_size: int, backend: str, master_address: str, timeout_s: float):
        if backend not in BACKENDS:
            raise ValueError(f"weights-update group backend {backend!r}: use one of {BACKENDS}")
        if world_size < 2:
            raise ValueError(f"weights-update group of world_size {world_size}: needs the trainer and a server rank")
        self.group_name, self.world_size, self.backend_name = group_name, int(world_size), backend
        self.master_address, self.timeout_s = master_address, float(timeout_s)
        self.port: Optional[int] = None
        self._store: Any = None
        self._backend: Any = None

    @property
    def connected(self) -> bool:
        return self._backend is not None

    def open_store(self) -> int:
        """Host the rendezvous store on ``master_address`` (a free port) and return the port."""
        self._store = dist.TCPStore(self.master_address, 0, self.world_size, True,
                                    timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.port = int(self._store.port)
        return self.port

    def connect(self) -> None:
        """Build the backend on SGLang's key layout; blocks until every rank joined (or the timeout)."""
        if self._store is None:
            raise RuntimeError("UpdateGroup.connect() before open_store()")
        device = "cuda" if self.backend_name == "nccl" else "cpu"  # the first device torch's helper builds
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{self.group_name}/",
                                                                dist.PrefixStore(self.group_name, self._store)))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        backend: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if self.backend_name == "gloo":
            backend = dist.ProcessGroupGloo(store, 0, self.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(store, 0, self.world_size, options)
        if hasattr(backend, "_set_sequence_number_for_group"):
            # torch <= 2.13's helper does this on every rank (rank 0 publishes, the others read): a
            # server on such a torch waits for our key; one on a newer torch never asks, harmless
            backend._set_sequence_number_for_group()
        self._backend = backend

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0 (us); returns the ``Work`` to poll/wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        return self._backend.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop the backend and the store (the servers' ends see their connections close)."""
        backend, self._backend = self._backend, None
        if backend is not None and hasattr(backend, "shutdown") and self.backend_name == "nccl":
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown: the group is going away either way
                pass
        del backend
        self._store = None
