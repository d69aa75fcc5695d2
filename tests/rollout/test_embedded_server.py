"""The embedded engine server (``--embedded-engine-ranks process``) through the real SGLang client code.

Every situation is made from state: ``step_boundary_hook`` blocks the generating thread at a known step
until the server's ``state()`` shows what the test arranged (rows queued, an update waiting), and the
pause or abort is sent from the hook itself, so it lands at exactly that step.
"""

import os
import signal
import threading

import pytest

from _util import InThread
from megatron_rl.errors import EngineError, MegatronRLError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded import EngineRow
from megatron_rl.rollout.embedded_process import start_server
from megatron_rl.rollout.embedded_server import EmbeddedServer
from megatron_rl.rollout.sglang import protocol
from megatron_rl.rollout.sglang.client import SGLangClient
from megatron_rl.rollout.sglang.engine import SGLangEngine

BOUND_S = 300  # only a bound on a broken test; nothing waits for it to pass
SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=8, seed=11, n=2, ignore_eos=True)


@pytest.fixture
def server(models):
    srv = EmbeddedServer(EmbeddedEngine(models[0]), model_path=models[0]).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    engine = SGLangEngine([server.url], releases_memory=False, health_interval_s=0)
    yield engine
    engine.close()


def until(predicate, what):
    """Wait (bounded) for a state another thread brings about; the bound only ends a broken test."""
    done = threading.Event()
    for _ in range(BOUND_S * 100):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError(f"never happened: {what}")


def hook_at(server, step, action):
    """Run ``action`` once, in the generating thread, at step boundary ``step`` of the first batch."""
    fired = []

    def hook(at):
        if at == step and not fired:
            fired.append(at)
            action()

    server.engine.step_boundary_hook = hook


def row(prompt, seed, rid, max_new_tokens=8):
    return prompt, {**protocol.sampling_params_dict(SAMPLING, seed=seed), "max_new_tokens": max_new_tokens}, rid


def test_rows_of_concurrent_requests_share_one_batch_and_equal_the_engines_own(server, client, models):
    """Requests arriving while a batch runs join it at the next step (continuous batching); every row's tokens
    are the ones the engine's own ``generate`` gives for the same prompt and seed (log-probs to float32
    rounding), and each request returns when its own rows end."""
    first, later = [GenerateRequest([5, 17, 3], 0)], [GenerateRequest([9, 1, 100, 42], 1),
                                                      GenerateRequest([11, 12, 13, 14, 15], 2)]
    # the first request's rows wait at their second step until both later requests arrived (queued, or
    # already taken into the batch at that step's boundary)
    hook_at(server, 1, lambda: until(lambda: server.state()["batched_rows"] + server.state()["queued"] == 6,
                                     "the two later requests arrived"))
    a = InThread(lambda: client.generate(first, SAMPLING), bound_s=BOUND_S, what="request a")
    until(lambda: server.state()["running"] == 2, "the first batch running")
    b = InThread(lambda: client.generate(later[:1], SAMPLING), bound_s=BOUND_S, what="request b")
    c = InThread(lambda: client.generate(later[1:], SAMPLING), bound_s=BOUND_S, what="request c")
    got = {0: a.result(), 1: b.result(), 2: c.result()}
    # a request returns when its rows finish, a moment before the scheduler counts the batch as ended
    until(lambda: server.state()["batches"] >= 1, "the scheduler counted the batch")
    state = server.state()
    assert state["batches"] == 1 and state["most_rows"] == 6  # b's and c's rows joined a's running batch
    reference = EmbeddedEngine(models[0])
    for req in first + later:
        want = reference.generate([req], SAMPLING)
        for s, w in zip(got[req.group_index], want):
            assert s.response_ids == w.response_ids and s.finish_reason == w.finish_reason
            assert max(abs(x - y) for x, y in zip(s.rollout_logprobs, w.rollout_logprobs)) < 1e-5
            assert s.weight_version == 0 and s.token_versions == []
            tok = reference.tokenizer  # the tiny models have none: no text to send
            assert s.response_text == (tok.decode(w.response_ids, skip_special_tokens=True) if tok else "")


