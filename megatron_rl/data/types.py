"""The records that cross the engine boundary: requests in (``GenerateRequest``, ``SamplingParams``), ``Sample`` out.

They live here, below both the prompt data (which builds requests) and the
rollout engines (which answer them), so neither has to import the other;
the rollout package re-exports the request types.

``Sample`` is the one record that flows from engine to reward to trainer.

Token alignment convention (every module relies on it): a sample's sequence is
``prompt_ids + response_ids``. Per-token training quantities (log-probs,
advantages, loss mask, rollout log-probs) are *response-aligned*: entry ``i``
belongs to ``response_ids[i]``, i.e. it is produced by the model at position
``len(prompt_ids) + i - 1`` predicting that token. Flat per-token tensors over a
micro-batch are the concatenation of these response-aligned pieces, in sample
order, with ``response_lengths`` giving the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from megatron_rl.data.images import VisionInputs
from megatron_rl.errors import ConfigError, MegatronRLError


class HeldElsewhereError(MegatronRLError):
    """A ``SampleStub``'s tokens were read on a rank that does not hold them."""


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


def describe_prompt(metadata: dict) -> str:
    """How errors name a sample's prompt: ``prompt_index 3, line 4`` (its place in the prompt stream and the line
    of its prompt file, as the prompt reader records them in the request's metadata), or "" when unknown."""
    return ", ".join(f"{key} {metadata[key]}" for key in ("prompt_index", "line") if key in (metadata or {}))


#: the request metadata that places a prompt in the prompt file and stream (set by the prompt reader)
PROMPT_PLACE_KEYS = ("prompt_index", "line", "epoch")
#: sample metadata the engine writes itself (the prompt reader's place keys; SGLang's and the embedded engine's
#: weight_version_spans / finish_message; the tool loop's turn counts; the full-async producer's
#: partial_continuations; rewards' reward_metrics): a prompt's own metadata (--metadata-key) may not hold them,
#: or the run would read the user's value as its own
ENGINE_METADATA_KEYS = PROMPT_PLACE_KEYS + (
    "weight_version_spans", "finish_message", "turns", "tool_calls", "tool_errors", "agent_stop",
    "partial_continuations", "reward_metrics")


def mark_prompt(sample: "Sample", request: "GenerateRequest") -> None:
    """Give ``sample`` its request's place keys (``PROMPT_PLACE_KEYS``) where it lacks them, so an error about it
    (its reward, its group's filter verdict) names its prompt whatever engine or function made it; and its
    prompt's images (``multimodal_inputs``: one object shared by the group's samples, pickled once per dump)."""
    for key in PROMPT_PLACE_KEYS:
        if key in request.metadata:
            sample.metadata.setdefault(key, request.metadata[key])
    if sample.multimodal_inputs is None and request.multimodal_inputs is not None:
        sample.multimodal_inputs = request.multimodal_inputs


@dataclass
class GenerateRequest:
    """One prompt to answer; ``n`` samples of it form one GRPO group."""

    prompt_ids: list[int]
    group_index: int
    label: Any = None
    prompt_text: str | None = None
    metadata: dict = field(default_factory=dict)
    # This request's token budget where it is below the call's ``SamplingParams.max_new_tokens``: a partial
    # rollout's continuation (prompt + the tokens it had) has only the rest of its response's budget, and
    # continuations of different lengths go to the engine in one call. None: the call's.
    max_new_tokens: int | None = None
    # The prompt's images as the model takes them (pixel patches and grids, made once on the driver by
    # data/images.py from --multimodal-keys' column); prompt_ids then hold each image's pad tokens. None: text only.
    multimodal_inputs: Optional[VisionInputs] = None

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ConfigError(
                f"GenerateRequest(group_index={self.group_index}) has an empty prompt_ids; every prompt needs "
                "at least one token (check --input-key and the tokenizer)")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"GenerateRequest(group_index={self.group_index}) max_new_tokens "
                              f"{self.max_new_tokens}: use a value >= 1, or None for the call's")

    def budget(self, sampling: "SamplingParams") -> int:
        """How many tokens this request may generate in a call with ``sampling``."""
        if self.max_new_tokens is None:
            return sampling.max_new_tokens
        return min(sampling.max_new_tokens, self.max_new_tokens)


