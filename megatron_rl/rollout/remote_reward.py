"""``--rm-url``: rewards from an HTTP reward server, posted in batches.

slime's ``remote_rm`` posts one sample per request (``{"prompt", "response", "label"}``) and takes
the reply's JSON as the reward. Here a request carries a batch (``--rm-batch-size`` samples), so a
rollout of 256 samples costs a few round trips, not 256; each sample keeps slime's three keys, so
a slime reward server needs only a loop over ``samples`` (docs/agentic.md, "Reward servers").

Protocol: ``POST <--rm-url>`` with the JSON body::

    {"samples": [{"prompt": str | null, "response": str | null, "label": any,
                  "prompt_ids": [int], "response_ids": [int], "group_index": int, "index": int,
                  "finish_reason": "stop" | "length", "metadata": {...}}, ...]}

(``index``: the sample's place in the scored batch; ``group_index``: samples of one prompt share
it; texts are null when the engine has no tokenizer; metadata values JSON cannot hold are sent as
strings). The reply is HTTP 200 with ``{"rewards": [r, ...]}``, one per sample in order, each a
number or a dict reward ``{"reward": number, "<metric>": number, ...}`` (``rewards.py``: the other
keys are logged as ``reward/<metric>``).

Why these failure rules (the same as the SGLang client's, ``sglang/client.py``):

* a request that got no reply because of the connection (refused, connect timeout, dropped
  before a reply) is sent again, ``--rm-max-retries`` times with exponential backoff: scoring is
  a pure function of the sample, so a replay is harmless;
* a reply is never retried, whatever its status: a 4xx/5xx or a body that is not the protocol's
  is a bug in the server or in the request, and a retry would only hide it for a while; the error
  names the server, the status and what was expected;
* no reply within ``--rm-timeout`` seconds is an error naming the server too: a server still
  working on the batch may answer later, and sending it again would double its load.

Concurrency: the chunks of one call are posted at once, at most ``--rm-max-concurrency``
requests in flight over one pooled ``httpx.Client`` (thread-safe, keep-alive connections), from
a thread pool shared by every call, so callers scoring at the same time (the full-async
producer scores each group from its own thread) share the limit rather than multiply it.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable, Optional

import httpx

from megatron_rl.data.types import Sample
from megatron_rl.errors import EngineError

__all__ = ["RemoteReward", "RewardServerError", "probe_reward_server", "request_body"]

MAX_BACKOFF_S = 8.0  # one retry's wait at most; the waits double from backoff_s up to this
# no reply because of the connection: the server never answered this request, so sending it again is safe
_RETRIED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError, httpx.ReadError,
            httpx.WriteError)
_EXPECTED = ('HTTP 200 with {"rewards": [one number or {"reward": number, ...} per sample, in order]} '
             "(docs/agentic.md, \"Reward servers\")")


class RewardServerError(EngineError):
    """The reward server failed a request. ``kind``: "unreachable" (no reply after the retries),
    "timeout", "http" (an error status), "protocol" (a reply that is not ``{"rewards": [...]}``)."""

    def __init__(self, message: str, *, url: str, kind: str, status: Optional[int] = None):
        super().__init__(message)
        self.url, self.kind, self.status = url, kind, status


def _jsonable(value: Any) -> Any:
    """``json.dumps``'s fallback for metadata values JSON cannot hold (tuples become lists by themselves)."""
    return str(value)


def request_body(samples: list[Sample], start: int = 0) -> dict:
    """The body posted for ``samples``; ``start``: the first one's index in the scored batch."""
    return {"samples": [{"prompt": s.prompt_text, "response": s.response_text, "label": s.label,
                         "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
                         "group_index": s.group_index, "index": start + i, "finish_reason": s.finish_reason,
                         "metadata": s.metadata} for i, s in enumerate(samples)]}