def test_abort_pause_ends_running_rows_with_their_tokens_queued_rows_empty_and_holds_new_ones(server, models):
    http = SGLangClient(server.url)
    rows = [row([5, 17, 3], 1, "run-0"), row([9, 1, 100], 2, "run-1")]

    def pause_when_b_queued():
        until(lambda: server.state()["queued"] == 1, "request b queued")
        http.pause_generation("abort")

    hook_at(server, 3, pause_when_b_queued)
    a = InThread(lambda: http.generate(*map(list, zip(*[(p, sp) for p, sp, _ in rows])),
                                       rids=[r for _, _, r in rows]), bound_s=BOUND_S, what="request a")
    until(lambda: server.state()["running"] == 2, "the first batch running")
    # another temperature: it cannot join the running rows, so it waits in the queue behind them
    other = {**rows[0][1], "temperature": 0.5}
    b = InThread(lambda: http.generate([[7, 7, 7]], [other], rids=["queued"]), bound_s=BOUND_S, what="b")
    for entry in a.result():  # cut at the pause: three tokens each, "abort"
        out = protocol.parse_generate_output(entry, where="test")
        assert out.finish_reason == "abort" and len(out.output_ids) == 3
    queued = protocol.parse_generate_output(b.result()[0], where="test")
    assert queued.finish_reason == "abort" and queued.output_ids == []
    # paused: a new request waits in the queue until continue
    c = InThread(lambda: http.generate([[5, 17, 3]], [rows[0][1]], rids=["after"]), bound_s=BOUND_S, what="c")
    until(lambda: server.state()["queued"] == 1, "request c queued while paused")
    until(lambda: server.state()["batches"] == 1, "the aborted batch counted (just after its rows answered)")
    assert server.state()["queued"] == 1 and server.state()["batches"] == 1  # paused: c waits, no batch starts
    http.continue_generation()
    after = protocol.parse_generate_output(c.result()[0], where="test")
    assert after.finish_reason == "length" and len(after.output_ids) == 8
    whole = EmbeddedEngine(models[0]).generate_rows([EngineRow([5, 17, 3], 1, 8)],
                                                    SamplingParams(temperature=0.9, ignore_eos=True))[0]
    assert after.output_ids == whole.response_ids  # an aborted row's seed replays whole after continue


def test_abort_request_by_rid_cuts_that_row_alone(server):
    http = SGLangClient(server.url)
    rows = [row([5, 17, 3], 1, "keep"), row([9, 1, 100], 2, "cut")]
    hook_at(server, 2, lambda: http.abort_request("cut"))
    entries = http.generate([p for p, _, _ in rows], [sp for _, sp, _ in rows], rids=[r for _, _, r in rows])
    keep, cut = (protocol.parse_generate_output(e, where="test") for e in entries)
    assert keep.finish_reason == "length" and len(keep.output_ids) == 8
    assert cut.finish_reason == "abort" and len(cut.output_ids) == 3  # the step running at the abort is kept


