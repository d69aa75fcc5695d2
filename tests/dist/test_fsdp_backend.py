"""FSDPBackend numerics: HF's own log-probs, DP2 and DP4 equal to one process, and equal to the MegatronBackend.

One 2-rank launch runs FSDP at DP2 on a tiny qwen2 with one sample per micro-batch, with
dynamic batching (several samples padded into one micro-batch, and a different split),
with --bf16, with --recompute-granularity full, with --optimizer-cpu-offload, with --fp16
(a scale that fits, and megatron's 2**32 that overflows), on a tiny qwen3_moe, and saves /
resumes DCP checkpoints. One 1-rank launch runs the FSDP and the megatron backend on the same
models, batch and flags (tests/dist/scripts/backend_worker.py's) and resumes the DP2
checkpoints at DP1. One 4-rank launch runs the dynamic-batching case at DP4. Compared: no-grad log-probs, per-step loss metrics and grad norm, and
the full HF-layout weights exported after each of 3 Adam steps (PPO loss + KL + entropy,
grad clip). Checkpoints: saved at DP2 after 3 steps, resumed at DP2 (the 4th step bitwise
equal to the uninterrupted one) and at DP1 (resharded: equal within summation order); the DP2
checkpoint is also exported with tools/convert_ckpt.py fsdp-to-hf (equal to the run's exported weights).
LoRA (``--lora-rank 4 --lora-alpha 8 --lora-load`` of a PEFT dir with random A and B, so both backends start
from the same nonzero adapters): FSDP at DP2 and DP1 and the megatron backend at DP1 give the same log-probs,
metrics and merged exported weights; the FSDP optimizer holds the adapters only and the base never moves.

Tolerances: FSDP2 at DP2 reduce-scatters per-rank gradient sums, so parameters differ
from one process by fp32 summation order (~6e-6 after 3 steps, measured on a tiny Qwen2 over 2 gloo ranks);
megatron's attention and GEMMs differ from HF's SDPA by float rounding (its own layout
test uses the same 1e-5 / 2e-5 bounds; measured here ~5e-7 / ~1e-6).
"""

import json
import os
import sys

import pytest
import torch

from _util import REPO, check_logprobs_against_hf

pytestmark = pytest.mark.dist

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
DP4_RUN = "fsdp:--use-dynamic-batch-size,--max-tokens-per-gpu=24"
FP16, FP16_OVERFLOW = "fsdp:--fp16,--initial-loss-scale=1024", "fsdp:--fp16"
DP2_RUNS = ["fsdp", "fsdp:--use-dynamic-batch-size,--max-tokens-per-gpu=24", "fsdp:--bf16",
            "fsdp:--recompute-granularity=full", "fsdp:--optimizer-cpu-offload", FP16]
SKIP_METRICS = {"train/step_time_s", "train/micro_batches", "mlp0_forwards"}
OTHER_FAMILIES = ("gpt_oss", "gemma3_text")  # one process each, FSDP vs megatron


def _random_peft_dir(hf: str, out) -> str:
    """A PEFT LoRA adapter (r 4, alpha 8, all-linear) of ``hf`` with random A and B, as PEFT saves it."""
    from peft import LoraConfig, get_peft_model
    import transformers

    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out))
    return str(out)


