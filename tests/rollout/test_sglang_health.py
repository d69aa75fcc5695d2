"""SGLang engine faults, sync hygiene and stale-sample accounting, against the in-process stand-in.

Real parts: ``SGLangEngine`` / ``SGLangClient`` / ``HealthMonitor`` over HTTP, the disk and
distributed transports, ``RolloutManager``, and the protocol-exact stand-in server
(tests/rollout/sglang_standin.py, in this process). Two stand-in variants defined here only
observe or trim the protocol: ``RecordingStandIn`` records each request's path and body in order,
``NoPauseStandIn`` plays an SGLang without ``/pause_generation`` (FastAPI's 404, as the stand-in's
``legacy`` mode does for the begin/end pair). Most tests drive the monitor by ``poll_health()``
(``health_interval_s=0``: no thread), so they do not depend on timing. Every other wait is for a
state (a request pending on the server, a refused flush, a thread waiting on the update) with a
hang bound only, and health polls get a timeout that a slow reply cannot reach by load alone
(a failed poll is made by a dropped connection or a reply that never comes, not by a short timeout).
"""

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import parse_config
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import GenerateRequest, SamplingParams
from megatron_rl.rollout.batch_builder import weight_version_metrics
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.sglang import SGLangClient, SGLangEngine
from megatron_rl.weight_sync.distributed import DistributedSynchronizer

from sglang_standin import SGLangStandIn  # tests/ is on sys.path (conftest)

REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42], 1)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
NOTE = "engine 1 on node 0, log /logs/engine_1.log"
CONTROL = ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weights_from_disk",
           "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update", "/model_info")


class RecordingStandIn(SGLangStandIn):
    """The stand-in, recording ``(path, body)`` of every request it handles, in arrival order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self.before = {}  # path -> a callable run (once) before that request is answered

    def handle(self, method, path, body):
        self.calls.append((path, body))
        hook = self.before.pop(path, None)
        if hook is not None:
            hook()
        return super().handle(method, path, body)

    def control(self):
        """The sync-related calls, in order (generate and health left out)."""
        return [p for p, _ in self.calls if p in CONTROL]


class NoPauseStandIn(RecordingStandIn):
    """An SGLang without ``/pause_generation`` / ``/continue_generation``: FastAPI's 404."""

    def handle(self, method, path, body):
        if path in ("/pause_generation", "/continue_generation"):
            self.calls.append((path, body))
            return 404, {"detail": "Not Found"}
        return super().handle(method, path, body)


@pytest.fixture
def model(tiny_hf_models):
    return tiny_hf_models("qwen2")


@pytest.fixture
def weights(model):
    return load_file(f"{model}/model.safetensors")


def make_engine(server, tmp_path, **kwargs):
    options = dict(weight_dir=str(tmp_path / "weights"), hf_checkpoint=server.model_path, timeout_s=60,
                   connect_retries=0, health_interval_s=0, health_timeout_s=60, server_notes={server.url: NOTE})
    options.update(kwargs)
    return SGLangEngine([server.url], **options)


