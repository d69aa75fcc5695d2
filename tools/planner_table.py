#!/usr/bin/env python
"""The planner's table in docs/planner.md: static memory per rank, the peak with the activations and the fit
verdict (the engines' GPUs too), weight-sync bytes and seconds, and the step's split, for the shipped GPU scripts' models and three bigger ones, on H100 and H200 plans.

    python tools/planner_table.py                 # print the table (markdown)
    python tools/planner_table.py --update-doc    # rewrite it in docs/planner.md between its markers

Every figure comes from ``plan/memory.py`` and ``plan/sync_estimate.py`` with their default assumptions (the links
of the GPU's node, IB NDR between nodes, the default per-bucket latency and MFUs); the models' shapes are their
published ``config.json`` values, written out below. Standard library only; never imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.plan.activations import ActivationFlags  # noqa: E402
from megatron_rl.plan.engine_memory import EngineSpec  # noqa: E402
from megatron_rl.plan.fit import FitReport, Knobs, attach_activations  # noqa: E402
from megatron_rl.plan.memory import (GIB, GPU_MEMORY_GIB, MegatronLayout, ModelArch, RoleModelSpec,  # noqa: E402
                                     TrainingFlags, estimate_megatron)
from megatron_rl.plan.sync_estimate import (GB, Links, StepPlan, SyncPlan, estimate_step,  # noqa: E402
                                            estimate_sync, moe_topk)

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "planner.md")
BEGIN, END = "<!-- planner_table: begin -->", "<!-- planner_table: end -->"

# -- published config.json values (the fields that size each model) ---------------------------------------------
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": True}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64}
_MLA = {"intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False}
DEEPSEEK_V3 = {**_MLA, "model_type": "deepseek_v3", "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_routed_experts": 256, "first_k_dense_replace": 3, "vocab_size": 129280, "num_nextn_predict_layers": 1}
KIMI_K2 = {**_MLA, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
           "n_routed_experts": 384, "first_k_dense_replace": 1, "vocab_size": 163840}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: a model on a plan (the trainer's layout and flags, the engines it feeds, one step's rollout)."""

    model: str
    hf: dict
    gpu: str
    layout: MegatronLayout
    flags: TrainingFlags
    transport: str
    engines: int
    engine_gpus: int
    colocated: bool
    bucket_bytes: int
    rollout: tuple[int, int, int, int]  # prompts, samples per prompt, prompt and response lengths
    passes: float = 3.0
    tags: tuple[str, ...] = ()
    source: str = ""
    peer: str = "-"  # a peer's published sync time at this model's scale (docs/planner.md names the sources)
    tokens: int = 16384  # packed tokens per micro-batch per GPU (--max-tokens-per-gpu), sequence-parallel, full recompute


BF16_DO = TrainingFlags(params_dtype="bfloat16", distributed_optimizer=True)
GIB_BUCKET = 2 ** 30


def _cases() -> list[Case]:
    out = []
    for gpu in ("H100-80G", "H200-141G"):
        # scripts/run_qwen3_4b_grpo.sh: TP 2 x DP 4 colocated with 4 SGLang engines of 2 GPUs, a KL reference
        out.append(Case("Qwen3-4B", QWEN3_4B, gpu, MegatronLayout(world=8, tp=2),
                        dataclasses.replace(BF16_DO, cpu_offload=True, precision_aware=True), "tensor", 4, 2, True,
                        512 * 2 ** 20, (64, 8, 1024, 8192), passes=5, tags=("ref",), tokens=32768,
                        source="scripts/run_qwen3_4b_grpo.sh"))
        # scripts/run_qwen3_30b_a3b_grpo.sh: TP 4 x PP 2 x EP 8 on 32 GPUs, two 8-GPU servers on their own nodes
        out.append(Case("Qwen3-30B-A3B", QWEN3_30B_A3B, gpu, MegatronLayout(world=32, tp=4, pp=2, ep=8, etp=1),
                        BF16_DO, "distributed", 2, 8, False, GIB_BUCKET, (128, 8, 1024, 16384), passes=4,
                        source="scripts/run_qwen3_30b_a3b_grpo.sh"))
    big = (("Qwen3-235B-A22B", QWEN3_235B_A22B,
            {"H100-80G": (MegatronLayout(world=128, tp=4, pp=2, ep=32, etp=1), 16, 8),
             "H200-141G": (MegatronLayout(world=64, tp=4, pp=2, ep=16, etp=1), 8, 8)}),
           ("DeepSeek-V3 671B", DEEPSEEK_V3,
            {"H100-80G": (MegatronLayout(world=512, tp=8, pp=4, ep=64, etp=1, last_stage_layers=16), 32, 16),
             "H200-141G": (MegatronLayout(world=256, tp=8, pp=4, ep=32, etp=1, last_stage_layers=16), 16, 16)}),
           ("Kimi-K2 1T", KIMI_K2,
            {"H100-80G": (MegatronLayout(world=512, tp=8, pp=4, ep=64, etp=1, last_stage_layers=16), 16, 32),
             "H200-141G": (MegatronLayout(world=256, tp=8, pp=4, ep=32, etp=1, last_stage_layers=16), 16, 16)}))
    peers = {"Qwen3-235B-A22B": "NeMo-RL ~4.6 s", "Kimi-K2 1T": "miles ~7.2 s (1T)"}
    for name, hf, plans in big:
        for gpu, (lay, engines, size) in plans.items():
            out.append(Case(name, hf, gpu, lay, BF16_DO, "distributed", engines, size, False, GIB_BUCKET,
                            (128, 8, 1024, 8192), passes=4, peer=peers.get(name, "-")))
    models = [c.model for c in out]
    return sorted(out, key=lambda c: (models.index(c.model), c.gpu))


