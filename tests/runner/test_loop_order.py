"""The loop's order of calls, end to end through ``train.run`` in-process, in about a second.

The backend is a ``TrainBackend`` subclass and the engine a ``RolloutEngine`` subclass, put
into the real registries (``BACKENDS``, ``ENGINES``), so the loop, the runner's
collaborators, ``build_rollout``, the weight-sync transport, the algorithm spec and the
checkpoint schedule are the real code; only the model and the sampler are doubles.
Because the backend double implements the ABC and nothing else, a loop call outside the
``TrainBackend`` contract fails here. Checked: the colocated sleep/wake order around
training (the engine's weights resumed before the sync, its KV cache after it), a weight sync after every train (version = rollout id + 1) and before the next
generate, saves on the schedule plus the final one, and a SIGTERM mid-run that finishes
the step, saves and stops with exit code 3.
"""

import json
import os
import signal

import pytest
import torch

from _metrics_doc import check_mode_keys
from megatron_rl.backends.base import TrainBackend, WeightManager
from megatron_rl.backends.factory import BACKENDS
from megatron_rl.config import parse_config
from megatron_rl.data.types import Sample
from megatron_rl.infra.wall_time import EXIT_WALL_TIME
from megatron_rl.rollout.base import ENGINES, EngineHealth, RolloutEngine
from megatron_rl.train import run

EVENTS: list = []


class RecordingBackend(TrainBackend):
    """One parameter ``w``; every call the loop makes is appended to EVENTS."""

    def initialize(self, cfg, spec):
        EVENTS.append("initialize")
        self.cfg, self.w = cfg, torch.zeros(3)
        self.dp_size, self.dp_rank, self.pad_to_multiple, self.holds_results = 1, 0, 1, True
        self.weights = WeightManager(lambda: iter([("w", self.w)]))

    def forward(self, samples, plan=None, owned_only=False):
        EVENTS.append(("forward", self.weights.active))
        return [torch.zeros(s.response_length) for s in samples]

    def train_step(self, batch):
        EVENTS.append("train_step")
        self.w += 1.0
        return {"train/pg_loss": 0.0}

    def save(self, path, extra_state):
        EVENTS.append(("save", os.path.basename(path), extra_state["rollout_id"]))
        os.makedirs(path)

    def load(self, path):
        raise AssertionError("a fresh start loads nothing")

    def load_frozen_weights(self, tag, path):
        raise AssertionError("no --ref-load here")

    def sleep(self):
        EVENTS.append("backend.sleep")

    def wake(self):
        EVENTS.append("backend.wake")

    def release_comm_groups(self):
        EVENTS.append("backend.release_comm_groups")
        return 0

    def restore_comm_groups(self):
        EVENTS.append("backend.restore_comm_groups")
        return 0

    def export_weights(self, bucket_bytes):
        yield [("w", self.w.clone())]


class RecordingEngine(RolloutEngine):
    """Answers every prompt with the label's text (reward 1 for half the samples)."""

    tokenizer = None

    @classmethod
    def from_config(cls, cfg):
        EVENTS.append("engine.from_config")
        return cls()

    def __init__(self):
        self.version, self.w = 0, torch.zeros(3)

    def generate(self, requests, sampling):
        EVENTS.append(("generate", self.version))
        return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=[5, 6],
                       response_text=r.label if i % 2 else "no", rollout_logprobs=[-1.0, -1.0],
                       weight_version=self.version, label=r.label, finish_reason="stop")
                for r in requests for i in range(sampling.n)]

    def update_weights(self, named_tensors, version):
        for _name, tensor in named_tensors:
            self.w = tensor.clone()
        self.version = version
        EVENTS.append(("update_weights", version))

    def update_weights_from_disk(self, path, version):
        raise AssertionError("the loop's default transport (tensor) hands tensors over; nothing is on disk")

    def named_weights(self):
        yield "w", self.w

    def release(self):
        EVENTS.append("engine.release")

    def resume(self):
        EVENTS.append("engine.resume")

    def resume_weights(self):
        EVENTS.append("engine.resume_weights")

    def resume_kv_cache(self):
        EVENTS.append("engine.resume_kv_cache")

    def health(self):
        return EngineHealth(ok=True, weight_version=self.version, released=False, weights_loaded=True)

    @property
    def weight_version(self):
        return self.version