def wait_for(predicate, what: str, timeout_s=120.0):
    """Wait for a state; the timeout only bounds a hang (and names it)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"hung: {what} not reached within {timeout_s:.0f} s"
        time.sleep(0.01)


def when(predicate, action, what: str) -> threading.Thread:
    """Run ``action`` on a thread once ``predicate`` holds (a state the test's own call is blocked in)."""
    def run():
        wait_for(predicate, what)
        action()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_server_failing_its_health_polls_is_declared_dead_and_named(model, weights, tmp_path, monkeypatch):
    server = SGLangStandIn(model).start()
    engine = make_engine(server, tmp_path)
    try:
        server.faults.drop["/health"] = 1  # one failed poll is not a death (was: a reply slower than a 0.3 s
        engine.poll_health()  # timeout, which a busy machine's ordinary replies could reach too)
        assert server.faults.drop["/health"] == 0
        engine.poll_health()
        engine.poll_health()
        assert engine.dead_servers() == []
        server.stop()
        engine.poll_health()
        engine.poll_health()
        assert engine.dead_servers() == []  # 2 of 3
        engine.poll_health()
        assert engine.dead_servers() == [server.url]
        sent = []  # at once: no request to the dead server (was: 'took < 0.5 s')
        monkeypatch.setattr(engine.clients[0], "request", lambda *a, **k: sent.append(a))
        for call in (lambda: engine.generate(REQUESTS, GREEDY), lambda: engine.update_weights(weights.items(), 1)):
            with pytest.raises(EngineError) as err:
                call()
            assert sent == []
            message = str(err.value)
            assert server.url in message and NOTE in message and "connection refused" in message, message
            assert "3 times in a row" in message
        monkeypatch.undo()
        health = engine.health()
        assert not health.ok and NOTE in health.detail

        # it comes back at the engine's weight version (0): used again after the next poll
        server.start()
        engine.poll_health()
        assert engine.dead_servers() == []
        assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {0}

        # a restart: a fresh server on the same port serves its initial weights ("default") while the engine
        # is at version 1, so the engine refuses to generate until a complete update heals it
        engine.update_weights(weights.items(), 1)
        server.stop()
        for _ in range(3):
            engine.poll_health()
        port = int(server.url.rsplit(":", 1)[1])
        server = SGLangStandIn(model, port=port).start()
        engine.poll_health()
        with pytest.raises(EngineError, match="reports weight_version 0, the engine is at 1: it restarted"):
            engine.generate(REQUESTS, GREEDY)
        with pytest.raises(EngineError, match="it restarted with other weights; send a complete update"):
            engine.generate(REQUESTS, GREEDY)
        engine.update_weights(weights.items(), 2)
        assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {2}
    finally:
        engine.close()
        server.stop()


def test_the_monitor_thread_polls_pauses_while_released_or_updating_and_stops_on_close(model, weights, tmp_path):
    with RecordingStandIn(model) as server:
        engine = make_engine(server, tmp_path, health_interval_s=0.02)
        try:
            wait_for(lambda: server.requests["/health"] >= 3, "3 health polls")
            engine.release()
            polls = server.requests["/health"]
            assert engine.poll_health() is False  # a round while released (the thread's too) polls nothing
            assert server.requests["/health"] == polls  # none while released
            engine.resume()
            wait_for(lambda: server.requests["/health"] >= polls + 2, "2 health polls after resume")
            # the load waits until the monitor thread has had 3 rounds in which it could have polled (was: a
            # 0.3 s delay, which proves nothing where the thread got no CPU meanwhile)
            rounds, loading = [], []
            original = engine._monitor.poll
            engine._monitor.poll = lambda: rounds.append(original()) or rounds[-1]

            def three_rounds_during_the_load():
                start = len(rounds)
                wait_for(lambda: rounds[start:].count(False) >= 3, "3 monitor rounds during the load")
                loading.extend(rounds[start + 1:])  # the first may have ended as the pause began

            server.before["/update_weights_from_disk"] = three_rounds_during_the_load
            engine.update_weights(weights.items(), 1)
            assert len(loading) >= 2 and True not in loading  # paused for the update: nothing polled
            paths = [p for p, _ in server.calls]
            between = paths[paths.index("/pause_generation"):paths.index("/continue_generation")]
            assert "/update_weights_from_disk" in between and "/health" not in between
            wait_for(lambda: paths.count("/health") < [p for p, _ in server.calls].count("/health"),
                     "a health poll after the update")
        finally:
            engine.close()
        assert not engine._monitor._thread.is_alive()  # the thread is gone


def test_a_generate_waiting_on_a_server_declared_dead_is_abandoned_not_hung(model, tmp_path):
    with SGLangStandIn(model) as server:
        server.faults.delay_s["/generate:row"] = 300.0  # the rows do not finish before the test ends...
        engine = make_engine(server, tmp_path, health_interval_s=0.02, health_failures=2, generate_timeout_s=600)
        try:
            wait_for(lambda: server.requests["/health"] >= 1, "a health poll")
            # ...and once they are in flight the server stops answering its health checks. Was: a 5 s /health
            # delay against a 0.2 s timeout set before the generate, which let a busy machine declare the server
            # dead before the generate was sent, and 'took < 3 s'; a generate not abandoned now fails by the
            # message (it would end only at the 600 s generate timeout, a hang bound)
            when(lambda: server.pending_count() > 0, lambda: server.faults.drop.update({"/health": 10 ** 9}),
                 "the generate in flight on the server")
            with pytest.raises(EngineError) as err:
                engine.generate(REQUESTS, GREEDY)
            message = str(err.value)
            assert "declared dead while its /generate was in flight" in message and NOTE in message, message
            assert "connection dropped without a reply" in message
            assert engine.dead_servers() == [server.url]
        finally:
            engine.close()


def test_a_connection_cut_mid_generate_names_the_server_and_its_log(model, tmp_path):
    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path, connect_retries=1, backoff_s=0.05)
        try:
            server.faults.die_on = "/generate"
            with pytest.raises(EngineError) as err:
                engine.generate(REQUESTS, GREEDY)
            message = str(err.value)
            assert server.url in message and NOTE in message and "POST /generate" in message, message
            assert err.value.kind == "unreachable" and "likely died" in message
        finally:
            engine.close()


