"""How long a weight sync takes, and what share of an RL step it is: an estimate from config.json and the flags.

A sync here is what ``weight_sync/`` does, stage by stage, one after another (the export is a generator the
transport pulls bucket by bucket, so the stages do not overlap):

1. **TP gather** (every training rank, ``models/weights.export_hf_weights``): each tensor-parallel shard is
   all-gathered into the full HF tensor: a rank receives ``(tp - 1) / tp`` of the dense bytes, over the link
   that joins its TP group (NVLink when the group sits in one node).
2. **expert-TP / EP gather**: the routed experts likewise over expert-TP, then over the expert-parallel group
   (NVLink when ``ep x expert-TP`` ranks fit in a node, else the inter-node link).
3. **PP broadcast** (``pp > 1``, transports that export the whole model on every rank: ``tensor`` and ``disk``):
   each stage's buckets are broadcast to the other stages, so every rank ends with every tensor: the whole
   payload crosses the PP group's link (between nodes unless the whole world is one node). The ``distributed``
   transport exports stage by stage (``stage_only``): each stage sends its own tensors, no broadcast.
4. **the transport**: ``tensor`` (CUDA IPC / the in-process hand-over: no bytes cross a link; a flatten copy
   on the trainer and the engine's load copy, at HBM speed), ``disk`` (the driver writes HF safetensors, every
   engine reads them back, in parallel), ``distributed`` (the bucket is broadcast from the sending rank into
   every server's TP ranks over NCCL, flatten and load copies on each side); plus a fixed latency per bucket
   (an HTTP call and its collectives) and two more per sync (begin / end of the update).

The payload is a table (:data:`SYNC_PAYLOADS`): ``merged`` (the full HF weights in the trainer's parameter
dtype: what ``export_weights`` yields; a LoRA run merges the adapters in first) and ``adapter``
(``--lora-sync adapter``: the PEFT adapters only; the first sync also carries the base model). A delta mode
(sending only what changed) is not built: it would register a payload here, with its own bytes.

Links come from a named table (:data:`LINKS`, nominal one-direction bandwidth per GPU) that flags override;
every link is taken at :data:`ACHIEVED_FRACTION` of its nominal figure. The step time is rougher still:
FLOPs over the GPUs' peak at an assumed MFU (``--estimate-train-mfu``, ``--estimate-decode-mfu``). Every
assumption is printed beside the figures. Standard library only (``--dry-run`` and ``tools/check_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_rl.errors import PlanError
from megatron_rl.plan.memory import DEFAULT_GPU_TYPE, DTYPE_SHORT, MegatronLayout, ModelArch, TrainingFlags
from megatron_rl.plan.memory import _layer_tensors as layer_tensors  # the per-layer shapes the memory estimate uses
from megatron_rl.plan.memory import _lora_adapters as lora_adapters

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One kind of link: its nominal bandwidth per GPU in GB/s, one direction (``write``: a disk's write
    bandwidth, when it differs from the read)."""

    name: str
    description: str
    gb_per_s: float
    kind: str  # "intra-node" | "inter-node" | "disk"
    write_gb_per_s: Optional[float] = None


#: nominal figures from the vendors' data sheets, one direction, per GPU (a node's NIC rail per GPU)
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("nvlink3", "NVLink 3 (A100): 600 GB/s both directions", 300.0, "intra-node"),
    Link("nvlink4", "NVLink 4 (H100/H200): 900 GB/s both directions", 450.0, "intra-node"),
    Link("nvlink5", "NVLink 5 (B200): 1.8 TB/s both directions", 900.0, "intra-node"),
    Link("pcie4", "PCIe gen4 x16", 32.0, "intra-node"),
    Link("pcie5", "PCIe gen5 x16", 64.0, "intra-node"),
    Link("ib-hdr", "InfiniBand HDR, 200 Gb/s per GPU", 25.0, "inter-node"),
    Link("ib-ndr", "InfiniBand NDR, 400 Gb/s per GPU", 50.0, "inter-node"),
    Link("ib-xdr", "InfiniBand XDR, 800 Gb/s per GPU", 100.0, "inter-node"),
    Link("eth-100g", "Ethernet / RoCE 100 Gb/s per GPU", 12.5, "inter-node"),
    Link("nvme-gen4", "local NVMe SSD, PCIe gen4 (7 GB/s read, 5 GB/s write)", 7.0, "disk", 5.0),
    Link("nvme-gen5", "local NVMe SSD, PCIe gen5 (14 GB/s read, 10 GB/s write)", 14.0, "disk", 10.0),
)}
INTRA_NODE_LINKS = tuple(n for n, link in LINKS.items() if link.kind == "intra-node")
INTER_NODE_LINKS = tuple(n for n, link in LINKS.items() if link.kind == "inter-node")
DISK_LINKS = tuple(n for n, link in LINKS.items() if link.kind == "disk")
DEFAULT_INTER_NODE_LINK = "ib-ndr"
DEFAULT_DISK_LINK = "nvme-gen4"
ACHIEVED_FRACTION = 0.8  # of a link's nominal bandwidth a large NCCL collective / sequential I/O reaches
DEFAULT_BUCKET_LATENCY_MS = 10.0
DEFAULT_TRAIN_MFU = 0.3
DEFAULT_DECODE_MFU = 0.1


