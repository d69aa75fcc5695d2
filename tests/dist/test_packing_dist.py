"""Loss denominators all-reduced over a real 2-rank gloo DP group (torchrun).

Kept beside the other packing tests (marked slow) because it exercises one
function; its job (tests/dist/scripts/packing_worker.py) runs in its launch
group's 2-rank launch (tests/_launches.py) instead of a launch of its own.
"""

import json

import pytest

from _launches import one_job

pytestmark = pytest.mark.dist

shared_launch = one_job("packing", 2)  # one 2-rank job in the group's launch: its output dir


def test_denominators_all_reduce_over_dp_group(shared_launch_state):
    tmp_path = shared_launch_state
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    total_tokens = sum(n // 2 for n in (4, 9, 16, 25, 6, 3, 11))
    for d in got:
        assert d["global_tokens"] == total_tokens and d["global_samples"] == 7
    assert got[0]["local_tokens"] + got[1]["local_tokens"] == total_tokens
    assert got[0]["local_samples"] + got[1]["local_samples"] == 7
    assert {got[0]["local_samples"], got[1]["local_samples"]} == {3, 4}
