"""Device memory of a rollout engine's GPU, and of a colocated GPU in each phase of a step (stdlib only).

SGLang sizes its static memory as ``--sglang-mem-fraction-static`` of the GPU: the weights at the engine's TP/EP
first, the KV-cache pool takes the rest of that fraction (``model_runner``'s profile: total x fraction minus what
is already held). Outside the fraction it needs room for CUDA graphs and the forward's workspace: named here as
:data:`ENGINE_RESERVE_GIB`, an assumption (SGLang captures graphs for its ``--cuda-graph-bs`` list; a few GiB on an
80 GB card). Without the flag SGLang picks a fraction from the GPU's memory and TP; :data:`DEFAULT_MEM_FRACTION`
stands in for it here and the table says so.

KV bytes per token on one engine GPU: full-attention layers x 2 (K and V) x KV heads on this TP rank (SGLang
replicates a KV head over the TP ranks that share it: ``max(groups / TP, 1)``) x head dim x the KV dtype (the
model's: bf16); MLA (deepseek_v3 / kimi_k2) caches one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer on
every TP rank; gated delta-net layers keep a fixed recurrent state instead (not counted).

Colocated (``--colocate``: trainer rank and engine shard on one GPU), per phase (``runner/colocation.py``,
``backends/sleep_tiers.py``'s ``offload`` tier on GPUs):

* **train**: the trainer's static memory and its activation peak; the engine sleeps (``--enable-memory-saver``
  releases its weights and KV cache), its CUDA graphs and context stay (the reserve);
* **sync**: the trainer with its gradient buffers released and optimizer state in host memory (its parameters
  and device weight tags stay), the engine's weights resumed, one ``--update-weight-buffer-size`` bucket;
* **generate**: as sync without the bucket, the KV pool back: SGLang's fraction then covers the trainer's
  residual too (it sizes the pool from what is free), so the pool is what is left of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_rl.plan.memory import GIB, MegatronLayout, ModelArch, Row, stage_tensors

#: SGLang's CUDA graphs, their memory pool and the forward's workspace, outside --sglang-mem-fraction-static
ENGINE_RESERVE_GIB = 4.0
#: the fraction assumed when --sglang-mem-fraction-static is not given (SGLang picks one from the GPU and TP)
DEFAULT_MEM_FRACTION = 0.85


def engine_weight_bytes(a: ModelArch, tp: int, ep: int = 1, dtype_bytes: int = 2) -> float:
    """One engine GPU's weights: attention and dense MLP over TP, routed experts over EP (expert-TP 1 with EP,
    else TP), vocab over TP."""
    lay = MegatronLayout(world=tp, tp=tp, ep=ep, etp=1 if ep > 1 else None)
    return float(sum(t.elements for t in stage_tensors(a, lay, 0, 0) if not t.buffer_fp32) * dtype_bytes)


def kv_bytes_per_token(a: ModelArch, tp: int, dtype_bytes: int = 2) -> float:
    """KV-cache bytes one token takes on one engine GPU (module docstring)."""
    attn_layers = sum(1 for i in range(a.layers) if not a.is_linear_layer(i))
    if a.mla:
        _, kv_rank, _, rope, _ = a.mla
        return float(attn_layers * (kv_rank + rope) * dtype_bytes)
    return attn_layers * 2 * max(a.groups / tp, 1) * a.head_dim * dtype_bytes


@dataclass(frozen=True)
class EngineSpec:
    """The rollout engines of a plan: ``count`` engines of ``tp`` GPUs (EP ``ep`` inside)."""

    arch: ModelArch
    tp: int
    count: int = 1
    ep: int = 1
    mem_fraction: Optional[float] = None  # --sglang-mem-fraction-static
    dtype_bytes: int = 2
    sequence_tokens: int = 0  # prompt + response of one sample (--rollout-max-prompt-len + -response-len)

    @property
    def fraction(self) -> float:
        return DEFAULT_MEM_FRACTION if self.mem_fraction is None else self.mem_fraction


def engine_rows(spec: EngineSpec, gpu_bytes: float, held_by_trainer: float = 0.0) -> tuple[list[Row], float]:
    """``(rows, kv_pool_bytes)`` of one engine GPU; ``held_by_trainer``: a colocated trainer's residual, which
    SGLang's fraction covers too. A pool <= 0 does not fit (SGLang refuses to start)."""
    frac = spec.fraction
    weights = engine_weight_bytes(spec.arch, spec.tp, spec.ep, spec.dtype_bytes)
    pool = frac * gpu_bytes - weights - held_by_trainer
    per_token = kv_bytes_per_token(spec.arch, spec.tp, spec.dtype_bytes)
    where = "" if spec.mem_fraction is not None else f"; {frac:g} assumed: --sglang-mem-fraction-static not given"
    tokens = max(pool, 0) / per_token if per_token else 0
    seqs = f", {tokens / spec.sequence_tokens:,.0f} full-length samples" if spec.sequence_tokens else ""
    rows = [Row(f"engine weights (TP {spec.tp}" + (f", EP {spec.ep}" if spec.ep > 1 else "") + ")", device=weights),
            Row("engine KV-cache pool", device=max(pool, 0.0),
                note=f"fraction {frac:g} of the GPU less the weights{' and the trainer residual' if held_by_trainer else ''}"
                     f" ({per_token / 1024:.1f} KiB per token: {tokens:,.0f} tokens{seqs}){where}"),
            Row("engine CUDA graphs + workspace (reserve)", device=ENGINE_RESERVE_GIB * GIB,
                note="ENGINE_RESERVE_GIB, an assumption, outside the fraction")]
    return rows, pool


@dataclass(frozen=True)
class Phase:
    """One phase of a colocated GPU: its rows and their sum."""

    name: str
    rows: list[Row]

    @property
    def total(self) -> float:
        return sum(r.device for r in self.rows)


def colocated_phases(trainer_static: float, trainer_peak: float, trainer_params: float, spec: EngineSpec,
                     gpu_bytes: float, bucket_bytes: float) -> tuple[list[Phase], float]:
    """``(phases, kv_pool)`` of a GPU that holds a trainer rank and an engine shard (module docstring).
    ``trainer_params``: what the trainer keeps on the device while it sleeps (its parameters, device tags)."""
    reserve = Row("engine CUDA graphs + workspace (reserve)", device=ENGINE_RESERVE_GIB * GIB)
    weights = engine_weight_bytes(spec.arch, spec.tp, spec.ep, spec.dtype_bytes)
    rows, pool = engine_rows(spec, gpu_bytes, held_by_trainer=trainer_params)
    train = Phase("train", [Row("trainer: static memory", device=trainer_static),
                            Row("trainer: activation + logits peak", device=trainer_peak), reserve])
    sleeping = Row("trainer asleep: parameters (+ device tags)", device=trainer_params,
                   note="offload tier: gradient buffers released, optimizer state in host memory")
    sync = Phase("sync", [sleeping, Row("engine weights", device=weights),
                          Row("weight-update bucket", device=bucket_bytes), reserve])
    generate = Phase("generate", [sleeping] + rows)
    return [train, sync, generate], pool
