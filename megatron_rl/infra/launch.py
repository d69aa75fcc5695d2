"""torchrun for the launch scripts: one line and the run's exit code, whatever ends the run.

    python -m megatron_rl.infra.launch --run-dir OUTPUT_DIR [torchrun flags] -m megatron_rl.train ...

Runs ``torch.distributed.run`` in this process (the launch scripts ``exec`` it, so
a signal sent to the script, to its process group, or to torchrun reaches the
same process) and turns how the run ended into one exit code:

* 0 finished, 3 stopped early on purpose (wall time, SIGTERM/SIGINT: the workers
  saved first) -- from ``OUTPUT_DIR/run_status.json``, written by the driver;
* a refusal (``ConfigError`` ...): the workers write ``error`` + exit code to the
  same file (``MEGATRON_RL_STATUS_FILE``) instead of printing it on every rank;
  this prints ``error: ...`` once and exits with its code (2), not torchrun's 1
  and ChildFailedError traceback;
* a signal before the loop could save: 128 + the signal (143 SIGTERM, 130 SIGINT);
* a crash: which rank failed with what (its traceback is above), exit 1; a rank ended by
  signal N (the OOM killer's SIGKILL): 128 + N (137), naming that rank, not one torchrun
  SIGTERMed after it (:func:`_first_failure`); the ranks whose collectives broke under it
  print one line each and keep their tracebacks in ``RUN_DIR/rank<R>_traceback.txt``.
  These ends and a signal's (below) are recorded in ``run_status.json`` too (``error``,
  the exit code, the launcher's line): no worker could write it.

Why not plain torchrun: torchrun exits 1 with a traceback for all of these, and a
wrapper script around it that is itself signalled leaves torchrun and the workers
running. Two more things torchrun does that a stop save cannot live with:

* on a signal it forwards it to every worker, waits ``--shutdown-timeout``
  (default 30 s) and then SIGKILLs them; the wait is raised to 300 s here
  (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` overrides) so the step in flight and the
  save can finish;
* a second signal (``timeout`` and Slurm signal both the process and its group;
  a terminal's Ctrl-C reaches every process in the foreground group) raises again
  inside that wait and abandons the workers mid-save. Here the first signal
  starts the stop and later ones are ignored (SIGKILL still ends everything).
* torchrun starts each worker in a session of its own, so a SIGKILL of torchrun
  (``kill -9 -PGID`` of a script that ``exec``s this, the OOM killer) left the
  workers and their engines training on, parentless, to the end of the run (saving,
  holding the ``--save`` lock). Here each worker is started with
  ``PR_SET_PDEATHSIG`` = SIGKILL: it dies with this process, and its engines with it
  (they carry the same setting towards their rank).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
from typing import Optional

from megatron_rl.infra.atomic import atomic_write_json
from megatron_rl.infra.wall_time import RUN_STATUS_FILE, STATUS_ENV, read_run_status, status_exit_code

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT_S = 300
USAGE = "usage: python -m megatron_rl.infra.launch --run-dir OUTPUT_DIR [torchrun flags] SCRIPT|-m MODULE [args]"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _split_args(argv: list[str]) -> tuple[str, list[str]]:
    if len(argv) < 3 or argv[0] != "--run-dir" or not argv[1]:
        _say(f"error: {USAGE}")
        sys.exit(2)
    return argv[1], argv[2:]


def _first_signal_only() -> None:
    """Make torchrun's signal handler act once: later signals are ignored while the workers stop and save."""
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    seen: list[int] = []

    def handler(signum, frame):
        if seen:
            _say(f"launch: got {signal.Signals(signum).name} again; still waiting for the workers to save and "
                 f"exit (SIGKILL ends them now, losing the steps since the last checkpoint)")
            return
        seen.append(signum)
        original(signum, frame)  # raises SignalException: torchrun forwards it and waits

    api._terminate_process_handler = handler


PR_SET_PDEATHSIG = 1


def _workers_die_with_launcher() -> None:
    """Start torchrun's workers with ``PR_SET_PDEATHSIG`` = SIGKILL towards this process (Linux; elsewhere the
    workers start as torchrun starts them). ``SubprocessHandler`` starts each worker from this process's main
    thread (the death signal follows the thread that forked), in a session of its own: a SIGKILL of this
    process or of its process group did not reach them."""
    try:
        import ctypes  # lazy: only the launcher needs it

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # loaded here: the forked child only calls it
    except (OSError, AttributeError):
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    launcher = os.getpid()

    def die_with_launcher() -> None:  # runs in the child between fork and exec
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != launcher:  # the launcher died before the setting took: no signal will come
            os._exit(128 + int(signal.SIGKILL))

    subprocess_handler.Popen = functools.partial(subprocess.Popen, preexec_fn=die_with_launcher)  # type: ignore[misc,assignment]  # torch's module-level name, called with keywords only


