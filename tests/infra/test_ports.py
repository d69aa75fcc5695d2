"""Ports for the servers a run starts: outside the kernel's ephemeral range, never handed out twice,
never one that is held; and the words by which our servers say their port was taken."""

import socket

import pytest

from megatron_rl.infra import ports


def test_ports_lie_outside_the_ephemeral_range_bind_and_are_not_repeated():
    low, high = ports.ephemeral_range()
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(not low <= p <= high and p >= 1024 for p in got)
    for p in got[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # each still binds
    assert ports.free_port("0.0.0.0") not in got


def test_a_held_port_and_the_avoided_ones_are_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        draws = iter([port, port + 1 if port < 65535 else port - 1, 23456, 23457])

        class Rng:
            def choice(self, seq):
                return seq[0]

            def randint(self, lo, hi):
                return next(draws)

        monkeypatch.setattr(ports, "_rng", Rng())
        monkeypatch.setattr(ports, "_handed", set())
        second = port + 1 if port < 65535 else port - 1
        assert ports.free_port(avoid=[second]) in (23456, 23457)  # the held one and the avoided one skipped


def test_no_listening_range_left_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    a, b = ports.free_port(), ports.free_port()
    assert a != b and 1024 <= a <= 65535


@pytest.mark.parametrize("message", [
    "OSError: [Errno 98] Address already in use",  # Python's http.server, the stand-in
    "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use",
    "The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
    "code: -98, name: EADDRINUSE, message: address already in use",  # torch's TCPStore
])
def test_the_servers_words_for_a_taken_port(message):
    assert ports.address_in_use(message)
    assert not ports.address_in_use("exited with code 3 while starting: cannot load model")
