"""verl's reward-function contract: ``--custom-reward-function-path file.py:compute_score``.

verl (``custom_reward_function.path`` / ``.name``, default name ``compute_score``) calls a user's scorer once per
sample, by keyword::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)

``solution_str`` is the response decoded without special tokens (``sample.response_text``), ``ground_truth`` the
sample's label (a verl parquet file's ``reward_model.ground_truth``), ``data_source`` and ``extra_info`` the
prompt's metadata (a parquet row's columns; a JSONL prompt gives them through ``--metadata-key``; absent: None and
``{}``), and ``reward_kwargs`` verl's ``custom_reward_function.reward_kwargs`` (``--custom-reward-function-kwargs``,
a JSON object, winning over the four as verl's merge does). The function may be ``async def``: the batch's
coroutines then run together on one event loop.

Only the keywords the function's signature accepts are passed (all of them with ``**kwargs``). So verl's own
per-dataset scorers, ``compute_score(solution_str, ground_truth, ...)`` in ``verl/utils/reward_score/*.py``, run
unchanged too, called as verl's ``default_compute_score`` calls them. A parameter without a default that none of
the keywords fills, or a positional-only one, is refused when the function is loaded (the driver's pre-flight).

A result is a number (a bool counts as 0 / 1) or verl's dict: its ``score`` is the reward and every other numeric
(or bool) value a per-sample metric, logged as ``reward/<key>`` (the batch mean, ``rewards.reward_metrics``);
non-numeric values (verl's ``math_dapo`` returns its parsed ``pred`` text) are not metrics and are dropped. A batch
is one call into user code bounded by ``--user-function-timeout`` (``infra.user_function.call_user_function``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from typing import Any, Callable, Mapping, Optional

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.infra.user_function import call_user_function, load_user_function

FLAG = "--custom-reward-function-path"
KWARGS_FLAG = "--custom-reward-function-kwargs"
DEFAULT_NAME = "compute_score"  # verl's custom_reward_function.name default
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
SCORE_KEY = "score"  # the key of verl's dict result that is the reward


def with_default_name(path: str) -> str:
    """``file.py`` alone names its ``compute_score`` (verl's default name); other forms are returned unchanged."""
    return f"{path}:{DEFAULT_NAME}" if str(path).endswith(".py") else path


def parse_reward_kwargs(text: Optional[str]) -> dict:
    """``--custom-reward-function-kwargs``: a JSON object (verl's reward_kwargs); "" or None is none."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{KWARGS_FLAG} {text!r}: not JSON ({exc.msg}); give a JSON object, e.g. "
                          "'{\"method\": \"flexible\"}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{KWARGS_FLAG} {text!r}: a {type(value).__name__}; give a JSON object of keyword "
                          "arguments, e.g. '{\"method\": \"flexible\"}'")
    return value


def accepted_keywords(fn: Callable, offered: tuple[str, ...], where: str) -> Optional[frozenset[str]]:
    """The keywords of ``offered`` that ``fn`` takes (None: all, it has ``**kwargs``); ``ConfigError`` naming
    ``where`` for a parameter that no keyword fills and that has no default."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin without a signature: pass everything, as verl does
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{where}: parameter {p.name!r} is positional-only; verl calls a reward function "
                              f"by keyword ({', '.join(VERL_KEYWORDS)}): make it a normal parameter")
        if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                and p.name not in offered):
            raise ConfigError(f"{where}: parameter {p.name!r} has no default and verl's call does not give it "
                              f"(it gives {', '.join(offered)}); give it a default or pass it in {KWARGS_FLAG}")
    if takes_all:
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) & set(offered)


