"""The static-memory estimate (plan/memory.py, printed by --dry-run and tools/check_plan.py) against the bytes a real
backend holds after one training step, on 2 ranks (tests/dist/scripts/memory_worker.py).

One job in the ``megatron_ranks`` group's first 2-rank launch (tests/_launches.py): the tiny Qwen3-MoE at DP 2 (bf16,
distributed optimizer, tied embeddings, a KL reference as a weight tag), DP 2 with the optimizer offloaded to the CPU
(megatron-core's hybrid optimizer), TP 2 (plain optimizer), PP 2 with ppo's critic at its own TP 2, EP 2 (fp32),
LoRA with a ppo critic and a reference tag, and FSDP2 at DP 2; then six other families' models (no optimizer) at TP 2
/ EP 2 / PP 2 with MTP, counting parameters only.

Every kind (parameters, frozen parameters, gradient buffers, weight tags) must be within 1% of the estimate on every
rank; they are exact. The optimizer's state is the estimate's average shard: the distributed optimizer splits each
padded bucket evenly, so ranks differ by where the padding falls (up to ~2% on the LoRA critic's 7k elements); the
average over a stage's ranks must be within 1%, each rank within 2%, and each rank's total within 1%.
"""

import json

import pytest

pytestmark = pytest.mark.dist

JOB = "memory"  # tests/dist/scripts/memory_worker.py
BF16, DO = ["--bf16"], ["--use-distributed-optimizer"]


def _runs(hf, tied):
    from megatron_rl.models.hf_tiny import tiny_config

    def family(name, **kw):
        return tiny_config(name, **kw).to_dict()

    train = [
        dict(name="dp2", hf=tied, flags=BF16 + DO + ["--use-kl-loss"]),
        dict(name="dp2_offload", hf=hf, flags=BF16 + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]),
        dict(name="tp2", hf=hf, flags=BF16 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        dict(name="pp2_critic_tp2", hf=tied, flags=BF16 + DO + [
            "--pipeline-model-parallel-size", "2", "--advantage-estimator", "ppo", "--critic-tensor-model-parallel-size",
            "2", "--critic-pipeline-model-parallel-size", "1", "--sequence-parallel"]),
        dict(name="ep2_fp32", hf=hf, flags=DO + ["--expert-model-parallel-size", "2"]),
        dict(name="lora_ppo", hf=hf, flags=BF16 + DO + ["--lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj",
                                                        "v_proj", "o_proj", "--use-kl-loss", "--advantage-estimator",
                                                        "ppo"]),
        dict(name="fsdp_dp2", hf=hf, flags=["--train-backend", "fsdp", "--bf16"]),
    ]
    ep2 = dict(tp=2, ep=2, etp=1)
    shapes = [
        dict(name="deepseek_v3_tp2_ep2", config=family("deepseek_v3"), layout=ep2),
        dict(name="deepseek_v3_pp2_mtp", config=family("deepseek_v3", num_nextn_predict_layers=1), layout=dict(pp=2),
             mtp=1),
        dict(name="qwen3_next_tp2_ep2", config=family("qwen3_next"), layout=ep2),
        dict(name="gpt_oss_tp2_ep2", config=family("gpt_oss"), layout=ep2),
        dict(name="glm4_moe_tp2_ep2", config=family("glm4_moe"), layout=ep2),
        dict(name="gemma3_tp2", config=family("gemma3_text"), layout=dict(tp=2)),
    ]
    return train, shapes


def _activation_runs(ctx):
    """plan/activations.py at TP 2 with sequence parallelism (the local kernels' terms split over TP, the norms'
    and the linears' inputs over the sequence), a dense and a MoE model."""
    tp2_sp = dict(tp=2, sequence_parallel=True)
    return [dict(name="act_dense_tp2_sp", activations=True, hf=ctx.tiny_hf_models("qwen3"), layout=tp2_sp),
            dict(name="act_moe_tp2_sp", activations=True, hf=ctx.tiny_hf_models("qwen3_moe"), layout=tp2_sp)]


def shared_launch(ctx):
    """One phase-1 job of the group's 2-rank launch; the output dir and the runs."""
    hf = ctx.tiny_hf_models("qwen3_moe")
    tied = ctx.tiny_hf_models("qwen3_moe", tie_word_embeddings=True)
    out = ctx.tmp_path_factory.mktemp("memory")
    train, shapes = _runs(hf, tied)
    acts = _activation_runs(ctx)
    yield {2: [(JOB, [out, *(json.dumps(r) for r in train + shapes + acts)])]}
    return out, [r["name"] for r in train], [r["name"] for r in shapes], [r["name"] for r in acts]


