"""HF <-> megatron-core bridge: config mapping, layer spec, model building, name maps.

A :class:`Bridge` is built from an HF ``config.json`` (a dict; no ``transformers``
import needed) and is the one object the MegatronBackend asks about a model:

* ``Bridge.transformer_config(layout, params_dtype=torch.float32, **overrides)``
  -> ``TransformerConfig`` (CPU-required flags from the compat shim included);
* ``Bridge.layer_spec(config, moe=...)`` / ``Bridge.block_spec(config, vp_stage)``:
  transformer-engine spec where TE imports, megatron's local spec otherwise, with
  our SP-aware :class:`~megatron_rl.models.norm.RMSNorm` and, when present,
  ``megatron_rl.models.attention.PackedCoreAttention`` as ``core_attention``; megatron's
  multi-latent attention spec and ``MLATransformerConfig`` for a family with ``mla`` set
  (its name and shape maps: ``hf_attention_shapes`` / ``megatron_attention_shapes`` /
  ``attention_rules``, overridden per attention kind);
* ``Bridge.build_model(layout, params_dtype=torch.float32, pg_collection=None, **overrides)`` -> one
  ``GPTModel`` per virtual pipeline stage held by this rank (needs
  :func:`~megatron_rl.models.parallel.initialize_parallel` first; ``pg_collection``: the layout's
  process groups, which the model's modules then hold);
* ``Bridge.load_hf_weights(chunks, hf_dir)`` / ``Bridge.export_hf_weights(chunks,
  bucket_bytes=None)``: see :mod:`megatron_rl.models.weights`;
* ``Bridge.hf_param_shapes()`` and ``Bridge.rule_for(canonical_name)``: the pure
  name/shape map (what :mod:`weights` and ``tools/convert_ckpt.py`` consume);
  ``Bridge.megatron_param_shapes(flavour)`` / ``Bridge.hf_to_megatron(flavour)``: the
  megatron side and the inverse, per layer spec (``local`` or ``transformer_engine``,
  whose norm names :data:`weight_maps.LAYER_SPEC_NAMES` holds).

Canonical megatron names use *global* indices:
``decoder.layers.{layer}.…`` and ``decoder.layers.{layer}.mlp.experts.local_experts.{expert}.…``
where megatron's module tree uses per-chunk layer and per-rank expert indices;
:func:`megatron_rl.models.weights.canonical_parameters` does the renaming.

Logits of a built model have ``padded_vocab_size`` columns; only the first
``bridge.vocab_size`` are real tokens (slice before a softmax).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from megatron_rl.compat import apply_cpu_compat, cpu_config_overrides
from megatron_rl.config.architecture import quantized_checkpoint
from megatron_rl.errors import BridgeError
from megatron_rl.models import weight_maps, weights
from megatron_rl.models.spec import LAYER_SPECS, final_norm_module, layer_spec_flavour

_MISSING = object()


@dataclass(frozen=True)
class ParamRule:
    """How one megatron parameter is made from HF tensors.

    ``kind``: ``copy`` (one HF tensor, same layout), ``vocab`` (one HF tensor,
    rows padded to the padded vocab), ``qkv`` (q, k, v fused per query group),
    ``gate_up`` (gate, up concatenated); for HF checkpoints that stack every expert of a layer in one
    tensor (gpt-oss), expert ``expert``'s slice of it: ``expert_gate_up`` (``[E, hidden, 2 ffn]`` with
    gate / up interleaved in the columns -> ``[gate; up]`` rows), ``expert_row`` (a bias ``[E, n]`` ->
    row ``expert``), ``expert_down`` (``[E, ffn, hidden]`` -> its transpose). TP slicing follows the
    megatron parameter's own ``partition_dim``.
    """

    kind: str
    hf_names: tuple[str, ...]
    expert: Optional[int] = None  # the expert_* kinds: which slice of the stacked HF tensor


class Bridge:
    """Base bridge for Llama-like decoder-only families. Subclasses set the flags (a family whose
    switch lives in its config.json overrides the flag with a property reading it)."""

    family: str = ""
    model_types: tuple[str, ...] = ()
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    moe: bool = False
    sliding_window_gated: bool = False  # `sliding_window` counts only with use_sliding_window (Qwen)
    partial_rotary: bool = False  # partial_rotary_factor < 1 maps to megatron's rotary_percent (GLM)
    moe_ffn_key: str = "moe_intermediate_size"  # config.json key of the expert MLP size (Mixtral: intermediate_size)
    router_expert_bias: bool = False  # router has a selection-only score bias (GLM e_score_correction_bias)
    hf_moe_block: str = "mlp"  # HF module of a MoE layer's router and experts (Mixtral: block_sparse_moe)
    hf_expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # (gate, up, down); Mixtral w1/w3/w2
    mla: bool = False  # multi-latent attention (DeepSeek-V3): MLA layer spec, MLATransformerConfig, MLA name maps
    rope_types: tuple[str, ...] = ("default",)  # HF rope_type values the family maps exactly
    sliding_window_layers: bool = False  # layer_types sliding_attention / full_attention map (gpt-oss)
    attention_layer_types: tuple[str, ...] = ("full_attention",)  # config.json layer_types this family builds
    position_embedding_type: str = "rope"  # megatron GPTModel's (gpt-oss: "yarn")
    vision_language: bool = False  # a vision tower in front (image_token_id / spatial_merge_size then defined)

    def __init__(self, hf_config: dict, mtp_num_layers: int = 0):
        self.hf_config = dict(hf_config)
        self.validate()
        self.mtp_num_layers = self._checked_mtp_layers(mtp_num_layers)

    # ------------------------------------------------------------------ config
    def cfg(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.hf_config and self.hf_config[key] is not None:
            return self.hf_config[key]
        if default is _MISSING:
            raise BridgeError(f"HF config for {self.family} has no {key!r}; is this a {self.family} checkpoint?")
        return default

    @property
    def num_layers(self) -> int:
        return int(self.cfg("num_hidden_layers"))

    @property
    def checkpoint_mtp_layers(self) -> int:
        """Multi-token-prediction layers the checkpoint holds after the decoder (``num_nextn_predict_layers``)."""
        return int(self.cfg("num_nextn_predict_layers", 0))

    def _checked_mtp_layers(self, n: int) -> int:
        n = int(n or 0)
        if n and n != self.checkpoint_mtp_layers:
            raise BridgeError(f"--mtp-num-layers {n} but config.json's num_nextn_predict_layers is "
                              f"{self.checkpoint_mtp_layers}: megatron's MTP block maps the checkpoint's own MTP "
                              f"layers, so pass --mtp-num-layers {self.checkpoint_mtp_layers} (keep them) or 0 "
                              "(skip them, as transformers does)")
        return n

    def mtp_hf_layer(self, depth: int) -> int:
        """HF layer index of MTP depth ``depth`` (0-based): the checkpoint stores them after the decoder."""
        return self.num_layers + depth

    def mtp_aliases(self) -> dict[str, str]:
        """HF name of each MTP layer's embedding / output head -> the main model's tensor it equals.

        megatron's MTP block shares the model's embedding and output layer (as DeepSeek-V3 trains it);
        checkpoints store a copy under the MTP layer (``embed_tokens``, ``shared_head.head``). The load
        accepts them only equal to the main tensors; the export writes them from the main tensors."""
        head = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
        out = {}
        for d in range(self.mtp_num_layers):
            p = f"model.layers.{self.mtp_hf_layer(d)}."
            out[p + "embed_tokens.weight"] = "model.embed_tokens.weight"
            out[p + "shared_head.head.weight"] = head
        return out

    @property
    def hidden_size(self) -> int:
        return int(self.cfg("hidden_size"))

    @property
    def num_heads(self) -> int:
        return int(self.cfg("num_attention_heads"))

    @property
    def num_query_groups(self) -> int:
        return int(self.cfg("num_key_value_heads", self.num_heads))

    @property
    def head_dim(self) -> int:
        return int(self.cfg("head_dim", self.hidden_size // self.num_heads))

    @property
    def vocab_size(self) -> int:
        return int(self.cfg("vocab_size"))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.cfg("tie_word_embeddings", False))

    @property
    def rope_theta(self) -> float:
        rope = self.cfg("rope_parameters", {}) or {}
        return float(self.cfg("rope_theta", rope.get("rope_theta", 10000.0)))

    @property
    def num_experts(self) -> int:
        return int(self.cfg("num_experts", self.cfg("num_local_experts", self.cfg("n_routed_experts", 0))))

    @property
    def moe_ffn_hidden_size(self) -> int:
        return int(self.cfg(self.moe_ffn_key))

    @property
    def shared_expert_size(self) -> int:
        """Hidden size of the always-on shared expert MLP of a MoE layer; 0: none."""
        return 0

    @property
    def _rope(self) -> dict[str, Any]:
        """The RoPE settings, wherever config.json keeps them (transformers 5's ``rope_parameters``, or
        ``rope_scaling``, which wins)."""
        rope = dict(self.cfg("rope_parameters", {}) or {})
        rope.update(self.cfg("rope_scaling", {}) or {})
        return rope

    def _yarn_problems(self, derived_from: str) -> list[str]:
        """What megatron's YarnRotaryEmbedding cannot take from a YaRN ``rope_parameters``: missing fields, and an
        explicit ``attention_factor`` (megatron derives the scale from ``derived_from``)."""
        rope, problems = self._rope, []
        missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
        if missing:
            problems.append(f"yarn rope_parameters without {missing}")
        if rope.get("attention_factor") is not None:
            problems.append(f"yarn attention_factor={rope['attention_factor']} (megatron derives it from "
                            f"{derived_from})")
        return problems

    @property
    def rotary_percent(self) -> float:
        return float(self._rope.get("partial_rotary_factor", self.cfg("partial_rotary_factor", 1.0)))

    def router_config(self) -> dict[str, Any]:
        """megatron router fields: top-k over a softmax. ``norm_topk_prob``: softmax over the top-k
        logits == renormalised top-k of the full softmax; otherwise softmax over all experts first."""
        return dict(moe_router_pre_softmax=not bool(self.cfg("norm_topk_prob", True)),
                    moe_router_score_function="softmax")

    def is_moe_layer(self, layer: int) -> bool:
        if not self.moe:
            return False
        step = int(self.cfg("decoder_sparse_step", 1))
        return layer not in set(self.cfg("mlp_only_layers", []) or []) and (layer + 1) % step == 0

    def unsupported(self) -> list[str]:
        """Every HF config feature this bridge cannot reproduce exactly."""
        problems = []
        model_type = self.cfg("model_type", None)
        if self.model_types and model_type not in self.model_types:
            problems.append(f"model_type={model_type!r} (this bridge handles {', '.join(self.model_types)})")
        act = self.cfg("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act={act!r} (only 'silu' gated MLPs)")
        rope = self._rope
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, *self.rope_types):
            problems.append(f"rope scaling type {rope_type!r} (only {' / '.join(self.rope_types)} RoPE)")
        partial = self.rotary_percent
        rotary_dim = self.head_dim * partial
        if partial != 1.0 and not self.partial_rotary:
            problems.append(f"partial_rotary_factor={partial} (only full rotary)")
        elif not 0 < partial <= 1 or rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
            problems.append(f"partial_rotary_factor={partial} (head_dim {self.head_dim} x factor must be an even "
                            "number of rotated dims)")
        if self.cfg("use_sliding_window", False):
            problems.append("use_sliding_window=true (sliding-window attention)")
        if not self.sliding_window_gated and not self.sliding_window_layers and self.cfg("sliding_window", None):
            problems.append(f"sliding_window={self.cfg('sliding_window')} (sliding-window attention; megatron "
                            "attention here is full causal)")
        layer_types = self.cfg("layer_types", None) or []
        mapped = ("full_attention", "sliding_attention") if self.sliding_window_layers else self.attention_layer_types
        odd = sorted({t for t in layer_types if t not in mapped})
        if odd:
            problems.append(f"layer_types {odd} (only {' / '.join(mapped)})")
        if self.cfg("attention_bias", False) and not self.qkv_bias:
            problems.append("attention_bias=true (this family maps no attention bias)")
        if self.cfg("mlp_bias", False):
            problems.append("mlp_bias=true (MLP biases are not mapped)")
        if self.num_heads % self.num_query_groups:
            problems.append(f"num_attention_heads={self.num_heads} not a multiple of "
                            f"num_key_value_heads={self.num_query_groups}")
        quant = quantized_checkpoint(self.hf_config)
        if quant:
            problems.append(quant)
        if self.moe:
            if not self.num_experts:
                problems.append("num_experts missing or 0 for an MoE family")
            if self.cfg("shared_expert_intermediate_size", 0) and not self.shared_expert_size:
                problems.append("shared_expert_intermediate_size>0 (shared experts are not mapped for "
                                f"{self.family})")
        return problems

    def validate(self) -> None:
        problems = self.unsupported()
        if problems:
            raise BridgeError(f"{self.family} bridge cannot map this HF config exactly; unsupported: "
                              + "; ".join(problems)
                              + ". Use a checkpoint without these features or extend the bridge.")

    def transformer_config(self, layout, params_dtype: torch.dtype = torch.float32, **overrides):
        """Map the HF config (plus ``layout``) to a megatron ``TransformerConfig``.

        ``overrides`` win over everything (e.g. ``recompute_granularity``, and the Megatron-LM
        training flags of config/megatron_flags.py: dropouts, router dtype, aux loss, uneven
        last pipeline stage). Architecture stays the HF config's: those flags are only checked.
        """
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        problems = self.unsupported_layout(layout)
        if problems:
            raise BridgeError(f"{self.family} bridge cannot run layout {layout.describe()} exactly: "
                              + "; ".join(problems))
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
        # uneven stages (--decoder-first/last-pipeline-num-layers): megatron-core checks that split itself
        uneven = any(overrides.get(f"num_layers_in_{edge}_pipeline_stage") is not None for edge in ("first", "last"))
        layout.validate(world, None if uneven else self.num_layers)
        kw: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=int(self.cfg("intermediate_size")),
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=float(self.cfg("rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=float(self.cfg("attention_dropout", 0.0)),
            attention_softmax_in_fp32=True,
            apply_query_key_layer_scaling=False,
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            **layout.megatron_sizes(),
            sequence_parallel=layout.sequence_parallel,
            variable_seq_lengths=True,
            # megatron checks the dispatcher against variable_seq_lengths even for
            # dense models; alltoall is the one that supports it.
            moe_token_dispatcher_type="alltoall",
        )
        kw.update(self.attention_config())
        if self.moe:
            aux = float(self.cfg("router_aux_loss_coef", 0.0))
            kw.update(
                num_moe_experts=self.num_experts,
                moe_ffn_hidden_size=self.moe_ffn_hidden_size,
                moe_router_topk=int(self.cfg("num_experts_per_tok")),
                moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
                moe_aux_loss_coeff=aux,
                moe_router_dtype="fp32",
                moe_layer_freq=[1 if self.is_moe_layer(i) else 0 for i in range(self.num_layers)],
                moe_shared_expert_intermediate_size=self.shared_expert_size or None,
                **self.router_config(),
            )
        kw.update(self.architecture_config())
        kw.update(cpu_config_overrides())
        if self.mtp_num_layers:
            kw.update(mtp_num_layers=self.mtp_num_layers)
        asked = overrides.pop("mtp_num_layers", self.mtp_num_layers)  # --mtp-num-layers: what get_bridge was given
        if (asked or 0) != self.mtp_num_layers:
            raise BridgeError(f"mtp_num_layers={asked} asked of a bridge built with mtp_num_layers="
                              f"{self.mtp_num_layers}; pass it to get_bridge(..., mtp_num_layers=...)")
        kw.update(overrides)
        if isinstance(kw.get("attention_backend"), str):  # --attention-backend arrives by name
            from megatron.core.transformer.enums import AttnBackend

            kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
        if self.mla:
            from megatron.core.transformer import MLATransformerConfig as TransformerConfig  # lazy: megatron-core
        elif self.position_embedding_type == "yarn":
            from megatron_rl.models.yarn_config import YarnTransformerConfig as TransformerConfig  # lazy: megatron
        try:
            return TransformerConfig(**kw)
        except (AssertionError, ValueError) as exc:
            raise BridgeError(f"megatron TransformerConfig rejected the {self.family} config for layout "
                              f"{layout.describe()}: {exc}") from exc

    def unsupported_layout(self, layout) -> list[str]:
        """Parallel layouts whose megatron-core 0.16.1 result would differ from HF for this family (each
        with the fix); checked when the megatron config is built, before any collective."""
        return []

    def attention_config(self) -> dict[str, Any]:
        """Attention fields of the megatron config beyond the GQA ones (MLA families: its ranks and dims)."""
        return {}

    def architecture_config(self) -> dict[str, Any]:
        """Any other megatron config fields a family sets (gpt-oss: biases, activation, sinks, windows, YaRN);
        applied after the MoE fields, before the CPU flags and the caller's overrides."""
        return {}

    # -------------------------------------------------------------------- spec
    def layer_spec(self, config, moe: Optional[bool] = None):
        """ModuleSpec of one transformer layer (MoE or dense MLP; MLA attention when ``mla``)."""
        moe = self.moe if moe is None else moe
        num_experts = config.num_moe_experts if moe else None
        mla = {"multi_latent_attention": True} if self.mla else {}
        return LAYER_SPECS[layer_spec_flavour()](num_experts=num_experts, qk_layernorm=self.qk_norm, **mla)

    def block_spec(self, config, vp_stage: Optional[int] = None):
        """``TransformerBlockSubmodules`` for the layers of this rank's ``vp_stage``."""
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules, get_num_layers_to_build)
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = {m: self.layer_spec(config, moe=m) for m in {self.is_moe_layer(offset + i) for i in range(n)}}
        return TransformerBlockSubmodules(
            layer_specs=[specs[self.is_moe_layer(offset + i)] for i in range(n)],
            layer_norm=self.final_norm())

    def mtp_block_spec(self, config):
        """megatron's ``MultiTokenPredictionBlockSubmodules``: one MTP layer per depth, each around the layer spec
        of HF layer ``num_layers + depth`` (MoE or dense as that layer is), norms and ``eh_proj`` of the layer
        spec's backend."""
        from megatron_rl.models.mtp import mtp_block_spec  # lazy: imports megatron-core

        return mtp_block_spec(config, [self.layer_spec(config, moe=self.is_moe_layer(self.mtp_hf_layer(d)))
                                       for d in range(self.mtp_num_layers)])

    def final_norm(self):
        """The module class of the decoder's final norm (Gemma: zero-centred)."""
        return final_norm_module()

    def _local_spec_only(self, flavour: str) -> None:
        """Refuse the transformer-engine layer spec for a family whose norms it cannot hold (zero-centred
        gains, post-norms)."""
        if flavour != "local":
            raise BridgeError(f"{self.family} runs on megatron's local layer spec only (the transformer-engine "
                              "spec's fused norms have a plain gain, and it has no post-attention / post-MLP "
                              "norms); run without transformer-engine installed")

    def gpt_model_class(self):
        """The ``GPTModel`` subclass a family builds (a vision-language model: one with its vision tower); None:
        megatron's ``GPTModel``."""
        return None

    def finish_model(self, model) -> None:
        """Attach what a family computes outside megatron's modules to one built chunk (Gemma: the
        embedding scale and logit soft-capping, as forward hooks)."""

    def padded_vocab_size(self, tp_size: int, divisible_by: int = 128) -> int:
        return weight_maps.padded_vocab_size(self.vocab_size, tp_size, divisible_by)

    def build_model(self, layout, params_dtype: torch.dtype = torch.float32, make_vocab_size_divisible_by: int = 128,
                    pg_collection=None, **overrides) -> list:
        """Build this rank's model chunks (one ``GPTModel`` per virtual stage).

        Needs :func:`initialize_parallel` with the same ``layout``. Pre/post-process
        follow the (virtual) pipeline stage; with tied embeddings megatron shares the
        first stage's embedding with the last stage's output layer (it syncs them
        through the embedding group; after :meth:`load_hf_weights` both hold the same
        values). Parameters are on CPU on a CPU host, on the current GPU otherwise.

        ``pg_collection``: the layout's megatron-core ``ProcessGroupCollection``
        (``models.parallel.LayoutScope``), handed to every ``GPTModel`` (whose blocks, layers, embedding and
        output layer then hold its groups) and read for the pipeline stage; None: ``parallel_state``'s groups.
        Either way ``parallel_state``'s globals must be this layout's while the model is built: the layer specs'
        pipeline offsets (``block_spec``: megatron's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``
        default to its PP rank) and an MTP block (megatron's ``GPTModel`` builds it without the collection) read them.
        """
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage, is_vp_first_stage,
                                                           is_vp_last_stage)

        apply_cpu_compat()
        config = self.transformer_config(layout, params_dtype=params_dtype, **overrides)
        vpp = layout.num_model_chunks
        chunks = []
        for vp_stage in range(vpp):
            stage = vp_stage if vpp > 1 else None
            if pg_collection is None:
                pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
                post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
            else:
                pre = is_pp_first_stage(pg_collection.pp) and is_vp_first_stage(stage, vpp)
                post = is_pp_last_stage(pg_collection.pp) and is_vp_last_stage(stage, vpp)
            mtp = self.mtp_block_spec(config) if post and self.mtp_num_layers else None
            model_class = self.gpt_model_class() or GPTModel
            if mtp is not None:
                from megatron_rl.models.mtp import MtpGPTModel as model_class  # lazy: imports megatron-core
            model = model_class(
                config=config,
                transformer_layer_spec=self.block_spec(config, vp_stage=stage),
                vocab_size=self.padded_vocab_size(layout.tp, make_vocab_size_divisible_by),
                max_sequence_length=int(self.cfg("max_position_embeddings", 4096)),
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=self.tie_word_embeddings,
                position_embedding_type=self.position_embedding_type,
                rotary_base=self.rope_theta,
                rotary_percent=self.rotary_percent,
                parallel_output=True,
                vp_stage=stage,
                **({"mtp_block_spec": mtp} if mtp is not None else {}),
                **({"pg_collection": pg_collection} if pg_collection is not None else {}),
            )
            self.finish_model(model)
            if torch.cuda.is_available() and not config.use_cpu_initialization:
                model.cuda(torch.cuda.current_device())
            chunks.append(model)
        return chunks

    # --------------------------------------------------------------- name maps
    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of this config holds, with its shape."""
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h),
                                              "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            shapes.update(self.hf_layer_shapes(i))
        for d in range(self.mtp_num_layers):
            layer = self.mtp_hf_layer(d)
            p = f"model.layers.{layer}."
            shapes.update(self.hf_layer_shapes(layer))
            shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                           p + "shared_head.norm.weight": (h,)})
        shapes.update({alias: shapes[main] for alias, main in self.mtp_aliases().items()})
        return shapes

    def hf_layer_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """HF tensors of decoder layer ``i`` (an MTP layer's decoder layer too) with their shapes."""
        h = self.hidden_size
        p = f"model.layers.{i}."
        shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,),
                                              p + "post_attention_layernorm.weight": (h,)}
        shapes.update(self.hf_attention_shapes(p + "self_attn."))
        if self.is_moe_layer(i):
            moe = f"{p}{self.hf_moe_block}."
            shapes.update(self.hf_router_expert_shapes(moe))
            if self.shared_expert_size:
                s = self.shared_expert_size
                shapes[moe + "shared_experts.gate_proj.weight"] = (s, h)
                shapes[moe + "shared_experts.up_proj.weight"] = (s, h)
                shapes[moe + "shared_experts.down_proj.weight"] = (h, s)
        else:
            f = int(self.cfg("intermediate_size"))
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
        return shapes

    def hf_router_expert_shapes(self, moe: str) -> dict[str, tuple[int, ...]]:
        """HF tensors of one MoE layer's router and routed experts (names under prefix ``moe``)."""
        h, f = self.hidden_size, self.moe_ffn_hidden_size
        gate, up, down = self.hf_expert_projs
        shapes: dict[str, tuple[int, ...]] = {moe + "gate.weight": (self.num_experts, h)}
        if self.router_expert_bias:
            shapes[moe + "gate.e_score_correction_bias"] = (self.num_experts,)
        for e in range(self.num_experts):
            shapes[moe + f"experts.{e}.{gate}.weight"] = (f, h)
            shapes[moe + f"experts.{e}.{up}.weight"] = (f, h)
            shapes[moe + f"experts.{e}.{down}.weight"] = (h, f)
        return shapes

    def megatron_router_expert_shapes(self, layer: str) -> dict[str, tuple[int, ...]]:
        """Canonical megatron parameters of one MoE layer's router and routed experts (prefix ``layer``)."""
        h, f = self.hidden_size, self.moe_ffn_hidden_size
        shapes: dict[str, tuple[int, ...]] = {layer + "mlp.router.weight": (self.num_experts, h)}
        if self.router_expert_bias:
            shapes[layer + "mlp.router.expert_bias"] = (self.num_experts,)
        for e in range(self.num_experts):
            shapes[layer + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * f, h)
            shapes[layer + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        return shapes

    def hf_attention_shapes(self, attn: str) -> dict[str, tuple[int, ...]]:
        """HF tensors of one layer's attention (names under prefix ``attn``) with their shapes."""
        h, d, nh, ng = self.hidden_size, self.head_dim, self.num_heads, self.num_query_groups
        shapes: dict[str, tuple[int, ...]] = {
            attn + "q_proj.weight": (nh * d, h), attn + "k_proj.weight": (ng * d, h),
            attn + "v_proj.weight": (ng * d, h), attn + "o_proj.weight": (h, nh * d)}
        if self.qkv_bias:
            shapes.update({attn + "q_proj.bias": (nh * d,), attn + "k_proj.bias": (ng * d,),
                           attn + "v_proj.bias": (ng * d,)})
        if self.qk_norm:
            shapes.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
        return shapes

    def megatron_attention_shapes(self, names: weight_maps.LayerSpecNames) -> dict[str, tuple[int, ...]]:
        """Canonical megatron parameters of one layer's attention (relative to the layer), full shapes,
        input norm included (layer spec ``names``)."""
        h, d, nh, ng = self.hidden_size, self.head_dim, self.num_heads, self.num_query_groups
        shapes = {names.input_norm: (h,), "self_attention.linear_qkv.weight": ((nh + 2 * ng) * d, h),
                  "self_attention.linear_proj.weight": (h, nh * d)}
        if self.qkv_bias:
            shapes["self_attention.linear_qkv.bias"] = ((nh + 2 * ng) * d,)
        if self.qk_norm:
            shapes.update({"self_attention.q_layernorm.weight": (d,), "self_attention.k_layernorm.weight": (d,)})
        return shapes

    def attention_rules(self, attn: str) -> dict[str, tuple[str, tuple[str, ...]]]:
        """Layer-relative megatron attention parameter -> (rule kind, HF names under prefix ``attn``)."""
        return {
            "self_attention.linear_qkv.weight": ("qkv", tuple(attn + f"{x}_proj.weight" for x in "qkv")),
            "self_attention.linear_qkv.bias": ("qkv", tuple(attn + f"{x}_proj.bias" for x in "qkv")),
            "self_attention.linear_proj.weight": ("copy", (attn + "o_proj.weight",)),
            "self_attention.q_layernorm.weight": ("copy", (attn + "q_norm.weight",)),
            "self_attention.k_layernorm.weight": ("copy", (attn + "k_norm.weight",)),
        }

    def ignorable_hf_names(self) -> set[str]:
        """HF tensors that may legitimately be present but map to nothing."""
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def is_ignorable_hf_name(self, name: str) -> bool:
        """Whether HF tensor ``name`` may be present yet map to nothing (as transformers skips it on load)."""
        return name in self.ignorable_hf_names()

    _LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
    _MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
    #: an MTP layer's own modules (megatron name -> HF name under the layer); its decoder layer is
    #: ``transformer_layer``, mapped as decoder layer ``num_layers + depth``
    _MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                "final_layernorm.weight": "shared_head.norm.weight"}
    _EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

    def rule_for(self, name: str) -> ParamRule:
        """The HF source of the megatron parameter with canonical (global-index) ``name``."""
        if name == "embedding.word_embeddings.weight":
            return ParamRule("vocab", ("model.embed_tokens.weight",))
        if name == "output_layer.weight":
            src = "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"
            return ParamRule("vocab", (src,))
        if name == "decoder.final_layernorm.weight":
            return ParamRule("copy", ("model.norm.weight",))
        mtp = self._MTP.match(name)
        if mtp and int(mtp.group(1)) < self.mtp_num_layers:
            layer, rest = self.mtp_hf_layer(int(mtp.group(1))), mtp.group(2)
            if rest in self._MTP_OWN:
                return ParamRule("copy", (f"model.layers.{layer}.{self._MTP_OWN[rest]}",))
            if rest.startswith("transformer_layer."):
                return self.rule_for(f"decoder.layers.{layer}.{rest[len('transformer_layer.'):]}")
        m = self._LAYER.match(name)
        if m:
            layer, rest = int(m.group(1)), m.group(2)
            p = f"model.layers.{layer}."
            attn, moe, shared = p + "self_attn.", f"{p}{self.hf_moe_block}.", f"{p}{self.hf_moe_block}.shared_experts."
            table = {
                **self.attention_rules(attn),
                "mlp.linear_fc1.weight": ("gate_up", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                "mlp.linear_fc2.weight": ("copy", (p + "mlp.down_proj.weight",)),
                "mlp.router.weight": ("copy", (moe + "gate.weight",)),
                "mlp.router.expert_bias": ("copy", (moe + "gate.e_score_correction_bias",)),
                "mlp.shared_experts.linear_fc1.weight": ("gate_up", (shared + "gate_proj.weight",
                                                                     shared + "up_proj.weight")),
                "mlp.shared_experts.linear_fc2.weight": ("copy", (shared + "down_proj.weight",)),
            }
            for spec_names in weight_maps.LAYER_SPEC_NAMES.values():  # norms sit where each layer spec puts them
                table[spec_names.input_norm] = ("copy", (p + "input_layernorm.weight",))
                for pre_mlp in (spec_names.dense_pre_mlp_norm, spec_names.moe_pre_mlp_norm):
                    table[pre_mlp] = ("copy", (p + "post_attention_layernorm.weight",))
            if rest in table:
                kind, names = table[rest]
                return ParamRule(kind, names)
            e = self._EXPERT.match(rest)
            if e:
                ex = f"{moe}experts.{int(e.group(1))}."
                gate, up, down = self.hf_expert_projs
                if e.group(2) == "linear_fc1":
                    return ParamRule("gate_up", (f"{ex}{gate}.weight", f"{ex}{up}.weight"))
                return ParamRule("copy", (f"{ex}{down}.weight",))
        raise BridgeError(f"{self.family} bridge has no HF mapping for megatron parameter {name!r}")

    def exported_names(self, name: str) -> tuple[str, ...]:
        """HF names produced on export by canonical parameter ``name`` (none for the
        tied output layer, whose values the embedding already exports, and none for a
        TE ``_extra_state`` entry)."""
        if weight_maps.is_extra_state(name) or (name == "output_layer.weight" and self.tie_word_embeddings):
            return ()
        rule = self.rule_for(name)
        if rule.expert is not None:  # one slice of a stacked HF tensor: weights.stack_expert_pieces joins them
            return tuple(weight_maps.expert_piece_name(n, rule.expert) for n in rule.hf_names)
        return rule.hf_names

    def megatron_param_shapes(self, flavour: str = "local", tp_size: int = 1) -> dict[str, tuple[int, ...]]:
        """Canonical name -> full (TP-gathered) shape of every parameter a single-stage
        model of this config holds when built with layer spec ``flavour`` (a key of
        :data:`weight_maps.LAYER_SPEC_NAMES`). The pure megatron side of the name map:
        what a live model's ``canonical_parameters`` must list (checked against a built
        local model in tests; the TE side is checked as a name/shape map only)."""
        names = weight_maps.LAYER_SPEC_NAMES[flavour]
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "embedding.word_embeddings.weight": (self.padded_vocab_size(tp_size), h),
            "decoder.final_layernorm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["output_layer.weight"] = (self.padded_vocab_size(tp_size), h)
        for i in range(self.num_layers):
            shapes.update({f"decoder.layers.{i}.{n}": s for n, s in self.megatron_layer_shapes(i, names).items()})
        for d in range(self.mtp_num_layers):
            p = f"mtp.layers.{d}."
            shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                           p + "final_layernorm.weight": (h,)})
            shapes.update({f"{p}transformer_layer.{n}": s
                           for n, s in self.megatron_layer_shapes(self.mtp_hf_layer(d), names).items()})
        return shapes

    def megatron_layer_shapes(self, i: int, names: weight_maps.LayerSpecNames) -> dict[str, tuple[int, ...]]:
        """Parameters of one megatron transformer layer (names relative to it) built as HF layer ``i`` is."""
        h = self.hidden_size
        shapes = dict(self.megatron_attention_shapes(names))
        if self.is_moe_layer(i):
            shapes[names.moe_pre_mlp_norm] = (h,)
            shapes.update(self.megatron_router_expert_shapes(""))
            if self.shared_expert_size:
                shapes["mlp.shared_experts.linear_fc1.weight"] = (2 * self.shared_expert_size, h)
                shapes["mlp.shared_experts.linear_fc2.weight"] = (h, self.shared_expert_size)
        else:
            f = int(self.cfg("intermediate_size"))
            shapes[names.dense_pre_mlp_norm] = (h,)
            shapes["mlp.linear_fc1.weight"] = (2 * f, h)
            shapes["mlp.linear_fc2.weight"] = (h, f)
        return shapes

    def hf_to_megatron(self, flavour: str = "local") -> dict[str, tuple[str, ...]]:
        """HF name -> the canonical megatron parameters built from it (layer spec
        ``flavour``): the inverse of :meth:`rule_for` over :meth:`megatron_param_shapes`.
        With the TE spec ``input_layernorm.weight`` feeds ``linear_qkv.layer_norm_weight``."""
        out: dict[str, list[str]] = {}
        for name in self.megatron_param_shapes(flavour):
            for hf in self.rule_for(name).hf_names:
                out.setdefault(hf, []).append(name)
        return {hf: tuple(names) for hf, names in out.items()}

    # ---------------------------------------------------------------- weights
    def load_hf_weights(self, model_chunks, hf_dir: str | os.PathLike) -> None:
        weights.load_hf_weights(self, model_chunks, hf_dir)

    def export_hf_weights(self, model_chunks, bucket_bytes: Optional[int] = None, stage_only: bool = False,
                          include_mtp: bool = True, include_vision: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return weights.export_hf_weights(self, model_chunks, bucket_bytes=bucket_bytes, stage_only=stage_only,
                                         include_mtp=include_mtp, include_vision=include_vision)


def read_hf_config(hf_dir_or_config) -> dict:
    """``config.json`` of a checkpoint dir, a dict, or a ``transformers`` config object."""
    if isinstance(hf_dir_or_config, dict):
        return dict(hf_dir_or_config)
    if hasattr(hf_dir_or_config, "to_dict"):
        return hf_dir_or_config.to_dict()
    path = os.fspath(hf_dir_or_config)
    config_path = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise BridgeError(f"no HF config at {config_path}; pass an HF checkpoint directory (with config.json)")
    with open(config_path) as f:
        return json.load(f)
