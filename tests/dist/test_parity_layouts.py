"""fp32 parity of real megatron-core (CPU, gloo) with HF transformers across layouts.

Few launches, many layouts: each torchrun launch loops over layouts, re-initialising
megatron's parallel state (see scripts/parity_layouts.py). Per layout we assert
max |delta logit| <= 1e-5 against HF and against the launch's first (TP1/PP1, DP-only)
layout; for training layouts, gradients through megatron DDP + finalize_model_grads
equal HF autograd of the same loss, and one get_megatron_optimizer step (plain and
distributed optimizer) equals torch AdamW on HF. With the MTP block trained (``mtp_train``): the MTP loss
and its gradients equal the same loss built from transformers' modules (tests/_mtp_reference.py).
"""

import pytest

from _util import read_json

pytestmark = pytest.mark.dist

LOGIT_TOL = 1e-5
GRAD_RTOL = 1e-5
PARAM_TOL = 1e-6
MTP_LOSS_RTOL = 1e-5


def entry(name, family, path, tp=1, pp=1, vpp=0, cp=1, ep=1, etp=0, sp=0, checks="logits"):
    return f"{name}:{family}:{path}:{tp},{pp},{vpp},{cp},{ep},{etp},{sp}:{checks}"


def family_entries(family, path, moe=True):
    """The 2-rank layouts every family is held to (logits; qwen3 / qwen3_moe above go further): DP2
    first (the TP1/PP1 reference), TP2 (MoE: ETP1, as ETP2 does not run on gloo), PP2, CP2 and, for
    an MoE family, EP2 with gradients."""
    tp2 = entry(f"{family}_tp2", family, path, tp=2, etp=1 if moe else 0)
    ep2 = [entry(f"{family}_ep2", family, path, ep=2, checks="grads")] if moe else []
    return [entry(f"{family}_dp2", family, path), tp2, entry(f"{family}_pp2", family, path, pp=2), *ep2,
            entry(f"{family}_cp2", family, path, cp=2)]


def check(results):
    for name, r in results.items():
        print(name, {k: v for k, v in r.items() if k != "layout"})
    for name, r in results.items():
        assert r["vs_hf"] <= LOGIT_TOL, (name, r)
        assert r["vs_reference_layout"] <= LOGIT_TOL, (name, r)
        if "mtp_vs_reference" in r:
            assert r["mtp_vs_reference"] <= LOGIT_TOL and r["mtp_export_bit_exact"], (name, r)
        if "mtp_loss_rel_diff" in r:  # --enable-mtp-training's loss and gradients, the MTP layer's on their own
            assert r["mtp_loss_on_last_stage"] and 0.0 <= r["mtp_loss_rel_diff"] <= MTP_LOSS_RTOL, (name, r)
            for part in ("mtp", "shared"):
                assert r[f"{part}_grad_max_abs_diff"] <= GRAD_RTOL * max(1.0, r[f"{part}_grad_max_abs"]), (name, r)
        if "grad_max_abs_diff" in r and "distopt" not in name:
            assert r["grad_max_abs_diff"] <= GRAD_RTOL * max(1.0, r["grad_max_abs"]), (name, r)
        if "param_max_abs_diff_after_step" in r:
            assert r["optim_ok"], (name, r)
            assert abs(r["grad_norm"][0] - r["grad_norm"][1]) <= 1e-5 * r["grad_norm"][1], (name, r)
            assert r["param_max_abs_diff_after_step"] <= PARAM_TOL, (name, r)