@dataclass(frozen=True)
class GpuSpec:
    """Dense bf16 peak (TFLOP/s, no sparsity), HBM bandwidth (TB/s) and the NVLink of a ``--gpu-type``."""

    peak_tflops: float
    hbm_tb_per_s: float
    nvlink: str


GPU_SPECS = {"A100-80G": GpuSpec(312.0, 2.04, "nvlink3"), "H100-80G": GpuSpec(989.0, 3.35, "nvlink4"),
             "H200-141G": GpuSpec(989.0, 4.8, "nvlink4"), "B200-192G": GpuSpec(2250.0, 8.0, "nvlink5")}


@dataclass(frozen=True)
class Links:
    """The links an estimate uses, each ``(name or override text, GB/s as achieved)``, and the GPU's figures."""

    gpu_type: str
    intra: tuple[str, float]
    inter: tuple[str, float]
    disk_read: tuple[str, float]
    disk_write: tuple[str, float]
    hbm_gb_per_s: float
    peak_flops: float

    @classmethod
    def resolve(cls, gpu_type: Optional[str] = None, *, intra_node_link: Optional[str] = None,
                inter_node_link: Optional[str] = None, disk_link: Optional[str] = None,
                intra_node_gb_per_s: Optional[float] = None, inter_node_gb_per_s: Optional[float] = None,
                disk_gb_per_s: Optional[float] = None) -> "Links":
        """From the flags: a named link (``--intra-node-link``, default the GPU's NVLink; ``--inter-node-link``;
        ``--disk-link``) or a bandwidth that overrides it (``--*-bandwidth-gb-per-s``, taken as achieved)."""
        gpu = gpu_type or DEFAULT_GPU_TYPE
        if gpu not in GPU_SPECS:
            raise PlanError(f"--gpu-type {gpu!r} is not one of {', '.join(GPU_SPECS)}")
        spec = GPU_SPECS[gpu]

        def pick(flag: str, name: Optional[str], default: str, kinds: tuple[str, ...], override: Optional[float],
                 override_flag: str, write: bool = False) -> tuple[str, float]:
            if override is not None:
                if not (isinstance(override, (int, float)) and math.isfinite(override) and override > 0):
                    raise PlanError(f"{override_flag} {override} must be a positive number of GB/s")
                return f"{override_flag} {override:g}", float(override)
            name = name or default
            if name not in kinds:
                raise PlanError(f"{flag} {name!r} is not one of {', '.join(kinds)}; or give the bandwidth with "
                                f"{override_flag}")
            link = LINKS[name]
            nominal = link.write_gb_per_s if write and link.write_gb_per_s else link.gb_per_s
            return name, nominal * ACHIEVED_FRACTION

        return cls(gpu, pick("--intra-node-link", intra_node_link, spec.nvlink, INTRA_NODE_LINKS, intra_node_gb_per_s,
                             "--intra-node-bandwidth-gb-per-s"),
                   pick("--inter-node-link", inter_node_link, DEFAULT_INTER_NODE_LINK, INTER_NODE_LINKS,
                        inter_node_gb_per_s, "--inter-node-bandwidth-gb-per-s"),
                   pick("--disk-link", disk_link, DEFAULT_DISK_LINK, DISK_LINKS, disk_gb_per_s,
                        "--disk-bandwidth-gb-per-s"),
                   pick("--disk-link", disk_link, DEFAULT_DISK_LINK, DISK_LINKS, disk_gb_per_s,
                        "--disk-bandwidth-gb-per-s", write=True),
                   spec.hbm_tb_per_s * 1000 * ACHIEVED_FRACTION, spec.peak_tflops * 1e12)

    def describe(self) -> str:
        return (f"intra-node {self.intra[0]} {self.intra[1]:g} GB/s, inter-node {self.inter[0]} {self.inter[1]:g} "
                f"GB/s, disk {self.disk_read[0]} {self.disk_read[1]:g} GB/s read / {self.disk_write[1]:g} write, HBM "
                f"{self.hbm_gb_per_s:g} GB/s ({self.gpu_type}); named links at {ACHIEVED_FRACTION:.0%} of nominal")