@pytest.fixture(scope="module")
def runs(shared_launch_state):
    out, train, shapes, acts = shared_launch_state
    load = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]
            for name in train + shapes + acts}
    return load, train, shapes, acts


def _table(load, names):
    """The measured-vs-estimated figures, printed (pytest -s) for the record."""
    lines = []
    for name in names:
        for rank, rec in enumerate(load[name]):
            for comp, kinds in rec["measured"].items():
                for kind, value in kinds.items():
                    if kind == "names":
                        continue
                    est = rec["estimate"][comp].get(kind)
                    rel = f"{(est - value) / value:+.4%}" if est is not None and value else ""
                    lines.append(f"{name} rank {rank} {comp} {kind}: measured {value} estimated {est} {rel}")
    print("\n".join(lines))


def test_every_kind_of_static_memory_matches_the_estimate(runs):
    load, train, _, _ = runs
    _table(load, train)
    for name in train:
        recs = load[name]
        for rank, rec in enumerate(recs):
            for comp, kinds in rec["measured"].items():
                est = rec["estimate"][comp]
                for kind in ("params", "frozen", "grads", "tags", "param_elements"):
                    if kind in kinds and (kinds[kind] or est.get(kind)):
                        assert est[kind] == pytest.approx(kinds[kind], rel=0.01), (name, rank, comp, kind)
                if "optimizer" in kinds:
                    assert est["optimizer"] == pytest.approx(kinds["optimizer"], rel=0.02), (name, rank, comp)
                total = sum(v for k, v in kinds.items() if k in ("params", "frozen", "grads", "optimizer", "tags"))
                est_total = sum(v for k, v in est.items() if k in ("params", "frozen", "grads", "optimizer", "tags"))
                assert est_total == pytest.approx(total, rel=0.01), (name, rank, comp)
        # the optimizer's average over the ranks of one pipeline stage is the estimate's shard
        for comp in recs[0]["measured"]:
            by_stage: dict = {}
            for rec in recs:
                if "optimizer" in rec["measured"][comp]:
                    key = rec["estimate"][comp]["optimizer"]
                    by_stage.setdefault(key, []).append(rec["measured"][comp]["optimizer"])
            for est, measured in by_stage.items():
                assert est == pytest.approx(sum(measured) / len(measured), rel=0.01), (name, comp, measured)


def test_the_layouts_are_what_they_say(runs):
    """The runs really exercised sharding: DP 2 halves the optimizer state but not the gradient buffer, the offload
    run holds its optimizer state in the hybrid optimizer's host copies, the weight tags are two copies (the
    reference and the actor's kept values), PP 2 gives the two ranks different stages."""
    load, _, _, _ = runs
    dp2 = load["dp2"][0]["measured"]
    # two copies (the reference and the actor's kept values) of the bf16 parameters, unpadded
    assert dp2["tags"]["names"] == ["actor", "ref"] and dp2["tags"]["tags"] == 2 * 2 * dp2["actor"]["param_elements"]
    off = load["dp2_offload"][0]["measured"]["actor"]  # fp32 param, grad and two moments per element of the DP shard
    assert off["optimizer"] == pytest.approx(16 * off["param_elements"] / 2, rel=0.01)
    pp = [r["measured"]["actor"]["param_elements"] for r in load["pp2_critic_tp2"]]
    assert pp[0] != pp[1]
    lora = load["lora_ppo"][0]["measured"]
    assert lora["actor"]["frozen"] > 10 * lora["actor"]["params"] and lora["tags"]["names"] == ["actor", "ref"]


def test_parameter_splits_of_other_families(runs):
    """MLA (replicated down projections), gated delta-net, gpt-oss sinks and biases, shared experts and their
    gate, Gemma's extra norms, DeepSeek's MTP layer and its embedding copy on the last stage: exact on each rank."""
    load, _, shapes, _ = runs
    _table(load, shapes)
    for name in shapes:
        for rank, rec in enumerate(load[name]):
            assert rec["estimate"]["model"]["param_elements"] == rec["measured"]["model"]["param_elements"], (name, rank)


def test_activations_at_tp2_with_sequence_parallelism(runs):
    """The autograd graph's saved bytes on each TP rank within 10% of plan/activations.py's estimate."""
    load, _, _, acts = runs
    for name in acts:
        for rank, rec in enumerate(load[name]):
            print(f"{name} rank {rank} ({rec['seconds']:.1f} s): measured {rec['measured']} estimated {rec['estimate']} "
                  f"{rec['estimate'] / rec['measured'] - 1:+.2%}")
            assert rec["estimate"] == pytest.approx(rec["measured"], rel=0.10), (name, rank)
