"""Partial rollouts in the embedded engine: pause at a decode-step boundary, a weight update, continue.

Every situation is made from state, never from timing: ``step_boundary_hook`` runs in the generating
thread at a known step (it pauses there, or blocks there), ``wait_paused`` returns once the generate is
parked, and a blocked forward holds a step open while another thread's update waits for it.
Log-prob tolerance: 1e-5 absolute, the float32 agreement of the engine's incremental decode with a
full recomputing forward (``test_embedded.py`` holds every engine to it).
"""

import threading

import pytest
import torch

from _util import InThread as _InThread
from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams

REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42, 7, 8, 60], 1),
            GenerateRequest([11, 12, 13, 14, 15], 2)]
# stop ids that end some rows early (so the decode batch compacts), max_batch_size 4: two chunks, the
# second (the third prompt's two samples) starts after the update of the first
SAMPLING = SamplingParams(temperature=0.8, max_new_tokens=8, seed=7, n=2, stop_token_ids=tuple(range(0, 250, 13)),
                          ignore_eos=True)
PAUSE_STEP = 3  # tokens each live row has when the pause lands
HANG_BOUND_S = 300  # only a bound on a broken test; nothing waits for it to pass


def _thread(fn):
    return _InThread(fn, bound_s=HANG_BOUND_S, what="the generate")


def pause_at(engine, step, mode):
    """Pause ``engine`` from its generating thread at the first chunk's boundary ``step`` (once)."""
    fired = []

    def hook(at):
        if at == step and not fired:
            fired.append(at)
            engine.pause(mode)

    engine.step_boundary_hook = hook


def recomputed_logprobs(model, sample, temperature):
    """Log-prob of every response token by one full forward of prompt + response (no cache, no padding)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()[len(sample.prompt_ids) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def generate_across_update(models, mode):
    """Generate with a pause in ``mode`` at ``PAUSE_STEP`` of the first chunk, version 1 loaded while parked."""
    engine = EmbeddedEngine(models[0], max_batch_size=4)
    pause_at(engine, PAUSE_STEP, mode)
    running = _thread(lambda: engine.generate(REQUESTS, SAMPLING))
    assert engine.wait_paused(HANG_BOUND_S) == 1
    engine.update_weights_from_disk(models[1], 1)
    assert engine.weight_version == 1 and engine.paused == mode
    engine.continue_()
    return running.result()


def expected_versions(sample):
    """Rows of the first chunk (prompts 0 and 1) carry version 0 up to the pause, then 1; the second chunk
    started after the update: all 1."""
    if sample.group_index == 2:
        return [1] * len(sample.response_ids)
    return [0 if t < PAUSE_STEP else 1 for t in range(len(sample.response_ids))]


def test_retract_update_mid_generation_gives_each_token_its_version_and_its_policys_logprob(models, references):
    samples = generate_across_update(models, "retract")
    assert len(samples) == 6
    assert any(s.token_versions for s in samples), "no row spans the update"
    for s in samples:
        versions = expected_versions(s)
        assert s.effective_token_versions() == versions
        assert s.weight_version == versions[0]
        # filled only when a row holds two versions: a one-version row looks exactly as before
        assert s.token_versions == (versions if len(set(versions)) > 1 else [])
        assert s.oldest_version == min(versions) and s.staleness(1) == 1 - min(versions)
        assert s.finish_reason in ("stop", "length")
        # retract recomputed the prefix under version 1: every token is its own version's policy given its prefix
        by_version = {v: recomputed_logprobs(references[v], s, SAMPLING.temperature) for v in references}
        expected = torch.stack([by_version[v][t] for t, v in enumerate(versions)])
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), expected, atol=1e-5, rtol=0)


def test_in_place_keeps_the_old_kv_cache(models, references):
    """in_place: the tokens after the update come from the new weights over the KV cache the old ones built,
    so they are not the new policy's log-probs of the prefix (retract's are); the tokens before are the old
    policy's, as in an unpaused generate."""
    in_place = generate_across_update(models, "in_place")
    retract = generate_across_update(models, "retract")
    unpaused = EmbeddedEngine(models[0], max_batch_size=4).generate(REQUESTS, SAMPLING)
    spanning = 0
    for a, b, before in zip(in_place, retract, unpaused):
        assert a.effective_token_versions() == expected_versions(a)
        if a.group_index == 2:
            continue  # the second chunk started after the update, with a fresh cache: no old KV
        assert a.response_ids[:PAUSE_STEP] == before.response_ids[:PAUSE_STEP]
        assert a.rollout_logprobs[:PAUSE_STEP] == before.rollout_logprobs[:PAUSE_STEP]
        if len(a.response_ids) > PAUSE_STEP:
            spanning += 1
            # the first token after the update is drawn from the same uniform; its log-prob under the new
            # weights differs by how the prefix's KV cache was built
            new_policy = recomputed_logprobs(references[1], a, SAMPLING.temperature)[PAUSE_STEP]
            assert abs(a.rollout_logprobs[PAUSE_STEP] - new_policy.item()) > 1e-3
            assert b.response_ids[PAUSE_STEP] != a.response_ids[PAUSE_STEP] or \
                abs(b.rollout_logprobs[PAUSE_STEP] - a.rollout_logprobs[PAUSE_STEP]) > 1e-3
    assert spanning


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_without_an_update_is_an_unpaused_generate_bit_for_bit(models, mode):
    unpaused = EmbeddedEngine(models[0], max_batch_size=4).generate(REQUESTS, SAMPLING)
    engine = EmbeddedEngine(models[0], max_batch_size=4)
    pause_at(engine, PAUSE_STEP, mode)
    running = _thread(lambda: engine.generate(REQUESTS, SAMPLING))
    assert engine.wait_paused(HANG_BOUND_S) == 1
    engine.continue_()
    paused = running.result()
    for a, b in zip(paused, unpaused):
        assert (a.response_ids, a.rollout_logprobs, a.finish_reason) == (b.response_ids, b.rollout_logprobs,
                                                                          b.finish_reason)
        assert a.token_versions == [] and a.weight_version == 0


