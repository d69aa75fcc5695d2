"""A thin, strict HTTP client for one SGLang server (``python -m sglang.launch_server``).

One ``SGLangClient`` per server URL; one method per endpoint the RL loop uses.
Paths, request fields and reply shapes follow SGLang 0.5.2x
(``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py``); ``protocol`` holds the request
builders and reply parsers so the stand-in server in the tests and this client
read the same definitions.

Why a synchronous ``httpx.Client``: the RL loop and every ``RolloutEngine``
method are synchronous, and the engine fans a batch out to several servers with
a small thread pool; ``httpx.Client`` is thread-safe and pools keep-alive
connections per server, so an async core would only add an event-loop thread
and a bridge without making anything faster. The async switch is local to this
file should a streaming or partial-rollout caller need it.

Retry rule (a weight update must never be applied twice):

* a request that could not be *sent* (connection refused, connect timeout, name
  resolution) is retried ``connect_retries`` times with exponential backoff
  ``backoff_s * 2**k``, for every endpoint: the server never saw it;
* a connection dropped *after* sending (server died mid-request) is retried only
  for idempotent endpoints (health, model_info, generate, abort, flush); for the
  others the error says the server may or may not have applied it;
* an HTTP reply, whatever its status, is never retried; a read timeout is never
  retried either (the server may still be working on it).

Every failure raises ``SGLangEngineError`` (an ``EngineError``) or, for weight
endpoints, ``SGLangSyncError`` (a ``SyncError``); both carry ``url``,
``endpoint``, ``status``, ``server_message`` and ``kind`` (what failed, below) and say
them in the message. A client built with a ``note`` (the launcher's "engine 1 on node 0,
log /path/engine_1.log") names its server as ``label`` = "SGLang server URL (note)" in
every message, so the user reading an error finds the server's log.

``kind``: "unreachable" (never connected: refused, connect timeout, name resolution),
"dropped" (the connection was cut after sending), "timeout" (no reply in time),
"http" (the server answered an error status or a failure body), "protocol" (a reply
that is not SGLang's shape), "transport" (any other httpx error). The health monitor
(``health.py``) reports these words.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Optional, Sequence

import httpx

from megatron_rl.errors import EngineError, SyncError
from megatron_rl.rollout.sglang import protocol

__all__ = ["SGLangClient", "SGLangEngineError", "SGLangSyncError", "normalize_base_url"]

# Endpoints whose replay is harmless: a dropped connection after sending is retried for these.
_IDEMPOTENT = frozenset({"/health", "/health_generate", "/model_info", "/generate", "/abort_request",
                         "/flush_cache", "/pause_generation", "/continue_generation"})


def _timeout_flag(endpoint: str) -> str:
    """Where the bound of a timed-out call is set: the run's engine gives /generate
    --rollout-generate-timeout and its weight, pause and memory calls --rollout-update-timeout."""
    if endpoint == "/generate":
        return "raise --rollout-generate-timeout"
    if endpoint in _WEIGHT_ENDPOINTS or endpoint in _UPDATE_TIMEOUT_ENDPOINTS:
        return "raise --rollout-update-timeout"
    return "raise the timeout for this call"


# Endpoints that change the weights or their version: failures are SyncError.
_WEIGHT_ENDPOINTS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor",
                               "/init_weights_update_group", "/update_weights_from_distributed",
                               "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
                               "/update_weight_version", "/load_lora_adapter", "/load_lora_adapter_from_tensors",
                               "/unload_lora_adapter"})
# Calls the engine bounds by --rollout-update-timeout besides the weight calls above.
_UPDATE_TIMEOUT_ENDPOINTS = frozenset({"/pause_generation", "/release_memory_occupation",
                                       "/resume_memory_occupation"})


ERROR_KINDS = ("unreachable", "dropped", "timeout", "http", "protocol", "transport")


def normalize_base_url(url: str) -> str:
    """A server URL as the client keys it: ``http://`` added when no scheme is given, no trailing slash."""
    url = str(url)
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url.rstrip("/")


