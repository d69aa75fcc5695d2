"""``EmbeddedEngine.generate_continuous``: rows joining a running batch at any step give the tokens ``generate``
gives them alone (their own uniforms, positions and budget; log-probs to float32 rounding), a retract pause
with an update mid-batch re-prefills every row under the new weights as ``generate`` does, and a row ends
the step it finishes. Joins happen at fixed step indices (``take`` counts its calls): no timing involved."""

import threading

import pytest

from _util import InThread
from megatron_rl.errors import ConfigError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.embedded import EngineRow, row_seed

REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42, 7, 8, 60], 1),
            GenerateRequest([11, 12], 2)]
SAMPLING = SamplingParams(temperature=0.9, max_new_tokens=8, seed=11, n=2, ignore_eos=True,
                          stop_token_ids=tuple(range(0, 250, 29)))
SHARED = SamplingParams(temperature=0.9, ignore_eos=True, stop_token_ids=SAMPLING.stop_token_ids)
BOUND_S = 300


def rows_arriving(schedule, budgets, one_call=False):
    """``take`` for ``generate_continuous``: at its k-th call, the rows ``schedule[k]`` names ((request, sample)
    pairs, seeded as ``generate`` seeds request i's sample j when called with that one request, or with all
    of ``REQUESTS`` in one call: ``one_call``)."""
    calls, names = [0], {}

    def take(room):
        k = calls[0]
        calls[0] += 1
        out = []
        for i, j in schedule.get(k, []):
            row = EngineRow(list(REQUESTS[i].prompt_ids), row_seed(SAMPLING.seed, i if one_call else 0, j),
                            budgets.get(i, 8))
            names[id(row)] = (i, j)
            out.append(row)
        return out

    return take, names


def run(engine, schedule, budgets=None, one_call=False):
    take, names = rows_arriving(schedule, budgets or {}, one_call)
    ended, order = {}, []

    def finish(row, output):
        ended[names[id(row)]] = output
        order.append(names[id(row)])

    engine.generate_continuous(SHARED, take, finish)
    return ended, order


def alone(engine, i, budget=8):
    return engine.generate([REQUESTS[i]], SamplingParams(**{**SAMPLING.__dict__, "max_new_tokens": budget}))


def test_rows_joining_at_any_step_get_the_tokens_they_get_alone(models):
    engine = EmbeddedEngine(models[0])
    budgets = {2: 5}
    ended, order = run(engine, {0: [(0, 0), (0, 1)], 2: [(1, 0), (1, 1)], 5: [(2, 0), (2, 1)]}, budgets)
    assert sorted(ended) == [(i, j) for i in range(3) for j in range(2)]
    for (i, j), out in ended.items():
        want = alone(engine, i, budgets.get(i, 8))[j]
        assert out.response_ids == want.response_ids and out.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(out.logprobs, want.rollout_logprobs)) < 1e-5
        assert out.versions == [0] * len(out.response_ids)
    # each row ended the step it finished, not with the batch: the first pair never waits for the last
    first_done = max(order.index((0, j)) for j in range(2))
    assert first_done < min(order.index((2, j)) for j in range(2)) or len(ended[(0, 0)].response_ids) < 8


