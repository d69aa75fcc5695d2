"""verl's rule rewards here give verl's scores (rollout/verl_scores.py): a corpus of answers with the scores verl's own
functions gave.

The expected values were recorded once by running verl's ``verl/utils/reward_score/gsm8k.py`` (``compute_score`` with
method strict and flexible), ``math_reward.py`` and ``math_dapo.py`` from volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7 (pure Python: no verl import needed) on these inputs; no verl code is
vendored. ``--rm-type math`` (this engine's own, numeric rule) is shown to differ where it means to.
"""
import pytest

from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.rewards import BUILTIN_REWARDS, get_reward_fn
from megatron_rl.rollout.verl_scores import gsm8k_score, math_dapo_score, verl_math_score

# (response, ground truth, verl strict score, verl flexible score)
GSM8K = [
    ('Natalia sold 48 + 24 = 72 clips. #### 72', '72', 1.0, 1.0),
    ('The total is #### 1,000', '1000', 1.0, 0.0),
    ('#### $18', '18', 0.0, 1.0),
    ('#### -5', '-5', 1.0, 1.0),
    ('#### 72.0', '72', 0.0, 0.0),
    ('The answer is 72', '72', 0.0, 1.0),
    ('####72', '72', 0.0, 1.0),
    ('#### 10 then #### 12', '12', 1.0, 1.0),
    ('#### 10 then #### 12', '10', 0.0, 0.0),
    ('', '3', 0.0, 0.0),
    ('\\boxed{72}', '72', 0.0, 1.0),
    ('x' * 400 + '#### 5', '5', 1.0, 1.0),
    ('#### 5 ' + 'y' * 400, '5', 0.0, 0.0),
    ('It costs 3.50 dollars.', '3.50', 0.0, 1.0),
    ('It costs 3.50.', '3.50', 0.0, 0.0),
    ('4 2 5 2', '2', 0.0, 1.0),
]

# (response, ground truth, verl math_reward score)
MATH = [
    ('so the answer is \\boxed{\\frac{1}{2}}', '\\frac{1}{2}', 1.0),
    ('\\boxed{0.5}', '\\frac{1}{2}', 1.0),
    ('\\boxed{1/2}', '\\frac12', 1.0),
    ('\\boxed{\\dfrac{3}{4}}', '\\frac{3}{4}', 1.0),
    ('\\boxed{x = 3}', '3', 1.0),
    ('\\boxed{10\\%}', '10', 1.0),
    ('\\boxed{1,000}', '1000', 0.0),
    ('\\boxed{90^\\circ}', '90', 1.0),
    ('\\boxed 5$', '5', 1.0),
    ('\\fbox{5}', '5', 0.0),
    ('no box, 42', '42', 0.0),
    ('\\boxed{\\sqrt3}', '\\sqrt{3}', 1.0),
    ('\\boxed{\\left( 1, 2 \\right)}', '(1,2)', 1.0),
    ('\\boxed{5 \\text{ cm}}', '5', 1.0),
    ('\\boxed{.5}', '0.5', 1.0),
    ('\\boxed{7}', '8', 0.0),
    ('\\boxed{2} and later \\boxed{3}', '3', 1.0),
    ('\\boxed{\\frac{1}{2}', '\\frac{1}{2}', 0.0),
    ('\\boxed{\\sqrt}', '\\sqrt', 1.0),
    ('\\boxed{5}', 5, 0.0),
]

# (response, ground truth, verl math_dapo result)
DAPO = [
    ('Reasoning...\nAnswer: 42', '42', {'score': 1.0, 'acc': True, 'pred': '42'}),
    ('answer : \\boxed{42}', '42', {'score': 1.0, 'acc': True, 'pred': '42'}),
    ('Answer: $\\frac{1}{2}$', '\\frac12', {'score': 1.0, 'acc': True, 'pred': '\\frac{1}{2}'}),
    ('Answer: 1,000 dollars', '1000', {'score': 1.0, 'acc': True, 'pred': '1000'}),
    ('Answer: 7', '8', {'score': -1.0, 'acc': False, 'pred': '7'}),
    ('The result is 42.', '42', {'score': -1.0, 'acc': False, 'pred': '[INVALID]'}),
    ('Answer: x = 3', '3', {'score': 1.0, 'acc': True, 'pred': '3'}),
    ('Answer: 5 \\text{ cm}', '5', {'score': 1.0, 'acc': True, 'pred': '5'}),
    ('Answer: 3\nAnswer: 4', '4', {'score': 1.0, 'acc': True, 'pred': '4'}),
    ('z' * 400 + 'Answer: 9', '9', {'score': 1.0, 'acc': True, 'pred': '9'}),
    ('Answer: 9' + 'z' * 400, '9', {'score': -1.0, 'acc': False, 'pred': '[INVALID]'}),
]


def _sample(response, label, data_source=None):
    return Sample(group_index=0, prompt_ids=[1], response_ids=[2], response_text=response, label=label,
                  metadata={"data_source": data_source} if data_source else {})


@pytest.mark.parametrize("response, truth, strict, flexible", GSM8K)
def test_gsm8k_scores_as_verl(response, truth, strict, flexible):
    assert gsm8k_score(response, truth) == strict
    assert gsm8k_score(response, truth, method="flexible") == flexible
    assert get_reward_fn("gsm8k")([_sample(response, truth)]) == [strict]


@pytest.mark.parametrize("response, truth, score", MATH)
def test_verl_math_scores_as_verl(response, truth, score):
    assert verl_math_score(response, truth) == score
    assert get_reward_fn("verl_math")([_sample(response, truth)]) == [score]


@pytest.mark.parametrize("response, truth, result", DAPO)
def test_math_dapo_scores_as_verl(response, truth, result):
    assert math_dapo_score(response, truth) == result
    assert get_reward_fn("math_dapo")([_sample(response, truth)]) == [{"reward": result["score"],
                                                                       "acc": float(result["acc"])}]


def test_verl_picks_the_rule_by_data_source_and_refuses_an_unknown_one():
    fn = get_reward_fn("verl")
    samples = [_sample("#### 72", "72", "openai/gsm8k"), _sample("\\boxed{0.5}", "\\frac{1}{2}", "lighteval/MATH"),
               _sample("Answer: 7", "8", "aime2024")]
    assert fn(samples) == [1.0, 1.0, {"reward": -1.0, "acc": 0.0}]
    with pytest.raises(ConfigError, match=r"^--rm-type verl: data_source 'codecontests' has no rule built here"):
        fn([_sample("x", "y", "codecontests")])


def test_our_own_math_rule_differs_from_verls_where_it_compares_numbers():
    """``--rm-type math`` is this engine's lenient rule; ``verl_math`` is verl's string rule."""
    assert BUILTIN_REWARDS["math"](_sample("\\boxed{1,000}", "1000")) == 1.0
    assert verl_math_score("\\boxed{1,000}", "1000") == 0.0


def test_math_dapo_refuses_a_ground_truth_that_is_not_text():
    with pytest.raises(ConfigError, match=r"reward 'math_dapo' needs a text ground truth; the sample's is int 42"):
        get_reward_fn("math_dapo")([_sample("Answer: 42", 42)])
