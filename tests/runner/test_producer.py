"""runner/producer.py: the staleness bound, partial rollouts and the snapshot, under random speeds.

The engine is a double that answers like an SGLang server paused in abort mode: it draws tokens one
at a time, each stamped with the version it holds (and a log-prob that encodes that version), and a
sync's pause cuts every row in flight, which comes back ``abort`` with the tokens drawn so far (or, as
``InPlaceEngine``, paused in_place: the rows go on across the sync, their later tokens by the new version). Engine
and trainer sleep random short times so groups finish out of order and syncs land mid-response; every
assertion is on the samples' state (versions, tokens, prompt indices), none on timing.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.runner.producer import Group, RolloutProducer

B, N, MAX_NEW = 3, 2, 6


def logprob_of(version: int) -> float:
    return -0.001 * (version + 1)


class PausingEngine:
    """Token by token; ``sync(version)`` aborts the rows in flight (their tokens returned) and waits for them."""

    def __init__(self, seed: int, delay: float):
        self.version, self.rng, self.delay = 0, random.Random(seed), delay
        self._lock = threading.Condition()
        self._pausing, self._active = False, 0

    def generate(self, requests, sampling):
        with self._lock:
            self._active += 1
        try:
            out = []
            for req in requests:
                for _ in range(sampling.n):
                    out.append(self._row(req, sampling))
            return out
        finally:
            with self._lock:
                self._active -= 1
                self._lock.notify_all()

    def _row(self, req, sampling) -> Sample:
        tokens, logprobs, versions, finish = [], [], [], "length"
        for _ in range(req.budget(sampling)):
            time.sleep(self.rng.random() * self.delay)
            with self._lock:
                if self._pausing:
                    finish = "abort"
                    break
                version = self.version
            tokens.append(7)
            logprobs.append(logprob_of(version))
            versions.append(version)
            if self.rng.random() < 0.15:
                finish = "stop"
                break
        spans = len(set(versions)) > 1
        return Sample(req.group_index, list(req.prompt_ids), tokens, rollout_logprobs=logprobs, finish_reason=finish,
                      weight_version=versions[0] if versions else self.version,
                      token_versions=versions if spans else [], metadata=dict(req.metadata))

    def sync(self, version: int) -> None:
        with self._lock:
            self._pausing = True
            while self._active:  # abort mode: every row in flight returns at its next token
                self._lock.wait()
            self.version = version
            self._pausing = False


class InPlaceEngine(PausingEngine):
    """``sync`` as an in_place pause: the rows in flight park between two tokens while the version changes and go
    on after it (nothing aborted, nothing resubmitted), their later tokens by the new version."""

    def sync(self, version: int) -> None:
        with self._lock:  # a row reads the version under this lock before each token: the update lands between two
            self.version = version


class Prompts:
    def __init__(self):
        self.drawn = 0

    def draw(self) -> list[GenerateRequest]:
        out = []
        for g in range(B):
            out.append(GenerateRequest([1, 2, self.drawn], g, metadata={"prompt_index": self.drawn}))
            self.drawn += 1
        return out


def make(engine, prompts, *, k: int, partial: bool, **kw) -> RolloutProducer:
    return RolloutProducer(engine, prompts.draw, SamplingParams(max_new_tokens=MAX_NEW, n=N, seed=3),
                           groups_per_step=B, max_staleness=k, version=engine.version, partial=partial,
                           score=lambda samples: None, concurrency=(k + 1) * B, **kw)


def train(producer, engine, steps, start=0, trainer_delay=0.0, seed=0, keeps_rows=False):
    """The full-async driver's order per step; ``keeps_rows`` (--pause-generation-mode retract / in_place): the
    gate stays open and nothing is aborted before the sync, whose own pause parks the rows in flight."""
    rng, trained = random.Random(seed), []
    for step in range(start, start + steps):
        groups = producer.take(B, step, timeout_s=120)
        trained.append((step, groups))
        time.sleep(rng.random() * trainer_delay)  # the training
        if not keeps_rows:
            producer.close_gate()
        engine.sync(step + 1)
        producer.open_gate(step + 1)
    return trained


@pytest.mark.parametrize("k,partial,engine_delay,trainer_delay,in_place", [
    (1, True, 0.002, 0.0, False),  # the engine is the slow side
    (1, True, 0.0, 0.01, False),  # the trainer is
    (2, True, 0.001, 0.005, False),
    (1, False, 0.001, 0.002, False),
    (1, True, 0.002, 0.002, True),  # --pause-generation-mode in_place: rows go on across the sync
])
def test_every_trained_token_is_within_the_bound_and_nothing_is_dropped(k, partial, engine_delay, trainer_delay,
                                                                        in_place):
    engine, prompts = (InPlaceEngine if in_place else PausingEngine)(seed=k, delay=engine_delay), Prompts()
    producer = make(engine, prompts, k=k, partial=partial)
    producer.start()
    try:
        trained = train(producer, engine, steps=12, trainer_delay=trainer_delay, seed=k, keeps_rows=in_place)
    finally:
        producer.stop()
    indices = []
    mixed = 0
    for step, groups in trained:
        assert len(groups) == B and [len(g.samples) for g in groups] == [N] * B
        for g in groups:
            indices.append(g.request.metadata["prompt_index"])
            for s in g.samples:
                versions = s.effective_token_versions()
                assert s.finish_reason != "abort" and 1 <= len(versions) <= MAX_NEW
                assert min(versions) >= step - k, (step, versions)  # the bound, every token
                assert s.staleness(step) <= k and s.oldest_version == min(versions)
                # each token carries the behaviour log-prob of the weights that drew it
                assert s.rollout_logprobs == [logprob_of(v) for v in versions]
                assert versions == sorted(versions)
                mixed += len(set(versions)) > 1
                if in_place:  # a row that spans a sync was never cut: no resubmission
                    assert "partial_continuations" not in s.metadata
                elif len(set(versions)) > 1:
                    assert s.metadata["partial_continuations"] >= 1
    # taken in admission order, each prompt once: no group dropped, none trained twice
    assert indices == list(range(12 * B))
    if not partial:
        assert mixed == 0  # a response cut by a sync was drawn again, whole, by the new weights


def test_a_response_cut_by_a_sync_continues_on_the_new_weights():
    """Deterministic: the row draws 2 tokens by version 0, parks until the sync pauses it, comes back aborted with
    them, and is continued after the sync from prompt + those tokens by version 1."""
    parked, calls = threading.Event(), []

    class Parking(PausingEngine):
        def _row(self, req, sampling):
            calls.append((list(req.prompt_ids), req.budget(sampling), self.version))
            if len(calls) > 1:  # the continuation: 3 more tokens by the version it holds now
                return Sample(req.group_index, list(req.prompt_ids), [8, 8, 8], [logprob_of(self.version)] * 3,
                              finish_reason="stop", weight_version=self.version, metadata=dict(req.metadata))
            parked.set()
            with self._lock:
                while not self._pausing:
                    self._lock.wait()
            return Sample(req.group_index, list(req.prompt_ids), [7, 7], [logprob_of(0)] * 2, finish_reason="abort",
                          weight_version=0, metadata=dict(req.metadata))

        def sync(self, version):
            with self._lock:
                self._pausing = True
                self._lock.notify_all()
                while self._active:
                    self._lock.wait()
                self.version, self._pausing = version, False

    engine = Parking(seed=0, delay=0.0)
    producer = RolloutProducer(engine, lambda: [GenerateRequest([1, 2], 0, metadata={"prompt_index": 0})],
                               SamplingParams(max_new_tokens=MAX_NEW, n=1, seed=3), groups_per_step=1,
                               max_staleness=1, version=0, partial=True, score=lambda samples: None, concurrency=1)
    producer.start()
    try:
        assert parked.wait(60)
        producer.close_gate()
        engine.sync(1)
        producer.open_gate(1)
        (group,) = producer.take(1, 0, timeout_s=60)
    finally:
        producer.stop()
    (s,) = group.samples
    assert calls[1] == ([1, 2, 7, 7], MAX_NEW - 2, 1)  # prompt + the kept tokens, for the budget left, by v1
    assert s.prompt_ids == [1, 2] and s.response_ids == [7, 7, 8, 8, 8] and s.finish_reason == "stop"
    assert s.token_versions == [0, 0, 1, 1, 1] and s.weight_version == 0 and s.staleness(1) == 1
    assert s.rollout_logprobs == [logprob_of(0)] * 2 + [logprob_of(1)] * 3
    assert s.metadata["partial_continuations"] == 1


def test_a_response_parked_in_place_across_a_sync_goes_on_without_a_second_call():
    """Deterministic, --pause-generation-mode in_place: the row draws 2 tokens by version 0, is parked while the
    sync changes the weights (the gate stays open, nothing is aborted), then draws 3 by version 1 in the same call."""
    drawing, calls = threading.Event(), []

    class Parked(InPlaceEngine):
        def _row(self, req, sampling):
            calls.append(list(req.prompt_ids))
            drawing.set()
            with self._lock:
                while self.version == 0:
                    self._lock.wait()
                version = self.version
            return Sample(req.group_index, list(req.prompt_ids), [7, 7, 8, 8, 8],
                          [logprob_of(0)] * 2 + [logprob_of(version)] * 3, finish_reason="stop", weight_version=0,
                          token_versions=[0, 0] + [version] * 3, metadata=dict(req.metadata))

        def sync(self, version):
            with self._lock:
                self.version = version
                self._lock.notify_all()

    engine = Parked(seed=0, delay=0.0)
    producer = RolloutProducer(engine, lambda: [GenerateRequest([1, 2], 0, metadata={"prompt_index": 0})],
                               SamplingParams(max_new_tokens=MAX_NEW, n=1, seed=3), groups_per_step=1,
                               max_staleness=1, version=0, partial=True, score=lambda samples: None, concurrency=1)
    producer.start()
    try:
        assert drawing.wait(60)
        engine.sync(1)  # no close_gate, no abort: the sync's own pause parks the row
        producer.open_gate(1)
        (group,) = producer.take(1, 0, timeout_s=60)
    finally:
        producer.stop()
    (s,) = group.samples
    assert calls[:1] == [[1, 2]] and group.admitted_at == 0
    assert s.response_ids == [7, 7, 8, 8, 8] and s.token_versions == [0, 0, 1, 1, 1] and s.staleness(1) == 1
    assert s.rollout_logprobs == [logprob_of(0)] * 2 + [logprob_of(1)] * 3
    assert "partial_continuations" not in s.metadata


def test_snapshot_restores_every_untrained_prompt_exactly_once():
    engine, prompts = PausingEngine(seed=5, delay=0.001), Prompts()
    producer = make(engine, prompts, k=1, partial=True)
    producer.start()
    try:
        before = train(producer, engine, steps=3)
        producer.close_gate()  # as at a checkpoint: the snapshot is one instant's state
        snap = producer.snapshot()
        producer.open_gate(engine.version)
    finally:
        producer.stop()
    trained = [g.request.metadata["prompt_index"] for _, gs in before for g in gs]
    buffered = [g["request"]["metadata"]["prompt_index"] for g in snap["buffer"]]
    pending = [r["metadata"]["prompt_index"] for r in snap["pending"]]
    # every prompt drawn so far is trained, finished in the buffer, or listed to be generated again: once
    assert sorted(trained + buffered + pending) == list(range(prompts.drawn))

    engine2 = PausingEngine(seed=6, delay=0.001)
    engine2.version = engine.version
    restored = RolloutProducer(
        engine2, prompts.draw, SamplingParams(max_new_tokens=MAX_NEW, n=N, seed=3), groups_per_step=B,
        max_staleness=1, version=engine2.version, partial=True, score=lambda samples: None, concurrency=2 * B,
        next_step=3, next_serial=snap["next_serial"], pending=[GenerateRequest(**r) for r in snap["pending"]],
        buffer=[Group(g["serial"], GenerateRequest(**g["request"]), g["admitted_at"],
                      [Sample(**s) for s in g["samples"]]) for g in snap["buffer"]])
    restored.start()
    try:
        after = train(restored, engine2, steps=3, start=3)
    finally:
        restored.stop()
    again = [g.request.metadata["prompt_index"] for _, gs in after for g in gs]
    assert set(again[:len(buffered)]) == set(buffered)  # the finished groups first
    assert sorted(trained + again) == list(range(len(trained) + len(again)))  # nothing lost, nothing twice


def test_a_worker_failure_reaches_the_trainer_naming_the_producer():
    class Broken(PausingEngine):
        def generate(self, requests, sampling):
            raise RuntimeError("server exploded")

    producer = make(Broken(seed=0, delay=0.0), Prompts(), k=1, partial=True)
    producer.start()
    try:
        with pytest.raises(Exception, match="rollout producer failed: server exploded"):
            producer.take(B, 0, timeout_s=60)
    finally:
        producer.stop()


def test_take_times_out_naming_what_it_waited_for():
    class Silent(PausingEngine):
        def generate(self, requests, sampling):
            threading.Event().wait(30)
            return []

    producer = make(Silent(seed=0, delay=0.0), Prompts(), k=1, partial=True)
    producer.start()
    try:
        with pytest.raises(Exception, match=r"did not arrive within --async-wait-timeout 0.2 s \(0 finished, 6 "
                                            r"generating, gate open, engines Silent\)"):
            producer.take(B, 0, timeout_s=0.2, describe=lambda: "Silent")
    finally:
        producer.stop()


def test_a_sync_whose_abort_is_not_answered_stops_naming_the_calls_in_flight():
    """The quiesce before an abort-mode sync: an engine that neither returns its calls nor acts on the abort (a
    frozen server) ends the wait at the bound with an error naming what stayed in flight."""
    release = threading.Event()

    class Frozen(PausingEngine):
        def generate(self, requests, sampling):
            release.wait(60)
            return []

    producer = make(Frozen(seed=0, delay=0.0), Prompts(), k=1, partial=True)
    producer.start()
    aborts = []
    try:
        for _ in range(1200):  # until every worker's call is in flight (a state; the count only bounds a hang)
            if producer.depth()[1] == 2 * B:
                break
            with pytest.raises(Exception, match="did not arrive"):
                producer.take(B, 0, timeout_s=0.05)
        assert producer.depth()[1] == 2 * B
        producer.close_gate()
        with pytest.raises(Exception, match=r"6 generate call\(s\) still in flight 0.3 s after the sync began "
                                            r"aborting them; the engines do not answer /abort_request"):
            producer.quiesce(lambda: aborts.append(1), timeout_s=0.3)
        assert aborts  # it did ask
    finally:
        release.set()
        producer.stop()


def test_a_generate_function_cut_by_a_sync_is_run_again_whole():
    """--custom-generate-function-path under --async-mode full: each group comes from the user's function, which
    calls the engine twice (two turns: the second continues the first's tokens, observation tokens between
    them). A sync cutting either call starts the group again after the sync, so every trained sample is one
    uncut attempt: both turns present, no abort, each token within the staleness bound, every prompt once."""
    from megatron_rl.rollout.generate_fn import group_generate

    attempts = []

    def two_turns(request, sampling, engine):
        attempts.append(request.metadata["prompt_index"])
        first = engine.generate(request.prompt_ids, dataclasses.replace(sampling, max_new_tokens=2))
        out = []
        for turn in first:
            context = list(request.prompt_ids) + turn.output_ids + [99]  # the observation
            second = engine.generate(context, dataclasses.replace(sampling, n=1, max_new_tokens=2))[0]
            ids = turn.output_ids + [99] + second.output_ids
            out.append(Sample(request.group_index, list(request.prompt_ids), ids,
                              rollout_logprobs=turn.logprobs + [0.0] + second.logprobs,
                              loss_mask=[1] * len(turn.output_ids) + [0] + [1] * len(second.output_ids),
                              token_versions=turn.token_versions + [turn.token_versions[-1]] + second.token_versions,
                              weight_version=turn.token_versions[0],
                              finish_reason=second.finish_reason, metadata=dict(request.metadata)))
        return out

    engine, prompts = PausingEngine(seed=5, delay=0.002), Prompts()
    producer = make(engine, prompts, k=1, partial=False, generate_group=group_generate(two_turns, "two_turns"))
    producer.start()
    try:
        trained = train(producer, engine, steps=10, trainer_delay=0.005, seed=5)
    finally:
        producer.stop()
    indices = []
    for step, groups in trained:
        for g in groups:
            indices.append(g.request.metadata["prompt_index"])
            for s in g.samples:
                assert s.finish_reason != "abort" and 99 in s.response_ids
                assert s.loss_mask[s.response_ids.index(99)] == 0
                assert min(s.effective_token_versions()) >= step - 1
    assert indices == list(range(10 * B))
    assert len(attempts) > len(indices)  # some syncs cut a group, which ran again


def test_a_dynamic_sampling_filter_keeps_dropped_groups_out_of_the_buffer_and_the_bound():
    """--dynamic-sampling-filter-path under --async-mode full: the groups of odd prompts are dropped as they
    finish; every step still trains B kept groups, in admission order, within the staleness bound."""
    from megatron_rl.rollout.dynamic_sampling import DynamicFilterOutput, DynamicSampler, StreamFilter

    def even_prompts(args, samples):
        keep = samples[0].metadata["prompt_index"] % 2 == 0
        return DynamicFilterOutput(keep=keep, reason=None if keep else "odd")

    stream = StreamFilter(DynamicSampler(even_prompts, "even_prompts", over_sampling_batch_size=B, max_rounds=4),
                          None, batch_size=B)
    engine, prompts = PausingEngine(seed=5, delay=0.001), Prompts()
    producer = make(engine, prompts, k=1, partial=True, group_filter=stream)
    producer.start()
    try:
        trained = train(producer, engine, steps=6, trainer_delay=0.002, seed=5)
    finally:
        producer.stop()
    indices = [g.request.metadata["prompt_index"] for _, groups in trained for g in groups]
    assert all(len(groups) == B for _, groups in trained)
    assert indices == list(range(0, 12 * B, 2))  # the even prompts, each once, in admission order
    for step, groups in trained:
        assert all(s.staleness(step) <= 1 for g in groups for s in g.samples)
    m = stream.metrics(kept_groups=6 * B)
    assert m["rollout/filtered_groups"] >= 6 * B - 1 and m["rollout/dynamic_filter/drop_odd"] == m["rollout/filtered_groups"]


def _even_prompts_filter():
    from megatron_rl.rollout.dynamic_sampling import DynamicFilterOutput, DynamicSampler, StreamFilter

    def even_prompts(args, samples):
        keep = samples[0].metadata["prompt_index"] % 2 == 0
        return DynamicFilterOutput(keep=keep, reason=None if keep else "odd")

    return StreamFilter(DynamicSampler(even_prompts, "even_prompts", over_sampling_batch_size=B, max_rounds=4),
                        None, batch_size=B)


def _restored(snap, engine, draw, step, partial=True, **kw) -> RolloutProducer:
    """A producer rebuilt from a buffer file's snapshot, as ``full_async._build_producer`` does on a resume."""
    return RolloutProducer(
        engine, draw, SamplingParams(max_new_tokens=MAX_NEW, n=N, seed=3), groups_per_step=B, max_staleness=1,
        version=engine.version, partial=partial, score=lambda samples: None, concurrency=2 * B, next_step=step,
        next_serial=snap["next_serial"], pending=[GenerateRequest(**r) for r in snap["pending"]],
        buffer=[Group(g["serial"], GenerateRequest(**g["request"]), g["admitted_at"], [Sample(**s) for s in g["samples"]])
                for g in snap["buffer"]], **kw)