class RoutedExperts:
    """The experts each token of a sample went to in the rollout engine's forwards (MoE routing replay R3).

    ``array[t, l, j]`` is the j-th of the top-k experts that input token ``t`` of ``prompt_ids +
    response_ids`` went to in the model's ``l``-th MoE layer (counting MoE layers only, in layer order).
    The last token has no row: no forward of the engine reads it (the trainer's output there carries no
    loss), so there are ``total_length - 1`` rows, as SGLang returns them. A token's row is the route
    its key/value in the engine's cache was computed with: its prefill (prompt, observation, or a
    re-prefill after a retract under new weights) or the decode step that fed it.

    Stored in the smallest unsigned dtype that holds the expert ids (uint8 up to 256 experts): a
    32k-token sample of a 58-MoE-layer top-8 model is 15M ids. A plain class, not a dataclass, so
    ``dataclasses.asdict(sample)`` keeps it whole (rollout checkpoints store samples as field dicts).
    """

    __slots__ = ("array",)

    def __init__(self, array: "np.ndarray"):
        array = np.asarray(array)
        if array.ndim != 3 or array.dtype.kind not in "iu":
            raise ValueError(f"routed experts must be an integer array [tokens, moe_layers, topk], got "
                             f"{array.dtype} {array.shape}")
        self.array = array

    @classmethod
    def from_indices(cls, indices: Any, num_experts: int) -> "RoutedExperts":
        """From integer expert ids (any int array or tensor), in the smallest unsigned dtype for ``num_experts``."""
        dtype = np.uint8 if num_experts <= 1 << 8 else np.uint16 if num_experts <= 1 << 16 else np.uint32
        return cls(np.asarray(indices).astype(dtype))

    @property
    def tokens(self) -> int:
        return int(self.array.shape[0])

    @property
    def layers(self) -> int:
        return int(self.array.shape[1])

    @property
    def topk(self) -> int:
        return int(self.array.shape[2])

    def first(self, tokens: int) -> "RoutedExperts":
        """The routes of the first ``tokens`` tokens (a sample cut shorter keeps its prefix's routes)."""
        return RoutedExperts(self.array[:tokens])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RoutedExperts) and self.array.dtype == other.array.dtype
                and self.array.shape == other.array.shape and bool(np.array_equal(self.array, other.array)))

    __hash__ = None  # type: ignore[assignment]  # mutable contents, like the list fields of Sample

    def __repr__(self) -> str:
        return f"RoutedExperts({self.array.dtype}, tokens={self.tokens}, moe_layers={self.layers}, topk={self.topk})"

    def __getstate__(self):
        return self.array

    def __setstate__(self, array) -> None:
        self.array = array


