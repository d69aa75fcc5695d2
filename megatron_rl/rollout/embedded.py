"""The embedded rollout engine: in-process torch generation over an HF model.

Needs no server and runs on CPU, so tests, the CPU demo and training-on-one-box
use it; it is also the numerical reference the SGLang engine is checked against.

How a ``generate`` call runs (per chunk of at most ``max_batch_size`` rows, a
row being one (request, sample) pair):

1. prefill each distinct prompt of the chunk once, left-padded, with an
   attention mask and position ids ``cumsum(mask) - 1`` so padding changes
   nothing; only the last position's logits are computed;
2. copy the KV cache rows so each of the ``n`` samples of a prompt gets its own;
3. decode one token per step for every unfinished row; a row that emits a stop
   token or reaches its length limit is finished; finished rows are dropped from
   the batch and its KV cache once a quarter of the batch has finished (each drop
   copies the cache, so not one copy per finished row).

Reproducibility: each row owns a ``torch.Generator`` seeded from
``(seed, request index, sample index)`` that supplies one uniform number per
step, so a row's tokens do not depend on which other rows share its batch or on
``max_batch_size``, and a shorter ``max_new_tokens`` yields a prefix of the
longer response.

Memory: the engine keeps no KV cache between calls. A chunk holds as many rows as fit
``CHUNK_BUDGET_BYTES`` of KV cache and sampling buffers (from the model's shape and the
chunk's longest sequence), or ``max_batch_size`` if given: one chunk for a whole
rollout of a small model, so every decode step is one batched forward instead of
one per 64 rows (those calls, not the arithmetic, were most of the CPU demo's
generation time). ``release()`` drops the
parameter storage; with ``weight_backup=True`` it is kept on the CPU and
``resume()`` restores it (on a CPU engine that backup *is* the storage, so only
the bookkeeping changes); without a backup ``resume()`` allocates uninitialised
storage and ``generate`` refuses until an ``update_weights`` covering every
tensor arrives, which is what a colocated trainer sends next anyway. An engine that merges
LoRA adapters itself (``update_adapter``, ``--lora-sync adapter``) keeps its weights and the
adapted modules' base on the host across a release, so the next sync stays an adapter.

Partial rollouts across weight updates (asynchronous RL; SGLang's ``/pause_generation``,
``/continue_generation``): every model use is a *step*, the prefill and first token of a chunk,
or one decode forward and its sampled token; between steps the engine lock is free. Invariants:

* ``pause(mode)`` stops every ``generate`` in flight (and any that starts) at its next step
  boundary, never mid-forward; ``wait_paused(timeout)`` returns once they are parked there and
  raises ``EngineError`` naming what did not happen otherwise (never hangs). ``continue_()``
  lets them go on. Modes: ``in_place`` keeps the KV cache built by the old weights;
  ``retract`` recomputes the KV cache of prompt + tokens so far under the weights current at
  continue, so every later token's log-prob is the new policy's given its prefix (only when the
  version changed: the same weights would recompute the same cache up to float rounding, and a
  pause alone must not change a sample); ``abort`` ends the unfinished rows in flight with
  finish_reason "abort" (partial tokens kept, rows of chunks not started empty; the calls
  return) and parks calls that start later until ``continue_()``.
* A weight update (``update_weights``, ``update_weights_from_disk``, ``release``, ``resume``)
  takes the engine lock between steps (``exclusive()``): paused or not it never lands
  mid-forward. Not paused, it waits for the current step only, and a generate in flight goes on
  under the new weights with the KV cache it had (as ``in_place``); its tokens record that.
  ``release`` refuses while a generate is in flight (a parked row would continue on no weights).
* Every token records the version of the weights whose forward produced its logits. A sample's
  ``weight_version`` is its first token's; ``token_versions`` is filled only when a row holds
  more than one version, so a generate no update touched gives the samples it gave before pausing
  existed, and a pause + continue without an update is bitwise an unpaused generate (same
  forwards, same per-row uniforms).

Routes (MoE routing replay R3, ``record_routes=True``): each forward's expert choices are read off
the routers (``rollout.routes.RouteCapture``) and filed under the token that was the input there: a
row's prompt gets its prefill's, each fed token its decode step's; a retract's re-prefill replaces
every route of the row (the cache later tokens attend to is the re-prefill's). A sample's
``routed_experts`` covers its first ``total_length - 1`` tokens (the last one is never an input).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch

from megatron_rl.data.images import VisionInputs
from megatron_rl.data.types import Sample
from megatron_rl.errors import CheckpointError, ConfigError, EngineError, SyncError
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.hf_module import hf_config
from megatron_rl.models.mrope import check_image_tokens, mrope_position_ids
from megatron_rl.models.peft_adapter import AdapterExport, is_adapter_dir, merged_weight
from megatron_rl.ops.batch_invariant import batch_invariant_mode
from megatron_rl.rollout.base import EngineHealth, GenerateRequest, RolloutEngine, SamplingParams, checked_tokenizer, load_tokenizer
from megatron_rl.rollout.engine_rows import EngineRow, RowOutput
from megatron_rl.rollout.hf_layout import HFParamMap
from megatron_rl.rollout.lean_decode import lean_decoder
from megatron_rl.rollout.routes import RouteCapture, routed_experts
from megatron_rl.rollout.mtp_draft import DRAFT_MODULE, MtpDraft
from megatron_rl.rollout.sampling import sample_next_tokens
from megatron_rl.rollout.speculative import (SPEC_METADATA_KEY, SpeculativeConfig, generate_speculative_chunk,
                                              speculative_config)
from megatron_rl.rollout.weight_delta import DeltaBaseMismatch, TensorDelta, is_delta_dir, read_delta_dir, tensor_checksum
from megatron_rl.rollout.weight_dir import ADAPTER_BASE_DIR

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.plan.engines import EnginePlacement


def _safetensors_items(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors ``files``, one at a time."""
    from safetensors import safe_open

    for fname in files:
        with safe_open(fname, framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def row_seed(seed: int, request_index: int, sample_index: int) -> int:
    """The generator seed of one row: a hash, so nearby seeds give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{request_index}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


log = logging.getLogger("megatron_rl")

CHUNK_BUDGET_BYTES = 1 << 30  # KV cache + per-row logits/sampling buffers of one generate chunk
COMPACT_AT = 0.75  # finished rows leave the decode batch once at most this fraction is still generating
PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


class _GenerateCall:
    """One ``generate_part`` in flight, as ``pause`` / ``wait_paused`` see it (guarded by the engine's condition)."""

    __slots__ = ("parked", "aborted")

    def __init__(self) -> None:
        self.parked = False  # waiting at a step boundary because the engine is paused
        self.aborted = False  # a pause("abort") came while it was in flight: it returns at its next boundary




class _Slot:
    """A row of ``generate_continuous``'s batch: what it generated so far and its own uniforms."""

    __slots__ = ("row", "plen", "start", "limit", "tokens", "logprobs", "versions", "done", "reason", "routes",
                 "_uniforms")

    def __init__(self, row: EngineRow, limit: int, greedy: bool, start: int):
        self.row, self.plen = row, len(row.prompt_ids)
        self.start = start  # the position of its first response token (EmbeddedEngine.response_start)
        self.limit = limit
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.done, self.reason = False, "length"
        self.routes: list[torch.Tensor] = []  # [tokens, moe_layers, topk] pieces, with record_routes
        self._uniforms = None if greedy else \
            torch.rand(self.limit, generator=torch.Generator().manual_seed(row.seed), dtype=torch.float64)

    def uniform(self) -> float:
        """This row's uniform for its next token (by its own token index, as ``generate``'s rows)."""
        return 0.0 if self._uniforms is None else float(self._uniforms[len(self.tokens)])

    def end(self, reason: str) -> None:
        self.done, self.reason = True, reason

    def output(self, reason: str, experts: int = 0) -> RowOutput:
        routes = routed_experts(self.routes, self.plen + len(self.tokens), experts) if experts else None
        return RowOutput(list(self.tokens), list(self.logprobs), reason, list(self.versions), routes)


def _padding_columns(mask: torch.Tensor) -> int:
    """How many leftmost columns of a left-padded attention ``mask`` are padding in every row: positions no
    row attends to, which a continuous batch drops when it copies its cache (``kv_cache.compact_kv_cache``)."""
    return int(mask.shape[1] - mask.sum(dim=1).max()) if mask.shape[0] else 0


class EmbeddedEngine(RolloutEngine):
    """Generation with a KV cache over ``transformers.AutoModelForCausalLM`` (llama, qwen2, qwen3, qwen3_moe,
    mixtral, glm4_moe, deepseek_v3 / kimi_k2, gpt_oss, gemma3_text, qwen3_next, minimax_m2,
    gemma4_text, deepseek_v32: transformers' indexed cache, batched statically), or a vision-language checkpoint's
    ``AutoModelForImageTextToText`` (qwen2_5_vl, qwen3_vl).

    Images (a request's ``multimodal_inputs``): the prefill of a prompt gives the model its pixel patches and grids
    (one prefill per prompt, its cache copied to the group's samples, so the vision tower runs once per prompt) and
    the prompt's M-RoPE positions (``models.mrope.mrope_position_ids``, as the trainer packs them); every response
    token is text, at the position after the prompt's largest (``response_start``), as transformers' own
    ``rope_deltas`` place it.

    ``attn_implementation`` None lets transformers choose per model: SDPA where the model supports it,
    eager otherwise (gpt-oss, whose attention sinks SDPA cannot express). ``lean_decode`` (on by default): a dense
    llama / qwen2 / qwen3 model on the CPU decodes through ``rollout.lean_decode``, transformers' logits bit for bit
    without its module plumbing; False: always the model's forward."""

    def __init__(self, hf_checkpoint: str, *, tokenizer: Any = None, max_batch_size: Optional[int] = None,
                 weight_backup: bool = False, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 attn_implementation: Optional[str] = None, record_routes: bool = False,
                 batch_invariant: bool = False, lean_decode: bool = True,
                 speculative: Optional[SpeculativeConfig] = None):
        import transformers

        if not os.path.isfile(os.path.join(str(hf_checkpoint), "config.json")):
            raise ConfigError(f"--hf-checkpoint {hf_checkpoint}: no config.json there; point it at a directory "
                              "written by save_pretrained (config.json + *.safetensors)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"EmbeddedEngine max_batch_size={max_batch_size}: use a value >= 1 (or None: "
                              f"as many rows as fit {CHUNK_BUDGET_BYTES >> 20} MiB)")
        checkpoint = HFCheckpoint(hf_checkpoint)  # a truncated/missing shard named here, not by transformers
        config = hf_config(str(hf_checkpoint))
        vision = getattr(config, "vision_config", None)
        auto = transformers.AutoModelForImageTextToText if vision is not None else transformers.AutoModelForCausalLM
        # --true-on-policy-mode: a MoE model's experts in transformers' eager loop (each expert's rows through
        # F.linear, the outputs index_add_-ed expert by expert: the batch-invariant ops and the trainer's combine
        # order, backends/megatron/engine_moe.py), not its default grouped_mm kernel (torch._grouped_mm, a sum over
        # each token's top-k slots)
        experts = {"experts_implementation": "eager"} if batch_invariant else {}
        self.model = auto.from_pretrained(
            str(hf_checkpoint), config=config, dtype=dtype, attn_implementation=attn_implementation, **experts,
        ).to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
        self.text_config = self.model.config.get_text_config()  # a vision-language config's language model
        # (image-pad token id, spatial merge size) of a vision-language model; None: text only
        self.image_tokens: Optional[tuple[int, int]] = (
            (int(config.image_token_id), int(vision.spatial_merge_size)) if vision is not None else None)
        # a vision-language model never samples its vision tokens (sampling.py: the reported log-probs stay the full
        # distribution's): a response holding an image-pad token would have no image behind it, and the trainer
        # refuses such a sample
        self.banned_tokens: tuple[int, ...] = tuple(sorted({int(t) for t in (
            getattr(config, key, None) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id")) if t is not None})) if vision is not None else ()
        checkpoint.refuse_non_finite_parameters(self.model)  # inf/NaN: named here, not as NaN logits later
        self.model.requires_grad_(False)
        self.device = torch.device(device)
        # --true-on-policy-mode: every forward and sampling step under ops.batch_invariant, so a token's log-prob
        # is the one the trainer's forward computes under the same mode, whatever the batch (docs/on-policy.md)
        self.batch_invariant = batch_invariant
        self.max_batch_size = max_batch_size
        self.weight_backup = weight_backup
        if tokenizer is None:
            tokenizer = load_tokenizer(str(hf_checkpoint))
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = checked_tokenizer(transformers.AutoTokenizer.from_pretrained(str(tokenizer)), str(tokenizer))
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(
            _as_id_list(getattr(self.model.generation_config, "eos_token_id", None))
            + _as_id_list(getattr(self.model.config, "eos_token_id", None))
            + _as_id_list(getattr(tokenizer, "eos_token_id", None))))
        self.vocab_size = int(self.text_config.vocab_size)
        self.context_length = int(getattr(self.text_config, "max_position_embeddings", 1 << 30))
        self._warned_cap = False  # a response cut by the context length: warned once (_new_token_limit)
        self.hf_checkpoint = str(hf_checkpoint)
        # --speculative-algorithm: the checkpoint's MTP layers as the draft (rollout/mtp_draft.py), a submodule of the
        # model so release / resume / update_weights treat its weights as any other (names: the checkpoint's)
        self.speculative = speculative
        self.draft: Optional[MtpDraft] = None
        if speculative is not None:
            self._refuse_speculative(record_routes, batch_invariant)
            self.draft = MtpDraft(self.model).to(device=self.device, dtype=dtype).eval().requires_grad_(False)
            self.model.add_module(DRAFT_MODULE, self.draft)
        self.param_map = HFParamMap(self.model)
        if self.draft is not None:
            self.param_map.add_aliases(self.draft.shared_names())
            self._load_draft(checkpoint)
        # MoE routing replay from the rollout (R3): every forward's expert choices, filed per token
        self.route_capture: Optional[RouteCapture] = RouteCapture(self.model) if record_routes else None
        # a dense Llama-family model on the CPU decodes through rollout.lean_decode (transformers' own ops, its
        # logits bit for bit, without the module plumbing); None: through the model's forward
        self._lean_decode = lean_decoder(self.model, self.device) if lean_decode else None
        self._weight_version = 0
        self._released = False
        self._weights_loaded = True
        self._backup: dict[str, torch.Tensor] = {}
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        # --lora-sync adapter: the base weights of the adapted modules (HF weight name -> tensor), kept from the
        # first adapter update (which brings the base model); each adapter update merges into these
        self._adapter_base: dict[str, torch.Tensor] = {}
        self._adapter_saved: set[str] = set()  # the weights of --lora-modules-to-save each adapter update sets
        self._kept_on_release = weight_backup  # the last release kept the weights on the host
        # the engine lock: a logical flag under one condition, so waiting updates go first at a step boundary
        # (a plain Lock would let the generating thread take it back at once, step after step)
        self._cond = threading.Condition()
        self._model_busy = False  # a step or an exclusive() block is using the model
        self._model_owner: Optional[int] = None  # the thread of that exclusive() block (re-entrant)
        self._exclusive_waiting = 0
        self._pause_mode: Optional[str] = None
        self._calls: list[_GenerateCall] = []
        # Called by a generating thread at every step boundary with the number of tokens each live row of the
        # chunk has (0: before the prefill), outside the engine lock: tests pause at a known step with it.
        self.step_boundary_hook: Optional[Callable[[int], None]] = None

    def _refuse_speculative(self, record_routes: bool, batch_invariant: bool) -> None:
        conflicts = [(record_routes, "--use-rollout-routing-replay (a rejected draft's routes would be recorded)"),
                     (batch_invariant, "--true-on-policy-mode (a verify forward of several positions is not "
                                       "bitwise the one-token forward)"),
                     (self.image_tokens is not None, "a vision-language checkpoint")]
        for bad, what in conflicts:
            if bad:
                raise ConfigError(f"--speculative-algorithm {self.speculative.algorithm if self.speculative else ''} "
                                  f"with {what}: not supported by the embedded engine; drop one of them")

    def _load_draft(self, checkpoint: HFCheckpoint) -> None:
        """The draft's weights from the checkpoint's MTP tensors; its copies of the embedding and head must equal
        the main model's (they alias them here, as the trainer's bridge shares them)."""
        assert self.draft is not None
        prefixes = tuple(f"model.layers.{key}." for key in self.draft.model.layers)
        shared = self.draft.shared_names()
        wanted = {n for n in self.param_map.names() if n.startswith(prefixes)}
        loaded: set[str] = set()
        with torch.no_grad():
            for name in sorted(n for n in checkpoint.names() if n.startswith(prefixes)):
                tensor = checkpoint.read(name)
                if name in shared:
                    main = self.param_map.view(shared[name])
                    if not torch.equal(tensor.to(main.dtype).to(main.device), main):
                        raise CheckpointError(f"{name} in {self.hf_checkpoint} differs from {shared[name]}: the "
                                              "draft shares the main model's embedding and head; a checkpoint whose "
                                              "MTP copies differ cannot serve --speculative-algorithm")
                    continue
                if name not in self.param_map:
                    raise CheckpointError(f"{name} in {self.hf_checkpoint}: not a tensor of the MTP draft built from "
                                          "config.json; the checkpoint's MTP layers do not match its config")
                self.param_map.view(name).copy_(tensor)
                loaded.add(name)
        if wanted - loaded:
            raise CheckpointError(f"{self.hf_checkpoint} lacks {len(wanted - loaded)} MTP tensor(s) of the draft "
                                  f"(first: {sorted(wanted - loaded)[0]}); --speculative-algorithm needs the "
                                  "checkpoint's MTP layers (num_nextn_predict_layers)")

    @classmethod
    def from_config(cls, cfg: "Config", placement: "Optional[EnginePlacement]" = None) -> "EmbeddedEngine":
        """The loop's engine: ``--hf-checkpoint`` (weights, and the tokenizer found beside them). It runs in
        this process, so there is no ``placement`` to take (the launcher makes none for it)."""
        if cfg.model.hf_checkpoint is None:
            raise ConfigError("--rollout-backend embedded loads the policy from --hf-checkpoint: give "
                              "--hf-checkpoint DIR (an HF model directory)")
        return cls(cfg.model.hf_checkpoint, record_routes=cfg.megatron.use_rollout_routing_replay,
                   batch_invariant=cfg.algorithm.true_on_policy_mode, speculative=speculative_config(cfg.rollout))

    # ------------------------------------------------------------------ state
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def health(self) -> EngineHealth:
        if self._released:
            detail = "released: call resume()"
        elif not self._weights_loaded:
            detail = "weights incomplete: send an update_weights covering every tensor"
        else:
            detail = "ready"
        return EngineHealth(ok=not self._released and self._weights_loaded, weight_version=self._weight_version,
                            released=self._released, weights_loaded=self._weights_loaded, detail=detail)

    def _check_ready(self, action: str) -> None:
        health = self.health()
        if not health.ok:
            raise EngineError(f"embedded engine cannot {action}: {health.detail}")

    def release(self) -> None:
        with self.exclusive():
            if self._released:
                return
            with self._cond:
                in_flight, parked = len(self._calls), sum(c.parked for c in self._calls)
            if in_flight:
                raise EngineError(f"embedded engine cannot release: {in_flight} generate call(s) in flight ({parked} "
                                  "parked at a pause) would continue on no weights; continue_() and let them finish, "
                                  "or pause('abort') so they return, then release")
            self._release()

    def _release(self) -> None:
        # --lora-sync adapter: the weights go to the host like a weight backup, so the next sync can stay an
        # adapter (the frozen base would otherwise have to come again from the trainer every step)
        self._kept_on_release = self.weight_backup or bool(self._adapter_base)
        for name, param in self.model.named_parameters():
            self._shapes[name] = (param.shape, param.dtype)
            if self._kept_on_release:
                self._backup[name] = param.data.to("cpu")
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._adapter_base = {name: t.to("cpu") for name, t in self._adapter_base.items()}
        self._released = True

    def resume(self) -> None:
        with self.exclusive():
            self._resume()

    def _resume(self) -> None:
        if not self._released:
            return
        for name, param in self.model.named_parameters():
            shape, dtype = self._shapes[name]
            if self._kept_on_release:
                param.data = self._backup.pop(name).to(self.device)
            else:
                param.data = torch.empty(shape, dtype=dtype, device=self.device)
        self._adapter_base = {name: t.to(self.device) for name, t in self._adapter_base.items()}
        self._released = False
        self._weights_loaded = self._kept_on_release

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Read-only views of the live weights by HF checkpoint name (no copies)."""
        if self._released:
            raise EngineError("embedded engine cannot list weights: released: call resume()")
        return self.param_map.items()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy each tensor into the live weights, then adopt ``version`` (see the invariants in ``base``).

        The whole stream is consumed even after a bad entry, so one error lists
        every unknown name and shape mismatch. Tensors may have another dtype
        (e.g. bf16 from the trainer); they are cast to the engine's dtype. When
        the engine's weights are incomplete (after a failed update, or
        ``resume()`` without backup) the update must cover every tensor.
        """
        with self.exclusive():
            self._update_weights(named_tensors, version)

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self._released:
            raise EngineError("embedded engine cannot update weights: released: call resume() first")
        if version < self._weight_version:
            raise SyncError(f"update_weights(version={version}) is older than the engine's weight_version "
                            f"{self._weight_version}; versions only move forward (check the trainer's step counter)")
        unknown: list[str] = []
        mismatched: list[str] = []
        applied: set[str] = set()
        try:
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name not in self.param_map:
                        unknown.append(name)
                        continue
                    dst = self.param_map.view(name)
                    if tuple(tensor.shape) != tuple(dst.shape):
                        mismatched.append(f"{name} (sent {tuple(tensor.shape)}, engine has {tuple(dst.shape)})")
                        continue
                    dst.copy_(tensor)
                    applied.add(self.param_map.canonical(name))
        except BaseException:
            self._weights_loaded = False
            raise
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown name(s): {', '.join(unknown[:10])}")
        if mismatched:
            problems.append(f"{len(mismatched)} shape mismatch(es): {', '.join(mismatched[:10])}")
        if not problems and not self._weights_loaded:
            missing = [n for n in self.param_map.names() if n not in applied]
            if missing:
                problems.append(f"the engine's weights are incomplete and this update lacks {len(missing)} "
                                f"tensor(s): {', '.join(missing[:10])}")
        if problems:
            self._weights_loaded = False
            raise SyncError(f"weight update to version {version} failed; engine stays at version "
                            f"{self._weight_version} and refuses to generate until a complete update: "
                            + "; ".join(problems)
                            + ". Send HF checkpoint names and shapes (as in model.safetensors) for this model.")
        self._weights_loaded = True
        self._weight_version = version

    def update_weights_delta(self, deltas: Iterable[TensorDelta], base_version: int, version: int) -> None:
        """Patch the live weights with each delta (``TensorDelta.apply_to``: in place), then adopt ``version``.

        Refused with ``DeltaBaseMismatch`` before any change when the engine does not hold complete weights of
        ``base_version``. Each patched tensor's checksum is compared with the one the delta carries (a patch
        applied to other bits than its base is named here); any failure leaves the engine refusing to generate
        until a complete (full) update, as a failed ``update_weights`` does."""
        with self.exclusive():
            if self._released:
                raise EngineError("embedded engine cannot update weights: released: call resume() first")
            if base_version != self._weight_version or not self._weights_loaded:
                held = (f"version {self._weight_version}" if self._weights_loaded
                        else f"incomplete weights (after version {self._weight_version})")
                raise DeltaBaseMismatch(f"delta update to version {version} is based on version {base_version}, "
                                        f"but the engine holds {held}; send a full update")
            problems: list[str] = []
            applied: set[str] = set()
            try:
                with torch.no_grad():
                    for d in deltas:
                        if d.name not in self.param_map:
                            problems.append(f"{d.name}: no such tensor in this model")
                            continue
                        canonical = self.param_map.canonical(d.name)
                        if canonical in applied:  # a tied alias (lm_head of tied embeddings): one storage, patched
                            continue  # once (an xor patch applied twice would undo itself)
                        applied.add(canonical)
                        dst = self.param_map.view(d.name)
                        try:
                            d.apply_to(dst)
                        except SyncError as e:
                            problems.append(str(e))
                            continue
                        if d.checksum_algorithm and tensor_checksum(dst, d.checksum_algorithm) != d.checksum:
                            problems.append(f"{d.name}: after the {d.kind} patch its {d.checksum_algorithm} is "
                                            "not the trainer's (the base bits differed)")
            except BaseException:
                self._weights_loaded = False
                raise
            if problems:
                self._weights_loaded = False
                raise SyncError(f"delta update to version {version} (base {base_version}) failed; the engine refuses "
                                f"to generate until a full update: {len(problems)} problem(s): "
                                + "; ".join(problems[:10]))
            self._weight_version = version

    def reports_weight_checksums(self) -> bool:
        return True

    def weight_checksums(self, names: Iterable[str], algorithm: str) -> dict[str, str]:
        """The ``algorithm`` checksum of each named live tensor (``weight_delta.tensor_checksum``)."""
        with self.exclusive():
            if self._released:
                raise EngineError("embedded engine cannot report checksums: released: call resume()")
            return {n: tensor_checksum(self.param_map.view(n), algorithm) for n in names if n in self.param_map}

    def adapter_base_needed(self) -> bool:
        """Whether the next ``update_adapter`` must bring the base weights: none kept yet, or the live weights
        are gone (``release`` without backup, a failed update)."""
        return not self._adapter_base or self._released or not self._weights_loaded

    def update_adapter(self, adapter: AdapterExport, version: int,
                       base: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """``--lora-sync adapter``: set every adapted weight to ``W_base + alpha / r * B @ A`` (float32, then the
        engine's dtype: ``peft_adapter.merged_weight``) and every weight of the modules to save to the adapter's
        tensor (``--lora-modules-to-save``; one sent before and missing now is refused), then adopt ``version``.

        ``base`` (the trainer's unmerged weights, every tensor): loaded first, as ``update_weights``, and the
        adapted modules' base weights kept from it; without it the base kept by an earlier update is used.
        Every adapter tensor is checked (module known, shapes ``[r, in]`` / ``[out, r]``) before any weight
        changes: a bad adapter leaves the engine at its version, still serving."""
        with self.exclusive():
            if base is None and self.adapter_base_needed():
                raise SyncError(f"adapter update to version {version}: the engine holds no base weights to merge the "
                                "adapter into (none sent yet, or released); send the base weights with it")
            if self._released:
                raise EngineError("embedded engine cannot update weights: released: call resume() first")
            if base is not None:
                self._adapter_base, self._adapter_saved = {}, set()
            modules, saved = self._checked_adapter(adapter, version)
            if base is not None:
                self._update_weights(base, version)  # the whole base model, checked as any update
            try:
                with torch.no_grad():
                    for name, (a, b) in modules.items():
                        dst = self.param_map.view(name)
                        if name not in self._adapter_base:
                            self._adapter_base[name] = dst.detach().clone()
                        dst.copy_(merged_weight(self._adapter_base[name], a.to(dst.device), b.to(dst.device),
                                                adapter.scaling, dst.dtype))
                    for name, tensor in saved.items():  # --lora-modules-to-save: the trainer's weights as they are
                        dst = self.param_map.view(name)
                        dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
                    self._adapter_saved = set(saved)
            except BaseException:
                self._weights_loaded = False
                raise
            self._weights_loaded = True
            self._weight_version = version

    def _checked_adapter(self, adapter: AdapterExport, version: int
                         ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
        """HF weight name -> ``(A, B)`` of every adapted module, and HF weight name -> tensor of every weight of the
        modules to save (``--lora-modules-to-save``), or SyncError naming every problem."""
        if version < self._weight_version:
            raise SyncError(f"update_adapter(version={version}) is older than the engine's weight_version "
                            f"{self._weight_version}; versions only move forward")
        try:
            modules = {f"{m}.weight": ab for m, ab in adapter.modules().items()}
        except ValueError as e:
            raise SyncError(f"adapter update to version {version}: {e}") from e
        problems = []
        for name, (a, b) in modules.items():
            if name not in self.param_map:
                problems.append(f"{name}: no such weight in this model")
                continue
            out_f, in_f = tuple(self.param_map.view(name).shape)
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (adapter.rank, in_f) or \
                    tuple(b.shape) != (out_f, adapter.rank):
                problems.append(f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} vs weight {(out_f, in_f)} at "
                                f"r={adapter.rank}")
        if self._adapter_base and set(self._adapter_base) - set(modules):
            problems.append(f"{len(set(self._adapter_base) - set(modules))} module(s) adapted before have no adapter "
                            f"now (first: {sorted(set(self._adapter_base) - set(modules))[0]})")
        saved = adapter.saved()
        if adapter.tie_word_embeddings and "lm_head.weight" not in self.param_map:
            saved.pop("lm_head.weight", None)  # PEFT's copy of the tied output layer: the embedding here
        for name, tensor in saved.items():
            if name not in self.param_map:
                problems.append(f"{name} (a module to save): no such weight in this model")
            elif tuple(tensor.shape) != tuple(self.param_map.view(name).shape):
                problems.append(f"{name} (a module to save): shape {tuple(tensor.shape)} vs the weight's "
                                f"{tuple(self.param_map.view(name).shape)}")
        if self._adapter_base and self._adapter_saved - set(saved):  # they train: kept, the engine would drift
            problems.append(f"{len(self._adapter_saved - set(saved))} weight(s) of the modules to save sent before are "
                            f"not sent now (first: {sorted(self._adapter_saved - set(saved))[0]})")
        if problems:
            raise SyncError(f"adapter update to version {version} refused; the engine stays at version "
                            f"{self._weight_version}: " + "; ".join(problems[:10]))
        return modules, saved

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load every ``*.safetensors`` of the directory ``path`` through ``update_weights`` (same name,
        shape and version checks), one tensor at a time. A PEFT dir (``adapter_config.json``, what the disk
        transport writes under ``--lora-sync adapter``) goes through ``update_adapter``, with the model
        files of its ``base`` subdir (``weight_dir.ADAPTER_BASE_DIR``), when there are any, as its base weights."""
        if is_adapter_dir(str(path)):
            files = sorted(glob.glob(os.path.join(str(path), ADAPTER_BASE_DIR, "*.safetensors")))
            try:
                adapter = AdapterExport.load(str(path))  # inf/NaN refused naming the tensor and file
            except (OSError, ValueError, KeyError, CheckpointError) as e:
                raise SyncError(f"adapter update to version {version}: {path} is not a readable PEFT dir ({e})") from e
            self.update_adapter(adapter, version, base=_safetensors_items(files) if files else None)
            return
        if is_delta_dir(str(path)):  # --update-weight-mode delta: patch the weights of the version it names
            header, deltas = read_delta_dir(str(path))
            if header.version != version:
                raise SyncError(f"weight update to version {version}: {path} holds the delta to version "
                                f"{header.version}; load the directory of version {version}")
            self.update_weights_delta(deltas, header.base_version, version)
            return
        files = sorted(glob.glob(os.path.join(str(path), "*.safetensors")))
        if not files:
            raise SyncError(f"weight update to version {version}: no *.safetensors in {path}; the disk transport "
                            "publishes v<version>/model.safetensors under --update-weight-disk-dir")

        self.update_weights(_safetensors_items(files), version)

    # -------------------------------------------------------- pause / continue
    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model between steps: a generate in flight finishes its current step, then waits until the
        block ends. Weight updates, ``release`` and ``resume`` run inside it (so they never land mid-forward);
        so does anything else that writes the parameters (a test double's weight reset). Re-entrant in one
        thread; a waiting block goes before the next step of every generate."""
        me = threading.get_ident()
        with self._cond:
            if self._model_owner == me:
                nested = True
            else:
                nested = False
                self._exclusive_waiting += 1
                self._cond.notify_all()  # whoever watches the engine's state (a test) sees the update waiting
                try:
                    while self._model_busy:
                        self._cond.wait()
                finally:
                    self._exclusive_waiting -= 1
                self._model_busy, self._model_owner = True, me
        if nested:
            yield
            return
        try:
            yield
        finally:
            with self._cond:
                self._model_busy, self._model_owner = False, None
                self._cond.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """Stop generation at the next step boundary of every ``generate`` in flight (and of any that starts),
        in ``mode`` (module docstring); returns at once: ``wait_paused`` says when they are parked."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause(mode={mode!r}): use one of {', '.join(PAUSE_MODES)} (SGLang's "
                              "/pause_generation modes)")
        with self._cond:
            self._pause_mode = mode
            if mode == "abort":
                for call in self._calls:
                    call.aborted = True
            self._cond.notify_all()

    def continue_(self) -> None:
        """Let parked generates go on, under whatever weights and version the engine holds now."""
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @property
    def paused(self) -> Optional[str]:
        """The pause mode in effect, None when generation runs."""
        return self._pause_mode

    def wait_paused(self, timeout: float, *, calls: int = 1) -> int:
        """Block until the engine is paused, at least ``calls`` generate calls are parked at a step boundary
        and none is running a step (``calls=0``: also when none is in flight, e.g. after an abort-mode pause
        returned them); return how many are parked. After ``timeout`` seconds raise ``EngineError`` naming
        what did not happen."""
        def parked() -> bool:
            return (self._pause_mode is not None and len(self._calls) >= calls
                    and all(c.parked for c in self._calls))

        with self._cond:
            if self._cond.wait_for(parked, timeout):
                return len(self._calls)
            in_flight, at_boundary = len(self._calls), sum(c.parked for c in self._calls)
            if self._pause_mode is None:
                why = "pause(mode) was not called (or continue_() came first)"
            elif in_flight < calls:
                why = f"only {in_flight} generate call(s) in flight, {calls} expected to park"
            else:
                why = (f"{in_flight - at_boundary} of {in_flight} generate call(s) did not reach a step boundary "
                       "(a step or a step_boundary_hook still running)")
            raise EngineError(f"embedded engine: no pause within {timeout} s: {why}; pause mode "
                              f"{self._pause_mode!r}, {at_boundary} parked")

    def _enter_step(self, call: _GenerateCall) -> tuple[bool, Optional[str]]:
        """Wait at a step boundary until ``call`` may run a step, then hold the model.

        Returns ``(aborted, parked_under)``: aborted: the call was aborted (the model is not held);
        parked_under: the last pause mode it waited under (None if it did not park)."""
        parked_under = None
        with self._cond:
            while True:
                if call.aborted:
                    call.parked = False
                    self._cond.notify_all()
                    return True, parked_under
                if self._pause_mode is not None:
                    parked_under = self._pause_mode
                    if not call.parked:
                        call.parked = True
                        self._cond.notify_all()  # wait_paused
                elif not self._model_busy and not self._exclusive_waiting:
                    break
                self._cond.wait()
            call.parked = False
            self._model_busy, self._model_owner = True, None
        return False, parked_under

    def _leave_step(self) -> None:
        with self._cond:
            self._model_busy = False
            self._cond.notify_all()

    # ------------------------------------------------------------- generation
    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        return self.generate_part(requests, sampling)

    def generate_part(self, requests: list[GenerateRequest], sampling: SamplingParams, *, first_request: int = 0,
                      pad_to: int = 0) -> list[Sample]:
        """``generate`` of ``requests`` as the part starting at ``first_request`` of a larger call.

        Why: engine replicas on several ranks (``rollout.replicas``) each generate a contiguous part
        of one rollout. A row's generator is seeded with its index in the whole call, and prompts are
        left-padded to at least ``pad_to`` tokens (the whole call's longest prompt), so every row
        sees the sampling stream and the prefill shape it would have seen in one call.
        """
        self._check_ready("generate")
        if not requests:
            return []
        for req in requests:
            self._check_prompt(req.prompt_ids, f"prompt of group_index {req.group_index}", req.multimodal_inputs)
        base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        rows = [EngineRow(list(requests[i].prompt_ids), row_seed(base_seed, first_request + i, j),
                          requests[i].budget(sampling), key=i, images=requests[i].multimodal_inputs)
                for i in range(len(requests)) for j in range(sampling.n)]
        outputs = self._run_rows(rows, sampling, pad_to)
        samples = []
        for (i, _j), out in zip([(i, j) for i in range(len(requests)) for j in range(sampling.n)], outputs):
            req = requests[i]
            text = self.tokenizer.decode(out.response_ids, skip_special_tokens=True) \
                if self.tokenizer is not None else None
            samples.append(Sample(
                group_index=req.group_index, prompt_ids=list(req.prompt_ids), response_ids=out.response_ids,
                rollout_logprobs=out.logprobs, finish_reason=out.finish_reason,
                weight_version=out.versions[0] if out.versions else self._weight_version,
                label=req.label, prompt_text=req.prompt_text, response_text=text, metadata=dict(req.metadata),
                token_versions=list(out.versions) if len(set(out.versions)) > 1 else [], routed_experts=out.routes,
                multimodal_inputs=req.multimodal_inputs))
            if out.spec is not None:  # drafts proposed / accepted per depth: rollout/spec_accept_rate_d{j}
                samples[-1].metadata[SPEC_METADATA_KEY] = out.spec
        return samples

    def generate_rows(self, rows: list["EngineRow"], sampling: SamplingParams) -> list["RowOutput"]:
        """Generate ``rows`` that may come from many requests, as one batch where they fit one chunk.

        Why: a server in front of this engine (``rollout.embedded_server``) batches the rows of the
        requests that arrived while the previous batch ran, each with its own seed and token budget,
        so concurrent requests share every decode forward instead of taking turns. ``sampling``
        gives what the rows share (temperature, top-p/k, stop tokens); its ``seed``, ``n`` and
        ``max_new_tokens`` are not used (each row brings its own). A row's tokens are what
        ``generate`` gives for the same prompt, seed and budget: they do not depend on the batch.
        """
        self._check_ready("generate")
        for k, row in enumerate(rows):
            self._check_prompt(row.prompt_ids, f"row {k}", row.images)
            if row.max_new_tokens < 1:
                raise ConfigError(f"row {k}: max_new_tokens {row.max_new_tokens}; use a value >= 1")
        return self._run_rows(rows, sampling, 0) if rows else []

    def _new_token_limit(self, row: "EngineRow") -> int:
        """How many tokens ``row`` may generate: its ``max_new_tokens``, capped so that prompt + response fit the
        model's context (``max_position_embeddings``). The first capped row of this engine is warned, naming
        the numbers (was: --rollout-max-response-len 100 became 59 without a word); its samples end with
        finish_reason "length" as any other cut."""
        room = self.context_length - len(row.prompt_ids)
        if row.max_new_tokens > room and not self._warned_cap:
            self._warned_cap = True
            log.warning("a response may be %d tokens long (--rollout-max-response-len, or --eval-max-response-len for "
                        "evaluation), but a prompt of %d tokens leaves %d of the model's context "
                        "(max_position_embeddings %d in %s): such responses are cut at %d tokens (finish_reason "
                        "'length'). Lower the flag to fit, or shorten the prompts (--rollout-max-prompt-len); "
                        "warned once per engine", row.max_new_tokens, len(row.prompt_ids), room,
                        self.context_length, self.hf_checkpoint, room)
        return min(row.max_new_tokens, room)

    def _check_prompt(self, prompt_ids: list[int], what: str, images: Optional[VisionInputs] = None) -> None:
        if self.image_tokens is None and images is not None:
            raise ConfigError(f"{what} carries images but {self.hf_checkpoint} is a text-only model; use a "
                              "vision-language checkpoint or drop --multimodal-keys")
        if self.image_tokens is not None:  # its image-pad tokens must be its images' features (named, before work)
            check_image_tokens(torch.tensor(prompt_ids), _grid(images), *self.image_tokens, what,
                               pixel_rows=int(images.pixel_values.shape[0]) if images is not None else None)
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"{what} has token id {bad[0]} outside the model's vocab [0, {self.vocab_size}); "
                              "the tokenizer does not match --hf-checkpoint")
        if len(prompt_ids) >= self.context_length:
            raise ConfigError(f"{what} has {len(prompt_ids)} tokens, not below the model's context length "
                              f"{self.context_length}; lower --rollout-max-prompt-len")

    def _run_rows(self, rows: list["EngineRow"], sampling: SamplingParams, pad_to: int) -> list["RowOutput"]:
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        longest = max(len(r.prompt_ids) + r.max_new_tokens for r in rows)
        per_chunk = self.rows_per_chunk(longest)
        outputs: list[RowOutput] = []
        call = _GenerateCall()
        with self._cond:
            self._calls.append(call)
        try:
            with torch.inference_mode(), batch_invariant_mode(self.batch_invariant):
                for start in range(0, len(rows), per_chunk):
                    part = rows[start:start + per_chunk]
                    if self.speculative is not None:
                        outputs.extend(generate_speculative_chunk(self, call, part, sampling, stop_ids, pad_to,
                                                                  self.speculative))
                    else:
                        outputs.extend(self._generate_chunk(call, part, sampling, stop_ids, pad_to))
        finally:
            with self._cond:
                self._calls.remove(call)
                self._cond.notify_all()
        return outputs

    @property
    def joins_rows(self) -> bool:
        """Whether ``generate_continuous`` can take rows into a running batch: every attention layer full (a
        sliding-window or linear-attention cache cannot be left-padded to merge); else a server batches
        statically with ``generate_rows``. A speculative engine batches statically too (its rows' caches hold
        rejected drafts' holes, which a merge would not carry)."""
        from megatron_rl.rollout.kv_cache import joinable, make_kv_cache  # lazy: kv_cache imports transformers

        return self.speculative is None and joinable(make_kv_cache(self.model.config, capacity=1))

    def generate_continuous(self, sampling: SamplingParams, take: Callable[[int], list["EngineRow"]],
                            finish: Callable[["EngineRow", "RowOutput"], None]) -> None:
        """Continuous batching: generate rows that keep arriving, each handed back the step it ends.

        Why: a server's requests arrive at their own times; in a static batch a request that arrives just
        after one starts waits for the whole of it, and a row that finishes early waits for the longest.
        Here, at every step boundary ``take(room)`` gives up to ``room`` rows to join the running batch
        (their prompts prefilled in that step, their caches merged with the running one, left-padded:
        ``kv_cache.merge_kv_caches``), and ``finish(row, output)`` receives each row in the step it ends.
        Returns when no row is running and ``take`` gives none. A row's tokens are what ``generate`` gives
        for its prompt, seed and budget (its own uniforms, by its own token index; positions its own), so
        they do not depend on who shares its batch. Pauses, aborts, cancels and weight versions behave as
        in ``generate`` (module docstring): ``retract`` re-prefills every running row, prompt + tokens."""
        from megatron_rl.rollout.kv_cache import compact_kv_cache, merge_kv_caches  # lazy: imports transformers

        if not self.joins_rows:
            raise ConfigError("generate_continuous needs a model whose attention layers are all full attention "
                              "(a sliding-window or linear-attention cache cannot be merged): use generate_rows")
        self._check_ready("generate")
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        slots: list[_Slot] = []  # the cache's rows, in order (finished ones until the next compaction)
        cache: Any = None
        mask = tokens = torch.empty(0)
        last_version = self._weight_version
        step = 0
        call = _GenerateCall()
        with self._cond:
            self._calls.append(call)
        try:
            with torch.inference_mode(), batch_invariant_mode(self.batch_invariant):
                while True:
                    active = [s for s in slots if not s.done]
                    longest = max((s.plen + s.limit for s in active), default=1)
                    joining = []
                    for row in take(max(0, self.rows_per_chunk(longest) - len(active))):
                        self._check_prompt(row.prompt_ids, "a joining row", row.images)
                        joining.append(_Slot(row, self._new_token_limit(row), sampling.greedy,
                                             self.response_start(row.prompt_ids, row.images)))
                    if not active and not joining:
                        return
                    if self.step_boundary_hook is not None:
                        self.step_boundary_hook(step)
                    aborted, parked_under = self._enter_step(call)
                    if aborted:
                        for slot in active + joining:
                            finish(slot.row, slot.output("abort", self._route_experts))
                        return
                    try:
                        if step:
                            self._check_ready("continue generating")
                        version = self._weight_version
                        retract = bool(active) and version != last_version and parked_under == "retract"
                        parts, logits = [], []
                        if active and not retract:  # one decode step of the running rows
                            mask = torch.cat([mask, mask.new_ones(len(slots), 1)], dim=1)
                            positions = self._decode_positions([s.start + len(s.tokens) - 1 for s in slots])
                            step_logits = self._decode_step(tokens.unsqueeze(-1), mask, positions, cache)
                            if self.route_capture is not None:  # each running row's fed token
                                step_routes = self.route_capture.take(len(slots), 1)
                                for k, s in enumerate(slots):
                                    if not s.done:
                                        s.routes.append(step_routes[k])
                            keep = [k for k, s in enumerate(slots) if not s.done]
                            index = torch.tensor(keep, dtype=torch.long, device=self.device)
                            parts.append((cache, index, mask[index]))
                            logits.append(step_logits[index])
                            order = [slots[k] for k in keep]
                        else:
                            order = []
                        fresh = (active if retract else []) + joining
                        if fresh:  # prefill: rows joining (and, after a retract, every running row again)
                            seqs = [s.row.prompt_ids + s.tokens for s in fresh]
                            width = max(map(len, seqs))
                            ids = torch.zeros(len(seqs), width, dtype=torch.long)
                            pmask = torch.zeros(len(seqs), width, dtype=torch.long)
                            for r, seq in enumerate(seqs):
                                ids[r, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
                                pmask[r, width - len(seq):] = 1
                            new_cache, new_logits = self._prefill(ids, pmask, capacity=width,
                                                                  images=[s.row.images for s in fresh])
                            if self.route_capture is not None:  # a (re-)prefill gives every route of its rows
                                prefill_routes = self.route_capture.take(len(seqs), width)
                                for r, (s, seq) in enumerate(zip(fresh, seqs)):
                                    s.routes = [prefill_routes[r, width - len(seq):]]
                            parts.append((new_cache, torch.arange(len(seqs), device=self.device), pmask.to(self.device)))
                            logits.append(new_logits)
                            order += fresh
                        if len(parts) == 1 and not fresh:
                            if len(order) < len(slots) and len(order) <= COMPACT_AT * len(slots):
                                # drop finished rows (a copy: not per row) and the padding columns they leave
                                _, index, kept = parts[0]
                                lead = _padding_columns(kept)
                                compact_kv_cache(cache, index, lead)
                                mask, tokens = kept[:, lead:], tokens[index]
                                slots = order
                            # else: the finished rows stay in the batch until the next compaction
                        else:
                            leads = [_padding_columns(m) for _, _, m in parts]
                            width = max(m.shape[1] - lead for (_, _, m), lead in zip(parts, leads))
                            remaining = max(s.limit - len(s.tokens) for s in order)
                            cache = merge_kv_caches(self.model.config, [(c, i, lead) for (c, i, _), lead
                                                                        in zip(parts, leads)], width, width + remaining)
                            mask = torch.cat([torch.nn.functional.pad(m[:, lead:], (width - m.shape[1] + lead, 0))
                                              for (_, _, m), lead in zip(parts, leads)])
                            slots = order
                        live = [s for s in slots if not s.done]
                        assert [id(s) for s in order] == [id(s) for s in live], "logits follow the live rows"
                        uniforms = torch.tensor([s.uniform() for s in order], dtype=torch.float64)
                        sampled, sampled_lp = sample_next_tokens(torch.cat(logits), sampling, uniforms.to(self.device),
                                                                 self.banned_tokens)
                    finally:
                        self._leave_step()
                    last_version = version
                    for slot, tok, lp in zip(order, sampled.tolist(), sampled_lp.tolist()):
                        slot.tokens.append(tok)
                        slot.logprobs.append(lp)
                        slot.versions.append(version)
                        if tok in stop_ids:
                            slot.end("stop")
                        elif slot.row.cancel is not None and slot.row.cancel.is_set():
                            slot.end("abort")
                        elif len(slot.tokens) >= slot.limit:
                            slot.end("length")
                        if slot.done:
                            finish(slot.row, slot.output(slot.reason, self._route_experts))
                    # the next step's input, one per cache row (a finished row's is ignored)
                    last = {id(s): s.tokens[-1] for s in order}
                    tokens = torch.tensor([last.get(id(s), s.tokens[-1] if s.tokens else 0) for s in slots],
                                          dtype=torch.long, device=self.device)
                    step += 1
        finally:
            with self._cond:
                self._calls.remove(call)
                self._cond.notify_all()

    def rows_per_chunk(self, longest: int) -> int:
        """Rows of one generate chunk whose sequences reach ``longest`` tokens: ``max_batch_size`` if set,
        else what fits ``CHUNK_BUDGET_BYTES`` (K and V of every layer at full length, plus the float32
        logits and the float64 sampling CDF of one step)."""
        if self.max_batch_size is not None:
            return self.max_batch_size
        cfg = self.text_config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        elem = next(self.model.parameters()).element_size()
        per_row = 2 * cfg.num_hidden_layers * kv_heads * head_dim * longest * elem + self.vocab_size * (4 + 4 + 8)
        if self.speculative is not None:  # k + 1 cache columns per token at worst, k + 1 positions' logits
            k = self.speculative.num_steps
            per_row = per_row * (k + 1) + self.vocab_size * (4 + 8 + 8) * (2 * k + 1)
        return max(1, CHUNK_BUDGET_BYTES // per_row)

    def _decode_step(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                     cache: Any) -> torch.Tensor:
        """One decode step of every cache row (``input_ids [b, 1]``): the new position's logits ``[b, vocab]``."""
        if self._lean_decode is not None:
            return self._lean_decode(input_ids, mask, positions, cache)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        return out.logits[:, -1, :]

    def _prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, capacity: int,
                 images: Optional[list[Optional[VisionInputs]]] = None):
        """Forward of left-padded sequences into a fresh cache of ``capacity`` positions; ``(cache, logits of
        each sequence's last position)``. Position ids ``cumsum(mask) - 1``, so padding changes nothing; a
        vision-language model's: each sequence's M-RoPE rows ``[3, b, s]``, with ``images`` (one entry per
        sequence) given as their pixel patches and grids, in row order (the order the model scatters them in)."""
        from megatron_rl.rollout.kv_cache import make_kv_cache  # lazy: kv_cache imports transformers at import time

        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra: dict[str, torch.Tensor] = {}
        if self.image_tokens is not None:
            positions, extra = self._vision_prefill(input_ids, mask, images or [None] * len(input_ids))
        cache = make_kv_cache(self.model.config, capacity=capacity)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), cache=cache, use_cache=True, logits_to_keep=1,
                         **{k: v.to(self.device) for k, v in extra.items()})
        return cache, out.logits[:, -1, :]

    def _vision_prefill(self, input_ids: torch.Tensor, mask: torch.Tensor,
                        images: list[Optional[VisionInputs]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``[3, b, s]`` M-RoPE positions of left-padded sequences (0 on the padding, which the mask hides) and
        the model's image keywords (their images concatenated in row order)."""
        assert self.image_tokens is not None
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        for r, seq_images in enumerate(images):
            keep = mask[r].bool()
            positions[:, r, keep] = mrope_position_ids(input_ids[r, keep], _grid(seq_images), *self.image_tokens)
        present = [im for im in images if im is not None]
        if not present:
            return positions, {}
        return positions, {"pixel_values": torch.cat([torch.from_numpy(im.pixel_values) for im in present]).to(
                               next(self.model.parameters()).dtype),
                           "image_grid_thw": torch.cat([torch.from_numpy(im.image_grid_thw) for im in present]).long()}

    def response_start(self, prompt_ids: list[int], images: Optional[VisionInputs]) -> int:
        """The position of a prompt's first response token: its length for a text model; for a vision-language
        model one past the prompt's largest M-RoPE position (an image of ``h x w`` merged patches advances the
        positions by ``max(h, w)``, not by its token count), as the trainer numbers the same tokens."""
        if self.image_tokens is None or images is None:
            return len(prompt_ids)
        return int(mrope_position_ids(torch.tensor(prompt_ids), _grid(images), *self.image_tokens).max()) + 1

    def _decode_positions(self, positions: list[int]) -> torch.Tensor:
        """One decode step's position ids: ``[b, 1]``, or ``[3, b, 1]`` (every M-RoPE row alike: text) for a
        vision-language model."""
        ids = torch.tensor(positions, device=self.device)[:, None]
        return ids[None].expand(3, -1, -1) if self.image_tokens is not None else ids

    def _generate_chunk(self, call: _GenerateCall, chunk: list["EngineRow"], sampling: SamplingParams,
                        stop_ids: set[int], pad_to: int = 0) -> list["RowOutput"]:
        keys = [row.key if row.key is not None else ("row", r) for r, row in enumerate(chunk)]
        prompt_order = list(dict.fromkeys(keys))  # rows with one key share one prefill of their prompt
        first_row = {key: r for r, key in reversed(list(enumerate(keys)))}
        prompts = [chunk[first_row[key]].prompt_ids for key in prompt_order]
        prompt_images = [chunk[first_row[key]].images for key in prompt_order]
        width = max(pad_to, max(len(p) for p in prompts))
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
        prompt_mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            prompt_mask[r, width - len(p):] = 1
        prompt_lens = [len(row.prompt_ids) for row in chunk]
        starts = [self.response_start(row.prompt_ids, row.images) for row in chunk]  # first response positions
        limits = [self._new_token_limit(row) for row in chunk]
        capacity = width + max(limits)
        # each row gets its own copy of its prompt (and, after the prefill, of its cache)
        slot = {key: k for k, key in enumerate(prompt_order)}
        expand = torch.tensor([slot[key] for key in keys], dtype=torch.long)

        longest = max(limits)
        uniforms = torch.empty(len(chunk), longest, dtype=torch.float64)
        if not sampling.greedy:
            for r, row in enumerate(chunk):
                gen = torch.Generator().manual_seed(row.seed)
                uniforms[r] = torch.rand(longest, generator=gen, dtype=torch.float64)
        batch = list(range(len(chunk)))  # batch row -> chunk row
        done = [False] * len(chunk)
        responses: list[list[int]] = [[] for _ in chunk]
        logprobs: list[list[float]] = [[] for _ in chunk]
        versions: list[list[int]] = [[] for _ in chunk]  # the weight version of each token
        finish: list[str] = ["length"] * len(chunk)
        capture = self.route_capture
        routes: list[list[torch.Tensor]] = [[] for _ in chunk]  # per row, with record_routes (module docstring)
        step = 0  # tokens every live row has
        cache: Any = None
        mask = tokens = torch.empty(0)
        keep: list[int] = []  # batch rows still generating
        last_version = self._weight_version
        while True:
            if self.step_boundary_hook is not None:
                self.step_boundary_hook(step)
            aborted, parked_under = self._enter_step(call)
            if aborted:
                for r in range(len(chunk)):
                    if not done[r]:
                        finish[r], done[r] = "abort", True
                break
            try:
                if step:
                    self._check_ready("continue generating")  # an update that failed between two steps
                version = self._weight_version
                if step == 0:
                    cache, logits = self._prefill(input_ids, prompt_mask, capacity, images=prompt_images)
                    if capture is not None:
                        prefill_routes = capture.take(len(prompts), width)
                        routes = [[prefill_routes[int(expand[r]), width - prompt_lens[r]:]] for r in range(len(chunk))]
                    cache.batch_select_indices(expand.to(self.device))
                    logits = logits[expand.to(self.device)]
                    mask = prompt_mask[expand].to(self.device)
                elif version != last_version and parked_under == "retract":
                    # SGLang's retract: the rows go back to the queue and are prefilled again, prompt + tokens so
                    # far, under the new weights; every live row has ``step`` tokens
                    batch = [batch[b] for b in keep]
                    generated = torch.tensor([responses[r] for r in batch], dtype=torch.long)
                    prefix_mask = torch.cat([prompt_mask[expand[batch]],
                                             torch.ones(len(batch), step, dtype=torch.long)], dim=1)
                    cache, logits = self._prefill(torch.cat([input_ids[expand[batch]], generated], dim=1),
                                                  prefix_mask, capacity, images=[chunk[r].images for r in batch])
                    if capture is not None:  # the re-prefill's routes replace every route of its rows
                        prefill_routes = capture.take(len(batch), width + step)
                        for b, r in enumerate(batch):
                            routes[r] = [prefill_routes[b, width - prompt_lens[r]:]]
                    mask = prefix_mask.to(self.device)
                else:
                    if len(keep) <= COMPACT_AT * len(batch):
                        # drop finished rows from the batch and its KV cache (a copy of the cache: not for every
                        # row that ends, only once a quarter of the batch is idle)
                        index = torch.tensor(keep, dtype=torch.long, device=self.device)
                        cache.batch_select_indices(index)
                        mask, tokens = mask[index], tokens[index]
                        batch = [batch[b] for b in keep]
                    mask = torch.cat([mask, mask.new_ones(len(batch), 1)], dim=1)
                    # a finished row left in the batch keeps its last position (its outputs are ignored)
                    positions = self._decode_positions([starts[r] + min(step, len(responses[r])) - 1 for r in batch])
                    logits = self._decode_step(tokens.unsqueeze(-1), mask, positions, cache)
                    if capture is not None:  # each live row's fed token (its last sampled one)
                        step_routes = capture.take(len(batch), 1)
                        for b, r in enumerate(batch):
                            if not done[r]:
                                routes[r].append(step_routes[b])
                tokens, token_logprobs = sample_next_tokens(logits, sampling, uniforms[batch, step].to(self.device),
                                                            self.banned_tokens)
            finally:
                self._leave_step()
            last_version = version
            keep = []
            for b, (tok, lp) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                r = batch[b]
                if done[r]:
                    continue  # finished earlier, still in the batch until the next compaction
                responses[r].append(tok)
                logprobs[r].append(lp)
                versions[r].append(version)
                if tok in stop_ids:
                    finish[r], done[r] = "stop", True
                elif (cancel := chunk[r].cancel) is not None and cancel.is_set():
                    finish[r], done[r] = "abort", True  # aborted alone (a server's /abort_request): tokens kept
                elif len(responses[r]) < limits[r]:
                    keep.append(b)
                else:
                    done[r] = True
            step += 1
            if not keep:
                break
        experts = self._route_experts
        return [RowOutput(responses[r], logprobs[r], finish[r], versions[r],
                          routed_experts(routes[r], prompt_lens[r] + len(responses[r]), experts) if experts else None)
                for r in range(len(chunk))]

    @property
    def _route_experts(self) -> int:
        """The expert count routes are stored for (0: not recording routes)."""
        return self.route_capture.num_experts if self.route_capture is not None else 0


def _grid(images: Optional[VisionInputs]) -> Optional[torch.Tensor]:
    """The ``image_grid_thw`` of a prompt's images as a tensor (None: no images)."""
    return torch.from_numpy(images.image_grid_thw).long() if images is not None else None
