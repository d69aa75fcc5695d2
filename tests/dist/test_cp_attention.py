"""PackedCoreAttention under context parallelism (real torchrun, gloo).

Each launch checks, on every rank: THD causal / causal with TE-style padding /
no-mask, THD with sequence-parallel padding, and SBHD causal; outputs and q/k/v
gradients in fp32 against an exact fp64 eager reference (<= 1e-6), in fp64
against the single-process module on the whole batch (<= 1e-12), plus
gather_packed_from_cp reassembly.
"""

import pytest

from _util import REPO, read_json, torchrun

SCRIPT = REPO / "tests" / "dist" / "scripts" / "cp_attention_worker.py"
TOL = 1e-6  # fp32 CP module vs exact fp64 eager reference (values peak at ~2-5)
TOL64 = 1e-12  # fp64 CP module vs the fp64 single-process module


def _run(tmp_path, nproc, tp, cp):
    torchrun(SCRIPT, nproc, [str(tmp_path), str(tp), str(cp)], timeout=240)
    for rank in range(nproc):
        results = read_json(tmp_path / f"rank{rank}.json")
        errors = {k: v for k, v in results.items() if k != "seconds" and "#" not in k}
        assert len(errors) == 4 * 9 + 4, sorted(errors)  # 4 THD cases x 9 checks + SBHD x 4
        fp32 = {k: v for k, v in errors.items() if "fp64" not in k}
        fp64 = {k: v for k, v in errors.items() if "fp64" in k}
        assert max(fp32.values()) <= TOL, {k: v for k, v in fp32.items() if v > TOL}
        assert max(fp64.values()) <= TOL64, {k: v for k, v in fp64.items() if v > TOL64}


@pytest.mark.slow
def test_cp2_matches_single_process(tmp_path):
    _run(tmp_path, 2, tp=1, cp=2)


@pytest.mark.slow
def test_tp2_cp2_matches_single_process(tmp_path):
    _run(tmp_path, 4, tp=2, cp=2)
