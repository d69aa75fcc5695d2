"""rollout_ckpts/: the rollout right after checkpoint N is stored, and a job resumed from N loads it.

The rollout side is the real ``RolloutManager`` and ``RolloutSource.get`` over a real
prompt file and parsed flags; the engine is a test double that counts its calls and, like
a sampler or a reward function could, draws from the process's global RNG, so the test
sees that everything generation advanced comes back on load.
"""

import contextlib
import json
import logging
import os
import random

import numpy as np
import pytest
import torch

from megatron_rl.config import parse_config
from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.data.types import Sample
from megatron_rl.infra.checkpoint_root import MARKER_NAME, iter_dir
from megatron_rl.runner.checkpoints import CheckpointCursor
from megatron_rl.runner.rollout_source import RolloutSource
from megatron_rl.rollout.manager import RolloutManager


class CountingEngine:
    """Generates from the global torch RNG; rewards below draw from python's ``random``."""

    tokenizer = None

    def __init__(self, weight_version=2):
        self.weight_version = weight_version
        self.calls = 0

    def serving(self):  # RolloutEngine's: no replicas on other ranks to coordinate
        return contextlib.nullcontext()

    def generate(self, requests, sampling):
        self.calls += 1
        return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids),
                       response_ids=torch.randint(0, 10, (3,)).tolist(), rollout_logprobs=[-1.0] * 3,
                       weight_version=self.weight_version, label=r.label, metadata=dict(r.metadata))
                for r in requests for _ in range(sampling.n)]


def random_reward(samples):
    return [random.random() for _ in samples]


@pytest.fixture
def setup(tiny_hf_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(5)))
    root = tmp_path / "ckpt"

    def cfg(*extra):
        return parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(prompts),
                             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-shuffle",
                             "--save", str(root), *extra])

    def checkpoint(step, marker="{}"):
        path = iter_dir(str(root), step)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, MARKER_NAME), "w") as fh:
            fh.write(marker)
        return path

    return cfg, checkpoint, str(root)


def _job(cfg, engine, position=None, checkpoint=None, resumed=False, reward=random_reward):
    """The driver's side of one job: manager at ``position`` (a checkpoint's dataset_state), context after
    saving (or resuming from) ``checkpoint`` = (step, path)."""
    prompts = PromptIterator(PromptDataset(cfg.data.prompt_data), rollout_batch_size=2, n_samples_per_prompt=2,
                             shuffle=True, seed=cfg.rollout.rollout_seed)
    if position is not None:
        prompts.load_state_dict(position)
    manager = RolloutManager(cfg, engine, prompts, reward)
    step, path = checkpoint or (None, None)
    ctx = RolloutSource(cfg, CheckpointCursor(step, path, resumed_at=step if resumed else None), is_driver=True)
    return ctx, manager


def _stored(root):
    """Rollout ids under root/rollout_ckpts (read here without the module under test)."""
    directory = os.path.join(root, "rollout_ckpts")
    return sorted(int(n[len("rollout_"):-3]) for n in os.listdir(directory)
                  if n.startswith("rollout_") and n.endswith(".pt")) if os.path.isdir(directory) else []


def _advance(manager, n):
    for _ in range(n):
        next(manager.prompts)


def _next_draws():
    return random.random(), torch.rand(3).tolist(), float(np.random.rand())


def test_resumed_job_loads_the_rollout_and_everything_generation_advanced(setup):
    cfg, checkpoint, root = setup
    ck2 = checkpoint(2)
    # job 1: rollouts 0, 1 consumed, checkpoint 2 saved, rollout 2 generated (then the job dies)
    ctx, first = _job(cfg(), CountingEngine(), checkpoint=(2, ck2))
    _advance(first, 2)
    position = first.position()  # what iter_2's dataset_state holds
    samples, metrics = ctx.get(2, first)
    assert _stored(root) == [2]
    after_position, after_draws = first.position(), _next_draws()  # what training rollout 2 would see next

    # job 2: resumed from iter_2 in a fresh process (RNG elsewhere); must not call the engine
    random.seed(7), torch.manual_seed(7), np.random.seed(7)
    engine = CountingEngine()
    ctx, second = _job(cfg(), engine, position=position, checkpoint=(2, ck2), resumed=True)
    got_samples, got_metrics = ctx.get(2, second)
    assert engine.calls == 0
    assert got_samples == samples and got_metrics == metrics
    assert second.position() == after_position
    assert _next_draws() == after_draws


