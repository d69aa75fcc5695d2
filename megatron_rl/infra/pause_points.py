"""Test pause points: a run stops at a named place so a test signals or kills it at known state.

A test that must act on a process *at* a given moment (SIGKILL mid-save, Ctrl-C mid-conversion,
SIGTERM once step 3 is logged) cannot find that moment by polling the file system and then acting:
on a busy machine the process moves on between the poll and the signal (the conversion had already
finished, the save was already published). Instead the test launches it with::

    MEGATRON_RL_TEST_PAUSE_AT=<point>[:<key>]   e.g. publish_written:iter_0000002
    MEGATRON_RL_TEST_PAUSE_DIR=<dir>

and every process that reaches :func:`pause_point` with that name (and key, where given) writes
``<dir>/<spec>.rank<RANK>.paused`` and waits there until

* ``<dir>/<spec>.release`` exists (the test is done looking), or
* a signal arrives: its handler runs as it would have (a flag set, ``KeyboardInterrupt``, the
  default action), then the process goes on; so a test sends its SIGTERM/SIGINT and needs no
  release, and a SIGKILL finds the process exactly there.

Once released, the point no longer pauses (later arrivals pass straight through). A pause that
nobody ends within :data:`PAUSE_TIMEOUT_S` raises :class:`PauseTimeout` naming the point and the
release file, so a forgotten pause fails the test instead of hanging it. Without the variable
:func:`pause_point` returns at once (one dict lookup): the points cost nothing in a real run.

Points (where the one-line calls are): ``context_created`` (train.py, the driver's tracker exists),
``step_logged:<step>`` (train.py, the step's metrics are in metrics.jsonl, before its save and stop
check), ``publish_written:<name>`` (publish.py, every rank's files are in the temp dir, no marker,
nothing published), ``publish_sealed:<name>`` (publish.py, rank 0: the marker written too, only
the rename left), ``published:<name>`` (publish.py, renamed into place, before the tracker files),
``prune_renamed:<name>`` (checkpoint_root.py, the pruned checkpoint renamed to its ``.deleting``
name, not yet removed), ``rollout_stored:rollout_<N>`` (rollout_ckpt.py, the file is written),
``sync_started:<version>`` (runner/loop.py, a weight sync about to send; in full async mode the
producer's gate closed and nothing in flight), ``buffer_full`` (runner/producer.py, a producer
worker held back by the staleness bound for the first time; only that thread waits).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from typing import Optional

PAUSE_AT_ENV = "MEGATRON_RL_TEST_PAUSE_AT"
PAUSE_DIR_ENV = "MEGATRON_RL_TEST_PAUSE_DIR"
PAUSE_TIMEOUT_S = 900.0  # only a hang bound: a test ends every pause it sets long before this
POLL_S = 0.01
# the signals a test sends; each one ends the pause after its handler ran
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class PausePointError(RuntimeError):
    """A pause point asked for in a way that cannot work (no dir to write the marker to)."""


class PauseTimeout(PausePointError, TimeoutError):
    """A pause point was reached and neither released nor signalled within PAUSE_TIMEOUT_S."""


def marker_path(directory: str, spec: str, rank: int = 0) -> str:
    """The file a process writes once it is paused at ``spec`` (its content: the pid)."""
    return os.path.join(directory, f"{spec}.rank{rank}.paused")


def release_path(directory: str, spec: str) -> str:
    """The file a test creates to let every process paused at ``spec`` go on."""
    return os.path.join(directory, f"{spec}.release")


def pause_point(name: str, key: Optional[str] = None) -> None:
    """Pause here if ``MEGATRON_RL_TEST_PAUSE_AT`` names this point (``name`` or ``name:key``)."""
    spec = os.environ.get(PAUSE_AT_ENV)
    if not spec or spec not in (name, f"{name}:{key}"):
        return
    directory = os.environ.get(PAUSE_DIR_ENV)
    if not directory:
        raise PausePointError(f"{PAUSE_AT_ENV}={spec} is set without {PAUSE_DIR_ENV}: set it to the dir where the "
                           "paused marker is written and the release file is looked for")
    release = release_path(directory, spec)
    if os.path.exists(release):
        return
    marker = marker_path(directory, spec, int(os.environ.get("RANK", "0")))
    os.makedirs(directory, exist_ok=True)
    with open(marker + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)  # whole when seen
    _wait(spec, release)


def _wait(spec: str, release: str) -> None:
    arrived: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            handler = signal.getsignal(sig)
            if handler is None:  # installed outside Python: leave it alone
                continue
            previous[sig] = handler
            signal.signal(sig, functools.partial(_forward, arrived, handler))
    try:
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while not arrived and not os.path.exists(release):
            if time.monotonic() > deadline:
                raise PauseTimeout(f"paused at {PAUSE_AT_ENV}={spec} for {PAUSE_TIMEOUT_S:.0f} s and nothing "
                                   f"ended it: the test must create {release} or signal pid {os.getpid()}")
            time.sleep(POLL_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward(arrived: list, handler, signum: int, frame) -> None:
    """Run what the signal would have run without the pause, then end the pause."""
    arrived.append(signum)
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # the default action (SIGTERM: terminated by it)
