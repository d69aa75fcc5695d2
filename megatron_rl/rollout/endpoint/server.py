"""The OpenAI-compatible endpoint an ``--agent-function-path`` agent talks to: ``/v1/chat/completions`` (and
``/v1/completions``) per session.

One HTTP server per process (``endpoint_for``), bound to 127.0.0.1 on a free port for the life of the process,
like the SGLang-protocol gateway (``slime_compat/gateway.py``) whose batcher it generates with: the same engine
call a native generate function gets (``engine.generate`` in a synchronous run, the asynchronous producer's
gated call otherwise), requests arriving together served by one engine call, an engine error or a sync's cut
handed to the group. Each agent session has its own base URL, ``http://127.0.0.1:PORT/sessions/<id>/v1``, so an
unchanged OpenAI client (``OpenAI(base_url=...)``) carries the session in every request's path.

A request: ``messages`` (and ``tools``) rendered with the model's chat template
(``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)``, encoded without added
special tokens, as ``--apply-chat-template`` encodes prompts; a tool call's ``arguments`` JSON string passed as
its object, ``_plain``); the engine samples with the run's sampling flags
(``--rollout-temperature``, ``--rollout-top-p``, ``--rollout-top-k``: the trainer's log-probs are the run's; a
request's ``temperature`` / ``top_p`` are not used) for at most what the branch's response budget
(``--rollout-max-response-len``, counted from the branch's first prompt) has left, or ``max_tokens`` /
``max_completion_tokens`` when smaller. The completion is recorded (``trajectory.Completion``: prompt ids, output
ids, log-probs, weight versions) before the reply. The reply's text is the output decoded without special
tokens; with ``tools`` in the request, Hermes / Qwen ``<tool_call>{json}</tool_call>`` blocks
(``agent/parse.py``) become ``message.tool_calls`` (``content``: the text before the first block, None when
empty) and ``finish_reason`` ``tool_calls``. With ``--save-debug-rollout-data DIR/...`` every completion is also
written as one JSON line to ``DIR/agent_completions.jsonl``. ``/v1/completions`` takes ``prompt`` as it is (one
string, encoded without added special tokens, or one list of token ids; no template) and answers ``text``;
recorded and budgeted the same way. A request whose prompt extends no branch of the session starts a new branch
(``trajectory.py``; a template that drops earlier turns' thinking, e.g. Qwen3's): its response budget starts
afresh (at most ``--rollout-max-response-len``, and its prompt + response within ``--rollout-max-prompt-len`` +
``--rollout-max-response-len``). Not served: ``stream``, ``n`` > 1, ``stop`` strings (refused, 400).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

from megatron_rl.data.types import SamplingParams
from megatron_rl.errors import ConfigError, MegatronRLError
from megatron_rl.rollout.agent.parse import TOOL_CALL_START, parse_tool_calls
from megatron_rl.rollout.embedded_server import JsonHandler, start_http
from megatron_rl.rollout.endpoint.trajectory import Completion, Session
from megatron_rl.rollout.slime_compat.gateway import Gateway, Lane

log = logging.getLogger("megatron_rl")

_PREFIX = "/sessions/"
_ROUTE = "/v1/chat/completions"
_TEXT_ROUTE = "/v1/completions"


@dataclasses.dataclass
class LiveSession:
    """A session while its agent runs: its records, the group's engine call and sampling, what ended it."""

    session: Session
    lane: Lane
    sampling: SamplingParams
    max_prompt_len: int
    error: Optional[BaseException] = None  # a refusal (a first prompt too long) the group raises
    aborted: bool = False  # an engine call failed or was cut: the group's attempt ends with the lane's error
    truncated: set[int] = dataclasses.field(default_factory=set)  # branches a request found with no budget left
    requests: int = 0
    # one request of a session at a time: where a request goes (which branch it extends, or a new one) depends on
    # the completions before it, so a second request sent while one is generating waits for it
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Endpoint:
    """``/sessions/<id>/v1/chat/completions`` (and ``/v1/models``) over the sessions' engine calls."""

    def __init__(self, tokenizer: Any, *, model: str = "", seed: int = 0, host: str = "127.0.0.1",
                 journal: Optional[str] = None):
        self.tokenizer = tokenizer
        self.journal = journal
        self.model = model or "policy"
        self.batcher = Gateway(tokenizer, model_path=model, seed=seed)  # its batching, not its HTTP server
        self._host = host
        self._sessions: dict[str, LiveSession] = {}
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()  # a fast tokenizer used from two threads at once can fail
        self._httpd: Any = None
        self.port = 0

    def start(self) -> "Endpoint":
        self._httpd, _ = start_http(_Handler, {"endpoint": self}, self._host, 0, poll_interval_s=0.1)
        self.port = int(self._httpd.server_address[1])
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def base_url(self, session_id: str) -> str:
        return f"http://{self._host}:{self.port}{_PREFIX}{session_id}/v1"

    @contextlib.contextmanager
    def session(self, lane: Lane, sampling: SamplingParams, max_prompt_len: int) -> Iterator[LiveSession]:
        """A new session served while the ``with`` lasts (its requests generate through ``lane``)."""
        live = LiveSession(Session(uuid.uuid4().hex), lane, sampling, max_prompt_len)
        with self._lock:
            self._sessions[live.session.session_id] = live
        try:
            yield live
        finally:
            with self._lock:
                self._sessions.pop(live.session.session_id, None)

    # ------------------------------------------------------------------ serving
    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if not path.startswith(_PREFIX):
            return 404, _error(f"Not Found: {path}; this run's agent endpoint serves {_PREFIX}<session>{_ROUTE}")
        sid, _, rest = path[len(_PREFIX):].partition("/")
        with self._lock:
            live = self._sessions.get(sid)
        if live is None:
            return 404, _error(f"no agent session {sid} is running (a session lives while its agent call runs)")
        if rest.rstrip("/") == "v1/models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "megatron_rl"}]}
        route = {_ROUTE: self.chat, _TEXT_ROUTE: self.text_completion}.get("/" + rest.rstrip("/"))
        if route is None:
            return 404, _error(f"Not Found: /{rest}; served under the session's base URL: {_ROUTE}, {_TEXT_ROUTE} "
                               "and /v1/models")
        if method != "POST" or not isinstance(body, dict):
            return 400, _error(f"POST a JSON object to /{rest}")
        with live.lock:
            return route(live, body)

    def chat(self, live: LiveSession, body: dict) -> tuple[int, Any]:
        """``/v1/chat/completions``: ``messages`` (and ``tools``) rendered with the chat template, then generated."""
        messages, tools = body.get("messages"), body.get("tools") or None
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            return 400, _error("messages must be a non-empty list of message objects")
        if self.tokenizer is None:
            return 400, _error("the model (--hf-checkpoint) has no tokenizer to render messages with")
        try:
            with self._render_lock:
                text = self.tokenizer.apply_chat_template([_plain(m) for m in messages], tools=tools,
                                                          add_generation_prompt=True, tokenize=False)
                prompt = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        except Exception as exc:  # noqa: BLE001 - the agent gets the template's reason (400), not a dropped call
            return 400, _error(f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}")
        status, out = self._generate(live, prompt, body)
        if status != 200:
            return status, out
        decoded, finish, n = out
        return 200, self._reply(decoded, _tool_calls(decoded) if tools else [], finish, len(prompt), n)

    def text_completion(self, live: LiveSession, body: dict) -> tuple[int, Any]:
        """``/v1/completions``: ``prompt`` (a string, encoded without added special tokens, or token ids) as it
        is, no template."""
        raw = body.get("prompt")
        if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = [int(t) for t in raw]
        elif isinstance(raw, str) and raw and self.tokenizer is not None:
            with self._render_lock:
                prompt = [int(t) for t in self.tokenizer.encode(raw, add_special_tokens=False)]
        else:
            return 400, _error("prompt must be one non-empty string (the model has a tokenizer) or one list of "
                               "token ids")
        status, out = self._generate(live, prompt, body)
        if status != 200:
            return status, out
        decoded, finish, n = out
        return 200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                     "model": self.model, "choices": [{"index": 0, "text": decoded, "logprobs": None,
                                                       "finish_reason": finish}],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}}

    def _generate(self, live: LiveSession, prompt: list[int], body: dict) -> tuple[int, Any]:
        """(200, (decoded text, finish_reason, output tokens)) of one recorded completion of ``prompt``, or
        (status, error body): the session's refusals, the budget, the engine call, the record."""
        if live.error is not None:
            return 400, _error(str(live.error))
        if live.aborted:
            return 503, _error("the agent session's engine call was cut (a weight sync) or failed: the group is "
                               "generated again", "aborted")
        refused = (("stream", "streaming is not served") if body.get("stream") else
                   ("n", "one choice per request (n = 1)") if body.get("n") not in (None, 1) else
                   ("stop", "stop strings are not served: the model's end-of-turn token ends a completion")
                   if body.get("stop") else None)
        if refused:
            return 400, _error(f"{refused[0]}: {refused[1]}")
        s = live.session
        if not s.branches and len(prompt) > live.max_prompt_len:
            live.error = ConfigError(f"agent session {s.session_id}: the first request's prompt renders to "
                                     f"{len(prompt)} tokens, more than --rollout-max-prompt-len {live.max_prompt_len}: "
                                     "raise the flag or shorten the agent's first messages")
            return 400, _error(str(live.error), "prompt_too_long")
        live.requests += 1
        branch = s.place(prompt)
        max_new = live.sampling.max_new_tokens
        if branch is None and s.branches:  # a new branch (trajectory.py): its response starts here
            log.info("agent session %s splits: %s; branch %d starts", s.session_id, s.describe_split(prompt),
                     len(s.branches))
        # a branch's response within --rollout-max-response-len, its sequence within what the session's first
        # branch could reach (--rollout-max-prompt-len + --rollout-max-response-len)
        held = 0 if branch is None else len(prompt) - len(s.branches[branch][0].prompt_ids)
        budget = min(max_new - held, live.max_prompt_len + max_new - len(prompt))
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(cap, int) and cap > 0:
            budget = min(budget, cap)
        if budget <= 0:  # the branch's response budget is spent: nothing is generated or recorded
            if branch is not None:  # a new branch without room is never started
                live.truncated.add(branch)
            return 200, ("", "length", 0)
        sampling = dataclasses.replace(live.sampling, max_new_tokens=budget, seed=None, n=1)  # one per session
        out = self.batcher.submit(prompt, sampling, live.lane)
        if out is None or out.finish_reason == "abort":
            live.aborted = True
            return 503, _error("the rollout engine's call was cut (a weight sync) or failed: the group is "
                               "generated again", "aborted")
        completion = Completion(prompt, list(out.response_ids), [float(x) for x in out.rollout_logprobs],
                                [int(v) for v in out.effective_token_versions()], out.finish_reason)
        s.add(completion, -1 if branch is None else branch)
        if self.journal:
            _record(self.journal, s.session_id, completion)
        decoded = ""
        if self.tokenizer is not None:
            with self._render_lock:
                decoded = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        return 200, (decoded, completion.finish_reason, len(completion.output_ids))

    def _reply(self, text: str, calls: list[dict], finish: str, prompt_len: int, n: int) -> dict:
        content: Optional[str] = text
        if calls:
            content = text[:text.index(TOOL_CALL_START)] or None
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": "tool_calls" if calls else finish}],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}}