def test_retract_pause_update_and_continue_give_each_token_its_version(server, client, models):
    """The partial-rollout path SGLang offers: pause (retract), load version 1 from disk, continue; the row
    carries version "0" spans then "1" spans, which the client turns into per-token versions."""
    http = client.clients[0]

    def update_at_step_3():
        http.pause_generation("retract")
        until(lambda: server.engine.paused == "retract", "the pause")
        # the generating thread parks at its next boundary: the update must come from another thread
        threading.Thread(target=lambda: (http.update_weights_from_disk(models[1], weight_version="1"),
                                         http.continue_generation()), daemon=True).start()

    hook_at(server, 3, update_at_step_3)
    samples = client.generate([GenerateRequest([5, 17, 3], 0)], SAMPLING)
    for s in samples:
        assert s.effective_token_versions() == [0, 0, 0] + [1] * 5
        assert s.weight_version == 0 and s.staleness(1) == 1
    assert http.model_info()["weight_version"] == "1"


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_the_engines_own_sync_keeps_a_row_in_flight_across_the_update(server, models, mode):
    """--pause-generation-mode retract / in_place through the whole client sync (``update_weights_from_disk``:
    pause in that mode, load, the flush where SGLang allows it, the version check, continue) while a generate is in
    flight: the row is neither aborted nor resubmitted, its first 3 tokens are version 0's, the rest version 1's."""
    engine = SGLangEngine([server.url], releases_memory=False, health_interval_s=0, pause_mode=mode)
    sync = []
    go_on = server.engine.continue_

    def continue_once_parked():  # the sync's /continue_generation: only once the row is parked (it must be)
        server.engine.wait_paused(BOUND_S)
        go_on()

    def sync_at_step_3():  # the update comes from another thread; this (generating) one parks once it paused
        sync.append(InThread(lambda: engine.update_weights_from_disk(models[1], 1), bound_s=BOUND_S, what="sync"))
        until(lambda: server.engine.paused == mode, "the sync's pause")

    server.engine.continue_ = continue_once_parked
    hook_at(server, 3, sync_at_step_3)
    try:
        samples = engine.generate([GenerateRequest([5, 17, 3], 0)], SAMPLING)
        sync[0].result()
        until(lambda: server.state()["batches"] == 1, "the batch ended")
        assert engine.weight_version == 1 and server.state()["batched_rows"] == 2  # nothing resubmitted
    finally:
        server.engine.continue_ = go_on
        engine.close()
    whole = EmbeddedEngine(models[0]).generate([GenerateRequest([5, 17, 3], 0)], SAMPLING)
    for s, w in zip(samples, whole):
        assert s.finish_reason == "length" and s.effective_token_versions() == [0] * 3 + [1] * 5
        assert s.response_ids[:3] == w.response_ids[:3] and s.staleness(1) == 1


def test_an_update_without_a_pause_waits_for_the_running_batch(server, models):
    http = SGLangClient(server.url)
    hook_at(server, 2, lambda: until(lambda: server.state()["updating"] == 1, "the update waiting"))
    gen = InThread(lambda: http.generate([[5, 17, 3]], [row([5], 1, "x")[1]], rids=["x"]), bound_s=BOUND_S,
                   what="the generate")
    until(lambda: server.state()["running"] == 1, "the batch running")
    upd = InThread(lambda: http.update_weights_from_disk(models[1], weight_version="1"), bound_s=BOUND_S,
                   what="the update")
    out = protocol.parse_generate_output(gen.result()[0], where="test")
    upd.result()
    assert {span[0] for span in out.weight_version_spans} == {0} and len(out.output_ids) == 8
    assert server.engine.weight_version == 1 and http.model_info()["weight_version"] == "1"


def test_refusals_name_what_this_server_serves(server):
    http = SGLangClient(server.url)
    with pytest.raises(MegatronRLError, match="token ids, not text"):
        http.request("POST", "/generate", {"text": "hi", "sampling_params": {}})
    with pytest.raises(MegatronRLError, match="n must be 1"):
        http.generate([[1, 2]], [{"n": 2}])
    with pytest.raises(MegatronRLError, match="top_p must be in"):
        http.generate([[1, 2]], [{"top_p": 0.0}])
    with pytest.raises(MegatronRLError, match="weights: from disk only"):
        http.request("POST", "/update_weights_from_tensor", {})
    with pytest.raises(MegatronRLError, match="numbers versions with integers"):
        http.update_weights_from_disk("/nowhere", weight_version="v2")
    with pytest.raises(MegatronRLError, match="no \\*.safetensors"):
        http.update_weights_from_disk("/nowhere", weight_version="2")
    assert server.engine.weight_version == 0


def test_weights_checker_sees_an_update_that_restores_every_tensor(server, models):
    http = SGLangClient(server.url)
    http.check_weights("snapshot")
    http.check_weights("reset_tensors")
    http.update_weights_from_disk(models[0], weight_version="0")  # every tensor back: equal again
    http.check_weights("compare")
    http.check_weights("snapshot")
    http.check_weights("reset_tensors")
    with pytest.raises(EngineError, match="check tensor equality failed: 51 tensor.*embed_tokens"):
        http.check_weights("compare")


