#!/usr/bin/env python
"""Check a placement plan before launching anything.

State the placement one of three ways:

    python tools/check_plan.py 'sglang:d4t2+megatron:d2p2t2' --n-nodes 2 --n-gpus-per-node 8
    python tools/check_plan.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 \\
        --rollout-num-gpus 8 --rollout-num-gpus-per-engine 2 --colocate --tensor-model-parallel-size 2
    python tools/check_plan.py rollout.backend=sglang:d2t4 actor.backend=fsdp:d8 \\
        cluster.n_nodes=2 cluster.n_gpus_per_node=8 actor.weight_update_mode=xccl

Add ``--hf-checkpoint DIR`` (or ``--model-config config.json``), ``--seq-length``
and ``--virtual-pipeline-model-parallel-size`` to check the layout against the
model; with a model, the training ranks' static memory (parameters, gradient
buffers, optimizer state: ``--bf16``, ``--use-distributed-optimizer``,
``--optimizer-cpu-offload``, ``--lora-rank``) is estimated against ``--gpu-type`` /
``--gpu-memory-gib``, and a weight sync and an RL step are timed (``--update-weight-buffer-size``,
``--rollout-batch-size`` ..., the link and MFU assumptions of ``--intra-node-link`` ...: docs/planner.md).
Prints a table (or one JSON object with ``--json``). Exit
status: 0 valid, 2 invalid (reason on stderr). Never launches anything and never
imports torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.config.schema import (BatchingConfig, EstimateConfig, LoraConfig, RolloutConfig,  # noqa: E402
                                       SyncConfig, flag_name)
from megatron_rl.errors import PlanError  # noqa: E402
from megatron_rl.plan.allocation import MAX_SIZE  # noqa: E402
from megatron_rl.plan.memory import (GPU_MEMORY_GIB, MegatronLayout, ModelArch, TrainingFlags,  # noqa: E402
                                     estimate_for_component, format_memory, report_json)
from megatron_rl.plan.fit import check_plan_fit, fit_json, format_fit  # noqa: E402
from megatron_rl.plan.sources import ASCII_INT  # noqa: E402
from megatron_rl.plan.sync_estimate import (Links, StepPlan, SyncPlan, estimate_json, estimate_step,  # noqa: E402
                                            estimate_sync, format_estimate, moe_topk)
from megatron_rl.plan import (  # noqa: E402
    Cluster, ModelShape, format_table, parse_allocation, plan_from_areal_args,
    plan_from_slime_flags, report_dict, validate_plan,
)

# flag dest -> plan_from_slime_flags keyword (identical names)
_SLIME_INT = ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
              "rollout_num_gpus_per_engine", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "expert_tensor_parallel_size")
_SLIME_BOOL = ("colocate", "debug_train_only", "debug_rollout_only")
# the sync / step estimate's flags, declared once in config/schema.py (names, defaults, domains, help)
_ESTIMATE_FLAGS = ((BatchingConfig, ("rollout_batch_size", "n_samples_per_prompt")),
                   (RolloutConfig, ("rollout_max_prompt_len", "rollout_max_response_len")),
                   (SyncConfig, ("update_weight_buffer_size",)), (LoraConfig, ("lora_sync",)), (EstimateConfig, ()))


def _ascii_int(limit: int):
    """argparse type: ASCII digits only (int() also takes '１６', '+4', '1_0') and 1 <= n <= limit."""
    def convert(text: str) -> int:
        if not ASCII_INT.fullmatch(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer in ASCII digits 0-9")
        if len(text.lstrip("0")) > len(str(limit)) or not 1 <= int(text) <= limit:
            shown = text if len(text) <= 20 else f"{text[:12]}... ({len(text)} digits)"
            raise argparse.ArgumentTypeError(f"{shown} is out of range: use 1 to {limit}")
        return int(text)
    convert.__name__ = "integer"
    return convert


_SIZE = _ascii_int(MAX_SIZE)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="check_plan.py", allow_abbrev=False, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Unknown flags are refused: only placement flags are read.")
    ap.add_argument("items", nargs="*", metavar="ALLOCATION | key=value",
                    help="an allocation string, or AReaL key=value arguments")
    c = ap.add_argument_group("cluster (default: none, so no fit check)")
    c.add_argument("--n-nodes", type=_SIZE)
    c.add_argument("--n-gpus-per-node", type=_SIZE, help="default 8 when only --n-nodes is given")
    m = ap.add_argument_group("model")
    m.add_argument("--hf-checkpoint", metavar="DIR", help="HF checkpoint directory with config.json")
    m.add_argument("--model-config", metavar="CONFIG_JSON", help="an HF config.json")
    m.add_argument("--seq-length", type=_ascii_int(2 ** 31))
    m.add_argument("--virtual-pipeline-model-parallel-size", type=_SIZE, dest="vpp")
    s = ap.add_argument_group("slime / Megatron flags")
    for dest in _SLIME_INT:
        s.add_argument("--" + dest.replace("_", "-"), type=_SIZE, dest=dest)
    for dest in _SLIME_BOOL:
        s.add_argument("--" + dest.replace("_", "-"), action="store_true", dest=dest)
    s.add_argument("--train-backend", choices=("megatron", "fsdp"))
    s.add_argument("--update-weight-transport", metavar="disk|tensor|distributed",
                   help="also applies to an allocation string")
    t = ap.add_argument_group("static memory of the training ranks (with a model; docs/planner.md)")
    t.add_argument("--bf16", action="store_true", help="bf16 parameters (fp32 master copy in the optimizer)")
    t.add_argument("--fp16", action="store_true", help="fp16 parameters (fp32 master copy in the optimizer)")
    t.add_argument("--use-distributed-optimizer", action="store_true",
                   help="optimizer state sharded over data-parallel ranks")
    t.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="optimizer state in host memory (implies --use-distributed-optimizer)")
    t.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    t.add_argument("--lora-rank", type=_ascii_int(2 ** 16), default=0)
    t.add_argument("--lora-target-modules", nargs="+", metavar="NAME", default=["all-linear"])
    t.add_argument("--gpu-type", choices=tuple(GPU_MEMORY_GIB), default=None,
                   help="the GPU the estimate is compared with (default H100-80G)")
    t.add_argument("--gpu-memory-gib", type=float, default=None, help="the GPU's memory in GiB, instead of --gpu-type")
    e = ap.add_argument_group("weight sync and step time (with a model and a rollout engine; docs/planner.md)")
    for cls, names in _ESTIMATE_FLAGS:
        for f in dataclasses.fields(cls):
            if names and f.name not in names:
                continue
            kind = {int: _ascii_int(2 ** 62), float: float}.get(type(f.default) if f.default is not None else float, str)
            e.add_argument(flag_name(f), dest=f.name, default=f.default, type=kind, choices=f.metadata["choices"],
                           help=f.metadata["help"])
    a = ap.add_argument_group("activations and the fit verdict (with a model and --max-tokens-per-gpu; docs/planner.md)")
    a.add_argument("--max-tokens-per-gpu", type=_ascii_int(2 ** 31), help="packed tokens per micro-batch per GPU")
    a.add_argument("--sequence-parallel", action="store_true")
    a.add_argument("--recompute-granularity", choices=("full", "selective"))
    a.add_argument("--recompute-method", choices=("uniform", "block"))
    a.add_argument("--recompute-num-layers", type=_ascii_int(2 ** 16))
    a.add_argument("--sglang-mem-fraction-static", type=float, help="the engines' static fraction of the GPU")
    a.add_argument("--allow-over-memory", action="store_true", help="exit 0 when a GPU does not fit (a warning)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def resolve(ns: argparse.Namespace) -> tuple:
    """Return (plan, cluster, notes) from whichever placement form was given."""
    notes: list[str] = []
    strings = [x for x in ns.items if "=" not in x]
    keyvals = [x for x in ns.items if "=" in x]
    slime = {k: getattr(ns, k) for k in _SLIME_INT if getattr(ns, k) is not None}
    slime.update({k: True for k in _SLIME_BOOL if getattr(ns, k)})
    if ns.train_backend:
        slime["train_backend"] = ns.train_backend
    if len(strings) > 1:
        raise PlanError(f"got {len(strings)} allocation strings {strings}; give one and join its "
                        f"components with '+' (separate GPUs) or '|' (shared GPUs)")
    forms = [name for name, given in (("an allocation string", strings),
                                      ("AReaL key=value arguments", keyvals),
                                      ("slime flags", slime)) if given]
    if not forms:
        raise PlanError("no placement given: pass an allocation string (e.g. sglang:d2t4+megatron:d4), "
                        "AReaL key=value arguments, or slime flags (--actor-num-nodes ...)")
    if len(forms) > 1:
        raise PlanError(f"placement is stated twice ({' and '.join(forms)}); use one form")

    cluster = None
    if strings:
        plan = parse_allocation(strings[0], weight_update=ns.update_weight_transport)
    elif keyvals:
        plan, cluster = plan_from_areal_args(keyvals)
        if ns.update_weight_transport:
            plan = dataclasses.replace(plan, weight_update=ns.update_weight_transport)
    else:
        plan = plan_from_slime_flags(update_weight_transport=ns.update_weight_transport, **slime)

    if ns.n_nodes is not None or ns.n_gpus_per_node is not None:
        flag_cluster = Cluster(ns.n_nodes if ns.n_nodes is not None else 1,
                               ns.n_gpus_per_node if ns.n_gpus_per_node is not None else 8)
        if cluster is not None and cluster != flag_cluster:
            raise PlanError(f"cluster stated twice and differently: --n-nodes/--n-gpus-per-node give "
                            f"{flag_cluster.n_nodes}x{flag_cluster.gpus_per_node}, cluster.* keys "
                            f"give {cluster.n_nodes}x{cluster.gpus_per_node}; keep one")
        cluster = flag_cluster
    elif slime:
        gpn = slime.get("actor_num_gpus_per_node", 8)
        cluster = Cluster(max(1, -(-plan.total_gpus // gpn)), gpn)
        notes.append(f"no cluster given; assuming {cluster.n_nodes} node(s) x {gpn} GPUs "
                     f"(--actor-num-gpus-per-node) to check that TP groups stay inside a node")
    return plan, cluster, notes


def load_model(ns: argparse.Namespace):
    if ns.hf_checkpoint and ns.model_config:
        raise PlanError("pass --hf-checkpoint or --model-config, not both")
    path = ns.hf_checkpoint or ns.model_config
    return ModelShape.from_hf_config(path) if path else None


def memory_reports(ns: argparse.Namespace, plan) -> list:
    """The static memory of each actor's training ranks (with its colocated critic), or none without a model."""
    path = ns.hf_checkpoint or ns.model_config
    if not path or not plan.actors:
        return []
    if ns.bf16 and ns.fp16:
        raise PlanError("--bf16 and --fp16 are mutually exclusive; pick one")
    arch = ModelArch.from_path(path)
    flags = TrainingFlags(params_dtype="bfloat16" if ns.bf16 else "float16" if ns.fp16 else "float32",
                          distributed_optimizer=ns.use_distributed_optimizer or ns.optimizer_cpu_offload,
                          cpu_offload=ns.optimizer_cpu_offload, precision_aware=ns.optimizer_cpu_offload,
                          optimizer=ns.optimizer, lora_rank=ns.lora_rank, lora_targets=tuple(ns.lora_target_modules))
    if ns.max_tokens_per_gpu:  # the whole fit: activations, engines, verdict, ranked fixes (plan/fit.py)
        gpn = ns.n_gpus_per_node or ns.actor_num_gpus_per_node or 8
        return [check_plan_fit(plan, actor, arch, flags, tokens=ns.max_tokens_per_gpu, sequence_parallel=ns.sequence_parallel,
                               recompute=ns.recompute_granularity, mem_fraction=ns.sglang_mem_fraction_static,
                               gpus_per_node=gpn, vpp=ns.vpp, recompute_method=ns.recompute_method,
                               recompute_num_layers=ns.recompute_num_layers, gpu_type=ns.gpu_type,
                               gpu_memory=ns.gpu_memory_gib) for actor in plan.actors]
    return [estimate_for_component(plan, actor, arch, flags, vpp=ns.vpp, gpu_type=ns.gpu_type,
                                   gpu_memory=ns.gpu_memory_gib) for actor in plan.actors]