def shared_launch(ctx):
    """One phase of the group's launches (tests/_launches.py): the DP2 and DP4 runs, then one process (its
    1-rank launch runs after them: it resumes the DP2 checkpoints)."""
    tmp_path_factory, tiny_hf_models = ctx.tmp_path_factory, ctx.tiny_hf_models
    hf, moe = tiny_hf_models("qwen2"), tiny_hf_models("qwen3_moe")
    others = [tiny_hf_models(f) for f in OTHER_FAMILIES]
    one, two = tmp_path_factory.mktemp("fsdp_w1"), tmp_path_factory.mktemp("fsdp_w2")
    ckpt, ckpt16 = tmp_path_factory.mktemp("fsdp_ckpt"), tmp_path_factory.mktemp("fsdp_ckpt16")
    lora_ckpt = tmp_path_factory.mktemp("fsdp_lora_ckpt")
    lora = f"--lora-rank=4,--lora-alpha=8,--lora-load={_random_peft_dir(hf, tmp_path_factory.mktemp('peft'))}"
    # DP2: the runs, a DCP checkpoint after 3 steps (then a 4th step) and a resume from it at DP2, the MoE
    # model, and an overflowing fp16 run that saves its loss scaler
    dp2 = [("fsdp", [hf, two, *DP2_RUNS, f"fsdp:+save={ckpt}", f"fsdp:+load={ckpt}", f"fsdp:+hf={moe}",
                     f"{FP16_OVERFLOW},+save={ckpt16}", f"fsdp:{lora},+as=fsdp_lora",
                     f"fsdp:{lora},+as=fsdp_lora_saved,+save={lora_ckpt}"])]
    # DP4: uneven shares of the 6 samples (dynamic batching; one sample per micro-batch does not divide)
    four = tmp_path_factory.mktemp("fsdp_w4")
    # one process (the phase's 1-rank launch, after its 2- and 4-rank ones: tests/_launches.py): FSDP and
    # megatron (dense and MoE), and the DP2 checkpoints resumed at DP1
    yield {2: dp2, 4: [("fsdp", [hf, four, DP4_RUN])],
           1: [("fsdp", [hf, one, "fsdp", "megatron", f"fsdp:+load={ckpt}", f"fsdp:+hf={moe}",
                         f"megatron:+hf={moe}", f"{FP16_OVERFLOW},+load={ckpt16}", f"fsdp:{lora},+as=fsdp_lora",
                         f"megatron:{lora},+as=megatron_lora",
                         *[f"{b}:+hf={d},+as={b}_{f}" for f, d in zip(OTHER_FAMILIES, others)
                           for b in ("fsdp", "megatron")]])]}
    return (hf, json.load(open(one / "results_w1.json")), one, json.load(open(two / "results_w2.json")), two, ckpt,
            moe, ckpt16, json.load(open(four / "results_w4.json")), four, lora_ckpt)


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    return shared_launch_state


def _compare(ref, ref_dir, ref_run, rec, rec_dir, run, lp_tol=1e-5, w_tol=2e-5):
    lp = max(abs(a - b) for x, y in zip(ref["logprobs"], rec["logprobs"]) for a, b in zip(x, y))
    assert lp < lp_tol, (run, lp)
    for step, (s0, s1) in enumerate(zip(ref["steps"], rec["steps"])):
        m0, m1 = s0["metrics"], s1["metrics"]
        assert set(m0) - SKIP_METRICS == set(m1) - SKIP_METRICS, (run, set(m0) ^ set(m1))
        for k in set(m0) - SKIP_METRICS:
            assert m1[k] == pytest.approx(m0[k], rel=1e-4, abs=1e-5), (run, step, k)
        w0 = torch.load(ref_dir / f"{ref_run}_step{step}.pt")
        w1 = torch.load(rec_dir / f"{run}_step{step}.pt")
        assert set(w0) == set(w1), (run, set(w0) ^ set(w1))
        worst = max((w0[n] - w1[n]).abs().max().item() for n in w0)
        assert worst < w_tol, (run, step, worst)
    first, last = (torch.load(ref_dir / f"{ref_run}_step{s}.pt") for s in (0, 2))
    assert max((first[n] - last[n]).abs().max().item() for n in first) > 1e-3  # training moved the weights


def test_forward_logprobs_match_hf_transformers(runs):
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    hf, one, *_ = runs
    check_logprobs_against_hf(hf, make_samples(250), one["fsdp"]["logprobs"])


def test_exported_weights_carry_the_hf_checkpoint_names(runs):
    from safetensors.torch import load_file

    hf, _, one, *_ = runs
    stored = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(hf, f)))
    exported = torch.load(one / "fsdp_step0.pt")
    assert set(exported) == set(stored)
    assert all(exported[n].shape == stored[n].shape and exported[n].dtype == torch.float32 for n in stored)


@pytest.mark.parametrize("run", DP2_RUNS[:2])
def test_data_parallel_steps_equal_one_process(runs, run):
    _, one, one_dir, two, two_dir, *_ = runs
    _compare(one["fsdp"], one_dir, "fsdp", two[run], two_dir, run)


def test_four_data_parallel_ranks_equal_one_process(runs):
    _, one, one_dir, *_, four, four_dir, _ = runs
    _compare(one["fsdp"], one_dir, "fsdp", four[DP4_RUN], four_dir, DP4_RUN)


def test_fsdp_steps_equal_megatron_backend(runs):
    _, one, one_dir, *_ = runs
    _compare(one["megatron"], one_dir, "megatron", one["fsdp"], one_dir, "fsdp")


def test_moe_family_equals_megatron_and_data_parallel(runs):
    """qwen3_moe: transformers 5 fuses the experts on load; the export gives the checkpoint's
    per-expert names back (what the engine and megatron's export carry)."""
    _, one, one_dir, two, two_dir, _, moe, *_ = runs
    run, meg = f"fsdp:+hf={moe}", f"megatron:+hf={moe}"
    _compare(one[meg], one_dir, meg.replace("/", "_"), one[run], one_dir, run.replace("/", "_"))
    _compare(one[run], one_dir, run.replace("/", "_"), two[run], two_dir, run.replace("/", "_"))


