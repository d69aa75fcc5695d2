"""backends/roles.py ``needs_own_model`` (the rules: config/role_models.py): a frozen role of the policy's shapes is a
weight tag, one of other shapes a model of its own, one whose vocabulary lacks some of the policy's ids refused by
flag. Decided from the
``config.json`` files alone, so these write only those."""

import json

import pytest

from megatron_rl.backends.roles import needs_own_model, shape_differences
from megatron_rl.config.role_models import own_model_dir
from megatron_rl.errors import ConfigError

pytestmark = pytest.mark.unit

POLICY = dict(model_type="qwen2", vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _config_dir(path, **changes):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**POLICY, **changes}))
    return str(path)


def test_same_shapes_are_a_weight_tag(tmp_path):
    policy = _config_dir(tmp_path / "policy")
    other = _config_dir(tmp_path / "other", rope_theta=1e6, rms_norm_eps=1e-5)  # not shapes: a tag holds it
    assert shape_differences(policy, other) == []
    assert needs_own_model(policy, other, "--opd-teacher-load") is False


def test_a_larger_teacher_needs_its_own_model(tmp_path):
    policy = _config_dir(tmp_path / "policy")
    big = _config_dir(tmp_path / "big", hidden_size=128, num_hidden_layers=5)
    assert shape_differences(policy, big) == ["hidden_size: 64 vs 128", "num_hidden_layers: 4 vs 5"]
    assert needs_own_model(policy, big, "--opd-teacher-load") is True
    assert own_model_dir(policy, big) == big and own_model_dir(policy, policy) is None
    # a torch_dist model dir carries its HF config in hf_config/
    dist_dir = tmp_path / "big_dist"
    _config_dir(dist_dir / "hf_config", num_attention_heads=8)
    assert needs_own_model(policy, str(dist_dir), "--opd-teacher-load") is True


def test_a_vocabulary_without_the_policys_ids_is_refused_by_flag(tmp_path):
    policy = _config_dir(tmp_path / "policy")
    fewer = _config_dir(tmp_path / "fewer", vocab_size=200, hidden_size=128)
    with pytest.raises(ConfigError) as err:
        needs_own_model(policy, fewer, "--opd-teacher-load")
    assert str(err.value).startswith(f"--opd-teacher-load {fewer}: its vocabulary has 200 entries, fewer than the "
                                     "policy's 250")
    with pytest.raises(ConfigError, match="^--ref-load "):
        needs_own_model(policy, _config_dir(tmp_path / "ref", vocab_size=249), "--ref-load")
    # a larger model's embedding padded further (Qwen2.5-7B's 152064 rows over 0.5B's 151936) holds every id
    assert needs_own_model(policy, _config_dir(tmp_path / "padded", vocab_size=300, hidden_size=128),
                           "--opd-teacher-load") is True


def test_a_checkpoint_root_or_no_policy_config_is_the_policy_itself(tmp_path):
    """A training checkpoint root holds no config.json (the actor's own shapes by definition), and without
    --hf-checkpoint nothing is compared: both a weight tag."""
    policy = _config_dir(tmp_path / "policy")
    (tmp_path / "root").mkdir()
    assert needs_own_model(policy, str(tmp_path / "root"), "--ref-load") is False
    assert needs_own_model(None, _config_dir(tmp_path / "big", hidden_size=128), "--opd-teacher-load") is False