@pytest.fixture
def loop(tiny_hf_models, tmp_path, monkeypatch):
    EVENTS.clear()
    monkeypatch.setitem(BACKENDS._rows, "megatron", RecordingBackend)
    monkeypatch.setitem(ENGINES._rows, "embedded", RecordingEngine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(8)))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def start(*flags, colocated=True):
        common = ["--use-kl-loss", "--kl-loss-coef", "0.01", "--colocate", "--check-weight-update-equal"]
        cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(prompts),
                            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rm-type", "exact_match",
                            *(common if colocated else []),
                            "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run"), *flags],
                           validate=colocated)  # the async tests bypass the engine rule (their double is "embedded")
        return run(cfg)

    yield start, tmp_path
    for s, h in handlers.items():
        signal.signal(s, h)


def _step(rollout_id):
    """What one colocated RL step must call, in order (GRPO + KL: old log-probs under the actor, then the
    reference's under the swapped-in ref weights; one optimizer step per rollout)."""
    return ["backend.release_comm_groups", ("generate", rollout_id), "engine.release", "backend.restore_comm_groups",
            "backend.wake", ("forward", "actor"), ("forward", "ref"),
            "train_step",
            "backend.sleep", "engine.resume_weights", ("update_weights", rollout_id + 1), "engine.resume_kv_cache"]


def test_colocated_loop_order_sync_after_train_and_saves_on_schedule(loop):
    start, tmp = loop
    assert start("--num-rollout", "3", "--save-interval", "2") == 0
    assert EVENTS == ["initialize", "engine.from_config", ("update_weights", 0),
                      *_step(0), *_step(1), ("save", "iter_0000002", 2), *_step(2), ("save", "iter_0000003", 3)]
    status = json.loads((tmp / "run" / "run_status.json").read_text())
    assert status["status"] == "finished" and status["rollout_id"] == 3
    check_mode_keys(_records(tmp), "off")  # the keys docs/metrics.md lists for the mode


def _records(tmp) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_mid_step_finishes_the_step_saves_and_stops(loop):
    start, tmp = loop
    original = RecordingEngine.generate

    def generate_then_signal(self, requests, sampling):
        out = original(self, requests, sampling)
        if self.version == 1:  # rollout 1 is being generated: a scheduler's SIGTERM arrives
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    RecordingEngine.generate = generate_then_signal
    try:
        rc = start("--num-rollout", "5", "--save-interval", "4")
    finally:
        RecordingEngine.generate = original
    assert rc == EXIT_WALL_TIME
    # rollout 1 still trains and syncs; the unscheduled save follows; rollout 2 never starts
    assert EVENTS == ["initialize", "engine.from_config", ("update_weights", 0), *_step(0), *_step(1),
                      ("save", "iter_0000002", 2)]
    status = json.loads((tmp / "run" / "run_status.json").read_text())
    assert status["status"] == "stopped_early" and status["rollout_id"] == 2


@pytest.mark.parametrize("mode", ["one-step", "full"])
def test_async_loops_sync_after_the_generation_in_flight_and_train_every_step(loop, mode):
    """The async drivers through ``train.run`` (the engine's placement rule is bypassed: ``validate=False`` below,
    since this double is registered as the embedded engine): every step trains, the weights go 0..N in order, a
    generation never spans an update (the double draws a whole group at one version), and one-step's rollout
    N+1 is drawn by version N."""
    start, tmp = loop
    versions_seen = []
    original = RecordingEngine.generate

    def generate(self, requests, sampling):
        v = self.version
        out = original(self, requests, sampling)
        assert self.version == v, "a weight update landed inside a generate call"
        versions_seen.append(v)
        return out

    RecordingEngine.generate = generate
    try:
        # in the driver rank: the double stands where the embedded engine's own process would be
        assert start("--num-rollout", "3", "--save-interval", "2", "--async-mode", mode,
                     "--embedded-engine-ranks", "driver", colocated=False) == 0
    finally:
        RecordingEngine.generate = original
    updates = [e[1] for e in EVENTS if isinstance(e, tuple) and e[0] == "update_weights"]
    assert updates == [0, 1, 2, 3] and EVENTS.count("train_step") == 3
    if mode == "one-step":
        assert versions_seen == [0, 0, 1]  # rollout 0 by v0, then rollout N+1 by vN while N trains
    saves = [e[1] for e in EVENTS if isinstance(e, tuple) and e[0] == "save"]
    assert saves == ["iter_0000002", "iter_0000003"]  # on schedule, then the final one
    records = _records(tmp)
    trained = [r for r in records if "train/pg_loss" in r]
    assert len(trained) == 3 and all(r["rollout/staleness_max"] <= 1 for r in trained)
    check_mode_keys(records, mode)  # the keys docs/metrics.md lists for the mode
    if mode == "one-step":  # every version metric against the weights that train (was: stale 0 beside staleness 1)
        assert [(r["rollout/stale_samples"], r["rollout/staleness_max"]) for r in trained] == [(0, 0), (4, 1), (4, 1)]
    if mode == "full":  # every save, the final one too, is preceded by the producer's snapshot
        assert sorted(os.listdir(tmp / "ckpt" / "async_buffer")) == ["buffer_2.pt", "buffer_3.pt"]


