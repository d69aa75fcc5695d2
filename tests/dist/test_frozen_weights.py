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

from _util import REPO, torchrun
from megatron_rl.models.hf_tiny import build_tiny_hf_model

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "frozen_worker.py")


def hf_logprobs(path, samples):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for s in samples:
        p = len(s.prompt_ids)
        logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
        out.append(torch.log_softmax(logits.double(), -1)[p - 1:-1].gather(
            -1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


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
        want = hf_logprobs(path, samples)
        worst = max((w - torch.tensor(g, dtype=torch.float64)).abs().max().item() for w, g in zip(want, got[key]))
        assert worst < 1e-5, (key, worst)
    # the three models really differ, so the tags are not all the same weights
    assert abs(got["actor"][0][0] - got["ref"][0][0]) > 1e-3
    assert abs(got["ref"][0][0] - got["teacher"][0][0]) > 1e-3
