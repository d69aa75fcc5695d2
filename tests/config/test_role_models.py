"""Models by role (config/role_models.py, backends/roles.py): a frozen role of the actor's shapes is a weight tag, one
of other shapes a model of its own; each model of its own, and a critic of another size, is checked against the
layout it gets and the student's vocabulary before any worker starts, naming the flag and the fix."""

from megatron_rl.backends.roles import role_specs
from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors

BIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=5)  # twice the hidden size, one more layer
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)


def errors(*argv):
    return collect_errors(parse_config(list(argv), validate=False))


def test_roles_of_a_run(tiny_hf_models):
    actor, big = tiny_hf_models("qwen2"), tiny_hf_models("qwen2", **BIG)
    cfg = parse_config(["--hf-checkpoint", actor, "--advantage-estimator", "ppo", "--opd-teacher-load", big,
                        "--opd-kl-coef", "0.5", "--use-kl-loss"])
    roles = role_specs(cfg)
    assert list(roles) == ["actor", "critic", "ref", "teacher"]
    assert [r.trainable for r in roles.values()] == [True, True, False, False]
    assert roles["critic"].head == "value" and roles["teacher"].source == big and roles["ref"].source is None


def test_models_of_their_own_are_checked_against_their_layout(tiny_hf_models):
    actor, big, small = tiny_hf_models("qwen2"), tiny_hf_models("qwen2", **BIG), tiny_hf_models("qwen2", **SMALL)
    ppo = ["--hf-checkpoint", actor, "--actor-num-gpus-per-node", "4", "--advantage-estimator", "ppo"]
    assert not errors(*ppo, "--critic-hf-checkpoint", small)
    got = errors(*ppo, "--critic-hf-checkpoint", small, "--critic-tensor-model-parallel-size", "2")
    assert any("--critic-hf-checkpoint" in e and "num_key_value_heads=1 does not split over TP 2" in e for e in got)
    got = errors(*ppo, "--critic-hf-checkpoint", small, "--critic-pipeline-model-parallel-size", "4")
    assert any("its 2 layers do not split into 4 pipeline stages" in e for e in got)
    teacher = ["--opd-teacher-load", big, "--opd-kl-coef", "0.5"]
    assert not errors("--hf-checkpoint", actor, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size",
                      "2", *teacher)
    got = errors("--hf-checkpoint", actor, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
                 *teacher)
    assert any("--opd-teacher-load" in e and "its 5 layers do not split into 2 pipeline stages" in e for e in got)
    got = errors(*ppo, "--critic-hf-checkpoint", tiny_hf_models("qwen2", vocab_size=200))
    assert any("--critic-hf-checkpoint" in e and "200 entries, fewer than" in e for e in got)
