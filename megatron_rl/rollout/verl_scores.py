"""verl's rule rewards, scored as verl scores them: ``--rm-type gsm8k``, ``verl_math``, ``math_dapo`` and ``verl``.

A verl user's rewards come from ``verl.utils.reward_score.default_compute_score``, which picks a rule by the
sample's ``data_source``. These are this engine's implementations of the pure-Python rules among them, written to
give verl's scores exactly (tests/rollout/test_verl_scores.py holds a corpus of answers with the scores verl's own
functions gave, recorded from its repository); their quirks are verl's and are kept on purpose:

* ``gsm8k`` (verl's ``gsm8k.py``): of the response's last 300 characters, the last ``#### <number>`` (strict; the
  flexible method takes the last number) with ``,`` and ``$`` removed, compared as text with the ground truth:
  1.0 equal, 0.0 otherwise;
* ``verl_math`` (verl's ``math_reward.py``, the Hendrycks MATH rule): the last ``\\boxed{...}`` (or ``\\boxed x``,
  ``\\fbox{...}``), both sides normalised (fractions, ``\\left``/``\\right``, units, ``0.5`` -> ``\\frac{1}{2}``, ...)
  and compared as text;
* ``math_dapo`` (verl's ``math_dapo.py``): the last ``Answer: ...`` line of the response's last 300 characters,
  Minerva-normalised and compared as text; 1.0 or -1.0, with the metric ``acc``;
* ``verl``: one of the three by ``data_source`` (``sample.metadata``, from a verl parquet file's column), as
  ``default_compute_score`` dispatches; another source is refused naming it.

``--rm-type math`` is this engine's own rule (rewards.py) and differs from ``verl_math`` on purpose (it compares
numbers: ``1,000`` equals ``1000``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError

_CLIP = 300  # verl scores the last 300 characters of a response (gsm8k, math_dapo)


def _text(sample: Sample, reward: str) -> str:
    if sample.response_text is None:
        raise ConfigError(f"reward {reward!r} needs sample.response_text but it is None; give the rollout engine a "
                          "tokenizer (an --hf-checkpoint directory with tokenizer files)")
    return sample.response_text


def _truth(sample: Sample, reward: str) -> Any:
    if sample.label is None:
        raise ConfigError(f"reward {reward!r} needs a ground truth but the sample has none; a verl parquet file's "
                          "reward_model.ground_truth (or --label-key for JSONL) gives it")
    return sample.label


# ------------------------------------------------------------------ gsm8k
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"(-?[0-9.,]+)")


def gsm8k_answer(text: str, method: str = "strict") -> Optional[str]:
    """The answer verl's gsm8k rule reads from ``text`` (None: none)."""
    text = text[-_CLIP:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = [n for n in _ANY_NUMBER.findall(text) if n not in ("", ".")]
    return found[-1] if found else None


def gsm8k_score(text: str, ground_truth: Any, method: str = "strict") -> float:
    answer = gsm8k_answer(text, method)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


def gsm8k_reward(sample: Sample) -> float:
    return gsm8k_score(_text(sample, "gsm8k"), _truth(sample, "gsm8k"))


# ------------------------------------------------------------------ Hendrycks MATH (verl_math)
def last_boxed(text: str, plain_space_form: bool = True) -> Optional[str]:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` with its braces balanced, or (``plain_space_form``) the
    ``\\boxed x`` form up to a ``$``; None when there is none or its braces never close."""
    if plain_space_form and "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def _unbox(boxed: str) -> str:
    """The inside of ``\\boxed{...}`` / ``\\boxed x``; ValueError for another shape (``\\fbox{}``: verl fails there too,
    scoring 0)."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(boxed)
        return boxed[len("\\boxed "):]
    if not boxed.startswith("\\boxed{") or not boxed.endswith("}"):
        raise ValueError(boxed)
    return boxed[len("\\boxed{"):-1]


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a ``\\frac`` with fewer than two characters
    after it leaves the whole string as it was."""
    head, *parts = s.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part.startswith("{"):
            out += part
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _slash_fraction(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(a) + "}{" + str(b) + "}" if s == f"{a}/{b}" else s


def _braced_sqrt(s: str) -> str:
    if "\\sqrt" not in s:
        return s
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (part if part.startswith("{") else "{" + part[0] + "}" + part[1:])
                          for part in parts)


def hendrycks_normalize(s: str) -> str:
    """The MATH answer normalisation verl's math_reward applies to both sides; raises where verl's does (an answer
    with two ``\\text{ `` units, a ``\\sqrt`` at the very end), which makes the comparison plain string equality."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError(s)
        s = pieces[0]
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 3" -> "3"
        s = sides[1]
    s = _braced_sqrt(s)
    s = s.replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s)


def math_equivalent(answer: Optional[str], truth: Optional[str]) -> bool:
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return hendrycks_normalize(answer) == hendrycks_normalize(truth)
    except Exception:  # noqa: BLE001 - verl's rule: a normalisation that fails compares the raw strings
        return answer == truth


def verl_math_score(text: str, ground_truth: Any) -> float:
    try:
        boxed = last_boxed(text)
        if boxed is None:
            return 0.0
        return 1.0 if math_equivalent(_unbox(boxed), ground_truth) else 0.0
    except Exception:  # noqa: BLE001 - verl scores a response its rule cannot parse 0
        return 0.0


def verl_math_reward(sample: Sample) -> float:
    return verl_math_score(_text(sample, "verl_math"), _truth(sample, "verl_math"))


# ------------------------------------------------------------------ math_dapo (Minerva)
_DAPO_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                       (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
                 r",\!", "{,}", '"', "\\dots")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def minerva_normalize(answer: str) -> str:
    answer = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _DAPO_REMOVED:
        answer = answer.replace(word, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def math_dapo_score(text: str, ground_truth: Any) -> dict:
    found = _ANSWER_LINE.findall(text[-_CLIP:])
    prediction = minerva_normalize(found[-1] if found else "[INVALID]")
    correct = prediction == minerva_normalize(ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": prediction}


def math_dapo_reward(sample: Sample) -> dict:
    truth = _truth(sample, "math_dapo")
    if not isinstance(truth, str):  # verl's rule normalises it as text and fails on anything else
        raise ConfigError(f"reward 'math_dapo' needs a text ground truth; the sample's is {type(truth).__name__} "
                          f"{truth!r}: store reward_model.ground_truth as a string")
    result = math_dapo_score(_text(sample, "math_dapo"), truth)
    return {"reward": result["score"], "acc": float(result["acc"])}


# ------------------------------------------------------------------ by data_source (default_compute_score)
_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")


def rule_for(data_source: Any) -> Optional[str]:
    """The built-in rule verl's ``default_compute_score`` applies to ``data_source`` (None: not one built here)."""
    if data_source == "openai/gsm8k":
        return "gsm8k"
    if data_source in _MATH_SOURCES:
        return "verl_math"
    if data_source in _DAPO_SOURCES or (isinstance(data_source, str) and data_source.startswith("aime")):
        return "math_dapo"
    return None


def verl_default_reward(sample: Sample) -> Any:
    source = sample.metadata.get("data_source")
    rule = rule_for(source)
    if rule is None:
        raise ConfigError(f"--rm-type verl: data_source {source!r} has no rule built here (openai/gsm8k, "
                          f"{', '.join(_MATH_SOURCES)}, {', '.join(_DAPO_SOURCES)}, aime*); score it with "
                          "--custom-reward-function-path (verl's compute_score contract)")
    return VERL_RULES[rule](sample)


VERL_RULES: dict[str, Any] = {"gsm8k": gsm8k_reward, "verl_math": verl_math_reward, "math_dapo": math_dapo_reward,
                              "verl": verl_default_reward}

__all__ = ["VERL_RULES", "gsm8k_score", "math_dapo_score", "rule_for", "verl_math_score"]
