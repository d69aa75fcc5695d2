"""The SGLang-protocol endpoint a slime function posts to: ``/generate`` served by the run's own engine call.

Why a gateway of our own rather than the engine's URL: a slime function reaches the engine only through
``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate``, and the run's engine is not always an HTTP
server (the embedded engine lives in the driver in a synchronous run). The gateway, one per process, bound to
127.0.0.1 on a free port for the life of the process, answers exactly that request shape by calling the same
engine call a native generate function gets (``EngineCall``: ``engine.generate`` in a synchronous run, the
asynchronous producer's gated call in a one-step or fully asynchronous run; with SGLang engines that call goes to
the SGLang router), so weight syncs, aborts and per-token weight versions keep working as they do for every
other rollout. Requests that arrive while an engine call runs are served together by the next one (one call per
sampling; the engine calls are made one at a time: the driver's embedded engine is not thread-safe), so the
concurrent samples of a rollout are batched as the engine batches any call. The reply carries exactly the
engine's tokens and log-probs (``meta_info.output_token_logprobs``): a function that builds its sample from them
trains on what the engine sampled (no re-tokenisation).

Request fields read: ``input_ids`` (or ``text``, encoded with the model's tokenizer as SGLang encodes it),
``sampling_params`` (``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``, ``stop_token_ids``, ``stop``
strings, ``ignore_eos``, ``sampling_seed``, ``skip_special_tokens``, ``no_stop_trim``), ``return_logprob``. A
``stop`` string ends the response at the first token whose text completes it (the tokens are drawn one after the
other, so the response cut there is the one a stopping engine returns). A request's ``sampling_seed`` is honoured
(its row then goes to the engine alone); others get the call's seed, successive calls ``SEED_STRIDE`` apart.

Which engine call: the groups running a slime function register theirs (``lane``) for the time of their call;
a request is served by the newest registered one (they differ only in the group they belong to). An engine
error raised by a lane's call is handed to every group then running (``Lane.errors``) and re-raised by each when
its function returns, so a sync that cuts the calls or an engine that fails ends every group's attempt as it
would a native function's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import uuid
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import EngineError
from megatron_rl.rollout.embedded_server import JsonHandler, start_http


#: seeds of successive engine calls lie this far apart
SEED_STRIDE = 1_000_003


class Lane:
    """One group's engine call while its slime function runs, and the errors its requests met."""

    def __init__(self, call: Any):
        self.call = call
        self.errors: list[BaseException] = []


class _Row:
    """One /generate request waiting for its engine call."""

    __slots__ = ("request", "sampling", "lane", "output", "done")

    def __init__(self, request: GenerateRequest, sampling: SamplingParams, lane: Lane):
        self.request, self.sampling, self.lane = request, sampling, lane
        self.output: Optional[Sample] = None
        self.done = False


