"""``--async-mode full`` end to end, SIGKILLed at three points and relaunched: every prompt trained once.

Real parts: torchrun (``megatron_rl.infra.launch``) with 2 gloo ranks, megatron-core DP2 training,
``python -m megatron_rl.train``, the producer's threads on the driver speaking HTTP to the server
through ``SGLangEngine`` while the main thread trains, the disk transport, checkpoints and the
buffer file beside each. The server is the protocol-exact stand-in (tests/rollout/sglang_standin.py)
in this process.

One run directory, four launches, with dynamic sampling (``--dynamic-sampling-filter-path``: a filter that
drops every third prompt's group as it finishes): killed (SIGKILL of the whole tree) (1) the first time the
staleness bound holds a worker back, before any checkpoint; (2) as the sync of step 3 begins, after
checkpoint 2 with its buffer; (3) mid-save of checkpoint 4 (every rank's files written, nothing published:
the buffer file of 4 exists, its checkpoint does not); (4) relaunched to the end. Then, over the lineage
the final checkpoint comes from (the debug rollout file of each step, as the last launch to train it
wrote it): no prompt trained twice and no dropped prompt ever, and every prompt drawn is trained, finished
in the final buffer, listed there to be generated again, or dropped by the filter; the filter's counts
(each step's metrics, the final buffer file's) add up to exactly the groups judged over that lineage;
every trained token within --max-staleness; nothing dropped as stale.

The batch rollout function's kill and resume: ``test_full_async_engine_killed_mid_run_exits_3_and_the_relaunch_
resumes_a_batch_rollout_function`` below (its engine's death ends the first launch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _metrics_doc import check_mode_keys
from _util import PausePoint, finished_run, kill_tree, launch_async_run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "rollout"))

from sglang_standin import SGLangStandIn  # noqa: E402 - tests/rollout, put on sys.path above

from megatron_rl.infra.checkpoint_root import find_latest_complete  # noqa: E402
from megatron_rl.runner.full_async import read_buffer  # noqa: E402

pytestmark = pytest.mark.e2e

TIMEOUT = 420  # one launch: a hang bound, not a speed expectation
B, STEPS = 2, 4


#: --dynamic-sampling-filter-path of the kill-and-resume run: every third prompt's group dropped (reason "third")
THIRD_FILTER = """from megatron_rl.rollout.dynamic_sampling import DynamicFilterOutput


def keep(args, samples):
    dropped = int(samples[0].label) % 3 == 2
    return DynamicFilterOutput(keep=not dropped, reason="third" if dropped else None)