def test_disk_update_pauses_loads_flushes_checks_and_continues_in_order(model, weights, tmp_path):
    with RecordingStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        try:
            engine.update_weights(weights.items(), 1)
            assert server.control() == ["/pause_generation", "/update_weights_from_disk", "/flush_cache",
                                        "/model_info", "/continue_generation"]
            bodies = dict(server.calls)
            assert bodies["/pause_generation"] == {"mode": "abort"}
            assert bodies["/update_weights_from_disk"]["flush_cache"] is False  # flushed after, with retries
            # a failed load: still continued, and the engine refuses to generate
            server.calls.clear()
            with pytest.raises(SyncError, match="unknown name"):
                engine.update_weights({"model.not_a_tensor": torch.zeros(3)}.items(), 2)
            assert server.control() == ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
            with pytest.raises(EngineError, match="last weight update failed"):
                engine.generate(REQUESTS, GREEDY)
        finally:
            engine.close()


def test_a_server_without_pause_generation_is_updated_without_it(model, weights, tmp_path):
    with NoPauseStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        try:
            engine.update_weights(weights.items(), 1)
            engine.update_weights(weights.items(), 2)
            assert server.control() == ["/pause_generation", "/update_weights_from_disk", "/flush_cache",
                                        "/model_info", "/update_weights_from_disk", "/flush_cache", "/model_info"]
            assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {2}
        finally:
            engine.close()


