"""The embedded engine in a process of its own, behind the part of SGLang's HTTP protocol our client speaks.

Why: asynchronous RL generates while the trainer trains, which needs an engine that does not
live inside a trainer rank (the embedded engine normally runs in the driver rank, on its
devices and its Python interpreter). Served from its own process, the embedded engine is
reached exactly as an SGLang server is: the driver's ``SGLangEngine`` client, the disk weight
transport, pause / continue / abort around each sync, per-token weight-version spans. So the
asynchronous drivers, their partial rollouts and their staleness bookkeeping run unchanged on a
CPU machine with no SGLang install (``--embedded-engine-ranks process``; the driver starts it,
``rollout.embedded_process``).

Batching across requests (continuous, as SGLang's scheduler): at every decode step the rows that arrived
since join the running batch (``EmbeddedEngine.generate_continuous``: their prompts prefilled in that
step, their KV caches merged with the running one), and each row's reply goes back the step it ends, so
a request neither waits for a batch to finish before it starts nor for the batch's longest row before it
returns. Rows share a batch when they share temperature / top-p / top-k / stop tokens; each keeps its
own ``sampling_seed`` and ``max_new_tokens``, and its tokens do not depend on its batch (same prompt,
seed and budget give the engine's ``generate`` tokens). Rows of another sampling wait until the rows
ahead of them finish (first come, first served); while a weight update waits, no row joins, so the
running ones drain (SGLang's model-update lock). A model with sliding-window or linear-attention layers
(whose caches cannot be merged) is batched statically: the rows queued when a batch starts.

Endpoints (request and reply shapes as SGLang 0.5.23's, see ``rollout.sglang.protocol``):
``/generate`` (``input_ids`` only: the trainer never sends text; with ``image_data`` for a vision-language
model: each row's images as base64, ``data:`` URLs, file paths or bytes, as SGLang takes them, run through the
checkpoint's own image processor, ``data/images.py``, and each image's run of pad tokens in ``input_ids`` made its
feature count, one pad per image or the expanded run alike), ``/update_weights_from_disk``
(``model_path``, ``weight_version``: an integer string, as the trainer sends), ``/pause_generation``
(``abort``: running rows end "abort" with their tokens so far, queued ones with none; ``retract`` /
``in_place``: running rows park at their next step, as ``EmbeddedEngine.pause`` documents; in every
mode, requests arriving while paused wait for ``/continue_generation``),
``/continue_generation``, ``/abort_request`` (``rid`` or ``abort_all``), ``/flush_cache`` (400 while
rows run or wait, as SGLang's: waiting rows do not count while paused, nor rows a retract pause parked;
there is no cache kept between batches to flush), ``/model_info``,
``/server_info``, ``/health``, ``/health_generate``, ``/weights_checker`` (snapshot / reset_tensors /
compare, for ``--check-weight-update-equal``). Started with ``--enable-return-routed-experts`` (as SGLang),
a ``/generate`` with ``return_routed_experts`` gets each row's routes in ``meta_info.routed_experts``
(SGLang's base64 int32 ``[tokens, num_hidden_layers, topk]``, ``rollout.routes``); without that flag
such a request is refused (400). A weight update not preceded by a pause waits
for the running batch to finish and holds the next (SGLang's model-update lock); while paused it
lands at once, between two steps. Anything else answers 404 naming what this server serves
(the tensor and distributed weight routes need SGLang: validation refuses them before start).

    python -m megatron_rl.rollout.embedded_server --model HF_DIR [--host 127.0.0.1] [--port 0]
        [--enable-return-routed-experts] [--enable-deterministic-inference]
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlsplit

from megatron_rl.data.images import ImageProcessor, VisionInputs, expand_image_tokens
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.rollout.embedded import EmbeddedEngine, EngineRow, RowOutput
from megatron_rl.rollout.routes import to_sglang
from megatron_rl.data.types import SamplingParams

DEFAULT_VERSION = "default"  # SGLang's weight_version before any versioned update
SERVER_VERSION = "megatron_rl-embedded"  # what /server_info says this is (no SGLang version to claim)


class _Row:
    """One ``/generate`` row from arrival to reply."""

    __slots__ = ("rid", "prompt_ids", "key", "seed", "max_new_tokens", "images", "cancel", "done", "output", "error",
                 "tic")

    def __init__(self, rid: str, prompt_ids: list[int], key: tuple, seed: int, max_new_tokens: int,
                 images: Optional[VisionInputs] = None):
        self.rid, self.prompt_ids, self.key, self.seed = rid, prompt_ids, key, seed
        self.max_new_tokens = max_new_tokens
        self.images = images
        self.cancel = threading.Event()  # /abort_request or an abort-mode pause
        self.done = threading.Event()
        self.output: Optional[RowOutput] = None
        self.error: Optional[str] = None
        self.tic = time.time()

    def finish(self, output: Optional[RowOutput] = None, error: Optional[str] = None) -> None:
        self.output, self.error = output, error
        self.done.set()


def sampling_key(sp: dict) -> tuple:
    """What rows of one batch must share (``EmbeddedEngine.generate_rows`` takes one ``SamplingParams``)."""
    return (float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0),
            float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0),
            int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1),
            tuple(int(t) for t in sp.get("stop_token_ids") or ()), bool(sp.get("ignore_eos", False)))


def check_sampling(sp: Any) -> Optional[str]:
    """Why ``sp`` cannot be served (SGLang's ``SamplingParams.verify`` checks, in its words), or None."""
    if not isinstance(sp, dict):
        return f"sampling_params must be an object, got {type(sp).__name__}"
    temperature, top_p, top_k = sampling_key(sp)[:3]
    if not math.isfinite(temperature) or temperature < 0.0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    if not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if top_k != -1 and top_k < 1:
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if int(sp.get("max_new_tokens", 128)) < 1:
        return f"max_new_tokens must be at least 1 here, got {int(sp.get('max_new_tokens', 128))}."
    if int(sp.get("n", 1)) != 1:
        return "n must be 1: send one row per sample (each with its own sampling_seed)"
    return None


class EmbeddedServer:
    """Serve one ``EmbeddedEngine`` over HTTP on ``host:port`` (0: a free port), batching rows across requests."""

    def __init__(self, engine: EmbeddedEngine, *, host: str = "127.0.0.1", port: int = 0, model_path: str = ""):
        self.engine = engine
        self.model_path = model_path
        self._host, self._port = host, port
        self._cond = threading.Condition()
        self._queue: deque[_Row] = deque()
        self._running: dict[int, _Row] = {}  # id(its EngineRow) -> the row the engine is generating
        self._paused: Optional[str] = None
        self._updating = 0  # weight updates waiting for the running batch (they hold the next one)
        self._stopped = False
        self._version_names: dict[int, str] = {0: DEFAULT_VERSION}
        self._snapshot: Optional[list] = None  # /weights_checker's
        self.batches = 0  # engine calls (a continuous batch is one), rows taken, the most rows generated at once:
        self.batched_rows = 0  # what a test or a log reads to see batching happen
        self.most_rows = 0
        self.continuous = engine.joins_rows  # rows join a running batch; else static batches (generate_rows)
        self._httpd: Optional[ThreadingHTTPServer] = None
        self._threads: list[threading.Thread] = []
        self.images = RequestImages(engine)

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._port}"

    def start(self) -> "EmbeddedServer":
        self._httpd, http = start_http(_Handler, {"server_": self}, self._host, self._port, poll_interval_s=0.1)
        self._port = self._httpd.server_address[1]
        batches = threading.Thread(target=self._schedule, name="batches", daemon=True)
        batches.start()
        self._threads = [http, batches]
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for row in [*self._queue, *self._running.values()]:
                row.cancel.set()
            self._cond.notify_all()
        self.engine.continue_()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def state(self) -> dict[str, Any]:
        """Rows queued and running, updates waiting, the pause mode, batches run: what a test decides from."""
        with self._cond:
            return {"queued": len(self._queue), "running": len(self._running), "updating": self._updating,
                    "paused": self._paused, "batches": self.batches, "batched_rows": self.batched_rows,
                    "most_rows": self.most_rows}

    # ---------------------------------------------------------------- batches
    def _next_key(self) -> Optional[tuple]:
        """Wait for rows to generate (not paused, no update waiting); the oldest row's sampling key, or None
        once stopped."""
        with self._cond:
            while not self._stopped and (not self._queue or self._paused is not None or self._updating):
                self._cond.wait()
            return None if self._stopped else self._queue[0].key

    def _take(self, key: tuple, room: int) -> list[EngineRow]:
        """Up to ``room`` queued rows of sampling ``key`` that no row of another key precedes (FIFO: a stream of
        one key does not starve another), none while paused or while an update waits (the running batch then
        drains, SGLang's model-update lock)."""
        with self._cond:
            if self._stopped or self._paused is not None or self._updating:
                return []
            taken: list[EngineRow] = []
            while self._queue and self._queue[0].key == key and len(taken) < room:
                row = self._queue.popleft()
                engine_row = EngineRow(row.prompt_ids, row.seed, row.max_new_tokens, cancel=row.cancel,
                                       images=row.images)
                self._running[id(engine_row)] = row
                taken.append(engine_row)
            self.batched_rows += len(taken)
            self.most_rows = max(self.most_rows, len(self._running))
            return taken

    def _finished(self, engine_row: EngineRow, output: RowOutput) -> None:
        with self._cond:
            row = self._running.pop(id(engine_row))
            self._cond.notify_all()
        row.finish(output)

    def _schedule(self) -> None:
        while True:
            key = self._next_key()
            if key is None:
                return
            temperature, top_p, top_k, stop_ids, ignore_eos = key
            sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=stop_ids,
                                      ignore_eos=ignore_eos)
            try:
                if self.continuous:
                    self.engine.generate_continuous(sampling, lambda room: self._take(key, room), self._finished)
                else:
                    rows = self._take(key, len(self._queue))
                    for engine_row, out in zip(rows, self.engine.generate_rows(rows, sampling) if rows else []):
                        self._finished(engine_row, out)
            except Exception as exc:  # noqa: BLE001 - every row it held answers with the reason
                with self._cond:
                    failed, self._running = list(self._running.values()), {}
                for row in failed:
                    row.finish(error=f"{type(exc).__name__}: {exc}")
            with self._cond:
                self.batches += 1
                self._cond.notify_all()

    # ---------------------------------------------------------------- endpoints
    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """(status, reply) of one request; a str reply is sent as text/plain, anything else as JSON."""
        if path in ("/health", "/health_generate"):
            return 200, ""
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                         "weight_version": self._version_names[self.engine.weight_version]}
        if path in ("/server_info", "/get_server_info"):
            return 200, {"model_path": self.model_path, "tp_size": 1, "dp_size": 1, "device": str(self.engine.device),
                         "dtype": str(next(self.engine.model.parameters()).dtype).removeprefix("torch."),
                         "enable_deterministic_inference": True, "version": SERVER_VERSION,
                         "weight_version": self._version_names[self.engine.weight_version]}
        routes = {"/generate": self.generate, "/update_weights_from_disk": self.update_weights_from_disk,
                  "/pause_generation": self.pause, "/continue_generation": self.continue_,
                  "/abort_request": self.abort, "/flush_cache": self.flush_cache,
                  "/weights_checker": self.weights_checker}
        fn = routes.get(path)
        if fn is None:
            return 404, {"detail": f"Not Found: the embedded engine server serves {', '.join(sorted(routes))}, "
                                   "/model_info, /server_info and /health (weights: from disk only)"}
        if method != "POST" and path != "/flush_cache":
            return 405, {"detail": "Method Not Allowed"}
        if not isinstance(body, dict):
            return 400, _error("request body must be a JSON object")
        return fn(body)

    def generate(self, body: dict) -> tuple[int, Any]:
        if "input_ids" not in body:
            return 400, _error("send input_ids: the embedded engine server takes token ids, not text")
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        rids = body.get("rid")
        rids = [uuid.uuid4().hex for _ in prompts] if rids is None else rids if isinstance(rids, list) else [rids]
        if len(params) != len(prompts) or len(rids) != len(prompts):
            return 400, _error(f"The length of sampling_params ({len(params)}) and rid ({len(rids)}) must match "
                               f"the batch size ({len(prompts)})")
        routes = bool(body.get("return_routed_experts", False))
        if routes and self.engine.route_capture is None:
            return 400, _error("return_routed_experts needs a server started with --enable-return-routed-experts")
        row_images, refused = image_data_rows(body.get("image_data"), len(prompts), batch)
        if refused:
            return 400, _error(refused)
        rows = []
        processed: dict[tuple, VisionInputs] = {}  # a group's rows carry the same images: processed once
        for k, (prompt, sp, rid, items) in enumerate(zip(prompts, params, rids, row_images)):
            refused = check_sampling(sp)
            if refused is None and not (isinstance(prompt, list) and prompt):
                refused = f"input_ids of row {k} must be a non-empty list of token ids"
            if refused:
                return 400, _error(refused)
            try:
                ids, vision = self.images.prepare([int(t) for t in prompt], items, f"row {k}", processed)
            except ConfigError as exc:
                return 400, _error(str(exc))
            seed = sp.get("sampling_seed")
            rows.append(_Row(str(rid), ids, sampling_key(sp),
                             int(seed) if seed is not None else uuid.uuid4().int & ((1 << 63) - 1),
                             int(sp.get("max_new_tokens", 128)), vision))
        with self._cond:  # while paused (any mode) they wait in the queue for continue, as SGLang holds them
            self._queue.extend(rows)
            self._cond.notify_all()
        for row in rows:
            row.done.wait()
        failed = [row.error for row in rows if row.error]
        if failed:
            return 400, _error(failed[0])
        out = [self._reply(row, routes) for row in rows]
        return 200, (out if batch else out[0])

    def _reply(self, row: _Row, routes: bool = False) -> dict:
        out = row.output
        assert out is not None, "a row without an error has an output"
        if out.finish_reason == "stop":
            finish: dict = {"type": "stop", "matched": out.response_ids[-1]}
        elif out.finish_reason == "abort":
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        else:
            finish = {"type": "length", "length": row.max_new_tokens}
        spans: list[list] = []  # runs of one weight version over the output tokens
        for t, v in enumerate(out.versions):
            if spans and spans[-1][0] == v:
                spans[-1][2] = t + 1
            else:
                spans.append([v, t, t + 1])
        name = self._version_names.get
        current = name(self.engine.weight_version, str(self.engine.weight_version))
        n = len(out.response_ids)
        tok = self.engine.tokenizer  # SGLang detokenizes (skip_special_tokens: the client always asks it)
        text = tok.decode(out.response_ids, skip_special_tokens=True) if tok is not None else ""
        meta: dict = {}
        capture = self.engine.route_capture
        if routes and capture is not None and out.routes is not None:
            meta["routed_experts"] = to_sglang(out.routes, capture.moe_layers, capture.num_hidden_layers)
        return {"text": text, "output_ids": list(out.response_ids), "meta_info": {
            **meta, "id": row.rid, "finish_reason": finish, "prompt_tokens": len(row.prompt_ids), "weight_version": current,
            "output_token_logprobs": [[float(lp), int(t), None] for lp, t in zip(out.logprobs, out.response_ids)],
            "completion_tokens": n, "cached_tokens": 0,
            "weight_versions": [{"version": name(v, str(v)), "start": a, "end": b} for v, a, b in spans]
            or [{"version": current, "start": 0, "end": 0}],
            "e2e_latency": time.time() - row.tic}}

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        path = body.get("model_path")
        given = body.get("weight_version")
        try:
            version = self.engine.weight_version + 1 if given is None else \
                0 if str(given) == DEFAULT_VERSION else int(str(given))
        except ValueError:
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": f"weight_version {given!r}: this server numbers versions with integers"}
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        with self._cond:
            self._updating += 1  # no batch starts meanwhile
            try:
                # not paused: wait for the running batch (SGLang's model-update lock); paused: it parks between
                # two steps, and the update lands there (EmbeddedEngine.exclusive)
                while self._running and self._paused is None and not self._stopped:
                    self._cond.wait()
            except BaseException:
                self._updating -= 1
                raise
        try:
            self.engine.update_weights_from_disk(str(path), version)
        except Exception as exc:  # noqa: BLE001 - the reason goes back to the client, as SGLang's loader's does
            return 400, {"success": False, "num_paused_requests": 0, "message": f"Failed to update weights: {exc}"}
        finally:
            with self._cond:
                self._updating -= 1
                self._cond.notify_all()
        self._version_names[version] = str(version if given is None else given)  # what /model_info reports now
        self.model_path = str(path)
        return 200, {"success": True, "num_paused_requests": 0,
                     "message": f"Succeeded to update model weights. Weight version updated to {version}."}

    def pause(self, body: dict) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return 400, _error(f"mode must be one of abort, retract, in_place, got {mode!r}")
        with self._cond:
            self._paused = mode
            if mode == "abort":
                self._abort_queued(lambda row: True)
            self._cond.notify_all()
        self.engine.pause(mode)  # abort: the running rows end with their tokens; else they park at a step
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_(self, body: dict) -> tuple[int, Any]:
        with self._cond:
            self._paused = None
            self._cond.notify_all()
        self.engine.continue_()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort(self, body: dict) -> tuple[int, Any]:
        every = bool(body.get("abort_all"))
        rid = str(body.get("rid") or "")

        def chosen(row: _Row) -> bool:
            return every or row.rid == rid

        with self._cond:
            self._abort_queued(chosen)
            for row in self._running.values():
                if chosen(row):
                    row.cancel.set()  # ends "abort" after its current step, its tokens kept
        if every and self.engine.paused in ("retract", "in_place"):
            self.engine.pause("abort")  # rows parked at a step would not reach their next one until continue
        return 200, ""

    def _abort_queued(self, chosen) -> None:
        """End the queued rows ``chosen`` picks with no tokens (called holding the condition)."""
        kept: deque[_Row] = deque()
        for row in self._queue:
            if chosen(row):
                row.finish(RowOutput([], [], "abort"))
            else:
                kept.append(row)
        self._queue = kept

    def weights_checker(self, body: dict) -> tuple[int, Any]:
        """SGLang's ``/weights_checker`` (what ``--check-weight-update-equal`` drives): ``snapshot`` copies the
        live weights, ``reset_tensors`` overwrites them with noise (so an update that skipped a tensor shows),
        ``compare`` checks the live weights against the snapshot bit for bit, naming every tensor that differs.
        ``tensor_checksums`` (ours, not SGLang's: ``--update-weight-verify`` of this engine) answers the
        ``algorithm`` checksum of each tensor in ``names`` (HF names) as the engine holds it now."""
        import torch  # lazy: the module's request handling needs no torch of its own

        action = body.get("action", "checksum")
        if action == "tensor_checksums":
            names, algorithm = body.get("names"), body.get("algorithm")
            if not isinstance(names, list) or not isinstance(algorithm, str):
                return 400, {"success": False, "message": "tensor_checksums needs names (a list of tensor names) and "
                                                           "algorithm (a checksum name)"}
            try:
                return 200, {"success": True, "checksums": self.engine.weight_checksums(names, algorithm)}
            except (EngineError, KeyError, ValueError) as exc:
                return 400, {"success": False, "message": str(exc)}
        with self.engine.exclusive():
            params = list(self.engine.model.named_parameters())
            if action == "snapshot":
                self._snapshot = [(n, p.detach().clone()) for n, p in params]
            elif action == "reset_tensors":
                gen = torch.Generator().manual_seed(0)
                for _, p in params:
                    p.data.copy_(torch.rand(p.shape, generator=gen).to(p.dtype))
            elif action == "compare":
                if self._snapshot is None:
                    return 400, {"success": False, "message": "compare needs a snapshot first"}
                bad = [n for (n, p), (_, want) in zip(params, self._snapshot) if not torch.equal(p, want)]
                self._snapshot = None
                if bad:
                    return 400, {"success": False, "message": f"check tensor equality failed: {len(bad)} tensor(s) "
                                                               f"differ: {', '.join(bad[:8])}"}
            else:
                return 400, {"success": False, "message": f"Unsupported action={action!r} (snapshot, "
                                                           "reset_tensors, compare, tensor_checksums)"}
        return 200, {"success": True, "message": "Success."}

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        # SGLang's rule (Scheduler.flush_cache: is_fully_idle(ignore_waiting=paused)): while paused the waiting
        # rows do not count, and a retract pause has put the running ones among them; an in_place pause keeps
        # them running (and their cache), so the flush is refused then
        with self._cond:
            busy = bool(self._queue) and self._paused is None or bool(self._running) and self._paused != "retract"
        return (400, "Flush cache failed.") if busy else (200, "Cache flushed.")


