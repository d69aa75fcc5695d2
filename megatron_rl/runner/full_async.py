"""``--async-mode full``: the engines generate continuously (``runner.producer``); the trainer takes each
step's batch from the buffer as it fills.

One step, N = ``rollout_id``: take ``--rollout-batch-size`` groups in the order they were admitted (the
producer's pacing keeps each within ``--max-staleness``; one beyond it is dropped and counted), train on them (weights -> N+1),
close the producer's gate (no group starts) and abort the rows in flight until none is (they come
back with their tokens and are continued after the sync with ``--partial-rollout``), sync, open the
gate at version N+1, then evaluation, metrics, checkpoint, stop, as in turn. With
``--pause-generation-mode retract`` / ``in_place`` the gate stays open and nothing is aborted: the sync's own
pause parks the rows on the engines while the weights load, and they go on after it in the same call, so
generation does not stop while the trainer exports and writes the weights.

Exact resume (every prompt trained exactly once across any number of kills): a checkpoint N is
preceded by ``<save>/async_buffer/buffer_N.pt``, one instant's snapshot of the producer: the finished
groups not yet trained (with their tokens, versions and rewards), the requests not finished (in
flight, or drawn and not started) and the prompt position after everything drawn, which is the
position the checkpoint records. Groups that finish after the snapshot are trained by this run
and, after a kill, generated again from their prompts by the resumed one (their samples were not
in the snapshot; the snapshot lists them as not finished). The checkpoint's extra state names the
file and its SHA-256; a resume whose file is missing or damaged stops, naming it, since going on
would silently drop its prompts. Files live as long as their checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Optional

from megatron_rl.data.types import GenerateRequest, Sample
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.rollout.dynamic_sampling import DynamicSampler, StreamFilter
from megatron_rl.rollout.endpoint.agent import rollout_functions_from_config
from megatron_rl.rollout.manager import sampling_params, save_rollout
from megatron_rl.runner.buffer_file import buffer_path, prune_buffers, read_buffer, write_buffer
from megatron_rl.runner.loop import StepParts
from megatron_rl.runner.producer import EngineFault, Group, RolloutProducer, generation_span_s

log = logging.getLogger("megatron_rl")

MAX_WORKERS = 64  # groups generated at once at most (each a request of n rows the servers batch together)


def _build_producer(parts: StepParts, start: int) -> RolloutProducer:
    """The driver's producer: restored from the checkpoint's buffer file on a resume from a full-mode checkpoint."""
    cfg, rollout = parts.ctx.cfg, parts.rollout
    assert rollout is not None, "the driver holds the rollout manager"
    r, b = cfg.rollout, cfg.batching
    cursor = parts.ctx.checkpoints.cursor
    restored: dict = {}
    record = (cursor.extra or {}).get("async_buffer") if cursor.resumed_at == start else None
    if record:
        assert cfg.checkpoint.save is not None and cursor.path is not None, "a resume reads its checkpoint"
        restored = read_buffer(os.path.dirname(cursor.path), start, record)
        if restored["state"] != rollout.position():
            raise ConfigError(f"--async-mode full: {buffer_path(os.path.dirname(cursor.path), start)} was taken at "
                              "another prompt position than its checkpoint records; start afresh "
                              "(--no-auto-resume --existing-save archive)")
        log.info("rollout buffer of %s restored: %d finished group(s) to train, %d prompt group(s) generated again",
                 cursor.path, len(restored["buffer"]), len(restored["pending"]))
    tok = getattr(rollout.engine, "tokenizer", None)
    # --custom-generate-function-path / --agent-function-path per group; --rollout-function-path per B groups
    functions = rollout_functions_from_config(cfg)
    generate_batch = None
    if functions is not None and functions.batch_fn is not None:
        batch_functions = functions

        def generate_batch(rollout_id, requests, sampling, call):
            return batch_functions.generate(rollout_id, requests, sampling, call, tokenizer=tok)
    k = r.max_staleness if r.max_staleness is not None else 1
    groups = b.rollout_batch_size
    sampler = DynamicSampler.from_config(cfg)  # --dynamic-sampling-filter-path: groups judged as they finish
    group_filter = StreamFilter(sampler, cfg, groups) if sampler is not None else None
    if group_filter is not None and restored.get("filter"):  # the drops in a row and the step's counts so far
        group_filter.restore(restored["filter"])
    producer = RolloutProducer(
        rollout.engine, lambda: list(next(rollout.prompts).requests),
        sampling_params(cfg, n=b.n_samples_per_prompt, seed=r.rollout_seed), groups_per_step=groups,
        max_staleness=k, version=parts.synced_version, partial=r.partial_rollout,
        score=rollout.batch_builder.score, next_step=start,
        concurrency=min((k + 1) * groups, MAX_WORKERS), abort_retries=r.rollout_abort_retries,
        next_serial=restored.get("next_serial", 0),
        pending=[GenerateRequest(**q) for q in restored.get("pending", [])],
        buffer=[Group(g["serial"], GenerateRequest(**g["request"]), g["admitted_at"],
                      [Sample(**s) for s in g["samples"]]) for g in restored.get("buffer", [])],
        position=rollout.position, generate_group=functions.group_generate(tok) if functions else None,
        tolerate_faults=r.use_fault_tolerance, group_filter=group_filter, generate_batch=generate_batch)
    return producer


def _batch(producer: RolloutProducer, parts: StepParts, rollout_id: int) -> tuple[list[Sample], dict]:
    """The step's groups, in the order they were admitted; one beyond ``--max-staleness`` dropped and counted."""
    cfg = parts.ctx.cfg
    want, k = cfg.batching.rollout_batch_size, cfg.rollout.max_staleness or 1
    engine = parts.rollout.engine if parts.rollout is not None else None
    describe = getattr(engine, "describe", lambda: type(engine).__name__)
    kept: list[Group] = []
    dropped = 0
    t = time.perf_counter()
    while len(kept) < want:
        try:
            taken = producer.take(want - len(kept), rollout_id, cfg.rollout.async_wait_timeout, describe)
        except EngineFault:
            producer.give_back(kept)  # trained after the engines are back, in their order
            raise
        for group in taken:
            if any(s.staleness(rollout_id) > k for s in group.samples):
                dropped += 1
                log.warning("rollout %d: dropped prompt group %s (staleness %d > --max-staleness %d)", rollout_id,
                            group.request.metadata, max(s.staleness(rollout_id) for s in group.samples), k)
            else:
                kept.append(group)
    wait_s = time.perf_counter() - t
    samples = []
    for index, group in enumerate(kept):  # GRPO groups by group_index: renumbered within the step's batch
        for s in group.samples:
            s.group_index = index
            samples.append(s)
    assert parts.rollout is not None, "the driver holds the rollout manager"
    metrics = parts.rollout.batch_builder.metrics(samples, trained_at=rollout_id, time_s=generation_span_s(kept),
                                                  reward_s=sum(g.reward_s for g in kept))
    finished, generating = producer.depth()
    metrics.update({"rollout/dropped_stale": float(dropped), "rollout/buffer_depth": float(finished),
                    "rollout/inflight_groups": float(generating),
                    "rollout/partial_continued_samples": float(sum("partial_continuations" in s.metadata
                                                                   for s in samples)),
                    "perf/rollout_wait_s": wait_s})
    if producer.group_filter is not None:  # --dynamic-sampling-filter-path: what the filter dropped meanwhile
        metrics.update(producer.group_filter.metrics(len(kept)))
    if cfg.mode.save_debug_rollout_data:
        save_rollout(cfg.mode.save_debug_rollout_data.format(rollout_id=rollout_id), rollout_id, samples)
    return samples, metrics


