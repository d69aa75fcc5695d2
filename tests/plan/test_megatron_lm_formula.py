"""Our static-memory estimate (plan/memory.py) against Megatron-LM's own theoretical-memory formula on published
configurations: the same numbers for the parts both compute, every difference named (docs/planner.md, "Against
Megatron-LM's formula").

The formula is ``compute_weight_and_optimizer_memory`` in Megatron-LM's
``megatron/training/theoretical_memory_usage.py`` (read at commit d98e8a64ddf3, 2026-08-22). It is restated below
in our own words (:func:`megatron_lm_formula`), from its arguments, as an independent check: it counts parameters
per kind (TP-sharded, replicated, routed-expert), places them on "the most loaded shard" (the first pipeline stage
with the embedding and any MTP layers) and "the other shards", and charges 18 bytes per parameter (bf16 weight,
fp32 main grad, fp32 master and two Adam moments), or ``6 + 12 / DP`` with the distributed optimizer (experts:
``6 + 12 / expert-DP``).

Where the two differ, by design of the formula (a simplification) or of megatron-core (what it really allocates,
which our estimate follows and tests/dist/test_static_memory.py checks on real ranks):

* q/k layernorms (Qwen3): megatron-core has them (``q_layernorm`` / ``k_layernorm``, head_dim each per layer); the
  formula does not count them.
* MLA's down projections (``linear_q_down_proj``, ``linear_kv_down_proj``) and their latent norms: megatron-core
  replicates them on every TP rank; the formula divides them by TP with the rest of the attention.
* MTP: an MTP layer also has two norms (``enorm``, ``hnorm``), the ``eh_proj`` [h, 2h] (column-parallel) and a final
  norm; the formula counts the MTP transformer layer only. It puts the MTP block on the first stage's shard;
  megatron-core puts it on the last.
* the final norm: the formula spreads it over the stages (``h / PP`` each); megatron-core has it on the last stage.
* the output layer at PP > 1: the formula leaves it out (its most loaded shard is the first stage); the last stage
  holds it (our last stage: embedding-sized, ``V h / TP``).
* DDP's buffer padding (each parameter starts on a multiple of 64 elements, each bucket ends on a multiple of
  lcm(DP, 128)): the distributed optimizer's param and grad buffers hold it (6 bytes per padded element); the
  formula has no padding.
* the sigmoid router's expert-bias (DeepSeek-V3's ``e_score_correction_bias``): an fp32 buffer, no parameter, in
  neither count here.
"""

from dataclasses import dataclass
from typing import Optional

import pytest

from megatron_rl.plan.memory import MegatronLayout, ModelArch, RoleModelSpec, TrainingFlags, estimate_megatron, stage_tensors

# -- published config.json values (the fields that size each model) ---------------------------------------------
LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN3_235B_A22B = {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                   "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
               "num_nextn_predict_layers": 1}


# -- Megatron-LM's formula, restated -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MegatronArgs:
    """The Megatron-LM arguments the formula reads (swiglu, RMSNorm, no linear biases: every model here)."""

    hidden: int
    heads: int
    kv_channels: int
    groups: int
    ffn: int
    padded_vocab: int
    layers: int
    untie: bool
    tp: int
    pp: int
    world: int
    distributed_optimizer: bool
    experts: Optional[int] = None
    moe_ffn: int = 0
    moe_pattern: tuple = ()
    shared_ffn: int = 0
    mtp_layers: int = 0
    mla: Optional[tuple] = None  # (q_lora_rank or None, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim)
    ep: int = 1
    etp: int = 1