@dataclass
class Sample:
    """One generated response to one prompt, with everything the trainer needs."""

    group_index: int  # which prompt this answers; samples of one prompt share it (GRPO groups)
    prompt_ids: list[int]
    response_ids: list[int]
    # Log-probs of the sampled tokens under the engine's weights at sampling
    # temperature; used for truncated importance sampling and mismatch metrics.
    rollout_logprobs: list[float] = field(default_factory=list)
    # 1 where a response token is trained on (tool outputs / padding get 0). Empty = all ones.
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "length"  # "stop" (hit a stop token) | "length" | "abort"
    weight_version: int = 0  # engine weight version of the response's first (oldest) token
    label: Any = None  # ground truth for the reward function
    prompt_text: str | None = None
    response_text: str | None = None
    metadata: dict = field(default_factory=dict)
    # The weight version that generated each response token (response-aligned, like rollout_logprobs).
    # Empty = every token has ``weight_version``; set when an update landed mid-response (a partial
    # rollout paused, updated and continued): staleness is defined per token (docs/async.md).
    token_versions: list[int] = field(default_factory=list)
    # The rollout engine's expert choices per input token (MoE routing replay R3, --use-rollout-routing-replay);
    # None when the engine was not asked for them.
    routed_experts: Optional[RoutedExperts] = None
    # ReMax (--advantage-estimator remax): the reward of one greedy response to the same prompt, generated and
    # scored by the rollout manager right after the group; the advantage is reward - reward_baseline.
    reward_baseline: Optional[float] = None
    # Which branch of its trajectory this sample is (0: the first, or the only one). An agent session whose chat
    # template re-rendered its history splits into branches (rollout/endpoint/trajectory.py), each a sample of its
    # own; a sample with branch k > 0 follows branch k-1 of the same trajectory in the batch, and the advantage
    # estimators count the trajectory once in its group (docs/agentic.md, "Branches").
    branch: int = 0
    # The prompt's images (GenerateRequest.multimodal_inputs, given by mark_prompt): pixel patches and grids whose
    # features fill the image-pad tokens of prompt_ids. None: a text-only sample.
    multimodal_inputs: Optional[VisionInputs] = None

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def num_rollout_logprobs(self) -> int:
        return len(self.rollout_logprobs)

    def effective_loss_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)

    def effective_token_versions(self) -> list[int]:
        """The weight version of every response token (``token_versions``, or ``weight_version`` for all)."""
        return list(self.token_versions) if self.token_versions else [self.weight_version] * len(self.response_ids)

    @property
    def oldest_version(self) -> int:
        """The version of the sample's oldest token: what its staleness is measured from."""
        return min(self.token_versions) if self.token_versions else self.weight_version

    def staleness(self, trained_at: int) -> int:
        """How many weight updates behind its oldest token is, when trained by weights of version ``trained_at``."""
        return trained_at - self.oldest_version


# What a SampleStub does not carry: reading one of these on it is a bug in the caller (it would
# silently train on the wrong data if it returned anything), so it raises.
_HELD_ELSEWHERE = ("prompt_ids", "response_ids", "rollout_logprobs", "finish_reason", "weight_version", "label",
                   "prompt_text", "response_text", "metadata", "token_versions", "routed_experts",
                   "multimodal_inputs")


@dataclass
class SampleStub:
    """A rollout sample whose tokens another data-parallel rank holds.

    Each training rank receives in full only the samples it trains on; of the others it
    keeps what every rank needs of every sample: lengths (the micro-batch plan is a pure
    function of them), reward and group (advantages are computed over whole groups), the
    loss mask (loss denominators count the whole step's tokens) and the number of rollout
    log-probs (validation, which must fail on every rank alike). Same attribute names as
    ``Sample`` for those; its tokens, texts and log-probs raise ``HeldElsewhereError``.
    """

    group_index: int
    prompt_length: int
    response_length: int
    num_rollout_logprobs: int
    reward: float
    loss_mask: list[int]  # as the sample has it: response-aligned, empty for all ones
    owner: int  # the data-parallel rank that holds the sample
    reward_baseline: Optional[float] = None  # ReMax's greedy-response reward (advantages need it for every sample)
    branch: int = 0  # Sample.branch: advantages count a trajectory's branches once

    @property
    def total_length(self) -> int:
        return self.prompt_length + self.response_length

    def effective_loss_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * self.response_length

    def __getattr__(self, name: str):
        if name in _HELD_ELSEWHERE:
            raise HeldElsewhereError(f"a sample of group {self.group_index} is held by data-parallel rank "
                                     f"{self.owner}: its {name} never reached this rank (each rank receives the "
                                     "samples it trains on; plan with TrainBackend.plan_rollout)")
        raise AttributeError(name)


#: One entry of a training rank's rollout batch: ``Sample`` where its data-parallel rank trains on it,
#: ``SampleStub`` elsewhere (``backends.rollout_shards``). Lengths, reward, group and loss mask read alike.
AnySample = Union[Sample, SampleStub]