# ------------------------------------------------------------------------------------------------ the payload


@dataclass(frozen=True)
class Payload:
    """What one sync moves: bytes per pipeline stage, dense and routed-expert, and what they are."""

    what: str
    dense: tuple[float, ...]  # bytes per stage
    expert: tuple[float, ...]
    gathered: bool = True  # the TP / EP / PP gathers of stages 1-3 apply (the adapters' are negligible)
    note: str = ""

    @property
    def total(self) -> float:
        return sum(self.dense) + sum(self.expert)


def _stage_layers(a: ModelArch, lay: MegatronLayout, stage: int) -> list[int]:
    return [i for c in range(lay.chunks) for i in lay.chunk_layers(a.layers, stage, c)]


def merged_payload(a: ModelArch, lay: MegatronLayout, flags: TrainingFlags) -> Payload:
    """The full HF weights (no vocab padding, tied embeddings once, no MTP layers: ``include_mtp=False``), in the
    trainer's parameter dtype (a sigmoid router's expert-bias buffers in fp32); per stage as megatron holds them."""
    pb = flags.param_bytes
    dense, expert = [], []
    for s in range(lay.pp):
        d = e = 0
        fp32 = 0  # the sigmoid router's expert-bias buffers: exported too (the engine's e_score_correction_bias)
        for i in _stage_layers(a, lay, s):
            for t in layer_tensors(a, i, 1, 1, 1):
                if t.buffer_fp32:
                    fp32 += t.elements
                elif t.expert:
                    e += t.elements
                else:
                    d += t.elements
        if s == 0:
            d += a.vocab * a.hidden
        if s == lay.pp - 1:
            d += a.hidden + (0 if a.tied else a.vocab * a.hidden)
        dense.append(d * pb + fp32 * 4)
        expert.append(e * pb)
    what = f"merged full weights ({DTYPE_SHORT[flags.params_dtype]}, the trainer's parameter dtype)"
    return Payload(what, tuple(dense), tuple(expert),
                   note="with LoRA the adapters are merged in first" if flags.lora_rank else "")


def adapter_payload(a: ModelArch, lay: MegatronLayout, flags: TrainingFlags) -> Payload:
    """``--lora-sync adapter``: the adapters of every targeted linear, whole (gathered over TP and PP)."""
    if not flags.lora_rank:
        raise PlanError("--lora-sync adapter needs --lora-rank > 0")
    n = []
    for s in range(lay.pp):
        n.append(sum(t.elements for i in _stage_layers(a, lay, s)
                     for t in lora_adapters(a, layer_tensors(a, i, 1, 1, 1), 1, flags)) * flags.param_bytes)
    return Payload(f"LoRA adapters only (rank {flags.lora_rank}, {DTYPE_SHORT[flags.params_dtype]})", tuple(n),
                   (0.0,) * lay.pp, gathered=False,
                   note="the first sync (and any after the engine lost its weights) also carries the base model")


#: ``--lora-sync`` (``merged`` also for a run without LoRA) -> what a sync sends. A delta payload (only the
#: changed weights) would be one more row, with the bytes it moves.
SYNC_PAYLOADS: dict[str, Callable[[ModelArch, MegatronLayout, TrainingFlags], Payload]] = {
    "merged": merged_payload, "adapter": adapter_payload}


# ------------------------------------------------------------------------------------------------ the sync


@dataclass(frozen=True)
class SyncPlan:
    """The placement facts a sync's cost depends on."""

    transport: str  # "tensor" | "disk" | "distributed"
    engines: int
    engine_gpus: int
    colocated: bool  # the engines share the trainer's devices (tensor)
    engines_remote: bool  # the engines run on other nodes than the sending rank
    gpus_per_node: int
    bucket_bytes: int
    embedded: bool = False  # the in-process engine (tensor: a hand-over, no IPC, no HTTP)
    payload: str = "merged"
    fsdp: bool = False  # --train-backend fsdp: every tensor is all-gathered over the DP world (layout: tp = world)


@dataclass(frozen=True)
class SyncStage:
    name: str
    seconds: float
    how: str


