"""A protocol-exact local stand-in for an SGLang HTTP server, backed by the embedded engine (CPU test stand-in).

Real SGLang needs a 7 GB install and 1-2 minutes to start (docs/sglang-cpu.md), so CI
talks to this instead: same paths, request fields, reply shapes and status codes as SGLang
0.5.23, answered by ``EmbeddedEngine`` on a tiny HF model, so a weight push visibly changes
generations. Shapes were taken from SGLang's sources (0.5.19-0.5.23 wheels as read for issue
14, and the stored copies of ``python/sglang/srt/entrypoints/http_server.py`` and
``python/sglang/srt/managers/io_struct.py`` / ``sampling/sampling_params.py``):

* ``POST /generate``: ``input_ids`` (one list, or a list of lists = batch), ``sampling_params``
  (a dict, or one per row), ``rid``, ``return_logprob``, ``image_data`` (each row's images, read as
  ``GenerateReqInput`` reads them, processed as the embedded engine server does: ``RequestImages``; kept per rid
  in ``generated``); answers ``{text, output_ids, meta_info}``
  (a list for a batch) with ``meta_info`` carrying the keys real SGLang 0.5.23 sends
  (``id, finish_reason, prompt_tokens, weight_version, num_retractions, input_token_logprobs,
  output_token_logprobs=[[logprob, id, None], ...], output_token_logprobs_length,
  reasoning_tokens, completion_tokens, cached_tokens, weight_versions=[{version, start, end}],
  cached_tokens_details, dp_rank, e2e_latency, response_sent_to_client_ts``); errors
  ``{"error": {"message"}}`` with 400 (invalid sampling params too, in ``SamplingParams.verify``'s
  words). ``sampling_seed`` is honoured as by a server started with
  ``--enable-deterministic-inference``; ``deterministic=False`` plays the default server, which
  ignores it (``/server_info`` reports which).
* weight endpoints: ``{success, message}`` (``/update_weights_from_disk`` adds
  ``num_paused_requests``; a pushed ``weight_version`` appends " Weight version updated to V."
  to the message), 200 or 400; ``/update_weight_version`` adds ``new_version`` and
  aborts all requests unless ``abort_all_requests`` is false.
* ``/begin_weight_update`` / ``/end_weight_update`` (0.5.21+): tensor and distributed updates
  answer 400 outside the pair; disk is exempt. ``legacy=True`` plays a server older than
  0.5.21: the pair answers FastAPI's 404 ``{"detail": "Not Found"}`` and no session is needed.
* ``/release_memory_occupation`` / ``/resume_memory_occupation`` (``tags``): 200 with a
  ``null`` body, 400 ``{"error": {"message"}}`` (release asserts the server is idle).
* ``/pause_generation`` (``mode``) / ``/continue_generation``: ``{"message", "status": "ok"}``. Rows
  not yet started (pending) wait until continue in every mode. ``retract`` / ``in_place`` park the rows
  being generated at their next decode step (``EmbeddedEngine.pause``), a weight update then lands at
  once (SGLang skips its model-update lock while paused), and continue goes on under the new weights:
  ``in_place`` over the KV cache the old ones built, ``retract`` over a prefix recomputed by the new
  ones (SGLang's re-prefill); the row's ``weight_versions`` spans and ``output_token_logprobs`` show
  both versions. Not paused (or paused in ``abort`` mode), an update waits for the rows being
  generated to finish, as SGLang's ``model_update_lock`` makes it; ``abort`` aborts the pending rows
  (and rows parked by an earlier retract / in_place pause) and cuts the rows being generated at their next
  step, as SGLang does.
* ``/abort_request`` (``rid``, ``abort_all``): 200, empty body; aborted rows finish "abort".
* ``/flush_cache``: plain text, 200, or 400 while requests are running or waiting.
* ``/model_info`` (``weight_version``: "default" until a versioned update; ``model_path`` and
  ``served_model_name`` follow each disk load, ``tokenizer_path`` stays), ``/server_info``
  (a subset of the resolved launch arguments: the ones a client reads), ``/health``
  (200 empty; 503 while "starting"), ``/health_generate``.

The replies and messages above are held to real SGLang 0.5.23's in CI: ``tests/rollout/test_standin_replies.py``
sends ``tools/sglang_cpu/record_replies.py``'s fixed requests here and compares statuses, reply shapes and
messages with ``tests/rollout/fixtures/sglang_0.5.23_replies.json``, recorded from real SGLang on CPU
(``scripts/test_sglang_real.sh --record-replies``); ``tools/sglang_cpu/check_real_sglang.py`` compares the
replies that need a request in flight or a second server (flush refused, an aborted row, a 503) on every run.

* ``/init_weights_update_group`` (``master_address, master_port, rank_offset, world_size,
  group_name, backend``) / ``/update_weights_from_distributed`` (``names, dtypes, shapes,
  group_name, flush_cache, abort_all_requests, weight_version, load_format``) /
  ``/destroy_weights_update_group`` (``group_name``), as SGLang 0.5.23 handles them
  (``model_runner_components/weight_updater.py``, ``scheduler_components/weight_updater.py``,
  ``tokenizer_control_mixin.py``): the server joins a process group of its own as rank
  ``rank_offset + tp_rank`` (tp_size 1 here) the way ``init_custom_process_group`` does (a
  ``tcp://`` rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper`` with no
  rank list: a non-default group, the default one is never made), from the request's thread; an
  update allocates each tensor (``getattr(torch, dtype)``, shape), posts one ``broadcast(src=0)`` per
  name in order, waits for all, then loads them into the embedded engine (``load_format
  "flattened_bucket"``: one uint8 broadcast of all their bytes, sliced back as 0.5.23's
  ``FlattenedTensorBucket`` does, a misaligned offset refused in its words; ``version`` is what
  ``/server_info`` reports, "0.5.23" unless told). Replies and messages are
  SGLang's ("Succeeded to initialize custom process group.", "Failed to receive weights: ...",
  "Succeeded to update parameter online." + " Weight version updated to V.", the flush refusal,
  "The group to be destroyed does not exist."); 400 outside begin/end. ``server.groups`` holds the
  live groups by name; ``server.distributed_updates`` lists ``(weight_version, names)`` per update,
  ``server.distributed_formats`` their ``load_format``.

* ``/update_weights_from_tensor`` (``serialized_named_tensors, load_format, flush_cache,
  abort_all_requests, weight_version``), as SGLang 0.5.23 handles it for tp_size 1
  (``scheduler_components/weight_updater.py``, ``tp_worker.deserialize_own_rank``,
  ``model_runner_components/weight_updater.py``): entry ``[tp_rank]`` is base64-decoded
  and unpickled the way ``MultiprocessingSerializer.deserialize`` does, through an allowlist
  (``_SafeUnpickler``: SGLang's ``SafeUnpickler`` rules for the globals a tensor payload uses, so
  a payload real SGLang would refuse is refused here too, in its words); ``load_format
  "flattened_bucket"`` is a ``{flattened_tensor, metadata}`` dict rebuilt as
  ``FlattenedTensorBucket.reconstruct_tensors`` does (``buffer[start:end].view(dtype).reshape(shape)``),
  None a list of ``(name, tensor)``; then loaded into the embedded engine. Replies "Success"
  (+ " Weight version updated to V."), the flush refusal while requests run, 400 outside
  begin/end. ``tp_size`` > 1 plays replicated TP ranks: each opens its own entry, all must carry the
  same tensors (every trainer rank sends full HF tensors), rank 0's are loaded (tensor route only).
  ``server.tensor_updates`` lists ``(weight_version, load_format, names)`` per update.
  Run the stand-in in its own process (``python tests/rollout/sglang_standin.py --model DIR``)
  for the handles to cross processes as they do with SGLang (``file_system`` sharing on CPU).

* ``/load_lora_adapter`` (``lora_name``, ``lora_path``: a PEFT dir), ``/load_lora_adapter_from_tensors``
  (``lora_name``, ``config_dict``, ``serialized_named_tensors``) / ``/unload_lora_adapter`` (``lora_name``), with
  ``enable_lora`` (SGLang's ``--enable-lora``): SGLang 0.5.23's ``LoRAUpdateOutput`` (``success``,
  ``error_message``, ``loaded_adapters``; 400 on failure) and its refusals in its words (LoRA not enabled, a
  name already loaded, unloading an unknown name). A ``/generate`` naming an adapter in ``lora_path`` is
  generated with it merged into the weights (PEFT's ``W + alpha/r B A`` in float32, restored to the base for
  rows without one, one adapter per request); a name unloaded since is loaded again from its path, a name
  never loaded is refused, as SGLang's ``_resolve_lora_path`` does. A base weight update lands on the base
  (the adapter stays apart). ``server.lora_loads`` lists every load. Checked against real SGLang on CPU by
  ``scripts/test_sglang_real.sh --lora``.

Where the stand-in differs on purpose (said so in its replies): ``/generate`` while the
weights or KV cache are released answers 400 (real SGLang on GPU would crash or compute
garbage); a tensor update whose payload cannot be opened, or whose weights do not fit,
answers 400 with the reason (SGLang raises in its scheduler, which takes the server down); a
weights-update group times out after ``group_timeout_s`` (60 s; SGLang: torch's 30 min default)
so a broken test fails instead of waiting; the error wording is its own. Rows of
a batch are generated one by one (each with its own ``sampling_seed``), as SGLang's
continuous batching makes rows independent.

Faults (``server.faults``, a ``Faults``): ``delay_s`` per path (slow replies, for timeouts; the
key ``"/generate:row"`` instead holds each generate row *pending* that long, abortable, for the
abort / flush / pause tests),
``drop`` (close the connection without a reply for the next N requests to a path),
``die_on`` (the server dies on receiving a path: listening socket closed, every connection
cut), ``die_mid_bucket`` (the next ``/update_weights_from_distributed`` receives that many tensors,
then the server dies: its group dropped, the request unanswered, the server down),
and ``stop()`` / ``start()`` for connection refused then back. ``server.requests``
counts every request received, so tests can check what was (not) retried; ``server.generated`` keeps,
per answered ``/generate`` row (by rid), the ``sampling_params`` it came with and the row sent back, so a
client test checks the request it made and how it parsed the reply; ``server.disk_updates``
lists each loaded ``/update_weights_from_disk`` as ``(weight_version, model_path)``, in order.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import datetime
import glob
import hashlib
import io
import json
import math
import os
import pickle
import secrets
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

import torch
from safetensors.torch import load_file

from megatron_rl.data.images import VisionInputs
from megatron_rl.errors import ConfigError
from megatron_rl.rollout import EmbeddedEngine, SamplingParams
from megatron_rl.rollout.embedded import EngineRow, row_seed
from megatron_rl.rollout.embedded_server import JsonHandler, RequestImages, image_data_rows, start_http

ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
SESSION_ENDPOINTS = ("/update_weights_from_tensor", "/update_weights_from_distributed")


@dataclass
class Faults:
    """Switches a test flips to make the stand-in misbehave."""

    delay_s: dict = field(default_factory=dict)  # path -> seconds to wait before answering
    drop: Counter = field(default_factory=Counter)  # path -> requests to answer by closing the connection
    die_on: Optional[str] = None  # path whose arrival kills the server
    die_mid_bucket: Optional[int] = None  # tensors the next distributed update receives before the server dies
    die_in_group: Optional[str] = None  # with die_mid_bucket: only an update over a group whose name ends so
    abort_rows: int = 0  # the next this many generate rows come back aborted, as after another client's /abort_request
    unavailable_generates: int = 0  # the next this many /generate requests answer 503, as an abort with a status
    # an HF tensor name: after every weight load one element of it is changed inside the engine (+1.0 on its first
    # element), as a faulty apply would leave it; --update-weight-verify checksum must name it
    corrupt_after_update: Optional[str] = None


_DIE = object()  # a handler's reply meaning: the server dies with this request unanswered


class _Pending:
    def __init__(self, rid: str):
        self.rid = rid
        self.aborted = threading.Event()


def flattened_receive(names, dtypes, shapes):
    """``(flat, rebuild)`` of a ``load_format="flattened_bucket"`` distributed update, as SGLang 0.5.23's
    ``FlattenedTensorBucket.empty`` and ``reconstruct_tensors`` do it: ``flat`` is the uint8 tensor to
    receive into, ``rebuild()`` its ``(name, tensor)`` views, each slice at a byte offset that must be a
    multiple of its dtype's size (SGLang's ValueError, in its words, otherwise)."""
    layout, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dtype, shape = (dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)), torch.Size(shape)
        if any(dim < 0 for dim in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        layout.append((name, dtype, shape, offset))
        offset += shape.numel() * dtype.itemsize
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    flat = torch.empty(offset, dtype=torch.uint8)
    return flat, lambda: [(name, flat[start:start + shape.numel() * dtype.itemsize].view(dtype).reshape(shape))
                          for name, dtype, shape, start in layout]


class SGLangStandIn:
    """Serve ``hf_checkpoint`` on 127.0.0.1 like ``python -m sglang.launch_server`` would."""

    def __init__(self, hf_checkpoint: str, *, legacy: bool = False, deterministic: bool = True, port: int = 0,
                 group_timeout_s: float = 60.0, tp_size: int = 1, version: str = "0.5.23", enable_lora: bool = False,
                 max_lora_rank: int = 64):
        self.engine = EmbeddedEngine(hf_checkpoint, weight_backup=True)
        self.images = RequestImages(self.engine)  # /generate's image_data (a vision-language checkpoint)
        # --enable-lora: adapters by name (/load_lora_adapter), the paths of every one ever loaded (SGLang reloads an
        # unloaded adapter a request names), the adapter merged into the engine now and the base of its modules
        self.enable_lora, self.max_lora_rank = enable_lora, int(max_lora_rank)
        self.loras: dict[str, Any] = {}
        self.lora_ref_cache: dict[str, str] = {}
        self.lora_loads: list[tuple[str, str]] = []  # (lora_name, lora_path) of each load, implicit reloads too
        self._merged_lora: Optional[str] = None
        self._lora_base: dict[str, torch.Tensor] = {}
        self.version = version  # what /server_info reports (clients choose a distributed load_format by it)
        self.tp_size = int(tp_size)  # > 1: plays that many TP ranks on the tensor route (see update_weights_from_tensor)
        self.model_path = hf_checkpoint  # moves to each loaded dir, as SGLang's does
        self.tokenizer_path = hf_checkpoint
        self.legacy = legacy
        self.deterministic = deterministic
        self.faults = Faults()
        self.requests: Counter = Counter()  # path -> requests received
        self.rids_served: list[str] = []  # every /generate row's rid, in arrival order
        self.generated: dict[str, dict] = {}  # rid -> {"sampling_params": as received, "row": the reply row sent}
        self.disk_updates: list[tuple[Optional[str], str]] = []  # (weight_version, model_path) of each loaded update
        self.groups: dict[str, Any] = {}  # group_name -> this server's process group (SGLang's _model_update_group)
        self.group_timeout_s = group_timeout_s
        self.distributed_updates: list[tuple[Optional[str], list[str]]] = []  # (weight_version, names) per update
        self.distributed_group_names: list[str] = []  # the group of each of them
        self._weights_snapshot: Optional[list] = None  # /weights_checker snapshot
        self.weights_checker_actions: list[str] = []  # every /weights_checker action asked, in order
        self.distributed_formats: list[Optional[str]] = []  # load_format of each distributed update
        self.tensor_updates: list[tuple[Optional[str], Optional[str], list[str]]] = []  # (version, load_format, names)
        self.weight_version = "default"
        self.released: set[str] = set()
        self.in_session = False
        self.starting = False
        self._engine_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        # SGLang's model_update_lock: rows inside the engine are readers, weight writes the writer (see pause)
        self._rows = threading.Condition()
        self._generating = 0  # rows inside engine.generate (parked ones too)
        self._updates_waiting = 0
        self._version_names: dict[int, str] = {0: "default"}  # engine version -> the weight_version it was served as
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._engine_version = 0
        self._port = port
        self._httpd: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self._conns: set[socket.socket] = set()

    # ------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> "SGLangStandIn":
        self._httpd, self._thread = start_http(_Handler, {"standin": self}, "127.0.0.1", self._port,
                                               poll_interval_s=0.05)
        self._port = self._httpd.server_address[1]
        return self

    def stop(self) -> None:
        """Close the listening socket and cut every open connection (clients then get connection refused)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        with self._state_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for p in list(self._pending.values()):
            p.aborted.set()

    def __enter__(self) -> "SGLangStandIn":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._httpd is not None

    def pending_count(self) -> int:
        with self._state_lock:
            return len(self._pending)

    @contextlib.contextmanager
    def _model_update(self) -> Iterator[None]:
        """Write the weights as SGLang does: while the engine is paused at once (a retract / in_place pause
        parks the rows being generated at a decode-step boundary; an abort after it ends them), otherwise
        once the rows being generated have finished (new rows wait meanwhile: the model-update lock is a
        writer)."""
        with self._engine_lock:
            with self._rows:
                self._updates_waiting += 1
                self._rows.notify_all()  # a test watching the state sees the update waiting
                self._rows.wait_for(lambda: not self._generating or self.engine.paused is not None)
            try:
                with self.engine.exclusive():
                    yield
            finally:
                with self._rows:
                    self._updates_waiting -= 1
                    self._rows.notify_all()

    @contextlib.contextmanager
    def _row_generating(self) -> Iterator[None]:
        with self._rows:
            self._rows.wait_for(lambda: not self._updates_waiting)
            self._generating += 1
        try:
            yield
        finally:
            with self._rows:
                self._generating -= 1
                self._rows.notify_all()

    def _adopt_engine_version(self) -> None:
        """After an engine update: the engine's new version is served under the current weight_version until
        the handler names it (``_name_version``)."""
        self._engine_version += 1
        self._version_names[self._engine_version] = self.weight_version
        name = self.faults.corrupt_after_update
        if name is not None:
            with torch.no_grad():
                dict(self.engine.model.named_parameters())[name].view(-1)[0] += 1.0

    def _name_version(self, weight_version: str) -> None:
        self.weight_version = weight_version
        self._version_names[self._engine_version] = weight_version

    # ------------------------------------------------------------- handlers
    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """Return (status, body); a dict/list/None body is sent as JSON, a str as text/plain."""
        if path in ("/health", "/health_generate"):
            if self.starting:
                return 503, ""
            if path == "/health_generate":
                status, _ = self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1,
                                                                                  "temperature": 0.0}})
                return (200 if status == 200 else 503), ""
            return 200, ""
        if path in ("/model_info", "/get_model_info"):
            return 200, self.model_info()
        if path in ("/server_info", "/get_server_info"):
            return 200, self.server_info()
        routes = {
            "/generate": self.generate,
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weights_from_tensor": self.session_update,
            "/update_weights_from_distributed": self.session_update,
            "/init_weights_update_group": self.init_weights_update_group,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/update_weight_version": self.update_weight_version,
            "/release_memory_occupation": self.release,
            "/resume_memory_occupation": self.resume,
            "/pause_generation": self.pause,
            "/continue_generation": self.continue_,
            "/abort_request": self.abort,
            "/flush_cache": self.flush_cache,
            "/weights_checker": self.weights_checker,
            "/load_lora_adapter": self.load_lora_adapter,
            "/load_lora_adapter_from_tensors": self.load_lora_adapter_from_tensors,
            "/unload_lora_adapter": self.unload_lora_adapter,
        }
        if not self.legacy:
            routes["/begin_weight_update"] = self.begin
            routes["/end_weight_update"] = self.end
        fn = routes.get(path)
        if fn is None:  # FastAPI: an unknown path is 404 whatever the method (GET /workers on a server, too)
            return 404, {"detail": "Not Found"}
        if method != "POST" and path not in ("/flush_cache", "/release_memory_occupation",
                                              "/resume_memory_occupation"):
            return 405, {"detail": "Method Not Allowed"}
        if not isinstance(body, dict):
            return 400, _validation_error("request body must be a JSON object")
        if path == "/update_weights_from_tensor":  # SGLang 0.5.23 decodes the entries while parsing the request
            bad = [e for e in body.get("serialized_named_tensors") or [] if not _is_base64(e)]
            if bad:
                return 400, _validation_error("1 validation error: serialized_named_tensors: Value error, Expected "
                                              "base64-encoded bytes")
        return fn(body, path) if path in SESSION_ENDPOINTS else fn(body)

    def model_info(self) -> dict:
        config = self.engine.model.config
        return {"model_path": self.model_path, "served_model_name": self.model_path,
                "tokenizer_path": self.tokenizer_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None), "embedding": _EMBEDDING_PLAN}

    def server_info(self) -> dict:
        """The resolved launch arguments a client reads (real SGLang sends several hundred keys)."""
        return {"model_path": self.tokenizer_path, "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.tokenizer_path, "tp_size": self.tp_size, "dp_size": 1, "pp_size": 1,
                "device": "cpu",
                "dtype": "float32", "weight_version": "default", "disable_radix_cache": True,
                "enable_deterministic_inference": self.deterministic, "version": self.version}

    def generate(self, body: dict) -> tuple[int, Any]:
        if "input_ids" not in body:
            return 400, {"error": {"message": "The stand-in serves token ids only: send input_ids (text needs a "
                                              "tokenizer the tiny test models do not have)"}}
        ids = body["input_ids"]
        batch = bool(ids) and isinstance(ids[0], list)
        rows = ids if batch else [ids]
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        rids = body.get("rid")
        if rids is None:
            rids = [uuid.uuid4().hex for _ in rows]
        elif not isinstance(rids, list):
            rids = [rids]
        if len(params) != len(rows) or len(rids) != len(rows):
            return 400, {"error": {"message": f"The length of sampling_params ({len(params)}) and rid "
                                              f"({len(rids)}) must match the batch size ({len(rows)})"}}
        for sp in params:
            refused = _verify_sampling(sp)
            if refused:
                return 400, {"error": {"message": refused}}
        # image_data as SGLang 0.5.23's GenerateReqInput reads it; each row's images through the checkpoint's own
        # processor and its pad-token runs made their feature counts, as the embedded engine server does
        row_images, refused = image_data_rows(body.get("image_data"), len(rows), batch)
        if refused:
            return 400, {"error": {"message": refused}}
        visions = []
        try:
            for k, items in enumerate(row_images):
                prompt, vision = self.images.prepare([int(t) for t in rows[k]], items, f"row {k}")
                rows[k] = prompt
                visions.append(vision)
        except ConfigError as exc:
            return 400, {"error": {"message": str(exc)}}
        released = sorted(self.released & {"weights", "kv_cache"})
        if released:
            return 400, {"error": {"message": f"stand-in: memory released for {released}; call "
                                              "/resume_memory_occupation before /generate"}}
        lora = body.get("lora_path")
        if isinstance(lora, list):  # one per row in SGLang; the stand-in serves a batch with one adapter
            if len(set(lora)) > 1:
                return 400, {"error": {"message": "stand-in: one lora_path per request (SGLang mixes adapters in a "
                                                  "batch; the stand-in merges one into its weights)"}}
            lora = lora[0] if lora else None
        if lora:
            refused = self._resolve_lora(str(lora))
            if refused:
                return 400, {"error": {"message": refused}}
        with self._state_lock:
            unavailable = self.faults.unavailable_generates > 0
            self.faults.unavailable_generates -= unavailable
        if unavailable:
            # SGLang 0.5.23: a row aborted with a status (a decode retraction without a KV backup, a request
            # timeout, a priority preemption) fails the whole non-streamed request with that status
            # (TokenizerManager._handle_abort_finish_reason raises HTTPException; http_server's handler)
            message = "Retracted under decode memory pressure without a KV backup. Retry later."
            return 503, {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
        pending = [_Pending(str(r)) for r in rids]
        self.rids_served.extend(p.rid for p in pending)
        with self._state_lock:
            for p in pending:
                self._pending[p.rid] = p
        try:
            out = [self._generate_row(row, sp, p, lora or None, vision)
                   for row, sp, p, vision in zip(rows, params, pending, visions)]
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed request with its message
            return 400, {"error": {"message": str(exc)}}
        finally:
            with self._state_lock:
                for p in pending:
                    self._pending.pop(p.rid, None)
        for p, sp, row, items in zip(pending, params, out, row_images):
            self.generated[p.rid] = {"sampling_params": dict(sp), "row": row, "image_data": list(items)}
        return 200, (out if batch else out[0])

    def _generate_row(self, prompt: list, sp: dict, pending: _Pending, lora: Optional[str] = None,
                      images: Optional[VisionInputs] = None) -> dict:
        tic = time.time()
        delay = float(self.faults.delay_s.get("/generate:row", 0.0))
        deadline = time.monotonic() + delay
        while (time.monotonic() < deadline or not self._unpaused.is_set()) and not pending.aborted.is_set():
            time.sleep(0.005)
        if not prompt:
            raise ValueError("input_ids is empty")
        if pending.aborted.is_set():
            return _row("", [], [], {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                        pending.rid, len(prompt), self.weight_version, tic)
        with self._state_lock:
            refuse = self.faults.abort_rows > 0
            self.faults.abort_rows -= refuse
        if refuse:  # SGLang 0.5.23 answers HTTP 200 only for an abort without a status code (/abort_request)
            return _row("", [], [], {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                        pending.rid, len(prompt), self.weight_version, tic)
        temperature = float(sp.get("temperature", 1.0))
        sampling = SamplingParams(temperature=temperature, top_p=float(sp.get("top_p", 1.0)),
                                  top_k=int(sp.get("top_k", -1)), max_new_tokens=int(sp.get("max_new_tokens", 128)),
                                  stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                  seed=sp.get("sampling_seed") if self.deterministic else None,
                                  ignore_eos=bool(sp.get("ignore_eos", False)))
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        # the row's own generator seed as the engine's generate gives request 0, sample 0; /abort_request (or an
        # abort-mode pause) sets ``pending.aborted``: the row ends "abort" after its current step, tokens kept
        row = EngineRow(list(prompt), row_seed(seed, 0, 0), sampling.max_new_tokens, cancel=pending.aborted,
                        images=images)
        if lora != self._merged_lora:  # a writer: waits for the rows generating, as a weight update does
            with self._model_update():
                self._merge_lora(lora)
        with self._row_generating():
            sample = self.engine.generate_rows([row], sampling)[0]
        if sample.finish_reason == "stop":
            finish = {"type": "stop", "matched": sample.response_ids[-1]}
        elif sample.finish_reason == "abort":  # cut by an abort, or parked by a retract / in_place pause then aborted
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        else:
            finish = {"type": "length", "length": sampling.max_new_tokens}
        spans: list[list[int]] = []  # [engine version, start, end] runs over the output tokens
        for t, v in enumerate(sample.versions):
            if spans and spans[-1][0] == v:
                spans[-1][2] = t + 1
            else:
                spans.append([v, t, t + 1])
        text = " ".join(f"<{t}>" for t in sample.response_ids)  # the tiny models have no tokenizer
        return _row(text, sample.response_ids, sample.logprobs, finish, pending.rid, len(prompt),
                    self.weight_version, tic,
                    spans=[(self._version_names.get(v, self.weight_version), a, b) for v, a, b in spans])

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        path = body.get("model_path")
        files = sorted(glob.glob(f"{path}/*.safetensors")) if path else []
        index = os.path.join(str(path), "model.safetensors.index.json") if path else ""
        if files and os.path.isfile(index):  # SGLang's loader: only the files the index lists (not an adapter's)
            with open(index) as fh:
                listed = {os.path.join(str(path), f) for f in json.load(fh)["weight_map"].values()}
            files = [f for f in files if f in listed]
        if not files:
            # real SGLang falls back to a hub download for a path that is not a dir, hence its words
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": "Failed to get weights iterator: [Errno -2] Name or service not known."}
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        with self._model_update():
            try:
                self._merge_lora(None)  # a base update: SGLang's adapters stay apart from these weights
                self.engine.update_weights(tensors.items(), self._engine_version + 1)
                self._forget_lora_merge()
            except Exception as exc:  # noqa: BLE001 - SGLang reports loader errors as the message
                return 400, {"success": False, "num_paused_requests": 0,
                             "message": f"Failed to update weights: {exc}.\nRolling back to original weights."}
            self._adopt_engine_version()
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self._name_version(str(body["weight_version"]))
            message += f" Weight version updated to {self.weight_version}."
        self.model_path = str(path)
        self.disk_updates.append((body.get("weight_version"), str(path)))
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    # ------------------------------------------------------------------ LoRA
    def _lora_reply(self, ok: bool, error: str = "") -> tuple[int, Any]:
        """SGLang 0.5.23's ``LoRAUpdateOutput`` (200, or 400 with ``error_message``; ``loaded_adapters`` name ->
        path on success, null on failure)."""
        loaded = {n: self.lora_ref_cache[n] for n in self.loras} if ok else None
        return (200 if ok else 400), {"rid": None, "http_worker_ipc": None, "success": ok, "error_message": error,
                                      "loaded_adapters": loaded}

    def load_lora_adapter(self, body: dict) -> tuple[int, Any]:
        """``/load_lora_adapter`` (``lora_name``, ``lora_path``: a PEFT dir), SGLang's checks and words."""
        from megatron_rl.models.peft_adapter import AdapterExport  # lazy: the LoRA route only

        if not self.enable_lora:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name, path = str(body.get("lora_name")), str(body.get("lora_path"))
        if name in self.loras:
            return self._lora_reply(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        others = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors"))
                        if os.path.basename(f) != "adapter_model.safetensors")
        if others:  # real SGLang loads every file of the dir and its scheduler dies on the first base weight
            return self._lora_reply(False, f"stand-in: {path} holds {others} beside the adapter; SGLang 0.5.23 reads "
                                           "every safetensors file of an adapter's dir and its scheduler dies at the "
                                           "first request (\"Cannot find target module name for model.layers...\")")
        try:
            adapter = AdapterExport.load(path)
        except (OSError, ValueError, KeyError) as exc:
            return self._lora_reply(False, f"stand-in: cannot read the PEFT dir {path}: {exc}")
        if adapter.rank > self.max_lora_rank:
            return self._lora_reply(False, f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the "
                                           f"current LoRA memory pool configuration (max_lora_rank "
                                           f"{self.max_lora_rank})")
        with self._state_lock:
            self.loras[name] = adapter
            self.lora_ref_cache[name] = path
            self.lora_loads.append((name, path))
        return self._lora_reply(True)

    def load_lora_adapter_from_tensors(self, body: dict) -> tuple[int, Any]:
        """``/load_lora_adapter_from_tensors`` (``lora_name``, ``config_dict``, ``serialized_named_tensors``: one
        entry per TP rank of a ``{name: tensor}`` dict, ``load_format`` None), rank 0's entry opened as SGLang's
        ``tp_worker`` does."""
        from megatron_rl.models.peft_adapter import AdapterExport  # lazy: the LoRA route only

        if not self.enable_lora:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name, config = str(body.get("lora_name")), body.get("config_dict") or {}
        if name in self.loras:
            return self._lora_reply(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        try:
            tensors = _deserialize((body.get("serialized_named_tensors") or [None])[0])
            adapter = AdapterExport(dict(tensors.items()), int(config["r"]), float(config["lora_alpha"]))
        except Exception as exc:  # noqa: BLE001 - SGLang's scheduler would raise; the stand-in answers why
            return self._lora_reply(False, f"stand-in: cannot open the adapter tensors: {type(exc).__name__}: {exc}")
        with self._state_lock:
            self.loras[name] = adapter
            self.lora_ref_cache[name] = "__tensor__"
            self.lora_loads.append((name, "__tensor__"))
        return self._lora_reply(True)

    def unload_lora_adapter(self, body: dict) -> tuple[int, Any]:
        if not self.enable_lora:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name = str(body.get("lora_name"))
        if name not in self.loras:
            return self._lora_reply(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                           f"odict_keys({list(self.loras)})")
        with self._state_lock:
            del self.loras[name]
        return self._lora_reply(True)

    def _resolve_lora(self, name: str) -> Optional[str]:
        """A request's ``lora_path``: SGLang's refusal, or None once the adapter is loaded (one unloaded since is
        loaded again from its path, as SGLang's ``_resolve_lora_path`` does)."""
        if not self.enable_lora:
            return (f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        if name in self.loras:
            return None
        if name not in self.lora_ref_cache or self.lora_ref_cache[name] == "__tensor__":  # tensors: nothing to reload
            return (f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: dict_keys({list(self.lora_ref_cache)}).")
        status, reply = self.load_lora_adapter({"lora_name": name, "lora_path": self.lora_ref_cache[name]})
        return None if status == 200 else f"Failed to implicitly load LoRA adapter {name}: {reply['error_message']}"

    def _merge_lora(self, name: Optional[str]) -> None:
        """The engine's weights become the base with adapter ``name`` merged (PEFT's W + alpha/r B A, float32;
        ``models.peft_adapter.merged_weight``), or the base alone for None. Inside ``_model_update``."""
        from megatron_rl.models.peft_adapter import merged_weight  # lazy: the LoRA route only

        param_map = self.engine.param_map
        with torch.no_grad():
            for weight, base in self._lora_base.items():  # back to the base first
                param_map.view(weight).copy_(base)
            if name is not None:
                adapter = self.loras[name]
                for module, (a, b) in adapter.modules().items():
                    dst = param_map.view(f"{module}.weight")
                    base = self._lora_base.setdefault(f"{module}.weight", dst.detach().clone())
                    dst.copy_(merged_weight(base, a, b, adapter.scaling, dst.dtype))
        self._merged_lora = name

    def _forget_lora_merge(self) -> None:
        """After a base weight update: the engine holds the new base, with no adapter merged."""
        self._lora_base, self._merged_lora = {}, None

    def begin(self, body: dict) -> tuple[int, Any]:
        if self.in_session:
            return 400, {"success": False, "message": "a weight-update session is already open; "
                                                       "call end_weight_update() first"}
        self.in_session = True
        return 200, {"success": True, "message": "Success"}

    def end(self, body: dict) -> tuple[int, Any]:
        if not self.in_session:
            return 400, {"success": False, "message": "no weight-update session is open; call "
                                                       "begin_weight_update() first"}
        self.in_session = False
        return 200, {"success": True, "message": "Success"}

    def session_update(self, body: dict, path: str) -> tuple[int, Any]:
        if not self.legacy and not self.in_session:
            return 400, {"success": False, "message": f"{path[1:]} must run between begin_weight_update() and "
                                                       "end_weight_update()"}
        if path == "/update_weights_from_distributed":
            return self.update_weights_from_distributed(body)
        return self.update_weights_from_tensor(body)

    # ------------------------------------------------------- the tensor route
    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        """SGLang's tensor update: TP rank ``r`` opens entry ``[r]`` only, rebuilds the tensors, loads them.

        With ``tp_size`` > 1 the stand-in plays replicated TP ranks: every rank's entry is opened (as each
        of SGLang's ranks opens its own, from the trainer rank on its device) and must carry the same
        tensors bit for bit (each trainer rank sends the full HF tensors); rank 0's are loaded."""
        entries = body.get("serialized_named_tensors")
        if entries is None:
            return 400, _validation_error("Field required: serialized_named_tensors")
        load_format = body.get("load_format")
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        try:
            if len(entries) < self.tp_size:
                raise IndexError(f"{len(entries)} serialized_named_tensors entries for tp_size {self.tp_size}: TP "
                                 f"rank {len(entries)} has none (one entry per engine TP rank)")
            per_rank = []
            for rank in range(self.tp_size):
                payload = _deserialize(entries[rank])  # each TP rank opens its own entry only
                if load_format == "flattened_bucket":
                    per_rank.append(_reconstruct_flattened(payload))
                elif load_format in (None, "direct"):
                    per_rank.append([(str(name), tensor) for name, tensor in payload])
                else:
                    raise NotImplementedError(f"Unknown load_format={load_format}")
            named = per_rank[0]
            for rank, other in enumerate(per_rank[1:], 1):
                if [n for n, _ in other] != [n for n, _ in named] or not all(
                        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                        for (_, a), (_, b) in zip(named, other)):
                    raise ValueError(f"TP rank {rank}'s entry carries other tensors than TP rank 0's")
        except Exception as exc:  # noqa: BLE001 - SGLang's scheduler would raise; we answer with the reason
            return 400, {"success": False, "message": f"stand-in: could not open the tensor payload: "
                                                       f"{type(exc).__name__}: {exc}"}
        del per_rank, payload
        names = [name for name, _ in named]
        with self._model_update():
            try:
                self._check_fits(named)  # refused before any tensor is copied: the engine stays as it was
                self._merge_lora(None)  # a base update: SGLang's adapters stay apart from these weights
                self.engine.update_weights(named, self._engine_version + 1)
                self._forget_lora_merge()
            except Exception as exc:  # noqa: BLE001
                return 400, {"success": False, "message": f"stand-in: loading the tensors failed: {exc}"}
            self._adopt_engine_version()
        del named  # the trainer may free its buffers once we answered: nothing here points at them
        if body.get("flush_cache", True) and self.pending_count():
            return 400, {"success": False, "message": "Weights were updated, but the cache was not flushed because "
                                                      "requests are still running or queued. Retract or finish them, "
                                                      "then call /flush_cache."}
        message = "Success"
        if body.get("weight_version") is not None:
            self._name_version(str(body["weight_version"]))
            message += f" Weight version updated to {self.weight_version}."
        self.tensor_updates.append((body.get("weight_version"), load_format, names))
        return 200, {"success": True, "message": message}

    def _check_fits(self, named: list) -> None:
        """Every name is one of the model's and every shape its shape (the embedded engine would otherwise
        mark its weights incomplete and then take only whole-model updates, where a server takes buckets)."""
        params = self.engine.param_map  # the names (and tied aliases) the engine's own loader accepts
        unknown = [n for n, _ in named if n not in params]
        mismatched = [f"{n} (sent {tuple(t.shape)}, engine has {tuple(params.view(n).shape)})" for n, t in named
                      if n in params and tuple(t.shape) != tuple(params.view(n).shape)]
        if unknown or mismatched:
            raise ValueError("; ".join(part for part in (
                f"{len(unknown)} unknown name(s): {', '.join(unknown[:10])}" if unknown else "",
                f"{len(mismatched)} shape mismatch(es): {', '.join(mismatched[:10])}" if mismatched else "") if part))

    # ------------------------------------------------- the distributed route
    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        """SGLang's ``WeightUpdater.init_weights_update_group`` + ``init_custom_process_group``: join as
        rank ``rank_offset + tp_rank`` through a tcp:// rendezvous, on a group of our own."""
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                        rendezvous)

        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            return 400, _validation_error(f"Field required: {', '.join(missing)}")
        if self.tp_size != 1:
            return 400, {"success": False, "message": f"stand-in: tp_size {self.tp_size} plays TP ranks on the tensor "
                                                       "route only; the distributed route joins as one rank"}
        group_name = str(body.get("group_name", "weight_update_group"))
        if not group_name:
            return 400, {"success": False, "message": "Group name cannot be empty"}
        rank = int(body["rank_offset"]) + 0  # + tp_rank: one TP rank here
        world_size = int(body["world_size"])
        host = str(body["master_address"])
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        timeout = datetime.timedelta(seconds=self.group_timeout_s)
        try:
            store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(body['master_port'])}", rank, world_size,
                                                      timeout=timeout))
            store.set_timeout(timeout)
            store = PrefixStore(group_name, store)
            pg, _ = _new_process_group_helper(world_size, rank, [], Backend(str(body.get("backend", "nccl"))), store,
                                              group_name=group_name, backend_options=None, timeout=timeout)
            _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        except Exception as exc:  # noqa: BLE001 - SGLang answers with the error's words
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        with self._state_lock:
            self.groups[group_name] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        import torch.distributed as dist

        group_name = str(body.get("group_name", "weight_update_group"))
        with self._state_lock:
            pg = self.groups.pop(group_name, None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        try:
            dist.destroy_process_group(pg)
        except Exception as exc:  # noqa: BLE001
            return 400, {"success": False, "message": f"Failed to destroy custom process group: {exc}."}
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        """Receive one broadcast per name (SGLang's ``receive_weights_from_distributed``), or with
        ``load_format="flattened_bucket"`` one uint8 broadcast rebuilt as 0.5.23's
        ``FlattenedTensorBucket.empty`` / ``reconstruct_tensors`` do (each slice viewed as its dtype at an
        offset that must be a multiple of its element size); then load."""
        import torch.distributed as dist

        missing = [k for k in ("names", "dtypes", "shapes") if k not in body]
        if missing:
            return 400, _validation_error(f"Field required: {', '.join(missing)}")
        if body.get("abort_all_requests"):
            self.abort({"abort_all": True})
        group_name = str(body.get("group_name", "weight_update_group"))
        names, dtypes, shapes = list(body["names"]), list(body["dtypes"]), list(body["shapes"])
        die_after = None
        if self.faults.die_mid_bucket is not None and str(body.get("group_name", "")).endswith(
                self.faults.die_in_group or ""):
            die_after, self.faults.die_mid_bucket = self.faults.die_mid_bucket, None
        try:
            if group_name not in self.groups:
                raise AssertionError(f"Group {group_name} not in {list(self.groups)}. "
                                     "Please call `init_weights_update_group` first.")
            pg = self.groups[group_name]
            weights, handles = [], []
            if body.get("load_format") == "flattened_bucket":
                flat, rebuild = flattened_receive(names, dtypes, shapes)
                if die_after is None:  # the fault: down before the one broadcast arrives
                    dist.broadcast(flat, src=0, group=pg)
                    weights = rebuild()
            else:
                for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
                    if die_after is not None and i >= die_after:
                        break
                    weight = torch.empty(shape, dtype=getattr(torch, dtype))
                    handles.append(dist.broadcast(weight, src=0, group=pg, async_op=True))
                    weights.append((name, weight))
            for handle in handles:
                handle.wait()
        except Exception as exc:  # noqa: BLE001 - SGLang's reply for a failed receive
            return 400, {"success": False, "message": f"Failed to receive weights: {exc}"}
        if die_after is not None:  # the fault: drop the group mid-bucket and go down unanswered
            with self._state_lock:
                pg = self.groups.pop(group_name, None)
            if pg is not None:
                dist.destroy_process_group(pg)
            return 0, _DIE
        with self._model_update():
            try:
                self._merge_lora(None)  # a base update: SGLang's adapters stay apart from these weights
                self.engine.update_weights(weights, self._engine_version + 1)
                self._forget_lora_merge()
            except Exception as exc:  # noqa: BLE001
                return 400, {"success": False, "message": f"Failed to update parameter online: {exc}. The full "
                                                           "weights of the ModelRunner are partially updated. Please "
                                                           "discard the whole weights."}
            self._adopt_engine_version()
        if body.get("flush_cache", True) and self.pending_count():
            return 400, {"success": False, "message": "Weights were updated, but the cache was not flushed because "
                                                      "requests are still running or queued. Retract or finish them, "
                                                      "then call /flush_cache."}
        message = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            self._name_version(str(body["weight_version"]))
            message += f" Weight version updated to {self.weight_version}."
        self.distributed_updates.append((body.get("weight_version"), names))
        self.distributed_group_names.append(group_name)
        self.distributed_formats.append(body.get("load_format"))
        return 200, {"success": True, "message": message}

    def update_weight_version(self, body: dict) -> tuple[int, Any]:
        if "new_version" not in body:
            return 400, _validation_error("Field required: new_version")
        if body.get("abort_all_requests", True):
            self.abort({"abort_all": True})
        self._name_version(str(body["new_version"]))
        return 200, {"success": True, "message": f"Weight version updated to {self.weight_version}",
                     "new_version": self.weight_version}

    def _tags(self, body: dict) -> list[str]:
        tags = body.get("tags")
        return list(ALL_TAGS) if tags is None else [str(t) for t in tags]

    def release(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        if self.pending_count():
            return 400, {"error": {"message": "release_memory_occupation requires the server to be idle "
                                              f"({self.pending_count()} request(s) running)"}}
        if "weights" in tags and "weights" not in self.released:
            with self._engine_lock:
                self.engine.release()
        self.released |= set(tags)
        return 200, None

    def resume(self, body: dict) -> tuple[int, Any]:
        tags = self._tags(body)
        if "weights" in tags and "weights" in self.released:
            with self._engine_lock:
                self.engine.resume()
        self.released -= set(tags)
        return 200, None

    def pause(self, body: dict) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return 400, _validation_error(f"mode must be one of abort, retract, in_place, got {mode!r}")
        self._unpaused.clear()
        if mode == "abort":
            self.abort({"abort_all": True})
        else:
            self.engine.pause(mode)  # the rows being generated park at their next decode step
        with self._rows:
            self._rows.notify_all()  # an update waiting for the rows to finish may go now
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_(self, body: dict) -> tuple[int, Any]:
        self.engine.continue_()
        self._unpaused.set()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def abort(self, body: dict) -> tuple[int, Any]:
        with self._state_lock:
            for p in self._pending.values():
                if body.get("abort_all") or p.rid == body.get("rid"):
                    p.aborted.set()
        if body.get("abort_all") and self.engine.paused in ("retract", "in_place"):
            self.engine.pause("abort")  # the parked rows end "abort" with their partial tokens, as SGLang's do
        return 200, ""

    def weights_checker(self, body: dict) -> tuple[int, Any]:
        """SGLang 0.5.19+'s ``/weights_checker`` (``utils/weight_checker.py``): ``snapshot`` copies the model's
        tensors, ``reset_tensors`` overwrites them with random values, ``compare`` checks the model against the
        snapshot (400 naming every tensor that differs), ``checksum`` reports every TP rank's checksum of every
        tensor SGLang would hold (:func:`sglang_held_tensors`), in the reply real SGLang 0.5.23 sends (recorded from
        a real server: ``ranks`` of ``{checksums, per_gpu_checksum, parallelism_info: [...]}``,
        ``per_engine_checksum``)."""
        action = body.get("action", "checksum")
        self.weights_checker_actions.append(action)
        with self._model_update():
            params = list(self.engine.model.named_parameters())
            if action == "checksum":
                return 200, self._checksum_reply(dict(params))
            if action == "snapshot":
                self._weights_snapshot = [(n, p.detach().clone()) for n, p in params]
            elif action == "reset_tensors":
                gen = torch.Generator().manual_seed(len(self.rids_served))
                for _, p in params:
                    p.data.copy_(torch.rand(p.shape, generator=gen).to(p.dtype))
            elif action == "compare":
                if self._weights_snapshot is None:
                    return 400, {"success": False, "message": "AssertionError: "}
                bad = [f"name={n} max_abs_err={(p.detach().float() - want.float()).abs().max().item()}"
                       for (n, p), (_, want) in zip(params, self._weights_snapshot) if not torch.equal(p, want)]
                self._weights_snapshot = None
                if bad:
                    return 400, {"success": False, "message": "check tensor equality failed:\n" + "\n".join(bad)}
            else:
                return 400, {"success": False, "message": f"Unsupported action={action!r}"}
        return 200, {"success": True, "message": "Success."}

    def _checksum_reply(self, params: dict) -> dict:
        config = self.engine.model.config
        ranks = []
        for rank in range(self.tp_size):
            held = sglang_held_tensors(params, config, self.tp_size, rank)
            checksums = {name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).digest()[:8].hex()
                         for name, t in held.items()}
            overall = hashlib.sha256()
            for name in sorted(checksums):
                overall.update(name.encode())
                overall.update(checksums[name].encode())
            ranks.append({"checksums": checksums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [
                {"role": "target", "tp_rank": rank, "tp_size": self.tp_size, "dp_rank": 0, "dp_size": 1,
                 "pp_rank": 0, "pp_size": 1, "rank": rank, "size": self.tp_size}]})
        engine = hashlib.sha256()
        for r in ranks:
            engine.update(r["per_gpu_checksum"].encode())
        return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": engine.hexdigest()}

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        # SGLang's is_fully_idle(ignore_waiting=paused): a retract pause puts the running rows back among the
        # waiting ones, which a paused scheduler ignores, so the flush goes through
        if self.pending_count() and self.engine.paused != "retract":
            return 400, "Flush cache failed."
        return 200, ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                     "waiting requests, the operation will not be performed.)\n")


def formula_weights(shapes: dict) -> dict:
    """Weights every machine builds alike (integers over 4096: exact in float32), for ``shapes`` (name -> shape):
    the weights real SGLang's recorded ``/weights_checker`` checksum reply was taken on
    (``tests/rollout/fixtures/sglang_0.5.23_weights_checksum.json``)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        n = math.prod(shape)
        out[name] = (((torch.arange(n) * 7919 + i * 104729) % 2001 - 1000).float() / 4096).reshape(shape)
    return out


def sglang_held_tensors(params: dict, config: Any, tp_size: int, rank: int) -> dict:
    """What SGLang 0.5.23 holds on TP rank ``rank`` of a Qwen2-family model whose HF tensors are ``params``, in its
    parameter order (read from its ``qwen2.py``, ``linear.py``, ``vocab_parallel_embedding.py``; checked against a
    real server's checksums by ``scripts/test_sglang_real.sh``): q/k/v fused as ``qkv_proj`` and gate/up as
    ``gate_up_proj`` (each part cut by heads / rows per rank), ``o_proj`` / ``down_proj`` cut along dim 1, the
    embedding and LM head padded with zero rows to a multiple of 64 and cut by rows, the rest whole; a tied
    ``lm_head`` is the embedding (held once). Written apart from the trainer's ``plan.sglang_weights`` on
    purpose: a double that reused it would agree with any mistake there."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def heads_of(w: torch.Tensor, n: int, which: int, count: int) -> torch.Tensor:
        return w.reshape(n, head_dim, *w.shape[1:])[which * count:(which + 1) * count].reshape(-1, *w.shape[1:])

    def kv_part(w: torch.Tensor) -> torch.Tensor:
        if tp_size >= kv:
            return heads_of(w, kv, rank // (tp_size // kv), 1)
        return heads_of(w, kv, rank, kv // tp_size)

    def vocab_part(w: torch.Tensor) -> torch.Tensor:
        pad_to = 64 if (-(-w.shape[0] // 64) * 64) % tp_size == 0 else 64 * tp_size
        padded = torch.zeros(-(-w.shape[0] // pad_to) * pad_to, *w.shape[1:], dtype=w.dtype)
        padded[:w.shape[0]] = w
        return padded.chunk(tp_size, 0)[rank]

    held: dict = {}
    for name, p in params.items():
        w = p.detach()
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        if ".self_attn.q_proj." in name:
            prefix, leaf = name.split(".self_attn.q_proj.")
            k, v = (params[f"{prefix}.self_attn.{x}_proj.{leaf}"].detach() for x in "kv")
            held[f"{prefix}.self_attn.qkv_proj.{leaf}"] = torch.cat(
                [heads_of(w, heads, rank, heads // tp_size), kv_part(k), kv_part(v)])
        elif ".mlp.gate_proj." in name:
            prefix, leaf = name.split(".mlp.gate_proj.")
            up = params[f"{prefix}.mlp.up_proj.{leaf}"].detach()
            held[f"{prefix}.mlp.gate_up_proj.{leaf}"] = torch.cat([w.chunk(tp_size, 0)[rank], up.chunk(tp_size, 0)[rank]])
        elif any(f".{x}_proj." in name for x in ("k", "v", "up")) and (".self_attn." in name or ".mlp." in name):
            continue  # held inside the fused tensor above
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            held[name] = w.chunk(tp_size, 1)[rank]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            held[name] = vocab_part(w)
        else:
            held[name] = w
    return held


class _SafeUnpickler(pickle.Unpickler):
    """SGLang 0.5.23's ``SafeUnpickler`` rule (``srt/utils/common.py``) for what a tensor payload uses:
    plain containers, ``types.SimpleNamespace``, torch's tensor/storage rebuild functions and dtypes,
    SGLang's own bucket records; every other global is refused with SGLang's words."""

    ALLOWED = {("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset",
                                         "int", "list", "range", "set", "slice", "str", "tuple")} | {
        ("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
        ("types", "SimpleNamespace"), ("_codecs", "encode"),
        ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
        ("torch.nn.parameter", "Parameter"), ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        *(("torch.multiprocessing.reductions", n) for n in (
            "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_meta_tensor", "rebuild_storage_fd",
            "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
            "rebuild_typed_storage_child")),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def _deserialize(entry: Any) -> Any:
    """``MultiprocessingSerializer.deserialize``: base64 (validated) of ForkingPickler bytes, allowlisted."""
    if not isinstance(entry, str):
        raise TypeError(f"a serialized_named_tensors entry must be a base64 string over HTTP, got "
                        f"{type(entry).__name__}")
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the entry is not base64: {exc}") from None
    return _SafeUnpickler(io.BytesIO(raw)).load()


def _reconstruct_flattened(payload: Any) -> list:
    """``FlattenedTensorBucket(flattened_tensor, metadata).reconstruct_tensors()``, records read by attribute."""
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        out.append((str(meta.name), flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


# /model_info's "embedding" block (0.5.23's resolved_embedding_plan) for a generation model, embedding off: the
# values SGLang's own function gives for the tiny Qwen2 of the real-SGLang checks, except "bcg", whose launch-time
# values (a str, an int, ints) are stood in for; no client reads any of it.
_EMBEDDING_PLAN = {
    "family": "none", "task": "none", "execution": "none", "attention": "none", "pooling": "model_defined",
    "normalize": False, "postprocessor": "none", "tokenizer_special_tokens": "model_default",
    "supports_dimensions": False, "supports_token_embeddings": False, "supports_multimodal": False,
    "requires_embedding_flag": False, "auto_enable_embedding": False, "bcg_eligibility": "disabled",
    "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
    "enabled": False, "matryoshka_dimensions": [],
    "bcg": {"prefill_backend": "torch_native", "enabled": False, "capture_token_budget": 0, "capture_batch_sizes": [1]},
    "cache": {"kv_cache_disabled": False, "radix_cache_disabled": True, "chunked_prefill_disabled": False}}


def _is_base64(entry: Any) -> bool:
    if not isinstance(entry, str):
        return False
    try:
        base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _verify_sampling(sp: dict) -> Optional[str]:
    """SGLang 0.5.23's ``SamplingParams.verify`` for the keys a client sends, in its words (the
    tokenizer manager raises it as a ValueError: 400 ``{"error": {"message"}}``); None when valid.
    As there, a temperature below 1e-6 is greedy: top_k becomes 1 before the check."""
    temperature = float(sp.get("temperature", 1.0) if sp.get("temperature") is not None else 1.0)
    top_p = float(sp.get("top_p", 1.0) if sp.get("top_p") is not None else 1.0)
    top_k = int(sp.get("top_k", -1) if sp.get("top_k") is not None else -1)
    max_new_tokens = sp.get("max_new_tokens", 128)
    if 0 <= temperature < 1e-6:
        top_k = 1
    elif top_k == -1:
        top_k = 1 << 30
    if not math.isfinite(temperature) or temperature < 0.0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    if not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if top_k < 1:
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if max_new_tokens is not None and int(max_new_tokens) < 0:
        return f"max_new_tokens must be at least 0, got {int(max_new_tokens)}."
    return None


def _validation_error(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def _row(text, output_ids, logprobs, finish, rid, prompt_tokens, weight_version, tic, spans=()) -> dict:
    """One reply row, keys in real SGLang 0.5.23's order; ``spans``: ``(version, start, end)`` of each run of
    output tokens one weight version generated (none: all of them ``weight_version``'s)."""
    n = len(output_ids)
    versions = [{"version": v, "start": a, "end": b} for v, a, b in spans] or [
        {"version": weight_version, "start": 0, "end": n}]
    return {"text": text, "output_ids": list(output_ids), "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens, "weight_version": weight_version,
        "num_retractions": 0, "input_token_logprobs": [],
        "output_token_logprobs": [[float(lp), int(t), None] for lp, t in zip(logprobs, output_ids)],
        "output_token_logprobs_length": n, "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0,
        "weight_versions": versions, "cached_tokens_details": None,
        "dp_rank": None, "e2e_latency": time.time() - tic, "response_sent_to_client_ts": time.time()}}


class _Handler(JsonHandler):
    standin: SGLangStandIn

    def setup(self) -> None:
        super().setup()
        with self.standin._state_lock:
            self.standin._conns.add(self.connection)

    def finish(self) -> None:
        with self.standin._state_lock:
            self.standin._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        standin = self.standin
        path = urlsplit(self.path).path
        raw = self.read_body()
        if not standin.alive:
            self.close_connection = True
            return
        standin.requests[path] += 1
        faults = standin.faults
        if faults.die_on == path:
            faults.die_on = None
            threading.Thread(target=standin.stop, daemon=True).start()
            self.close_connection = True
            time.sleep(0.2)  # the server goes down with this request unanswered
            return
        if faults.drop[path] > 0:
            faults.drop[path] -= 1
            self.close_connection = True
            return
        if faults.delay_s.get(path):
            time.sleep(float(faults.delay_s[path]))
        body, bad = self.parse_json(raw)
        status, reply = (400, _validation_error(bad)) if bad else standin.handle(method, path, body)
        if reply is _DIE:
            threading.Thread(target=standin.stop, daemon=True).start()
            self.close_connection = True
            return
        self.send_reply(status, reply)


def main(argv=None) -> int:
    """Serve a stand-in in its own process (tests that need a server in another process, as SGLang is):
    prints ``URL <url>`` once listening, serves until killed."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description="SGLang protocol stand-in (CPU test stand-in)")
    ap.add_argument("--model", required=True, help="HF checkpoint dir of a tiny model")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--group-timeout-s", type=float, default=60.0)
    ap.add_argument("--tp-size", type=int, default=1, help="TP ranks to play on the tensor route")
    ap.add_argument("--version", default="0.5.23", help="the SGLang version /server_info reports")
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    ap.add_argument("--max-lora-rank", type=int, default=64)
    args = ap.parse_args(argv)
    server = SGLangStandIn(args.model, port=args.port, group_timeout_s=args.group_timeout_s,
                           tp_size=args.tp_size, version=args.version, enable_lora=args.enable_lora,
                           max_lora_rank=args.max_lora_rank).start()
    print(f"URL {server.url}", flush=True)
    try:
        while server.alive:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
