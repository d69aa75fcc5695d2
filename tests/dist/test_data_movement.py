"""Rollout batch and per-token results over real gloo ranks (flat tensors, not pickled objects).

One 4-rank launch (a simulated TP2 x DP2 layout, no model) checks that
``broadcast_samples`` delivers the driver's samples exactly, that
``gather_per_sample`` gives every rank every sample's tensor bitwise from the
TP-rank-0 holders only, and that a missing sample or absent batch makes EVERY
rank raise (no rank left waiting in a collective).
"""

import json

import pytest

from _launches import one_job

pytestmark = pytest.mark.dist


shared_launch = one_job("data_movement", 4)  # one 4-rank job in the group's launch (tests/_launches.py): its output dir


def test_broadcast_and_gather_on_four_ranks(shared_launch_state):
    tmp_path = shared_launch_state
    for rank in range(4):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["broadcast_equal"], rank
        assert "driver rank (rank 0) passed no samples" in res["broadcast_none_error"], rank
        assert res["holder_ranks"] == [0, 2], rank  # the TP-rank-0 rank of each DP rank
        assert res["gather_bitwise"] and res["gather_lengths"], rank
        assert "lack samples" in res["gather_missing_error"], rank
        assert res["share_bitwise"] and res["leaders"] == [0, 2], rank
        # each DP rank receives its share whole and headers of the rest; the plan agrees with the full batch's
        assert res["shard_plan_equal"] and res["shard_owned_equal"] and res["shard_stubs"], rank
        assert "held by data-parallel rank" in res["stub_tokens_error"], rank
        assert "driver rank (rank 0) passed no samples" in res["shard_none_error"], rank
        # DP rank 1's holder (rank 2) lacks a sample: it and its TP peer (rank 3) raise; DP rank 0's pair does not
        assert (res["share_missing_error"] is not None) == (rank >= 2), rank
    holder = json.loads((tmp_path / "rank2.json").read_text())["gather_missing_error"]
    assert "forward produced no log-probs for samples" in holder
    assert "holder rank 2 lacks samples" in json.loads((tmp_path / "rank3.json").read_text())["share_missing_error"]
