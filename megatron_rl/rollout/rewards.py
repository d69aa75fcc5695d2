"""Reward functions: built-in verifiable rewards (``--rm-type``) and user ones (``--custom-rm-path``).

Every reward is used through one batched form, ``RewardFn = (samples) -> list[float | dict]``,
so the RL loop calls one thing. A user function may be per-sample
``(sample) -> float`` or batched ``(samples) -> list[float]``; it is taken as
batched when it carries ``batched = True`` (see ``batched_reward``) or its first
parameter is named ``samples``. The third source, ``--rm-url``, is a reward server
(``remote_reward.RemoteReward``); ``reward_fn_from_config`` picks one of the three.

A reward may be a dict instead of a float: ``{"reward": 0.5, "format_ok": 1.0, ...}``. Its
``reward`` (or the key ``--reward-key`` names; ``--eval-reward-key`` for evaluation) is what trains; every other key is a numeric metric of that sample, kept in
``sample.metadata["reward_metrics"]`` and logged as ``reward/<key>``, the mean over the samples
of the batch that report it (``reward_metrics``). Why a dict and not a second function: the
quantities a reward computes on its way (a format check, a length penalty, a judge's sub-score)
are what a user wants to watch, and only the reward function has them.

Built-ins read ``sample.response_text`` (decoded by the engine's tokenizer) and
``sample.label``:

* ``exact_match``: 1.0 when the response equals the label after case folding,
  whitespace collapsing and dropping a trailing period;
* ``deepscaler``: slime's rule: the boxed answer after the last ``</think>``, graded as ``math``;
* ``f1``: slime's word-overlap F1 of the response and the label (SQuAD's answer F1);
* ``boxed_exact_match``, ``boxed_f1``: slime's ``boxed_`` prefix: the rule on the last ``\\boxed{}``'s contents;
* ``math``: extracts the final answer (last ``\\boxed{...}``, else the text after
  the last ``####``, else the last number) from the response (and from the label
  when it has such a marker), compares numerically (integers, decimals, ``1,000``,
  ``a/b``, ``\\frac{a}{b}``, a trailing ``%``) with relative tolerance 1e-6, and
  falls back to comparing normalised strings (e.g. ``x+1``);
* ``code``: the response's last code block run against the label's tests in the local sandbox
  (``code_reward``: ``{"reward": fraction passed, "all_passed": 0 or 1}``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from megatron_rl.data.types import Sample, describe_prompt
from megatron_rl.errors import ConfigError
from megatron_rl.infra.user_function import call_user_function, check_arity, load_user_function
from megatron_rl.rollout.code_reward import code_reward, code_reward_from_config
from megatron_rl.rollout.generate_fn import load_function
from megatron_rl.rollout.remote_reward import RemoteReward
from megatron_rl.rollout.slime_compat.contract import SlimeReward, check_slime_function, is_slime_function
from megatron_rl.rollout.slime_compat.finder import load_needing_slime
from megatron_rl.rollout.verl_reward import verl_reward_from_config
from megatron_rl.rollout.verl_scores import VERL_RULES

RewardFn = Callable[[list[Sample]], list[Any]]  # one float, or {"reward": float, other metrics}, per sample
REWARD_KEY = "reward"  # the key of a dict reward that trains; the others are metrics (module docstring)
METRICS_KEY = "reward_metrics"  # where a sample's extra reward metrics are kept, in sample.metadata


def batched_reward(fn: Callable[[list[Sample]], list[float]]) -> Callable[[list[Sample]], list[float]]:
    """Mark a user reward function as batched: ``(samples) -> list[float]``."""
    setattr(fn, "batched", True)  # a marker on the user's function, read by getattr(fn, "batched", False)
    return fn


# ----------------------------------------------------------------- built-ins
def _response_text(sample: Sample, reward: str) -> str:
    if sample.response_text is None:
        raise ConfigError(f"reward {reward!r} needs sample.response_text but it is None; give the rollout engine "
                          "a tokenizer (an --hf-checkpoint directory with tokenizer files)")
    return sample.response_text


def _label(sample: Sample, reward: str) -> Any:
    if sample.label is None:
        raise ConfigError(f"reward {reward!r} needs a label but sample (group_index {sample.group_index}) has none; "
                          "set --label-key to the JSON key holding the ground truth")
    return sample.label


def normalize_text(text: str) -> str:
    """Case-folded, whitespace-collapsed, without a trailing period."""
    return " ".join(str(text).split()).casefold().rstrip(".").strip()


def exact_match(sample: Sample) -> float:
    return float(normalize_text(_response_text(sample, "exact_match")) == normalize_text(_label(sample, "exact_match")))


_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_LAST_NUMBER = re.compile(rf"{_NUMBER}(?:\s*/\s*{_NUMBER})?")


def _boxed_contents(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or of ``\\boxed x``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        match = re.match(r"\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    depth = 0
    for i, ch in enumerate(stripped):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return stripped[1:i]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: last boxed, else after the last ``####``, else the last number."""
    boxed = _boxed_contents(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0].strip() if tail else None
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _normalize_math(text: str) -> str:
    s = str(text).strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("$", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", "%")):
        s = s.replace(old, new)
    return s.replace(" ", "").rstrip(".")


def parse_number(text: str) -> float | None:
    """A number from an answer string, or None when it is not a plain number or fraction."""
    s = _normalize_math(text).rstrip("%")
    frac = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or not den:
            return None
        return (-1 if frac.group(1) else 1) * num / den
    if "/" in s:
        parts = s.split("/")
        if len(parts) == 2:
            num, den = parse_number(parts[0]), parse_number(parts[1])
            return num / den if num is not None and den else None
        return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", s):
        return float(s)
    return None


def math_equal(prediction: str | None, reference: Any) -> bool:
    if prediction is None:
        return False
    reference = str(reference)
    if "\\boxed" in reference or "\\fbox" in reference or "####" in reference:
        reference = extract_answer(reference) or reference
    pred_value, ref_value = parse_number(prediction), parse_number(reference)
    if pred_value is not None and ref_value is not None:
        return math.isclose(pred_value, ref_value, rel_tol=1e-6, abs_tol=1e-9)
    return _normalize_math(prediction) == _normalize_math(reference)


def math_reward(sample: Sample) -> float:
    return float(math_equal(extract_answer(_response_text(sample, "math")), _label(sample, "math")))


def deepscaler_reward(sample: Sample) -> float:
    """slime's ``deepscaler`` rule (its rm_hub): the solution is the text after the last ``</think>``
    (else after the first ``###Response``; neither: 0), its answer the last ``\\boxed{}`` (none: 0),
    graded against the label (its boxed part when it has one) with ``math_equal``. slime grades
    with mathd + sympy equivalence; this is the numeric / normalised-string subset of that."""
    text = _response_text(sample, "deepscaler")
    label = _label(sample, "deepscaler")
    if "</think>" in text:
        solution = text.split("</think>")[-1]
    elif "###Response" in text:
        solution = text.split("###Response")[1]
    else:
        return 0.0
    answer = _boxed_contents(solution)
    if answer is None or str(label) == "":
        return 0.0
    return float(math_equal(answer.strip(), label))


def _squad_words(text: str) -> list[str]:
    """The words of ``text`` as SQuAD's answer F1 compares them: lower case, no punctuation, no articles."""
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_reward(sample: Sample) -> float:
    """slime's ``f1``: the word-overlap F1 of the response and the label (SQuAD's answer F1); a yes / no /
    noanswer answer on either side scores 0 unless both are the same."""
    pred, gold = _squad_words(_response_text(sample, "f1")), _squad_words(_label(sample, "f1"))
    closed = ("yes", "no", "noanswer")
    if (" ".join(pred) in closed or " ".join(gold) in closed) and pred != gold:
        return 0.0
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def boxed(rule: Callable[[Sample], float], name: str) -> Callable[[Sample], float]:
    """slime's ``boxed_<rule>``: ``rule`` on the contents of the response's last ``\\boxed{}`` ("" without one)."""
    def reward(sample: Sample) -> float:
        inner = _boxed_contents(_response_text(sample, name))
        return rule(dataclasses.replace(sample, response_text=(inner or "").strip()))

    reward.__name__ = name
    return reward


# --rm-type -> reward; the names are also config.schema.BUILTIN_REWARD_NAMES (the flag's choices; a test keeps
# the two equal), so an unknown name is refused while parsing flags, before any worker starts
BUILTIN_REWARDS: dict[str, Callable[[Sample], Any]] = {"exact_match": exact_match, "math": math_reward,
                                                       "deepscaler": deepscaler_reward, "f1": f1_reward,
                                                       "boxed_exact_match": boxed(exact_match, "boxed_exact_match"),
                                                       "boxed_f1": boxed(f1_reward, "boxed_f1"), "code": code_reward,
                                                       **VERL_RULES}  # verl's rules: rollout/verl_scores.py
# built-ins the run builds from its flags (their limits), in batched form: --rm-type name -> (cfg) -> RewardFn
CONFIGURED_REWARDS: dict[str, Callable[[Any], RewardFn]] = {"code": code_reward_from_config}


# ---------------------------------------------------------------- selection
def _is_batched(fn: Callable) -> bool:
    if getattr(fn, "batched", False):
        return True
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "samples"


def _as_batched(fn: Callable, batched: bool) -> RewardFn:
    if batched:
        return fn
    return lambda samples: [fn(s) for s in samples]


class BoundedReward:
    """A ``--custom-rm-path`` function in batched form, each batch's call bounded by --user-function-timeout
    (``infra.user_function.call_user_function``: a hang or an exception is one error line naming the flag and
    the function's line)."""

    batched = True

    def __init__(self, fn: Callable, path: str, timeout_s: float):
        self.fn, self.path, self.timeout_s = fn, path, timeout_s
        self._batched = _as_batched(fn, _is_batched(fn))

    def __call__(self, samples: list[Sample]) -> list[Any]:
        def scored(batch: list[Sample]) -> Any:  # a returned generator runs here too, under the deadline
            out = self._batched(batch)
            return out if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Iterable) else list(out)

        rewards = call_user_function(scored, samples, where=f"--custom-rm-path {self.path}",
                                     timeout_s=self.timeout_s, owner=self.fn)
        if not isinstance(rewards, list):
            raise ConfigError(f"--custom-rm-path {self.path} returned {type(rewards).__name__} for a batch of "
                              f"{len(samples)} samples; a batched reward returns a list of one reward per sample")
        return rewards

    def __repr__(self) -> str:
        return f"BoundedReward({self.path!r})"