def _quiet_torchrun_logs() -> None:
    """torchrun logs each failure and then raises; this module reports it once (LOGLEVEL=... keeps them)."""
    if "LOGLEVEL" in os.environ:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank whose failure ended the run, of torchrun's ``failures`` (rank -> ProcessFailure).

    Once one worker fails torchrun SIGTERMs the others and records them too, so the lowest rank is
    often a bystander: a SIGKILLed rank 1 was reported as rank 0 ended by SIGTERM (exit 143, not 137).
    Taken: the earliest failure (``timestamp``, whole seconds); within a second a death by a signal
    other than SIGTERM (SIGKILL, SIGSEGV: nothing of torchrun's sends those first), then an exit code
    (a crash, or a rank whose collective broke when its peer died), then SIGTERM (torchrun's own
    shutdown of the survivors); then the order torchrun noticed them (the failed one before those it
    terminated)."""
    def key(item):
        order, (_, failure) = item
        code = getattr(failure, "exitcode", 1)
        kind = 2 if code == -signal.SIGTERM else 0 if code is not None and code < 0 else 1
        return getattr(failure, "timestamp", 0), kind, order

    _, first = min(enumerate(failures.items()), key=key)
    return first


def _failure_summary(exc, run_dir: str = "") -> tuple[int, str, Optional[int]]:
    """(exit code, one line, rank) for torchrun's ChildFailedError: the rank whose failure ended the run and how:
    128 + N for a rank ended by signal N (SIGKILL: 137), else 1. A rank that ended quietly because a collective
    broke under it left its traceback in ``RUN_DIR/rank<R>_traceback.txt`` (``train.peer_gone_report``),
    named here instead of "above"."""
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return 1, "a worker failed (see its output above)", None
    rank, failure = _first_failure(failures)
    code = getattr(failure, "exitcode", 1)
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return 128 - code, f"rank {rank} was ended by {name}", rank
    kept = os.path.join(run_dir, f"rank{rank}_traceback.txt")
    where = f"its traceback: {kept}" if run_dir and os.path.isfile(kept) else "its traceback is above"
    return 1, f"rank {rank} exited with code {code} ({where})", rank


def _record_end(status_path: str, code: int, message: str, **info) -> None:
    """``run_status.json`` for an end no worker could record (a rank killed, a crash, a signal before the loop
    could save): ``error`` with the exit code and the launcher's line, so a script or scheduler that reads the
    file sees every end (was: absent after a SIGKILLed rank, exit 137)."""
    try:
        atomic_write_json(status_path, {"status": "error", "error": message, "exit_code": code,
                                        "recorded_by": "launcher", **info})
    except OSError:
        pass  # the exit code still says it


def run(run_dir: str, torchrun_args: list[str]) -> int:
    """Launch, wait, report; returns the exit code (see the module docstring)."""
    os.makedirs(run_dir, exist_ok=True)
    status_path = os.path.join(run_dir, RUN_STATUS_FILE)
    try:
        os.remove(status_path)  # a previous run's status must not speak for this one
    except FileNotFoundError:
        pass
    os.environ[STATUS_ENV] = status_path
    os.environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(DEFAULT_SHUTDOWN_TIMEOUT_S))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    _first_signal_only()
    _workers_die_with_launcher()
    _quiet_torchrun_logs()
    got_signal: Optional[signal.Signals] = None
    failure: Optional[tuple[int, str, Optional[int]]] = None
    try:
        torchrun(parse_args(torchrun_args))
    except SignalException as e:
        got_signal = signal.Signals(e.sigval)
    except ChildFailedError as e:
        failure = _failure_summary(e, run_dir)
    except KeyboardInterrupt:  # Ctrl-C before torchrun installed its handler: no worker was started yet
        got_signal = signal.SIGINT
    for sig in (signal.SIGTERM, signal.SIGINT):  # the workers are gone: a late signal must not cut the report
        signal.signal(sig, signal.SIG_IGN)

    status = read_run_status(run_dir)
    code = status_exit_code(status)
    if code == 0:
        curves = os.path.join(run_dir, "curves.png")
        _say(f"finished; curves: {curves}  metrics: {os.path.join(run_dir, 'metrics.jsonl')}"
             if os.path.isfile(curves) else f"finished; outputs in {run_dir}")
        return 0
    if code is not None:
        assert status is not None, "an exit code is read only from a run status"
        if status.get("status") == "stopped_early":
            _say(f"stopped early ({status.get('reason', 'stop requested')}) after rollout "
                 f"{status.get('rollout_id')}; exit {code}: relaunch the same command to resume")
            return code
        _say(f"error: {status.get('error')}")
        return code
    kept = "the newest complete checkpoint, if any, is kept"
    if got_signal is not None:
        line = (f"stopped by {got_signal.name} before the run could save (start-up, or the save did not finish "
                f"within {os.environ[SHUTDOWN_TIMEOUT_ENV]} s); {kept}")
        _record_end(status_path, 128 + int(got_signal), line, signal=got_signal.name)
        _say(line)
        return 128 + int(got_signal)
    if failure is not None:
        code, line, rank = failure
        _record_end(status_path, code, f"{line}; {kept}", rank=rank)
        _say(f"error: {line}; {kept}")
        return code
    return 0  # torchrun succeeded and nothing wrote a status (a run without a driver status, e.g. a plain script)


def main(argv: Optional[list[str]] = None) -> int:
    run_dir, torchrun_args = _split_args(list(sys.argv[1:] if argv is None else argv))
    return run(run_dir, torchrun_args)


if __name__ == "__main__":
    sys.exit(main())