"""


def _dropped(prompt_index: int) -> bool:
    return prompt_index % 3 == 2  # THIRD_FILTER's verdict (a prompt's label is its index)


def _launch(hf, tmp_path, out, server, env_extra=None) -> subprocess.Popen:
    (tmp_path / "third_filter.py").write_text(THIRD_FILTER)
    return launch_async_run(hf, tmp_path, out, server.url, ["--rollout-batch-size", str(B), "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
         "--num-rollout", str(STEPS), "--async-mode", "full", "--max-staleness", "1", "--partial-rollout",
         "--dynamic-sampling-filter-path", "third_filter:keep", "--over-sampling-batch-size", "3",
         "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt")], prompts=40, env_extra=env_extra)


def _kill_at(hf, tmp_path, out, server, spec: str) -> None:
    point = PausePoint(tmp_path / "pause", spec)
    proc = _launch(hf, tmp_path, out, server, env_extra=point.env)
    try:
        point.wait(proc, timeout=TIMEOUT, output=lambda: open(f"{out}.log").read()[-6000:])
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=60)


def test_full_async_killed_at_three_points_trains_every_prompt_exactly_once(tiny_hf_models, tmp_path):
    hf = tiny_hf_models("qwen2")
    out = tmp_path / "run"
    root = str(out / "ckpt")
    with SGLangStandIn(hf) as server:
        _kill_at(hf, tmp_path, out, server, "buffer_full")
        _kill_at(hf, tmp_path, out, server, "sync_started:3")
        assert os.path.isfile(os.path.join(root, "async_buffer", "buffer_2.pt"))
        _kill_at(hf, tmp_path, out, server, "publish_written:iter_0000004")
        assert os.path.isfile(os.path.join(root, "async_buffer", "buffer_4.pt"))  # written before its checkpoint
        text = finished_run(_launch(hf, tmp_path, out, server), out, TIMEOUT)
    assert "rollout buffer of" in text and "restored" in text, text[-4000:]

    trained = {}
    for step in range(STEPS):
        data = torch.load(out / "rollouts" / f"rollout_{step}.pt", weights_only=False)
        samples = data["samples"]
        assert len(samples) == B * 2
        for s in samples:  # every token within the bound: trained by version `step`, none older than step - 1
            versions = s["token_versions"] or [s["weight_version"]] * len(s["response_ids"])
            assert min(versions) >= step - 1, (step, versions)
            assert s["finish_reason"] != "abort"
        trained[step] = sorted({s["metadata"]["prompt_index"] for s in samples})
    indices = [i for step in range(STEPS) for i in trained[step]]
    assert len(indices) == len(set(indices)) == STEPS * B, trained  # no prompt trained twice
    assert not any(_dropped(i) for i in indices), trained  # no group the filter dropped, in any launch

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read().strip() == str(STEPS)
    extra = _final_extra(root)
    final = read_buffer(root, STEPS, extra["async_buffer"])
    finished = [g["request"]["metadata"]["prompt_index"] for g in final["buffer"]]
    assert not any(_dropped(i) for i in finished), finished  # a dropped group never enters the buffer
    left = finished + [r["metadata"]["prompt_index"] for r in final["pending"]]
    drawn = final["state"]["offset"]  # one epoch of 40 prompts: the offset counts every prompt drawn
    assert final["state"]["epoch"] == 0
    dropped = [i for i in range(drawn) if _dropped(i) and i not in left]  # judged and dropped, over the lineage
    assert sorted(indices + left + dropped) == list(range(drawn)), (trained, left, drawn)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/pg_loss" in r]
    assert all(r["rollout/dropped_stale"] == 0.0 and r["rollout/staleness_max"] <= 1.0 for r in steps)
    # every launch's records, superseded ones too: the keys docs/metrics.md lists, the filter's among them
    check_mode_keys(records, "full", present=("rollout/generated_groups", "rollout/filtered_groups"))
    # metrics.jsonl: steps 3 and 4 were trained by launch 3 and again by launch 4 (resumed at 2); the rolled-back
    # records are marked superseded (was: kept, two values a step); the run's curve is one record a step
    rolled_back = {(r["step"], r["attempt"]) for r in steps if r.get("superseded")}
    last = max(r["attempt"] for r in steps)
    assert {(3, last - 1), (4, last - 1)} <= rolled_back and all(a < last for _, a in rolled_back), steps
    live = [r for r in steps if not r.get("superseded")]
    assert [r["step"] for r in live] == list(range(1, STEPS + 1)) and live[-1]["attempt"] == last
    # the filter's counts resume exactly: each step reports the groups judged since the one before (a resumed
    # launch's first step those its buffer file carried over), and the final buffer file those judged after the
    # last step; over the lineage they are every group judged, once
    counts = final["filter"]
    assert sum(r["rollout/filtered_groups"] for r in live) + counts["filtered"] == len(dropped) > 0, (live, counts)
    assert sum(r.get("rollout/dynamic_filter/drop_third", 0.0) for r in live) + counts["reasons"].get("third", 0) \
        == len(dropped)
    assert sum(r["rollout/generated_groups"] for r in live) + counts["generated"] \
        == len(indices) + len(finished) + len(dropped), (live, counts)


def _final_extra(root: str, step: int = STEPS) -> dict:
    """Checkpoint ``step``'s extra state (what a resume reads: the buffer file's name and hash)."""
    from megatron_rl.backends.megatron.checkpoint import EXTRA_STATE_NAME

    with open(os.path.join(root, f"iter_{step:07d}", EXTRA_STATE_NAME)) as fh:
        return json.load(fh)


def _run_with_dying_engine(hf, tmp_path, steps: int, *flags: str, dies_after: int | None = 5, partial: bool = True,
                           ) -> subprocess.CompletedProcess:
    """``python -m megatron_rl.train`` (one process) in --async-mode full (``partial``: --partial-rollout) with a
    launched engine (the SGLang double of tests/rollout/sglang_double, SGLang's command line over the stand-in)
    that dies on its /generate call ``dies_after + 1`` (None: an engine that does not die); output dir
    ``tmp_path/run``."""
    out, record = tmp_path / "run", tmp_path / "record"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n" for i in range(40)))
    (tmp_path / "parity_reward.py").write_text("def score(sample):\n    return float(sample.response_ids[-1] % 2)\n")
    double = os.path.join(REPO, "tests", "rollout", "sglang_double")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), double]),
           "MRL_SGLANG_DOUBLE_RECORD": str(record)}
    if dies_after is not None:
        env["MRL_SGLANG_DOUBLE_FAULT"] = f"die-after-generate:{dies_after}"
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", hf, "--prompt-data", str(prompts),
         "--custom-rm-path", "parity_reward:score", "--lr", "1e-2", "--rollout-batch-size", str(B),
         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--num-rollout", str(steps),
         "--rollout-num-gpus", "1", "--sglang-disable-radix-cache", "--rollout-engine-startup-timeout", "120",
         "--update-weight-transport", "disk", "--update-weight-disk-dir", str(out) + ".weights",
         "--async-mode", "full", "--max-staleness", "1", *(["--partial-rollout"] if partial else []),
         "--output-dir", str(out), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)


#: --rollout-function-path of the kill-and-resume run: two engine calls per batch, an observation token (99,
#: loss mask 0) between the turns; every call logged (its rollout_id, its prompts) to calls.jsonl beside it
TWO_TURN_ROLLOUT = """import dataclasses, json, os

from megatron_rl.data.types import Sample


def rollout(rollout_id, requests, sampling, engine):
    with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "rollout_id": rollout_id,
                             "prompts": [r.metadata["prompt_index"] for r in requests]}) + "\\n")
    firsts = engine.generate_batch([r.prompt_ids for r in requests], dataclasses.replace(sampling, max_new_tokens=2))
    turns = [(r, g) for r, gens in zip(requests, firsts) for g in gens]
    seconds = engine.generate_batch([list(r.prompt_ids) + g.output_ids + [99] for r, g in turns],
                                    dataclasses.replace(sampling, n=1, max_new_tokens=2))
    return [Sample(r.group_index, list(r.prompt_ids), g.output_ids + [99] + h.output_ids,
                   rollout_logprobs=g.logprobs + [0.0] + h.logprobs,
                   loss_mask=[1] * len(g.output_ids) + [0] + [1] * len(h.output_ids),
                   token_versions=g.token_versions + g.token_versions[-1:] + h.token_versions,
                   weight_version=g.token_versions[0], finish_reason=h.finish_reason,
                   metadata={**r.metadata, "rollout_id": rollout_id})
            for (r, g), (h,) in zip(turns, seconds)]