def estimates(ns: argparse.Namespace, plan, cluster) -> list:
    """``(sync, step, transport)`` of each actor feeding rollout engines, or none without a model."""
    path = ns.hf_checkpoint or ns.model_config
    if not path or not plan.actors or not plan.rollout:
        return []
    for cls, _ in _ESTIMATE_FLAGS:  # the float flags' domains, as the run's validation walks them
        for f in dataclasses.fields(cls):
            value, domain = getattr(ns, f.name, None), f.metadata.get("domain")
            if domain is not None and value is not None and not domain.contains(value):
                raise PlanError(f"{flag_name(f)} {value:g} is out of range: it must lie in {domain}")
    arch = ModelArch.from_path(path)
    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path, encoding="utf-8") as fh:
        topk = moe_topk(json.load(fh))
    links = Links.resolve(ns.gpu_type, intra_node_link=ns.intra_node_link, inter_node_link=ns.inter_node_link,
                          disk_link=ns.disk_link, intra_node_gb_per_s=ns.intra_node_bandwidth_gb_per_s,
                          inter_node_gb_per_s=ns.inter_node_bandwidth_gb_per_s, disk_gb_per_s=ns.disk_bandwidth_gb_per_s)
    flags = TrainingFlags(params_dtype="bfloat16" if ns.bf16 else "float16" if ns.fp16 else "float32",
                          lora_rank=ns.lora_rank, lora_targets=tuple(ns.lora_target_modules))
    gpn = cluster.gpus_per_node if cluster is not None else 8
    out = []
    for actor in plan.actors:
        together = [c for c in plan.colocated_with(actor) if c.is_inference]
        engines = together or list(plan.rollout)
        colocated = bool(together)
        transport = plan.weight_update or ("tensor" if colocated else "distributed")
        fsdp = actor.backend == "fsdp"
        lay = (MegatronLayout(world=actor.world_size, tp=actor.world_size) if fsdp else
               MegatronLayout(world=actor.world_size, tp=actor.tp, pp=actor.pp, cp=actor.cp, ep=actor.ep,
                              etp=actor.etp if actor.ep > 1 else None, vpp=ns.vpp))
        sync_plan = SyncPlan(transport, sum(c.num_engines for c in engines), engines[0].engine_size, colocated,
                             not colocated and plan.total_gpus > gpn, gpn, ns.update_weight_buffer_size,
                             payload=ns.lora_sync if ns.lora_rank else "merged", fsdp=fsdp)
        sync = estimate_sync(arch, lay, flags, sync_plan, links, bucket_latency_ms=ns.sync_bucket_latency_ms)
        engine_gpus = actor.world_size if colocated else sum(c.world_size for c in engines)
        step = estimate_step(arch, topk, StepPlan(ns.rollout_batch_size, ns.n_samples_per_prompt,
                                                  ns.rollout_max_prompt_len, ns.rollout_max_response_len,
                                                  actor.world_size, engine_gpus,
                                                  passes_note="forward + backward 3; --dry-run also counts "
                                                  "recompute and the reference / old-log-prob / critic passes"),
                             links, sync.seconds, train_mfu=ns.estimate_train_mfu, decode_mfu=ns.estimate_decode_mfu)
        out.append((sync, step, transport))
    return out


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        plan, cluster, notes = resolve(ns)
        model = load_model(ns)
    except PlanError as exc:
        if ns.json:
            print(json.dumps({"valid": False, "total_gpus": None, "components": [],
                              "errors": [str(exc)], "warnings": [], "info": [],
                              "has_rollout": None, "has_training": None, "policies": [],
                              "multi_policy": None}, indent=2))
        print(f"check_plan: {exc}", file=sys.stderr)
        return 2
    report = validate_plan(plan, cluster, model, seq_length=ns.seq_length, vpp=ns.vpp)
    report = dataclasses.replace(report, info=tuple(notes) + report.info)
    try:
        fits = memory_reports(ns, plan) if report.ok else []
        memory = [f[0].memory if isinstance(f, tuple) else f for f in fits]
        for m in memory:
            m.ranks_per_node = cluster.gpus_per_node if cluster is not None else 1
        timed = estimates(ns, plan, cluster) if report.ok else []
    except PlanError as exc:
        print(f"check_plan: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        out = report_dict(plan, report, cluster)
        out["memory"] = [report_json(m) | (fit_json(*f) if isinstance(f, tuple) else {}) for m, f in zip(memory, fits)]
        out["sync"] = [estimate_json(sync, step) for sync, step, _ in timed]
        print(json.dumps(out, indent=2))
    else:
        print(format_table(plan, report, cluster))
        for m, f in zip(memory, fits):
            print("\n".join(format_memory(m, fit=isinstance(f, tuple))
                            + (["  " + line for line in format_fit(*f)] if isinstance(f, tuple) else [])))
        for sync, step, transport in timed:
            print("\n".join(format_estimate(sync, step, transport)))
    over = [s.describe() for f in fits if isinstance(f, tuple) for s in f[0].shortfalls()]
    if over and report.ok:
        print(f"check_plan: {'warning' if ns.allow_over_memory else 'error'}: the plan does not fit the GPU's "
              "memory:\n  - " + "\n  - ".join(over) + ("" if ns.allow_over_memory else
                                                      "\n(--allow-over-memory to exit 0 anyway)"), file=sys.stderr)
        if not ns.allow_over_memory:
            return 2
    if not report.ok:
        print("check_plan: invalid plan:\n  - " + "\n  - ".join(report.errors), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