def test_a_flush_refused_while_requests_are_pending_is_retried_then_reported(model, weights, tmp_path):
    """A server without /pause_generation keeps another client's request running through the update, so SGLang
    refuses to flush (400) until it ends."""
    with NoPauseStandIn(model) as server:
        engine = make_engine(server, tmp_path, flush_retry_s=0.6)
        other = SGLangClient(server.url, connect_retries=0)  # an eval or partial rollout on the same server
        try:
            server.faults.delay_s["/generate:row"] = 30.0
            pending = threading.Thread(target=other.generate, args=([[1, 2, 3]], [{"max_new_tokens": 2}]))
            pending.start()
            wait_for(lambda: server.pending_count() == 1, "the other client's request pending")
            with pytest.raises(SyncError) as err:  # after flush_retry_s of refusals (was also: 'took < 3 s')
                engine.update_weights(weights.items(), 1)
            message = str(err.value)
            assert server.url in message and NOTE in message and "/flush_cache" in message, message
            assert "Flush cache failed." in message and "no /pause_generation" in message
            assert server.requests["/flush_cache"] >= 3  # retried with backoff
            assert server.control().count("/pause_generation") == 1  # its 404 remembered; nothing left paused
            with pytest.raises(EngineError, match="left a cache unflushed"):
                engine.generate(REQUESTS, GREEDY)
            engine.abort()
            pending.join(60)

            # the same with the request ending during the retries: the update completes. The abort comes once a
            # flush was refused (was: a 0.2 s timer, which a busy machine could fire after the 0.6 s of retries)
            engine.flush_retry_s = 600  # a hang bound: the abort ends the refusals
            pending = threading.Thread(target=other.generate, args=([[1, 2, 3]], [{"max_new_tokens": 2}]))
            pending.start()
            wait_for(lambda: server.pending_count() == 1, "the other client's request pending")
            refused = server.requests["/flush_cache"]
            when(lambda: server.requests["/flush_cache"] > refused, engine.abort, "a refused flush")
            engine.update_weights(weights.items(), 2)
            pending.join(60)
            server.faults.delay_s.pop("/generate:row")
            assert engine.weight_version == 2
            assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {2}
        finally:
            other.close()
            engine.close()


def test_an_in_place_pause_keeps_a_running_request_and_its_cache_through_the_update(model, weights, tmp_path):
    """pause_mode in_place (--pause-generation-mode in_place): the request running on the server stays there with
    its KV cache, which SGLang would refuse to flush while it runs, so the update sends no /flush_cache."""
    with RecordingStandIn(model) as server:
        engine = make_engine(server, tmp_path, pause_mode="in_place")
        other = SGLangClient(server.url, connect_retries=0)  # a row of the producer in flight
        try:
            server.faults.delay_s["/generate:row"] = 30.0
            pending = threading.Thread(target=other.generate, args=([[1, 2, 3]], [{"max_new_tokens": 2}]))
            pending.start()
            wait_for(lambda: server.pending_count() == 1, "the request pending")
            engine.update_weights(weights.items(), 1)
            assert server.control() == ["/pause_generation", "/update_weights_from_disk", "/model_info",
                                        "/continue_generation"]
            assert [b for p, b in server.calls if p == "/pause_generation"] == [{"mode": "in_place"}]
            assert server.pending_count() == 1 and engine.weight_version == 1  # still running, not aborted
            engine.abort()
            pending.join(60)
        finally:
            other.close()
            engine.close()


class BucketBackend:
    """The trainer side of a sync: exports ``tensors`` two per bucket."""

    def __init__(self, tensors):
        self.tensors = list(tensors.items())

    def export_weights(self, bucket_bytes):
        for i in range(0, len(self.tensors), 2):
            yield self.tensors[i:i + 2]


def test_distributed_sync_is_wrapped_in_pause_and_continue_and_flushes_with_its_last_bucket(model, weights,
                                                                                           tmp_path):
    with RecordingStandIn(model, group_timeout_s=20) as server:
        engine = make_engine(server, tmp_path)
        sync = DistributedSynchronizer(bucket_bytes=1, timeout_s=20)
        try:
            sync.sync(BucketBackend(weights), engine, version=1)
            control = server.control()
            assert control[:2] == ["/pause_generation", "/begin_weight_update"], control
            assert control[-3:] == ["/end_weight_update", "/model_info", "/continue_generation"], control
            assert "/flush_cache" not in control  # the last bucket carried flush_cache
            updates = [body for path, body in server.calls if path == "/update_weights_from_distributed"]
            assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
            assert engine.weight_version == 1
            assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {1}
        finally:
            sync.shutdown()
            engine.close()


