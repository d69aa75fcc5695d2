"""Vocab-parallel log-prob/entropy and the globally normalised loss under real TP/DP (torchrun, gloo).

One 4-rank launch checks TP 1, 2 and 4 against the single-process float64
``log_softmax`` reference (values and logit gradients; fp32 and bf16 logits;
temperature != 1; chunk sizes that do not divide the 29 tokens), and a TP2 x DP2
training step whose DP-summed loss, output-layer weight gradients and metrics
must equal the one-big-batch loss; TP 2 and 4 over a padded vocab whose padding
columns (garbage, some ranks nothing else) must change nothing.
"""

import pytest

from _util import read_json

from _launches import one_job

pytestmark = pytest.mark.dist

# fp32 accumulation of values ~10 in magnitude; bf16 gradients are compared relative to their max
# (one rounding to 8 mantissa bits); the TP2xDP2 step computes logits in fp32 against an fp64 reference.
TOL = {"logprobs": 5e-6, "entropy": 5e-6, "grad": 5e-6, "bf16/grad": 8e-3,
       "tp2dp2/loss": 1e-6, "tp2dp2/weight_grad": 2e-5, "tp2dp2/metrics": 1e-6, "tp2dp2/metric_names": 0.0}


def _tol(name):
    if name.startswith("tp2dp2/"):
        return TOL[name]
    kind = name.rsplit("/", 1)[1]
    return TOL["bf16/grad"] if ("bf16" in name and kind == "grad") else TOL[kind]


shared_launch = one_job("vocab_parallel", 4)  # one 4-rank job in the group's launch (tests/_launches.py): its output dir


def test_tp1_tp2_tp4_and_tp2_dp2_step_match_single_process(shared_launch_state):
    tmp_path = shared_launch_state
    for rank in range(4):
        results = read_json(tmp_path / f"rank{rank}.json")
        errors = {k: v for k, v in results.items() if k != "seconds"}
        assert len(errors) == 3 * 3 * 3 + 2 * 3 + 4, sorted(errors)  # 3 TP x 3 cases x 3 checks, padded vocab, step
        bad = {k: v for k, v in errors.items() if v > _tol(k)}
        assert not bad, bad
