"""Wall-time budget and graceful stop (slime-style ``--wall-time-limit/--wall-time-reserve``).

The loop asks ``should_stop()`` after each step: true when the time left is under
the reserve (enough for the final save) or when SIGTERM/SIGINT arrived. Eval is
skipped when less than two reserves remain, so a run is never killed mid-eval.
The start time is carried across resumes through ``resume_state.json`` so a
limit means the whole job, not each restart.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

EXIT_WALL_TIME = 3  # distinct exit code: "stopped on purpose, relaunch to continue"
RUN_STATUS_FILE = "run_status.json"  # in --output-dir: {"status": "finished" | "stopped_early", ...}


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
        def _handler(signum, _frame):
            self.signal_received = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
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
    script turns ``stopped_early`` into ``EXIT_WALL_TIME`` with ``--exit-code``.
    """
    import os

    from megatron_rl.infra.atomic import atomic_write_json

    atomic_write_json(os.path.join(output_dir, RUN_STATUS_FILE), {"status": status, **info})


def launcher_exit_code(output_dir: str) -> int:
    """EXIT_WALL_TIME if the last run in ``output_dir`` stopped early on purpose, else 0."""
    import json
    import os

    path = os.path.join(output_dir, RUN_STATUS_FILE)
    if not os.path.isfile(path):
        return 0
    with open(path) as fh:
        return EXIT_WALL_TIME if json.load(fh).get("status") == "stopped_early" else 0


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(allow_abbrev=False, description="Exit with the run's status code (3 = stopped early on purpose).")
    ap.add_argument("--exit-code", metavar="OUTPUT_DIR", required=True, help="the run's --output-dir")
    sys.exit(launcher_exit_code(ap.parse_args().exit_code))
