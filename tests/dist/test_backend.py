"""MegatronBackend numerics: every layout equals the single-process run.

One 1-rank launch gives the reference; one 2-rank launch runs DP2 (plain and
distributed optimizer), TP2, PP2 and DP2 with dynamic batching (a token budget
that packs several samples per micro-batch, so packing differs from the
reference's one-sample micro-batches). Half the samples carry a loss mask with a span of zeros inside the
response (an agentic trajectory's tool observations): every layout must leave exactly those tokens out of
the loss and its gradients, as the single process does. Compared: no-grad log-probs (also against
HF transformers), per-step loss metrics and grad norm, and the full HF-layout
weights exported after each of 3 Adam steps (PPO loss + KL + entropy, grad clip).
"""

import json
import os
import sys

import pytest
import torch

from _util import check_logprobs_against_hf

pytestmark = pytest.mark.dist

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
LAYOUTS = ["", "--tensor-model-parallel-size=2", "--pipeline-model-parallel-size=2", "--context-parallel-size=2",
           "--pipeline-model-parallel-size=2,--virtual-pipeline-model-parallel-size=2",
           "--use-distributed-optimizer",
           "--use-dynamic-batch-size,--max-tokens-per-gpu=24",
           "--recompute-granularity=full", "--recompute-granularity=selective"]
MOE_LAYOUTS = ["", "--expert-model-parallel-size=2", "--pipeline-model-parallel-size=2"]  # qwen3_moe vs 1 process
# bf16 params with fp32 main params (megatron's Float16Module + mixed-precision optimizer)
BF16_LAYOUTS = ["--bf16", "--bf16,--use-distributed-optimizer"]
# DP2 x TP2 with sequence parallelism: log-probs shared within each DP rank's TP pair, and the output layer's
# loss rows gathered from the sequence-parallel slices (backends/megatron/backend.py::_output_rows)
FOUR_RANK_LAYOUTS = ["--tensor-model-parallel-size=2,--pipeline-model-parallel-size=2",
                     "--tensor-model-parallel-size=2,--sequence-parallel"]
# process groups destroyed and rebuilt before every step (--offload-train-groups on): bit for bit the
# layout without it. Last in the launch: once installed, every later group of the process is wrapped
# (the TP2 twin carries --offload-train, a no-op on CPU)
GROUPS = ",--offload-train-groups=on"
GROUPS_TWINS = {layout + GROUPS: layout for layout in
                ["--tensor-model-parallel-size=2,--offload-train", "--pipeline-model-parallel-size=2,--offload-train",
                 "--use-distributed-optimizer,--colocate"]}
SKIP_METRICS = {"train/step_time_s", "train/micro_batches"}
# --enable-mtp-training vs its one-process run: the MTP block on the last pipeline stage; each CP rank scoring the
# MTP rows of its shard (TP + SP and EP: tests/dist/test_parity_layouts.py, glm4_moe_mtp_*)
MTP_LAYOUTS = [",--pipeline-model-parallel-size=2", ",--context-parallel-size=2"]


def shared_launch(ctx):
    """The dense (qwen2) and MoE (qwen3_moe) models' runs (tests/_launches.py): the single-process references
    (plus the MoE's ``--enable-mtp-training`` one-process layout) and every parallel layout, in the group's
    launches. {name: (hf, reference record, reference dir, {layout: record}, parallel dir)}."""
    training = mtp_training_layout(ctx.tiny_hf_models)
    models = {
        "dense": (ctx.tiny_hf_models("qwen2"), (),
                  {2: LAYOUTS + BF16_LAYOUTS + list(GROUPS_TWINS.values()) + list(GROUPS_TWINS),
                   4: FOUR_RANK_LAYOUTS}),
        "moe": (ctx.tiny_hf_models("qwen3_moe"), (training,),
                {2: MOE_LAYOUTS + [mtp_layout(ctx.tiny_hf_models)] + [training + layout for layout in MTP_LAYOUTS]}),
    }
    mk = ctx.tmp_path_factory.mktemp
    dirs = {name: (mk(f"{name}_ref"), mk(f"{name}_par")) for name in models}
    jobs = {1: [("backend", [hf, dirs[name][0], "", *single]) for name, (hf, single, _) in models.items()]}
    for name, (hf, _, by_nproc) in models.items():
        for nproc, layouts in by_nproc.items():
            jobs.setdefault(nproc, []).append(("backend", [hf, dirs[name][1], *layouts]))
    yield jobs
    out = {}
    for name, (hf, _, by_nproc) in models.items():
        ref_dir, par_dir = dirs[name]
        par = {}
        for nproc in by_nproc:
            par.update(json.load(open(par_dir / f"results_w{nproc}.json")))
        out[name] = (hf, json.load(open(ref_dir / "results_w1.json"))["base"], ref_dir, par, par_dir)
    return out


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state["dense"]


