"""``--opd-teacher-load``'s validation (config/validate.py): a teacher of the policy's shapes or a larger one loads
into either backend; on fsdp only HF directories (a torch_dist teacher is refused naming the conversion); a teacher
whose vocabulary lacks some of the student's ids is refused by flag before any worker starts; with ``--lora-rank``
only a teacher of its own model (other shapes) is built, a same-shape one stays refused."""

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def models(tiny_hf_models):
    student = tiny_hf_models("qwen2")
    return {"student": student, "same": tiny_hf_models("qwen2", seed=12),
            "big": tiny_hf_models("qwen2", hidden_size=128, num_hidden_layers=5, seed=11),
            "vocab": tiny_hf_models("qwen2", vocab_size=200, hidden_size=128),
            "padded": tiny_hf_models("qwen2", vocab_size=300, hidden_size=128)}


def errors(models, teacher, *extra):
    return collect_errors(parse_config(["--hf-checkpoint", models["student"], "--opd-teacher-load", teacher,
                                        "--opd-kl-coef", "0.5", *extra], validate=False))


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_same_shape_and_larger_hf_teachers_are_accepted(models, backend):
    assert errors(models, models["same"], "--train-backend", backend) == []
    assert errors(models, models["big"], "--train-backend", backend) == []


def test_torch_dist_teacher_on_fsdp_is_refused_with_the_conversion(models, tmp_path):
    dist_dir = tmp_path / "teacher_dist"
    (dist_dir / "hf_config").mkdir(parents=True)
    found = errors(models, str(dist_dir), "--train-backend", "fsdp")
    assert any(e.startswith(f"--opd-teacher-load {dist_dir} with --train-backend fsdp: only HF model directories")
               and "tools/convert_ckpt.py dist-to-hf" in e for e in found), found
    assert not any("--opd-teacher-load" in e for e in errors(models, str(dist_dir), "--train-backend", "megatron"))


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_a_vocabulary_without_the_students_ids_is_refused_by_flag(models, backend):
    found = errors(models, models["vocab"], "--train-backend", backend)
    assert found == [f"--opd-teacher-load {models['vocab']}: its vocabulary has 200 entries, fewer than the policy's "
                     f"250 (--hf-checkpoint {models['student']}); it scores the student's tokens, so it needs the "
                     "student's tokenizer"], found
    # an embedding padded further (a larger model of the same tokenizer: Qwen2.5-7B over 0.5B) holds every id
    assert errors(models, models["padded"], "--train-backend", backend) == []


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_lora_takes_a_teacher_of_its_own_model_only(models, backend):
    lora = ["--lora-rank", "4"]
    assert errors(models, models["big"], "--train-backend", backend, *lora) == []
    for teacher in (models["same"],):
        found = errors(models, teacher, "--train-backend", backend, *lora)
        assert any(e.startswith("--opd-teacher-load with --lora-rank: a LoRA run's frozen weights are its base model")
                   for e in found), (backend, found)