def test_each_rank_keeps_the_log_probs_it_trains_on(runs):
    _, one, _, two, *_ = runs
    for run, rec in {**{f"w1 {k}": v for k, v in one.items()}, **two}.items():
        checks = rec["owned"]
        assert all(c["bitwise_equal_to_full_gather"] for c in checks), run
        assert sorted(i for c in checks for i in c["samples"]) == list(range(6)), run


def test_full_recompute_is_bitwise_and_recomputes(runs):
    """--recompute-granularity full: every decoder layer runs its forward again in the backward,
    and the step is bitwise the one without recompute."""
    _, _, _, two, two_dir, *_ = runs
    run = "fsdp:--recompute-granularity=full"
    for s0, s1 in zip(two["fsdp"]["steps"], two[run]["steps"]):
        m0, m1 = s0["metrics"], s1["metrics"]
        assert m1["mlp0_forwards"] == 2 * m0["mlp0_forwards"] == 2 * m0["train/micro_batches"]
        assert {k: v for k, v in m0.items() if k not in SKIP_METRICS} == \
            {k: v for k, v in m1.items() if k not in SKIP_METRICS}
    for step in range(3):
        w0, w1 = (torch.load(two_dir / f"{r}_step{step}.pt") for r in ("fsdp", run))
        assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_weight_tags_swap_local_shards(runs):
    """The reference snapshot and an HF --ref-load of the initial checkpoint give the initial
    log-probs back exactly (DP1 and DP2), and the trained actor is restored afterwards."""
    _, one, _, two, *_ = runs
    for rec in (one["fsdp"], two["fsdp"]):
        tags = rec["tags"]
        assert tags["snapshot_vs_initial"] == 0.0 and tags["hf_load_vs_initial"] == 0.0, tags
        assert tags["actor_after_vs_initial"] > 1e-2, tags


def test_bf16_tracks_fp32(runs):
    _, one, _, two, two_dir, *_ = runs
    ref, bf16 = one["fsdp"], two["fsdp:--bf16"]
    lp = max(abs(a - b) for x, y in zip(ref["logprobs"], bf16["logprobs"]) for a, b in zip(x, y))
    assert lp < 0.05  # bf16 compute vs fp32
    for s0, s1 in zip(ref["steps"], bf16["steps"]):
        assert s1["metrics"]["train/grad_norm"] == pytest.approx(s0["metrics"]["train/grad_norm"], rel=0.02)
    weights = torch.load(two_dir / "fsdp:--bf16_step2.pt")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())  # exported as the engine gets them


def test_cpu_offload_is_bitwise_the_step_without_it(runs):
    """--optimizer-cpu-offload (FSDP2's CPUOffloadPolicy): every sharded parameter is marked for
    host offload; on a CPU the shards were in host memory already, so the same maths must give
    the same bits through the offload code path. Device memory freed: scripts/gpu_check.sh."""
    _, _, _, two, two_dir, *_ = runs
    run = "fsdp:--optimizer-cpu-offload"
    assert (two[run]["offload_to_cpu"], two["fsdp"]["offload_to_cpu"]) == ([True], [False])  # the policy reached FSDP2
    for s0, s1 in zip(two["fsdp"]["steps"], two[run]["steps"]):
        assert {k: v for k, v in s0["metrics"].items() if k not in SKIP_METRICS} == \
            {k: v for k, v in s1["metrics"].items() if k not in SKIP_METRICS}
    for step in range(3):
        w0, w1 = (torch.load(two_dir / f"{r}_step{step}.pt") for r in ("fsdp", run))
        assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_fp16_with_loss_scaling_tracks_fp32(runs):
    """--fp16 --initial-loss-scale 1024: no overflow, every step taken at that scale (the window of
    1000 clean steps is not reached), gradients unscaled to fp32's within fp16 rounding."""
    _, one, one_dir, two, two_dir, *_ = runs
    ref, half = one["fsdp"], two[FP16]
    for s0, s1 in zip(ref["steps"], half["steps"]):
        m0, m1 = s0["metrics"], s1["metrics"]
        assert (m1["train/loss_scale"], m1["train/update_skipped"]) == (1024.0, 0.0)
        assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=0.01)
    for step in range(3):
        w0, w1 = torch.load(one_dir / f"fsdp_step{step}.pt"), torch.load(two_dir / f"{FP16}_step{step}.pt")
        assert all(t.dtype == torch.float16 for t in w1.values())  # exported as the engine gets them
        assert max((w0[n] - w1[n].float()).abs().max().item() for n in w0) < 0.01