def _two_rank_entries(tiny_hf_models):
    dense, moe = tiny_hf_models("qwen3"), tiny_hf_models("qwen3_moe")
    mixtral, glm = tiny_hf_models("mixtral"), tiny_hf_models("glm4_moe")
    llama, qwen2 = tiny_hf_models("llama"), tiny_hf_models("qwen2")
    deepseek, gptoss = tiny_hf_models("deepseek_v3"), tiny_hf_models("gpt_oss")
    gemma = tiny_hf_models("gemma3_text")
    qwen3_next = tiny_hf_models("qwen3_next")
    qwen3_next_dense = tiny_hf_models("qwen3_next", num_experts=0)
    qwen3_5, qwen3_5_moe = tiny_hf_models("qwen3_5_text"), tiny_hf_models("qwen3_5_moe_text")
    glm_mtp = tiny_hf_models("glm4_moe", mtp=True)
    entries = [
        entry("dense_dp2", "qwen3", dense, checks="grads+optim"),
        entry("dense_tp2", "qwen3", dense, tp=2, checks="grads+optim"),
        entry("dense_tp2_sp", "qwen3", dense, tp=2, sp=1, checks="grads"),
        entry("dense_pp2", "qwen3", dense, pp=2, checks="grads"),
        entry("dense_pp2_vpp2", "qwen3", dense, pp=2, vpp=2),
        entry("dense_cp2", "qwen3", dense, cp=2),
        entry("dense_dp2_distopt", "qwen3", dense, checks="distopt"),
        entry("moe_dp2", "qwen3_moe", moe),
        entry("moe_ep2", "qwen3_moe", moe, ep=2, checks="grads"),
        entry("moe_tp2", "qwen3_moe", moe, tp=2, etp=1),
        entry("moe_pp2", "qwen3_moe", moe, pp=2),
        entry("moe_cp2", "qwen3_moe", moe, cp=2),
        *family_entries("mixtral", mixtral),
        *family_entries("glm4_moe", glm),
        *family_entries("llama", llama, moe=False),
        *family_entries("qwen2", qwen2, moe=False),
        *family_entries("deepseek_v3", deepseek),
        # gpt-oss: sinks, sliding windows and YaRN through THD packing and CP2 (with the sinks' gradients);
        # SP: expert fc2 biases
        *[e for e in family_entries("gpt_oss", gptoss) if not e.startswith("gpt_oss_cp2:")],
        entry("gpt_oss_cp2", "gpt_oss", gptoss, cp=2, checks="grads"),
        entry("gpt_oss_tp2_sp", "gpt_oss", gptoss, tp=2, etp=1, sp=1),
        # gemma3: per-layer-type RoPE and windows through THD packing and CP2, post-norms (the layers' bda
        # weights) and tied scaled embeddings with their gradients, under SP too
        *[e for e in family_entries("gemma3_text", gemma, moe=False) if not e.startswith("gemma3_text_cp2:")],
        entry("gemma3_text_cp2", "gemma3_text", gemma, cp=2, checks="grads"),
        entry("gemma3_text_tp2_sp", "gemma3_text", gemma, tp=2, sp=1, checks="grads"),
        # multi-token prediction: megatron's MTP block on the last stage (PP2), TP-sharded (TP2); trained
        # (--enable-mtp-training's loss added to the main one) at PP2 and at TP2+SP with the MoE at EP2 (CP2: through
        # the backend's train step, tests/dist/test_backend.py)
        entry("glm4_moe_mtp_pp2", "glm4_moe_mtp", glm_mtp, pp=2, checks="mtp+mtp_train"),
        entry("glm4_moe_mtp_tp2_ep2_sp", "glm4_moe_mtp", glm_mtp, tp=2, ep=2, etp=1, sp=1, checks="mtp_train"),
        entry("deepseek_v3_mtp_tp2", "deepseek_v3_mtp", tiny_hf_models("deepseek_v3", mtp=True), tp=2, etp=1,
              checks="mtp"),
        # qwen3_next: gated delta-net layers through THD packing (state and conv restart per sequence), TP-sharded
        # key-head groups, gated attention, gated shared expert; CP is refused by the bridge (test_bridge.py).
        # TP2+SP gradients on a dense variant (num_experts 0): MoE at TP2 needs EP > 1 (docs/parity.md)
        *[e for e in family_entries("qwen3_next", qwen3_next) if not e.startswith("qwen3_next_cp2:")],
        entry("qwen3_next_tp2_sp", "qwen3_next", qwen3_next, tp=2, etp=1, sp=1),
        entry("qwen3_next_dense_tp2_sp", "qwen3_next_dense", qwen3_next_dense, tp=2, sp=1, checks="grads"),
        # Qwen3.5 text: the delta-net's separate in_proj_qkv/z/b/a fused per key head, then sharded over TP; a
        # dense MLP (with gradients under TP2+SP) or a MoE with the gated shared expert in every layer
        entry("qwen3_5_text_dp2", "qwen3_5_text", qwen3_5),
        entry("qwen3_5_text_tp2_sp", "qwen3_5_text", qwen3_5, tp=2, sp=1, checks="grads"),
        entry("qwen3_5_text_pp2", "qwen3_5_text", qwen3_5, pp=2),
        *[e for e in family_entries("qwen3_5_moe_text", qwen3_5_moe) if not e.startswith("qwen3_5_moe_text_cp2:")],
        # MiniMax-M2: sigmoid router with its selection bias and the all-heads q/k norm under EP2 (the TP case is in the
        # 4-rank launch); Gemma 4: value norm, layer scalars, proportional RoPE, windows and post-norms under TP2 + SP
        # (the other layouts: tools/check_parity.py, docs/parity.md)
        entry("minimax_m2_ep2", "minimax_m2", tiny_hf_models("minimax_m2"), ep=2, checks="grads"),
        entry("gemma4_text_tp2_sp", "gemma4_text", tiny_hf_models("gemma4_text"), tp=2, sp=1, checks="grads"),
        # DeepSeek-V3.2: the sparse-attention indexer (replicated, frozen) under DP2, TP2 + SP (its gradients: the
        # 4-rank launch, as MoE at TP2 needs EP > 1), its layers split over PP, experts over EP, with gradients (the
        # frozen indexer has none on either side); CP is refused by name
        entry("deepseek_v32_dp2", "deepseek_v32", tiny_hf_models("deepseek_v32")),
        entry("deepseek_v32_tp2_sp", "deepseek_v32", tiny_hf_models("deepseek_v32"), tp=2, etp=1, sp=1),
        entry("deepseek_v32_pp2", "deepseek_v32", tiny_hf_models("deepseek_v32"), pp=2, checks="grads"),
        entry("deepseek_v32_ep2", "deepseek_v32", tiny_hf_models("deepseek_v32"), ep=2, checks="grads"),
    ]
    return entries


