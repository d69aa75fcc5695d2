"""Each training rank frozen (SIGSTOP) in turn at each phase of a step: the other ends within the bound with a
named error, and the checkpoint root stays what a relaunch can resume from.

One 2-rank job in the group's launch (scripts/freeze_worker.py: the cases, the phases and how a case gets a
world of its own); the bound is ``--distributed-timeout-minutes 0.005`` (0.3 s), through
``infra.collective_watch``. Per case, the rank that waited raised a ``CollectiveTimeout`` that names the
phase, the frozen rank with its host and pid, the bound and the flag; step 1 (saved whole before the cases)
stays the newest complete checkpoint and the pointer's; the save frozen mid-write left at most its temp
dir, never a candidate; and after every case both ranks resume from step 1.
"""

import json
import os

import pytest

pytestmark = pytest.mark.dist

PHASES = {"train_step": "the train step", "weight_sync": "the weight sync", "checkpoint_save": "the checkpoint save",
          "resume": "the resume"}


def shared_launch(ctx):
    """One 2-rank job in the group's launch (tests/_launches.py); every rank's record."""
    out = ctx.tmp_path_factory.mktemp("freeze")
    yield {2: [("freeze", [out, ctx.tiny_hf_models("qwen2")])]}
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def results(shared_launch_state):
    return shared_launch_state


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("frozen", [0, 1])
def test_a_frozen_rank_is_named_by_the_one_that_waited(results, phase, frozen):
    waiter = 1 - frozen
    got = results[waiter][f"{phase}:rank{frozen}"]
    assert got["type"] == "CollectiveTimeout", got
    assert got["missing"] == [frozen], got
    msg = got["message"]
    assert msg.startswith(PHASES[phase]), msg
    assert f"training rank {frozen} (" in msg and " pid " in msg, msg  # who it is: host and pid
    assert "did not answer within 0.3 s (--distributed-timeout-minutes 0.005)" in msg, msg
    assert f"Rank {waiter} stops here" in msg, msg
    assert f"{phase}:rank{frozen}" not in results[frozen]  # the frozen rank only unwound


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("frozen", [0, 1])
def test_the_checkpoint_root_keeps_its_last_published_checkpoint(results, phase, frozen):
    root = results[1 - frozen][f"{phase}:rank{frozen}"]["root"]
    assert root["latest"] == 1 and root["newest_complete"] == 1 and root["candidates"] == [1], root
    assert "iter_0000002" not in root["entries"], root  # the frozen save published nothing
    assert set(root["entries"]) <= {"iter_0000001", ".iter_0000002.tmp", "latest_checkpointed_iteration.txt",
                                    "resume_state.json"}, root


def test_every_rank_resumes_from_the_latest_published_checkpoint_after_the_freezes(results):
    for r in range(2):
        assert results[r]["final_resume"]["step"] == 1, (r, results[r]["final_resume"])
        assert os.path.basename(results[r]["final_resume"]["root"]["entries"][-1]) != "iter_0000002"
