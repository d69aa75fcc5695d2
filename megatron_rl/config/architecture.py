"""Megatron architecture flags (a slime ``MODEL_ARGS``) against the HF ``config.json``.

Why: slime builds the Megatron model from these flags and converts HF weights into it,
so its launch scripts carry them. Here the HF config builds the model (the bridge), so
the flags are redundant, and a redundant value that disagrees is the dangerous case: a
wrong ``--rotary-base`` or ``--norm-epsilon`` would silently describe a different model
from the one the user believes they train. Each given flag is therefore compared with
what config.json says, and a mismatch is refused naming the flag, both values and the
file. Boolean flags are checked only when given (absent is "not stated", since the HF
config decides). Where there is no checkpoint to read (``--dry-run`` on a laptop for a
235B script), the flags alone give the model shape the planner needs.

:data:`ARCHITECTURE` is the table: one row per flag, the config.json key it is compared
with, and how config.json's value is read in Megatron's terms (:func:`megatron_view`,
following the bridges in ``models/families.py``; a test checks the two agree).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_rl.plan import ModelShape

from .schema import Config

_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
QKV_BIAS_TYPES = ("qwen2", "qwen2_5_vl_text")  # families whose q/k/v projections carry a bias (models/families.py)
# multimodal RoPE: megatron's position_embedding_type "mrope" (Qwen2.5-VL's and Qwen3-VL's language models,
# text_config's model_type)
MROPE_TYPES = ("qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text")
QKV_ONLY_ATTENTION_BIAS_TYPES = ("glm4_moe",)  # attention_bias means q/k/v bias (o_proj has none)
# (minimax_m2's q/k norms span all heads, which megatron's per-head qk_layernorm is not: the bridge builds them itself)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "gemma3_text", "gemma4_text",
                 "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_vl_text",
                 "qwen3_vl_moe_text")  # q/k RMSNorm (MLA: its q/kv latent norms; others: use_qk_norm)
MOE_FFN_KEYS = {"mixtral": "intermediate_size", "gpt_oss": "intermediate_size", "minimax_m2": "intermediate_size"}  # expert MLP size key where not moe_intermediate_size
SIGMOID_ROUTER_TYPES = ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "minimax_m2")  # sigmoid router score (the other MoE families: softmax)
MLA_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2")  # multi-latent attention (q/kv latents, decoupled RoPE)
# DeepSeek Sparse Attention (a lightning indexer per layer picks each query's index_topk keys; models/dsa.py):
# megatron-core's DSA keeps a sequence's keys on one rank, so context parallelism is refused
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
# gpt-oss: experts apply a clamped, offset quick-GELU GLU (not Megatron-LM's --swiglu), YaRN is megatron's
# position_embedding_type "yarn" (MLA models take YaRN inside their attention instead)
CLAMPED_GLU_TYPES = ("gpt_oss",)
YARN_POSITION_TYPES = ("gpt_oss",)
# Gemma 3: RoPE per layer type (rope_parameters.{full_attention, sliding_attention}; full layers' base is what
# GPTModel gets, a linear factor is applied by the layer itself, not megatron's --rotary-scaling-factor), and
# embeddings tied unless config.json says otherwise
PER_LAYER_ROPE_TYPES = ("gemma3_text", "gemma4_text")
TIED_BY_DEFAULT_TYPES = ("gemma3_text", "gemma4_text")
# experts with an fc2 bias: megatron-core 0.16.1 adds it on every expert-TP rank before the partial sums meet
EXPERT_BIAS_TYPES = ("gpt_oss",)
# q/k norms over all heads of a token (MiniMax-M2): the key norm's sum over TP would count a key head replicated
# over TP ranks (TP > num_key_value_heads) once per copy
ALL_HEADS_QK_NORM_TYPES = ("minimax_m2",)
# Qwen3-Next and Qwen3.5's text models: gated delta-net (linear attention) layers, whose recurrent state is not handed across CP ranks;
# partial RoPE 0.25 unless config.json says otherwise; one shared expert of shared_expert_intermediate_size
LINEAR_ATTENTION_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
GATED_ATTENTION_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # q_proj gives a per-head output gate (megatron attention_output_gate)
SHARED_EXPERT_GATE_TYPES = ("qwen3_next", "qwen3_5_moe_text")  # sigmoid gate on the shared expert (megatron moe_shared_expert_gate)
ZERO_CENTRED_NORM_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gemma3_text")  # x / rms(x) * (1 + w) (Megatron-LM --apply-layernorm-1p)
DEFAULT_ROTARY_PERCENT = {"qwen3_next": 0.25, "qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25}
SHARED_EXPERT_SIZE_KEYS = {"qwen3_next": "shared_expert_intermediate_size",
                           "qwen3_5_moe_text": "shared_expert_intermediate_size"}

# slime's --spec MODULE FUNCTION (its slime_plugins layer specs) -> the config.json model_types whose bridge builds
# the same layers (an empty tuple: a family no bridge here builds)
SLIME_SPECS: dict[tuple[str, str], tuple[str, ...]] = {
    ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): ("qwen3_next",),
    ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"): ("qwen3_5_text", "qwen3_5_moe_text"),
    ("slime_plugins.models.glm5.glm5", "get_glm5_spec"): (),  # GLM-5's DeepSeek sparse attention (DSA)
}

# config.json model_types a bridge builds (models/families.py BRIDGES_BY_MODEL_TYPE), and the multimodal ones
# whose text model has one (models.MULTIMODAL_WRAPPERS); tests/config/test_slime_architecture.py keeps them equal
BRIDGED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "gemma3_text", "gemma4_text", "glm4_moe", "glm_moe_dsa", "gpt_oss",
                       "kimi_k2", "llama", "minimax_m2", "mixtral", "qwen2", "qwen2_5_vl", "qwen3", "qwen3_5_moe_text",
                       "qwen3_5_text", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe",
                       "qwen3_next")
# vision-language model_types a bridge builds (models/families.py): what a run with one may combine is
# config/vlm_rules.py's (docs/vlm.md)
VISION_LANGUAGE_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
MULTIMODAL_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class _Unused:
    """A flag megatron-core does not read for this architecture (``--kv-channels`` of an MLA model,
    ``--moe-router-pre-softmax`` of a sigmoid router): any value states nothing, so none is compared."""

    def __repr__(self) -> str:
        return "UNUSED"


UNUSED: Any = _Unused()


def text_config(hf: dict) -> dict:
    """The language model's config (multimodal configs keep it under ``text_config``; the wrapper's
    ``tie_word_embeddings`` is the one transformers ties by, as the bridges read it)."""
    if "num_attention_heads" not in hf and isinstance(hf.get("text_config"), dict):
        if "tie_word_embeddings" in hf:
            return {**hf["text_config"], "tie_word_embeddings": hf["tie_word_embeddings"]}
        return hf["text_config"]
    return hf


def _num_experts(c: dict) -> int:
    return int(next((c[k] for k in _EXPERT_KEYS if c.get(k)), 0))


def moe_layer_pattern(hf: dict) -> list[int]:
    """Per layer of an HF config, 1 where the bridges build an MoE layer (0 for every layer of a dense model)."""
    c = text_config(hf)
    return _moe_pattern(c) if _num_experts(c) else [0] * int(c["num_hidden_layers"])


def _moe_pattern(c: dict) -> list[int]:
    """Per layer 1 = MoE, as the bridges decide (Qwen-MoE: decoder_sparse_step, mlp_only_layers;
    GLM: the first first_k_dense_replace layers dense)."""
    step = int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or []) | set(range(int(c.get("first_k_dense_replace") or 0)))
    return [0 if i in dense or (i + 1) % step else 1 for i in range(int(c["num_hidden_layers"]))]


def _rotary_dim_share(c: dict) -> Optional[float]:
    """MiniMax-M2's released config.json states partial RoPE as ``rotary_dim`` (rotated dims of ``head_dim``)."""
    if c.get("rotary_dim") is None:
        return None
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if heads else None)
    return float(c["rotary_dim"]) / float(head_dim) if head_dim else None


