"""Static memory of the training ranks: parameters, gradient buffers and optimizer state, from config.json and flags.

What one training rank holds before the first micro-batch runs, per role model (the actor, ppo's critic, a frozen
teacher of other shapes) and per weight tag (a reference or teacher of the actor's shapes: ``backends/roles.py``),
computed from the model's ``config.json`` and the parallel/precision/optimizer flags alone, so ``--dry-run`` and
``tools/check_plan.py`` answer without torch. Activations, the KV cache of a colocated engine, NCCL buffers and the
allocator's workspace are *not* in this slice: the report says so on a row of its own and never gives a fit
verdict beyond "static memory alone leaves X GiB for them".

How each kind is counted (megatron-core 0.16.1, as ``backends/megatron/role_model.py`` builds a role):

* **parameters**: this rank's shards, as megatron lays them out: the vocab padded to a multiple of 128 x TP, the
  word embeddings on the first pipeline stage, the output layer on the last (one tensor for tied embeddings at
  PP 1, a copy on the last stage at PP > 1, and an embedding copy there for MTP), column-/row-parallel linears
  split over TP, norms replicated, routed experts split over EP (``E / ep`` per rank) and expert-TP, MLA's down
  projections replicated, MTP layers on the last stage. ``--bf16`` / ``--fp16``: 2 bytes, else 4. With the
  distributed optimizer the trainable parameters live in DDP's contiguous param buffer, padded as the gradient
  buffer is (below); frozen ones (a LoRA base, untrained MTP layers) are their own tensors.
* **gradient buffers**: DDP's main grads, fp32 (``grad_reduce_in_fp32=True``: ``settings.ddp_config_kwargs``), one
  buffer per model chunk and per dense / expert group; with the distributed optimizer every parameter starts on a
  multiple of 64 elements and every bucket ends on a multiple of lcm(DP, 128); a tied (or MTP-shared) embedding is
  a bucket of its own. Only trainable parameters have one.
* **optimizer state**: Adam's two fp32 moments (SGD: one momentum) and, when the parameters are bf16/fp16, an fp32
  master copy; sharded over DP x CP (expert weights: over expert-DP) by the distributed optimizer (the average
  shard: ranks differ by the buckets' padding). ``--optimizer-cpu-offload`` (megatron-core's
  ``HybridDeviceOptimizer``, fraction ``f``): the offloaded part is host memory, an fp32 copy of each shard, an fp32
  gradient copy and the moments (16 bytes per element with Adam); the rest stays on the device.
* **weight tags**: a reference / teacher of the actor's shapes is a copy of this rank's actor parameters (with LoRA:
  of the adapters only), and once a tag is in use the actor's own values are kept aside too (``WeightManager``):
  one copy per tag plus one. Where (``--ref-weights-location``): host unless ``device``, or ``auto`` with one copy
  at most a quarter of what static memory leaves (the run decides ``auto`` from the measured free memory).

FSDP2 (``--train-backend fsdp``): the HF model's parameters (no vocab padding, tied embeddings once) sharded over
DP in fp32 (``--bf16`` is the compute dtype only), fp32 sharded gradients, the moments; ``--optimizer-cpu-offload``
puts all three in host memory. Each tensor's first dimension is padded to a multiple of DP by FSDP2 (not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from megatron_rl.errors import PlanError

GIB = 2 ** 30

#: ``--gpu-type`` -> device memory in GiB: the total ``nvidia-smi`` reports for the card (A100 80GB: 81920 MiB,
#: H100 80GB SXM: 81559 MiB, H200: 143771 MiB, B200: 183359 MiB). The CUDA context and NCCL take a little of it.
GPU_MEMORY_GIB = {"A100-80G": 80.0, "H100-80G": 79.6, "H200-141G": 140.4, "B200-192G": 179.1}
DEFAULT_GPU_TYPE = "H100-80G"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# ``--ref-weights-location auto`` keeps the tags on the device only when one copy of this rank's
# parameters takes at most this share of the device memory still free once model and optimizer
# exist: activations of the forward/backward passes need the rest.
DEVICE_TAG_SHARE = 0.25
NOT_ESTIMATED = "not estimated yet"

# config.json families (models/families.py): where their parameters differ from the Llama baseline
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_MLA = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2")
_DSA = ("deepseek_v32", "glm_moe_dsa")  # a lightning indexer per layer (frozen: models/dsa.py)
_SIGMOID_ROUTER = ("glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "minimax_m2")  # a selection bias per expert (an fp32 buffer)
_GATED_HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # gated attention + gated delta-net layers
_MOE_FFN_KEY = {"mixtral": "intermediate_size", "gpt_oss": "intermediate_size", "minimax_m2": "intermediate_size"}
_ALL_HEADS_QK_NORM = ("minimax_m2",)  # q/k norm gains per channel of all heads (nh x hd, ng x hd)
_TIED_BY_DEFAULT = ("gemma3_text", "gemma4_text")


def gpu_memory_gib(gpu_type: Optional[str] = None, override: Optional[float] = None) -> tuple[float, str]:
    """``(GiB, how it was chosen)`` of one GPU: ``override`` (``--gpu-memory-gib``), else ``gpu_type`` from
    :data:`GPU_MEMORY_GIB` (``--gpu-type``, default H100-80G)."""
    if override is not None:
        if not override > 0:
            raise PlanError(f"--gpu-memory-gib {override} must be a positive number of GiB")
        return float(override), f"--gpu-memory-gib: {override:g} GiB"
    name = gpu_type or DEFAULT_GPU_TYPE
    if name not in GPU_MEMORY_GIB:
        raise PlanError(f"--gpu-type {name!r} is not one of {', '.join(GPU_MEMORY_GIB)}; pick one, or give the "
                        "card's memory with --gpu-memory-gib")
    return GPU_MEMORY_GIB[name], f"{name}{'' if gpu_type else ' (the default --gpu-type)'}: {GPU_MEMORY_GIB[name]:g} GiB"


# ---------------------------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelArch:
    """The config.json facts that size a model's parameters (``from_hf_config``); one field per switch the bridges
    of ``models/families.py`` map."""

    model_type: str
    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    layers: int
    ffn: int
    tied: bool = False
    experts: int = 0
    moe_ffn: int = 0
    moe_layers: tuple[int, ...] = ()  # 1 per MoE layer
    shared_expert: int = 0  # the always-on shared expert's hidden size (0: none)
    shared_expert_gate: bool = False
    router_bias: bool = False  # gpt-oss: a router bias parameter
    expert_bias_buffer: bool = False  # sigmoid routers: an fp32 selection bias (a buffer, not trained)
    expert_biases: bool = False  # gpt-oss: fc1 / fc2 biases on every expert
    qkv_bias: bool = False
    o_bias: bool = False  # gpt-oss: linear_proj bias
    sinks: bool = False  # gpt-oss: a learnable softmax offset per head
    qk_norm: bool = False
    qk_norm_all_heads: bool = False  # minimax_m2: the q / k norm gains cover every head's channels
    gated_attention: bool = False  # qwen3_next: linear_qkv also gives a gate per head
    extra_norms: int = 0  # gemma3: post-attention and post-MLP norms
    layer_scalar: bool = False  # gemma4: a one-element buffer per layer scaling its output
    mla: Optional[tuple[Optional[int], int, int, int, int]] = None  # (q_lora_rank, kv_lora_rank, nope, rope, v)
    indexer: Optional[tuple[int, int]] = None  # DSA: (index_n_heads, index_head_dim), replicated over TP, frozen
    linear_layers: tuple[int, ...] = ()  # 1 per gated delta-net layer
    gdn: Optional[tuple[int, int, int, int, int]] = None  # (nk, nv, dk, dv, conv kernel)
    mtp_layers_in_checkpoint: int = 0  # num_nextn_predict_layers
    topk: int = 0  # experts per token (num_experts_per_tok): the MoE dispatch's token copies

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelArch":
        """From a ``config.json`` dict (a multimodal config's ``text_config``)."""
        c = hf["text_config"] if "num_attention_heads" not in hf and isinstance(hf.get("text_config"), dict) else hf

        def need(key: str) -> int:
            if c.get(key) is None:
                raise PlanError(f"config.json has no {key!r}: the memory estimate needs it")
            return int(c[key])

        mt = str(c.get("model_type") or "")
        h, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
        experts = int(next((c[k] for k in _EXPERT_KEYS if c.get(k)), 0))
        moe_layers: tuple[int, ...] = ()
        if experts:
            step = int(c.get("decoder_sparse_step") or 1)
            dense = set(c.get("mlp_only_layers") or []) | set(range(int(c.get("first_k_dense_replace") or 0)))
            # MTP layers too (index layers + depth): the bridges build each as its HF layer index says
            moe_layers = tuple(0 if i in dense or (i + 1) % step else 1
                               for i in range(layers + int(c.get("num_nextn_predict_layers") or 0)))
        shared = (int(c.get("shared_expert_intermediate_size") or 0) if mt in _GATED_HYBRID
                  else int(c.get("n_shared_experts") or 0) * int(c.get("moe_intermediate_size") or 0))
        linear: tuple[int, ...] = ()
        gdn = None
        if mt in _GATED_HYBRID:
            types = c.get("layer_types") or ["linear_attention" if (i + 1) % int(c.get("full_attention_interval") or 4)
                                             else "full_attention" for i in range(layers)]
            linear = tuple(int(t == "linear_attention") for t in types)
            gdn = (int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"]), int(c["linear_key_head_dim"]),
                   int(c["linear_value_head_dim"]), int(c.get("linear_conv_kernel_dim") or 4))
        mla = None
        if mt in _MLA:
            q = c.get("q_lora_rank")
            mla = (None if q is None else int(q), int(c["kv_lora_rank"]), int(c["qk_nope_head_dim"]),
                   int(c["qk_rope_head_dim"]), int(c["v_head_dim"]))
        return cls(
            model_type=mt, hidden=h, heads=heads, groups=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or h // heads), vocab=need("vocab_size"), layers=layers,
            ffn=int(c.get("intermediate_size") or 0),
            tied=bool(c.get("tie_word_embeddings", mt in _TIED_BY_DEFAULT)),
            experts=experts, moe_ffn=int(c.get(_MOE_FFN_KEY.get(mt, "moe_intermediate_size")) or 0),
            moe_layers=moe_layers, shared_expert=shared,
            shared_expert_gate=mt in ("qwen3_next", "qwen3_5_moe_text") and shared > 0,
            router_bias=mt == "gpt_oss", expert_bias_buffer=mt in _SIGMOID_ROUTER and experts > 0,
            expert_biases=mt == "gpt_oss",
            qkv_bias=mt in ("qwen2", "gpt_oss") or (mt == "glm4_moe" and bool(c.get("attention_bias"))),
            o_bias=mt == "gpt_oss", sinks=mt == "gpt_oss",
            qk_norm=mt in _QK_NORM or (mt == "glm4_moe" and bool(c.get("use_qk_norm"))),
            qk_norm_all_heads=mt in _ALL_HEADS_QK_NORM,
            gated_attention=mt in _GATED_HYBRID, extra_norms=2 if mt in ("gemma3_text", "gemma4_text") else 0,
            layer_scalar=mt == "gemma4_text",
            mla=mla, linear_layers=linear, gdn=gdn,
            indexer=(int(c["index_n_heads"]), int(c["index_head_dim"])) if mt in _DSA else None,
            mtp_layers_in_checkpoint=int(c.get("num_nextn_predict_layers") or 0),
            topk=int(c.get("num_experts_per_tok") or c.get("moe_topk") or 0) if experts else 0)

    @classmethod
    def from_path(cls, path: str) -> "ModelArch":
        """From a checkpoint dir (its ``config.json``) or a ``config.json`` path."""
        import json
        import os

        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file, encoding="utf-8") as fh:
                return cls.from_hf_config(json.load(fh))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"cannot read the model config {file!r} for the memory estimate: {exc}") from None

    def is_moe_layer(self, i: int) -> bool:
        return i < len(self.moe_layers) and bool(self.moe_layers[i])

    def is_linear_layer(self, i: int) -> bool:
        return i < len(self.linear_layers) and bool(self.linear_layers[i])

    def padded_vocab(self, tp: int) -> int:
        unit = 128 * tp
        return -(-self.vocab // unit) * unit

    def lora_problem(self, targets: tuple[str, ...]) -> Optional[str]:
        """Why ``models/lora.py`` refuses adapters on this model with ``--lora-target-modules targets``, or None."""
        if self.mla:
            return f"LoRA on {self.model_type}'s multi-latent attention is not built (the run refuses it)"
        if self.gated_attention:
            return f"LoRA on {self.model_type}'s gated attention / delta-net layers is not built (the run refuses it)"
        mlp = ("all-linear", "gate_proj", "up_proj", "down_proj")
        if any(self.moe_layers) and any(t.rsplit(".", 1)[-1] in mlp for t in targets):
            return ("LoRA on MoE expert linears is not built (the run refuses it): target the attention projections "
                    "only (--lora-target-modules q_proj k_proj v_proj o_proj)")
        return None


@dataclass(frozen=True)
class Tensors:
    """``count`` tensors of ``numel`` elements each on one rank."""

    numel: int
    count: int = 1
    expert: bool = False  # a routed expert's: expert-DP gradients and optimizer shards
    shared_embedding: bool = False  # a bucket of its own in DDP (tied / MTP embedding at PP > 1)
    frozen: bool = False  # no gradient, no optimizer state
    buffer_fp32: bool = False  # an fp32 buffer (the sigmoid router's expert bias), not a parameter
    site: str = ""  # the linear LoRA adapts ("qkv", "proj", "fc1", "fc2"), else ""

    @property
    def elements(self) -> int:
        return self.numel * self.count


def _split(n: int, by: int) -> int:
    return -(-n // by)


def _layer_tensors(a: ModelArch, i: int, tp: int, ep: int, etp: int) -> list[Tensors]:
    """Parameters of decoder layer ``i`` (an MTP layer's: ``i = layers + depth``) on one TP/EP rank."""
    h, d, nh, ng = a.hidden, a.head_dim, a.heads, a.groups
    out = [Tensors(h)]  # input norm
    if a.is_linear_layer(i) and a.gdn:
        nk, nv, dk, dv, kernel = a.gdn
        out += [Tensors(_split(2 * nk * dk + 2 * nv * dv, tp) * h), Tensors(_split(2 * nv, tp) * h),
                Tensors(_split(2 * nk * dk + nv * dv, tp) * kernel), Tensors(_split(nv, tp), 2), Tensors(dv),
                Tensors(h * _split(nv * dv, tp))]
    elif a.mla:
        q_rank, kv_rank, nope, rope, v = a.mla
        if q_rank is None:
            out.append(Tensors(_split(nh * (nope + rope), tp) * h))
        else:
            out += [Tensors(q_rank * h), Tensors(q_rank), Tensors(_split(nh * (nope + rope), tp) * q_rank)]
        out += [Tensors((kv_rank + rope) * h), Tensors(kv_rank), Tensors(_split(nh * (nope + v), tp) * kv_rank),
                Tensors(h * _split(nh * v, tp))]
        if a.indexer and q_rank is not None:  # wq_b, wk, k_norm gain and bias, weights_proj: whole on every rank
            ih, idim = a.indexer
            out += [Tensors(ih * idim * q_rank, frozen=True), Tensors(idim * h, frozen=True),
                    Tensors(idim, 2, frozen=True), Tensors(ih * h, frozen=True)]
    else:
        rows = ((2 * nh if a.gated_attention else nh) + 2 * ng) * d
        out += [Tensors(_split(rows, tp) * h, site="qkv"), Tensors(h * _split(nh * d, tp), site="proj")]
        if a.qkv_bias:
            out.append(Tensors(_split(rows, tp)))
        if a.o_bias:
            out.append(Tensors(h))
        if a.sinks:
            out.append(Tensors(_split(nh, tp)))
        if a.qk_norm_all_heads:
            out += [Tensors(_split(nh * d, tp)), Tensors(_split(ng * d, tp))]
        elif a.qk_norm:
            out.append(Tensors(d, 2))
    out.append(Tensors(h))  # pre-MLP norm
    if a.extra_norms:
        out.append(Tensors(h, a.extra_norms))
    if a.layer_scalar:
        out.append(Tensors(1, buffer_fp32=True))
    if a.is_moe_layer(i):
        e, f = _split(a.experts, ep), a.moe_ffn
        out.append(Tensors(a.experts * h))  # router
        if a.router_bias:
            out.append(Tensors(a.experts))
        if a.expert_bias_buffer:
            out.append(Tensors(a.experts, buffer_fp32=True))
        out += [Tensors(_split(2 * f, etp) * h, e, expert=True), Tensors(h * _split(f, etp), e, expert=True)]
        if a.expert_biases:
            out += [Tensors(_split(2 * f, etp), e, expert=True), Tensors(h, e, expert=True)]
        if a.shared_expert:
            s = a.shared_expert
            out += [Tensors(_split(2 * s, tp) * h), Tensors(h * _split(s, tp))]
            if a.shared_expert_gate:
                out.append(Tensors(h))
    else:
        out += [Tensors(_split(2 * a.ffn, tp) * h, site="fc1"), Tensors(h * _split(a.ffn, tp), site="fc2")]
    return out


# ---------------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class MegatronLayout:
    """One megatron role's layout on the training world (``models.parallel.ParallelLayout`` plus the world)."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # None: TP (megatron's default)
    vpp: Optional[int] = None
    last_stage_layers: Optional[int] = None  # --decoder-last-pipeline-num-layers
    first_stage_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def stage_of_rank(self, rank: int) -> int:
        """Pipeline stage of global ``rank`` (megatron's default order: TP fastest, PP slowest)."""
        return rank // (self.world // self.pp)

    def chunk_layers(self, num_layers: int, stage: int, chunk: int) -> range:
        """Global indices of the decoder layers of ``chunk`` on pipeline ``stage``."""
        first, last = self.first_stage_layers, self.last_stage_layers
        if (first is not None or last is not None) and self.pp > 1 and self.chunks == 1:
            middle = self.pp - (first is not None) - (last is not None)  # megatron-core's uneven split
            rest = num_layers - (first or 0) - (last or 0)
            each = rest // middle if middle else 0
            sizes = [each] * self.pp
            if first is not None:
                sizes[0] = first
            if last is not None:
                sizes[-1] = last
            start = sum(sizes[:stage])
            return range(start, start + sizes[stage])
        per = num_layers // (self.pp * self.chunks)
        start = (chunk * self.pp + stage) * per
        return range(start, start + per)

    def describe(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"] + ([f"VPP {self.vpp}"] if self.vpp else []) + (
            [f"CP {self.cp}"] if self.cp > 1 else []) + ([f"EP {self.ep}"] if self.ep > 1 else [])
        expert = f" (expert-TP {self.expert_tp}, expert-DP {self.edp})" if self.ep > 1 else ""
        return " x ".join(parts) + f" x DP {self.dp}{expert}"


@dataclass(frozen=True)
class TrainingFlags:
    """The flags that decide a trainable role's static memory."""

    params_dtype: str = "float32"
    distributed_optimizer: bool = False
    cpu_offload: bool = False
    offload_fraction: float = 1.0
    precision_aware: bool = False
    optimizer: str = "adam"
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("all-linear",)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def half(self) -> bool:
        return self.params_dtype != "float32"

    @property
    def moment_bytes(self) -> int:
        return 8 if self.optimizer == "adam" else 4

    def lora_targeted(self, hf_module: str) -> bool:
        return "all-linear" in self.lora_targets or any(
            t == hf_module or t.endswith("." + hf_module) for t in self.lora_targets)


_SITE_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",), "fc1": ("gate_proj", "up_proj"),
               "fc2": ("down_proj",)}


def _lora_adapters(a: ModelArch, layer: list[Tensors], tp: int, flags: TrainingFlags) -> list[Tensors]:
    """``models/lora.py``'s adapters of one layer on one TP rank: per targeted part of a column-parallel linear
    A ``[r, in]`` (replicated) and B ``[rows / tp, r]``; of a row-parallel one A ``[r, in / tp]`` and B ``[out, r]``."""
    r, h, d = flags.lora_rank, a.hidden, a.head_dim
    part_rows = {"q_proj": a.heads * d, "k_proj": a.groups * d, "v_proj": a.groups * d, "gate_proj": a.ffn,
                 "up_proj": a.ffn}
    out = []
    for t in layer:
        for part in _SITE_PARTS.get(t.site, ()):
            if not flags.lora_targeted(part):
                continue
            if t.site in ("qkv", "fc1"):
                out.append(Tensors(r * h + _split(part_rows[part], tp) * r))
            else:
                inner = a.heads * d if t.site == "proj" else a.ffn
                out.append(Tensors(r * _split(inner, tp) + h * r))
    return out


def stage_tensors(a: ModelArch, lay: MegatronLayout, stage: int, chunk: int, *, head: str = "logprob",
                  mtp_layers: int = 0, mtp_trained: bool = False, flags: Optional[TrainingFlags] = None,
                  trainable: bool = True) -> list[Tensors]:
    """Every parameter of one model chunk on one rank of pipeline ``stage`` (``frozen`` set as the role trains
    them: LoRA freezes the base, untrained MTP layers are frozen, a frozen role freezes everything)."""
    tp, pp = lay.tp, lay.pp
    first, last = stage == 0 and chunk == 0, stage == pp - 1 and chunk == lay.chunks - 1
    h, vocab = a.hidden, a.padded_vocab(tp) // tp
    lora = bool(flags and flags.lora_rank)
    base: list[Tensors] = []
    adapters: list[Tensors] = []
    mtp = mtp_layers if last else 0
    if first:
        base.append(Tensors(vocab * h, shared_embedding=pp > 1 and (a.tied or mtp_layers > 0)))
    for i in lay.chunk_layers(a.layers, stage, chunk):
        layer = _layer_tensors(a, i, tp, lay.ep, lay.expert_tp)
        base += layer
        if lora and flags is not None:
            adapters += _lora_adapters(a, layer, tp, flags)
    mtp_part: list[Tensors] = []
    if last:
        base.append(Tensors(h))  # final norm
        if mtp and not first:
            base.append(Tensors(vocab * h, shared_embedding=True))  # MTP's embedding copy
        for depth in range(mtp):
            mtp_part += [Tensors(h, 2), Tensors(_split(h, tp) * 2 * h), Tensors(h)]
            mtp_part += _layer_tensors(a, a.layers + depth, tp, lay.ep, lay.expert_tp)
        if head == "value":
            base.append(Tensors(h + 1))  # ValueHead [1, h] + bias, trains in full (also with LoRA)
            if lora:
                adapters.append(base.pop())
        elif not (a.tied and first):
            base.append(Tensors(vocab * h, shared_embedding=pp > 1 and a.tied and not mtp))
    frozen_base = lora or not trainable
    out = [replace(t, frozen=frozen_base or t.buffer_fp32) for t in base]
    out += [replace(t, frozen=not trainable or not mtp_trained or lora or t.buffer_fp32) for t in mtp_part]
    return out + [replace(t, frozen=not trainable) for t in adapters]


# ---------------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Row:
    """One kind of memory of one component on one rank: bytes on the device and in host memory."""

    kind: str
    device: float = 0.0
    host: float = 0.0
    note: str = ""


@dataclass
class StageMemory:
    """One component's rows on one pipeline stage (``label``: "stage 0", "all stages")."""

    label: str
    rows: list[Row] = field(default_factory=list)
    params: int = 0  # parameters on this rank (elements)

    def total(self, where: str) -> float:
        return sum(getattr(r, where) for r in self.rows)


def _pad(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def buffer_elements(tensors: list[Tensors], dp: int, distributed: bool) -> int:
    """Elements of megatron DDP's param/grad buffer for ``tensors`` (one chunk, one group): with the distributed
    optimizer each parameter starts on a multiple of 64, each bucket ends on a multiple of lcm(dp, 128), and a
    shared embedding is a bucket of its own (``_ParamAndGradBuffer``)."""
    if not distributed:
        return sum(t.elements for t in tensors)
    import math

    unit = math.lcm(dp, 128)
    own = [t for t in tensors if t.shared_embedding]
    rest = [t for t in tensors if not t.shared_embedding]
    buckets = [[t] for t in own] + ([rest] if rest else [])
    return sum(_pad(sum(_pad(t.numel, 64) * t.count for t in b), unit) for b in buckets)


def trainable_memory(chunks: list[list[Tensors]], lay: MegatronLayout, flags: TrainingFlags,
                     label: str) -> StageMemory:
    """The rows of one trainable role on one rank (its model chunks' tensors)."""
    pb, short = flags.param_bytes, DTYPE_SHORT[flags.params_dtype]
    dense_dp = lay.dp * lay.cp
    train_dense = train_expert = frozen = buffers = 0
    buf_elems = 0
    for tensors in chunks:
        dense = [t for t in tensors if not t.frozen and not t.expert]
        expert = [t for t in tensors if not t.frozen and t.expert]
        train_dense += sum(t.elements for t in dense)
        train_expert += sum(t.elements for t in expert)
        frozen += sum(t.elements for t in tensors if t.frozen and not t.buffer_fp32)
        buffers += sum(t.elements for t in tensors if t.buffer_fp32)
        buf_elems += (buffer_elements(dense, dense_dp, flags.distributed_optimizer)
                      + buffer_elements(expert, lay.edp, flags.distributed_optimizer))
    trainable = train_dense + train_expert
    mem = StageMemory(label, params=trainable + frozen)
    held = buf_elems if flags.distributed_optimizer else trainable
    pad = (f"{buf_elems - trainable:,} elements of padding in DDP's buffers"
           if flags.distributed_optimizer and buf_elems > trainable else "")
    mem.rows.append(Row(f"parameters, trainable ({short})", device=held * pb,
                        note="views of DDP's param buffer" + (f" ({pad})" if pad else "")
                        if flags.distributed_optimizer else ""))
    if frozen:
        mem.rows.append(Row(f"parameters, frozen ({short})", device=frozen * pb,
                            note="no gradient, no optimizer state"))
    if buffers:
        mem.rows.append(Row("router expert-bias buffers (fp32)", device=buffers * 4))
    mem.rows.append(Row("gradient buffers (fp32 main grads)", device=buf_elems * 4, note=pad))
    # the optimizer's share of this rank's trainable elements
    if flags.distributed_optimizer:
        shard = train_dense / dense_dp + (train_expert / lay.edp if train_expert else 0)
        how = (f"sharded over DP {lay.dp}" + (f" x CP {lay.cp}" if lay.cp > 1 else "")
               + (f", experts over expert-DP {lay.edp}" if train_expert else ""))
    else:
        shard, how = float(trainable), "not sharded (no --use-distributed-optimizer)"
    mem.rows += optimizer_rows(shard, flags, how)
    return mem


def optimizer_rows(shard: float, flags: TrainingFlags, how: str) -> list[Row]:
    """Master copy and moments of ``shard`` elements (device, or host with --optimizer-cpu-offload)."""
    moments = "exp_avg + exp_avg_sq" if flags.optimizer == "adam" else "momentum"
    f = flags.offload_fraction if flags.cpu_offload else 0.0
    on_device = shard * (1 - f)
    rows = []
    master_device = on_device * 4 if flags.half else 0.0
    if flags.cpu_offload and flags.half and not flags.precision_aware:
        master_device = shard * 4  # the distributed optimizer keeps its own fp32 shard beside the host copy
    if master_device:
        rows.append(Row("optimizer: fp32 master params", device=master_device, note=how))
    if on_device:
        rows.append(Row(f"optimizer: {moments} (fp32)", device=on_device * flags.moment_bytes, note=how))
    if f:
        rows.append(Row(f"optimizer, offloaded: fp32 params, grads, {moments}", host=shard * f * (8 + flags.moment_bytes),
                        note=f"--optimizer-cpu-offload (fraction {f:g}); {how}"))
    return rows


def frozen_memory(chunks: list[list[Tensors]], flags: TrainingFlags, label: str) -> StageMemory:
    n = sum(t.elements for c in chunks for t in c if not t.buffer_fp32)
    buffers = sum(t.elements for c in chunks for t in c if t.buffer_fp32)
    mem = StageMemory(label, params=n)
    mem.rows.append(Row(f"parameters ({DTYPE_SHORT[flags.params_dtype]}, frozen)", device=n * flags.param_bytes,
                        note="no gradient, no optimizer state"))
    if buffers:
        mem.rows.append(Row("router expert-bias buffers (fp32)", device=buffers * 4))
    return mem


@dataclass(frozen=True)
class RoleModelSpec:
    """One role's model on the training ranks."""

    name: str  # "actor", "critic", "teacher", "ref"
    arch: ModelArch
    layout: MegatronLayout
    trainable: bool = True
    head: str = "logprob"
    mtp_layers: int = 0
    mtp_trained: bool = False
    source: str = ""


def role_stage_memory(role: RoleModelSpec, flags: TrainingFlags, stage: int) -> StageMemory:
    lay = role.layout
    role_flags = flags if role.trainable else replace(flags, lora_rank=0)
    chunks = [stage_tensors(role.arch, lay, stage, c, head=role.head, mtp_layers=role.mtp_layers,
                            mtp_trained=role.mtp_trained, flags=role_flags, trainable=role.trainable)
              for c in range(lay.chunks)]
    label = f"stage {stage}" if lay.pp > 1 else "all ranks"
    return (trainable_memory(chunks, lay, flags, label) if role.trainable else frozen_memory(chunks, flags, label))


@dataclass
class ComponentMemory:
    """A role (or the weight tags) with its rows per pipeline stage."""

    name: str
    description: str
    stages: list[StageMemory]
    stage_of_rank: object  # rank -> index into stages

    def for_rank(self, rank: int) -> StageMemory:
        return self.stages[self.stage_of_rank(rank)]  # type: ignore[operator]


@dataclass
class MemoryReport:
    """The static memory per training rank (``estimate_megatron`` / ``estimate_fsdp``) and the GPU it is
    compared with."""

    components: list[ComponentMemory]
    world: int
    gpu_gib: float
    gpu_source: str
    notes: list[str] = field(default_factory=list)
    ranks_per_node: int = 1  # host memory is shared by a node's ranks

    def heaviest_node_host(self) -> tuple[int, float]:
        """``(node, host bytes)`` of the node whose ranks hold the most host memory together."""
        per, host = self.ranks_per_node, {}
        for r in range(self.world):
            key = tuple(c.stage_of_rank(r) for c in self.components)  # type: ignore[operator]
            if key not in host:
                host[key] = self.rank_totals(r)[1]
            node = r // per
            host[node, "node"] = host.get((node, "node"), 0.0) + host[key]
        nodes = [(n, host[n, "node"]) for n in range(-(-self.world // per))]
        return max(nodes, key=lambda x: (x[1], -x[0]))

    def rank_totals(self, rank: int) -> tuple[float, float]:
        """``(device, host)`` bytes of ``rank``: its pipeline stage's rows of every component."""
        stages = [c.for_rank(rank) for c in self.components]
        return sum(s.total("device") for s in stages), sum(s.total("host") for s in stages)

    def heaviest_rank(self) -> tuple[int, float, float]:
        """``(rank, device bytes, host bytes)`` of the rank with the most device memory (ties: the lowest rank);
        ranks of one pipeline-stage combination are equal, so one of each is looked at."""
        seen: dict[tuple, int] = {}
        for r in range(self.world):
            key = tuple(c.stage_of_rank(r) for c in self.components)  # type: ignore[operator]
            seen.setdefault(key, r)
        best = max(seen.values(), key=lambda r: (self.rank_totals(r)[0], -r))
        return (best, *self.rank_totals(best))


def tag_bytes(actor: RoleModelSpec, flags: TrainingFlags, stage: int) -> float:
    """One weight tag's copy on a rank of ``stage``: its actor parameters (unpadded), or the adapters with LoRA."""
    lay = actor.layout
    n = 0
    for c in range(lay.chunks):
        for t in stage_tensors(actor.arch, lay, stage, c, mtp_layers=actor.mtp_layers,
                               mtp_trained=actor.mtp_trained, flags=flags):
            if t.buffer_fp32 or (flags.lora_rank and t.frozen):
                continue
            n += t.elements
    return float(n * flags.param_bytes)


def estimate_megatron(actor: RoleModelSpec, flags: TrainingFlags, *, critic: Optional[RoleModelSpec] = None,
                      frozen_models: tuple[RoleModelSpec, ...] = (), tags: tuple[str, ...] = (),
                      tag_location: str = "host", offload_train: bool = False, gpu_type: Optional[str] = None,
                      gpu_memory: Optional[float] = None) -> MemoryReport:
    """The static memory of every role on the megatron training ranks (module docstring)."""
    gib, source = gpu_memory_gib(gpu_type, gpu_memory)
    comps = []
    for role in (actor, critic, *frozen_models):
        if role is None:
            continue
        lay = role.layout
        stages = [role_stage_memory(role, flags, s) for s in range(lay.pp)]
        kind = ("trains" if role.trainable else "frozen") + (", LoRA adapters" if flags.lora_rank and role.trainable
                                                             else "")
        desc = f"{role.name}: megatron {lay.describe()}, {kind}" + (f", from {role.source}" if role.source else "")
        comps.append(ComponentMemory(role.name, desc, stages, lay.stage_of_rank))
    report = MemoryReport(comps, actor.layout.world, gib, source)
    if tags:
        where = resolve_tag_location(tag_location, offload_train, report, actor, flags)
        copies = len(tags) + 1
        stages = []
        for s in range(actor.layout.pp):
            one = tag_bytes(actor, flags, s)
            what = "the LoRA adapters" if flags.lora_rank else "the actor's parameter shards"
            on_device = where[0] == "device"
            row = Row(f"weight tags {'+'.join(tags)} + the actor's kept copy", device=one * copies if on_device else 0.0,
                      host=0.0 if on_device else one * copies, note=f"{copies} copies of {what} ({where[1]})")
            stages.append(StageMemory(f"stage {s}" if actor.layout.pp > 1 else "all ranks", [row]))
        comps.append(ComponentMemory("tags", f"weight tags ({', '.join(tags)}): copies of the actor's weights, no "
                                     "model of their own", stages, actor.layout.stage_of_rank))
    return report


def resolve_weights_location(requested: str, *, cuda: bool, offload_train: bool, tag_bytes: int,
                             free_bytes: Optional[int]) -> tuple[str, str]:
    """``(location, why)`` of the reference / teacher copies for ``--ref-weights-location``: the one rule of the
    backends (``backends/base.WeightManager.resolved``, with ``free_bytes`` measured once the model and optimizer
    hold their memory) and of this estimate (``resolve_tag_location``). ``why`` goes to the log, with the numbers."""
    gib = (lambda n: f"{n / 2**30:.2f} GiB")
    if not cuda:
        return "host", "a CPU-only run: parameters and copies are all in host memory"
    if requested == "host":
        return "host", "--ref-weights-location host"
    if offload_train:
        # validation refuses an explicit `device` with offloading; auto lands here
        return "host", "--offload-train/--colocate: the trainer's device memory is handed to the rollout engine"
    if requested == "device":
        return "device", "--ref-weights-location device"
    if free_bytes is not None and tag_bytes <= DEVICE_TAG_SHARE * free_bytes:
        return "device", (f"auto: one copy ({gib(tag_bytes)}) is <= {DEVICE_TAG_SHARE:.0%} of the free device "
                          f"memory ({gib(free_bytes)})")
    return "host", (f"auto: one copy ({gib(tag_bytes)}) is more than {DEVICE_TAG_SHARE:.0%} of the free device "
                    f"memory ({gib(free_bytes or 0)})")


def resolve_tag_location(requested: str, offload_train: bool, report: MemoryReport, actor: RoleModelSpec,
                         flags: TrainingFlags) -> tuple[str, str]:
    """``("device" | "host", why)`` of the weight tags by ``resolve_weights_location``, with what static memory leaves
    standing in for the free memory the run measures."""
    _, dev, _ = report.heaviest_rank()
    one = max(tag_bytes(actor, flags, s) for s in range(actor.layout.pp))
    where, why = resolve_weights_location(requested, cuda=True, offload_train=offload_train, tag_bytes=int(one),
                                          free_bytes=int(report.gpu_gib * GIB - dev))
    if requested == "auto" and not offload_train:
        why += " (here: what static memory leaves; the run decides from the free memory it measures)"
    return where, why


def hf_parameter_count(a: ModelArch) -> int:
    """Parameters of the HF model (no vocab padding, tied embeddings once, no MTP layers): what FSDP shards."""
    lay = MegatronLayout(world=1)
    n = sum(t.elements for t in stage_tensors(a, lay, 0, 0) if not t.buffer_fp32)
    return n - (a.padded_vocab(1) - a.vocab) * a.hidden * (1 if a.tied else 2)


def estimate_fsdp(arch: ModelArch, flags: TrainingFlags, world: int, *, critic: Optional[ModelArch] = None,
                  gpu_type: Optional[str] = None, gpu_memory: Optional[float] = None) -> MemoryReport:
    """FSDP2 on a 1-D DP mesh of ``world`` ranks (module docstring); LoRA is not estimated here."""
    gib, source = gpu_memory_gib(gpu_type, gpu_memory)
    comps = []
    for name, a, extra in (("actor", arch, 0), ("critic", critic, 1)):
        if a is None:
            continue
        n = hf_parameter_count(a) - (a.vocab * a.hidden if name == "critic" and not a.tied else 0) + extra * (
            a.hidden + 1)
        shard = n / world
        def at(nbytes: float) -> tuple[float, float]:  # (device, host): --optimizer-cpu-offload moves all three
            return (0.0, nbytes) if flags.cpu_offload else (nbytes, 0.0)

        rows = [Row("parameters (fp32 shards)", *at(shard * 4),
                    note=f"sharded over DP {world}; --bf16 is the compute dtype only"),
                Row("gradients (fp32 shards)", *at(shard * 4),
                    note="from the backward to the optimizer step (freed by zero_grad)"),
                Row(f"optimizer: {'exp_avg + exp_avg_sq' if flags.optimizer == 'adam' else 'momentum'} (fp32)",
                    *at(shard * flags.moment_bytes))]
        desc = f"{name}: fsdp FSDP2 x DP {world}" + (", CPU offload" if flags.cpu_offload else "")
        comps.append(ComponentMemory(name, desc, [StageMemory("all ranks", rows, params=int(shard))], lambda r: 0))
    return MemoryReport(comps, world, gib, source)


def estimate_for_component(plan, comp, arch: ModelArch, flags: TrainingFlags, *, vpp: Optional[int] = None,
                           gpu_type: Optional[str] = None, gpu_memory: Optional[float] = None,
                           layout: Optional[dict] = None) -> MemoryReport:
    """The static memory of an allocation's actor ``comp`` (and a ``critic`` in its ``|`` group, of the same
    architecture), as ``tools/check_plan.py`` prints it. ``plan``: the :class:`~megatron_rl.plan.allocation.Allocation`;
    ``layout``: the actor's TP / PP / EP instead of the component's (``plan/fit.py``'s fixes; same world)."""
    critics = [m for m in plan.colocated_with(comp) if m.role == "critic" and m.is_training]
    if comp.backend == "fsdp":
        return estimate_fsdp(arch, flags, comp.world_size, critic=arch if critics else None, gpu_type=gpu_type,
                             gpu_memory=gpu_memory)

    def layout_of(c, chunks, changes=None):
        lay = MegatronLayout(world=c.world_size, tp=c.tp, pp=c.pp, cp=c.cp, ep=c.ep,
                             etp=c.etp if c.ep > 1 else None, vpp=chunks)
        return replace(lay, **changes) if changes else lay

    actor = RoleModelSpec("actor", arch, layout_of(comp, vpp, layout))
    critic = RoleModelSpec("critic", arch, layout_of(critics[0], None), head="value") if critics else None
    report = estimate_megatron(actor, flags, critic=critic, gpu_type=gpu_type, gpu_memory=gpu_memory)
    problem = arch.lora_problem(flags.lora_targets) if flags.lora_rank else None
    if problem:
        report.notes.append(problem)
    return report


# ---------------------------------------------------------------------------------------------------- rendering


def _gib(n: float) -> str:
    return "-" if not n else f"{n / GIB:.2f} GiB" if n >= 0.005 * GIB else "<0.01 GiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{int(n):,}"


def format_memory(report: MemoryReport, fit: bool = False) -> list[str]:
    """The tables (one per component: a row per kind of memory, a column per pipeline stage) and the per-rank
    verdict, as ``--dry-run`` and ``tools/check_plan.py`` print them. ``fit``: the activations and the verdict follow
    (``plan/fit.format_fit``), so neither the "not estimated" row nor the static-only verdict is printed."""
    lines = ["static memory per training rank (estimate from config.json and the flags: parameters, gradient "
             "buffers, optimizer state)"]
    for comp in report.components:
        lines.append(f"  {comp.description}")
        labels = [s.label + (f" ({_count(s.params)} params)" if s.params else "") for s in comp.stages]
        kinds: list[str] = []
        for s in comp.stages:
            kinds += [r.kind for r in s.rows if r.kind not in kinds]
        header = ["kind"] + labels + ["note"]
        body = []
        for kind in kinds:
            cells: list[str] = []
            notes: list[str] = []
            for s in comp.stages:
                row = next((r for r in s.rows if r.kind == kind), None)
                if row is None:
                    cells.append("-")
                    continue
                text = _gib(row.device) if row.device else "-"
                if row.host:
                    text = (text + " + " if row.device else "") + f"{_gib(row.host)} host"
                cells.append(text)
                if row.note and row.note not in notes:
                    notes.append(row.note)
            body.append([kind] + cells + [" | ".join(notes)])
        if comp.name != "tags" and not fit:  # a model's passes need activations; a tag is a copy, no pass of its own
            body.append(["activations"] + [NOT_ESTIMATED] * len(labels) + [""])
        if any(s.total("device") for s in comp.stages):
            body.append(["total (device)"] + [_gib(s.total("device")) for s in comp.stages] + [""])
        if any(s.total("host") for s in comp.stages):
            body.append(["total (host memory)"] + [_gib(s.total("host")) for s in comp.stages] + [""])
        widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header) - 1)]
        for line in [header] + body:
            padded = [c.ljust(w) for c, w in zip(line, widths)]
            lines.append(("    " + "  ".join(padded) + ("  " + line[-1] if line[-1] else "")).rstrip())
    rank, dev, host = report.heaviest_rank()
    gpu = report.gpu_gib * GIB
    where = "" if report.world == 1 else f" (rank {rank}, the heaviest)"
    lines.append(f"  per rank{where}: {_gib(dev)} device, {_gib(host)} host memory"
                 + ("" if fit else f"; activations {NOT_ESTIMATED}"))
    node, node_host = report.heaviest_node_host() if report.ranks_per_node > 1 and host else (0, 0.0)
    if node_host:
        lines.append(f"  host memory per node ({report.ranks_per_node} ranks; node {node}, the heaviest): "
                     f"{_gib(node_host)}")
    if not fit and dev > gpu:
        lines.append(f"  verdict: static memory alone ({_gib(dev)}) exceeds the GPU's memory ({report.gpu_source}): "
                     "it does not fit")
    elif not fit:
        lines.append(f"  verdict: static memory alone leaves {_gib(gpu - dev)} of the GPU's memory "
                     f"({report.gpu_source}) for activations, KV cache and workspace (not estimated yet: no fit "
                     "verdict beyond this)")
    lines += [f"  note: {n}" for n in report.notes]
    return lines


def report_json(report: MemoryReport) -> dict:
    """The machine view (``check_plan --json``'s ``memory``)."""
    rank, dev, host = report.heaviest_rank()
    return {
        "gpu_gib": report.gpu_gib, "gpu": report.gpu_source, "activations": NOT_ESTIMATED,
        "heaviest_rank": {"rank": rank, "device_bytes": dev, "host_bytes": host,
                          "left_for_activations_bytes": report.gpu_gib * GIB - dev},
        "components": [{"name": c.name, "description": c.description,
                        "stages": [{"label": s.label, "params": s.params,
                                    "rows": [{"kind": r.kind, "device_bytes": r.device, "host_bytes": r.host,
                                              "note": r.note} for r in s.rows]} for s in c.stages]}
                       for c in report.components],
        "notes": list(report.notes),
    }