def load_custom_reward(custom_rm_path: str, timeout_s: float = 3600.0, cfg: Any = None) -> RewardFn:
    """Import ``module:function`` (or ``path/to/file.py:function``) and return it in batched form, bounded by
    ``timeout_s`` (--user-function-timeout) per call. slime's ``reward_func(args, sample, **kwargs)`` (``args``
    first) is called as slime calls it, with the run's ``args`` (``cfg``)."""
    fn = load_needing_slime(lambda: load_user_function(custom_rm_path, "--custom-rm-path", example="my_rewards:score",
                                                       dotted=True))
    if is_slime_function(fn):
        check_slime_function(fn, "--custom-rm-path", custom_rm_path)
        return SlimeReward(fn, custom_rm_path, cfg, timeout_s)
    check_arity(fn, 1, "--custom-rm-path", custom_rm_path, "fn(sample) or a batched fn(samples)")
    return BoundedReward(fn, custom_rm_path, timeout_s)


def get_reward_fn(rm_type: str | None = None, custom_rm_path: str | None = None,
                  timeout_s: float = 3600.0, cfg: Any = None) -> RewardFn:
    """The reward selected by ``--rm-type`` or ``--custom-rm-path`` (exactly one), in batched form; a custom one's
    calls bounded by ``timeout_s`` (--user-function-timeout)."""
    if rm_type and custom_rm_path:
        raise ConfigError("--rm-type and --custom-rm-path are mutually exclusive; pick one reward")
    if custom_rm_path:
        return load_custom_reward(custom_rm_path, timeout_s, cfg)
    if not rm_type:
        raise ConfigError(f"no reward function: pass --rm-type ({', '.join(BUILTIN_REWARDS)}), "
                          "--custom-rm-path module:function or --rm-url URL (a reward server)")
    if rm_type not in BUILTIN_REWARDS:
        raise ConfigError(f"--rm-type {rm_type} is not a built-in reward; choose one of "
                          f"{', '.join(BUILTIN_REWARDS)} or pass --custom-rm-path module:function")
    return _as_batched(BUILTIN_REWARDS[rm_type], batched=False)


