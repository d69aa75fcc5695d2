"""On-policy distillation on the FSDP backend: a teacher of the student's shapes (a weight tag) and a larger one
(a frozen model of its own, backends/fsdp/teacher.py).

The student is the tiny qwen2 of the other FSDP tests; the larger teacher has twice its hidden size and one more
layer (same vocabulary), random weights of another seed. Its jobs (scripts/fsdp_worker.py ``teacher``) join the
group's 2-rank launch (phase 1: a fresh run that saves after 2 of its 3 steps, and a same-shape teacher run) and
1-rank launch (phase 2: the same fresh run, and a run resumed from the DP2 checkpoint), tests/_launches.py.

Checked against hand computations in this process: the teacher's log-probs are HF transformers' own forward of
the teacher (log_softmax gathered at the response tokens), and the loss's ``opd_reverse_kl`` at step 0 is the
loss-token mean of (student - teacher) log-probs of the two plain HF models, at DP2 and in one process (fp32,
1e-5). The larger teacher is frozen (no gradient, not in the optimizer, unchanged by training), moves with the
actor when the trainer sleeps, is not in the checkpoint, and a resume reloads it from its flag; a --lora-rank
student takes it too (the teacher has no adapters).
"""

import json
import os
import sys

import pytest
import torch

from _util import hf_response_logprobs, loss_token_error

pytestmark = pytest.mark.dist

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
PER_RANK = {"train/micro_batches"}  # this rank's count: 6 in one process, 3 on each of two


def shared_launch(ctx):
    hf = ctx.tiny_hf_models("qwen2")
    student_hidden = json.load(open(os.path.join(hf, "config.json")))
    big = ctx.tiny_hf_models("qwen2", hidden_size=2 * student_hidden["hidden_size"],
                             num_hidden_layers=student_hidden["num_hidden_layers"] + 1, seed=11)
    same = ctx.tiny_hf_models("qwen2", seed=12)
    out, ckpt = ctx.tmp_path_factory.mktemp("fsdp_teacher"), ctx.tmp_path_factory.mktemp("fsdp_teacher_ckpt")
    # the resume in the phase's 1-rank launch, which runs after its 2-rank one (tests/_launches.py)
    yield {2: [("fsdp_teacher", [hf, big, same, out, ckpt, "save"])],
           1: [("fsdp_teacher", [hf, big, same, out, ckpt, "resume"])]}
    return {"hf": hf, "big": big, "same": same, "dp2": json.load(open(out / "teacher_save_w2.json")),
            "dp1": json.load(open(out / "teacher_resume_w1.json"))}


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


@pytest.fixture(scope="module")
def samples():
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    return make_samples(250)


def _opd_reverse_kl(student, teacher, samples) -> float:
    """The loss's ``opd_reverse_kl`` by hand: the mean of (student - teacher) log-probs over every loss token of
    the batch (algorithms/losses.py's sum over count, reduced over ranks)."""
    total, count = 0.0, 0
    for s, t, sample in zip(student, teacher, samples):
        keep = torch.tensor(sample.loss_mask, dtype=torch.bool)
        total += (s - t)[keep].sum().item()
        count += int(keep.sum())
    return total / count