def test_dynamic_sampling_in_full_mode_resumes_exactly_after_a_kill(tmp_path):
    """--dynamic-sampling-filter-path under --async-mode full, killed after checkpoint 3 (the producer dropped with
    its calls in flight) and resumed from the buffer file: every even prompt drawn is trained exactly once, in
    admission order per run, no odd one ever, and the filter's counts go on from the file."""
    from megatron_rl.runner.buffer_file import read_buffer, write_buffer

    stream = _even_prompts_filter()
    engine, prompts = PausingEngine(seed=7, delay=0.001), Prompts()
    producer = make(engine, prompts, k=1, partial=True, group_filter=stream, position=lambda: prompts.drawn)
    producer.start()
    try:
        before = train(producer, engine, steps=3, seed=7)
        producer.close_gate()  # the checkpoint's instant
        record = write_buffer(str(tmp_path), 3, producer.snapshot())
        producer.open_gate(engine.version)
        train(producer, engine, steps=2, start=3, seed=8)  # trained after the checkpoint: lost with the kill
    finally:
        producer.stop()
    snap = read_buffer(str(tmp_path), 3, record)
    judged = snap["filter"]["generated"]
    assert judged > 0 and snap["filter"]["reasons"].get("odd", 0) == snap["filter"]["filtered"] > 0

    resumed_filter = _even_prompts_filter()
    resumed_filter.restore(snap["filter"])
    engine2 = PausingEngine(seed=9, delay=0.001)
    engine2.version = engine.version - 2  # the weights of checkpoint 3
    prompts2 = Prompts()
    prompts2.drawn = snap["state"]  # the prompt position the checkpoint records
    restored = _restored(snap, engine2, prompts2.draw, 3, group_filter=resumed_filter)
    restored.start()
    try:
        after = train(restored, engine2, steps=4, start=3, seed=9)
    finally:
        restored.stop()
    first = [g.request.metadata["prompt_index"] for _, gs in before for g in gs]
    again = [g.request.metadata["prompt_index"] for _, gs in after for g in gs]
    assert all(len(gs) == B for _, gs in before + after)
    assert all(i % 2 == 0 for i in first + again) and len(set(first + again)) == len(first + again)
    assert sorted(first + again) == list(range(0, 2 * len(first + again), 2))  # no even prompt lost, none twice
    assert resumed_filter.state()["generated"] >= judged  # counted on from the file


