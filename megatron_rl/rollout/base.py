"""The rollout-engine boundary: typed requests in, ``Sample`` records out.

Every engine (embedded torch, SGLang later) implements ``RolloutEngine``; the
RL loop never branches on which one it holds: ``--rollout-backend`` picks a
row of ``ENGINES`` (a ``registry.Registry``) and the row's class builds itself
with ``from_config(cfg)``. ``GenerateRequest`` and ``SamplingParams`` are
defined in ``data.types`` and re-exported here. Invariants every engine keeps:

* ``generate`` returns ``len(requests) * sampling.n`` samples, request-major:
  the ``n`` samples of request ``i`` are consecutive and carry its
  ``group_index``, ``label``, ``prompt_text`` and a copy of its ``metadata``.
* ``rollout_logprobs[i]`` is the log-prob of ``response_ids[i]`` under the
  distribution at the sampling temperature, *before* top-k/top-p filtering
  (SGLang's default, ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset). Greedy
  (temperature 0) reports the temperature-1 log-prob of the argmax token.
* A stop token that ends a response is part of ``response_ids`` (with its
  log-prob) so the trainer can learn to emit it; ``finish_reason`` is "stop".
* ``weight_version`` on a sample is the version of the weights that produced its
  first (oldest) response token; when an update landed mid-response, ``token_versions``
  holds the version of every response token (response-aligned; empty means every
  token has ``weight_version``), so staleness is measured per token.
* ``update_weights_from_disk(path, version)`` loads a dir of HF safetensors (what the disk
  transport publishes, ``rollout.weight_dir``) with the same checks and the same version rule.
* ``update_weights`` is atomic with respect to the version: the engine adopts
  ``version`` only after *all* tensors of that update are applied; a failed or
  partial update leaves the old version number and the engine refuses to
  generate until a complete update arrives (its weights are then a mix).
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Optional, Type, Union

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import EngineError, SyncError
from megatron_rl.infra.registry import Refused, Registry

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config
    from megatron_rl.models.peft_adapter import AdapterExport
    from megatron_rl.plan.engines import EnginePlacement

__all__ = ["ENGINES", "EngineHealth", "GenerateRequest", "RolloutEngine", "SamplingParams", "load_tokenizer",
           "make_engine", "register_engine"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class EngineHealth:
    """What ``health()`` reports; ``ok`` means ``generate`` would run now."""

    ok: bool
    weight_version: int
    released: bool
    weights_loaded: bool
    detail: str = ""


class RolloutEngine(abc.ABC):
    """Generates samples and accepts new weights from the trainer.

    Built either from keyword arguments (``make_engine(kind, **kwargs)`` calls the
    class) or from the run's flags (``from_config(cfg)``, what the loop uses).
    """

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: "Config", placement: "Optional[EnginePlacement]" = None) -> "RolloutEngine":
        """Build the engine from the run's flags (``--hf-checkpoint``, ...); ``placement``: the engine
        servers this run launched (``rollout.sglang.launcher``), None for an engine that needs none."""

    def close(self) -> None:
        """Release what the engine holds outside the model (HTTP pools, monitor threads) at the end of the
        run, before its servers stop; a no-op for an engine that holds none. Safe to call twice."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """Sample ``sampling.n`` responses per request (see module invariants)."""

    def serving(self) -> ContextManager[None]:
        """The span of one rollout's generation (``RolloutSource``): an engine with replicas in other ranks'
        processes (``rollout.replicas``) has them generate inside it and lets them go at its end.
        Default: nothing to coordinate."""
        return contextlib.nullcontext()

    def pause(self, mode: str = "abort") -> None:
        """Stop in-flight generation at a decode-step boundary so a weight update can land, in SGLang's
        ``/pause_generation`` modes ("abort", "retract", "in_place"); ``continue_`` resumes it. Optional:
        an asynchronous driver needs it, the synchronous loop never pauses."""
        raise EngineError(f"{type(self).__name__}: this engine cannot pause in-flight generation (mode {mode!r}); "
                          "sync weights between rollouts, or use an engine that implements pause()")

    def continue_(self) -> None:
        """Resume generation stopped by ``pause``, under the weights the engine holds now."""
        raise EngineError(f"{type(self).__name__}: this engine cannot pause in-flight generation, so there is "
                          "nothing to continue")

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Apply HF-checkpoint-named tensors (streamed, possibly in buckets), then adopt ``version``.

        Raises ``SyncError`` naming unknown names or shape mismatches.
        """

    def update_adapter(self, adapter: "AdapterExport", version: int,
                       base: Optional[Iterable[tuple[str, Any]]] = None) -> None:
        """``--lora-sync adapter``: merge a LoRA adapter (``models.peft_adapter``) into the engine's kept base
        weights, then adopt ``version``; ``base``: the base weights to load (and keep) first. Only engines
        that merge adapters themselves implement it (the embedded one)."""
        raise SyncError(f"{type(self).__name__} cannot apply a LoRA adapter itself: use --lora-sync merged")

    def adapter_base_needed(self) -> bool:
        """Whether the next ``update_adapter`` must carry the base weights (the engine lost or never had them).
        An engine in another process reports False: the transport sends the base with its first sync."""
        return False

    def update_weights_delta(self, deltas: Iterable[Any], base_version: int, version: int) -> None:
        """``--update-weight-mode delta``: apply ``rollout.weight_delta.TensorDelta`` s (only the tensors that
        changed) onto the weights of ``base_version``, then adopt ``version``. An engine at another version
        raises ``weight_delta.DeltaBaseMismatch`` before changing anything (the trainer then sends a full
        update). Only engines that patch their weights in place implement it (the embedded one)."""
        raise SyncError(f"{type(self).__name__} cannot apply a weight delta itself: use --update-weight-mode full")

    def reports_weight_checksums(self) -> bool:
        """Whether ``weight_checksums`` answers (``--update-weight-verify auto`` verifies only such engines)."""
        return False

    def weight_checksums(self, names: Iterable[str], algorithm: str) -> dict[str, str]:
        """The checksum (``weight_delta.tensor_checksum``) of each named tensor the engine holds now, for the
        trainer's post-apply check (``--update-weight-verify``); a name the engine lacks is left out."""
        raise EngineError(f"{type(self).__name__} cannot report checksums of its weights: use "
                          "--update-weight-verify off")

    @abc.abstractmethod
    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load the HF safetensors published in the directory ``path`` (``--update-weight-transport disk``),
        then adopt ``version``; same checks and errors as ``update_weights``."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The engine's weights by HF checkpoint name (for --check-weight-update-equal)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give back memory (weights, KV cache) so a colocated trainer can use it."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Re-acquire memory released by ``release``; see ``health().weights_loaded`` for what survived."""

    def resume_weights(self) -> None:
        """First half of a colocated wake: only the weights' memory comes back, so the weight sync
        that follows writes into it while the KV cache (an engine's largest allocation) is still
        released: the peak is trainer-asleep + engine weights, never + KV cache (slime's order:
        onload weights, update weights, onload KV). Default: everything comes back here."""
        self.resume()

    def resume_kv_cache(self) -> None:
        """Second half, after the weight sync: the rest (KV cache, CUDA graphs). Default: nothing
        is left (``resume_weights`` resumed everything)."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """Cheap liveness and state report."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the last complete weight update (0 = the weights loaded at start)."""


log = logging.getLogger("megatron_rl")


def load_tokenizer(hf_checkpoint: str) -> Any:
    """The tokenizer saved beside an HF checkpoint, or None when there is none (token-id prompts only);
    checked against what was saved (:func:`checked_tokenizer`)."""
    if not any(os.path.exists(os.path.join(str(hf_checkpoint), f)) for f in TOKENIZER_FILES):
        return None
    import transformers  # heavy: loaded only by an engine that has a tokenizer to load

    return checked_tokenizer(transformers.AutoTokenizer.from_pretrained(str(hf_checkpoint)), str(hf_checkpoint))


def _json_file(path: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _class_kind(name: str) -> str:
    """A tokenizer class name without the fast/slow distinction (``Qwen2TokenizerFast`` is ``Qwen2Tokenizer``;
    transformers 5's ``TokenizersBackend`` is 4's ``PreTrainedTokenizerFast``)."""
    name = "TokenizersBackend" if name == "PreTrainedTokenizerFast" else name
    return name[:-len("Fast")] if name.endswith("Fast") else name


def checked_tokenizer(tokenizer: Any, path: str) -> Any:
    """``tokenizer`` (``AutoTokenizer``'s load of ``path``), or the tokenizer as saved, with a warning naming both
    classes: transformers 5 loads a tokenizer saved beside a ``qwen2`` config.json as ``Qwen2Tokenizer`` whatever
    ``tokenizer_config.json`` names (its own pre-tokenizer and decoder: other token ids for the same text), so
    a class other than the saved one is replaced by the saved one when transformers has it (else warned).
    A tokenizer with more tokens than the model's vocabulary (config.json ``vocab_size``) is warned, naming
    the tokens without an embedding row."""
    import transformers  # heavy: only an engine with a tokenizer gets here

    saved = _json_file(os.path.join(path, "tokenizer_config.json")).get("tokenizer_class")
    loaded = type(tokenizer).__name__
    if isinstance(saved, str) and _class_kind(saved) != _class_kind(loaded):
        cls = getattr(transformers, saved, None) or getattr(transformers, _class_kind(saved), None)
        if cls is not None and hasattr(cls, "from_pretrained"):
            log.warning("tokenizer of %s: transformers' AutoTokenizer loads it as %s, but its tokenizer_config.json "
                        "names %s (another pre-tokenizer and decoder give other token ids for the same text); "
                        "loaded as %s, the tokenizer as saved", path, loaded, saved, cls.__name__)
            tokenizer = cls.from_pretrained(path)
        else:
            log.warning("tokenizer of %s: transformers' AutoTokenizer loads it as %s, but its tokenizer_config.json "
                        "names %s, which this transformers (%s) does not have: check that %s tokenizes your "
                        "prompts as intended, or install the version the tokenizer was saved with", path, loaded,
                        saved, transformers.__version__, loaded)
    config = _json_file(os.path.join(path, "config.json"))
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        extra = {i: tokenizer.convert_ids_to_tokens(i) for i in range(vocab, min(len(tokenizer), vocab + 8))}
        log.warning("tokenizer of %s (%s) has %d tokens, more than the model's vocabulary (config.json vocab_size "
                    "%d): ids %s have no embedding row (a prompt holding one fails; the engine never samples them); "
                    "remove those added tokens from the tokenizer files, or resize the model's embedding",
                    path, type(tokenizer).__name__, len(tokenizer), vocab, extra)
    return tokenizer


# --rollout-backend -> engine class (a RolloutEngine subclass, or "module:Class" imported on first use).
ENGINES: Registry[Type[RolloutEngine]] = Registry("--rollout-backend", "rollout engine", {
    "embedded": "megatron_rl.rollout.embedded:EmbeddedEngine",  # a path: its module loads transformers
    "sglang": "megatron_rl.rollout.sglang.engine:SGLangEngine",  # servers by --rollout-engine-urls
})


def register_engine(kind: str, engine: Union[str, Type[RolloutEngine], Refused]) -> None:
    """Make ``--rollout-backend kind`` build ``engine`` (a RolloutEngine subclass or "module:Class")."""
    ENGINES.register(kind, engine)


def make_engine(kind: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine named ``kind`` (e.g. "embedded") with its constructor's keyword arguments.

    The loop builds its engine from flags instead: ``ENGINES.get(kind).from_config(cfg)``
    (see ``rollout.build``). An unknown or refused ``kind`` raises ConfigError.
    """
    return ENGINES.get(kind)(**kwargs)
