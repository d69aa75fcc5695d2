"""The embedded engine replicated on every rank (``--embedded-engine-ranks``; rollout/replicas.py), over
real gloo on 3 ranks (so one rollout's parts differ in size, and a call with fewer requests than
ranks leaves a part empty).

Here: each replica returns, bit for bit, the samples one engine draws for its part
(``generate_part`` with the same rows per model call); the whole rollout equals one engine's
``generate`` field by field (tokens, finish reasons, texts, metadata exactly; log-probs to within
float32 rounding, see ``LOGPROB_ATOL``), for ragged prompts, top-k/top-p and stop tokens; an
unseeded call still returns every request's samples in order; outside ``serving()`` the driver
generates alone; a replica that fails is named with its rank and message by the driver,
and every other rank raises the driver's error instead of waiting. The loop with replicas equals
the loop with the driver's engine alone: tests/e2e/test_resume.py (the first half of the resumed
run).
"""

import json

import pytest

pytestmark = pytest.mark.dist


def shared_launch(ctx):
    """One 3-rank job in the group's launch (tests/_launches.py); every rank's record."""
    out = ctx.tmp_path_factory.mktemp("replicas")
    yield {3: [("replicas", [ctx.tiny_hf_models("qwen2"), out])]}
    return [json.load(open(out / f"rank{r}.json")) for r in range(3)]


@pytest.fixture(scope="module")
def ranks(shared_launch_state):
    return shared_launch_state


# A part is a smaller batch than the whole call, and CPU GEMMs need not give a row the same bits at
# another row count: oneDNN's sgemm on an AVX-512 Xeon takes another kernel for few rows (F.linear
# over 64..256 inputs differs from the full batch's rows below 3..11 rows, ~1 ulp), so a token's
# log-prob may differ in its last bits; on an AVX2 EPYC it did not. Measured worst: 1.4e-6 at ~-4.
LOGPROB_ATOL = 4e-6


def _without_logprobs(samples):
    return [{k: v for k, v in s.items() if k != "rollout_logprobs"} for s in samples]


def _logprobs(samples):
    return [[float.fromhex(x) for _, x in s["rollout_logprobs"][1]] for s in samples]


def test_each_replica_draws_exactly_the_part_one_engine_draws(ranks):
    """The protocol: requests, seeds, part bounds and padding reach every replica, and its samples come
    back whole and in order: bit for bit what one engine's ``generate_part`` gives for the same parts."""
    driver = ranks[0]
    assert driver["replicated"] == driver["parts_on_one_engine"]
    assert driver["local_only"] == driver["one_engine"][0]
    assert driver["unseeded"] == [i for i in range(7) for _ in range(2)]
    assert [r["served"] for r in ranks[1:]] == [4, 4]  # 3 seeded calls + the unseeded one, nothing after


def test_replicas_draw_the_samples_of_one_engine(ranks):
    """Row seeds by index in the whole call: the same tokens, finish reasons, texts and metadata as one
    engine generating the whole call; log-probs within float32 rounding of a smaller batch."""
    driver = ranks[0]
    for call, (ours, one) in enumerate(zip(driver["replicated"], driver["one_engine"])):
        assert _without_logprobs(ours) == _without_logprobs(one), call
        for a, b in zip(_logprobs(ours), _logprobs(one)):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL, call


def test_a_failing_replica_is_named_and_every_rank_stops(ranks):
    assert ranks[0]["error"].startswith("the embedded engine replica(s) failed to generate their part")
    assert "rank 2: EngineError: embedded engine cannot generate: released: call resume()" in ranks[0]["error"]
    for r in ranks[1:]:
        assert r["error"].startswith("rank 0's rollout stopped: EngineError: the embedded engine replica(s) failed")


def test_the_drivers_own_failure_reaches_every_rank(ranks):
    assert ranks[0]["own_error"] == "embedded engine cannot generate: released: call resume()"
    for r in ranks[1:]:
        assert r["own_error"] == ("rank 0's rollout stopped: EngineError: embedded engine cannot generate: "
                                  "released: call resume()")