def megatron_view(hf: dict) -> dict[str, tuple[str, Any]]:
    """``{field: (config.json key it comes from, value in Megatron's terms)}`` for an HF config."""
    c = text_config(hf)
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    model_type = c.get("model_type")
    rope: dict[str, Any] = dict(c.get("rope_parameters") or {})
    per_layer_rope = model_type in PER_LAYER_ROPE_TYPES
    if per_layer_rope and isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    rope.update(c.get("rope_scaling") or {})
    act = c.get("hidden_act", c.get("hidden_activation", "silu"))
    experts = _num_experts(c)
    eps_key = next((k for k in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if k in c), "rms_norm_eps")
    view: dict[str, tuple[str, Any]] = {
        "num_layers": ("num_hidden_layers", c.get("num_hidden_layers")),
        "hidden_size": ("hidden_size", hidden),
        "ffn_hidden_size": ("intermediate_size", c.get("intermediate_size")),
        "num_attention_heads": ("num_attention_heads", heads),
        "num_query_groups": ("num_key_value_heads", c.get("num_key_value_heads") or heads),
        # megatron's MLA sizes its heads by qk_head_dim / v_head_dim and never reads kv_channels
        "kv_channels": ("head_dim", UNUSED) if model_type in MLA_TYPES else (
            "head_dim", c.get("head_dim") or (hidden // heads if hidden and heads else None)),
        "vocab_size": ("vocab_size", c.get("vocab_size")),
        "max_position_embeddings": ("max_position_embeddings", c.get("max_position_embeddings")),
        "swiglu": ("hidden_act / model_type", act == "silu"
                   and model_type not in CLAMPED_GLU_TYPES),
        "normalization": (eps_key, "RMSNorm" if eps_key == "rms_norm_eps" else "LayerNorm"),
        "norm_epsilon": (eps_key, c.get(eps_key, 1e-6)),
        "rotary_base": ("rope_theta", float(c.get("rope_theta", rope.get(
            "rope_theta", 1000000.0 if per_layer_rope else 10000.0)))),
        "rotary_percent": ("partial_rotary_factor", float(rope.get("partial_rotary_factor", c.get(
            "partial_rotary_factor", _rotary_dim_share(c) or DEFAULT_ROTARY_PERCENT.get(str(model_type), 1.0))))),
        # every supported family is a RoPE model; gpt-oss's YaRN and Qwen2.5-VL's M-RoPE are megatron's own types
        "position_embedding_type": ("rope_parameters.rope_type", "yarn") if (
            model_type in YARN_POSITION_TYPES and rope.get("rope_type", rope.get("type")) == "yarn") else (
            "rope_parameters.mrope_section", "mrope") if model_type in MROPE_TYPES else ("rope_theta", "rope"),
        "disable_bias_linear": ("mlp_bias / attention_bias", not c.get("mlp_bias", False) and not (
            c.get("attention_bias", False) and model_type not in QKV_BIAS_TYPES + QKV_ONLY_ATTENTION_BIAS_TYPES)),
        "add_qkv_bias": ("model_type / attention_bias",
                         model_type in QKV_BIAS_TYPES or bool(c.get("attention_bias", False))),
        "qk_layernorm": ("model_type / use_qk_norm", model_type in QK_NORM_TYPES or bool(c.get("use_qk_norm"))),
        "attention_output_gate": ("model_type", model_type in GATED_ATTENTION_TYPES),
        "apply_layernorm_1p": ("model_type", model_type in ZERO_CENTRED_NORM_TYPES),
        "untie_embeddings_and_output_weights": ("tie_word_embeddings", not c.get(
            "tie_word_embeddings", model_type in TIED_BY_DEFAULT_TYPES)),
        "rotary_scaling_factor": ("rope_scaling.factor", UNUSED if per_layer_rope else float(rope.get("factor") or 1.0)),
        # slime's plugin spec of this family (UNUSED: slime has none, the Megatron-LM GPT spec builds it)
        "spec": ("model_type", next((s for s, types in SLIME_SPECS.items() if model_type in types), UNUSED)),
    }
    if model_type in MLA_TYPES:
        yarn = rope.get("rope_type", rope.get("type")) == "yarn"  # else megatron's MLA uses no mscale
        view.update({
            "multi_latent_attention": ("model_type", True),
            "q_lora_rank": ("q_lora_rank", c.get("q_lora_rank")),
            "kv_lora_rank": ("kv_lora_rank", c.get("kv_lora_rank")),
            "qk_head_dim": ("qk_nope_head_dim", c.get("qk_nope_head_dim")),
            "qk_pos_emb_head_dim": ("qk_rope_head_dim", c.get("qk_rope_head_dim")),
            "v_head_dim": ("v_head_dim", c.get("v_head_dim")),
            "mscale": ("rope_scaling.mscale", float(rope.get("mscale") or 1.0) if yarn else UNUSED),
            "mscale_all_dim": ("rope_scaling.mscale_all_dim",
                               float(rope.get("mscale_all_dim") or 0.0) if yarn else UNUSED),
        })
    else:
        view["multi_latent_attention"] = ("model_type", False)
    if experts:
        ffn_key = MOE_FFN_KEYS.get(str(model_type), "moe_intermediate_size")
        view.update({
            "num_experts": (next(k for k in _EXPERT_KEYS if c.get(k)), experts),
            "moe_ffn_hidden_size": (ffn_key, c.get(ffn_key)),
            "moe_router_topk": ("num_experts_per_tok", c.get("num_experts_per_tok")),
            "moe_layer_freq": ("decoder_sparse_step / mlp_only_layers / first_k_dense_replace", _moe_pattern(c)),
            "moe_router_score_function": ("model_type",
                                          "sigmoid" if model_type in SIGMOID_ROUTER_TYPES else "softmax"),
            "moe_shared_expert_gate": ("model_type", model_type in SHARED_EXPERT_GATE_TYPES),
            "moe_shared_expert_intermediate_size": (
                SHARED_EXPERT_SIZE_KEYS[str(model_type)], int(c.get(SHARED_EXPERT_SIZE_KEYS[str(model_type)]) or 0))
            if str(model_type) in SHARED_EXPERT_SIZE_KEYS else (
                "n_shared_experts x moe_intermediate_size",
                int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0)),
        })
        if model_type in SIGMOID_ROUTER_TYPES:  # DeepSeek-style: biased selection, grouped top-k, scaling
            view.update({
                "moe_router_pre_softmax": ("model_type", UNUSED),  # megatron reads it for softmax routers only
                "moe_router_enable_expert_bias": ("e_score_correction_bias", True),
                "moe_router_topk_scaling_factor": ("routed_scaling_factor",
                                                   float(c.get("routed_scaling_factor") or 1.0)),
                "moe_router_num_groups": ("n_group", int(c.get("n_group") or 1)),
                "moe_router_group_topk": ("topk_group", int(c.get("topk_group") or 1)),
            })
        else:  # softmax over the top-k logits, or over all experts (pre-softmax) without renormalising
            view.update({
                "moe_router_pre_softmax": ("norm_topk_prob", not bool(c.get("norm_topk_prob", True))),
                "moe_router_enable_expert_bias": ("model_type", False),
                "moe_router_topk_scaling_factor": ("model_type", 1.0),
                "moe_router_num_groups": ("model_type", 1),
                "moe_router_group_topk": ("model_type", 1),
            })
    return view


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _show(value) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _same(given, hf) -> bool:
    if isinstance(given, float) or isinstance(hf, float):
        return hf is not None and math.isclose(float(given), float(hf), rel_tol=1e-6, abs_tol=0.0)
    return given == hf


def _expand_layer_freq(value, num_layers: int) -> list[int]:
    """Megatron-LM's moe_layer_freq as a 0/1 list (an int N: layer i is MoE when i % N == 0)."""
    if isinstance(value, int):
        return [1 if i % value == 0 else 0 for i in range(num_layers)]
    return list(value)


@dataclass(frozen=True)
class ArchFlag:
    """One Megatron architecture flag: what it states, in Megatron's terms, from the config."""

    field: str
    given: Optional[Callable[[Any], Any]] = None  # the value the flag states, or None when not stated

    def stated(self, arch) -> Any:
        if self.given is not None:
            return self.given(arch)
        value = getattr(arch, self.field)
        return None if value is False else value  # a store_true flag left off states nothing


def _query_groups(a):
    return (a.num_query_groups or 1) if a.group_query_attention else None


def _position(a):
    return "rope" if a.use_rotary_position_embeddings else a.position_embedding_type


#: One row per architecture flag, in the order docs/migrating-from-slime.md lists them.
ARCHITECTURE: tuple[ArchFlag, ...] = tuple(ArchFlag(f) for f in (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")) + (
    ArchFlag("group_query_attention", lambda a: None),  # stated through num_query_groups below
    ArchFlag("num_query_groups", _query_groups),
) + tuple(ArchFlag(f) for f in ("kv_channels", "vocab_size", "max_position_embeddings", "swiglu", "normalization", "norm_epsilon",
                                "rotary_base", "rotary_percent")) + (
    ArchFlag("position_embedding_type", _position),
    ArchFlag("use_rotary_position_embeddings", lambda a: None),  # stated through position_embedding_type
    ArchFlag("spec", lambda a: tuple(a.spec) if a.spec else None),
) + tuple(ArchFlag(f) for f in ("disable_bias_linear", "add_qkv_bias", "qk_layernorm", "attention_output_gate",
                                "apply_layernorm_1p", "untie_embeddings_and_output_weights", "rotary_scaling_factor",
                                "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                "qk_pos_emb_head_dim", "v_head_dim", "mscale", "mscale_all_dim",
                                "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
                                "moe_router_score_function", "moe_shared_expert_intermediate_size",
                                "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                                "moe_router_topk_scaling_factor", "moe_router_num_groups",
                                "moe_router_group_topk"))

ARCHITECTURE_FIELDS = tuple(row.field for row in ARCHITECTURE)
_MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "moe_router_score_function",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
               "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mscale",
               "mscale_all_dim")


def flag_consistency_errors(cfg: Config) -> list[str]:
    """Contradictions among the flags themselves (no config.json needed)."""
    a = cfg.architecture
    errors = []
    if a.num_query_groups is not None and not a.group_query_attention:
        errors.append(f"--num-query-groups {a.num_query_groups} without --group-query-attention: Megatron-LM "
                      "ignores it then (one KV group per head); add --group-query-attention or drop "
                      "--num-query-groups")
    if a.use_rotary_position_embeddings and a.position_embedding_type not in (None, "rope"):
        errors.append(f"--use-rotary-position-embeddings with --position-embedding-type "
                      f"{a.position_embedding_type}: the first means rope; drop one of them")
    mla_given = [_flag(f) for f in _MLA_FIELDS if getattr(a, f) is not None]
    if mla_given and not a.multi_latent_attention:
        errors.append(f"{', '.join(mla_given)} without --multi-latent-attention: Megatron-LM ignores them then; "
                      "add --multi-latent-attention or drop them")
    if a.moe_router_group_topk is not None and a.moe_router_num_groups is None:
        errors.append(f"--moe-router-group-topk {a.moe_router_group_topk} without --moe-router-num-groups: "
                      "megatron-core needs both for the group-limited top-k; add --moe-router-num-groups or drop it")
    for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "vocab_size", "num_experts", "moe_ffn_hidden_size", "moe_router_topk",
                  "moe_router_num_groups", "moe_router_group_topk", "kv_lora_rank", "qk_head_dim",
                  "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank", "make_vocab_size_divisible_by",
                  "max_position_embeddings"):
        value = getattr(a, field)
        if value is not None and value < 1:
            errors.append(f"{_flag(field)} {value} must be >= 1")
    freq = a.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        errors.append(f"--moe-layer-freq {freq} must be >= 1 (every N-th layer) or a 0/1 list per layer")
    if isinstance(freq, list) and a.num_layers is not None and len(freq) != a.num_layers:
        errors.append(f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {a.num_layers}")
    return errors


def read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def hf_mismatch_errors(cfg: Config, hf: dict, source: str) -> list[str]:
    """Every stated architecture flag that disagrees with config.json ``hf`` (read from ``source``)."""
    a = cfg.architecture
    view = megatron_view(hf)
    errors = []
    for row in ARCHITECTURE:
        given = row.stated(a)
        if given is None:
            continue
        flag = _flag(row.field)
        if row.field in _MOE_FIELDS and row.field not in view:
            errors.append(f"{flag} {given} describes an MoE model but {source} has no experts (a dense model, "
                          f"no {' / '.join(_EXPERT_KEYS)}); drop the MoE flags or point --hf-checkpoint at the "
                          "MoE checkpoint")
            continue
        if row.field in _MLA_FIELDS and row.field not in view:
            errors.append(f"{flag} {_show(given)} describes multi-latent attention but {source} has none "
                          f"(model_type {text_config(hf).get('model_type')}); drop the MLA flags or point "
                          "--hf-checkpoint at an MLA checkpoint (deepseek_v3)")
            continue
        key, hf_value = view[row.field]
        if row.field == "spec":  # (before UNUSED: a family slime has no spec for refuses every spec)
            errors.extend(_spec_errors(given, text_config(hf).get("model_type"), source))
            continue
        if hf_value is UNUSED:
            continue
        if row.field == "vocab_size":
            errors.extend(_vocab_errors(given, hf_value, cfg.parallel.tensor_model_parallel_size, source,
                                        a.make_vocab_size_divisible_by or 128))
            continue
        if row.field == "moe_layer_freq":
            want = _expand_layer_freq(given, len(hf_value))
            if want != hf_value:
                errors.append(f"--moe-layer-freq {given} makes layers {_layers(want)} MoE but {source} "
                              f"({key}) makes layers {_layers(hf_value)} MoE; the HF config builds the model: "
                              "fix the flag or drop it")
            continue
        if not _same(given, hf_value):
            what = "" if given is True else f" {_show(given)}"
            if row.field == "num_query_groups" and a.num_query_groups is None:
                flag, what = "--group-query-attention", " without --num-query-groups (Megatron: 1 group)"
            errors.append(f"{flag}{what} does not match {source}: {key} gives {_fmt(row.field, hf_value)}; "
                          "the HF config builds the model: fix the flag or drop it")
    return errors


def _fmt(field: str, value) -> str:
    if isinstance(value, bool):
        return {"swiglu": "no gated SiLU MLP" if not value else "SwiGLU",
                "disable_bias_linear": "biases on linear layers",
                "add_qkv_bias": "no q/k/v bias",
                "qk_layernorm": "no q/k layernorm",
                "untie_embeddings_and_output_weights": "tied embeddings",
                "multi_latent_attention": "no multi-latent attention",
                "moe_router_pre_softmax": "a softmax over the top-k logits (norm_topk_prob true)",
                "moe_router_enable_expert_bias": "no expert bias"}.get(field, str(value))
    if field == "moe_shared_expert_intermediate_size" and value == 0:
        return "no shared expert"
    if value is None:
        return "null"
    return _show(value)


def _layers(pattern: list[int]) -> str:
    moe = [i for i, v in enumerate(pattern) if v]
    if len(moe) == len(pattern):
        return f"0-{len(pattern) - 1} (all)"
    return ", ".join(map(str, moe)) or "none"


def _spec_errors(given: tuple[str, str], model_type, source: str) -> list[str]:
    """``--spec MODULE FUNCTION``: slime's plugin spec of the family config.json's bridge builds."""
    families = SLIME_SPECS.get(given)
    shown = f"--spec {given[0]} {given[1]}"
    if families is None:
        known = "; ".join(f"{m} {f}" for m, f in SLIME_SPECS)
        return [f"{shown}: a custom layer spec is not loaded here (the bridge of config.json's model_type builds the "
                f"layers); drop --spec (the slime specs it stands for: {known})"]
    if not families:
        return [f"{shown} builds layers no bridge here builds (GLM-5's DeepSeek sparse attention); {source} "
                f"has model_type {model_type!r}: such a model cannot be trained here yet"]
    if model_type not in families:
        return [f"{shown} is slime's layer spec for model_type {' / '.join(families)}, but {source} has model_type "
                f"{model_type!r}: fix --spec or --hf-checkpoint (or drop --spec: the bridge builds the layers)"]
    return []


def _vocab_errors(given: int, hf: int, tp: int, source: str, divisible_by: int = 128) -> list[str]:
    """Megatron pads --vocab-size to a multiple of --make-vocab-size-divisible-by (128) x TP; what must agree
    is the padded size (the embedding megatron builds) and the real vocab must not be smaller than the HF one."""
    if given == hf:
        return []
    unit = divisible_by * tp
    pg, ph = -(-given // unit) * unit, -(-hf // unit) * unit
    if pg == ph and given >= hf:
        return []
    return [f"--vocab-size {given} does not match {source}: vocab_size is {hf}. Compared the padded sizes "
            f"megatron builds (a multiple of {divisible_by} x TP {tp} = {unit}): {given} pads to {pg}, {hf} pads to {ph}"
            + ("" if pg != ph else f", but {given} < {hf} would cut real tokens")
            + f"; give --vocab-size {hf} or drop it"
            + ("" if divisible_by == 128 else f" (--make-vocab-size-divisible-by {divisible_by})")]


def shape_from_flags(cfg: Config) -> Optional[ModelShape]:
    """The planner's model shape from the architecture flags alone, or None when they do not
    state it (--num-layers, --num-attention-heads and --vocab-size are needed)."""
    a = cfg.architecture
    if a.num_layers is None or a.num_attention_heads is None or a.vocab_size is None:
        return None
    return ModelShape(num_attention_heads=a.num_attention_heads,
                      num_query_groups=_query_groups(a) or a.num_attention_heads,
                      num_layers=a.num_layers, vocab_size=a.vocab_size, num_experts=a.num_experts or 0,
                      source="the architecture flags (--num-layers, --num-attention-heads, ...)")


def hf_checkpoint_missing(cfg: Config) -> bool:
    """``--hf-checkpoint`` names a path that does not exist on this machine."""
    path = cfg.model.hf_checkpoint
    return bool(path and not os.path.exists(path))


def dry_run_without_checkpoint(cfg: Config) -> bool:
    """``--dry-run`` of a script whose checkpoint is elsewhere (a 235B script on a laptop): the
    plan comes from the architecture flags, so the missing directory is not an error there."""
    return cfg.mode.dry_run and hf_checkpoint_missing(cfg) and shape_from_flags(cfg) is not None


def quantized_checkpoint(hf: dict) -> Optional[str]:
    """Why a quantized checkpoint (config.json ``quantization_config``) cannot be loaded, or None.

    The bridges map full-precision tensors; an fp8 checkpoint's weights would arrive without their
    block scales (``weight_scale_inv``), so the model would be silently wrong. DeepSeek-V3/R1 ship
    fp8 (slime's script points at a bf16 copy for this reason)."""
    quant = hf.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    return (f"quantization_config quant_method={method!r} (a quantized checkpoint; the bridge maps full-precision "
            "weights: dequantize it to bf16 first, e.g. DeepSeek's inference/fp8_cast_bf16.py for an fp8 "
            "checkpoint, and point --hf-checkpoint at that copy)")


def architecture_errors(cfg: Config) -> list[str]:
    """The flags' own contradictions, then each stated flag against --hf-checkpoint's config.json."""
    errors = flag_consistency_errors(cfg)
    path = cfg.model.hf_checkpoint
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return errors  # no config.json: reported by the checkpoint check (or a dry run plans from the flags)
    source = os.path.join(path, "config.json")
    try:
        hf = read_hf_config(path)
    except (OSError, ValueError) as exc:
        return errors + [f"--hf-checkpoint {path}: cannot read config.json ({exc})"]
    errors += model_type_errors(hf, f"--hf-checkpoint {path}")
    errors += hf_mismatch_errors(cfg, hf, source)
    quant = quantized_checkpoint(text_config(hf))
    if quant and not cfg.mode.dry_run:  # a dry run plans the same model; the run itself could not load it
        errors.append(f"--hf-checkpoint {path}: {quant}")
    return errors


def model_type_errors(hf: dict, where: str) -> list[str]:
    """config.json's ``model_type`` has a bridge (what ``models.get_bridge`` refuses once the model is built,
    said here, where validation and ``--dry-run`` read the file)."""
    model_type = hf.get("model_type")
    if model_type in BRIDGED_MODEL_TYPES:  # a vision-language one's combinations: config/vlm_rules.py
        return []
    if model_type in MULTIMODAL_MODEL_TYPES:
        return [f"{where}: model_type {model_type!r} is a multimodal checkpoint; megatron_rl trains its text model "
                f"(model_type {MULTIMODAL_MODEL_TYPES[model_type]!r}) only: write the text model out with "
                "transformers (AutoModelForCausalLM, then save_pretrained) and pass that directory"]
    return [f"{where}: config.json's model_type {model_type!r} has no bridge (supported: "
            f"{', '.join(BRIDGED_MODEL_TYPES)}); convert the model to one of these families or add a bridge "
            "(models/families.py)"]


def hf_model_type(cfg: Config) -> Optional[str]:
    """``model_type`` of --hf-checkpoint's config.json (its text config), None when unreadable or absent."""
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            return text_config(read_hf_config(path)).get("model_type")
        except (OSError, ValueError):
            return None
    return None


def hf_num_key_value_heads(cfg: Config) -> Optional[int]:
    """``num_key_value_heads`` (else ``num_attention_heads``) of --hf-checkpoint's config.json, None when unreadable."""
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            c = text_config(read_hf_config(path))
            n = c.get("num_key_value_heads") or c.get("num_attention_heads")
            return int(n) if n is not None else None
        except (OSError, ValueError, TypeError):
            return None
    return None


def hf_num_layers(cfg: Config) -> Optional[int]:
    """``num_hidden_layers`` of --hf-checkpoint's config.json (its text config), else --num-layers, else None."""
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            n = text_config(read_hf_config(path)).get("num_hidden_layers")
            return int(n) if n is not None else None
        except (OSError, ValueError, TypeError):
            return None
    return cfg.architecture.num_layers


def hf_is_moe(cfg: Config) -> Optional[bool]:
    """Whether the model has experts: config.json when readable, else --num-experts, else unknown."""
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        try:
            return _num_experts(text_config(read_hf_config(path))) > 0
        except (OSError, ValueError):
            return None
    if cfg.architecture.num_experts is not None:
        return cfg.architecture.num_experts > 0
    return None