class _SGLangErrorInfo:
    """What every SGLang client error carries besides its message."""

    url: str
    endpoint: str
    status: Optional[int]
    server_message: Optional[str]
    kind: str

    def _set_info(self, url: str, endpoint: str, status: Optional[int], server_message: Optional[str],
                  kind: str) -> None:
        self.url, self.endpoint, self.status, self.server_message = url, endpoint, status, server_message
        self.kind = kind


class SGLangEngineError(_SGLangErrorInfo, EngineError):
    """An SGLang server is unreachable, timed out, or refused a request."""

    def __init__(self, message: str, *, url: str, endpoint: str, status: Optional[int] = None,
                 server_message: Optional[str] = None, kind: str = "http"):
        super().__init__(message)
        self._set_info(url, endpoint, status, server_message, kind)


class SGLangSyncError(_SGLangErrorInfo, SyncError):
    """An SGLang weight endpoint failed (the server's weights or version may not be what was sent)."""

    def __init__(self, message: str, *, url: str, endpoint: str, status: Optional[int] = None,
                 server_message: Optional[str] = None, kind: str = "http"):
        super().__init__(message)
        self._set_info(url, endpoint, status, server_message, kind)


class SGLangClient:
    """Calls one SGLang server; see the module docstring for the retry and error rules.

    ``timeout_s`` bounds each request (connect, read, write and pool wait);
    methods that may legitimately take long (``generate``, weight loads) accept
    their own ``timeout_s``. ``note``: what the user should know to find this server
    (which engine, where its log is), said in every error. Use as a context manager or
    call ``close()``.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, connect_retries: int = 3, backoff_s: float = 0.5,
                 max_connections: int = 32, note: Optional[str] = None):
        self.base_url = normalize_base_url(base_url)
        self.note = note or None
        self.timeout_s = float(timeout_s)
        self.connect_retries = int(connect_retries)
        self.backoff_s = float(backoff_s)
        self._http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(self.timeout_s),
                                  limits=httpx.Limits(max_connections=max_connections,
                                                      max_keepalive_connections=max_connections,
                                                      # below uvicorn's 5 s keep-alive in SGLang, so a pooled
                                                      # connection is never one the server is closing
                                                      keepalive_expiry=2.0))
        self._has_update_session: Optional[bool] = None  # None until the first begin_weight_update

    # ------------------------------------------------------------- plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SGLangClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    @property
    def label(self) -> str:
        """How errors name this server: its URL, and the note (engine, log file) when there is one."""
        return f"SGLang server {self.base_url}" + (f" ({self.note})" if self.note else "")

    def _error(self, endpoint: str, message: str, status: Optional[int] = None,
               server_message: Optional[str] = None, kind: str = "http") -> Exception:
        cls = SGLangSyncError if endpoint in _WEIGHT_ENDPOINTS else SGLangEngineError
        return cls(message, url=self.base_url, endpoint=endpoint, status=status, server_message=server_message,
                   kind=kind)

    def request(self, method: str, endpoint: str, payload: Any = None, *, timeout_s: Optional[float] = None,
                ok_statuses: Sequence[int] = (200,), context: str = "") -> httpx.Response:
        """Send one request with the retry rule above; a status outside ``ok_statuses`` raises.

        ``context`` is added to an HTTP error's message: what the request was about, where the
        server's own words do not say it (SGLang's "Flush cache failed." names no reason, and a
        failed disk load names no path)."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        where = self.label
        attempts = self.connect_retries + 1
        last: Optional[BaseException] = None
        dropped = False
        started = time.monotonic()
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * (2 ** (attempt - 1)))
            try:
                resp = self._http.request(method, endpoint, json=payload if method != "GET" else None,
                                          timeout=httpx.Timeout(timeout))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                last = exc  # never reached the server: safe to resend
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                if endpoint in _IDEMPOTENT:
                    last, dropped = exc, True
                    continue
                raise self._error(endpoint, f"{where} dropped the connection during {method} {endpoint} "
                                  f"({type(exc).__name__}: {exc}); it may or may not have applied the request, "
                                  "so it is not resent: check the server's log and /model_info weight_version",
                                  kind="dropped") from exc
            except httpx.TimeoutException as exc:
                raise self._error(endpoint, f"{where} did not answer {method} {endpoint} within {timeout:g} s "
                                  f"({type(exc).__name__}); the server is overloaded, hung or dead: check its "
                                  f"log, or {_timeout_flag(endpoint)}",
                                  kind="timeout") from exc
            except httpx.HTTPError as exc:
                raise self._error(endpoint, f"{method} {endpoint} to {where} failed: "
                                  f"{type(exc).__name__}: {exc}", kind="transport") from exc
            if resp.status_code not in ok_statuses:
                server_message = protocol.error_message(resp.status_code, resp.content)
                raise self._error(endpoint, f"{where} answered {method} {endpoint} with HTTP {resp.status_code}: "
                                  f"{server_message}" + (f" ({context})" if context else ""),
                                  status=resp.status_code, server_message=server_message)
            return resp
        elapsed = time.monotonic() - started
        hint = ("a connection was cut mid-request, so the server likely died: check its log" if dropped
                else "is the server running and is the URL right?")
        kind = "dropped" if isinstance(last, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)) \
            else "unreachable"
        raise self._error(endpoint, f"could not reach {where} for {method} {endpoint} after {attempts} attempt(s) "
                          f"over {elapsed:.1f} s ({type(last).__name__}: {last}); {hint}", kind=kind) from last

    def _json(self, resp: httpx.Response, endpoint: str) -> Any:
        try:
            return resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._error(endpoint, f"{self.label} answered {endpoint} with a body that is "
                              f"not JSON: {resp.text[:200]!r}", status=resp.status_code, kind="protocol") from exc

    def _weight_call(self, endpoint: str, payload: dict, timeout_s: Optional[float], context: str = "",
                     message_key: str = "message") -> dict:
        """POST a weight endpoint: ``{success, <message_key>}`` back, 400 (raised) on failure (the LoRA
        endpoints' replies say it in ``error_message``, and their failures name ``context`` too)."""
        resp = self.request("POST", endpoint, payload, timeout_s=timeout_s, context=context)
        body = self._json(resp, endpoint)
        if not isinstance(body, dict) or not body.get("success", False):
            message = body.get(message_key) if isinstance(body, dict) else body
            where = f" ({context})" if context and message_key != "message" else ""
            raise self._error(endpoint, f"{self.label} reported failure for {endpoint}: {message}{where}",
                              status=resp.status_code, server_message=str(message))
        return body

    # ------------------------------------------------------------ liveness
    def health(self, *, timeout_s: Optional[float] = None) -> bool:
        """``GET /health``: True on 200, False on 503 (starting up or shutting down)."""
        resp = self.request("GET", "/health", timeout_s=timeout_s, ok_statuses=(200, 503))
        return resp.status_code == 200

    def health_generate(self, *, timeout_s: Optional[float] = None) -> bool:
        """``GET /health_generate``: True when the server generated a token, False on 503."""
        resp = self.request("GET", "/health_generate", timeout_s=timeout_s, ok_statuses=(200, 503))
        return resp.status_code == 200

    def model_info(self, *, timeout_s: Optional[float] = None) -> dict:
        """``GET /model_info``: model_path, is_generation, weight_version, ..."""
        return self._json(self.request("GET", "/model_info", timeout_s=timeout_s), "/model_info")

    def server_info(self, *, timeout_s: Optional[float] = None) -> dict:
        """The server's resolved launch arguments and scheduler state: ``GET /server_info`` (0.5.23;
        ``/get_server_info`` on older servers, which 0.5.23 still answers as deprecated)."""
        try:
            return self._json(self.request("GET", "/server_info", timeout_s=timeout_s), "/server_info")
        except SGLangEngineError as exc:
            if exc.status != 404:
                raise
        return self._json(self.request("GET", "/get_server_info", timeout_s=timeout_s), "/get_server_info")

    def weight_version(self, *, timeout_s: Optional[float] = None) -> str:
        """The server's weight version string (``/model_info``; ``/get_weight_version`` is gone since 0.5.21)."""
        info = self.model_info(timeout_s=timeout_s)
        if "weight_version" not in info:
            raise self._error("/model_info", f"{self.label} /model_info carries no weight_version "
                              f"(keys: {sorted(info)}); it predates weight versions: use SGLang >= 0.5.2",
                              kind="protocol")
        return str(info["weight_version"])

    # ----------------------------------------------------------- generation
    def generate(self, input_ids: list[list[int]], sampling_params: list[dict], *, rids: Optional[list[str]] = None,
                 return_logprob: bool = True, timeout_s: Optional[float] = None,
                 return_routed_experts: bool = False, lora_path: Optional[str] = None,
                 image_data: Optional[list[list[str]]] = None) -> list[dict]:
        """``POST /generate`` as one batch (one entry per row): ``[{text, output_ids, meta_info}, ...]``;
        ``lora_path``: the name of a loaded LoRA adapter every row is generated with; ``image_data``: each row's
        images (``protocol.generate_payload``)."""
        payload = protocol.generate_payload(input_ids, sampling_params, rids=rids, return_logprob=return_logprob,
                                            return_routed_experts=return_routed_experts, lora_path=lora_path,
                                            image_data=image_data)
        body = self._json(self.request("POST", "/generate", payload, timeout_s=timeout_s), "/generate")
        if not isinstance(body, list) or len(body) != len(input_ids):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise self._error("/generate", f"{self.label} answered a batch of {len(input_ids)} "
                              f"with {got}; expected one entry per input", kind="protocol")
        return body

    def generate_one(self, input_ids: list[int], sampling_params: dict, *, rid: str, return_logprob: bool = True,
                     timeout_s: Optional[float] = None, return_routed_experts: bool = False,
                     lora_path: Optional[str] = None, image_data: Optional[list[str]] = None) -> dict:
        """``POST /generate`` for one row (the form an sglang-router accepts): ``{text, output_ids, meta_info}``."""
        payload = protocol.single_generate_payload(input_ids, sampling_params, rid=rid, return_logprob=return_logprob,
                                                   return_routed_experts=return_routed_experts, lora_path=lora_path,
                                                   image_data=image_data)
        body = self._json(self.request("POST", "/generate", payload, timeout_s=timeout_s), "/generate")
        if not isinstance(body, dict):
            raise self._error("/generate", f"{self.label} answered one request with {type(body).__name__}; "
                              "expected one {text, output_ids, meta_info} object", kind="protocol")
        return body

    def router_workers(self, *, timeout_s: Optional[float] = None) -> Optional[list[str]]:
        """The worker URLs when this address is an sglang-router (``GET /workers``), else None (a plain
        SGLang server answers 404 there)."""
        try:
            resp = self.request("GET", "/workers", timeout_s=timeout_s)
        except SGLangEngineError as exc:
            if exc.status in (404, 405):
                return None
            raise
        try:
            body = resp.json()
        except ValueError:
            return None
        return protocol.parse_router_workers(body)

    def abort_request(self, rid: str = "", *, abort_all: bool = False) -> None:
        """``POST /abort_request``: the aborted rows come back with finish_reason type "abort"."""
        self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def pause_generation(self, mode: str = "abort", *, timeout_s: Optional[float] = None) -> dict:
        """``POST /pause_generation`` (mode abort | retract | in_place); new requests wait until continue."""
        if mode not in protocol.PAUSE_MODES:
            raise self._error("/pause_generation", f"pause mode {mode!r} is not one of {protocol.PAUSE_MODES}")
        return self._json(self.request("POST", "/pause_generation", {"mode": mode}, timeout_s=timeout_s),
                          "/pause_generation")

    def continue_generation(self) -> dict:
        return self._json(self.request("POST", "/continue_generation", {}), "/continue_generation")

    def flush_cache(self) -> None:
        """``POST /flush_cache``; SGLang answers 400 "Flush cache failed." while requests are running or waiting."""
        self.request("POST", "/flush_cache", context="SGLang refuses to flush its cache while requests are running "
                                                     "or waiting: abort or finish them first")

    # -------------------------------------------------------------- weights
    def update_weights_from_disk(self, model_path: str, *, weight_version: Optional[str] = None,
                                 load_format: Optional[str] = None, abort_all_requests: bool = False,
                                 flush_cache: bool = True, timeout_s: Optional[float] = None) -> dict:
        """``POST /update_weights_from_disk``: load the safetensors under ``model_path`` (exempt from begin/end)."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests,
                                   "flush_cache": flush_cache}
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._weight_call("/update_weights_from_disk", payload, timeout_s,
                                 context=f"loading {model_path}; SGLang reads a local dir or else tries the hub, "
                                         "hence a network error for a path it cannot see")

    def load_lora_adapter(self, lora_name: str, lora_path: str, *, timeout_s: Optional[float] = None) -> dict:
        """``POST /load_lora_adapter``: serve the PEFT dir ``lora_path`` (adapter_config.json +
        adapter_model.safetensors, a path the server can read) as ``lora_name``, which requests then name in
        their ``lora_path``. Needs a server started with ``--enable-lora``; ``{success, error_message,
        loaded_adapters}`` back, 400 (raised, in the server's words) on failure."""
        return self._lora_call("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path}, timeout_s,
                               context=f"loading the LoRA adapter {lora_path} as {lora_name!r}")

    def load_lora_adapter_from_tensors(self, lora_name: str, config: dict, named_tensors: Iterable[tuple[str, Any]], *,
                                       tp_size: int = 1, timeout_s: Optional[float] = None) -> dict:
        """``POST /load_lora_adapter_from_tensors``: serve the adapter tensors (PEFT's saved keys) with their
        ``adapter_config.json`` ``config`` as ``lora_name``; one serialized copy per server TP rank (each rank
        slices its shard), file-system sharing as ``update_weights_from_named_tensors``, the buffers held until
        the server answered."""
        if tp_size < 1:
            raise ValueError(f"tp_size={tp_size}: the server has at least one tensor-parallel rank")
        entry, buffers = protocol.serialize_named_tensors(named_tensors, as_dict=True)
        try:
            return self._lora_call("/load_lora_adapter_from_tensors",
                                   {"lora_name": lora_name, "config_dict": dict(config),
                                    "serialized_named_tensors": [entry] * tp_size, "load_format": None}, timeout_s,
                                   context=f"loading the LoRA adapter {lora_name!r} from tensors")
        finally:
            del buffers  # only now may the shared-memory files go

    def unload_lora_adapter(self, lora_name: str, *, timeout_s: Optional[float] = None) -> dict:
        """``POST /unload_lora_adapter``: the server forgets ``lora_name`` (400 if it serves none by that name)."""
        return self._lora_call("/unload_lora_adapter", {"lora_name": lora_name}, timeout_s,
                               context=f"unloading the LoRA adapter {lora_name!r}")

    def _lora_call(self, endpoint: str, payload: dict, timeout_s: Optional[float], context: str) -> dict:
        return self._weight_call(endpoint, payload, timeout_s, context=context, message_key="error_message")

    def update_weights_from_tensor(self, serialized_named_tensors: list[str], *, load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None,
                                   timeout_s: Optional[float] = None) -> dict:
        """``POST /update_weights_from_tensor`` (one base64 entry per engine TP rank; inside begin/end)."""
        payload: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                                   "load_format": load_format, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._weight_call("/update_weights_from_tensor", payload, timeout_s)

    def update_weights_from_named_tensors(self, named_tensors: Iterable[tuple[str, Any]], *, tp_size: int = 1,
                                          load_format: Optional[str] = None, flush_cache: bool = True,
                                          weight_version: Optional[str] = None,
                                          timeout_s: Optional[float] = None) -> dict:
        """Send ``(name, tensor)`` pairs through ``/update_weights_from_tensor`` (on 0.5.21+ inside
        ``begin_weight_update`` / ``end_weight_update``).

        Serialised by ``protocol.serialize_named_tensors`` (file-system sharing, so a server in
        another process tree can open CPU tensors); the same entry for each of the server's
        ``tp_size`` ranks (each rank's loader takes its shard). The shared buffers are held until
        the server has answered, so none is freed before the engine copied it.
        """
        if tp_size < 1:
            raise ValueError(f"tp_size={tp_size}: the server has at least one tensor-parallel rank")
        entry, buffers = protocol.serialize_named_tensors(named_tensors)
        try:
            return self.update_weights_from_tensor([entry] * tp_size, load_format=load_format,
                                                   flush_cache=flush_cache, weight_version=weight_version,
                                                   timeout_s=timeout_s)
        finally:
            del buffers  # only now may the shared-memory files go

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: Optional[float] = None) -> dict:
        return self._weight_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout_s)

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None, load_format: Optional[str] = None,
                                        timeout_s: Optional[float] = None) -> dict:
        """``load_format="flattened_bucket"``: the server receives ONE uint8 broadcast holding the tensors' bytes
        back to back in ``names`` order (each at an offset aligned to its dtype) instead of one per name."""
        payload: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                                   "shapes": [list(s) for s in shapes], "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return self._weight_call("/update_weights_from_distributed", payload, timeout_s)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                     timeout_s: Optional[float] = None) -> dict:
        return self._weight_call("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    @property
    def has_update_session(self) -> Optional[bool]:
        """Whether the server has ``/begin_weight_update`` (None: not asked yet)."""
        return self._has_update_session

    def _session_call(self, endpoint: str) -> bool:
        """POST ``endpoint`` of the begin/end pair; False (and remembered) where the server lacks it (404)."""
        if self._has_update_session is False:
            return False
        try:
            self._weight_call(endpoint, {}, None)
        except SGLangSyncError as exc:
            if exc.status == 404:
                self._has_update_session = False
                return False
            raise
        return True

    def begin_weight_update(self) -> bool:
        """Open a weight-update session; False on a server older than 0.5.21 that lacks it."""
        if self._session_call("/begin_weight_update"):
            self._has_update_session = True
            return True
        return False

    def open_weight_update(self) -> bool:
        """``begin_weight_update``, first closing a session an interrupted sync left open (the server
        answers 400 "already open"); False on a server that lacks the pair."""
        try:
            return self.begin_weight_update()
        except SGLangSyncError as exc:
            if exc.status != 400 or "already open" not in (exc.server_message or ""):
                raise
        self.end_weight_update()
        return self.begin_weight_update()

    def end_weight_update(self) -> bool:
        """Close the session opened by ``begin_weight_update``; False where the server lacks the pair."""
        return self._session_call("/end_weight_update")

    def check_weights(self, action: str, *, timeout_s: Optional[float] = None) -> dict:
        """``POST /weights_checker`` (SGLang 0.5.19+): ``snapshot`` copies the model's tensors, ``reset_tensors``
        overwrites them with random values, ``compare`` checks them against the snapshot (400 naming every
        tensor that differs), inside the server, on every TP rank."""
        return self._weight_call("/weights_checker", {"action": action}, timeout_s)

    def weight_checksums(self, *, timeout_s: Optional[float] = None) -> dict:
        """``POST /weights_checker`` action ``checksum`` of the served model (``selector`` target: no draft model):
        ``{"ranks": [{"checksums": {name: 16 hex digits}, "parallelism_info": [{"tp_rank": ...}]}, ...]}``, one
        entry per TP rank, over SGLang's own tensors (``rollout.sglang.checksums``)."""
        return self._weight_call("/weights_checker", {"action": "checksum", "selector": "target"}, timeout_s)

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True) -> dict:
        """``POST /update_weight_version``; SGLang aborts in-flight requests unless told not to."""
        return self._weight_call("/update_weight_version", {"new_version": str(new_version),
                                                            "abort_all_requests": abort_all_requests}, None)

    # --------------------------------------------------------------- memory
    def release_memory_occupation(self, tags: Optional[Iterable[str]] = None, *,
                                  timeout_s: Optional[float] = None) -> None:
        """``POST /release_memory_occupation`` (tags: weights, kv_cache, cuda_graph; None = all); server idle."""
        self.request("POST", "/release_memory_occupation", {"tags": protocol.check_tags(tags)}, timeout_s=timeout_s)

    def resume_memory_occupation(self, tags: Optional[Iterable[str]] = None, *,
                                 timeout_s: Optional[float] = None) -> None:
        self.request("POST", "/resume_memory_occupation", {"tags": protocol.check_tags(tags)}, timeout_s=timeout_s)