def _batch_or_park(producer: Optional[RolloutProducer], parts: StepParts, rollout_id: int) -> tuple:
    """The step's batch (``_batch``; none on the ranks without the producer). An engine fault
    (``--use-fault-tolerance``) leaves the producer parked with no call in flight, and is raised for
    ``EngineRecovery`` to restart the engine (every rank learns of it from the driver)."""
    if producer is None:
        return None, {}
    try:
        return _batch(producer, parts, rollout_id)
    except EngineFault:
        producer.close_gate()
        producer.quiesce(None, parts.ctx.cfg.rollout.async_wait_timeout)  # calls to the dead engine come back
        raise


def _quiesce(producer: Optional[RolloutProducer], parts: StepParts) -> tuple:
    """Before a sync: nothing left on the engines (``RolloutProducer.quiesce``). An engine death seen here (its
    abort refused) parks the producer and is raised for ``EngineRecovery`` (every rank learns of it)."""
    if producer is None:
        return None, {}
    timeout = parts.ctx.cfg.rollout.async_wait_timeout
    try:
        producer.quiesce(getattr(parts.rollout.engine if parts.rollout else None, "abort", None), timeout)
    except EngineError as exc:
        if not producer.tolerate_faults:
            raise
        producer.park(str(exc))
        producer.quiesce(None, timeout)  # calls to the dead engine come back
        raise
    return None, {}