@dataclass
class SyncEstimate:
    payload: Payload
    buckets: int
    stages: list[SyncStage]
    assumptions: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


def size(nbytes: float) -> str:
    """Bytes in decimal units (GB as the link bandwidths are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _transfer(nbytes: float, gb_per_s: float) -> float:
    return nbytes / (gb_per_s * GB)


def estimate_sync(a: ModelArch, lay: MegatronLayout, flags: TrainingFlags, plan: SyncPlan, links: Links, *,
                  bucket_latency_ms: float = DEFAULT_BUCKET_LATENCY_MS) -> SyncEstimate:
    """Seconds per sync of ``plan`` (module docstring: the stages in order)."""
    if plan.payload not in SYNC_PAYLOADS:
        raise PlanError(f"--lora-sync {plan.payload!r} is not one of {', '.join(SYNC_PAYLOADS)}")
    if plan.transport not in ("tensor", "disk", "distributed"):
        raise PlanError(f"--update-weight-transport {plan.transport!r} is not one of tensor, disk, distributed")
    if not bucket_latency_ms > 0 or not math.isfinite(bucket_latency_ms):
        raise PlanError(f"--sync-bucket-latency-ms {bucket_latency_ms} must be a positive number")
    if plan.bucket_bytes < 1:
        raise PlanError(f"--update-weight-buffer-size {plan.bucket_bytes} must be a positive number of bytes")
    pay = SYNC_PAYLOADS[plan.payload](a, lay, flags)
    gpn = max(1, plan.gpus_per_node)
    dense, expert, total = sum(pay.dense), sum(pay.expert), pay.total

    def link(span: int) -> tuple[str, float]:  # the link of a group of `span` consecutive ranks
        return (links.intra if span <= gpn else links.inter)

    def via(name_bw: tuple[str, float]) -> str:
        return f"{name_bw[0]} at {name_bw[1]:g} GB/s"

    stages: list[SyncStage] = []
    stage_only = plan.transport == "distributed" and lay.pp > 1
    if pay.gathered and plan.fsdp:
        if lay.world > 1:
            lk = link(lay.world)
            share = (lay.world - 1) / lay.world
            stages.append(SyncStage(f"FSDP all-gather over DP {lay.world}", _transfer(total * share, lk[1]),
                                    f"{size(total * share)} received per rank, {via(lk)}"))
    elif pay.gathered:
        if lay.tp > 1:
            lk = link(lay.tp)
            share = (lay.tp - 1) / lay.tp
            stages.append(SyncStage(f"TP {lay.tp} gather", _transfer(dense * share, lk[1]),
                                    f"{size(dense * share)} received per rank ({lay.tp - 1}/{lay.tp} of the "
                                    f"dense {size(dense)}), {via(lk)}"))
        if expert and lay.expert_tp > 1:
            lk = link(lay.expert_tp)
            share = (lay.expert_tp - 1) / lay.expert_tp
            stages.append(SyncStage(f"expert-TP {lay.expert_tp} gather", _transfer(expert * share, lk[1]),
                                    f"{size(expert * share)} per rank, {via(lk)}"))
        if expert and lay.ep > 1:
            lk = link(lay.ep * lay.expert_tp)
            share = (lay.ep - 1) / lay.ep
            stages.append(SyncStage(f"EP {lay.ep} gather", _transfer(expert * share, lk[1]),
                                    f"{size(expert * share)} received per rank ({lay.ep - 1}/{lay.ep} of the "
                                    f"experts' {size(expert)}), {via(lk)}"))
        if lay.pp > 1 and not stage_only:
            lk = links.intra if lay.world <= gpn else links.inter
            stages.append(SyncStage(f"PP {lay.pp} broadcast", _transfer(total, lk[1]),
                                    f"every stage's {size(total)} to every rank, {via(lk)}"))
    # the transport
    buckets = 1 if not pay.gathered else sum(
        math.ceil(b / plan.bucket_bytes) for b in (*pay.dense, *pay.expert) if b)
    copies = _transfer(4 * total, links.hbm_gb_per_s)  # two device copies, each a read and a write
    if plan.transport == "tensor":
        if plan.embedded:
            stages.append(SyncStage("hand-over to the in-process engine", _transfer(2 * total, links.hbm_gb_per_s),
                                    f"one device copy of {size(total)} at HBM {links.hbm_gb_per_s:g} GB/s"))
        else:
            stages.append(SyncStage("CUDA IPC buckets (flatten + engine load)", copies,
                                    f"two device copies of {size(total)} at HBM {links.hbm_gb_per_s:g} GB/s; "
                                    "no bytes cross a link"))
    elif plan.transport == "disk":
        stages.append(SyncStage("disk write (driver)", _transfer(total, links.disk_write[1]),
                                f"{size(total)} of safetensors at {links.disk_write[0]} "
                                f"{links.disk_write[1]:g} GB/s"))
        stages.append(SyncStage("disk read (engines, in parallel)", _transfer(total, links.disk_read[1]),
                                f"{size(total)} per engine at {links.disk_read[0]} {links.disk_read[1]:g} GB/s"))
        buckets = 1  # one load call per sync
    else:
        lk = links.inter if plan.engines_remote else links.intra
        senders = f"each stage's sender in turn ({lay.pp} stages)" if stage_only else "the driver rank"
        stages.append(SyncStage(f"NCCL broadcast into {plan.engines} engine(s) x TP {plan.engine_gpus}",
                                _transfer(total, lk[1]),
                                f"{size(total)} from {senders}, {via(lk)} (a pipelined broadcast: every "
                                "receiver at the link's rate)"))
        stages.append(SyncStage("flatten + engine load copies", copies,
                                f"two device copies at HBM {links.hbm_gb_per_s:g} GB/s"))
    calls = buckets + 2
    if not plan.embedded:
        stages.append(SyncStage(f"{calls} calls ({buckets} bucket(s) + begin/end)", calls * bucket_latency_ms / 1000,
                                f"{bucket_latency_ms:g} ms each (--sync-bucket-latency-ms)"))
    assumptions = [f"links: {links.describe()}",
                   "stages run one after another (the export is pulled bucket by bucket)"]
    if pay.note:
        assumptions.append(pay.note)
    return SyncEstimate(pay, buckets, stages, assumptions)


# ------------------------------------------------------------------------------------------------ the step


def active_matmul_params(a: ModelArch, topk: int) -> float:
    """Parameters one token's forward multiplies by: every layer's dense weights, ``topk`` of the routed experts
    (MoE), the output layer; not the input embedding (a lookup)."""
    n = 0.0
    for i in range(a.layers):
        for t in layer_tensors(a, i, 1, 1, 1):
            if t.buffer_fp32:
                continue
            n += t.elements * (min(topk, a.experts) / a.experts if t.expert and a.experts else 1.0)
    return n + a.vocab * a.hidden + a.hidden


def attention_flops_per_token(a: ModelArch, context: float) -> float:
    """Forward FLOPs of the attention core (scores and the weighted sum) for one query over ``context`` keys,
    every full-attention layer (gated delta-net layers: none quadratic; sliding windows not modelled)."""
    if a.mla:
        _, _, nope, rope, v = a.mla
        qk, vd = nope + rope, v
    else:
        qk = vd = a.head_dim
    full = sum(1 for i in range(a.layers) if not a.is_linear_layer(i))
    return full * 2 * a.heads * (qk + vd) * context


@dataclass(frozen=True)
class StepPlan:
    """The rollout / training facts of one RL step."""

    prompts: int
    samples_per_prompt: int
    prompt_len: int
    response_len: int
    train_gpus: int
    engine_gpus: int  # colocated: the trainer's
    passes: float = 3.0  # forward-equivalents over the batch: training 3 (fwd + bwd), +1 per recompute / forward-only
    passes_note: str = "forward + backward 3"
    asynchronous: bool = False


@dataclass
class StepEstimate:
    tokens: int
    train_flops: float
    rollout_flops: float
    rollout_s: float
    train_s: float
    sync_s: float
    assumptions: list[str]

    @property
    def seconds(self) -> float:
        return self.rollout_s + self.train_s + self.sync_s

    @property
    def sync_share(self) -> float:
        return self.sync_s / self.seconds if self.seconds else 0.0


def estimate_step(a: ModelArch, topk: int, step: StepPlan, links: Links, sync_s: float, *,
                  train_mfu: float = DEFAULT_TRAIN_MFU, decode_mfu: float = DEFAULT_DECODE_MFU) -> StepEstimate:
    """Rollout (prefill + decode on the engines' GPUs), training (``passes`` forwards over every token) and the
    sync, one after another (a synchronous step)."""
    for flag, value in (("--estimate-train-mfu", train_mfu), ("--estimate-decode-mfu", decode_mfu)):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise PlanError(f"{flag} {value} must lie in (0, 1]")
    n = active_matmul_params(a, topk)
    p, r = step.prompt_len, step.response_len
    samples = step.prompts * step.samples_per_prompt
    tokens = samples * (p + r)
    # training: a packed sample of p + r tokens, causal: a token attends to (p + r) / 2 keys on average
    train = step.passes * tokens * (2 * n + attention_flops_per_token(a, (p + r) / 2))
    prefill = step.prompts * p * (2 * n + attention_flops_per_token(a, p / 2))
    decode = samples * r * (2 * n + attention_flops_per_token(a, p + r / 2))
    peak = links.peak_flops
    rollout_s = prefill / (step.engine_gpus * peak * train_mfu) + decode / (step.engine_gpus * peak * decode_mfu)
    train_s = train / (step.train_gpus * peak * train_mfu)
    notes = [f"{step.prompts} prompts x {step.samples_per_prompt} samples x ({p} prompt + {r} response tokens) = "
             f"{tokens:,} tokens per step, at the maximum lengths (an upper bound)",
             f"{n / 1e9:.3g} B parameters multiplied per token ({'top-' + str(topk) + ' routed experts, ' if a.experts else ''}"
             "the output layer; not the input embedding): 2N FLOPs per token forward, plus the causal attention core",
             f"training: {step.passes:g} forward-equivalents per token ({step.passes_note}) on {step.train_gpus} GPU(s) at MFU "
             f"{train_mfu:g} (--estimate-train-mfu) of {peak / 1e12:g} TFLOP/s ({links.gpu_type}, dense bf16)",
             f"rollout on {step.engine_gpus} engine GPU(s): the prompt prefilled once per group (the radix cache) at "
             f"MFU {train_mfu:g}, decode at MFU {decode_mfu:g} (--estimate-decode-mfu)",
             "a synchronous step: generate, train, sync in turn" if not step.asynchronous else
             "--async-mode overlaps generation with training: the step is nearer max(rollout, train) + sync"]
    return StepEstimate(tokens, train, prefill + decode, rollout_s, train_s, sync_s, notes)


def moe_topk(hf: dict) -> int:
    """Routed experts per token from a ``config.json`` (``num_experts_per_tok``; gpt-oss ``experts_per_token``);
    0 for a dense model."""
    c = hf["text_config"] if "num_attention_heads" not in hf and isinstance(hf.get("text_config"), dict) else hf
    return int(c.get("num_experts_per_tok") or c.get("experts_per_token") or c.get("moe_topk") or 0)


# ------------------------------------------------------------------------------------------------ rendering


def _secs(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


def format_estimate(sync: SyncEstimate, step: Optional[StepEstimate], transport: str) -> list[str]:
    """The section ``--dry-run`` and ``tools/check_plan.py`` print: the sync's stages, the step's split, and every
    assumption on a line of its own."""
    pay = sync.payload
    lines = [f"weight sync estimate (--update-weight-transport {transport}): {size(pay.total)} per sync, "
             f"{pay.what}; {sync.buckets} bucket(s); about {_secs(sync.seconds)}"]
    width = max(len(s.name) for s in sync.stages) if sync.stages else 0
    for s in sync.stages:
        lines.append(f"    {s.name.ljust(width)}  {_secs(s.seconds):>8}  {s.how}")
    if step is not None:
        lines.append(f"  step estimate: rollout {_secs(step.rollout_s)}, training {_secs(step.train_s)}, sync "
                     f"{_secs(step.sync_s)}: about {_secs(step.seconds)} per step, the sync {step.sync_share:.1%} of it")
    lines += [f"  assumption: {n}" for n in sync.assumptions + (step.assumptions if step else [])]
    return lines


def estimate_json(sync: SyncEstimate, step: Optional[StepEstimate]) -> dict:
    """The machine view (``check_plan --json``'s ``sync``)."""
    out: dict = {"bytes": sync.payload.total, "payload": sync.payload.what, "buckets": sync.buckets,
                 "seconds": sync.seconds, "stages": [{"name": s.name, "seconds": s.seconds, "how": s.how}
                                                     for s in sync.stages],
                 "assumptions": list(sync.assumptions)}
    if step is not None:
        out["step"] = {"tokens": step.tokens, "train_flops": step.train_flops, "rollout_flops": step.rollout_flops,
                       "rollout_s": step.rollout_s, "train_s": step.train_s, "sync_s": step.sync_s,
                       "seconds": step.seconds, "sync_share": step.sync_share, "assumptions": list(step.assumptions)}
    return out