def mtp_layout(tiny_hf_models):
    """A glm4_moe checkpoint with its MTP layer, the MTP block on the last of 2 pipeline stages (one more layout
    of the MoE launch)."""
    return (f"--hf-checkpoint={tiny_hf_models('glm4_moe', mtp=True)},--mtp-num-layers=1,"
            "--pipeline-model-parallel-size=2")


@pytest.fixture(scope="module")
def moe_runs(shared_launch_state):
    return shared_launch_state["moe"]


def mtp_training_layout(tiny_hf_models):
    """--enable-mtp-training on one process (a layout of the MoE launch's single-process run; at PP2 one more
    layout of its 2-rank launch)."""
    return (f"--hf-checkpoint={tiny_hf_models('glm4_moe', mtp=True)},--mtp-num-layers=1,--enable-mtp-training,"
            "--mtp-loss-scaling-factor=0.5")


def test_mtp_training_loss_matches_the_reference_and_trains_only_with_the_flag(moe_runs, tiny_hf_models):
    """--enable-mtp-training: the first step's train/mtp_loss (at the checkpoint's weights) equals the MTP
    loss computed from transformers' modules (tests/_mtp_reference.py) within 1e-5; the MTP layers then
    train (they have gradients and move) while the export, checkpoint and copies still round-trip. Without
    the flag they stay bitwise frozen (test above)."""
    rec = json.load(open(moe_runs[2] / "results_w1.json"))[mtp_training_layout(tiny_hf_models)]
    first = rec["steps"][0]["metrics"]
    assert abs(first["train/mtp_loss"] - rec["mtp_reference_loss"]) <= 1e-5, (first, rec["mtp_reference_loss"])
    assert rec["mtp_reference_loss"] > 1.0
    mtp = rec["mtp"]
    assert mtp["own_unchanged"] is False and mtp["mtp_grads"] > 0, mtp
    assert mtp["checkpoint_round_trip"] and mtp["names_equal"] and mtp["main_moved"] and mtp["copies_follow_main"], mtp


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_mtp_training_at_pp2_and_cp2_matches_one_process(moe_runs, tiny_hf_models, layout):
    """--enable-mtp-training with the MTP block on the last of 2 pipeline stages, or at 2 context-parallel ranks:
    every step's metrics (train/mtp_loss, grad norm), the synced weights and the trained MTP layer equal the
    single process's."""
    one = mtp_training_layout(tiny_hf_models)
    par = one + layout
    ref, rec = json.load(open(moe_runs[2] / "results_w1.json"))[one], moe_runs[3][par]
    assert abs(rec["mtp_reference_loss"] - ref["mtp_reference_loss"]) < 1e-9
    for step, (s0, s1) in enumerate(zip(ref["steps"], rec["steps"])):
        m0, m1 = s0["metrics"], s1["metrics"]
        assert set(m0) == set(m1) and "train/mtp_loss" in m0
        for k in set(m0) - SKIP_METRICS:
            assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5), (step, k)
        w0 = torch.load(moe_runs[2] / f"{one}_step{step}.pt".replace("/", "_"))
        w1 = torch.load(moe_runs[4] / f"{par}_step{step}.pt".replace("/", "_"))
        assert set(w0) == set(w1) and max((w0[n] - w1[n]).abs().max().item() for n in w0) < 2e-5, step
    assert ref["steps"][2]["metrics"]["train/mtp_loss"] < ref["steps"][0]["metrics"]["train/mtp_loss"] - 1.0
    t0 = torch.load(moe_runs[2] / f"{one}_mtp.pt".replace("/", "_"))
    t1 = torch.load(moe_runs[4] / f"{par}_mtp.pt".replace("/", "_"))
    assert len(t0) > 20 and set(t0) == set(t1) and max((t0[n] - t1[n]).abs().max().item() for n in t0) < 2e-5


