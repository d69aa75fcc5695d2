"""--ref-load (HF dir) and --opd-teacher-load (torch_dist) become weight tags of the live TP2 model.

Three different random models: the actor, a reference given as an HF directory,
and a teacher converted to torch_dist with tools/convert_ckpt.py. Log-probs under
each tag must equal HF transformers on that model, and the actor's must come back
unchanged after the swaps.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from _util import REPO, hf_response_logprobs, loss_token_error, torchrun
from megatron_rl.models.hf_tiny import build_tiny_hf_model

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "frozen_worker.py")


@pytest.mark.slow
def test_ref_and_teacher_tags_from_hf_and_torch_dist(tmp_path):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from backend_worker import make_samples

    actor = build_tiny_hf_model("qwen2", tmp_path / "actor", seed=0)
    ref = build_tiny_hf_model("qwen2", tmp_path / "ref", seed=1)
    teacher_hf = build_tiny_hf_model("qwen2", tmp_path / "teacher_hf", seed=2)
    conv = subprocess.run([sys.executable, "tools/convert_ckpt.py", "hf-to-dist", "--input", teacher_hf,
                           "--output", str(tmp_path / "teacher_dist"), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr[-3000:]
    out = tmp_path / "out.json"
    torchrun(SCRIPT, 2, [actor, ref, str(tmp_path / "teacher_dist"), str(out)], timeout=600)
    got = json.loads(out.read_text())
    samples = make_samples(250)
    for key, path in [("actor", actor), ("ref", ref), ("teacher", teacher_hf), ("actor_again", actor)]:
        worst = loss_token_error(hf_response_logprobs(path, samples), got[key], samples)
        assert worst < 1e-5, (key, worst)
    # the three models really differ, so the tags are not all the same weights
    assert abs(got["actor"][0][0] - got["ref"][0][0]) > 1e-3
    assert abs(got["ref"][0][0] - got["teacher"][0][0]) > 1e-3


@pytest.mark.slow
def test_load_of_a_converted_model_dir_gives_the_initial_weights(tmp_path):
    """--load of a model-only torch_dist dir (convert_ckpt.py hf-to-dist) initialises the policy from
    it, not from --hf-checkpoint, in bf16 at TP2, and a train step from there moves the weights."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    from backend_worker import make_samples

    actor = build_tiny_hf_model("qwen2", tmp_path / "actor", seed=0)
    start_hf = build_tiny_hf_model("qwen2", tmp_path / "start_hf", seed=5)
    conv = subprocess.run([sys.executable, "tools/convert_ckpt.py", "hf-to-dist", "--input", start_hf,
                           "--output", str(tmp_path / "start_dist"), "--no-progress", "--dtype", "bfloat16"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr[-3000:]
    out, ref_out = tmp_path / "out.json", tmp_path / "ref.json"
    torchrun(SCRIPT, 2, ["--init", actor, str(tmp_path / "start_dist"), str(out)], timeout=600)
    # the same run started from start_hf itself (bf16 params are the same values as the bf16 dir)
    torchrun(SCRIPT, 2, ["--init", start_hf, "-", str(ref_out)], timeout=600)
    got, ref = json.loads(out.read_text()), json.loads(ref_out.read_text())
    samples = make_samples(250)
    want_start, want_actor = hf_response_logprobs(start_hf, samples), hf_response_logprobs(actor, samples)
    err = (lambda want, g: loss_token_error(want, g, samples))
    assert err(want_start, got["before"]) < 0.05  # bf16 weights of start_hf
    assert err(want_actor, got["before"]) > 0.5  # ... and not --hf-checkpoint's
    assert err(want_start, got["after"]) > 1e-3  # the optimizer stepped
    # ... from exactly those weights, with master weights made from them: bitwise the HF-started run
    assert got["before"] == ref["before"] and got["after"] == ref["after"]
    untimed = (lambda m: {k: v for k, v in m.items() if not k.endswith("_time_s")})
    assert untimed(got["metrics"]) == untimed(ref["metrics"]) and got["metrics"]["train/grad_norm"] > 0
