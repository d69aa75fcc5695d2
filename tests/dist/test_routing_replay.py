"""MoE routing replay (--use-routing-replay, R2) on a tiny qwen3_moe: every layout equals the single process.

One 1-rank launch gives the reference, one 2-rank launch runs EP2, PP2 with full activation recompute (a
forward re-run inside the backward replays from megatron's FIFO), CP2, and TP2 + sequence parallelism +
EP2. Per layout (tests/dist/scripts/routing_worker.py): the routes the old-log-prob pass records, gathered
per sample and layer, equal the single process's bit for bit; replaying them, the trainer's own router
agrees on every token; with forced routes (every token to experts 0 and 1) the log-probs and the training
step's metrics equal the single process's under the same routes, the router's own choice disagrees as
often, and only experts 0 and 1 get a gradient. Then R3: the samples carry an engine's routes
(``Sample.routed_experts``, every token to experts 2 and 3); every pass replays them with nothing recorded,
the forward and the step equal the single process's and only experts 2 and 3 get a gradient.
"""

import json

import pytest

pytestmark = pytest.mark.dist


LAYOUTS = ["--expert-model-parallel-size=2", "--pipeline-model-parallel-size=2,--recompute-granularity=full",
           "--context-parallel-size=2",
           "--tensor-model-parallel-size=2,--sequence-parallel,--expert-model-parallel-size=2,"
           "--expert-tensor-parallel-size=1"]
SKIP_METRICS = {"train/micro_batches"}


def shared_launch(ctx):
    """The single-process reference and every layout (tests/_launches.py, scripts/routing_worker.py)."""
    hf = ctx.tiny_hf_models("qwen3_moe")
    ref_dir, par_dir = ctx.tmp_path_factory.mktemp("replay_ref"), ctx.tmp_path_factory.mktemp("replay_par")
    yield {1: [("routing", [hf, ref_dir, ""])], 2: [("routing", [hf, par_dir, *LAYOUTS])]}
    return (json.load(open(ref_dir / "results_w1.json"))["base"], json.load(open(par_dir / "results_w2.json")))


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


def test_single_process_replays_and_forces_routes(runs):
    ref, _ = runs
    assert ref["natural_agreement"] == 1.0
    forced = ref["forced_metrics"]["train/route_agreement"]
    assert 0.0 < forced < 0.9  # the forced routes are not the router's own choice
    assert ref["expert_has_grad"] == {"0": True, "1": True, "2": False, "3": False}
    # every sample and MoE layer has a route per token, and they are not all experts 0/1 already
    assert len(ref["routes"]) == 6 and all(len(by_layer) == 4 for by_layer in ref["routes"].values())
    assert any(sorted(r) != [0, 1] for by_layer in ref["routes"].values() for rs in by_layer.values() for r in rs)
    assert ref["r3_expert_has_grad"] == {"0": False, "1": False, "2": True, "3": True}
    assert 0.0 < ref["r3_metrics"]["train/route_agreement"] < 0.9
    assert ref["r3_logprobs"] != ref["forced_logprobs"]  # other experts, other numbers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_replays_as_the_single_process(runs, layout):
    ref, par = runs
    rec = par[layout]
    assert rec["routes"] == ref["routes"]  # recorded, gathered over TP/SP, CP and pipeline stages: bitwise
    assert rec["natural_agreement"] == 1.0
    lp = max(abs(a - b) for x, y in zip(ref["forced_logprobs"], rec["forced_logprobs"]) for a, b in zip(x, y))
    assert lp < 1e-5, (layout, lp)
    m0, m1 = ref["forced_metrics"], rec["forced_metrics"]
    assert set(m0) == set(m1)
    for k in set(m0) - SKIP_METRICS:
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5), (layout, k)
    assert rec["expert_has_grad"] == ref["expert_has_grad"]
    # R3: the rollout's routes, from the samples
    lp = max(abs(a - b) for x, y in zip(ref["r3_logprobs"], rec["r3_logprobs"]) for a, b in zip(x, y))
    assert lp < 1e-5, (layout, lp)
    m0, m1 = ref["r3_metrics"], rec["r3_metrics"]
    assert set(m0) == set(m1)
    for k in set(m0) - SKIP_METRICS:
        assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5), (layout, k)
    assert rec["r3_expert_has_grad"] == ref["r3_expert_has_grad"]