def _resync(producer: Optional[RolloutProducer], parts: StepParts, reopen: bool = True) -> dict:
    """After a restart: the current weights synced again (collective), then the producer goes on (``reopen``;
    else its gate stays closed for the sync under way)."""
    engine = parts.rollout.engine if parts.rollout is not None else None
    if engine is not None and hasattr(engine, "poll_health"):
        engine.poll_health()  # the restarted servers count as alive again (the recovery rewinds no rollout here)
    metrics = parts.resync(parts.synced_version)
    if producer is not None:
        producer.recovered(parts.synced_version if reopen else None)
    return metrics


def run_full(parts: StepParts, start: int) -> Optional[int]:
    """The loop of ``--async-mode full`` (module docstring); the exit code of a planned stop, else None."""
    cfg = parts.ctx.cfg
    producer = _build_producer(parts, start) if parts.rollout is not None else None
    root = cfg.checkpoint.save
    # --pause-generation-mode retract / in_place: the rows in flight stay on the servers across each sync (its own
    # /pause_generation parks them), so the producer neither closes its gate nor aborts them before it
    keeps_rows = cfg.rollout.pause_generation_mode != "abort"
    if producer is not None:
        producer.start()

    def prepare(step: int) -> Optional[dict]:
        """The driver's buffer snapshot, written before checkpoint ``step``; what its extra state records."""
        if producer is None or root is None:
            return None
        snapshot = producer.snapshot()
        record = write_buffer(root, step, snapshot)
        prune_buffers(root, keep=step)
        return {"dataset_state": snapshot["state"], "async_buffer": record}

    parts.prepare_final = lambda: prepare(cfg.rollout.num_rollout)  # ctx.finish's save, while the producer runs
    try:
        for rollout_id in range(start, cfg.rollout.num_rollout):
            t0 = time.perf_counter()
            samples, metrics = parts.recovery.generate(functools.partial(_batch_or_park, producer, parts, rollout_id),
                                                       None, resync=functools.partial(_resync, producer, parts))
            parts.train(samples, metrics, rollout_id=rollout_id)
            if not keeps_rows:  # abort: nothing starts while the weights change, nothing is left on the servers
                if producer is not None:
                    producer.close_gate()
                _, restarted = parts.recovery.generate(functools.partial(_quiesce, producer, parts), None,
                                                       resync=functools.partial(_resync, producer, parts,
                                                                                reopen=False))
                if restarted:  # an engine died since the batch was taken: restarted, synced; the step's sync follows
                    metrics["rollout/engine_restarts"] = metrics.get("rollout/engine_restarts", 0.0) \
                        + restarted["rollout/engine_restarts"]
            try:
                parts.push_weights(rollout_id + 1, metrics)
            finally:
                if producer is not None:
                    producer.open_gate(rollout_id + 1)
            if producer is not None:
                step_s = time.perf_counter() - t0
                metrics["perf/trainer_idle_frac"] = metrics["perf/rollout_wait_s"] / step_s if step_s > 0 else 0.0
                metrics["perf/engine_idle_frac"] = min(1.0, producer.idle_seconds() / step_s) if step_s > 0 else 0.0

            parts.evaluate_and_log(rollout_id, metrics, t0)
            _, code = parts.save_or_stop(rollout_id, prepare=functools.partial(prepare, rollout_id + 1))
            if code is not None:
                if producer is not None:
                    producer.stop()  # saved: nothing more is trained in this job
                return code
        return None
    except BaseException:
        if producer is not None:
            producer.stop()
        raise
    # a normal end: the producer keeps running until the final save (ctx.finish) snapshots it; its daemon
    # threads end with the process, their calls with the engines' close