def test_a_batch_rollout_function_runs_in_full_mode_and_resumes_exactly_after_a_kill(tmp_path):
    """--rollout-function-path under --async-mode full: the producer calls the user's batch function on B prompts
    at a time (two engine calls per batch, an observation between), as many calls as the staleness bound admits; a
    call a sync cuts runs again whole. Killed after checkpoint 3 and resumed from the buffer file: every prompt
    trained exactly once, every sample one uncut attempt within the bound, rollout ids counting on."""
    from megatron_rl.rollout.generate_fn import RolloutFunctions
    from megatron_rl.runner.buffer_file import read_buffer, write_buffer

    calls = []

    def rollout(rollout_id, requests, sampling, engine):
        calls.append((rollout_id, [r.metadata["prompt_index"] for r in requests]))
        firsts = engine.generate_batch([r.prompt_ids for r in requests], dataclasses.replace(sampling, max_new_tokens=2))
        contexts = [list(r.prompt_ids) + g.output_ids + [99] for r, gens in zip(requests, firsts) for g in gens]
        seconds = engine.generate_batch(contexts, dataclasses.replace(sampling, n=1, max_new_tokens=2))
        out = []
        for k, (turn, (second,)) in enumerate(zip([g for gens in firsts for g in gens], seconds)):
            request = requests[k // sampling.n]
            out.append(Sample(request.group_index, list(request.prompt_ids), turn.output_ids + [99] + second.output_ids,
                              rollout_logprobs=turn.logprobs + [0.0] + second.logprobs,
                              loss_mask=[1] * len(turn.output_ids) + [0] + [1] * len(second.output_ids),
                              token_versions=turn.token_versions + [turn.token_versions[-1]] + second.token_versions,
                              weight_version=turn.token_versions[0], finish_reason=second.finish_reason,
                              metadata=dict(request.metadata)))
        return out

    functions = RolloutFunctions(batch_fn=rollout, batch_where="--rollout-function-path t:rollout")

    def generate_batch(rollout_id, requests, sampling, call):
        return functions.generate(rollout_id, requests, sampling, call)

    def check(trained):
        for step, groups in trained:
            assert len(groups) == B
            for g in groups:
                assert len(g.samples) == N
                for s in g.samples:
                    assert s.finish_reason != "abort" and s.loss_mask[s.response_ids.index(99)] == 0
                    assert min(s.effective_token_versions()) >= step - 1  # --max-staleness 1, every token
        return [g.request.metadata["prompt_index"] for _, gs in trained for g in gs]

    engine, prompts = PausingEngine(seed=11, delay=0.002), Prompts()
    producer = make(engine, prompts, k=1, partial=False, generate_batch=generate_batch,
                    position=lambda: prompts.drawn)
    producer.start()
    try:
        before = train(producer, engine, steps=3, trainer_delay=0.005, seed=11)
        producer.close_gate()  # the checkpoint's instant
        record = write_buffer(str(tmp_path), 3, producer.snapshot())
        producer.open_gate(engine.version)
        train(producer, engine, steps=2, start=3, seed=12)  # lost with the kill
    finally:
        producer.stop()
    first = check(before)
    assert first == list(range(3 * B))  # admission order: the batches' prompts in draw order
    assert all(ids == list(range(rid * B, rid * B + B)) for rid, ids in calls)  # rollout_id numbers the batches

    snap = read_buffer(str(tmp_path), 3, record)
    assert len(snap["pending"]) % B == 0 and snap["next_serial"] % B == 0
    engine2 = PausingEngine(seed=13, delay=0.002)
    engine2.version = engine.version - 2  # the weights of checkpoint 3
    prompts2 = Prompts()
    prompts2.drawn = snap["state"]
    calls.clear()
    restored = _restored(snap, engine2, prompts2.draw, 3, partial=False, generate_batch=generate_batch)
    restored.start()
    try:
        again = check(train(restored, engine2, steps=4, start=3, trainer_delay=0.005, seed=13))
    finally:
        restored.stop()
    assert sorted(first + again) == list(range(len(first) + len(again)))  # nothing lost, nothing twice
    assert min(rid for rid, _ in calls) == snap["next_serial"] // B  # the resumed run's calls count on