def megatron_lm_formula(m: MegatronArgs) -> dict:
    """Per-kind parameter counts and the bytes of the most loaded shard, as the formula computes them."""
    h = m.hidden
    norm = 1  # RMSNorm: one weight vector
    if m.mla:
        q_rank, kv_rank, qk, rope, v = m.mla
        q = h * m.heads * (qk + rope) if q_rank is None else q_rank * (h + m.heads * (qk + rope) + norm)
        attention = q + kv_rank * (h + m.heads * (qk + v) + norm) + h * rope + m.heads * v * h
    else:  # q and o: h x heads*d each; k and v: h x groups*d each
        attention = 2 * h * m.heads * m.kv_channels + 2 * h * m.groups * m.kv_channels
    pattern = list(m.moe_pattern) if m.experts else [0] * m.layers
    moe_layers = sum(pattern)
    dense_layers = m.layers - moe_layers
    mtp_moe = m.mtp_layers * (pattern[-1] if m.experts else 0)
    mtp_dense = m.mtp_layers - mtp_moe
    dense_mlp = 3 * h * m.ffn  # gate, up, down
    shared = 3 * h * m.shared_ffn
    routed = 3 * h * m.moe_ffn * (m.experts or 0)
    router = h * m.experts if m.experts else 0
    norms = 2 * h  # the two pre-norms of a layer
    embedding = h * m.padded_vocab

    tp_block = (attention + dense_mlp) * dense_layers + (attention + shared) * moe_layers
    repl_block = norms * dense_layers + (norms + router) * moe_layers + h  # + the final norm
    expert_block = routed * moe_layers
    tp_mtp = (attention + dense_mlp) * mtp_dense + (attention + shared) * mtp_moe
    repl_mtp = norms * mtp_dense + (norms + router) * mtp_moe
    expert_mtp = routed * mtp_moe
    total = tp_block + repl_block + expert_block + tp_mtp + repl_mtp + expert_mtp + embedding * (2 if m.untie else 1)

    first_tp = (tp_block / m.pp + tp_mtp + embedding) / m.tp + (embedding / m.tp if m.untie and m.pp == 1 else 0)
    first_repl = repl_block / m.pp + repl_mtp
    first_expert = (expert_block / m.pp + expert_mtp) / (m.etp * m.ep)
    other = (tp_block / (m.pp * m.tp) + repl_block / m.pp, expert_block / (m.pp * m.etp * m.ep))
    dp = m.world // (m.tp * m.pp)
    edp = m.world // (m.etp * m.ep * m.pp)

    def per_param(d: int) -> float:
        return 6 + 12 / d if m.distributed_optimizer else 18

    return {"total": total, "first_dense": first_tp + first_repl, "first_expert": first_expert,
            "other_dense": other[0], "other_expert": other[1],
            "first_bytes": (first_tp + first_repl) * per_param(dp) + first_expert * per_param(edp),
            "other_bytes": other[0] * per_param(dp) + other[1] * per_param(edp), "dp": dp, "edp": edp}


def _args(hf: dict, arch: ModelArch, lay: MegatronLayout, distributed: bool, mtp: int = 0) -> MegatronArgs:
    """Megatron-LM's arguments for ``hf`` (as slime's model scripts set them) at ``lay``."""
    moe = bool(arch.experts)
    return MegatronArgs(
        hidden=arch.hidden, heads=arch.heads, kv_channels=arch.head_dim, groups=arch.groups, ffn=arch.ffn,
        padded_vocab=arch.padded_vocab(lay.tp), layers=arch.layers, untie=not arch.tied, tp=lay.tp, pp=lay.pp,
        world=lay.world, distributed_optimizer=distributed, experts=arch.experts or None, moe_ffn=arch.moe_ffn,
        moe_pattern=tuple(arch.moe_layers[:arch.layers]) if moe else (), shared_ffn=arch.shared_expert,
        mtp_layers=mtp, mla=arch.mla, ep=lay.ep, etp=lay.expert_tp)


def _ours(arch: ModelArch, lay: MegatronLayout, stage: int, mtp: int = 0) -> tuple[int, int]:
    """(dense, routed-expert) parameters of our estimate on a rank of ``stage``."""
    ts = [t for t in stage_tensors(arch, lay, stage, 0, mtp_layers=mtp, mtp_trained=True) if not t.buffer_fp32]
    return sum(t.elements for t in ts if not t.expert), sum(t.elements for t in ts if t.expert)


def _stage_bytes(arch: ModelArch, lay: MegatronLayout, flags: TrainingFlags, stage: int, mtp: int = 0) -> tuple:
    """(static bytes, DDP padding elements) of our estimate on a rank of ``stage``."""
    report = estimate_megatron(RoleModelSpec("actor", arch, lay, mtp_layers=mtp, mtp_trained=True), flags)
    s = report.components[0].stages[stage]
    held = next(r for r in s.rows if r.kind.startswith("parameters, trainable")).device / flags.param_bytes
    buffers = sum(r.device for r in s.rows if r.kind.startswith("router expert-bias"))  # no parameter: not compared
    return s.total("device") - buffers, held - s.params


BF16 = TrainingFlags(params_dtype="bfloat16")
BF16_DO = TrainingFlags(params_dtype="bfloat16", distributed_optimizer=True)