def test_a_generate_during_an_update_waits_on_another_thread_and_is_refused_on_the_updating_one(model, tmp_path):
    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path, update_timeout_s=10)
        try:
            engine.begin_update(1)
            with pytest.raises(EngineError, match="update to version 1 has begun"):  # it would wait on itself
                engine.generate(REQUESTS, GREEDY)
            result = {}
            waiting = threading.Thread(target=lambda: result.update(out=engine.generate(REQUESTS, GREEDY)))
            waiting.start()
            # held until the update ends: it waits on the update's condition (was: alive after a 0.3 s sleep)
            wait_for(lambda: len(engine._update_ended._waiters) == 1, "the generate waiting on the update")
            assert waiting.is_alive() and "out" not in result and server.requests["/generate"] == 0
            engine.end_update()
            waiting.join(120)
            assert len(result["out"]) == 2
            engine.update_timeout_s = 0.3
            engine.begin_update(1)
            failed = threading.Thread(target=lambda: result.update(err=pytest.raises(EngineError, engine.generate,
                                                                                      REQUESTS, GREEDY)))
            failed.start()
            failed.join(120)
            assert "begun by another thread has not ended within 0.3 s" in str(result["err"].value)
            engine.end_update()
        finally:
            engine.close()


def _manager(model, tmp_path, engine, reward, *extra):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n" for i in range(4)))
    cfg = parse_config(["--hf-checkpoint", model, "--prompt-data", str(prompts_file), "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "3", *extra])
    prompts = PromptIterator(PromptDataset(cfg.data.prompt_data), rollout_batch_size=2, n_samples_per_prompt=2,
                             shuffle=False, seed=1)
    return RolloutManager(cfg, engine, prompts, reward)


def test_rows_aborted_by_an_update_are_generated_again_with_the_new_weights(model, weights, tmp_path):
    """An update lands while a rollout is generating: its pause aborts the rows; their groups are generated
    again (the retry waits for the other thread's update to end), so nothing cut short is trained on and every
    sample comes from version 1; the aborts are counted."""
    updated = threading.Event()

    def reward(samples):
        assert updated.wait(120), "hung: the update did not finish"  # a hang bound
        return [0.0] * len(samples)

    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        manager = _manager(model, tmp_path, engine, reward)
        result = {}
        try:
            server.faults.delay_s["/generate:row"] = 30.0
            rollout = threading.Thread(target=lambda: result.update(out=manager.generate(0)))
            rollout.start()
            wait_for(lambda: server.pending_count() > 0, "the rollout's rows pending")
            server.faults.delay_s.pop("/generate:row")  # the pending rows keep their 30 s; the retries run at once
            engine.update_weights(weights.items(), 1)
            updated.set()
            rollout.join(120)  # a hang bound
            samples, metrics = result["out"]
            assert [s.group_index for s in samples] == [0, 0, 1, 1]
            assert {s.finish_reason for s in samples} <= {"stop", "length"}
            assert {s.weight_version for s in samples} == {1}
            assert metrics["rollout/aborted_samples"] == 4.0 and metrics["rollout/abort_retried_groups"] == 2.0
            assert metrics["rollout/stale_samples"] == 0.0 and metrics["rollout/mixed_version_samples"] == 0.0
            samples, metrics = manager.generate(1)  # the next rollout: nothing aborted
            assert metrics["rollout/aborted_samples"] == metrics["rollout/abort_retried_groups"] == 0.0
        finally:
            updated.set()
            engine.close()


def test_a_group_with_an_aborted_sample_is_generated_again_whole_in_place(model, tmp_path):
    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        manager = _manager(model, tmp_path, engine, lambda samples: [0.0] * len(samples))
        try:
            server.faults.abort_rows = 1  # the first row of the first group: that group (both samples) again
            served = len(server.rids_served)
            samples, metrics = manager.generate(0)
            assert [s.group_index for s in samples] == [0, 0, 1, 1]
            assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 1, 1]
            assert all(s.finish_reason != "abort" and s.response_ids for s in samples)
            assert metrics["rollout/aborted_samples"] == 1.0 and metrics["rollout/abort_retried_groups"] == 1.0
            assert len(server.rids_served) - served == 4 + 2  # the rollout, then one group of 2 again
        finally:
            engine.close()


def test_a_group_still_aborted_after_its_retries_stops_the_rollout_naming_prompt_and_message(model, tmp_path):
    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        manager = _manager(model, tmp_path, engine, lambda samples: [0.0] * len(samples),
                           "--rollout-abort-retries", "1")
        try:
            server.faults.abort_rows = 4 + 4  # every row of the rollout and of its one retry
            with pytest.raises(EngineError) as err:
                manager.generate(0)
            text = str(err.value)
            assert "2 prompt group(s) still had aborted samples after 1 retry (--rollout-abort-retries)" in text
            assert "group 0 (prompt_index 0, line 1; 3 prompt tokens): Aborted | group 1 (prompt_index 1" in text
            assert "/abort_request" in text and "--rollout-abort-retries" in text
        finally:
            engine.close()


def test_a_generate_answered_503_is_generated_again_and_names_the_servers_words_when_it_persists(model, tmp_path):
    """SGLang fails a whole non-streamed /generate with 503 when it aborts a row with a status (a decode
    retraction without a KV backup: "Retry later."): the request's rows count as aborted, their groups are
    generated again; still 503 after the retries, the error carries the server's message."""
    with SGLangStandIn(model) as server:
        engine = make_engine(server, tmp_path)
        manager = _manager(model, tmp_path, engine, lambda samples: [0.0] * len(samples),
                           "--rollout-abort-retries", "1")
        try:
            server.faults.unavailable_generates = 1  # the rollout's one batched request; its retry is served
            samples, metrics = manager.generate(0)
            assert [s.group_index for s in samples] == [0, 0, 1, 1]
            assert all(s.finish_reason != "abort" and s.response_ids for s in samples)
            assert metrics["rollout/aborted_samples"] == 4.0 and metrics["rollout/abort_retried_groups"] == 2.0
            server.faults.unavailable_generates = 2  # the rollout and its one retry
            with pytest.raises(EngineError) as err:
                manager.generate(1)
            text = str(err.value)
            assert "2 prompt group(s) still had aborted samples after 1 retry" in text
            assert ("answered 503: Retracted under decode memory pressure without a KV backup. Retry later." in text)
            assert "--sglang-mem-fraction-static" in text
        finally:
            engine.close()


def test_weight_version_metrics_count_mixed_and_stale_samples():
    def sample(version, spans=None, finish="length"):
        metadata = {"weight_version_spans": spans} if spans else {}
        return Sample(group_index=0, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1.0, -1.0],
                      weight_version=version, finish_reason=finish, metadata=metadata)

    samples = [sample(3), sample(2, spans=[[2, 0, 1], [3, 1, 2]]), sample(1, finish="abort"), sample(3)]
    assert weight_version_metrics(samples, current_version=3) == {
        "rollout/stale_samples": 2.0, "rollout/weight_version_min": 1.0, "rollout/weight_version_max": 3.0,
        "rollout/mixed_version_samples": 1.0, "rollout/staleness_mean": 0.75, "rollout/staleness_max": 2.0}


def test_constructor_refuses_what_it_cannot_honour():
    with pytest.raises(ConfigError, match=r"server_notes name \['http://elsewhere:1'\]"):
        SGLangEngine(["http://a:1"], server_notes={"elsewhere:1": "x"}, health_interval_s=0)
    with pytest.raises(ConfigError, match="pause_mode 'drain'"):
        SGLangEngine(["http://a:1"], pause_mode="drain", health_interval_s=0)
    with pytest.raises(ConfigError, match="health monitor"):
        SGLangEngine(["http://a:1"], health_failures=0)
    engine = SGLangEngine(["a:1/"], server_notes={"http://a:1": NOTE}, health_interval_s=0)
    assert engine.urls == ["http://a:1"] and engine.clients[0].label == f"SGLang server http://a:1 ({NOTE})"
    engine.close()