def test_only_the_rollout_right_after_a_checkpoint_is_written(setup):
    cfg, checkpoint, root = setup
    ctx, manager = _job(cfg(), CountingEngine(), checkpoint=(2, checkpoint(2)))
    _advance(manager, 3)
    ctx.get(3, manager)  # rollout 3 follows no checkpoint: a resume never starts there
    assert _stored(root) == []
    ctx.cursor.step = ctx.cursor.path = None
    ctx.get(4, manager)
    assert _stored(root) == []
    unmarked = iter_dir(root, 5)  # no COMPLETE.json: not a checkpoint a resume could start from
    os.makedirs(unmarked)
    ctx.cursor.step, ctx.cursor.path = 5, unmarked
    ctx.get(5, manager)
    assert _stored(root) == []


@pytest.mark.parametrize("change", ["checkpoint_rewritten", "flags_changed", "position_differs", "not_resumed",
                                    "unreadable"])
def test_a_stored_rollout_that_does_not_belong_to_this_resume_is_regenerated(setup, change, caplog):
    cfg, checkpoint, root = setup
    ck2 = checkpoint(2)
    ctx, first = _job(cfg(), CountingEngine(), checkpoint=(2, ck2))
    _advance(first, 2)
    position = first.position()
    ctx.get(2, first)

    extra = ["--rollout-temperature", "0.5"] if change == "flags_changed" else []
    if change == "checkpoint_rewritten":
        checkpoint(2, marker='{"another": "run"}')
    if change == "position_differs":
        position = dict(position, offset=(position["offset"] + 1) % 5)
    if change == "unreadable":
        with open(os.path.join(root, "rollout_ckpts", "rollout_2.pt"), "wb") as fh:
            fh.write(b"not a torch file")
    engine = CountingEngine()
    ctx, second = _job(cfg(*extra), engine, position=position, checkpoint=(2, ck2), resumed=change != "not_resumed")
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        ctx.get(2, second)
    assert engine.calls == 1
    if change != "not_resumed":
        assert "rollout 2:" in caplog.text and "generating it again" in caplog.text
    # the regenerated rollout replaced the stale file: a second resume loads it
    engine = CountingEngine()
    ctx, third = _job(cfg(*extra), engine, position=position, checkpoint=(2, ck2), resumed=True)
    ctx.get(2, third)
    assert engine.calls == 0


def test_a_stored_rollout_lives_as_long_as_its_checkpoint(setup):
    cfg, checkpoint, root = setup
    for step in (2, 4):
        ctx, manager = _job(cfg(), CountingEngine(), checkpoint=(step, checkpoint(step)))
        _advance(manager, step)
        ctx.get(step, manager)
    assert _stored(root) == [2, 4]
    from megatron_rl.rollout import rollout_ckpt

    directory = os.path.join(root, rollout_ckpt.DIR_NAME)
    open(os.path.join(directory, ".rollout_6.pt.x1y2.tmp"), "wb").close()  # a write killed half-way
    os.remove(os.path.join(iter_dir(root, 2), MARKER_NAME)), os.rmdir(iter_dir(root, 2))  # pruned checkpoint
    assert rollout_ckpt.prune(root) == [2]
    assert sorted(os.listdir(directory)) == ["rollout_4.pt"]


def quarter_reward(samples):
    return [0.25 for _ in samples]


def _stored_run(setup):
    """Job 1 stores rollout 2 (rewards 0.25) after checkpoint 2; returns what job 2 resumes with."""
    cfg, checkpoint, root = setup
    ck2 = checkpoint(2)
    ctx, first = _job(cfg(), CountingEngine(), checkpoint=(2, ck2), reward=quarter_reward)
    _advance(first, 2)
    position = first.position()
    ctx.get(2, first)
    return cfg, ck2, position, os.path.join(root, "rollout_ckpts", "rollout_2.pt")


