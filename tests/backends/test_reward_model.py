"""The reward-model role in one process (backends/reward_model.py, runner/step.py ``apply_reward_model``): HF's own
scores, the policy's ids or the RM's own tokenization of the text, the reward it makes with or without a rule
reward, and what validation refuses by name (config/validate.py ``_check_reward_model``)."""

import json

import pytest

from megatron_rl.backends.reward_model import RewardModel, score_batch
from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors
from megatron_rl.data.types import Sample
from megatron_rl.models.hf_tiny import build_tiny_reward_model
from megatron_rl.runner.step import apply_reward_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model("qwen2", tmp_path_factory.mktemp("rm") / "rm", seed=4)


def _samples(n=5):
    return [Sample(group_index=i // 2, prompt_ids=[3 + i, 7, 9], response_ids=[11 + i] * (1 + i % 3),
                   reward=0.5 * i, prompt_text=f"p{i}:", response_text="x" * (1 + i)) for i in range(n)]


def _hf(rm, ids_list):
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in ids_list]


def test_scores_equal_hf_and_make_the_reward(tiny_hf_models, rm_dir):
    policy = tiny_hf_models("qwen2")
    samples = _samples()
    want = _hf(rm_dir, [s.prompt_ids + s.response_ids for s in samples])
    alone = RewardModel(parse_config(["--hf-checkpoint", policy, "--reward-model-path", rm_dir,
                                      "--reward-model-micro-batch-size", "2", "--reward-model-weight", "2.0"]))
    assert alone.tokenizer is None and not alone.has_rule
    got = score_batch(alone, samples)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    metrics: dict = {}
    apply_reward_model(alone, samples, metrics)
    assert [s.reward for s in samples] == pytest.approx([2.0 * w for w in want], abs=1e-5)  # the score alone
    assert metrics["rollout/reward_mean"] == pytest.approx(2.0 * sum(want) / len(want), abs=1e-5)
    assert metrics["reward/rm_score"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    assert "reward/rule" not in metrics and metrics["perf/reward_model_s"] >= 0
    with_rule = RewardModel(parse_config(["--hf-checkpoint", policy, "--reward-model-path", rm_dir,
                                          "--rm-type", "exact_match"]))
    samples = _samples()
    apply_reward_model(with_rule, samples, metrics)
    assert [s.reward for s in samples] == pytest.approx([0.5 * i + w for i, w in enumerate(want)], abs=1e-5)
    assert metrics["reward/rule"] == pytest.approx(0.5 * sum(range(5)) / 5)


def test_an_rm_of_another_tokenizer_reads_the_text(tmp_path, rm_dir):
    """The policy's char tokenizer and an RM whose tokenizer maps the characters to other ids: the RM reads
    ``prompt_text + response_text`` through its own; with the policy's tokenizer it reads the ids."""
    import shutil

    from _tokenizer import build_char_tokenizer

    policy = tmp_path / "policy"
    build_char_tokenizer(policy)
    same = tmp_path / "same_rm"
    shutil.copytree(rm_dir, same)
    build_char_tokenizer(same)
    cfg = parse_config(["--hf-checkpoint", str(policy), "--reward-model-path", str(same)], validate=False)
    assert RewardModel(cfg).tokenizer is None  # the policy's tokenizer: its ids
    other = tmp_path / "other_rm"
    shutil.copytree(rm_dir, other)
    tok = json.loads((policy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tok["model"]["vocab"] = {t: (i + 40) % len(vocab) if i >= 6 else i for t, i in vocab.items()}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (policy / name).exists():
            shutil.copy(policy / name, other / name)
    rm = RewardModel(parse_config(["--hf-checkpoint", str(policy), "--reward-model-path", str(other)],
                                  validate=False))
    assert rm.tokenizer is not None
    s = _samples(1)[0]
    ids = rm.encode(s)
    assert ids == rm.tokenizer("p0:x", add_special_tokens=False)["input_ids"] and ids != s.prompt_ids + s.response_ids
    assert score_batch(rm, [s]) == pytest.approx(_hf(str(other), [ids]), abs=1e-5)


def errors(*argv):
    return collect_errors(parse_config(list(argv), validate=False))


def test_validation_refuses_by_name(tiny_hf_models, rm_dir, tmp_path):
    policy = tiny_hf_models("qwen2")
    base = ["--hf-checkpoint", policy, "--reward-model-path", rm_dir]
    assert errors(*base) == []
    assert any("--reward-model-path" in e and "not a *ForSequenceClassification" in e
               for e in errors("--hf-checkpoint", policy, "--reward-model-path", policy))
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "num_labels": 2}))
    assert any("its head has 2 labels" in e for e in errors("--hf-checkpoint", policy, "--reward-model-path",
                                                            str(two)))
    assert any("--reward-model-weight tune --reward-model-path's model" in e
               for e in errors("--hf-checkpoint", policy, "--reward-model-weight", "2"))
    assert any(e.startswith("--advantage-estimator remax with --reward-model-path")
               for e in errors(*base, "--advantage-estimator", "remax"))
    assert any(e.startswith("--dynamic-sampling-filter-path with --reward-model-path")
               for e in errors(*base, "--dynamic-sampling-filter-path", "m:f"))
    assert any(e.startswith("--eval-prompt-data with --reward-model-path") for e in errors(
        *base, "--eval-prompt-data", str(tmp_path / "eval.jsonl")))
    assert not any("--reward-model-path" in e for e in errors(*base, "--rm-type", "exact_match",
                                                             "--eval-prompt-data", str(tmp_path / "eval.jsonl")))