def test_fp16_overflow_skips_the_step_on_every_rank_and_backs_off(runs):
    """--fp16 at megatron's initial scale 2**32: the tiny model's gradients overflow fp16, so every
    step is skipped on BOTH ranks (the exported weights, gathered from both ranks' shards, stay the
    initial ones) and the scale follows megatron's hysteresis: 2**32, 2**32, then halving. The
    checkpoint after 3 steps holds the scaler: resumed at DP1, the 4th step runs at 2**30 as the
    uninterrupted run did, not at a fresh 2**32."""
    from safetensors.torch import load_file

    hf, one, _, two, two_dir, _, _, ckpt16, *_ = runs
    saved = f"{FP16_OVERFLOW},+save={ckpt16}"
    steps = [s["metrics"] for s in two[saved]["steps"]]
    assert [m["train/loss_scale"] for m in steps] == [2.0 ** 32, 2.0 ** 32, 2.0 ** 31, 2.0 ** 30]
    assert all(m["train/update_skipped"] == 1.0 and m["train/grad_norm"] != m["train/grad_norm"] for m in steps)
    initial = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            initial.update(load_file(os.path.join(hf, f)))
    for step in range(4):
        w = torch.load(two_dir / f"{saved}_step{step}.pt".replace("/", "_"))
        assert all(torch.equal(w[n], initial[n].to(torch.float16)) for n in w)
    resumed = one[f"{FP16_OVERFLOW},+load={ckpt16}"]["steps"]
    assert [s["metrics"]["train/loss_scale"] for s in resumed] == [2.0 ** 30]


def test_dcp_checkpoint_resumes_exactly_at_dp2_and_resharded_at_dp1(runs):
    _, one, one_dir, two, two_dir, ckpt, *_ = runs
    saved = f"fsdp:+save={ckpt}"
    root = ckpt / "iter_0000003"
    meta = json.load(open(root / "COMPLETE.json"))
    assert meta["format"] == "megatron_rl.fsdp_dcp.v1" and meta["layout"] == {"backend": "fsdp", "dp": 2,
                                                                               "world_size": 2}
    assert {"extra_state.json", "hf_config/config.json", "rng/rank_00000.pt", ".metadata"} <= \
        {e["path"] for e in meta["files"]}
    want = two[saved]["steps"][3]["metrics"]
    w_want = torch.load(two_dir / f"{saved}_step3.pt".replace("/", "_"))
    resumed = f"fsdp:+load={ckpt}"
    for rec, rec_dir, exact in ((two[resumed], two_dir, True), (one[resumed], one_dir, False)):
        assert rec["extra_state"] == {"rollout_id": 3}
        got = rec["steps"][0]["metrics"]
        w_got = torch.load(rec_dir / f"fsdp:+load={ckpt}_step3.pt".replace("/", "_"))
        worst = max((w_want[n] - w_got[n]).abs().max().item() for n in w_want)
        if exact:  # same layout: model, optimizer, scheduler and RNG restored bitwise
            assert {k: v for k, v in got.items() if k != "train/step_time_s"} == \
                {k: v for k, v in want.items() if k != "train/step_time_s"}
            assert worst == 0.0
        else:
            for k in set(want) - SKIP_METRICS:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
            assert worst < 1e-6


def test_dp2_checkpoint_converts_to_hf_bit_exact(runs, tmp_path):
    """tools/convert_ckpt.py fsdp-to-hf on the DP2 checkpoint root (every tensor in two ranks' shards, read
    back in one process): exactly the fp32 weights the run exported after its 3rd step, under the HF
    checkpoint's names (one-rank, MoE, bf16 and the refusals: tests/convert/test_fsdp_convert.py)."""
    from megatron_rl.convert.fsdp_to_hf import convert_fsdp_to_hf
    from megatron_rl.models.hf_checkpoint import HFCheckpoint

    _, _, _, _, two_dir, ckpt, *_ = runs
    summary = convert_fsdp_to_hf(str(ckpt), str(tmp_path / "hf"), verify=True, show_progress=False)
    assert summary["source"] == str(ckpt / "iter_0000003") and summary["verified"]
    want = torch.load(two_dir / f"fsdp:+save={ckpt}_step2.pt".replace("/", "_"))
    got = HFCheckpoint(tmp_path / "hf")
    assert got.names() == set(want)
    assert all(torch.equal(got.read(n), want[n]) for n in want)


