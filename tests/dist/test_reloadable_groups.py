"""Process groups destroyed while the trainer sleeps and rebuilt before it trains
(``--offload-train-groups``; megatron_rl/infra/reloadable_groups.py), over real gloo on 2 ranks.

Here: the collectives megatron uses give the same results on the rebuilt groups, two cycles
in a row; a destroyed group's real process group is gone from torch's tables and a collective
on it raises an error naming it (no KeyError, no hang) while rank/size queries still answer;
a rank that is not a member of a group replays its creation too. Bitwise continuation of
megatron training across the teardown: the ``--offload-train-groups=on`` layouts of
tests/dist/test_backend.py; the loop's order: tests/runner/test_loop_order.py.
"""

import json

import pytest

pytestmark = pytest.mark.dist


def shared_launch(ctx):
    """One 2-rank job in the group's launch (tests/_launches.py); every rank's record."""
    out = ctx.tmp_path_factory.mktemp("groups") / "groups.json"
    yield {2: [("groups", [out])]}
    return json.load(open(out))


@pytest.fixture(scope="module")
def ranks(shared_launch_state):
    return shared_launch_state


def test_rebuilt_groups_give_the_same_collective_results(ranks):
    for rank in ranks:
        assert rank["before"]["all_reduce"] == 3.0 and rank["before"]["all_gather"] == [0.0, 1.0]
        for cycle in rank["cycles"]:
            assert cycle["after"] == rank["before"]
    assert [r["before"]["p2p"] for r in ranks] == [101.0, 100.0]  # batched isend/irecv reached the peer
    assert [r["before"]["coalesced"] for r in ranks] == [[3.0, 2.0]] * 2


def test_destroyed_groups_leave_torch_and_name_themselves(ranks):
    for rank, r in enumerate(ranks):
        members = 2 if rank == 0 else 1  # rank 0 is also in the group of rank 0 alone
        for cycle in r["cycles"]:
            assert cycle["destroyed"] == cycle["rebuilt"] == members
            assert cycle["registered_while_destroyed"] == cycle["registered_before"] - members
            assert cycle["registered_after"] == cycle["registered_before"]
            assert "process group TEST_PAIR (global ranks [0, 1]) is destroyed while the trainer sleeps" in \
                cycle["error"]
            assert (cycle["rank_while_destroyed"], cycle["size_while_destroyed"]) == (rank, 2)
            assert cycle["ranks_while_destroyed"] == [0, 1]


def test_a_group_destroyed_for_good_is_not_rebuilt(ranks):
    assert [r["after_retire"] for r in ranks] == [{"destroyed": 1, "rebuilt": 1}, {"destroyed": 0, "rebuilt": 0}]
