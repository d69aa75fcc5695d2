"""Ports for the servers a run starts: SGLang engines, the router, a one-process gloo group.

Why not ``bind(("", 0))``: the kernel draws that port from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), the range it also draws from for
every outgoing connection on the node (gloo's and NCCL's sockets, HTTP clients, torchrun's store). Between
our probe and the server's own bind, any new connection can take the port, and the engine dies with
"Address already in use" (seen in CI with two test workers side by side). A port *below* that range is never
given to a connection, so only another process choosing listening ports can race us; a random start,
drawn from the OS (ranks seeded alike must not draw alike), makes that rare, and the launcher retries it.
"""

from __future__ import annotations

import errno
import random
import socket
from typing import Iterable

__all__ = ["ADDRESS_IN_USE", "address_in_use", "ephemeral_range", "free_port"]

_LISTEN_LOW = 20000  # below SGLang's default 30000 is fine: we always pass --port
_DEFAULT_EPHEMERAL = (32768, 60999)
_rng = random.SystemRandom()
_handed: set[int] = set()  # a process never hands out one port twice (two engines started back to back)

# how the servers we start say their port was taken: Python's and uvicorn's socket error,
# torch's TCPStore ("code: -98, name: EADDRINUSE, message: address already in use")
ADDRESS_IN_USE = "address already in use"


def address_in_use(message: str) -> bool:
    """Whether a server's error (or the tail of its log) says its port was taken."""
    return ADDRESS_IN_USE in message.lower()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux), or the usual default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(x) for x in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _binds(host: str, port: int) -> bool:
    # no SO_REUSEADDR: a port a listener, a connection or a TIME_WAIT socket holds is refused here
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_port(host: str = "127.0.0.1", *, avoid: Iterable[int] = ()) -> int:
    """A port on ``host`` that binds now, outside the ephemeral range, never one this process handed out
    before nor one of ``avoid``. Falls back to the kernel's choice when no such range is left."""
    low_eph, high_eph = ephemeral_range()
    ranges = [(lo, hi) for lo, hi in ((_LISTEN_LOW, low_eph - 1), (high_eph + 1, 65535)) if hi - lo >= 1000]
    skip = _handed | set(avoid)
    for _ in range(256):
        if not ranges:
            break
        lo, hi = _rng.choice(ranges)
        port = _rng.randint(lo, hi)
        if port not in skip and _binds(host, port):
            _handed.add(port)
            return port
    while True:  # the kernel's choice: a tiny or odd port range
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in skip:
            _handed.add(port)
            return port
