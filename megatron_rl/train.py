"""The RL loop: ``python -m megatron_rl.train [flags]`` (one process per rank, under torchrun).

    place + build -> sync weights -> per step: generate -> reward -> advantages
    -> old/ref/teacher log-probs -> train -> sync weights -> eval -> save

Every piece lives in its module (the driver's jobs in ``megatron_rl.runner``;
docs/architecture.md lists one step as file:function); this file only orders
them. Rank 0 is the driver: it holds the rollout engine, the prompt data and
the trackers; every rank trains (collectives inside the backend and the weight sync).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Optional

from megatron_rl.config import Config, parse_config
from megatron_rl.config.placement import launches_sglang_engines, refuse_single_process_world
from megatron_rl.errors import EngineError, MegatronRLError, SyncError
from megatron_rl.infra import collective_watch
from megatron_rl.infra.pause_points import pause_point
from megatron_rl.infra.wall_time import (EXIT_WALL_TIME, STATUS_ENV, end_process_on_stop_signals,
                                         restore_signal_handlers, status_exit_code, write_error_status)

if TYPE_CHECKING:
    from megatron_rl.runner.loop import StepParts

# torch and everything that imports it load after the flags parsed (in run(), train_on_rollout()):
# --help, --dry-run's refusals and every other flag error answer without the ~2 s torch import.

log = logging.getLogger("megatron_rl")


class _PhaseClock:
    """Seconds per start-up phase since ``main`` began (``perf/startup_<phase>_s``, ``perf/startup_s``)."""

    started = time.perf_counter()  # reset by main(); module import time is docs/benchmarks.md's business

    def __init__(self):
        self.last = time.perf_counter()
        self.laps = {"perf/startup_config_s": self.last - _PhaseClock.started}  # logging set-up, flag parsing

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[f"perf/startup_{phase}_s"], self.last = now - self.last, now

    def metrics(self) -> dict[str, float]:
        return {**self.laps, "perf/startup_s": self.last - _PhaseClock.started}


def run(cfg: Config) -> int:
    clock = _PhaseClock()  # start-up phases, logged with the step-0 record as perf/startup_*_s
    collective_watch.configure(cfg.parallel.distributed_timeout_minutes)  # before any process group is made
    # lazy: torch, megatron-core glue and the engine load only once the flags parsed (--help, flag errors: ~0.1 s)
    from megatron_rl.algorithms import spec_from_config
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.rollout.build import build_replica_worker, build_rollout
    from megatron_rl.runner.context import RunContext
    from megatron_rl.runner.engine_faults import EngineRecovery
    from megatron_rl.runner.loop import StepParts
    from megatron_rl.weight_sync import make_synchronizer_from_config

    clock.lap("import_torch")  # torch and the loop's modules (not imported for --help / flag errors)
    ctx = RunContext.create(cfg)
    pause_point("context_created")  # tests: SIGKILL in start-up, the driver's tracker made, nothing built
    spec = spec_from_config(cfg)
    clock.lap("context")
    if not cfg.has_training and not ctx.is_driver:
        return 0  # rollout-only: the driver's engine does all the work; no trainer ranks
    backend = make_backend(cfg.precision.train_backend) if cfg.has_training else None
    clock.lap("import_backend")
    reward_model = None
    if backend:
        backend.initialize(cfg, spec)
        if cfg.data.reward_model_path:  # the RM role, on the trainer's ranks (backends/reward_model.py)
            from megatron_rl.backends.reward_model import RewardModel  # lazy: transformers' classifier

            reward_model = RewardModel(cfg)
    clock.lap("backend")
    fleet = None  # the SGLang engines this run launches (each node's local rank 0 starts its node's)
    sync = rollout = engine = None
    looping = False  # the loop runs: an engine lost from here on leaves the run resumable (engine_failure)
    try:
        if launches_sglang_engines(cfg):
            # lazy: subprocess + HTTP readiness polling, only for runs that launch SGLang engines
            from megatron_rl.rollout.sglang.launcher import launch_engines

            fleet = launch_engines(cfg)  # collective: every rank learns every engine's URL
            clock.lap("engines")
        placement = fleet.placement if fleet is not None else None
        rollout = build_rollout(cfg, placement) if ctx.is_driver and cfg.has_rollout_engine else None
        replica = None if ctx.is_driver else build_replica_worker(cfg)  # --embedded-engine-ranks all
        here = rollout or replica  # this rank's rollout side: the driver's manager, or its engine replica
        engine = here.engine if here is not None else None  # what the weight sync and the colocation act on
        recovery = EngineRecovery(fleet, enabled=cfg.rollout.use_fault_tolerance)
        sync = make_synchronizer_from_config(cfg, engines=fleet.placement if fleet is not None else None)
        clock.lap("rollout")
        ctx.checkpoints.algorithm_state = spec.state_dict  # the adaptive KL coefficient travels in checkpoints
        start = ctx.resume.resume_or_init(backend, rollout) if backend else 0
        ctx.begin_attempt(start)  # metrics.jsonl: the earlier launches' records past `start` are superseded
        spec.load_state_dict((ctx.checkpoints.cursor.extra or {}).get("algorithm_state") or {})
        clock.lap("resume")
        if backend and cfg.has_rollout_engine:
            with collective_watch.watched(collective_watch.WEIGHT_SYNC):
                synced = sync.sync(backend, engine, version=start)
            clock.lap("sync")
            ctx.log(start, {**synced, **clock.metrics()}, attempt_start=True)
        ctx.clock.stop_at_next_step_on_signal()  # from here a signal means: finish the step, save, exit 3
        parts = StepParts(ctx, spec, backend, rollout, replica, engine, recovery, sync, synced_version=start,
                          resync=lambda version: _resync(sync, backend, rollout, version), reward_model=reward_model)
        if cfg.rollout.async_mode == "one-step":
            # lazy: a driver only its mode loads (one-step: rollout N+1 generated beside training N)
            from megatron_rl.runner.one_step import run_one_step as loop
        elif cfg.rollout.async_mode == "full":
            # lazy: a driver only its mode loads (full: a producer fills a buffer continuously)
            from megatron_rl.runner.full_async import run_full as loop
        else:
            loop = run_in_turn
        looping = True
        code = loop(parts, start)
        if code is not None:
            return code  # a planned stop, saved
        ctx.finish(backend, rollout, parts.prepare_final)
        return 0
    except (EngineError, SyncError) as exc:
        dead = fleet.dead() if fleet is not None else []
        if isinstance(exc, SyncError) and not dead:
            raise  # a weight update that failed with its engines alive: the update's own error
        # say why the server stopped answering: the process this node launched is gone (unless the error already
        # quotes its log: the rollout's own report of the death; a client error that names the engine, its log's
        # path included, has not said why it died)
        unsaid = [p for p in dead if f"Last lines of {p.log_path}" not in str(exc)]
        named = EngineError(f"{exc}. " + " ".join(p.death_message("during the run", lines=8) for p in unsaid)) \
            if unsaid else exc
        failure = engine_failure(cfg, named, mid_run=looping, engines_dead=bool(dead))
        if failure is exc:
            raise
        raise failure from exc
    finally:
        if sync is not None:
            sync.shutdown()  # the distributed transport's process group with the servers; others hold nothing
        if engine is not None:
            engine.close()  # its health monitor stops before the servers do
        if fleet is not None:
            fleet.stop()  # SIGTERM, then SIGKILL, each engine's process group


def engine_failure(cfg: Config, exc: MegatronRLError, *, mid_run: bool, engines_dead: bool = False) -> MegatronRLError:
    """An engine lost during the loop, with what a relaunch resumes from and the exit code that says so: 3
    (relaunch to resume, as a stop or a full disk) where a complete checkpoint is under ``--save``; else
    ``exc`` as it is (2). Was: 2 ("refused") even with a checkpoint to resume from. At start-up an
    unreachable engine is a refusal (2) whatever is on disk; a full-async producer's failure that is not an
    engine's (a reward function's exception, wrapped in ``ProducerError``) stays what it is."""
    from megatron_rl.infra.checkpoint_root import find_latest_complete, iter_dir  # lazy: stdlib + json only
    from megatron_rl.runner.producer import ProducerError  # lazy: the loop's modules load after the flags

    lost = engines_dead or not isinstance(exc, ProducerError) or isinstance(exc.__cause__, EngineError)
    root = cfg.checkpoint.save
    newest = find_latest_complete(root) if mid_run and lost and root and cfg.has_training else None
    if newest is None or root is None:
        return exc
    out = EngineError(f"{exc}; {iter_dir(root, newest)} is complete: relaunch the same command once the engines "
                      "are back and it resumes from there (--use-fault-tolerance restarts a launched engine within "
                      "the run)")
    out.exit_code = EXIT_WALL_TIME  # type: ignore[attr-defined]  # read by main(), as the disk-full errors' own
    return out


def run_in_turn(parts: "StepParts", start: int) -> Optional[int]:
    """``--async-mode off``: generate, train, sync, in turn; the exit code of a planned stop, else None."""
    cfg = parts.ctx.cfg
    for rollout_id in range(start, cfg.rollout.num_rollout):
        t0 = time.perf_counter()
        samples, metrics = parts.generate(rollout_id)
        if cfg.has_training:
            parts.train(samples, metrics, rollout_id=rollout_id)
            if cfg.has_rollout_engine:
                parts.push_weights(rollout_id + 1, metrics)
        parts.evaluate_and_log(rollout_id, metrics, t0)
        _, code = parts.save_or_stop(rollout_id)
        if code is not None:
            return code
    return None


def _resync(sync, backend, rollout, version: int) -> dict:
    """After an engine restart: what the transport held with the dead server goes, then a complete sync
    of the weights the rollout is generated with (version ``version``, as the last sync sent)."""
    sync.shutdown()
    if backend is None:
        return {}
    backend.restore_comm_groups()  # the export runs collectives; they go again at the next generate
    return sync.sync(backend, rollout and rollout.engine, version=version)


def refusal_of_another_rank() -> Optional[dict]:
    """The refusal another rank of this launch recorded (``MEGATRON_RL_STATUS_FILE``), or None.

    Why this is safe to trust after a collective failed here: a rank records its refusal in ``main``
    before its process group is destroyed or the process exits, so the file exists before any peer
    can see that rank's connections close. Without the launcher (plain torchrun, no status file)
    there is nothing to read and every rank reports for itself."""
    path = os.environ.get(STATUS_ENV) if "TORCHELASTIC_RUN_ID" in os.environ else None
    if not path:
        return None
    try:
        with open(path) as fh:
            status = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or status.get("status") != "error":
        return None
    return status if str(status.get("rank")) != os.environ.get("RANK", "0") else None


PEER_GONE = re.compile(r"connection (closed|reset) by peer|broken pipe|econnreset|epipe|connection refused",
                       re.IGNORECASE)


def traceback_file(run_dir: str, rank) -> str:
    """Where a rank that ended quietly (:func:`peer_gone_report`) left its traceback; the launcher names it."""
    return os.path.join(run_dir, f"rank{rank}_traceback.txt")


def peer_gone_report(exc: BaseException) -> Optional[str]:
    """Under the launcher, for a collective that failed because a peer rank's process is gone (its
    connections closed: gloo's "Connection closed by peer", a torch ``DistError``): the traceback goes to
    a file beside ``run_status.json`` and this returns the one line to print instead; None otherwise.

    Why: a rank SIGKILLed (the OOM killer) took every other rank's collective down with it, and each
    printed a gloo traceback above the launcher's line, which names the killed rank; those tracebacks
    pointed away from the cause. The file keeps them for the rare case the peer is not the cause."""
    import traceback

    status = os.environ.get(STATUS_ENV) if "TORCHELASTIC_RUN_ID" in os.environ else None
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    chain, seen = [], set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    gone = any((dist_error is not None and isinstance(e, dist_error)) or PEER_GONE.search(str(e)) for e in chain)
    if not status or not gone:
        return None
    path = traceback_file(os.path.dirname(status), os.environ.get("RANK", "0"))
    try:
        with open(path, "w") as fh:
            fh.write("".join(traceback.format_exception(exc)))
    except OSError:
        return None  # nowhere to keep it: the traceback is printed as before
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return (f"a collective failed ({type(exc).__name__}: {first}): another rank of this launch ended first; the "
            f"launcher names it below. This rank's traceback: {path}")


def main(argv=None) -> int:
    previous = end_process_on_stop_signals()  # until the loop can save, SIGTERM/SIGINT end the run (143/130)
    _PhaseClock.started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lists every parameter of every bucket
    try:
        cfg = parse_config(argv)
        if cfg.mode.dry_run:
            from megatron_rl.runner.dry_run import print_plan  # lazy: the plan tables, only for --dry-run

            return print_plan(cfg)
        refuse_single_process_world(cfg)  # no torchrun: 1 rank, whatever the flags planned for
        if int(os.environ.get("RANK", "0")) == 0:
            # lazy: the prompt reader and the HTTP client, only for a real run's driver
            from megatron_rl.runner.preflight import preflight

            preflight(cfg)  # prompt files, tokenizer, --rollout-engine-urls: refused before any collective
        rc = run(cfg)
        # torchrun treats any non-zero worker exit as a crash and kills the others: on a planned
        # stop the workers exit 0 and run_status.json tells the launch script to exit 3.
        return 0 if rc == EXIT_WALL_TIME and "TORCHELASTIC_RUN_ID" in os.environ else rc
    except MegatronRLError as exc:
        # under megatron_rl.infra.launch the launcher prints the first rank's error once, with its code
        # its exit code: 2 (refused), or 3 for a full disk with a complete checkpoint to resume from
        code = getattr(exc, "exit_code", 2)
        status_file = os.environ.get(STATUS_ENV) if "TORCHELASTIC_RUN_ID" in os.environ else None
        recorded = status_file and (write_error_status(status_file, str(exc), code) or os.path.isfile(status_file))
        if not recorded:
            print(f"error: {exc}", file=sys.stderr)
        return code
    except Exception as exc:  # noqa: BLE001 - re-raised unless another rank's refusal or death explains it
        refusal = refusal_of_another_rank()
        if refusal is None:
            quiet = peer_gone_report(exc)
            if quiet is None:
                raise  # a crash: its traceback is the report
            print(f"rank {os.environ.get('RANK', '0')}: {quiet}", file=sys.stderr, flush=True)
            return 1
        # the usual cause: the refusing rank left a collective this rank waits in ("Connection closed by
        # peer"); the launcher prints that rank's error once, so this rank ends without a traceback
        log.info("rank %s stops after rank %s's refusal (here: %s in what it was doing with it)",
                 os.environ.get("RANK", "0"), refusal.get("rank"), type(exc).__name__)
        code = status_exit_code(refusal)
        assert code is not None, "a refusal's status is an error, which always maps to an exit code"
        return code
    finally:
        save_lock = sys.modules.get("megatron_rl.infra.save_lock")  # the driver's lock on --save, if it took one
        if save_lock is not None:
            save_lock.release_all()
        dist = sys.modules.get("torch.distributed")  # not imported: no process group to destroy
        if dist is not None and dist.is_available() and dist.is_initialized():
            # megatron's layout goes with the groups: a caller in the same process (tests) would otherwise find
            # parallel_state "initialized" on destroyed groups
            parallel_state = sys.modules.get("megatron.core.parallel_state")
            if parallel_state is not None and parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        restore_signal_handlers(previous)  # main() called in-process (tests) leaves them as it found them


if __name__ == "__main__":
    sys.exit(main())