def reward_fn_from_config(cfg) -> RewardFn:
    """The run's reward: a reward server (``--rm-url``), else ``--rm-type`` / ``--custom-rm-path``.

    The three are exclusive (validation refuses two at once; this says it again for a caller that
    built its config by hand), so a run's rewards never come from a silently chosen one. With
    ``--agent-function-path``, the reward an agent returned comes first (``AgentReward``)."""
    agent = getattr(getattr(cfg, "rollout", None), "agent_function_path", None)
    if agent:
        d = cfg.data
        given = any((d.rm_url, d.rm_type, d.custom_rm_path, getattr(d, "custom_reward_function_path", None),
                     getattr(d, "reward_model_path", None)))
        return AgentReward(f"--agent-function-path {agent}", _configured_reward(cfg) if given else None)
    return _configured_reward(cfg)


def trajectory_last(samples: list[Sample]) -> list[int]:
    """For each sample, the index of its trajectory's last branch (``Sample.branch``: a trajectory's branches are
    consecutive, numbered 0, 1, ...; a sample of its own is its own last branch)."""
    last = list(range(len(samples)))
    for i in range(len(samples) - 2, -1, -1):
        if samples[i + 1].branch == samples[i].branch + 1 and samples[i + 1].branch > 0:
            last[i] = last[i + 1]
    return last