def probe_reward_server(url: str, *, timeout_s: float = 5.0, max_retries: int = 5, backoff_s: float = 0.5,
                        sleep: Callable[[float], None] = time.sleep) -> Optional[str]:
    """Why ``url`` (--rm-url) cannot be a running reward server, or None: its host resolves and its port accepts
    a TCP connection, tried ``max_retries`` more times with the requests' backoff (a server still starting
    gets as long as a request would). Nothing is posted: a probe must not cost the server a batch."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url} is not an http(s)://host[:port]/path URL"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        return f"{url}: {exc}"
    last: Optional[OSError] = None
    for attempt in range(max_retries + 1):
        if attempt:
            sleep(min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout_s):
                return None
        except OSError as exc:
            last = exc
    return (f"nothing accepts a connection at {parts.hostname}:{port} after {max_retries + 1} attempt(s) "
            f"({type(last).__name__}: {last})")


class RemoteReward:
    """A batched reward function (``rewards.RewardFn``) that asks a reward server (module docstring).

    ``sleep`` waits between retries (tests pass their own to act at that moment); ``transport``
    replaces httpx's network transport (tests). Thread-safe; ``close()`` ends the pool."""

    batched = True  # rewards._is_batched: it takes the whole batch

    def __init__(self, url: str, *, timeout_s: float = 120.0, batch_size: int = 64, max_concurrency: int = 16,
                 max_retries: int = 5, backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep,
                 transport: Optional[httpx.BaseTransport] = None):
        self.url = url
        self.timeout_s = float(timeout_s)
        self.batch_size = int(batch_size)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self._sleep = sleep
        self._http = httpx.Client(timeout=httpx.Timeout(self.timeout_s), transport=transport,
                                  limits=httpx.Limits(max_connections=max_concurrency,
                                                      max_keepalive_connections=max_concurrency,
                                                      # below common servers' 5 s keep-alive, so a pooled
                                                      # connection is rarely one the server is closing
                                                      keepalive_expiry=2.0))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency,
                                                           thread_name_prefix="reward-server")
        self._lock = threading.Lock()
        self.requests_sent = 0  # every POST, retries included (tests and logs read it)

    @classmethod
    def from_config(cls, cfg) -> "RemoteReward":
        d = cfg.data
        return cls(d.rm_url, timeout_s=d.rm_timeout, batch_size=d.rm_batch_size,
                   max_concurrency=d.rm_max_concurrency, max_retries=d.rm_max_retries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"

    def __call__(self, samples: list[Sample]) -> list[Any]:
        """One reward (a number or a dict reward) per sample, in order; chunks posted concurrently."""
        if not samples:
            return []
        starts = range(0, len(samples), self.batch_size)
        futures = [self._pool.submit(self._post, samples[i:i + self.batch_size], i) for i in starts]
        rewards: list[Any] = []
        try:
            for future in futures:
                rewards.extend(future.result())
        except BaseException:
            for future in futures:  # chunks not started yet are not sent; started ones finish on their own
                future.cancel()
            raise
        return rewards

    def _post(self, samples: list[Sample], start: int) -> list[Any]:
        body = json.dumps(request_body(samples, start), default=_jsonable).encode()
        what = f"a batch of {len(samples)} sample(s)"
        attempts = self.max_retries + 1
        started = time.monotonic()
        last: Optional[BaseException] = None
        for attempt in range(attempts):
            if attempt:
                self._sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            with self._lock:
                self.requests_sent += 1
            try:
                resp = self._http.post(self.url, content=body, headers={"Content-Type": "application/json"})
            except _RETRIED as exc:
                last = exc
                continue
            except httpx.TimeoutException as exc:
                raise RewardServerError(
                    f"reward server {self.url} (--rm-url) did not answer {what} within {self.timeout_s:g} s "
                    f"(--rm-timeout; {type(exc).__name__}); it is overloaded, hung or dead: check its log, raise "
                    "--rm-timeout, or send fewer samples per request (--rm-batch-size)",
                    url=self.url, kind="timeout") from exc
            except httpx.HTTPError as exc:
                raise RewardServerError(f"POST {what} to reward server {self.url} (--rm-url) failed: "
                                        f"{type(exc).__name__}: {exc}", url=self.url, kind="unreachable") from exc
            return self._rewards(resp, len(samples), what)
        raise RewardServerError(
            f"could not reach reward server {self.url} (--rm-url) for {what} after {attempts} attempt(s) over "
            f"{time.monotonic() - started:.1f} s ({type(last).__name__}: {last}); is the server running and is the "
            "URL right? (--rm-max-retries sets the retries)", url=self.url, kind="unreachable") from last

    def _rewards(self, resp: httpx.Response, count: int, what: str) -> list[Any]:
        """The reply's rewards, or an error naming the server, what it sent and what was expected."""
        def refuse(said: str, kind: str = "protocol") -> RewardServerError:
            return RewardServerError(f"reward server {self.url} (--rm-url) answered {what} with {said}; expected "
                                     f"{_EXPECTED}", url=self.url, kind=kind, status=resp.status_code)

        if resp.status_code != 200:
            raise refuse(f"HTTP {resp.status_code}: {resp.text[:300]!r}", kind="http")
        try:
            reply = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise refuse(f"a body that is not JSON: {resp.text[:200]!r}") from None
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list):
            raise refuse(f"{type(reply).__name__} {json.dumps(reply)[:200]} (no \"rewards\" list)")
        if len(rewards) != count:
            raise refuse(f"{len(rewards)} reward(s) for {count} sample(s)")
        return rewards
