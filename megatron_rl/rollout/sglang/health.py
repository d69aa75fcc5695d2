"""``HealthMonitor``: a daemon thread that polls every SGLang server's ``GET /health``.

Why poll: a server that dies between rollouts is named before the next ``generate`` or weight
sync sends it work, and a server that hangs (takes connections, never answers) is named while a
``generate`` waits on it, instead of after that request's 600 s timeout. ``SGLangEngine`` owns
one monitor and checks it before generating or updating (``engine.dead_servers()`` is what a
fault-tolerant runner reads).

Rules, from SGLang 0.5.23's ``http_server.health_generate``:

* ``/health`` generates one token (unless the server runs with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``): it waits at least 1 s, answers 200 as soon
  as the scheduler produced anything, and 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s)
  without a token, marking the server unhealthy. Hence the poll's own timeout (default 30 s)
  exceeds 20 s, so a slow server is a 503, not a client timeout.
* Polls pause while the engine is released (the health generation would run on released
  memory, and ``/release_memory_occupation`` asserts the server is idle) and while a weight
  update is in flight (a health generation in the running batch makes the post-update flush
  fail; one sent while ``/pause_generation`` holds requests waits out the 20 s and answers 503).
  ``pause`` waits for a poll already in flight, so neither can overlap one.
* One failed poll is not a death (a slow reply, a restarting proxy): a server is declared dead
  after ``failures`` consecutive failed polls (default 3). What is reported is the *first*
  failure of that streak (the cause; later failures are usually its consequences), with the
  streak's length and start time.
* Dead servers keep being polled. One that answers 200 again is "recovered": the engine then
  reads its weight version before using it (a restarted server serves its initial weights).

``probe_servers`` is the one-off check of servers the user runs (``--rollout-engine-urls``), made by
the driver before the workers start (``megatron_rl.runner.preflight``): each must answer
``/health`` 200 and ``/model_info`` with SGLang's JSON (a router: each of its workers), every request
bounded by one timeout, so a wrong port, a hung server, an error status or a reply that is not
SGLang's is named by URL before any rank has started work.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_rl.rollout.sglang.client import SGLangClient, SGLangEngineError

__all__ = ["HealthFailure", "HealthMonitor", "describe_failure", "probe_servers"]

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0  # a probe's bound per request: above SGLang's 20 s health-check timeout, so slow is a 503


@dataclass(frozen=True)
class HealthFailure:
    """Why a server is considered dead: the first failed poll of the streak that crossed the threshold."""

    url: str
    what: str  # "connection refused", "HTTP 503", "timeout", ... (describe_failure)
    first_at: float  # time.time() of the first failed poll of the streak
    failures: int  # consecutive failed polls when declared dead

    def describe(self) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(self.first_at))
        return f"/health failed {self.failures} times in a row since {when}, first: {self.what}"


def describe_failure(exc: BaseException, timeout_s: float) -> str:
    """What one failed ``/health`` poll was, in the words a user greps a log for."""
    kind = getattr(exc, "kind", None)
    cause = exc.__cause__
    if kind == "unreachable":
        return f"connection refused ({type(cause).__name__}: {cause})" if cause else "connection refused"
    if kind == "dropped":
        return "connection dropped without a reply"
    if kind == "timeout":
        return f"timeout: no reply within {timeout_s:g} s"
    status = getattr(exc, "status", None)
    if status is not None:
        return f"HTTP {status}"
    return f"{type(exc).__name__}: {exc}"


def probe_servers(urls: Sequence[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """One line per server of ``urls`` that does not answer as a running SGLang server ([] when all do).

    Each server, all at once: ``GET /health`` must answer 200 (503: still starting, or unhealthy), then
    ``GET /workers`` tells an sglang-router (whose workers are probed the same way) from a server, whose
    ``GET /model_info`` must be a JSON object with a ``weight_version``. One attempt per request, each
    bounded by ``timeout_s``; a line names the URL, the request and what came back."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(urls))), thread_name_prefix="sglang-probe") as pool:
        found = list(pool.map(lambda u: _probe_one(u, timeout_s), urls))
    return [line for lines in found for line in lines]


def _probe_one(url: str, timeout_s: float, router: Optional[str] = None) -> list[str]:
    """``router``: the sglang-router whose worker ``url`` is (a router is not looked for behind a router)."""
    with SGLangClient(url, timeout_s=timeout_s, connect_retries=0,
                      note=router and f"a worker of sglang-router {router}") as client:
        name = client.base_url + (f" ({client.note})" if client.note else "")
        endpoint = "/health"
        try:
            if not client.health():
                return [f"{name}: GET /health answered HTTP 503 (the server is still starting, or "
                        "unhealthy): wait until it answers 200"]
            endpoint = "/workers"
            workers = client.router_workers() if router is None else None
            if workers is not None:  # an sglang-router: the engine talks to its workers
                if not workers:
                    return [f"{client.base_url}: an sglang-router that lists no workers (GET /workers); register "
                            "its SGLang servers with it first"]
                return [line for w in workers for line in _probe_one(w, timeout_s, router=client.base_url)]
            endpoint = "/model_info"
            info = client.model_info()
        except SGLangEngineError as exc:
            what = describe_failure(exc, timeout_s)
            if exc.status is not None and exc.server_message:
                what += f": {exc.server_message[:200]}"
            elif exc.kind == "protocol":
                what = str(exc)
            return [f"{name}: GET {endpoint}: {what}"]
        if not isinstance(info, dict) or "weight_version" not in info:
            return [f"{name}: GET /model_info answered {str(info)[:200]!r}, not an SGLang server's "
                    "reply (a JSON object with weight_version; SGLang >= 0.5.2)"]
    return []