class AgentReward:
    """The reward each ``--agent-function-path`` agent returned (``metadata["agent_reward"]``); a sample whose
    agent returned None is scored by the run's reward flag, and refused naming the agent when none is given."""

    batched = True

    def __init__(self, where: str, fallback: Optional[RewardFn]):
        self.where, self.fallback = where, fallback

    def __call__(self, samples: list[Sample]) -> list[Any]:
        out: list[Any] = [s.metadata.get("agent_reward") for s in samples]
        rest = [i for i, r in enumerate(out) if r is None]
        if rest and self.fallback is None:
            raise ConfigError(f"no reward for sample {rest[0]}: {self.where} returned None and no reward flag is "
                              f"given; return the reward from the agent, or pass --rm-type "
                              f"({', '.join(BUILTIN_REWARDS)}), --custom-rm-path module:function or --rm-url URL")
        if rest:
            assert self.fallback is not None
            # a session split into branches is scored once, on its last branch (the session's final state); its
            # other branches get that reward (trajectory_last)
            last = trajectory_last(samples)
            scored = sorted({last[i] for i in rest})
            by_last = dict(zip(scored, self.fallback([samples[i] for i in scored])))
            for i in rest:
                out[i] = by_last[last[i]]
        return out

    def __repr__(self) -> str:
        return f"AgentReward({self.where!r}, {self.fallback!r})"


def _configured_reward(cfg) -> RewardFn:
    d = cfg.data
    verl_fn = getattr(d, "custom_reward_function_path", None)
    given = [f for f, v in (("--rm-url", d.rm_url), ("--rm-type", d.rm_type), ("--custom-rm-path", d.custom_rm_path),
                            ("--custom-reward-function-path", verl_fn)) if v]
    if d.rm_url:
        if len(given) > 1:
            raise ConfigError(f"--rm-url {d.rm_url} scores every sample on the reward server, so "
                              f"{' and '.join(given[1:])} would be ignored: drop one of them")
        return RemoteReward.from_config(cfg)
    if verl_fn:
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)} each name the reward; pick one")
        verl_reward = verl_reward_from_config(cfg)
        assert verl_reward is not None
        return verl_reward
    if d.reward_model_path and not (d.rm_type or d.custom_rm_path):
        return _scored_by_the_reward_model  # the RM role on the trainer's ranks sets every reward (runner/step.py)
    if d.rm_type in CONFIGURED_REWARDS and not d.custom_rm_path:
        return CONFIGURED_REWARDS[d.rm_type](cfg)
    function = _slime_function_flag(cfg)
    if function and not (d.rm_type or d.custom_rm_path):
        return SetByFunction(function)  # slime's functions may fill sample.reward themselves (its tau-bench does)
    return get_reward_fn(rm_type=d.rm_type, custom_rm_path=d.custom_rm_path,
                         timeout_s=cfg.rollout.user_function_timeout, cfg=cfg)


def _slime_function_flag(cfg) -> str:
    """``--custom-generate-function-path P`` / ``--rollout-function-path P`` when one is given and names a slime
    function (``slime_compat``; a native one sets no reward of its own), else ""."""
    r = getattr(cfg, "rollout", None)
    for flag, value in (("--custom-generate-function-path", getattr(r, "custom_generate_function_path", None)),
                        ("--rollout-function-path", getattr(r, "rollout_function_path", None))):
        if value and is_slime_function(load_function(value, flag)):
            return f"{flag} {value}"
    return ""


