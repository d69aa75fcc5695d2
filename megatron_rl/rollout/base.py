"""The rollout-engine boundary: typed requests in, ``Sample`` records out.

Every engine (embedded torch, SGLang later) implements ``RolloutEngine``; the
RL loop never branches on which one it holds. Invariants every engine keeps:

* ``generate`` returns ``len(requests) * sampling.n`` samples, request-major:
  the ``n`` samples of request ``i`` are consecutive and carry its
  ``group_index``, ``label``, ``prompt_text`` and a copy of its ``metadata``.
* ``rollout_logprobs[i]`` is the log-prob of ``response_ids[i]`` under the
  distribution at the sampling temperature, *before* top-k/top-p filtering
  (SGLang's default, ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset). Greedy
  (temperature 0) reports the temperature-1 log-prob of the argmax token.
* A stop token that ends a response is part of ``response_ids`` (with its
  log-prob) so the trainer can learn to emit it; ``finish_reason`` is "stop".
* ``weight_version`` on a sample is the version of the weights that produced
  every one of its tokens.
* ``update_weights`` is atomic with respect to the version: the engine adopts
  ``version`` only after *all* tensors of that update are applied; a failed or
  partial update leaves the old version number and the engine refuses to
  generate until a complete update arrives (its weights are then a mix).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; one value per ``generate`` call (every request shares it).

    ``top_k=-1`` and ``top_p=1.0`` disable those filters; ``temperature=0`` is
    greedy. ``seed=None`` draws a fresh seed per call (not reproducible); with a
    seed, the output is a pure function of (weights, requests, params).
    EOS ids from the model's generation config are stop tokens unless
    ``ignore_eos``; ``stop_token_ids`` are always stop tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.temperature >= 0.0, "--rollout-temperature", self.temperature, "use 0 for greedy or a value > 0"),
            (0.0 < self.top_p <= 1.0, "--rollout-top-p", self.top_p, "use a value in (0, 1]; 1.0 disables top-p"),
            (self.top_k == -1 or self.top_k >= 1, "--rollout-top-k", self.top_k, "use -1 (disabled) or k >= 1"),
            (self.max_new_tokens >= 1, "--rollout-max-response-len", self.max_new_tokens, "use a value >= 1"),
            (self.n >= 1, "--n-samples-per-prompt", self.n, "use a value >= 1"),
            (all(t >= 0 for t in self.stop_token_ids), "--rollout-stop-token-ids", self.stop_token_ids,
             "token ids are non-negative integers"),
        ]
        for ok, flag, value, fix in checks:
            if not ok:
                raise ConfigError(f"{flag}={value!r} is invalid: {fix}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    """One prompt to answer; ``n`` samples of it form one GRPO group."""

    prompt_ids: list[int]
    group_index: int
    label: Any = None
    prompt_text: str | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ConfigError(
                f"GenerateRequest(group_index={self.group_index}) has an empty prompt_ids; every prompt needs "
                "at least one token (check --input-key and the tokenizer)")


@dataclass(frozen=True)
class EngineHealth:
    """What ``health()`` reports; ``ok`` means ``generate`` would run now."""

    ok: bool
    weight_version: int
    released: bool
    weights_loaded: bool
    detail: str = ""


class RolloutEngine(abc.ABC):
    """Generates samples and accepts new weights from the trainer."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
        """Sample ``sampling.n`` responses per request (see module invariants)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Apply HF-checkpoint-named tensors (streamed, possibly in buckets), then adopt ``version``.

        Raises ``SyncError`` naming unknown names or shape mismatches.
        """

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The engine's weights by HF checkpoint name (for --check-weight-update-equal)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give back memory (weights, KV cache) so a colocated trainer can use it."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Re-acquire memory released by ``release``; see ``health().weights_loaded`` for what survived."""

    @abc.abstractmethod
    def health(self) -> EngineHealth:
        """Cheap liveness and state report."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the last complete weight update (0 = the weights loaded at start)."""


_ENGINE_KINDS: dict[str, Callable[..., RolloutEngine]] = {}


def register_engine(kind: str, constructor: Callable[..., RolloutEngine]) -> None:
    """Make ``make_engine(kind, ...)`` build engines with ``constructor``."""
    _ENGINE_KINDS[kind] = constructor


def make_engine(kind: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine named ``kind`` (e.g. "embedded") with its constructor's keyword arguments."""
    if kind == "embedded" and kind not in _ENGINE_KINDS:
        from megatron_rl.rollout.embedded import EmbeddedEngine

        register_engine("embedded", EmbeddedEngine)
    if kind not in _ENGINE_KINDS:
        raise ConfigError(
            f"--rollout-backend={kind!r} is not a known rollout engine; choose one of "
            f"{', '.join(sorted(set(_ENGINE_KINDS) | {'embedded'}))}")
    return _ENGINE_KINDS[kind](**kwargs)
