"""PackedCoreAttention under context parallelism (real torchrun, gloo).

Each launch checks, on every rank: THD causal / causal with TE-style padding /
no-mask, THD with sequence-parallel padding, and SBHD causal; outputs and q/k/v
gradients in fp32 against an exact fp64 eager reference (<= 1e-6), in fp64
against the single-process module on the whole batch (<= 1e-12), plus
gather_packed_from_cp reassembly.
"""

import pytest

from _util import read_json

pytestmark = pytest.mark.dist

TOL = 1e-6  # fp32 CP module vs exact fp64 eager reference (values peak at ~2-5)
TOL64 = 1e-12  # fp64 CP module vs the fp64 single-process module


CASES = {"cp2": (2, 1, 2), "tp2_cp2": (4, 2, 2)}  # name: (ranks, tp, cp)


def shared_launch(ctx):
    """One job per case in the group's launches (tests/_launches.py); the output dir of each."""
    dirs = {name: ctx.tmp_path_factory.mktemp(f"cp_attention_{name}") for name in CASES}
    yield {nproc: [("cp_attention", [dirs[name], tp, cp])] for name, (nproc, tp, cp) in CASES.items()}
    return dirs


def _check(out, nproc):
    for rank in range(nproc):
        results = read_json(out / f"rank{rank}.json")
        errors = {k: v for k, v in results.items() if k != "seconds" and "#" not in k}
        assert len(errors) == 4 * 9 + 4, sorted(errors)  # 4 THD cases x 9 checks + SBHD x 4
        fp32 = {k: v for k, v in errors.items() if "fp64" not in k}
        fp64 = {k: v for k, v in errors.items() if "fp64" in k}
        assert max(fp32.values()) <= TOL, {k: v for k, v in fp32.items() if v > TOL}
        assert max(fp64.values()) <= TOL64, {k: v for k, v in fp64.items() if v > TOL64}


def test_cp2_matches_single_process(shared_launch_state):
    _check(shared_launch_state["cp2"], 2)


def test_tp2_cp2_matches_single_process(shared_launch_state):
    _check(shared_launch_state["tp2_cp2"], 4)