def test_lora_on_fsdp_equals_one_process_and_the_megatron_backend(runs):
    """PEFT's adapters in the FSDP2-sharded HF model: DP2 equals DP1, and DP1 equals the megatron backend's own
    adapters (models/lora.py) started from the same PEFT dir: log-probs, step metrics and the merged weights the
    engine gets after each step. The base is frozen: the optimizer holds exactly the adapters (A and B of the
    7 linears of every layer), the reference tag holds only them, every base shard is bitwise unchanged."""
    hf, one, one_dir, two, two_dir, *_ = runs
    layers = json.load(open(os.path.join(hf, "config.json")))["num_hidden_layers"]
    _compare(one["megatron_lora"], one_dir, "megatron_lora", one["fsdp_lora"], one_dir, "fsdp_lora")
    _compare(one["fsdp_lora"], one_dir, "fsdp_lora", two["fsdp_lora"], two_dir, "fsdp_lora")
    merged = torch.load(one_dir / "fsdp_lora_step0.pt")
    assert not any("lora" in n or "base_layer" in n for n in merged)  # plain HF names, adapters folded in
    for rec in (one["fsdp_lora"], two["fsdp_lora"]):
        lo = rec["lora"]
        assert len(lo["adapters"]) == layers * 7 * 2 and all(".lora_" in n for n in lo["adapters"])
        assert lo["optimizer_params"] == lo["adapters"] and lo["optimizer_state_params"] == len(lo["adapters"])
        assert lo["tag_tensors"] == lo["adapters"] and lo["snapshot_vs_initial"] == 0.0
        assert lo["frozen"] > 0 and lo["base_unchanged"]
    # --lora-sync adapter: each backend's export_adapters (gathered, PEFT's keys) merged as the engine merges them
    # (float32) is its merged export bit for bit; the two backends' adapters after 3 steps agree within the weights'
    # tolerance, as do FSDP at DP2 and DP1 (their gradients are summed in another order)
    for rec in (one["megatron_lora"], one["fsdp_lora"], two["fsdp_lora"]):
        sync = rec["adapter_sync"]
        assert sync["merge_max_diff"] == 0.0 and sync["others_are_base"], sync
        assert len(sync["keys"]) == layers * 7 * 2 and sync["r_alpha"] == [4, 8.0]
    mega, fsdp1, fsdp2 = (torch.load(d / f"{n}_adapter.pt") for d, n in
                          ((one_dir, "megatron_lora"), (one_dir, "fsdp_lora"), (two_dir, "fsdp_lora")))
    assert set(mega) == set(fsdp1) == set(fsdp2)
    assert max((mega[k].float() - fsdp1[k]).abs().max().item() for k in mega) <= 2e-5
    assert max((fsdp2[k] - fsdp1[k]).abs().max().item() for k in fsdp1) <= 2e-5


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_on_fsdp_equal_the_megatron_backend(runs, family):
    """gpt-oss (sinks, sliding windows, biased experts: transformers' eager attention, which it needs for the
    sinks) and Gemma 3 (zero-centred norms, soft-capping, per-layer RoPE) trained by FSDP equal the megatron
    bridge's model over 3 Adam steps (measured: log-probs 4.8e-7 / 9.5e-7, weights 1.1e-6 / 9.8e-7)."""
    _, one, one_dir, *_ = runs
    _compare(one[f"megatron_{family}"], one_dir, f"megatron_{family}", one[f"fsdp_{family}"], one_dir,
             f"fsdp_{family}")


def test_fsdp_lora_checkpoint_exports_a_peft_dir(runs, tmp_path):
    """fsdp-to-peft: the adapters of an FSDP LoRA checkpoint (DP2, after 3 steps) as a HF PEFT dir; PEFT merges
    it onto the base into the weights the run synced its engine with at that step (<= 1e-6); fsdp-to-hf names
    fsdp-to-peft for such a checkpoint."""
    import subprocess
    import sys

    import transformers
    from peft import PeftModel

    hf, _, _, _, two_dir, *_ = runs
    ckpt = runs[-1]
    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", "fsdp-to-peft", "--input", str(ckpt),
                           "--output", str(tmp_path / "peft")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(tmp_path / "peft")).merge_and_unload().state_dict()
    synced = torch.load(two_dir / "fsdp_lora_saved_step2.pt")
    assert max((synced[n] - merged[n]).abs().max().item() for n in synced) <= 1e-6
    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", "fsdp-to-hf", "--input", str(ckpt),
                           "--output", str(tmp_path / "hf"), "--no-progress"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "fsdp-to-peft" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
