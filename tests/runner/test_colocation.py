"""runner/colocation.py: the barriers and the wait for released device memory around a colocated train step.

The probe of free device memory is a double (no GPU here); the barrier is recorded instead of
run; backend and engine record their calls. The loop-level order is in test_loop_order.py.
"""

import logging

import pytest

import megatron_rl.runner.colocation as colocation
from megatron_rl.config import parse_config
from megatron_rl.runner.colocation import Colocation, expected_release_fraction, wait_for_release

GIB = 1 << 30


class Probe:
    """Free memory readings in turn (the last one repeats), as torch.cuda.mem_get_info would give them."""

    def __init__(self, events, frees, total=100 * GIB):
        self.events, self.frees, self.total = events, list(frees), total

    def __call__(self):
        self.events.append("probe")
        free = self.frees.pop(0) if len(self.frees) > 1 else self.frees[0]
        return free, self.total


class Recorder:
    def __init__(self, events, name):
        self.events, self.name = events, name

    def __getattr__(self, method):
        return lambda *a: self.events.append(f"{self.name}.{method}")


class Rollout:
    def __init__(self, events):
        self.engine = Recorder(events, "engine")


@pytest.fixture
def events(monkeypatch):
    log = []
    monkeypatch.setattr(colocation, "barrier", lambda: log.append("barrier"))
    return log


def test_wake_waits_for_the_engines_memory_after_every_rank_passed_the_release(events):
    # the driver: free 10 GiB before; the release shows up over three polls (SGLang answers early: docs/peer-failures.md)
    probe = Probe(events, [10 * GIB, 12 * GIB, 20 * GIB, 40 * GIB])
    c = Colocation(True, True, expected_release_fraction=0.25, probe=probe)
    c.before_train(Recorder(events, "backend"), Rollout(events))
    assert events == ["probe", "barrier", "engine.release", "barrier", "probe", "probe", "probe", "backend.restore_comm_groups",
                      "backend.wake"]


def test_a_rank_without_the_engines_waits_too_and_sleep_precedes_any_resume(events):
    probe = Probe(events, [10 * GIB, 40 * GIB])
    c = Colocation(True, True, expected_release_fraction=0.25, probe=probe)
    c.before_train(Recorder(events, "backend"), None)  # rank 1: no engine handle, same GPU sharing
    c.before_rollout(Recorder(events, "backend"), None)
    c.after_sync(None)
    assert events == ["probe", "barrier", "barrier", "probe", "backend.restore_comm_groups", "backend.wake",
                      "backend.sleep", "barrier"]
    events.clear()
    c.before_rollout(Recorder(events, "backend"), Rollout(events))
    c.after_sync(Rollout(events))
    assert events == ["backend.sleep", "barrier", "engine.resume_weights", "engine.resume_kv_cache"]


def test_no_device_or_no_releasing_engine_means_no_wait(events):
    c = Colocation(True, True, expected_release_fraction=0.25, probe=lambda: None)  # CPU: no device
    c.before_train(Recorder(events, "backend"), Rollout(events))
    assert events == ["engine.release", "barrier", "backend.restore_comm_groups", "backend.wake"]
    events.clear()
    Colocation(True, True, expected_release_fraction=None, probe=Probe(events, [0])).before_train(
        Recorder(events, "backend"), Rollout(events))
    # the embedded engine: nothing to poll
    assert events == ["engine.release", "barrier", "backend.restore_comm_groups", "backend.wake"]
    events.clear()
    off = Colocation(False, False, probe=Probe(events, [0]))
    off.before_train(Recorder(events, "backend"), Rollout(events))
    off.before_rollout(Recorder(events, "backend"), Rollout(events))
    off.after_sync(Rollout(events))
    assert events == []  # separate placement: nothing moves, no barrier


class GroupsBackend:
    """Tears its groups down (--offload-train-groups): 12 destroyed, 12 rebuilt."""

    def __init__(self, events):
        self.events = events

    def release_comm_groups(self):
        self.events.append("backend.release_comm_groups")
        return 12

    def restore_comm_groups(self):
        self.events.append("backend.restore_comm_groups")
        return 12

    def wake(self):
        self.events.append("backend.wake")


def test_groups_go_for_the_generation_and_come_back_before_the_wake(events):
    c = Colocation(True, False, probe=lambda: None)
    backend = GroupsBackend(events)
    c.before_generate(backend)
    metrics = c.before_train(backend, None)
    assert events == ["backend.release_comm_groups", "barrier", "backend.restore_comm_groups", "backend.wake"]
    assert metrics["perf/groups_rebuild_s"] >= 0
    events.clear()
    Colocation(False, True, probe=lambda: None).before_generate(backend)  # the trainer does not sleep
    assert events == []


def test_a_release_that_never_shows_warns_and_goes_on(caplog):
    readings = iter([11 * GIB] * 1000)
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert wait_for_release(10 * GIB, 8 * GIB, lambda: (next(readings), 100 * GIB), timeout_s=0.05,
                                poll_s=0.01) is False
    assert "only 1.00 GiB more free (expected >= 8.00 GiB)" in caplog.text and "docs/peer-failures.md" in caplog.text
    assert wait_for_release(10 * GIB, 8 * GIB, lambda: (18 * GIB, 100 * GIB), timeout_s=0.05) is True


def test_expected_release_follows_the_engines_memory_fraction(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    base = ["--hf-checkpoint", hf, "--dry-run"]
    sglang = ["--rollout-backend", "sglang", "--colocate", "--actor-num-gpus-per-node", "1"]
    assert expected_release_fraction(parse_config(base + sglang + ["--sglang-mem-fraction-static", "0.6"])) == 0.3
    assert expected_release_fraction(parse_config(base + sglang)) == 0.25
    assert expected_release_fraction(parse_config(base + sglang + ["--sglang-device", "cpu"])) is None
    assert expected_release_fraction(parse_config(base + ["--colocate"])) is None  # the embedded engine
    assert expected_release_fraction(parse_config(base + sglang[:2] + ["--rollout-num-gpus", "1"])) is None