def test_mtp_layers_stay_frozen_through_training_and_leave_the_weight_sync(moe_runs, tiny_hf_models):
    """--mtp-num-layers at PP2: three train steps move the model but not the MTP layers (no gradient, no
    optimizer state); the weight sync sends no MTP tensor; the full export keeps them, with the MTP layer's
    copies of the embedding / head following the trained main ones; a training checkpoint (with the MTP
    block, on the last stage) saves and loads back every value."""
    layout = mtp_layout(tiny_hf_models)
    rec = moe_runs[3][layout]
    assert rec["mtp"] == {"names_equal": True, "own_tensors": rec["mtp"]["own_tensors"], "own_unchanged": True,
                          "checkpoint_round_trip": True, "copies_follow_main": True, "main_moved": True,
                          "mtp_grads": 0}, rec["mtp"]
    assert rec["mtp"]["own_tensors"] > 20
    synced = torch.load(moe_runs[4] / f"{layout}_step2.pt".replace("/", "_"))
    assert synced and not any(n.startswith("model.layers.4.") for n in synced)
    assert all(s["metrics"]["train/grad_norm"] > 0 for s in rec["steps"])


def test_reference_logprobs_match_hf(runs):
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    hf, ref, *_ = runs
    check_logprobs_against_hf(hf, make_samples(250), ref["logprobs"])


def _compare(ref, ref_dir, par, par_dir, layout):
    rec = par[layout or "base"]
    # the per-stage export (one weight sender per pipeline stage): every rank of a stage exports the same
    # names, the stages partition the model, each tensor bit for bit the whole export's (rank 0's view)
    stages = rec["stage_export"]
    assert stages["equal"] and stages["same_within_stage"] and stages["partition"], (layout, stages)
    assert stages["stages"] == (2 if "pipeline-model-parallel-size=2" in layout else 1)
    assert stages["sources"][0] == 0
    lp = max(abs(a - b) for x, y in zip(ref["logprobs"], rec["logprobs"]) for a, b in zip(x, y))
    assert lp < 1e-5
    for step, (s0, s1) in enumerate(zip(ref["steps"], rec["steps"])):
        m0, m1 = s0["metrics"], s1["metrics"]
        assert set(m0) == set(m1)
        for k in set(m0) - SKIP_METRICS:
            assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5), (layout, step, k)
        w0 = torch.load(ref_dir / f"base_step{step}.pt")
        w1 = torch.load(par_dir / f"{layout or 'base'}_step{step}.pt")
        assert set(w0) == set(w1)
        worst = max((w0[n] - w1[n]).abs().max().item() for n in w0)
        assert worst < 2e-5, (layout, step, worst)
    # training moved the weights (the comparison is not between two untouched models)
    first = torch.load(ref_dir / "base_step0.pt")
    last = torch.load(ref_dir / "base_step2.pt")
    assert max((first[n] - last[n]).abs().max().item() for n in first) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS + FOUR_RANK_LAYOUTS)
def test_layout_matches_single_process(runs, layout):
    _compare(*runs[1:], layout)


@pytest.mark.parametrize("layout", list(GROUPS_TWINS))
def test_groups_torn_down_between_steps_train_bit_for_bit(runs, layout):
    """Every process group destroyed and rebuilt before each of the 3 steps (the colocated loop's
    teardown around a generation): the same metrics and exported weights, exactly."""
    _, _, _, par, par_dir = runs
    twin = GROUPS_TWINS[layout]
    drop = (lambda steps: [{k: v for k, v in s["metrics"].items() if k not in SKIP_METRICS} for s in steps])
    assert drop(par[layout]["steps"]) == drop(par[twin]["steps"])
    assert par[layout]["logprobs"] == par[twin]["logprobs"]
    for step in range(3):
        ours = torch.load(par_dir / f"{layout}_step{step}.pt")
        theirs = torch.load(par_dir / f"{twin}_step{step}.pt")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    for cycle in par[layout]["groups"]:
        assert cycle["destroyed"] == cycle["rebuilt"] > 5, cycle  # megatron's groups, this backend's too
        assert "is destroyed while the trainer sleeps (--offload-train-groups)" in cycle["error"]


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_moe_layout_matches_single_process(moe_runs, layout):
    _compare(*moe_runs[1:], layout)
    # the export (what every weight-sync transport sends) gives the dense tensors of every stage first,
    # then the experts: the saved dicts keep the export's order
    names = list(torch.load(moe_runs[4] / f"{layout or 'base'}_step0.pt"))
    first_expert = next(i for i, n in enumerate(names) if ".mlp.experts." in n)
    assert all(".mlp.experts." in n for n in names[first_expert:]), names