def test_two_rank_layouts(shared_launch_state):
    results, entries = shared_launch_state[2]
    assert set(results) == {e.split(":")[0] for e in entries}
    check(results)


def _four_rank_entries(tiny_hf_models):
    dense, moe = tiny_hf_models("qwen3"), tiny_hf_models("qwen3_moe")
    mixtral, glm = tiny_hf_models("mixtral"), tiny_hf_models("glm4_moe")
    deepseek, gptoss = tiny_hf_models("deepseek_v3"), tiny_hf_models("gpt_oss")
    qwen3_next = tiny_hf_models("qwen3_next")
    entries = [
        entry("dense_dp4", "qwen3", dense),
        entry("dense_tp2_pp2", "qwen3", dense, tp=2, pp=2, checks="grads"),
        entry("dense_tp2_cp2", "qwen3", dense, tp=2, cp=2),
        entry("moe_dp4", "qwen3_moe", moe),
        entry("moe_ep2_tp2_sp", "qwen3_moe", moe, tp=2, ep=2, etp=1, sp=1, checks="grads"),
        # one entry each (its own reference): vs_hf is the check; TP2 x PP2 x EP2 at once
        entry("mixtral_tp2_pp2_ep2_sp", "mixtral", mixtral, tp=2, pp=2, ep=2, etp=1, sp=1, checks="grads"),
        entry("glm4_moe_tp2_pp2_ep2_sp", "glm4_moe", glm, tp=2, pp=2, ep=2, etp=1, sp=1, checks="grads"),
        entry("deepseek_v3_tp2_pp2_ep2_sp", "deepseek_v3", deepseek, tp=2, pp=2, ep=2, etp=1, sp=1, checks="grads"),
        entry("gpt_oss_tp2_pp2_ep2_sp", "gpt_oss", gptoss, tp=2, pp=2, ep=2, etp=1, sp=1, checks="grads"),
        entry("qwen3_next_tp2_pp2_ep2_sp", "qwen3_next", qwen3_next, tp=2, pp=2, ep=2, etp=1, sp=1, checks="grads"),
        entry("qwen3_5_moe_text_tp2_pp2_ep2_sp", "qwen3_5_moe_text", tiny_hf_models("qwen3_5_moe_text"), tp=2, pp=2,
              ep=2, etp=1, sp=1, checks="grads"),
        # the all-heads q/k norm's TP-sharded gains: sum of squares all-reduced over TP, gradients not summed again
        entry("minimax_m2_tp2_ep2_sp", "minimax_m2", tiny_hf_models("minimax_m2"), tp=2, ep=2, etp=1, sp=1,
              checks="grads"),
        # DeepSeek-V3.2 at TP2 x PP2 x EP2 + SP: the indexer reads the SP-gathered hidden states and q latent
        entry("deepseek_v32_tp2_pp2_ep2_sp", "deepseek_v32", tiny_hf_models("deepseek_v32"), tp=2, pp=2, ep=2, etp=1,
              sp=1, checks="grads"),
    ]
    return entries


def test_four_rank_layouts(shared_launch_state):
    results, entries = shared_launch_state[4]
    assert set(results) == {e.split(":")[0] for e in entries}
    check(results)


def shared_launch(ctx):
    """The 2- and 4-rank launches of this file's layouts (tests/_launches.py): {ranks: (results, entries)}."""
    out = ctx.tmp_path_factory.mktemp("parity")
    entries = {2: _two_rank_entries(ctx.tiny_hf_models), 4: _four_rank_entries(ctx.tiny_hf_models)}
    yield {n: [("parity", [out / f"r{n}.json", *e])] for n, e in entries.items()}
    return {n: (read_json(out / f"r{n}.json"), e) for n, e in entries.items()}
