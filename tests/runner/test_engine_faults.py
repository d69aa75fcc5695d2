"""EngineRecovery after a rollout that succeeded although an engine died (an sglang-router in front of
the engines retries the failed request on the others and keeps listing the dead one as healthy).

One process (``all_gather`` is the identity without a process group); the fleet is a test double of
``EngineFleet`` with the two things recovery reads (``dead()``, ``restart()``) and processes that
answer ``death_message`` as ``EngineProcess`` does. The real fleet, router and restart run in
tests/e2e/test_sglang_launched.py (router off; on in scripts/test_extended.sh).
"""

import pytest

from megatron_rl.errors import EngineError
from megatron_rl.runner.engine_faults import EngineRecovery


class _Process:
    def __init__(self, name):
        self.name, self.alive_now = name, False
        self.slot = self

    def describe(self):
        return self.name

    def death_message(self, when, lines=20):
        return f"{self.name} exited with code 9 {when}. Last lines of {self.name}.log:\nboom"


class _Fleet:
    def __init__(self, dead):
        self.local, self._dead, self.restarted = list(dead), list(dead), []

    def dead(self):
        return list(self._dead)

    def restart(self, process):
        self.restarted.append(process.name)
        self._dead.remove(process)


def _get():
    return ["sample"], {"rollout/reward": 1.0}


def test_a_masked_death_stops_every_rank_naming_the_engine_without_the_flag():
    fleet = _Fleet([_Process("SGLang engine 1")])
    with pytest.raises(EngineError, match="SGLang engine 1 exited with code 9 during the rollout") as err:
        EngineRecovery(fleet, enabled=False).generate(_get, None, resync=lambda: pytest.fail("no resync"))
    assert "--use-fault-tolerance restarts a dead engine" in str(err.value) and "engine 1.log" in str(err.value)
    assert fleet.restarted == []


def test_a_masked_death_is_restarted_and_synced_and_the_rollout_kept_with_the_flag():
    fleet, synced = _Fleet([_Process("SGLang engine 1")]), []
    recovery = EngineRecovery(fleet, enabled=True)
    calls = []

    def get():
        calls.append(1)
        return _get()

    samples, metrics = recovery.generate(get, None, resync=lambda: synced.append(1) or {})
    assert samples == ["sample"] and len(calls) == 1  # generated once: the router served it
    assert fleet.restarted == ["SGLang engine 1"] and synced == [1]
    assert metrics == {"rollout/reward": 1.0, "rollout/engine_restarts": 1.0} and recovery.restarts == 1


def test_nothing_dead_nothing_done():
    fleet = _Fleet([])
    for enabled in (False, True):
        assert EngineRecovery(fleet, enabled=enabled).generate(_get, None, resync=lambda: pytest.fail("")) == _get()
