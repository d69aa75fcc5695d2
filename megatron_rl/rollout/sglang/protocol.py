"""SGLang's HTTP wire format, in one place: request builders and reply parsers.

Taken from SGLang 0.5.2x: ``python/sglang/srt/entrypoints/http_server.py``
(paths, status codes, reply bodies), ``python/sglang/srt/managers/io_struct.py``
(``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``, ...) and
``python/sglang/srt/sampling/sampling_params.py`` (``sampling_params`` keys,
``sampling_seed``). Facts the parsers rely on:

* ``POST /generate`` with a list of ``input_ids`` answers a list of
  ``{"text", "output_ids", "meta_info"}``, one per input, in order;
  ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, text|None], ...]``
  (one per output token, a matched stop token included), ``meta_info.finish_reason``
  is ``{"type": "stop", "matched": ...}`` / ``{"type": "length", "length": n}`` /
  ``{"type": "abort", "message": ...}``, ``meta_info.weight_version`` a string
  ("default" until the first versioned update). That field is the server's version *when
  the reply was built*, not necessarily the one that generated the tokens: since 0.5.2x
  ``meta_info.weight_versions`` lists ``{"version", "start", "end"}`` spans over the output
  tokens (several when an update landed mid-row, e.g. after an in-place pause), and is what
  the parser uses when present (checked against real SGLang 0.5.23, docs/sglang.md). The spans
  are half-open and in order; together they cover the output tokens exactly, and a reply whose
  spans do not is out of protocol (per-token versions read from it would be wrong).
* With ``return_routed_experts`` in the request (a server started with
  ``--enable-return-routed-experts``), ``meta_info.routed_experts`` is base64 of int32
  ``[tokens, num_hidden_layers, topk]``: each input token's top-k experts per layer (dense layers'
  rows unused), for the first ``prompt + output - 1`` tokens (``rollout.routes``).
* Errors: weight endpoints answer ``{"success": false, "message"}`` with 400;
  most others ``{"error": {"message"}}`` with 400; request validation
  ``{"object": "error", "message", "type", "param", "code"}``; an unknown path
  FastAPI's ``{"detail": "Not Found"}`` with 404; ``/flush_cache`` plain text.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional, overload

from megatron_rl.data.types import SamplingParams
from megatron_rl.errors import ConfigError, EngineError

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PAUSE_MODES = ("abort", "retract", "in_place")
FINISH_TYPES = ("stop", "length", "abort")
DEFAULT_WEIGHT_VERSION = "default"  # what SGLang reports before any versioned update


@overload
def check_tags(tags: None) -> None: ...
@overload
def check_tags(tags: Iterable[str]) -> list[str]: ...


def check_tags(tags: Optional[Iterable[str]]) -> Optional[list[str]]:
    """Validate memory tags; None means every tag (SGLang's default)."""
    if tags is None:
        return None
    tags = [str(t) for t in tags]
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ConfigError(f"SGLang memory tag(s) {bad} unknown; use a subset of {list(MEMORY_TAGS)}")
    return tags


def row_seed(seed: int, request_index: int, sample_index: int) -> int:
    """Per-row sampling seed (the embedded engine's formula): rows do not depend on routing or batching."""
    digest = hashlib.blake2b(f"{seed}:{request_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sampling_params_dict(sampling: SamplingParams, *, seed: Optional[int] = None,
                         max_new_tokens: Optional[int] = None) -> dict[str, Any]:
    """Our ``SamplingParams`` as SGLang ``sampling_params`` for one row (``n`` is always 1: rows are sent apart);
    ``max_new_tokens``: the row's own budget (``GenerateRequest.budget``), else the call's."""
    params: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_new_tokens": int(sampling.max_new_tokens if max_new_tokens is None else max_new_tokens),
        "ignore_eos": bool(sampling.ignore_eos),
        "skip_special_tokens": True,
        "n": 1,
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = int(seed)
    return params


def generate_payload(input_ids: list[list[int]], sampling_params: list[dict], *, rids: Optional[list[str]] = None,
                     return_logprob: bool = True, return_routed_experts: bool = False,
                     lora_path: Optional[str] = None,
                     image_data: Optional[list[list[str]]] = None) -> dict[str, Any]:
    """A batch ``GenerateReqInput``: one entry per row, per-row sampling params and request ids;
    ``lora_path`` (a loaded adapter's ``lora_name``; SGLang repeats a string for every row) when given;
    ``image_data``: each row's images (``data:`` URLs, ``VisionInputs.data_urls``; ``[]`` for a row without),
    sent when any row has one.

    Why ``[]`` and not None for a row without images: SGLang 0.5.23's ``GenerateReqInput._normalize_image_data``
    reads a batch's ``image_data`` as one list per row only when its first entry is a list (else as one image per
    row, each wrapped in a list), and counts an empty list as no images."""
    if len(sampling_params) != len(input_ids) or (rids is not None and len(rids) != len(input_ids)) or (
            image_data is not None and len(image_data) != len(input_ids)):
        raise ValueError("generate_payload: input_ids, sampling_params, rids and image_data must have one entry per "
                         "row")
    payload: dict[str, Any] = {"input_ids": [list(map(int, ids)) for ids in input_ids],
                               "sampling_params": list(sampling_params),
                               "return_logprob": bool(return_logprob), "stream": False}
    if rids is not None:
        payload["rid"] = list(rids)
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if lora_path is not None:
        payload["lora_path"] = str(lora_path)
    if image_data is not None and any(image_data):
        payload["image_data"] = [list(images) for images in image_data]
    return payload


def single_generate_payload(input_ids: list[int], sampling_params: dict, *, rid: str,
                            return_logprob: bool = True, return_routed_experts: bool = False,
                            lora_path: Optional[str] = None,
                            image_data: Optional[list[str]] = None) -> dict[str, Any]:
    """One row's ``GenerateReqInput`` (not a batch). What goes through an sglang-router: its typed
    request schema takes ``sampling_params`` as one map, so per-row params (each row's
    ``sampling_seed``) need one request per row; the router passes ``sampling_seed`` and ``rid``
    through (checked against sglang-router 0.3.2)."""
    payload = {"input_ids": list(map(int, input_ids)), "sampling_params": dict(sampling_params),
               "return_logprob": bool(return_logprob), "stream": False, "rid": str(rid)}
    if return_routed_experts:
        payload["return_routed_experts"] = True
    if lora_path is not None:
        payload["lora_path"] = str(lora_path)
    if image_data:
        payload["image_data"] = list(image_data)  # one request: its images
    return payload


def parse_router_workers(body: Any) -> Optional[list[str]]:
    """Worker URLs of an sglang-router's ``GET /workers`` answer
    (``{"workers": [{"url": ..., "is_healthy": ...}, ...], "total": N}``), or None when ``body``
    is not one (a plain SGLang server has no ``/workers``)."""
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        return None
    urls = [w.get("url") for w in body["workers"] if isinstance(w, dict)]
    return [str(u) for u in urls if u]


def serialize_named_tensors(named_tensors: Iterable[tuple[str, Any]], *, as_dict: bool = False) -> tuple[str, list]:
    """One ``serialized_named_tensors`` entry for ``/update_weights_from_tensor``, and the buffers it points at;
    ``as_dict``: a ``{name: tensor}`` dict instead of the pairs, what ``/load_lora_adapter_from_tensors`` opens
    (0.5.23's ``tp_worker.load_lora_adapter_from_tensors`` calls ``.items()`` on it).

    SGLang's wire format (``MultiprocessingSerializer.serialize(..., output_str=True)``): a list of
    ``(name, tensor)`` pickled with ``multiprocessing.reduction.ForkingPickler`` (torch's reducers
    put each storage in shared memory and send a handle, not the bytes), base64-encoded.

    Why the sharing strategy is switched to ``file_system`` here: with torch's default
    ``file_descriptor`` strategy a CPU storage travels as a file descriptor that the receiver
    fetches from the sender's ``multiprocessing`` resource sharer, authenticated with the
    sender's process-tree key; an SGLang server started separately has another key, answers
    "digest sent was rejected" and its scheduler dies (measured on SGLang 0.5.23, CPU). With
    ``file_system`` the handle is a shared-memory file name any local process can open. The
    setting is process-wide and only affects tensors shared after it, which in this process
    are only these. GPU tensors travel as CUDA IPC handles either way.

    Each tensor is copied into a fresh buffer first: sharing moves a storage into shared memory
    in place, which must not happen to the trainer's own parameters. The caller must keep the
    returned buffers alive until the server has answered (a buffer freed or reused before the
    engine copied it corrupts the weights: docs/peer-failures.md).
    """
    import torch  # heavy: only the tensor route needs it
    import torch.multiprocessing as torch_mp  # registers torch's ForkingPickler reducers
    from multiprocessing.reduction import ForkingPickler

    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")
    pairs = []
    for name, tensor in named_tensors:
        t = torch.as_tensor(tensor).detach()
        pairs.append((str(name), t.clone() if t.is_cuda else t.to("cpu", copy=True).contiguous()))
    if not pairs:
        raise ValueError("serialize_named_tensors: no tensors to send")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(dict(pairs) if as_dict else pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii"), [t for _, t in pairs]


def error_message(status: int, content: bytes) -> str:
    """The server's own words from an error reply, whichever of SGLang's error shapes it has."""
    text = content.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or f"(empty body, HTTP {status})"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail", "error_message"):  # error_message: the LoRA endpoints' LoRAUpdateOutput
            if key in body:
                return str(body[key])
    return text[:500]


def parse_weight_version(value: Any, *, where: str) -> int:
    """SGLang's string weight version as our integer one ("default" = 0, the weights loaded at start)."""
    if value is None or str(value) == DEFAULT_WEIGHT_VERSION:
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineError(f"{where} reports weight_version {value!r}, not an integer; another trainer or a person "
                          "set it with /update_weight_version: restart the server or push an integer version") \
            from None


@dataclass(frozen=True)
class GenerateOutput:
    """One parsed ``/generate`` row.

    ``weight_version`` is the version of the row's first output token (the oldest policy that
    generated any of it); ``weight_version_spans`` lists ``(version, start, end)`` over the output
    tokens, more than one when an update landed while the row was generating.
    """

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    text: Optional[str]
    finish_message: Optional[str] = None
    weight_version_spans: tuple[tuple[int, int, int], ...] = ()
    routed_experts: Optional[str] = None  # meta_info.routed_experts as sent (base64), when asked for
    prompt_tokens: Optional[int] = None  # meta_info.prompt_tokens: the prompt as the server ran it (images expanded)

    def token_versions(self) -> list[int]:
        """``Sample.token_versions``: each output token's version when they differ, else ``[]``.

        Empty when every token has one version (the usual row), so such a sample stays exactly
        what it was before per-token versions existed and costs nothing to move.
        """
        versions = [v for v, start, end in self.weight_version_spans for _ in range(start, end)]
        return versions if len(set(versions)) > 1 else []


def parse_weight_version_spans(meta: dict, *, where: str, num_tokens: int) -> tuple[tuple[int, int, int], ...]:
    """``meta_info.weight_versions`` as ``((version, start, end), ...)``; () when the server sends none.

    The spans must cover the row's ``num_tokens`` output tokens exactly, in order (each starts where
    the previous ended, the first at 0, the last ends at ``num_tokens``): the per-token versions the
    trainer measures staleness with are read off them, so a gap, an overlap or a short cover is an
    ``EngineError`` like a malformed span, not a guess.
    """
    spans = meta.get("weight_versions")
    if not spans:
        return ()
    out = []
    for span in spans:
        if isinstance(span, dict):
            raw: tuple = (span.get("version"), span.get("start"), span.get("end"))
        else:
            raw = tuple(span) if isinstance(span, (list, tuple)) and len(span) == 3 else (None, None, None)
        try:
            start, end = int(raw[1]), int(raw[2])  # a missing or non-numeric bound raises
        except (TypeError, ValueError):
            raise EngineError(f"{where} /generate row has a weight_versions entry {span!r}; expected "
                              "{version, start, end}") from None
        out.append((parse_weight_version(raw[0], where=where), start, end))
    covered: Optional[int] = 0  # where the next span must start; None once one did not
    for _, start, end in out:
        covered = end if covered == start <= end else None
    if covered != num_tokens:
        raise EngineError(f"{where} /generate row has weight_versions spans {spans!r} that do not cover its "
                          f"{num_tokens} output token(s) exactly (in order, each starting where the previous "
                          "ended); out of protocol")
    return tuple(out)


def first_token_version(spans: tuple[tuple[int, int, int], ...]) -> int:
    """The version of the first output token: the first span holding a token (the first span when none does)."""
    return next((v for v, start, end in spans if end > start), spans[0][0])


def parse_generate_output(entry: Any, *, where: str) -> GenerateOutput:
    """Check one ``/generate`` row against the protocol and extract what a ``Sample`` needs."""
    if not isinstance(entry, dict) or "meta_info" not in entry:
        raise EngineError(f"{where} answered /generate with a row that has no meta_info: {str(entry)[:200]}")
    meta = entry["meta_info"]
    output_ids = entry.get("output_ids")
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs is None:
        raise EngineError(f"{where} /generate row carries no meta_info.output_token_logprobs; the request asked "
                          "return_logprob=True (is this an SGLang server?)")
    logprob_ids = [int(t[1]) for t in token_logprobs]
    if output_ids is None:
        output_ids = logprob_ids
    output_ids = [int(t) for t in output_ids]
    if output_ids != logprob_ids:
        raise EngineError(f"{where} /generate row: output_ids ({len(output_ids)} tokens) and "
                          f"output_token_logprobs ({len(logprob_ids)} tokens) disagree; out of protocol")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH_TYPES:
        raise EngineError(f"{where} /generate row has finish_reason {finish!r}; expected a type in {FINISH_TYPES}")
    message = finish.get("message") if isinstance(finish, dict) else None
    spans = parse_weight_version_spans(meta, where=where, num_tokens=len(output_ids))
    version = first_token_version(spans) if spans else parse_weight_version(meta.get("weight_version"), where=where)
    routes = meta.get("routed_experts")
    if routes is not None and not isinstance(routes, str):
        raise EngineError(f"{where} /generate row has meta_info.routed_experts of type {type(routes).__name__}; "
                          "SGLang sends a base64 string")
    return GenerateOutput(output_ids=output_ids, logprobs=[float(t[0]) for t in token_logprobs], finish_reason=kind,
                          weight_version=version, text=entry.get("text"), finish_message=message,
                          weight_version_spans=spans, routed_experts=routes,
                          prompt_tokens=int(meta["prompt_tokens"]) if meta.get("prompt_tokens") is not None else None)