"""


def test_full_async_engine_killed_mid_run_exits_3_and_the_relaunch_resumes_a_batch_rollout_function(
        tiny_hf_models, tmp_path):
    """Without --use-fault-tolerance the engine's death ends the run; with a complete checkpoint under --save
    that is exit 3 ("relaunch to resume", as a full disk), naming the engine, its log and the checkpoint. Was:
    exit 2, the code of a refusal. (At start-up an engine that does not answer is a refusal: 2.)

    The run generates with a batch rollout function (--rollout-function-path, two engine calls a batch), so the
    death is its kill: its calls in flight and the groups generated since the last checkpoint's buffer file are
    lost with the process. The same command relaunched (the engine back) resumes from that checkpoint and its
    buffer file and trains to the end. Over the lineage: every step one call of the function (its B groups), no
    prompt trained twice, every drawn prompt trained or left in the final buffer, every sample one uncut two-turn
    attempt (the observation at loss mask 0) within --max-staleness, and the calls' rollout_id counting on across
    the resume (the relaunch's first call numbered from the restored buffer file)."""
    hf, steps = tiny_hf_models("qwen2"), 6
    out, root = tmp_path / "run", tmp_path / "run" / "ckpt"
    (tmp_path / "two_turn.py").write_text(TWO_TURN_ROLLOUT)
    flags = ("--save", str(root), "--save-interval", "1", "--rollout-function-path", "two_turn:rollout",
             "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt"))
    proc = _run_with_dying_engine(hf, tmp_path, steps, *flags, partial=False)  # a cut batch runs again whole
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-5000:]
    resumed_at = find_latest_complete(str(root))
    newest = os.path.join(str(root), f"iter_{resumed_at:07d}")
    assert "test double: dying on /generate call 6" in proc.stderr and \
        f"{newest} is complete: relaunch the same command once the engines are back" in proc.stderr, proc.stderr[-5000:]
    assert proc.stderr.count("Last lines of") == 1  # the death is told once
    # the call that died was the third batch's (--max-staleness 1 admits it once step 0 took the first): no step
    # past 2 could be trained, so the relaunch trains at least 4 steps of the function
    assert 0 < resumed_at <= 2, resumed_at

    proc = _run_with_dying_engine(hf, tmp_path, steps, *flags, dies_after=None, partial=False)  # engines back
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rollout buffer of" in proc.stderr and "restored" in proc.stderr, proc.stderr[-5000:]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read().strip() == str(steps)

    trained, ids = [], []
    for step in range(steps):  # each step's rollout file as the last launch to train it wrote it: the lineage
        samples = torch.load(out / "rollouts" / f"rollout_{step}.pt", weights_only=False)["samples"]
        assert len(samples) == B * 2
        for s in samples:
            assert s["finish_reason"] != "abort" and s["response_ids"][2] == 99 and s["loss_mask"] == [1, 1, 0, 1, 1]
            versions = s["token_versions"] or [s["weight_version"]] * len(s["response_ids"])
            assert min(versions) >= step - 1, (step, versions)  # --max-staleness 1, every token
        assert len({s["metadata"]["rollout_id"] for s in samples}) == 1  # one call of the function a step
        ids.append(samples[0]["metadata"]["rollout_id"])
        trained += sorted({s["metadata"]["prompt_index"] for s in samples})
    assert len(trained) == len(set(trained)) == steps * B, trained  # no prompt trained twice
    assert ids == sorted(set(ids)), ids  # the calls' numbers only go on, across the resume too

    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    relaunch = [c for c in calls if c["pid"] == calls[-1]["pid"]]
    restored = read_buffer(str(root), resumed_at, _final_extra(str(root), resumed_at)["async_buffer"])
    assert min(c["rollout_id"] for c in relaunch) == restored["next_serial"] // B  # numbered on from the file
    final = read_buffer(str(root), steps, _final_extra(str(root), steps)["async_buffer"])
    left = [g["request"]["metadata"]["prompt_index"] for g in final["buffer"]]
    left += [r["metadata"]["prompt_index"] for r in final["pending"]]
    assert sorted(trained + left) == list(range(final["state"]["offset"])), (trained, left)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    live = [r for r in records if "train/pg_loss" in r and not r.get("superseded")]
    assert [r["step"] for r in live] == list(range(1, steps + 1))
    assert all(r["rollout/dropped_stale"] == 0.0 and r["rollout/staleness_max"] <= 1.0 for r in live)


