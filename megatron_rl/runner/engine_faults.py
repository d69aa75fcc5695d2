"""``--use-fault-tolerance``: a launched SGLang engine that dies is restarted, re-synced, and the rollout
generated again.

Why here and collective: only the driver generates, but a restart must be followed by a complete
weight sync (a restarted server serves its initial weights), and every sync is collective over the
training world. So after each generate attempt the driver tells every rank whether it failed (one
small broadcast per step); on a failure each node's local rank 0 restarts its dead engines (same
command, port and log file; ``EngineFleet.restart``), every rank agrees it worked, the transport
drops what it held with the dead servers (``shutdown``: the distributed transport's group), the
current weights are synced again, and the same rollout is generated again from the same prompt
position (the manager's state is rewound). A failure that killed no engine (a server answering
400, a timeout with the process alive) is not retried: the error stands. At most
``MAX_RESTARTS`` restarts per run; the next death ends the run with the engine and its log named.
Without the flag the first error ends the run (``train.py`` names the dead engine and its log).
A rollout that succeeded is followed by a look at the launched processes on every node, flag or not:
behind an sglang-router a death does not fail the rollout (``EngineRecovery.generate``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.errors import EngineError
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.sglang.launcher import EngineFleet, all_gather

log = logging.getLogger("megatron_rl")

MAX_RESTARTS = 3  # per run: an engine that keeps dying is a bug to read in its log, not to restart forever


def from_driver(obj: Any) -> Any:
    """Collective: the driver's ``obj`` on every rank (itself without a process group)."""
    import torch.distributed as dist  # lazy: rollout-only runs have no process group

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class EngineRecovery:
    """Wraps each step's generation; a pass-through unless ``--use-fault-tolerance`` with launched engines."""

    fleet: Optional[EngineFleet]
    enabled: bool
    restarts: int = 0

    @property
    def retries_engine_errors(self) -> bool:
        """Whether ``generate`` may answer an ``EngineError`` with a restart (else any error ends the run)."""
        return self.fleet is not None and self.enabled

    def generate(self, get: Callable[[], tuple], rollout: Optional[RolloutManager],
                 resync: Callable[[], dict]) -> tuple[Any, dict]:
        """``get()`` (the driver's generation), retried after restarting dead engines and ``resync()``.

        A generation that succeeded is still followed by a look at the launched engines' processes
        (collective, every node its own): an sglang-router in front of them retries a request that
        failed on a dead worker on the others and keeps listing the dead one as healthy (0.3.2,
        measured), so the death would otherwise first show at the next release or weight sync, half
        way through the step. With the flag the dead engines are restarted and synced and the
        rollout, served by the live ones, is kept; without it every rank stops here, naming them."""
        if self.fleet is None:
            return get()
        if not self.enabled:
            samples, metrics = get()
            self._stop_if_dead()
            return samples, metrics
        restarted_now = 0
        while True:
            state = rollout.state_dict() if rollout is not None else None
            error: Optional[str] = None
            samples, metrics = None, {}
            try:
                samples, metrics = get()
            except EngineError as exc:  # only the driver generates, so only it can get here
                error = str(exc)
                if rollout is not None and state is not None:
                    rollout.load_state_dict(state)  # the retry draws the same prompts
            error = from_driver(error)
            if error is None:
                deaths = self._deaths()
                if deaths:  # the rollout is complete (the router served it from the live engines): keep it
                    self._recover(f"{'; '.join(d.splitlines()[0] for d in deaths)} (the rollout was served by the "
                                  "other engines)", rollout, resync)
                    restarted_now += 1
                if restarted_now:
                    metrics["rollout/engine_restarts"] = float(restarted_now)
                return samples, metrics
            self._recover(error, rollout, resync)
            restarted_now += 1

    def _recover(self, error: str, rollout: Optional[RolloutManager], resync: Callable[[], dict]) -> None:
        """Collective: restart the dead engines, let the driver's health monitor see them alive, sync them."""
        self._restart_dead(error)
        if rollout is not None:
            rollout.engine.poll_health()  # the restarted servers count as alive again
        resync()

    def _launched(self) -> EngineFleet:
        assert self.fleet is not None, "generate() hands over to get() alone when this run launched no engines"
        return self.fleet

    def _deaths(self) -> list[str]:
        """Collective: the death message of every launched engine (or router) of every node that has exited."""
        mine = [p.death_message("during the rollout", lines=8) for p in self._launched().dead()]
        return sum(all_gather(mine), [])

    def _stop_if_dead(self) -> None:
        deaths = self._deaths()
        if deaths:
            raise EngineError("; ".join(deaths) + "\n(the rollout itself finished: an sglang-router retries a "
                              "failed request on the other engines; --use-fault-tolerance restarts a dead engine)")

    def _restart_dead(self, error: str) -> None:
        """Collective: each node restarts its dead engines; every rank raises if none was dead (the
        error was not a death), the limit is reached, or a restart failed."""
        fleet = self._launched()
        dead = fleet.dead()
        for _ in range(30):  # the process may still be exiting when the driver's request failed
            if dead or not fleet.local:
                break
            time.sleep(0.1)
            dead = fleet.dead()
        problem: Optional[str] = None
        names = [p.slot.describe() for p in dead]
        if dead and self.restarts + len(dead) <= MAX_RESTARTS:
            try:
                for process in dead:
                    fleet.restart(process)
            except EngineError as exc:
                problem = str(exc)
        parts = all_gather((len(dead), names, problem))
        total = sum(n for n, _, _ in parts)
        problems = [p for _, _, p in parts if p]
        if total == 0:
            raise EngineError(f"{error} (--use-fault-tolerance restarts only engines whose process died; every "
                              "engine of this run is alive, so the error stands)")
        if self.restarts + total > MAX_RESTARTS:
            raise EngineError(f"{error}. --use-fault-tolerance already restarted {self.restarts} engine(s) in this "
                              f"run (at most {MAX_RESTARTS}); not restarting {'; '.join(sum((n for _, n, _ in parts), []))} "
                              "again: read the engine log named above")
        if problems:
            raise EngineError(f"{error}; restarting the engine failed too: {problems[0]}")
        self.restarts += total
        restarted: list[str] = sum((n for _, n, _ in parts), [])
        log.warning("--use-fault-tolerance: restarted %s after: %s; syncing the current weights and generating the "
                    "rollout again", "; ".join(restarted), error.splitlines()[0])