class SetByFunction:
    """No reward flag, and a rollout function: the reward each sample's slime function set (``sample.reward``,
    kept as ``metadata["slime_reward"]``; slime skips its reward model for such a sample). A sample without one
    is refused naming the function and the flags that would score it."""

    batched = True

    def __init__(self, where: str):
        self.where = where

    def __call__(self, samples: list[Sample]) -> list[Any]:
        missing = [i for i, s in enumerate(samples) if s.metadata.get("slime_reward") is None]
        if missing:
            raise ConfigError(f"no reward for sample {missing[0]}: {self.where} did not set sample.reward and no "
                              f"reward flag is given; pass --rm-type ({', '.join(BUILTIN_REWARDS)}), "
                              "--custom-rm-path module:function or --rm-url URL")
        return [s.metadata["slime_reward"] for s in samples]

    def __repr__(self) -> str:
        return f"SetByFunction({self.where!r})"


def _scored_by_the_reward_model(samples: list[Sample]) -> list[float]:
    """No rule reward: 0.0 until the reward model on the trainer's ranks scores the batch (``--reward-model-path``
    alone)."""
    return [0.0] * len(samples)


def reward_source(cfg) -> str:
    """How errors name the run's reward: ``--rm-url URL``, ``--custom-rm-path P`` or ``--rm-type T``."""
    d = cfg.data
    if d.rm_url:
        return f"--rm-url {d.rm_url}"
    if getattr(d, "custom_reward_function_path", None):
        return f"--custom-reward-function-path {d.custom_reward_function_path}"
    if d.reward_model_path and not (d.rm_type or d.custom_rm_path):
        return f"--reward-model-path {d.reward_model_path}"
    if not (d.rm_type or d.custom_rm_path) and _slime_function_flag(cfg):
        return f"the reward {_slime_function_flag(cfg)} set"
    return f"--custom-rm-path {d.custom_rm_path}" if d.custom_rm_path else f"--rm-type {d.rm_type}"


def _number(value: Any, source: str, what: str) -> float:
    if isinstance(value, (str, bytes)) or value is None:  # float("1.5") parses; a reward is a number, not text
        raise ConfigError(f"{source} returned {value!r} for {what}; rewards and reward metrics must be numbers")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source} returned {value!r} for {what}; rewards and reward metrics must be "
                          "numbers") from None
    if not math.isfinite(number):
        raise ConfigError(f"{source} returned {number} for {what}; rewards must be finite")
    return number


def _sample_name(sample: Sample, i: int, prompts: str = "") -> str:
    """How a reward error names a sample: its place in the batch and its prompt's (``prompt_index``, the line of
    ``prompts``, the prompt file's flag and path) when the sample carries them."""
    where = describe_prompt(sample.metadata)
    if where and prompts and "line" in sample.metadata:
        where += f" of {prompts}"
    return f"sample {i} ({where})" if where else f"sample {i}"


def _split_reward(r: Any, i: str, source: str, reward_key: str | None = None,
                  key_flag: str = "--reward-key") -> tuple[float, dict[str, float]]:
    """A float reward as is; a dict reward as its ``reward`` (or ``reward_key``'s: slime's --reward-key) and its
    other keys (the sample's metrics)."""
    key_name = reward_key or REWARD_KEY
    if not isinstance(r, Mapping):
        if reward_key is not None:
            raise ConfigError(f"{source} returned {r!r} for {i}, but {key_flag} {reward_key} picks the reward "
                              "out of a dict: return {"
                              f"{reward_key!r}: number, ...}} or drop {key_flag}")
        return _number(r, source, i), {}
    if key_name not in r:
        fix = (f"{key_flag} {reward_key} names the key that trains" if reward_key is not None else
               f"a dict reward is {{{REWARD_KEY!r}: number, other numeric metrics logged as reward/<key>}}, "
               "or give --reward-key KEY")
        raise ConfigError(f"{source} returned a dict without a {key_name!r} key for {i} (keys: "
                          f"{', '.join(map(str, r)) or 'none'}); {fix}")
    metrics = {}
    for key, value in r.items():
        if key == key_name:
            continue
        if not isinstance(key, str) or not key:
            raise ConfigError(f"{source} returned metric key {key!r} for {i}; metric keys are non-empty "
                              "strings (logged as reward/<key>)")
        metrics[key] = _number(value, source, f"metric {key!r} of {i}")
    return _number(r[key_name], source, i), metrics


