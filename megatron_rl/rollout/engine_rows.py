"""The embedded engine's rows: what a generate call is given per row and what it gives back.

Their own module because both the engine (``rollout.embedded``) and its speculative path
(``rollout.speculative``, which the engine calls) build them; neither imports the other for them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rl.data.images import VisionInputs
from megatron_rl.data.types import RoutedExperts


@dataclass
class EngineRow:
    """One row for ``EmbeddedEngine.generate_rows``: a prompt with its own generator seed and token budget."""

    prompt_ids: list[int]
    seed: int  # its generator's seed (``row_seed`` of a call's seed and the row's indices)
    max_new_tokens: int
    key: Any = None  # rows with one key share one prefill of their (equal) prompt; None: the row's own
    cancel: Optional[threading.Event] = None  # set by another thread: the row ends "abort" after its current step
    images: Optional[VisionInputs] = None  # the prompt's images (a vision-language model's), None: text only


@dataclass
class RowOutput:
    """What one row generated: tokens, their log-probs, why it ended, and each token's weight version."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    versions: list[int] = field(default_factory=list)
    routes: Optional[RoutedExperts] = None  # with ``record_routes``: the experts of its tokens (module docstring)
    # with a speculative draft: (drafts proposed, drafts accepted) at each draft depth (rollout/speculative.py)
    spec: Optional[tuple[list[int], list[int]]] = None


__all__ = ["EngineRow", "RowOutput"]