def test_the_server_process_starts_serves_and_stops_and_a_bad_model_is_named(models, tmp_path):
    """Also: the server process frozen (SIGSTOP: it accepts connections and never answers, as a hung engine) at
    each phase of a step it meets (generate, the sync's pause, the sync's disk load, a colocated resume, health, a
    colocated release):
    every call returns within its own timeout with an error naming the server, the endpoint and the timeout, and
    the health poll declares it dead."""
    process = start_server(models[0], str(tmp_path / "engine.log"), timeout_s=BOUND_S)
    try:
        engine = SGLangEngine([process.url], releases_memory=False, health_interval_s=0)
        assert [len(s.response_ids) for s in engine.generate([GenerateRequest([5, 17, 3], 0)], SAMPLING)] == [8, 8]
        engine.close()
        short = SGLangEngine([process.url], releases_memory=True, health_interval_s=0, timeout_s=0.5,
                             generate_timeout_s=0.5, update_timeout_s=0.5, connect_retries=0, health_timeout_s=0.5,
                             health_failures=1)
        os.kill(process.proc.pid, signal.SIGSTOP)
        try:
            loader = SGLangClient(process.url, timeout_s=0.5, connect_retries=0)  # the sync's load, past its pause
            calls = {"/generate": lambda: short.generate([GenerateRequest([5, 17, 3], 0)], SAMPLING),
                     "/pause_generation": lambda: short.update_weights_from_disk(models[1], 1),
                     "/update_weights_from_disk": lambda: loader.update_weights_from_disk(
                         models[1], weight_version="1", flush_cache=False, timeout_s=0.5),
                     # the colocated resume's call, as SGLangEngine.resume sends it (update_timeout_s)
                     "/resume_memory_occupation": lambda: loader.resume_memory_occupation(["weights"], timeout_s=0.5)}
            for endpoint, call in calls.items():
                with pytest.raises(MegatronRLError) as err:
                    InThread(call, bound_s=BOUND_S, what=endpoint).result()
                assert process.url in str(err.value) and f"did not answer POST {endpoint} within 0.5 s" in str(
                    err.value), str(err.value)
            short.poll_health()
            assert process.url in short.dead_servers()
            with pytest.raises(MegatronRLError, match="did not answer POST /release_memory_occupation within 0.5 s"):
                InThread(short.release, bound_s=BOUND_S, what="the colocated release").result()
        finally:
            os.kill(process.proc.pid, signal.SIGCONT)
            short.close()
    finally:
        process.stop(grace_s=10)
    assert not process.alive()
    with pytest.raises(EngineError, match="(?s)exited with code 2 while starting.*no config.json"):
        start_server(str(tmp_path), str(tmp_path / "bad.log"), timeout_s=BOUND_S)


def test_a_requests_own_budget_holds_in_the_engine_and_through_the_server(client, models):
    """``GenerateRequest.max_new_tokens`` (a partial rollout's continuation: the rest of its budget) caps that
    request alone, in the embedded engine and through the SGLang client; the tokens are a prefix of the
    uncapped ones (same seed)."""
    requests = [GenerateRequest([5, 17, 3], 0, max_new_tokens=3), GenerateRequest([9, 1, 100], 1)]
    whole = EmbeddedEngine(models[0]).generate([GenerateRequest([5, 17, 3], 0), requests[1]], SAMPLING)
    for got in (EmbeddedEngine(models[0]).generate(requests, SAMPLING), client.generate(requests, SAMPLING)):
        assert [len(s.response_ids) for s in got] == [3, 3, 8, 8]
        assert all(g.response_ids == w.response_ids[:len(g.response_ids)] for g, w in zip(got, whole))
    with pytest.raises(MegatronRLError, match="max_new_tokens 0"):
        GenerateRequest([1], 0, max_new_tokens=0)
