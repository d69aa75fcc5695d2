"""``infra.collective_watch`` in one process: which failures it names, the roll call over a real store, and a
world of one passing through. The ranks frozen for real: tests/dist/test_freeze_ranks.py."""

import pytest
import torch.distributed as dist

from megatron_rl.errors import CollectiveTimeout
from megatron_rl.infra import collective_watch as cw


@pytest.fixture
def short_bound():
    cw.configure(0.001)  # 0.06 s
    yield
    cw.configure(cw.DEFAULT_MINUTES)


def test_a_timed_out_collective_is_recognised_along_the_cause_chain():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600ms for recv operation")
    assert cw.is_collective_timeout(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("checking the marker failed") from e
    except ValueError as wrapped:
        assert cw.is_collective_timeout(wrapped)
    assert not cw.is_collective_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))  # gone: named
    assert not cw.is_collective_timeout(RuntimeError("shape mismatch"))
    assert not cw.is_collective_timeout(ValueError("Timed out waiting 5ms for recv operation"))  # not torch's type
    assert not cw.is_collective_timeout(TimeoutError("timed out"))  # a socket's (an engine's HTTP call): driver-only


def test_the_roll_call_names_the_rank_that_did_not_answer_with_its_host_and_pid(short_bound, monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(cw, "_store", lambda: store)
    store.set(f"{cw._KEY}/who/2", "node7 pid 4242")
    store.set(cw._answer_key("resume", 1), "3")  # rank 1 got to the end of the same (3rd) call of the phase
    store.set(cw._answer_key("resume", 2), "2")  # rank 2 only to the end of the one before
    missing, who = cw.roll_call("resume", 3, rank=0, world=3)
    assert missing == [2] and who == {2: "node7 pid 4242"}
    message = cw._message("resume", 0, missing, who, RuntimeError("Timed out waiting 60ms for send"))
    assert message.startswith("the resume (the newest complete checkpoint's load): training rank 2 (node7 pid 4242) "
                              "did not answer within 0.06 s (--distributed-timeout-minutes 0.001)"), message
    assert "Rank 0 stops here (it saw: Timed out waiting 60ms for send)" in message
    everyone = cw._message("train_step", 1, [], {}, RuntimeError("wait timeout after 60ms"))
    assert "every training rank answered the roll call" in everyone and "raise --distributed-timeout-minutes" in everyone


def test_a_world_of_one_passes_errors_through_and_the_bound_is_validated():
    with pytest.raises(RuntimeError, match="Timed out"):  # no process group: nothing to roll-call
        with cw.watched(cw.TRAIN_STEP):
            raise RuntimeError("Timed out waiting 1ms for recv operation to complete")
    with pytest.raises(CollectiveTimeout):  # an inner phase's named error stays what it is
        with cw.watched(cw.WEIGHT_SYNC):
            raise CollectiveTimeout("named already")
    with pytest.raises(ValueError, match="--distributed-timeout-minutes 0"):
        cw.configure(0)
    assert cw.timeout().total_seconds() == cw.DEFAULT_MINUTES * 60