def _plan_text(lay: MegatronLayout) -> str:
    parts = [f"TP{lay.tp}"] + ([f"PP{lay.pp}"] if lay.pp > 1 else []) + ([f"EP{lay.ep}"] if lay.ep > 1 else [])
    return " ".join(parts) + f" DP{lay.dp}"


def row(case: Case) -> dict:
    """The figures of one case."""
    arch = ModelArch.from_hf_config(case.hf)
    report = estimate_megatron(RoleModelSpec("actor", arch, case.layout), case.flags, tags=case.tags,
                               tag_location="auto", offload_train=case.colocated, gpu_type=case.gpu)
    rank, dev, host = report.heaviest_rank()
    lay = case.layout
    fit = FitReport(report, Knobs(tp=lay.tp, pp=lay.pp, ep=lay.ep, tokens=case.tokens), colocated=case.colocated,
                    bucket_bytes=float(case.bucket_bytes))
    attach_activations(fit, RoleModelSpec("actor", arch, lay), ActivationFlags(
        tokens=case.tokens * lay.cp, sequence_parallel=lay.tp > 1, recompute_granularity="full"))
    fit.engine = EngineSpec(arch, tp=case.engine_gpus, count=case.engines,
                            ep=case.engine_gpus if arch.experts else 1, mem_fraction=0.7)
    short = fit.shortfalls()
    links = Links.resolve(case.gpu)
    sync = estimate_sync(arch, case.layout, case.flags,
                         SyncPlan(case.transport, case.engines, case.engine_gpus, case.colocated,
                                  engines_remote=not case.colocated, gpus_per_node=8, bucket_bytes=case.bucket_bytes),
                         links)
    prompts, n, p, r = case.rollout
    engine_gpus = case.layout.world if case.colocated else case.engines * case.engine_gpus
    step = estimate_step(arch, moe_topk(case.hf), StepPlan(prompts, n, p, r, case.layout.world, engine_gpus,
                                                           case.passes), links, sync.seconds)
    return {"model": case.model, "gpu": case.gpu, "gpus": case.layout.world + (0 if case.colocated else engine_gpus),
            "plan": _plan_text(case.layout), "engines": f"{case.engines} x {case.engine_gpus}"
            + (" colocated" if case.colocated else ""), "device_gib": dev / GIB, "host_gib": host / GIB,
            "left_gib": GPU_MEMORY_GIB[case.gpu] - dev / GIB, "peak_gib": fit.heaviest()[3] / GIB,
            "verdict": (f"fits, {fit.headroom() / GIB:.1f} GiB free" if not short else
                        "short: " + ", ".join(sorted({s.component for s in short}))), "transport": case.transport,
            "sync_gb": sync.payload.total / GB, "sync_s": sync.seconds, "step_s": step.seconds,
            "share": step.sync_share, "source": case.source, "peer": case.peer}


def table(rows: Optional[list[dict]] = None) -> str:
    rows = rows if rows is not None else [row(c) for c in _cases()]
    head = ("| model | GPU | GPUs (train + rollout) | trainer plan | engines | static per rank (device) | host | left "
            "of the GPU | peak per rank | verdict | sync payload | transport | sync (est.) | peers' sync (published) | "
            "step (est.) | sync share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        host = f"{r['host_gib']:.1f} GiB" if r["host_gib"] else "-"
        lines.append(f"| {r['model']} | {r['gpu']} | {r['gpus']} | {r['plan']} | {r['engines']} | "
                     f"{r['device_gib']:.1f} GiB | {host} | {r['left_gib']:.1f} GiB | {r['peak_gib']:.1f} GiB | "
                     f"{r['verdict']} | {r['sync_gb']:.1f} GB | "
                     f"{r['transport']} | {r['sync_s']:.1f} s | {r['peer']} | {r['step_s'] / 60:.1f} min | "
                     f"{r['share']:.1%} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--update-doc", action="store_true", help=f"rewrite the table in {DOC} between its markers")
    ns = ap.parse_args(argv)
    text = table()
    if not ns.update_doc:
        print(text)
        return 0
    with open(DOC, encoding="utf-8") as fh:
        doc = fh.read()
    if BEGIN not in doc or END not in doc:
        print(f"planner_table: {DOC} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", doc, flags=re.S)
    with open(DOC, "w", encoding="utf-8") as fh:
        fh.write(doc)
    print(f"planner_table: wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