def _plain(message: dict) -> dict:
    """A message as a chat template reads it: OpenAI content parts joined into one string, and each tool call's
    ``arguments`` (a JSON string in the OpenAI API) as the object it encodes, as HF templates expect (Qwen2.5's
    renders ``arguments | tojson``: the string itself would be quoted again, and the history would no longer be
    what the model wrote)."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "".join(p.get("text", "") for p in content if isinstance(p, dict))}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message = {**message, "tool_calls": [_call_object(c) for c in calls]}
    return message


def _call_object(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("arguments"), str)):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: rendered as the agent sent it
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def _tool_calls(text: str) -> list[dict]:
    """The OpenAI ``tool_calls`` of ``text``'s ``<tool_call>`` blocks; none when one is malformed (the text is
    then the reply's content, as it was written)."""
    calls = parse_tool_calls(text)
    if not calls or any(c.error for c in calls):
        return []
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]


def _record(journal: str, session_id: str, c: Completion) -> None:
    """One JSON line per completion (``--save-debug-rollout-data``): what the saved samples can be compared with."""
    line = json.dumps({"session": session_id, "prompt_ids": c.prompt_ids, "output_ids": c.output_ids,
                       "logprobs": c.logprobs, "token_versions": c.token_versions,
                       "finish_reason": c.finish_reason}) + "\n"
    os.makedirs(os.path.dirname(journal) or ".", exist_ok=True)
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())  # one write per completion: concurrent sessions' lines never interleave
    finally:
        os.close(fd)


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _Handler(JsonHandler):
    endpoint: Endpoint

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        body, bad = self.parse_json(self.read_body())
        try:
            status, reply = (400, _error(bad)) if bad else self.endpoint.handle(method, urlsplit(self.path).path, body)
        except MegatronRLError as exc:
            status, reply = 400, _error(str(exc))
        except Exception as exc:  # noqa: BLE001 - the client gets the reason (500), never a dropped connection
            status, reply = 500, _error(f"{type(exc).__name__}: {exc}", "server_error")
        self.send_reply(status, reply)


_ENDPOINTS: dict[tuple, Endpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()


def endpoint_for(model_path: str, seed: int, tokenizer_loader: Any, journal: Optional[str] = None) -> Endpoint:
    """The process's endpoint for this model, seed and journal (started at its first use, serving until the
    process ends)."""
    with _ENDPOINTS_LOCK:
        ep = _ENDPOINTS.get((model_path, seed, journal))
        if ep is None:
            ep = Endpoint(tokenizer_loader(model_path) if model_path else None, model=model_path, seed=seed,
                          journal=journal).start()
            _ENDPOINTS[(model_path, seed, journal)] = ep
        return ep


__all__ = ["Endpoint", "LiveSession", "endpoint_for"]