class Gateway:
    """``/generate`` (and ``/health``, ``/model_info``) over the lanes' engine calls."""

    def __init__(self, tokenizer: Any, *, model_path: str = "", journal: Optional[str] = None,
                 seed: int = 0, host: str = "127.0.0.1"):
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.journal = journal
        self._seed = seed
        self._host = host
        self._lanes: list[Lane] = []
        self._lock = threading.Lock()
        self._serve_lock = threading.Lock()
        self._queue: list[_Row] = []
        self.requests = 0  # /generate requests and engine calls made for them: what a test reads to see batching
        self.calls = 0
        self._httpd: Any = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def start(self) -> "Gateway":
        self._httpd, _ = start_http(_Handler, {"gateway": self}, self._host, 0, poll_interval_s=0.1)
        self.port = int(self._httpd.server_address[1])
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    @contextlib.contextmanager
    def lane(self, call: Any) -> Iterator[Lane]:
        lane = Lane(call)
        with self._lock:
            self._lanes.append(lane)
        try:
            yield lane
        finally:
            with self._lock:
                self._lanes.remove(lane)

    # ------------------------------------------------------------------ serving
    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path in ("/health", "/health_generate"):
            return 200, ""
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        if path != "/generate":
            return 404, {"detail": f"Not Found: this run's SGLang-protocol gateway serves /generate, /model_info and "
                                   f"/health, not {path}"}
        if method != "POST" or not isinstance(body, dict):
            return 400, _error("POST a JSON object to /generate")
        return self.generate(body)

    def generate(self, body: dict) -> tuple[int, Any]:
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            return 400, _error("sampling_params must be one JSON object (one prompt per request here)")
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            if self.tokenizer is None:
                return 400, _error("text input needs the model's tokenizer (--hf-checkpoint has none): send input_ids")
            ids = list(self.tokenizer.encode(body["text"]))
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
            return 400, _error("send input_ids (a non-empty list of token ids, one prompt) or text")
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else [s for s in stops if s]
        if stops and self.tokenizer is None:
            return 400, _error("stop strings need the model's tokenizer (--hf-checkpoint has none): use stop_token_ids")
        with self._lock:
            self.requests += 1
            lanes = list(self._lanes)
        if not lanes:
            return 503, _error("no rollout is running: this gateway serves the run's slime functions while they run")
        seed = sp.get("sampling_seed")
        try:
            sampling = SamplingParams(
                temperature=float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0),
                top_p=float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0),
                top_k=int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1),
                max_new_tokens=int(sp.get("max_new_tokens", 128)),
                stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
                seed=None if seed is None else int(seed), ignore_eos=bool(sp.get("ignore_eos", False)))
        except Exception as exc:  # noqa: BLE001 - a bad field answers 400 with the reason, as SGLang does
            return 400, _error(str(exc))
        output = self.submit([int(t) for t in ids], sampling, lanes[-1])
        out = [output] if output is not None else []
        if len(out) != 1:  # the call failed (an engine error, a sync): the row answers "abort", as SGLang's
            return 200, self._reply(body, [], [], "abort", None, "0", str(uuid.uuid4().hex))
        s = out[0]
        ids_out, lps = list(s.response_ids), [float(x) for x in s.rollout_logprobs]
        finish = s.finish_reason
        matched: Any = s.response_ids[-1] if finish == "stop" and s.response_ids else None  # SGLang: the id, or the str
        if stops:
            cut = _stop_at(self.tokenizer, ids_out, stops)
            if cut is not None:
                ids_out, lps, finish, matched = ids_out[:cut[0]], lps[:cut[0]], "stop", cut[1]
        reply = self._reply(body, ids_out, lps, finish, matched, str(s.oldest_version), uuid.uuid4().hex,
                            no_stop_trim=bool(sp.get("no_stop_trim", False)), stops=stops,
                            skip_special=bool(sp.get("skip_special_tokens", True)), prompt_len=len(ids))
        if self.journal:
            self._record(ids, ids_out, lps, finish)
        return 200, reply

    def submit(self, ids: list[int], sampling: SamplingParams, lane: Lane) -> Optional[Sample]:
        """The engine's sample of the context ``ids`` through ``lane``'s call, batched with the rows queued
        meanwhile (module docstring); None when the call failed (its error is in ``lane.errors``). What the
        OpenAI-compatible endpoint (``rollout/agent_endpoint``) generates with too."""
        row = _Row(GenerateRequest(prompt_ids=list(ids), group_index=0, max_new_tokens=sampling.max_new_tokens),
                   sampling, lane)
        with self._lock:
            self._queue.append(row)
        with self._serve_lock:  # whoever holds it serves every row queued meanwhile, in one call per sampling
            if not row.done:
                with self._lock:
                    batch, self._queue = self._queue, []
                self._serve(batch)
        return row.output

    def _serve(self, rows: list["_Row"]) -> None:
        """One engine call per lane and sampling (seed and length aside) for ``rows``: each row keeps its own
        budget (``GenerateRequest.max_new_tokens``); rows that asked for a ``sampling_seed`` go alone. A call
        that fails leaves its rows without output (they answer "abort") and its error with every running group."""
        sets: dict[tuple, list[_Row]] = {}
        for row in rows:
            alone = id(row) if row.sampling.seed is not None else None
            key = (id(row.lane), alone, dataclasses.replace(row.sampling, seed=None, max_new_tokens=1))
            sets.setdefault(key, []).append(row)
        for group in sets.values():
            with self._lock:
                self.calls += 1
                k = self.calls
            first = group[0].sampling
            sampling = dataclasses.replace(first, max_new_tokens=max(r.sampling.max_new_tokens for r in group),
                                           seed=first.seed if first.seed is not None else self._seed + SEED_STRIDE * k)
            try:
                out = list(group[0].lane.call([r.request for r in group], sampling))
                if len(out) != len(group):
                    raise EngineError(f"the rollout engine returned {len(out)} samples for {len(group)} requests")
                for r, sample in zip(group, out):
                    r.output = sample
            except BaseException as exc:  # noqa: BLE001 - each running group re-raises it when its function returns
                with self._lock:
                    for running in self._lanes:
                        running.errors.append(exc)
            finally:
                for r in group:
                    r.done = True

    def _reply(self, body: dict, ids: list, lps: list, finish: str, matched: Any, version: str, rid: str, *,
               no_stop_trim: bool = True, stops: Optional[list] = None, skip_special: bool = True,
               prompt_len: int = 0) -> dict:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special) if self.tokenizer is not None else ""
        if finish == "stop" and isinstance(matched, str) and not no_stop_trim and text.endswith(matched):
            text = text[:-len(matched)]
        reason: dict = ({"type": "stop", "matched": matched} if finish == "stop" else
                        {"type": "abort", "message": "Aborted"} if finish == "abort" else
                        {"type": "length", "length": len(ids)})
        meta: dict = {"id": rid, "finish_reason": reason, "prompt_tokens": prompt_len, "completion_tokens": len(ids),
                      "cached_tokens": 0, "weight_version": version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _record(self, prompt: list, ids: list, lps: list, finish: str) -> None:
        line = json.dumps({"input_ids": prompt, "output_ids": ids, "logprobs": lps, "finish_reason": finish}) + "\n"
        assert self.journal is not None
        os.makedirs(os.path.dirname(self.journal) or ".", exist_ok=True)
        fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())  # one write per reply: lines from concurrent replies never interleave
        finally:
            os.close(fd)


def _stop_at(tokenizer: Any, ids: list, stops: list) -> Optional[tuple[int, str]]:
    """(k, the stop string) where the text of ``ids[:k]`` first contains a stop string, or None."""
    if not any(s in tokenizer.decode(ids) for s in stops):
        return None
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        for s in stops:
            if s in text:
                return k, s
    return None


def _error(message: str) -> dict:
    return {"error": {"message": message}}


class _Handler(JsonHandler):
    gateway: Gateway

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        body, bad = self.parse_json(self.read_body())
        try:
            status, reply = (400, _error(bad)) if bad else self.gateway.handle(method, urlsplit(self.path).path, body)
        except Exception as exc:  # noqa: BLE001 - the client gets the reason (500), never a dropped connection
            status, reply = 500, _error(f"{type(exc).__name__}: {exc}")
        self.send_reply(status, reply)


__all__ = ["Gateway", "Lane"]