class HealthMonitor:
    """Polls ``/health`` of ``urls`` every ``interval_s`` on a daemon thread (``interval_s`` 0: no thread;
    ``poll()`` still works). ``notes``: url -> what ``SGLangClient.note`` says of that server."""

    def __init__(self, urls: Sequence[str], *, interval_s: float = 10.0, timeout_s: float = 30.0,
                 failures: int = 3, notes: Optional[dict[str, str]] = None):
        if interval_s < 0:
            raise ValueError(f"health interval {interval_s} s is negative; use 0 to disable the monitor")
        if failures < 1:
            raise ValueError(f"health failures {failures}: a server is dead after at least 1 failed poll")
        notes = notes or {}
        # clients of their own: one attempt per poll (the streak counts failures) and a short pool
        self._clients = [SGLangClient(u, timeout_s=timeout_s, connect_retries=0, max_connections=2,
                                      note=notes.get(u)) for u in urls]
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.failures = int(failures)
        self._lock = threading.Lock()  # guards the state below
        self._round = threading.Lock()  # held for the length of one poll round
        self._streaks: dict[str, tuple[float, str, int]] = {}  # url -> (first_at, what, count) of failed polls
        self._dead: dict[str, HealthFailure] = {}
        self._recovered: set[str] = set()
        self._pauses: set[str] = set()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=min(16, max(1, len(self._clients))),
                                        thread_name_prefix="sglang-health")
        self._thread: Optional[threading.Thread] = None
        if self.interval_s > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="sglang-health-monitor")
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    # ------------------------------------------------------------ the engine's view
    def dead(self) -> dict[str, HealthFailure]:
        """Servers declared dead and not answering since, by URL."""
        with self._lock:
            return dict(self._dead)

    def take_recovered(self) -> list[str]:
        """Servers that were dead and answer again, each returned once (the engine checks their weights)."""
        with self._lock:
            out, self._recovered = sorted(self._recovered), set()
            return out

    def pause(self, reason: str) -> None:
        """Stop polling for ``reason`` ("released", "update"); returns once no poll is in flight."""
        with self._lock:
            self._pauses.add(reason)
        waited = time.monotonic()
        # a round lasts at most one poll's timeout (polls run in parallel); past that, go on regardless
        if self._round.acquire(timeout=self.timeout_s + 5.0):
            self._round.release()
        else:
            log.warning("SGLang health monitor: a /health poll was still in flight %.0f s after pausing for %s",
                        time.monotonic() - waited, reason)

    def resume(self, reason: str) -> None:
        with self._lock:
            self._pauses.discard(reason)

    @property
    def paused(self) -> bool:
        with self._lock:
            return bool(self._pauses)

    # ------------------------------------------------------------------ polling
    def poll(self) -> bool:
        """One round now, every server in parallel; False (and nothing polled) while paused."""
        with self._round:
            if self.paused:
                return False
            results = list(self._pool.map(self._poll_one, self._clients))
        now = time.time()
        with self._lock:
            for client, what in zip(self._clients, results):
                self._record(client, what, now)
        return True

    def _poll_one(self, client: SGLangClient) -> Optional[str]:
        """None when the server answered 200, else what failed."""
        try:
            return None if client.health() else "HTTP 503 (starting, shutting down, or no token within SGLang's " \
                                                  "health-check timeout)"
        except SGLangEngineError as exc:
            return describe_failure(exc, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a poll must never kill the monitor thread
            return f"{type(exc).__name__}: {exc}"

    def _record(self, client: SGLangClient, what: Optional[str], now: float) -> None:
        url = client.base_url
        if what is None:
            self._streaks.pop(url, None)
            if url in self._dead:
                del self._dead[url]
                self._recovered.add(url)
                log.warning("%s answers /health again after being declared dead", client.label)
            return
        first_at, first_what, count = self._streaks.get(url, (now, what, 0))
        self._streaks[url] = (first_at, first_what, count + 1)
        if count + 1 >= self.failures and url not in self._dead:
            failure = HealthFailure(url=url, what=first_what, first_at=first_at, failures=count + 1)
            self._dead[url] = failure
            log.error("%s is dead: %s (last: %s)", client.label, failure.describe(), what)
        elif url not in self._dead:
            log.info("%s: /health failed (%d of %d before it counts as dead): %s", client.label, count + 1,
                     self.failures, what)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except RuntimeError:
                if sys.is_finalizing():  # an engine never closed: the interpreter is exiting, stop quietly
                    return
                log.exception("SGLang health monitor: a poll round failed")
            except Exception:  # noqa: BLE001 - logged; the next round tries again
                log.exception("SGLang health monitor: a poll round failed")

    def close(self) -> None:
        """Stop the thread (it exits within one poll) and close the monitor's connections."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5.0)
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()
