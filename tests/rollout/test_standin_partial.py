"""The SGLang stand-in's partial rollouts: ``/pause_generation`` in retract / in_place mode parks a row being
generated at a decode step, a weight update lands, ``/continue_generation`` finishes it under the new weights,
and the reply shows both versions (``meta_info.weight_versions`` spans, ``output_token_logprobs``), as real
SGLang's does. Abort mode cuts a row being generated after its current step (its tokens so far come back,
finish_reason abort), and an update sent meanwhile waits for it to return.

The row is held at a known step from state: the engine's ``step_boundary_hook`` blocks the generating thread
there until the test has sent its pause. Log-prob tolerance 1e-5: the embedded engine's float32 agreement with
a full recomputing forward (``test_embedded.py``).
"""

import threading
import time

import pytest
import torch

from _util import InThread as _InThread
from megatron_rl.rollout.sglang import SGLangClient
from megatron_rl.rollout.sglang.protocol import parse_generate_output
from sglang_standin import SGLangStandIn  # tests/ is on sys.path (conftest)

PROMPT = [9, 1, 100, 42, 7]
PARAMS = {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": 7, "ignore_eos": True}
HOLD_STEP = 3  # output tokens the row has when it is held
HANG_BOUND_S = 300  # bounds a broken test only


def _thread(fn):
    return _InThread(fn, bound_s=HANG_BOUND_S, what="the request")


def wait_for(predicate, what: str) -> None:
    """Wait for a state; the bound only names a hang."""
    deadline = time.monotonic() + HANG_BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"hung: {what}"
        time.sleep(0.01)


class HeldRow:
    """One ``/generate`` row in flight, its generating thread held at ``HOLD_STEP`` until ``release()``."""

    def __init__(self, server):
        self.reached, self.go = threading.Event(), threading.Event()
        server.engine.step_boundary_hook = self._hold
        self.client = SGLangClient(server.url, timeout_s=HANG_BOUND_S, connect_retries=0)
        self.request = _thread(lambda: self.client.generate([PROMPT], [PARAMS])[0])
        assert self.reached.wait(HANG_BOUND_S), "the row never reached its held step"

    def _hold(self, step):
        if step == HOLD_STEP and not self.go.is_set():
            self.reached.set()
            assert self.go.wait(HANG_BOUND_S)

    def release(self):
        self.go.set()

    def reply(self):
        try:
            return self.request.result()
        finally:
            self.client.close()


@pytest.fixture
def server(models):
    with SGLangStandIn(models[0]) as standin:
        yield standin


@pytest.fixture
def client(server):
    with SGLangClient(server.url, timeout_s=HANG_BOUND_S, connect_retries=0) as c:
        yield c


def recomputed_logprobs(model, output_ids):
    ids = torch.tensor([PROMPT + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()[len(PROMPT) - 1:-1]
    return torch.log_softmax(logits / PARAMS["temperature"], -1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0]


def generate_across_update(server, client, models, mode):
    held = HeldRow(server)
    assert client.pause_generation(mode)["status"] == "ok"
    held.release()
    assert server.engine.wait_paused(HANG_BOUND_S) == 1  # parked at its decode step, not finished
    reply = client.update_weights_from_disk(models[1], weight_version="1")
    assert reply["success"], reply
    client.continue_generation()
    return held.reply()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_row_parked_across_an_update_carries_both_versions(server, client, models, references, mode):
    row = generate_across_update(server, client, models, mode)
    meta = row["meta_info"]
    n = len(row["output_ids"])
    assert n == PARAMS["max_new_tokens"] and meta["finish_reason"]["type"] == "length"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": HOLD_STEP},
                                       {"version": "1", "start": HOLD_STEP, "end": n}]
    assert meta["weight_version"] == "1"  # the server's version when the reply was built
    out = parse_generate_output(row, where="stand-in")
    assert out.weight_version == 0 and out.weight_version_spans == ((0, 0, HOLD_STEP), (1, HOLD_STEP, n))
    logprobs = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    old = recomputed_logprobs(references[0], row["output_ids"])
    new = recomputed_logprobs(references[1], row["output_ids"])
    torch.testing.assert_close(logprobs[:HOLD_STEP], old[:HOLD_STEP], atol=1e-5, rtol=0)
    if mode == "retract":  # the prefix was recomputed by the new weights: the new policy's log-probs
        torch.testing.assert_close(logprobs[HOLD_STEP:], new[HOLD_STEP:], atol=1e-5, rtol=0)
    else:  # in_place: the old weights' KV cache of the prefix stays, so the next token is not the new policy's
        assert abs(logprobs[HOLD_STEP] - new[HOLD_STEP]).item() > 1e-3


def test_pause_and_continue_without_an_update_changes_nothing(server, client):
    unpaused = client.generate([PROMPT], [PARAMS])[0]
    held = HeldRow(server)
    client.pause_generation("retract")
    held.release()
    server.engine.wait_paused(HANG_BOUND_S)
    client.continue_generation()
    row = held.reply()
    assert row["output_ids"] == unpaused["output_ids"]
    assert row["meta_info"]["output_token_logprobs"] == unpaused["meta_info"]["output_token_logprobs"]
    assert row["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": len(row["output_ids"])}]


def test_abort_all_ends_a_parked_row_with_its_partial_tokens(server, client):
    held = HeldRow(server)
    client.pause_generation("in_place")
    held.release()
    server.engine.wait_paused(HANG_BOUND_S)
    client.abort_request(abort_all=True)
    row = held.reply()  # returns while the server is still paused
    assert row["meta_info"]["finish_reason"]["type"] == "abort" and len(row["output_ids"]) == HOLD_STEP
    client.continue_generation()
    assert len(client.generate([PROMPT], [PARAMS])[0]["output_ids"]) == PARAMS["max_new_tokens"]


def test_abort_mode_cuts_the_generating_row_and_the_update_waits_for_it(server, client, models):
    """Abort mode aborts pending rows and cuts the row inside the engine after its current step (SGLang returns
    a running row's tokens so far); an update sent meanwhile lands after it returned (the model-update lock)."""
    server.faults.delay_s["/generate:row"] = HANG_BOUND_S  # a second row, pending: aborted by the pause
    pending = SGLangClient(server.url, timeout_s=HANG_BOUND_S, connect_retries=0)
    waiting = _thread(lambda: pending.generate([[5, 17, 3]], [PARAMS])[0])
    wait_for(lambda: server.pending_count() == 1, "the pending row")
    server.faults.delay_s.pop("/generate:row")
    held = HeldRow(server)
    client.pause_generation("abort")
    assert waiting.result()["meta_info"]["finish_reason"]["type"] == "abort"
    pending.close()
    update = _thread(lambda: client.update_weights_from_disk(models[1], weight_version="1"))
    with server._rows:
        assert server._rows.wait_for(lambda: server._updates_waiting == 1, HANG_BOUND_S)
    assert server.engine.weight_version == 0  # held back by the row inside the engine
    held.release()
    row = held.reply()
    assert row["meta_info"]["finish_reason"]["type"] == "abort" and len(row["output_ids"]) == HOLD_STEP + 1
    assert row["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": len(row["output_ids"])}]
    assert update.result()["success"] and server.engine.weight_version == 1
    client.continue_generation()
