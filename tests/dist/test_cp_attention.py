"""PackedCoreAttention under context parallelism (real torchrun, gloo).

Each launch checks, on every rank: THD causal / causal with TE-style padding /
no-mask, THD with sequence-parallel padding, and SBHD causal; outputs and q/k/v
gradients against the single-process module on the whole batch and an fp64
eager reference (both <= 1e-6), plus gather_packed_from_cp reassembly.
"""

import pytest

from _util import REPO, read_json, torchrun

SCRIPT = REPO / "tests" / "dist" / "scripts" / "cp_attention_worker.py"
TOL = 1e-6


def _run(tmp_path, nproc, tp, cp):
    torchrun(SCRIPT, nproc, [str(tmp_path), str(tp), str(cp)], timeout=240)
    for rank in range(nproc):
        results = read_json(tmp_path / f"rank{rank}.json")
        errors = {k: v for k, v in results.items() if k != "seconds"}
        assert len(errors) == 4 * 9 + 4, sorted(errors)  # 4 THD cases x 9 checks + SBHD x 4
        assert max(errors.values()) <= TOL, {k: v for k, v in errors.items() if v > TOL}


@pytest.mark.slow
def test_cp2_matches_single_process(tmp_path):
    _run(tmp_path, 2, tp=1, cp=2)


@pytest.mark.slow
def test_tp2_cp2_matches_single_process(tmp_path):
    _run(tmp_path, 4, tp=2, cp=2)