def test_larger_teacher_log_probs_and_opd_term_equal_plain_hf_at_dp2_and_one_process(runs, samples):
    student = hf_response_logprobs(runs["hf"], samples)
    teacher = hf_response_logprobs(runs["big"], samples)
    want = _opd_reverse_kl(student, teacher, samples)
    for layout in ("dp2", "dp1"):
        rec = runs[layout]["big"]
        assert rec["own_model"]["kind"] == "FSDPFrozenModel" and "teacher" not in rec["own_model"]["tags"], layout
        assert loss_token_error(teacher, rec["teacher_logprobs"], samples) < 1e-5, layout
        assert loss_token_error(student, rec["student_logprobs"], samples) < 1e-5, layout
        assert rec["owned_ok"], layout  # owner-aligned: each DP rank gets its own samples' teacher log-probs
        got = rec["steps"][0]["train/opd_reverse_kl"]
        assert got == pytest.approx(want, abs=1e-5), (layout, got, want)
    # two different random models: the term (measured -0.058) and the per-token gaps are far above the tolerance
    assert abs(want) > 1e-2 and max((s - t).abs().max().item() for s, t in zip(student, teacher)) > 1.0
    # the term is in every step's loss, and DP2 steps equal one process's within fp32 summation order
    for m2, m1 in zip(runs["dp2"]["big"]["steps"], runs["dp1"]["big"]["steps"]):
        assert set(m2) == set(m1)
        for k in set(m1) - PER_RANK:
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-5), k


def test_larger_teacher_is_a_frozen_model_of_its_own(runs):
    student = json.load(open(os.path.join(runs["hf"], "config.json")))
    for layout in ("dp2", "dp1"):
        rec = runs[layout]["big"]
        own = rec["own_model"]
        assert own["hidden"] == [2 * student["hidden_size"], student["num_hidden_layers"] + 1]
        assert own["frozen"] and own["eval_mode"] and not own["in_optimizer"] and not own["shares_actor_params"]
        assert own["resident"] == [False, True]  # actor, teacher: what sleep moves off the device
        assert rec["teacher_after_training_equal"], layout  # 3 optimizer steps later
        assert [s["train/update_skipped"] for s in rec["steps"]] == [0.0, 0.0, 0.0]


def test_checkpoint_leaves_the_teacher_out_and_a_resume_reloads_it(runs, samples):
    """The DP2 checkpoint after 2 steps holds the actor only; resumed in one process (resume_or_init: the teacher
    from --opd-teacher-load, then the checkpoint), the teacher's log-probs are the teacher's and the 3rd step equals
    the uninterrupted DP2 run's (resharded: within summation order)."""
    dp2, resumed = runs["dp2"]["big"], runs["dp1"]["resumed"]
    assert dp2["ckpt_model_keys"] == dp2["own_model"]["actor_state_keys"]
    assert "teacher" not in " ".join(dp2["ckpt_top_keys"])
    assert resumed["start_step"] == 2 and len(resumed["steps"]) == 1
    assert loss_token_error(hf_response_logprobs(runs["big"], samples), resumed["teacher_logprobs"], samples) < 1e-5
    want = dp2["steps"][2]
    for k, v in resumed["steps"][0].items():
        if k in PER_RANK:
            continue
        assert v == pytest.approx(want[k], rel=1e-4, abs=1e-5), k


def test_same_shape_teacher_is_a_weight_tag_with_hf_log_probs(runs, samples):
    rec = runs["dp2"]["same"]
    assert rec["frozen_roles"] == [] and "teacher" in rec["tags"]
    assert loss_token_error(hf_response_logprobs(runs["same"], samples), rec["teacher_logprobs"], samples) < 1e-5
    assert rec["owned_ok"] and rec["actor_back"]


def test_lora_student_with_a_larger_teacher(runs, samples):
    """--lora-rank 4 with the larger teacher: the teacher is a model of its own without adapters (the student's sit
    in the actor only), gives HF's log-probs, and a step with the OPD term trains the adapters."""
    rec = runs["dp2"]["lora"]
    assert rec["own_model"]["kind"] == "FSDPFrozenModel" and rec["own_model"]["frozen"]
    assert not rec["own_model"]["in_optimizer"]
    assert rec["teacher_adapters"] == 0 and rec["student_adapters"] > 0
    assert loss_token_error(hf_response_logprobs(runs["big"], samples), rec["teacher_logprobs"], samples) < 1e-5
    step = rec["steps"][0]
    assert step["train/update_skipped"] == 0.0 and step["train/grad_norm"] > 0 and abs(step["train/opd_reverse_kl"]) > 1e-2