class VerlReward:
    """A verl ``compute_score`` in this engine's batched reward form (``rewards.RewardFn``): one bounded call per
    batch, one verl-keyword call per sample inside it."""

    batched = True

    def __init__(self, fn: Callable, path: str, reward_kwargs: dict, timeout_s: float):
        self.fn, self.path, self.reward_kwargs, self.timeout_s = fn, path, dict(reward_kwargs), timeout_s
        offered = tuple(dict.fromkeys((*VERL_KEYWORDS, *self.reward_kwargs)))
        self.keywords = accepted_keywords(fn, offered, f"{FLAG} {path}")

    def _kwargs(self, sample: Sample) -> dict:
        if sample.response_text is None:
            raise ConfigError(f"{FLAG} {self.path} needs the decoded response (solution_str) but the sample has "
                              "none; give the rollout engine a tokenizer (an --hf-checkpoint with tokenizer files)")
        extra = sample.metadata.get("extra_info")
        given = {"data_source": sample.metadata.get("data_source"), "solution_str": sample.response_text,
                 "ground_truth": sample.label, "extra_info": dict(extra) if isinstance(extra, Mapping) else {},
                 **self.reward_kwargs}  # verl's merge: reward_kwargs win
        return given if self.keywords is None else {k: v for k, v in given.items() if k in self.keywords}

    def _score_batch(self, samples: list[Sample]) -> Any:
        results = [self.fn(**self._kwargs(s)) for s in samples]
        pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if not pending:
            return results

        async def gathered() -> list:  # an async compute_score: the batch's calls run together on one loop
            done = await asyncio.gather(*(results[i] for i in pending))
            for i, value in zip(pending, done):
                results[i] = value
            return results

        return gathered()

    def __call__(self, samples: list[Sample]) -> list[Any]:
        results = call_user_function(self._score_batch, samples, where=f"{FLAG} {self.path}",
                                     timeout_s=self.timeout_s, owner=self.fn)
        return [self._as_reward(r, i) for i, r in enumerate(results)]

    def _as_reward(self, result: Any, i: int) -> Any:
        """verl's result -> this engine's: a number, or ``{"reward": score, <numeric metric>: value}``."""
        if isinstance(result, bool):
            return float(result)
        if not isinstance(result, Mapping):
            return result  # a number, checked (finite, not text) by rewards.compute_rewards
        if SCORE_KEY not in result:
            raise ConfigError(f"{FLAG} {self.path} returned a dict without {SCORE_KEY!r} for sample {i} (keys: "
                              f"{', '.join(map(str, result)) or 'none'}); verl's dict result is {{'score': number, "
                              "<metric>: value, ...}}")
        if "reward" in result:
            raise ConfigError(f"{FLAG} {self.path} returned a dict with a 'reward' key for sample {i}; the reward is "
                              f"its {SCORE_KEY!r} here and metrics are logged as reward/<key>, so 'reward' would "
                              "shadow it: rename the key")
        metrics = {str(k): float(v) for k, v in result.items() if k != SCORE_KEY and _is_metric(v)}
        score = result[SCORE_KEY]
        return {"reward": float(score) if isinstance(score, bool) else score, **metrics}

    def __repr__(self) -> str:
        return f"VerlReward({self.path!r})"


def _is_metric(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    return isinstance(value, (int, float)) and math.isfinite(value)


def load_verl_reward(path: str, reward_kwargs: Optional[dict] = None, timeout_s: float = 3600.0) -> VerlReward:
    """Import ``file.py[:name]`` (or ``module:name``; ``name`` defaults to ``compute_score``) and check that verl's
    keyword call fits its signature; the reward in batched form, each batch bounded by ``timeout_s``."""
    full = with_default_name(path)
    fn = load_user_function(full, FLAG, example="my_reward.py:compute_score")
    return VerlReward(fn, full, reward_kwargs or {}, timeout_s)


def verl_reward_from_config(cfg: Any) -> Optional[VerlReward]:
    """The run's ``--custom-reward-function-path`` reward, or None when the flag is not given."""
    d = cfg.data
    if not d.custom_reward_function_path:
        return None
    return load_verl_reward(d.custom_reward_function_path, parse_reward_kwargs(d.custom_reward_function_kwargs),
                            cfg.rollout.user_function_timeout)


__all__ = ["DEFAULT_NAME", "FLAG", "KWARGS_FLAG", "VerlReward", "load_verl_reward", "parse_reward_kwargs",
           "verl_reward_from_config", "with_default_name"]