def test_a_rollout_file_with_one_flipped_bit_is_regenerated_not_trained_on(setup, caplog):
    """The reported damage: one bit turns a stored reward 0.25 into 1.0 and the file still unpickles."""
    import io
    import struct

    from megatron_rl.infra import checksum

    cfg, ck2, position, path = _stored_run(setup)
    data = bytearray(open(path, "rb").read())
    assert data.startswith(checksum.BYTES_MAGIC)
    at = data.index(b"G" + struct.pack(">d", 0.25))  # pickle BINFLOAT of the first stored 0.25
    data[at + 2] ^= 0x20  # 0x3FD0... (0.25) -> 0x3FF0... (1.0): one bit
    open(path, "wb").write(bytes(data))
    # without the checksum this is silent: torch unpickles the damaged payload and a reward reads 1.0
    payload = bytes(data[data.index(b"\n") + 1:])
    damaged = torch.load(io.BytesIO(payload), weights_only=False)
    values = [s["reward"] for s in damaged["samples"]] + list(damaged["metrics"].values())
    assert 1.0 in values and 0.25 in values

    engine = CountingEngine()
    ctx, second = _job(cfg(), engine, position=position, checkpoint=(2, ck2), resumed=True, reward=quarter_reward)
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        samples, metrics = ctx.get(2, second)
    assert engine.calls == 1  # regenerated
    assert {s.reward for s in samples} == {0.25}
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    recorded, actual = data[len(checksum.BYTES_MAGIC):len(checksum.BYTES_MAGIC) + 64].decode(), \
        checksum.sha256_hex(payload)
    assert path in warning and recorded in warning and actual in warning and "generating it again" in warning
    assert "not regenerated" not in caplog.text
    # the regenerated rollout replaced the damaged file, sealed again: the next resume loads it
    engine = CountingEngine()
    ctx, third = _job(cfg(), engine, position=position, checkpoint=(2, ck2), resumed=True, reward=quarter_reward)
    assert ctx.get(2, third)[0] == samples and engine.calls == 0


def test_a_rollout_file_written_before_checksums_still_loads(setup, caplog):
    from megatron_rl.infra import checksum

    cfg, ck2, position, path = _stored_run(setup)
    sealed = open(path, "rb").read()
    open(path, "wb").write(sealed[sealed.index(b"\n") + 1:])  # the bare torch.save bytes older versions wrote
    assert not open(path, "rb").read().startswith(checksum.BYTES_MAGIC)
    engine = CountingEngine()
    ctx, second = _job(cfg(), engine, position=position, checkpoint=(2, ck2), resumed=True, reward=quarter_reward)
    with caplog.at_level(logging.INFO, logger="megatron_rl"):
        samples, _ = ctx.get(2, second)
    assert engine.calls == 0 and {s.reward for s in samples} == {0.25}
    assert f"{path} has no checksum" in caplog.text and "not regenerated" in caplog.text


def _without_token_versions(samples):
    """Sample dicts as files written before ``Sample.token_versions`` existed hold them."""
    assert all("token_versions" in s for s in samples)
    return [{k: v for k, v in s.items() if k != "token_versions"} for s in samples]


def test_a_rollout_file_written_before_token_versions_still_loads(setup):
    import io

    from megatron_rl.infra import checksum
    from megatron_rl.rollout.rollout_ckpt import read_rollout_file

    cfg, ck2, position, path = _stored_run(setup)
    data = read_rollout_file(path)
    data["samples"] = _without_token_versions(data["samples"])
    buf = io.BytesIO()
    torch.save(data, buf)
    checksum.write_bytes(path, buf.getvalue())  # sealed, as the older version sealed it
    engine = CountingEngine()
    ctx, second = _job(cfg(), engine, position=position, checkpoint=(2, ck2), resumed=True, reward=quarter_reward)
    samples, _ = ctx.get(2, second)
    assert engine.calls == 0 and {s.reward for s in samples} == {0.25}
    assert all(s.token_versions == [] and s.staleness(2) == 0 for s in samples)


def test_a_debug_rollout_keeps_token_versions_and_an_older_file_loads(tmp_path):
    """``--save-debug-rollout-data`` / ``--load-debug-rollout-data`` files, before and after the field."""
    from megatron_rl.rollout.manager import load_rollout, save_rollout

    samples = [Sample(group_index=0, prompt_ids=[1], response_ids=[2, 3], weight_version=1, token_versions=[1, 2]),
               Sample(group_index=0, prompt_ids=[1], response_ids=[4], weight_version=2)]
    path = str(tmp_path / "rollout_0.pt")
    save_rollout(path, 0, samples)
    assert load_rollout(path) == samples
    old = str(tmp_path / "rollout_old.pt")
    torch.save({"rollout_id": 0, "samples": _without_token_versions([vars(s) for s in samples])}, old)
    loaded = load_rollout(old)
    assert [s.token_versions for s in loaded] == [[], []] and [s.weight_version for s in loaded] == [1, 2]
