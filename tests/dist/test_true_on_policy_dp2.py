"""--true-on-policy-mode at DP2 (tests/dist/scripts/on_policy_worker.py, in the megatron_ranks group's 2-rank
launch): each rank's embedded-engine replica generates its own part of the rollout (its own group size and
engine chunk rows), and the DP2 trainer's old log-probs (owner-aligned micro-batches of 2) equal every sample's
rollout log-probs bit for bit, on both ranks, over two steps with the weights synced into both replicas between
them; the first minibatch's ratio is exactly 1 and the mismatch metrics exactly 0. A MoE model with routing
replay from the rollout (qwen3_moe, top-3)."""

import json

import pytest

pytestmark = pytest.mark.dist

FAMILIES = ("qwen3_moe",)  # MoE with R3: the dense layers' arithmetic too (dense DP2: docs/on-policy.md's demo)


def shared_launch(ctx):
    out = ctx.tmp_path_factory.mktemp("on_policy_dp2")
    yield {2: [("on_policy", [out, *FAMILIES])]}
    return json.load(open(out / "results.json"))


@pytest.fixture(scope="module")
def results(shared_launch_state):
    return shared_launch_state


@pytest.mark.parametrize("family", FAMILIES)
def test_every_replicas_rollout_logprobs_equal_the_dp2_trainers_bitwise(results, family):
    run = results[family]
    assert len(run["steps"]) == 2 and run["samples_per_step"] == 2 * 2 + 2 * 4  # rank 0: 2 groups of 2; rank 1: of 4
    for step in run["steps"]:
        for differ, tokens, largest in step["differ_by_rank"]:
            assert (differ, largest) == (0, 0.0) and tokens == 4 * run["samples_per_step"]
        m = step["metrics"]
        assert m["train/mismatch_logprob_diff_frac"] == 0.0 and m["train/mismatch_abs_logprob_max"] == 0.0
        assert m["train/mismatch_k3_kl"] == 0.0
        assert m["train/ratio"] == 1.0 and m["train/ratio_abs_dev"] == 0.0
        assert m["train/route_agreement"] == 1.0