class RequestImages:
    """What a server does with ``/generate``'s ``image_data`` for ``engine``: each row's images decoded and run
    through the checkpoint's own image processor (as the driver does, ``data/images.py``), and its prompt's runs of
    image-pad tokens made each image's feature count, as SGLang's processor does (it collapses a run of pad tokens
    between the vision start and end tokens and expands it again), so a prompt holding one pad token per image and
    one holding the expanded runs are served alike. Shared with the tests' SGLang stand-in."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine
        self._processor: Optional[ImageProcessor] = None  # the checkpoint's, loaded at the first image
        self._lock = threading.Lock()

    def processor(self) -> ImageProcessor:
        with self._lock:
            if self._processor is None:
                # the checkpoint the engine started from (a server's model_path follows weight updates, whose
                # directories hold weights only)
                self._processor = ImageProcessor(self.engine.hf_checkpoint, flag="--model")
            return self._processor

    def prepare(self, ids: list[int], items: list, what: str,
                processed: Optional[dict[tuple, VisionInputs]] = None) -> tuple[list[int], Optional[VisionInputs]]:
        """A row's prompt and images as the engine takes them (``processed``: images already made in this request,
        by their items). ``ConfigError`` naming the row: images for a text-only model, an image that does not
        decode, pad tokens that are not one run per image, pad tokens without images."""
        image_tokens = self.engine.image_tokens
        if image_tokens is None:
            if items:
                raise ConfigError(f"image_data: {what} has {len(items)} image(s) but {self.engine.hf_checkpoint} is a "
                                  "text-only model")
            return ids, None
        pad, merge = image_tokens
        if not items:
            if pad in ids:
                raise ConfigError(f"{what}: input_ids hold image-pad tokens (id {pad}) but the request has no "
                                  "image_data for it; send its images")
            return ids, None
        key = tuple(items) if all(isinstance(v, str) for v in items) else None
        vision = processed.get(key) if processed is not None and key is not None else None
        if vision is None:
            vision = self.processor().process(items, f"image_data: {what}")
            assert vision is not None, "items is not empty"
            if processed is not None and key is not None:
                processed[key] = vision
        collapsed = [t for k, t in enumerate(ids) if t != pad or k == 0 or ids[k - 1] != pad]
        return expand_image_tokens(collapsed, vision, pad, merge, f"image_data: {what}"), vision


def image_data_rows(data: Any, rows: int, batch: bool) -> tuple[list[list], Optional[str]]:
    """SGLang's ``image_data`` as each row's list of images (``[]``: none), read as SGLang 0.5.23's
    ``GenerateReqInput`` reads it; or why it cannot be. One request: one image or a list of its images. A batch:
    one image (every row gets it), or one entry per row, each a list of that row's images when the first entry
    is a list (else each entry the row's one image); None or ``[]`` for a row without."""
    if data is None or data == []:
        return [[] for _ in range(rows)], None
    if not batch:
        return [[v for v in (data if isinstance(data, list) else [data]) if v is not None]], None
    if not isinstance(data, list):
        return [[data] for _ in range(rows)], None
    if len(data) != rows:
        return [], f"The length of image_data ({len(data)}) should be equal to the batch size ({rows})."
    if isinstance(data[0], list):
        if not all(entry is None or isinstance(entry, list) for entry in data):
            return [], "image_data: a batch's entries must all be lists of a row's images when the first one is"
        return [[v for v in entry or [] if v is not None] for entry in data], None
    return [[] if entry is None else [entry] for entry in data], None


def _error(message: str) -> dict:
    return {"error": {"message": message}}


class JsonHandler(BaseHTTPRequestHandler):
    """A keep-alive HTTP/1.1 handler of JSON requests and JSON or text replies, as uvicorn serves SGLang: what
    this server and the CI's protocol stand-in share."""

    protocol_version = "HTTP/1.1"  # keep-alive: the client's pool reuses connections
    disable_nagle_algorithm = True  # TCP_NODELAY: else each keep-alive request waits for a delayed ACK

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    @staticmethod
    def parse_json(raw: bytes) -> tuple[Any, Optional[str]]:
        """(the body, None), or (None, why it is not JSON)."""
        try:
            return (json.loads(raw) if raw else {}), None
        except ValueError as exc:
            return None, f"JSON decode error: {exc}"

    def send_reply(self, status: int, reply: Any) -> None:
        """``reply`` as text/plain when a str, else as JSON; a client gone meanwhile closes the connection."""
        if isinstance(reply, str):
            data, ctype = reply.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(reply).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


class _Backlogged(ThreadingHTTPServer):
    """socketserver's listen backlog is 5: a burst of callers (a producer's workers, a batch's rows) past it, or
    the callers queued on a busy or stopped server, would each get a connect timeout naming the server as
    unreachable instead of the read timeout that says it did not answer. uvicorn's (SGLang's) is 2048."""

    request_queue_size = 256


def start_http(handler: type[JsonHandler], attrs: dict[str, Any], host: str, port: int, *,
               poll_interval_s: float) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """A threading HTTP server on ``host:port`` (0: a free one) whose handler is a subclass of ``handler`` carrying
    ``attrs`` (the object it serves), serving from a daemon thread: what this server and the stand-in start."""
    bound = type(handler.__name__, (handler,), dict(attrs))
    httpd = _Backlogged((host, port), bound)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": poll_interval_s}, name="http",
                              daemon=True)
    thread.start()
    return httpd, thread


class _Handler(JsonHandler):
    server_: EmbeddedServer

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        body, bad = self.parse_json(self.read_body())
        status, reply = (400, _error(bad)) if bad else self.server_.handle(method, urlsplit(self.path).path, body)
        self.send_reply(status, reply)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description="The embedded rollout engine served over "
                                 "SGLang's HTTP protocol, in a process of its own")
    ap.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="record each token's MoE experts and return them to requests with return_routed_experts "
                         "(SGLang's flag; routing replay R3)")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="run every forward and sampling step under the batch-invariant ops (SGLang's flag; "
                         "--true-on-policy-mode, docs/on-policy.md)")
    args = ap.parse_args(argv)
    import torch  # lazy: only the serving process needs torch's thread setting

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        engine = EmbeddedEngine(args.model, record_routes=args.enable_return_routed_experts,
                                batch_invariant=args.enable_deterministic_inference)
    except ConfigError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    server = EmbeddedServer(engine, host=args.host, port=args.port, model_path=args.model).start()
    print(f"serving {args.model} at {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