TWO_TURNS = """
from megatron_rl.data.types import Sample


def two_turns(request, sampling, engine):
    \"\"\"A multi-turn rollout as the tool loop records it: a turn, an observation token (loss mask 0), a turn.\"\"\"
    out = []
    for j, first in enumerate(engine.generate(request.prompt_ids, sampling)):
        second = engine.generate(list(request.prompt_ids) + first.output_ids + [9], sampling)[0]
        ids = first.output_ids + [9] + second.output_ids
        out.append(Sample(request.group_index, list(request.prompt_ids), ids,
                          rollout_logprobs=first.logprobs + [0.0] + second.logprobs,
                          loss_mask=[1] * len(first.output_ids) + [0] + [1] * len(second.output_ids),
                          token_versions=first.token_versions + first.token_versions[-1:] + second.token_versions,
                          weight_version=first.token_versions[0], finish_reason=second.finish_reason,
                          response_text=request.label if j % 2 else "no", label=request.label,
                          metadata={**request.metadata, "turns": 2, "tool_calls": 1, "tool_errors": j % 2}))
    return out
"""


@pytest.mark.parametrize("mode", ["off", "one-step", "full"])
def test_a_multi_turn_rollout_logs_the_agent_metrics_in_every_mode(loop, mode):
    """A ``--custom-generate-function-path`` function that records turns, tool calls and tool errors (as the tool
    loop does): every mode logs ``rollout/turns_mean`` and the rest with the step (full mode once did not: its
    batch's metrics were a copy of the manager's without them), and only keys docs/metrics.md lists for it."""
    start, tmp = loop
    (tmp / "two_turns.py").write_text(TWO_TURNS)
    flags = [] if mode == "off" else ["--async-mode", mode, "--embedded-engine-ranks", "driver"]
    assert start("--num-rollout", "2", "--custom-generate-function-path", f"{tmp / 'two_turns.py'}:two_turns",
                 *flags, colocated=False) == 0
    agent = ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_error_frac")
    check_mode_keys(_records(tmp), mode, present=agent)
    for r in [r for r in _records(tmp) if "train/pg_loss" in r]:
        assert (r["rollout/turns_mean"], r["rollout/tool_calls_mean"], r["rollout/tool_error_frac"]) == (2.0, 1.0, 0.5)


@pytest.mark.parametrize("mode", ["off", "one-step", "full"])
def test_a_reward_model_on_the_trainers_ranks_sets_the_rewards_that_train(loop, mode, tmp_path_factory):
    """--reward-model-path beside the rule reward, in every mode through ``train.run``: the samples the backend
    trains on carry rule + score, and each step's record says so (``rollout/reward_mean`` is the mean of
    ``reward/rule`` + ``reward/rm_score``), with the keys docs/metrics.md lists for the mode."""
    from megatron_rl.models.hf_tiny import build_tiny_reward_model

    start, tmp = loop
    rm = build_tiny_reward_model("qwen2", tmp_path_factory.mktemp("rm") / "rm", seed=4)
    trained: list = []
    original = RecordingBackend.train_step

    def train_step(self, batch):
        trained.append([float(s.reward) for s in batch.samples])
        return original(self, batch)

    RecordingBackend.train_step = train_step
    try:
        flags = ["--async-mode", mode, "--embedded-engine-ranks", "driver"] if mode != "off" else []
        assert start("--num-rollout", "2", "--reward-model-path", rm, *flags, colocated=mode == "off") == 0
    finally:
        RecordingBackend.train_step = original
    records = [r for r in _records(tmp) if "train/pg_loss" in r]
    assert len(records) == len(trained) == 2
    for record, rewards in zip(records, trained):
        assert record["rollout/reward_mean"] == pytest.approx(record["reward/rule"] + record["reward/rm_score"],
                                                              abs=1e-5)
        assert sum(rewards) / len(rewards) == pytest.approx(record["rollout/reward_mean"], abs=1e-5)
        assert record["perf/reward_model_s"] >= 0
    assert len({round(r, 6) for rewards in trained for r in rewards}) > 2  # scores, not a constant
    check_mode_keys(_records(tmp), mode)
