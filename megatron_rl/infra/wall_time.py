"""Wall-time budget and graceful stop (slime-style ``--wall-time-limit/--wall-time-reserve``).

The loop asks ``should_stop()`` after each step: true when the time left is under
the reserve (enough for the final save) or when SIGTERM/SIGINT arrived. Eval is
skipped when less than two reserves remain, so a run is never killed mid-eval.
The start time is carried across resumes through ``resume_state.json`` so a
limit means the whole job, not each restart.

Signals have two modes. During start-up (imports, model build, resume) there is
nothing to save, and a start-up may hang (an optional package whose import
blocks): SIGTERM/SIGINT then end the process at once, by the kernel's default
action (exit 143/130), which works even while Python is stuck. Once the loop can
save (:meth:`WallClock.stop_at_next_step_on_signal`), a signal only sets a flag:
the step finishes, the run saves and exits with ``EXIT_WALL_TIME``. A forked
checkpoint writer inherits the flag handler, so a SIGTERM to the worker's
process group (torchrun forwards with ``os.killpg``) does not kill it mid-write.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

from megatron_rl.errors import MegatronRLError
from megatron_rl.infra.atomic import atomic_write_json

EXIT_WALL_TIME = 3  # distinct exit code: "stopped on purpose, relaunch to continue"
RUN_STATUS_FILE = "run_status.json"  # in --output-dir: {"status": "finished" | "stopped_early" | "error", ...}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STATUS_ENV = "MEGATRON_RL_STATUS_FILE"  # set by megatron_rl.infra.launch: where a worker records its refusal


def end_process_on_stop_signals() -> dict:
    """Start-up mode: SIGTERM/SIGINT take their default action (the process ends: 143/130).

    Why the default action and not a Python handler that raises: a Python handler
    runs only between bytecodes, so a start-up stuck inside C code would never
    see it. Before the first step there is nothing to save; the newest complete
    checkpoint stays as it was.

    Returns the handlers it replaced (for :func:`restore_signal_handlers`).
    """
    return {sig: signal.signal(sig, signal.SIG_DFL) for sig in STOP_SIGNALS}


def restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class WallClock:
    def __init__(self, limit_s: Optional[float], reserve_s: float, elapsed_before_s: float = 0.0):
        self.limit_s = limit_s
        self.reserve_s = reserve_s
        self.elapsed_before_s = elapsed_before_s
        self._t0 = time.monotonic()
        self.signal_received: Optional[int] = None

    @property
    def elapsed_s(self) -> float:
        return self.elapsed_before_s + (time.monotonic() - self._t0)

    @property
    def remaining_s(self) -> float:
        return float("inf") if self.limit_s is None else self.limit_s - self.elapsed_s

    def install_signal_handlers(self) -> None:
        """Start-up: a signal ends the process now (:func:`end_process_on_stop_signals`)."""
        end_process_on_stop_signals()

    def stop_at_next_step_on_signal(self) -> None:
        """The loop can save from here on: a signal asks for a stop after the current step (and a save)."""
        def _handler(signum, _frame):
            self.signal_received = signum

        for sig in STOP_SIGNALS:
            signal.signal(sig, _handler)

    def stop_reason(self) -> Optional[str]:
        if self.signal_received is not None:
            return f"received signal {signal.Signals(self.signal_received).name}"
        if self.remaining_s < self.reserve_s:
            return (f"wall time: {self.remaining_s:.0f}s left of --wall-time-limit {self.limit_s:.0f}s, "
                    f"under --wall-time-reserve {self.reserve_s:.0f}s")
        return None

    def should_stop(self) -> bool:
        return self.stop_reason() is not None

    def can_eval(self) -> bool:
        return self.remaining_s >= 2 * self.reserve_s


def write_run_status(output_dir: str, status: str, **info) -> None:
    """Record how the run ended (driver rank), so a launcher can tell a planned stop from a crash.

    Under torchrun a worker's non-zero exit is reported as a failure (and the other
    workers are killed), so on a planned stop the workers exit 0 and the launch
    launcher (``megatron_rl.infra.launch``) turns ``stopped_early`` into ``EXIT_WALL_TIME``.
    """
    import os


    atomic_write_json(os.path.join(output_dir, RUN_STATUS_FILE), {"status": status, **info})


def read_run_status(output_dir: str) -> Optional[dict]:
    """``run_status.json`` of ``output_dir``, or None when absent or unreadable (a run killed before it ended)."""
    import json
    import os

    try:
        with open(os.path.join(output_dir, RUN_STATUS_FILE)) as fh:
            status = json.load(fh)
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


def status_exit_code(status: Optional[dict]) -> Optional[int]:
    """The exit code a run status stands for: 0 finished, 3 stopped early, the error's code; None if unknown."""
    if not status:
        return None
    kind = status.get("status")
    if kind == "finished":
        return 0
    if kind == "stopped_early":
        return EXIT_WALL_TIME
    if kind == "error":
        code = status.get("exit_code")
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return None


def launcher_exit_code(output_dir: str) -> int:
    """EXIT_WALL_TIME if the last run in ``output_dir`` stopped early on purpose, its code on an error, else 0."""
    code = status_exit_code(read_run_status(output_dir))
    return 0 if code is None else code


def write_error_status(path: str, message: str, exit_code: int) -> bool:
    """Record a refusal for the launcher (``MEGATRON_RL_STATUS_FILE``); the first rank to fail wins.

    Why a file: under torchrun every rank's refusal would print, followed by
    torchrun's own traceback; the launcher (``megatron_rl.infra.launch``) prints
    this one line instead and exits with ``exit_code``. Returns False when another
    rank had already written it (or it could not be written).
    """
    import json
    import os

    payload = {"status": "error", "error": message, "exit_code": exit_code,
               "rank": int(os.environ.get("RANK", "0"))}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh)
    return True


def record_refusal_now(exc: BaseException) -> bool:
    """Record ``exc`` (one of this package's errors) for the launcher before this rank tells its peers it
    stopped: a peer that raises on the news could otherwise record its own report of it first, and the
    launcher would print the peer's line ("rank 0's rollout stopped: ...") instead of this one. False when
    not under the launcher, not such an error, or another rank recorded first; ``train.main`` finds the file
    and prints nothing more."""
    path = os.environ.get(STATUS_ENV) if "TORCHELASTIC_RUN_ID" in os.environ else None
    if not path or not isinstance(exc, MegatronRLError):
        return False
    return write_error_status(path, str(exc), getattr(exc, "exit_code", 2))


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description="Exit with the run's status code (3 = stopped early on purpose).")
    ap.add_argument("--exit-code", metavar="OUTPUT_DIR", required=True, help="the run's --output-dir")
    sys.exit(launcher_exit_code(ap.parse_args().exit_code))