def test_full_async_with_fault_tolerance_restarts_a_dead_engine_and_keeps_its_buffer(tiny_hf_models, tmp_path):
    """--use-fault-tolerance with --async-mode full: the launched engine (the SGLang double of
    tests/rollout/sglang_double, SGLang's command line over the stand-in) dies on a /generate mid-run; the
    producer parks with its buffer, the engine is restarted on its port and synced to the current weights,
    the groups the death cut are generated again from their prompts, and the run trains every step: no prompt
    twice, every token within the bound."""
    out, steps = tmp_path / "run", 4
    proc = _run_with_dying_engine(tiny_hf_models("qwen2"), tmp_path, steps, "--use-fault-tolerance",
                                  "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.pt"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/pg_loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    assert sum(r.get("rollout/engine_restarts", 0.0) for r in trained) == 1.0
    assert max(r["rollout/staleness_max"] for r in trained) <= 1 and sum(r["rollout/dropped_stale"] for r in trained) == 0
    texts = [p.read_text() for p in sorted((out / "engines").glob("engine_*.log"))]
    assert len(texts) == 1 and texts[0].count("$ ") == 2 and "dying on /generate call 6" in texts[0]
    labels = []
    for k in range(steps):
        samples = torch.load(out / "rollouts" / f"rollout_{k}.pt", weights_only=False)["samples"]
        assert all(s["finish_reason"] != "abort" for s in samples)
        labels += sorted({s["label"] for s in samples})
    assert len(labels) == steps * B and len(set(labels)) == len(labels)  # every trained prompt once
