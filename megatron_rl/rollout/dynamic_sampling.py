"""Dynamic sampling (DAPO): generate until the batch holds ``--rollout-batch-size`` groups the filter keeps.

A GRPO group whose rewards are all equal has zero advantage everywhere: it costs a training
step's compute and moves nothing, and as the policy improves more and more groups are all
correct. DAPO drops such groups and samples more prompts until the batch is full, so every
step trains on groups that carry a signal.

One rollout, as slime's ``generate_rollout_async`` does it, in rounds:

1. draw prompts from the run's prompt stream, ``--over-sampling-batch-size`` at a time, as many
   draws as it takes to cover the groups still missing (``ceil(missing / N)``);
2. generate and score them (``RolloutManager._run``: aborted groups generated again, rewards);
3. judge each group in draw order with ``--dynamic-sampling-filter-path``; a kept group joins the
   batch until it is full; kept groups beyond it are dropped and counted (``excess``, as slime
   drops them: keeping them for the next rollout would put samples of older weights into it and
   make the rollout's content depend on the one before);
4. repeat until the batch is full, at most ``--dynamic-sampling-max-rounds`` rounds; then stop
   naming the flags and the filter's reasons (a batch that cannot fill means the task is all
   solved or all failed by the current policy: more rounds only burn generation).

Exact resume: everything drawn is consumed. The prompt stream's position after the rollout is
past every prompt of every round, excess and filtered ones included, and that position is what
``RolloutManager.state_dict`` and the checkpoint record, so a resumed run draws what an
uninterrupted one would. Round ``r`` samples with ``seed + r * ROUND_SEED_STRIDE``, so every
round is reproducible from the rollout id alone.

Filters have slime's signature ``fn(args, samples, **kwargs)`` (``args``: the run's ``Config``;
``samples``: one group, rewards set) and return a bool or a ``DynamicFilterOutput`` (``keep``,
``reason`` counted in ``rollout/dynamic_filter/drop_<reason>``, ``keep_when_insufficient``: keep
the group when dropping it would leave too few to fill the batch without another round). slime's
paths of its two built-ins name the ones here (``SLIME_FILTERS``), so a slime script runs
unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter
from typing import Any, Callable, Optional

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams, describe_prompt
from megatron_rl.errors import ConfigError
from megatron_rl.infra.user_function import call_user_function, check_arity, load_user_function
from megatron_rl.rollout.generate_fn import group_slices

__all__ = ["DynamicFilterOutput", "DynamicSampler", "StreamFilter", "SLIME_FILTERS", "check_reward_nonzero_std",
           "check_reward_nonzero_std_with_fallback", "load_filter"]

ROUND_SEED_STRIDE = 7_919_993  # round r's sampling seed offset; apart from the abort retries' 1_000_003 steps
ZERO_STD = 1e-6  # slime's threshold: a group whose rewards' std is at most this carries no GRPO signal


@dataclasses.dataclass
class DynamicFilterOutput:
    """A filter's verdict on one group (slime's ``filter_hub.base_types.DynamicFilterOutput``)."""

    keep: bool
    reason: Optional[str] = None  # why dropped: counted in rollout/dynamic_filter/drop_<reason>
    keep_when_insufficient: bool = False  # keep it anyway when dropping it would need another round


def _std(values: list[float]) -> float:
    """The sample standard deviation (torch.std's, as slime computes it); NaN for one value."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (std > 1e-6); drop one where every sample scored the same."""
    rewards = [float(s.reward) for s in samples]
    keep = _std(rewards) > ZERO_STD  # NaN (a group of one) is never kept: it has no GRPO signal either
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """``check_reward_nonzero_std``, but a constant group is kept when the round could not fill the batch
    without it: prefers groups with a signal, never costs another round."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output


_HERE = "megatron_rl.rollout.dynamic_sampling"
#: slime's dotted paths of its built-in filters -> the same filters here
SLIME_FILTERS = {f"slime.rollout.filter_hub.dynamic_sampling_filters.{name}": f"{_HERE}:{name}"
                 for name in ("check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback")}


def load_filter(path: str) -> Callable[..., Any]:
    """The filter ``--dynamic-sampling-filter-path`` names: ``module:fn``, ``file.py:fn``, slime's dotted
    ``module.fn``, or slime's path of a built-in (``SLIME_FILTERS``), checked to take ``(args, samples)``."""
    fn = load_user_function(SLIME_FILTERS.get(path, path), "--dynamic-sampling-filter-path",
                            example="my_filters:keep_group", dotted=True)
    check_arity(fn, 2, "--dynamic-sampling-filter-path", path, "fn(args, samples)")
    return fn


def _verdict(output: Any, path: str, group: list[Sample]) -> DynamicFilterOutput:
    """A filter's return value as a ``DynamicFilterOutput``: slime's legacy bool, its output object (any
    object with ``keep``), or a 0-d tensor / numpy bool (what ``std() > eps`` gives)."""
    if isinstance(output, DynamicFilterOutput):
        verdict = output
    elif hasattr(output, "keep"):
        verdict = DynamicFilterOutput(keep=output.keep, reason=getattr(output, "reason", None),
                                      keep_when_insufficient=bool(getattr(output, "keep_when_insufficient", False)))
    else:
        verdict = DynamicFilterOutput(keep=output)
    keep = verdict.keep
    if hasattr(keep, "item") and getattr(keep, "ndim", 0) == 0:
        keep = keep.item()
    if not isinstance(keep, (bool, int)) or isinstance(keep, int) and keep not in (0, 1):
        prompt = (describe_prompt(group[0].metadata) if group else "") or "of unknown place"
        raise ConfigError(f"--dynamic-sampling-filter-path {path} returned {_short_repr(output)} for the group of "
                          f"prompt ({prompt}); a filter returns True (keep the group), False (drop it) or a "
                          "DynamicFilterOutput(keep=..., reason=...)")
    return dataclasses.replace(verdict, keep=bool(keep))


def _short_repr(value: Any, limit: int = 200) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclasses.dataclass
class DynamicSampler:
    """Fills one rollout batch with groups the filter keeps (module docstring)."""

    filter_fn: Callable[..., Any]
    filter_path: str
    over_sampling_batch_size: int
    max_rounds: int
    timeout_s: float = 3600.0  # --user-function-timeout: one verdict at most

    def judge(self, args: Any, group: list[Sample]) -> DynamicFilterOutput:
        """The filter's verdict on ``group``, the call bounded by --user-function-timeout."""
        output = call_user_function(self.filter_fn, args, group, timeout_s=self.timeout_s,
                                    where=f"--dynamic-sampling-filter-path {self.filter_path}")
        return _verdict(output, self.filter_path, group)

    @classmethod
    def from_config(cls, cfg) -> Optional["DynamicSampler"]:
        """The run's sampler, or None without ``--dynamic-sampling-filter-path`` (plain rollouts)."""
        r = cfg.rollout
        if not r.dynamic_sampling_filter_path:
            return None
        return cls(load_filter(r.dynamic_sampling_filter_path), r.dynamic_sampling_filter_path,
                   r.over_sampling_batch_size or cfg.batching.rollout_batch_size, r.dynamic_sampling_max_rounds,
                   r.user_function_timeout)

    def fill(self, draw: Callable[[int], list[GenerateRequest]],
             run: Callable[[list[GenerateRequest], SamplingParams], list[Sample]], sampling: SamplingParams,
             batch_size: int, args: Any = None) -> tuple[list[Sample], dict[str, float]]:
        """``batch_size`` kept groups (request-major, ``group_index`` 0..batch_size-1) and the metrics.

        ``draw(k)``: the next ``k`` prompts of the run's stream; ``run(requests, sampling)``: their
        rewarded samples, ``sampling.n`` per request in request order; ``args``: what filters get
        as their first argument (the run's ``Config``)."""
        n, size = sampling.n, self.over_sampling_batch_size
        kept: list[list[Sample]] = []
        generated: list[Sample] = []
        reasons: Counter[str] = Counter()
        filtered = excess = rounds = drawn = 0
        while len(kept) < batch_size:
            if rounds == self.max_rounds:
                raise ConfigError(self._unfilled(len(kept), batch_size, rounds, drawn, filtered,
                                                 reasons))
            draws = math.ceil((batch_size - len(kept)) / size)
            requests = [r for _ in range(draws) for r in draw(size)]
            requests = [dataclasses.replace(r, group_index=i) for i, r in enumerate(requests)]
            seed = None if sampling.seed is None else sampling.seed + ROUND_SEED_STRIDE * rounds
            samples = run(requests, dataclasses.replace(sampling, seed=seed))
            try:  # n samples per prompt (more where an agent session split into branches)
                slices = group_slices(samples, len(requests), n)
            except ConfigError as exc:
                raise ConfigError(f"dynamic sampling: generating {len(requests)} prompt group(s) of {n}: {exc}") from None
            rounds += 1
            drawn += len(requests)
            generated += samples
            groups = [samples[sl] for sl in slices]
            for g, group in enumerate(groups):
                verdict = self.judge(args, group)
                undecided = len(kept) + len(groups) - g  # slime's remaining_batch_size: kept + not yet judged
                if not verdict.keep and not (verdict.keep_when_insufficient and undecided <= batch_size):
                    filtered += 1
                    if verdict.reason:
                        reasons[verdict.reason] += 1
                elif len(kept) < batch_size:
                    kept.append(group)
                else:
                    excess += 1
        batch = []
        for index, group in enumerate(kept):  # GRPO groups by group_index: renumbered within the batch
            for s in group:
                s.group_index = index
                batch.append(s)
        total = drawn
        metrics = {"rollout/dynamic_sampling_rounds": float(rounds), "rollout/generated_groups": float(total),
                   "rollout/filtered_groups": float(filtered), "rollout/filtered_groups_frac": filtered / total,
                   "rollout/excess_groups": float(excess),
                   "rollout/generation_cost_ratio": total / batch_size,
                   "rollout/generated_reward_mean": sum(s.reward for s in generated) / len(generated)}
        metrics.update({f"rollout/dynamic_filter/drop_{reason}": float(count) for reason, count in reasons.items()})
        return batch, metrics

    def _unfilled(self, kept: int, batch_size: int, rounds: int, generated: int, filtered: int,
                  reasons: Counter) -> str:
        why = ", ".join(f"{reason}: {count}" for reason, count in reasons.most_common(4)) or "no reasons given"
        return (f"dynamic sampling kept {kept} of the {batch_size} prompt groups a batch needs "
                f"(--rollout-batch-size) after {rounds} round(s) (--dynamic-sampling-max-rounds {self.max_rounds}) "
                f"of --over-sampling-batch-size {self.over_sampling_batch_size} prompts: "
                f"--dynamic-sampling-filter-path {self.filter_path} dropped {filtered} of {generated} generated "
                f"groups ({why}). Groups that all score the same mean the prompts are all solved or all failed by "
                "the current policy: check the reward function and the data's difficulty, or raise "
                "--dynamic-sampling-max-rounds / --over-sampling-batch-size")


class StreamFilter:
    """``--dynamic-sampling-filter-path`` under ``--async-mode full``: each group is judged as it finishes.

    The producer generates prompt groups continuously for the buffer, not a rollout in rounds; a
    group the filter drops never enters the buffer, so its place under the staleness bound goes to
    the next prompt, and a step's batch is ``--rollout-batch-size`` kept groups as in turn. There are
    no rounds: ``keep_when_insufficient`` has nothing to weigh and the verdict's ``keep`` decides. The
    bound that ends a run whose groups are all dropped is the in-turn one's total,
    ``--dynamic-sampling-max-rounds`` x max(``--rollout-batch-size``, ``--over-sampling-batch-size``)
    groups dropped in a row. Workers call ``keep`` from their threads (a lock orders the counts).
    """

    def __init__(self, sampler: DynamicSampler, args: Any, batch_size: int):
        self.sampler, self.args, self.batch_size = sampler, args, batch_size
        self.limit = sampler.max_rounds * max(batch_size, sampler.over_sampling_batch_size)
        self._lock = threading.Lock()
        self._in_a_row = 0
        self._reset()

    def _reset(self) -> None:
        self.generated = self.filtered = 0
        self.reasons: Counter[str] = Counter()
        self.reward_sum, self.reward_count = 0.0, 0

    def keep(self, group: list[Sample]) -> bool:
        """Whether the finished, rewarded ``group`` goes to the buffer (``judge`` then ``record``)."""
        return self.record(self.judge(group), group)

    def judge(self, group: list[Sample]) -> DynamicFilterOutput:
        """The filter's verdict on ``group`` (the user's function, bounded; counts nothing)."""
        return self.sampler.judge(self.args, group)

    def state(self) -> dict:
        """The counts a checkpoint keeps (the buffer file): the drops in a row and the step's metrics so far, so
        a resumed run stops after the same drops and its next step reports what the uninterrupted one would."""
        with self._lock:
            return {"in_a_row": self._in_a_row, "generated": self.generated, "filtered": self.filtered,
                    "reasons": dict(self.reasons), "reward_sum": self.reward_sum, "reward_count": self.reward_count}

    def restore(self, state: dict) -> None:
        with self._lock:
            self._in_a_row, self.generated, self.filtered = (int(state["in_a_row"]), int(state["generated"]),
                                                              int(state["filtered"]))
            self.reasons = Counter({str(k): int(v) for k, v in state["reasons"].items()})
            self.reward_sum, self.reward_count = float(state["reward_sum"]), int(state["reward_count"])

    def record(self, verdict: DynamicFilterOutput, group: list[Sample]) -> bool:
        """Count ``verdict`` on the finished, rewarded ``group`` and say whether it goes to the buffer; raises once
        ``limit`` groups in a row were dropped (naming the flags, as the in-turn sampler does after its last
        round). The producer records under its own lock, with the group leaving its in-flight set, so a snapshot
        never counts a group it also lists to be generated again."""
        with self._lock:
            self.generated += 1
            self.reward_sum += sum(s.reward for s in group)
            self.reward_count += len(group)
            if verdict.keep:
                self._in_a_row = 0
                return True
            self.filtered += 1
            self._in_a_row += 1
            if verdict.reason:
                self.reasons[verdict.reason] += 1
            if self._in_a_row >= self.limit:
                why = ", ".join(f"{r}: {c}" for r, c in self.reasons.most_common(4)) or "no reasons given"
                raise ConfigError(
                    f"dynamic sampling under --async-mode full: --dynamic-sampling-filter-path "
                    f"{self.sampler.filter_path} dropped {self._in_a_row} finished prompt groups in a row "
                    f"(--dynamic-sampling-max-rounds {self.sampler.max_rounds} x max(--rollout-batch-size "
                    f"{self.batch_size}, --over-sampling-batch-size {self.sampler.over_sampling_batch_size})) "
                    f"({why}). Groups that all score the same mean the prompts are all solved or all failed by "
                    "the current policy: check the reward function and the data's difficulty, or raise "
                    "--dynamic-sampling-max-rounds")
            return False

    def metrics(self, kept_groups: int) -> dict[str, float]:
        """The in-turn sampler's metrics for the groups judged since the last call (the step's share of the
        stream: they finished while this step waited or trained); the counts start again."""
        with self._lock:
            total = self.generated
            out = {"rollout/generated_groups": float(total), "rollout/filtered_groups": float(self.filtered),
                   "rollout/filtered_groups_frac": self.filtered / total if total else 0.0,
                   "rollout/generation_cost_ratio": total / kept_groups if kept_groups else 0.0}
            if self.reward_count:
                out["rollout/generated_reward_mean"] = self.reward_sum / self.reward_count
            out.update({f"rollout/dynamic_filter/drop_{r}": float(c) for r, c in self.reasons.items()})
            self._reset()
            return out
