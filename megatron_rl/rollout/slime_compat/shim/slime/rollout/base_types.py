"""slime's rollout function outputs."""

from dataclasses import dataclass
from typing import Any


@dataclass
class RolloutFnTrainOutput:
    samples: list
    metrics: Any = None


@dataclass
class RolloutFnEvalOutput:
    data: dict
    metrics: Any = None


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs):
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output