def test_abort_mode_ends_the_rows_in_flight_and_holds_later_generates_until_continue(models):
    engine = EmbeddedEngine(models[0], max_batch_size=4)
    unpaused = EmbeddedEngine(models[0], max_batch_size=4).generate(REQUESTS, SAMPLING)
    pause_at(engine, PAUSE_STEP, "abort")
    aborted = engine.generate(REQUESTS, SAMPLING)  # the hook pauses from this thread: nothing parks
    for a, b in zip(aborted, unpaused):
        if a.group_index == 2:  # the second chunk never started
            assert (a.response_ids, a.rollout_logprobs, a.finish_reason) == ([], [], "abort")
        elif len(b.response_ids) <= PAUSE_STEP:  # finished before the pause: kept as it was
            assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
        else:  # cut at the pause, its partial tokens returned
            assert a.finish_reason == "abort" and a.response_ids == b.response_ids[:PAUSE_STEP]
            assert a.rollout_logprobs == b.rollout_logprobs[:PAUSE_STEP]
    assert any(a.finish_reason == "abort" and a.response_ids for a in aborted)
    # still paused: a generate that starts now parks before its prefill, and runs whole after continue
    engine.step_boundary_hook = None
    later = _thread(lambda: engine.generate(REQUESTS, SAMPLING))
    assert engine.wait_paused(HANG_BOUND_S) == 1
    engine.continue_()
    assert [(s.response_ids, s.rollout_logprobs) for s in later.result()] == \
        [(s.response_ids, s.rollout_logprobs) for s in unpaused]


def test_an_update_while_decoding_waits_for_the_step_then_lands_between_steps(models, references):
    """Not paused: the update waits for the running forward, lands before the next one, and the rows go on
    under the new weights (over their KV cache, as in_place) with their tokens' versions recorded."""
    # the hold is in the model's forward, which the lean decode step (rollout/lean_decode.py) does not call; the
    # engine's step lock around it is the same either way
    engine = EmbeddedEngine(models[0], max_batch_size=4, lean_decode=False)
    forward = engine.model.forward
    in_forward, go = threading.Event(), threading.Event()
    calls = []

    def held_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == PAUSE_STEP + 1:  # the forward that yields token PAUSE_STEP of the first chunk
            in_forward.set()
            assert go.wait(HANG_BOUND_S)
        return forward(*args, **kwargs)

    engine.model.forward = held_forward
    running = _thread(lambda: engine.generate(REQUESTS, SAMPLING))
    assert in_forward.wait(HANG_BOUND_S)
    update = _thread(lambda: engine.update_weights_from_disk(models[1], 1))
    with engine._cond:  # the update is waiting for the step (state, not a sleep)
        assert engine._cond.wait_for(lambda: engine._exclusive_waiting == 1, HANG_BOUND_S)
    assert engine.weight_version == 0
    go.set()
    update.result()
    samples = running.result()
    for s in samples:
        versions = [1] * len(s.response_ids) if s.group_index == 2 else \
            [0 if t <= PAUSE_STEP else 1 for t in range(len(s.response_ids))]
        assert s.effective_token_versions() == versions
        old = recomputed_logprobs(references[0], s, SAMPLING.temperature)
        n_old = versions.count(0)
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs[:n_old]), old[:n_old], atol=1e-5, rtol=0)
    assert any(s.token_versions for s in samples)


def test_wait_paused_times_out_naming_what_did_not_happen(models):
    engine = EmbeddedEngine(models[0])
    with pytest.raises(EngineError, match=r"no pause within 0.01 s: pause\(mode\) was not called"):
        engine.wait_paused(0.01)
    engine.pause("in_place")
    with pytest.raises(EngineError, match="only 0 generate call.s. in flight, 1 expected to park"):
        engine.wait_paused(0.01)
    assert engine.wait_paused(0.01, calls=0) == 0  # nothing in flight: nothing decoding
    engine.continue_()
    # a generate held inside its step-boundary hook never reaches the boundary's pause check
    reached, release = threading.Event(), threading.Event()

    def hold(step):
        if step == 2 and not release.is_set():
            reached.set()
            assert release.wait(HANG_BOUND_S)

    engine.step_boundary_hook = hold
    running = _thread(lambda: engine.generate(REQUESTS[:1], SAMPLING))
    assert reached.wait(HANG_BOUND_S)
    engine.pause("retract")
    with pytest.raises(EngineError, match="1 of 1 generate call.s. did not reach a step boundary"):
        engine.wait_paused(0.01)
    release.set()
    assert engine.wait_paused(HANG_BOUND_S) == 1
    with pytest.raises(EngineError, match="1 generate call.s. in flight .1 parked"):
        engine.release()  # a parked row would continue on no weights
    with pytest.raises(ConfigError, match="use one of abort, retract, in_place"):
        engine.pause("later")
    engine.continue_()
    assert len(running.result()) == 2


def test_a_failed_update_while_parked_stops_the_generate_naming_it(models):
    engine = EmbeddedEngine(models[0])
    pause_at(engine, 1, "in_place")
    running = _thread(lambda: engine.generate(REQUESTS[:1], SAMPLING))
    engine.wait_paused(HANG_BOUND_S)
    with pytest.raises(SyncError, match="shape mismatch"):
        engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))], 1)
    engine.continue_()
    with pytest.raises(EngineError, match="cannot continue generating: weights incomplete"):
        running.result()
