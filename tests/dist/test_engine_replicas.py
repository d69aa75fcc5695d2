"""The embedded engine replicated on every rank (``--embedded-engine-ranks``; rollout/replicas.py), over
real gloo on 3 ranks (so one rollout's parts differ in size, and a call with fewer requests than
ranks leaves a part empty).

Here: the replicated engine's samples equal one engine's, every field bit for bit (tokens,
log-probs, finish reasons, texts, metadata), for ragged prompts, top-k/top-p and stop tokens;
an unseeded call still returns every request's samples in order; outside ``serving()`` the
driver generates alone; a replica that fails is named with its rank and message by the driver,
and every other rank raises the driver's error instead of waiting. The loop with replicas equals
the loop with the driver's engine alone: tests/e2e/test_resume.py (the first half of the resumed
run).
"""

import json

import pytest

from _util import torchrun

SCRIPT = __file__.replace("test_engine_replicas.py", "scripts/replicas_worker.py")


@pytest.fixture(scope="module")
def ranks(tiny_hf_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    torchrun(SCRIPT, 3, [tiny_hf_models("qwen2"), str(out)], timeout=300)
    return [json.load(open(out / f"rank{r}.json")) for r in range(3)]


def test_replicas_draw_exactly_the_samples_of_one_engine(ranks):
    driver = ranks[0]
    assert driver["replicated"] == driver["one_engine"]
    assert driver["local_only"] == driver["one_engine"][0]
    assert driver["unseeded"] == [i for i in range(7) for _ in range(2)]
    assert [r["served"] for r in ranks[1:]] == [4, 4]  # 3 seeded calls + the unseeded one, nothing after


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