def test_a_batch_that_never_drains_attends_over_its_live_rows_only(models):
    """Rows joining every 4 steps for 32 steps (asynchronous RL's pattern): the batch never empties, yet the
    positions each step attends over stay within its longest live row (the finished rows' padding columns
    leave with them); each row still gets ``generate``'s tokens."""
    engine = EmbeddedEngine(models[0])
    widths, calls, names = [], [0], {}
    forward, decode_step = engine.model.forward, engine._decode_step
    engine.model.forward = lambda *a, **kw: widths.append(kw["attention_mask"].shape[1]) or forward(*a, **kw)
    # the decode steps (the lean step calls no model forward): the width each one attends over
    engine._decode_step = lambda ids, mask, *rest: widths.append(mask.shape[1]) or decode_step(ids, mask, *rest)

    def take(room):
        k = calls[0]
        calls[0] += 1
        if k % 4 or k >= 32:
            return []
        i = (k // 4) % len(REQUESTS)
        rows = [EngineRow(list(REQUESTS[i].prompt_ids), row_seed(SAMPLING.seed, 0, j), 8) for j in range(2)]
        names.update({id(row): (i, j) for j, row in enumerate(rows)})
        return rows

    ended = []  # no stop tokens: every row runs its 8 steps, so each wave overlaps the next
    engine.generate_continuous(SamplingParams(temperature=0.9, ignore_eos=True), take,
                               lambda row, out: ended.append((names[id(row)], out)))
    assert len(ended) == 16 and calls[0] > 32  # every row ended; rows joined until the last wave
    longest = max(len(r.prompt_ids) for r in REQUESTS) + 8
    assert max(widths) <= 2 * longest, f"the batch's width grew with its age: {max(widths)} positions"
    sampling = SamplingParams(temperature=0.9, max_new_tokens=8, seed=SAMPLING.seed, n=2, ignore_eos=True)
    wants = {i: engine.generate([request], sampling) for i, request in enumerate(REQUESTS)}
    for (i, j), out in ended:
        want = wants[i][j]
        assert out.response_ids == want.response_ids and len(out.response_ids) == 8
        assert max(abs(a - b) for a, b in zip(out.logprobs, want.rollout_logprobs)) < 1e-5


def test_a_retract_update_mid_batch_equals_generates_own(models):
    """Both rows pairs joined at step 0 are parked at step 3, version 1 loaded, continued: each token carries its
    version and equals what ``generate`` draws under the same pause."""
    results = {}
    for how in ("continuous", "generate"):
        engine = EmbeddedEngine(models[0])
        fired = []

        def hook(at, engine=engine, fired=fired):
            if at == 3 and not fired:
                fired.append(at)
                engine.pause("retract")

        engine.step_boundary_hook = hook
        if how == "continuous":
            running = InThread(lambda engine=engine: run(engine, {0: [(0, 0), (0, 1), (1, 0), (1, 1)]},
                                                               one_call=True)[0],
                               bound_s=BOUND_S, what="the continuous batch")
        else:
            running = InThread(lambda engine=engine: engine.generate(REQUESTS[:2], SAMPLING), bound_s=BOUND_S,
                               what="the generate")
        engine.wait_paused(BOUND_S)
        engine.update_weights_from_disk(models[1], 1)
        engine.continue_()
        results[how] = running.result()
    for k, want in enumerate(results["generate"]):
        got = results["continuous"][(k // 2, k % 2)]
        assert got.response_ids == want.response_ids
        assert got.versions == want.effective_token_versions() and 0 in got.versions and 1 in got.versions
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.rollout_logprobs)) < 1e-5


def test_a_cancelled_row_ends_alone_and_an_abort_pause_ends_them_all(models):
    engine = EmbeddedEngine(models[0])
    cancel = threading.Event()
    take, names = rows_arriving({0: [(0, 0), (0, 1)]}, {})

    def take_and_mark(room):
        rows = take(room)
        if rows:
            rows[1].cancel = cancel
        return rows

    engine.step_boundary_hook = lambda at: cancel.set() if at == 2 else None
    ended = {}
    engine.generate_continuous(SHARED, take_and_mark, lambda row, out: ended.__setitem__(names[id(row)], out))
    assert ended[(0, 1)].finish_reason == "abort" and len(ended[(0, 1)].response_ids) == 3
    assert len(ended[(0, 0)].response_ids) == 8 or ended[(0, 0)].finish_reason == "stop"
    engine.step_boundary_hook = lambda at: engine.pause("abort") if at == 2 else None
    ended, _ = run(engine, {0: [(1, 0), (1, 1)]})
    assert {o.finish_reason for o in ended.values()} == {"abort"} and {len(o.response_ids) for o in ended.values()} == {2}
    engine.continue_()


def test_a_model_whose_cache_cannot_merge_is_refused(models, monkeypatch):
    engine = EmbeddedEngine(models[0])
    monkeypatch.setattr(type(engine), "joins_rows", property(lambda self: False))
    with pytest.raises(ConfigError, match="use generate_rows"):
        engine.generate_continuous(SHARED, lambda room: [], lambda row, out: None)