def test_bf16_training_tracks_fp32_and_is_layout_independent(runs):
    _, ref, ref_dir, par, par_dir = runs
    plain, distopt = (par[k] for k in BF16_LAYOUTS)
    lp = max(abs(a - b) for x, y in zip(ref["logprobs"], plain["logprobs"]) for a, b in zip(x, y))
    assert lp < 0.05  # bf16 weights/activations vs fp32
    for s0, s1 in zip(ref["steps"], plain["steps"]):
        assert s1["metrics"]["train/grad_norm"] == pytest.approx(s0["metrics"]["train/grad_norm"], rel=0.02)
    # After the first update the two bf16 runs (plain vs distributed optimizer, whose fp32
    # main params reduce in another order) differ by at most one bf16 rounding step (2^-7
    # relative, floor 2^-11 near zero). Later steps are compared through their metrics only:
    # Adam at lr 1e-2 amplifies one-ulp differences in tiny gradients beyond that bound.
    w_plain = torch.load(par_dir / f"{BF16_LAYOUTS[0]}_step0.pt")
    w_dist = torch.load(par_dir / f"{BF16_LAYOUTS[1]}_step0.pt")
    assert all(t.dtype == torch.bfloat16 for t in w_plain.values())
    for n in w_plain:
        a, b = w_plain[n].float(), w_dist[n].float()
        excess = ((a - b).abs() - 2 ** -7 * torch.maximum(a.abs(), b.abs()) - 2 ** -11).max().item()
        assert excess <= 0, (n, excess)
    for s0, s1 in zip(plain["steps"], distopt["steps"]):
        assert s1["metrics"]["train/grad_norm"] == pytest.approx(s0["metrics"]["train/grad_norm"], rel=0.01)
    assert distopt["steps"][-1]["metrics"]["train/update_skipped"] == 0.0


def test_each_data_parallel_rank_keeps_the_log_probs_it_trains_on(runs):
    """The owner-aligned forward (``plan_rollout`` + ``owned_only``): every rank holds exactly its DP
    rank's samples, bitwise the values a full gather of the same plan gives, None for the others;
    the DP ranks' shares cover the batch once. (Training on them is what the layout tests compare.)"""
    _, ref, _, par, _ = runs
    for layout, rec in {"": ref, **par}.items():
        checks = rec["owned"]
        assert all(c["forward_plan_follows_steps"] and c["bitwise_equal_to_full_gather"] for c in checks), layout
        by_dp = {}
        for c in checks:
            by_dp.setdefault(c["dp_rank"], set()).add(tuple(c["samples"]))
        assert all(len(v) == 1 for v in by_dp.values()), (layout, by_dp)  # peers agree
        shares = [s for v in by_dp.values() for s in next(iter(v))]
        assert sorted(shares) == list(range(6)), (layout, by_dp)


def test_forward_only_passes_compute_no_entropy(runs):
    """The old/ref log-prob passes ask the log-prob op for log-probs alone (entropy is an extra pass
    over the vocab that they would throw away); the training steps ask for entropy (their loss and
    metrics use it, and the layout tests compare those metrics). Rank 0's record of every layout."""
    _, ref, _, par, _ = runs
    for layout, rec in {"": ref, **par}.items():
        if "--pipeline-model-parallel-size=2" in layout:  # rank 0 is the first stage: it computes no log-probs
            continue
        assert rec["entropy_asked"] == {"forward": [False], "train": [True]}, (layout, rec["entropy_asked"])
        # the output projection fused into the log-prob op by row chunks (ops/linear_logprob.py), every pass
        assert rec["projected"] == [True], (layout, rec["projected"])