def test_llama3_70b_tp8_pp8_dp2():
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    lay = MegatronLayout(world=128, tp=8, pp=8)
    ref = megatron_lm_formula(_args(LLAMA3_70B, arch, lay, True))
    whole = megatron_lm_formula(_args(LLAMA3_70B, arch, MegatronLayout(world=1), True))["total"]
    assert whole == _ours(arch, MegatronLayout(world=1), 0)[0] == 70_553_706_496  # the published 70.6 B
    h = arch.hidden
    first, middle, last = (_ours(arch, lay, s) for s in (0, 3, 7))
    # stage 0: the embedding and 10 layers; the formula adds its share of the final norm (h / PP)
    assert first == (ref["first_dense"] - h / 8, 0)
    assert middle == (ref["other_dense"] - h / 8, 0)
    # the last stage holds the output layer and the final norm, which the formula's other shards leave out
    assert last[0] == ref["other_dense"] - h / 8 + arch.padded_vocab(8) * h // 8 + h
    # bytes: 6 + 12 / DP per parameter; megatron's buffers need no padding here (every size a multiple of 128)
    ours, pad = _stage_bytes(arch, lay, BF16_DO, 0)
    assert pad == 0
    assert ours == pytest.approx(ref["first_bytes"] - (h / 8) * (6 + 12 / 2), rel=1e-15)
    # without the distributed optimizer: 18 bytes per parameter, in both
    plain = megatron_lm_formula(_args(LLAMA3_70B, arch, lay, False))
    assert _stage_bytes(arch, lay, BF16, 3)[0] == pytest.approx(plain["other_bytes"] - 18 * h / 8, rel=1e-15)


def test_qwen3_235b_a22b_tp4_pp2_ep32():
    arch = ModelArch.from_hf_config(QWEN3_235B_A22B)
    lay = MegatronLayout(world=128, tp=4, pp=2, ep=32, etp=1)
    ref = megatron_lm_formula(_args(QWEN3_235B_A22B, arch, lay, True))
    assert (ref["dp"], ref["edp"]) == (lay.dp, lay.edp) == (16, 2)
    h, qk_norms = arch.hidden, 2 * arch.head_dim  # q and k layernorm weights per layer: ours only
    whole = megatron_lm_formula(_args(QWEN3_235B_A22B, arch, MegatronLayout(world=1), True))["total"]
    assert _ours(arch, MegatronLayout(world=1), 0)[0] + _ours(arch, MegatronLayout(world=1), 0)[1] == \
        whole + 94 * qk_norms == 235_093_634_560
    dense, expert = _ours(arch, lay, 0)
    assert expert == ref["first_expert"] == 47 * 3 * h * 1536 * 4  # 128 experts / EP 32 = 4 per rank
    assert dense == ref["first_dense"] - h / 2 + 47 * qk_norms
    ours, pad = _stage_bytes(arch, lay, BF16_DO, 0)
    assert ours == pytest.approx(ref["first_bytes"] + (47 * qk_norms - h / 2) * (6 + 12 / 16) + 6 * pad, rel=1e-15)
    assert pad == 0  # every parameter a multiple of 64 elements, the buckets of lcm(16, 128) and of lcm(2, 128)


def test_deepseek_v3_tp8_ep32_with_mtp():
    arch = ModelArch.from_hf_config(DEEPSEEK_V3)
    lay = MegatronLayout(world=256, tp=8, pp=1, ep=32, etp=1)
    ref = megatron_lm_formula(_args(DEEPSEEK_V3, arch, lay, True, mtp=1))
    assert (ref["dp"], ref["edp"]) == (32, 8)
    h = arch.hidden
    q_rank, kv_rank, _, rope, _ = arch.mla
    mtp_extra = 2 * h + 2 * h * h + h  # enorm, hnorm, eh_proj, the MTP block's final norm: ours only
    whole = megatron_lm_formula(_args(DEEPSEEK_V3, arch, MegatronLayout(world=1), True, mtp=1))["total"]
    ours_whole = sum(_ours(arch, MegatronLayout(world=1), 0, mtp=1))
    assert ours_whole == whole + mtp_extra
    assert sum(_ours(arch, MegatronLayout(world=1), 0)) == 671_026_404_352  # the published 671 B main model
    # + the MTP layer (11.6 B; the checkpoint's 14 B MTP module also stores copies of the embedding and the head,
    # which megatron shares with the main model's)
    assert ours_whole == 682_636_472_320 == 671_026_404_352 + 11_610_067_968
    # per rank: the MLA down projections and latent norms, replicated by megatron-core, divided by TP in the formula
    down = (q_rank * h + q_rank + (kv_rank + rope) * h + kv_rank) * (61 + 1)
    dense, expert = _ours(arch, lay, 0, mtp=1)
    assert expert == ref["first_expert"]
    assert dense == pytest.approx(ref["first_dense"] + down * (1 - 1 / 8) + 3 * h + 2 * h * h / 8, abs=1e-3)
    ours, pad = _stage_bytes(arch, lay, BF16_DO, 0, mtp=1)
    assert ours == pytest.approx(ref["first_bytes"] + (dense - ref["first_dense"]) * (6 + 12 / 32) + 6 * pad, rel=1e-14)