@dataclass(frozen=True)
class RewardShaping:
    """What happens to a training reward after the reward function: DAPO's overlong penalty, then a clip.

    Overlong (``--overlong-buffer-len N``, ``--overlong-penalty-factor F``; verl's
    ``reward_model.overlong_buffer``, DAPO eq. 13): a response of ``L`` tokens longer than
    ``max - N`` (``max`` = ``--rollout-max-response-len``) gets ``-(L - (max - N)) / N * F`` added:
    0 up to ``max - N``, falling linearly to ``-F`` at ``max``. ``L`` counts every response token
    (tool output of a multi-turn sample included: it takes room under the same bound). Then
    ``--reward-clip-range LOW HIGH`` (OpenRLHF's ``--reward_clip_range``) clips. Evaluation rewards
    are never shaped: they measure the task. Per-sample metrics ``overlong_penalty`` and
    ``reward_clipped`` go beside the reward function's own (logged ``reward/<key>``)."""

    max_response_len: int
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    clip_range: Optional[tuple[float, float]] = None

    @classmethod
    def from_config(cls, cfg) -> Optional["RewardShaping"]:
        d = cfg.data
        if not d.overlong_buffer_len and not d.reward_clip_range:
            return None
        clip = tuple(float(v) for v in d.reward_clip_range) if d.reward_clip_range else None
        return cls(cfg.rollout.rollout_max_response_len, int(d.overlong_buffer_len),
                   float(d.overlong_penalty_factor), clip)  # type: ignore[arg-type]  # two floats, validated

    def apply(self, reward: float, response_length: int) -> tuple[float, dict[str, float]]:
        """The shaped reward of one sample and its shaping metrics."""
        metrics: dict[str, float] = {}
        if self.overlong_buffer_len:
            exceed = response_length - (self.max_response_len - self.overlong_buffer_len)
            penalty = min(-exceed / self.overlong_buffer_len * self.overlong_penalty_factor, 0.0)
            reward += penalty
            metrics["overlong_penalty"] = penalty
        if self.clip_range is not None:
            low, high = self.clip_range
            clipped = min(max(reward, low), high)
            metrics["reward_clipped"] = float(clipped != reward)
            reward = clipped
        return reward, metrics


def compute_rewards(samples: list[Sample], reward_fn: RewardFn, source: str = "reward function",
                    reward_key: str | None = None, key_flag: str = "--reward-key",
                    shaping: Optional[RewardShaping] = None, prompts: str = "") -> list[float]:
    """Score ``samples`` with ``reward_fn``, check the result and store it in ``sample.reward``.

    Each result is a number or a dict reward (module docstring): its ``reward`` goes to
    ``sample.reward``, its other keys to ``sample.metadata["reward_metrics"]`` (a sample scored again
    loses the metrics of its previous score). ``reward_key`` (slime's ``--reward-key`` /
    ``--eval-reward-key``, named in errors by ``key_flag``) is the dict key that trains instead of
    ``reward``. ``shaping`` (training rollouts only) then adjusts each reward (``RewardShaping``).
    Nothing is stored unless every result is valid, so a refused batch leaves no half-scored
    samples behind. An error names the sample by its prompt (``prompt_index``, the line of ``prompts``: the
    prompt file's flag and path)."""
    rewards = list(reward_fn(samples))
    if len(rewards) != len(samples):
        raise ConfigError(f"{source} returned {len(rewards)} rewards for {len(samples)} samples; a batched reward "
                          "must return one float per sample, in order")
    scored = [_split_reward(r, _sample_name(samples[i], i, prompts), source, reward_key, key_flag)
              for i, r in enumerate(rewards)]
    if shaping is not None:
        for i, (sample, (value, metrics)) in enumerate(zip(samples, scored)):
            value, extra = shaping.apply(value, sample.response_length)
            scored[i] = value, {**metrics, **extra}
    last = trajectory_last(samples)  # a trajectory's branches share its reward: its last branch's, shaping included
    scored = [scored[j] for j in last]
    for sample, (value, metrics) in zip(samples, scored):
        sample.reward = value
        if metrics:
            sample.metadata[METRICS_KEY] = metrics
        else:
            sample.metadata.pop(METRICS_KEY, None)
    return [value for value, _ in scored]


def reward_metrics(samples: list[Sample]) -> dict[str, float]:
    """``reward/<key>``: the mean of each dict-reward metric over the samples that report it."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for sample in samples:
        for key, value in (sample.metadata.get(METRICS_KEY) or {}).items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {f"reward/{key}": sums[key] / counts[key] for key in sorted(sums)}
