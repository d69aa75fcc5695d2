"""The rollout sample: the one record that flows from engine to reward to trainer.

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
from typing import Any


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
    weight_version: int = 0  # engine weight version that produced the response
    label: Any = None  # ground truth for the reward function
    prompt_text: str | None = None
    response_text: str | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def effective_loss_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)
