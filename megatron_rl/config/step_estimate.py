"""The flags as the weight-sync and step-time estimate's inputs (``plan/sync_estimate.py``), for ``--dry-run``.

Which engines a run feeds and how (``--rollout-backend``, ``--colocate``, ``--rollout-engine-urls``, the resolved
``--update-weight-transport``), what a sync sends (``--lora-sync``), how many forwards a step makes over its tokens
(the reference, old-log-prob, teacher and critic passes the algorithm flags ask for), and the ``estimate`` group's
assumptions. Standard library only.
"""

from __future__ import annotations

import os
from megatron_rl.errors import PlanError
from megatron_rl.plan.memory import MegatronLayout
from megatron_rl.plan.sync_estimate import (Links, StepPlan, SyncPlan, estimate_step, estimate_sync, format_estimate,
                                            moe_topk)

from .architecture import read_hf_config
from .schema import Config
from .static_memory import actor_arch, training_flags


def links_for_config(cfg: Config) -> Links:
    e = cfg.estimate
    return Links.resolve(cfg.memory.gpu_type, intra_node_link=e.intra_node_link, inter_node_link=e.inter_node_link,
                         disk_link=e.disk_link, intra_node_gb_per_s=e.intra_node_bandwidth_gb_per_s,
                         inter_node_gb_per_s=e.inter_node_bandwidth_gb_per_s, disk_gb_per_s=e.disk_bandwidth_gb_per_s)


def _topk(cfg: Config) -> int:
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return moe_topk(read_hf_config(path))
    return int(cfg.architecture.moe_router_topk or 0)


def _passes(cfg: Config) -> tuple[float, str]:
    """Forward-equivalents per token of one step's training side, and what they are."""
    recompute = cfg.memory.recompute_granularity == "full"
    train = 4.0 if recompute else 3.0
    parts = ["forward + backward 3" + (", the recomputed forward 1" if recompute else "")]
    a, ck = cfg.algorithm, cfg.checkpoint
    if a.use_kl_loss or a.kl_coef > 0 or ck.ref_load:
        train += 1
        parts.append("the reference's log-probs 1")
    if cfg.batching.optimizer_steps_per_rollout > 1 and not a.use_rollout_logprobs:
        train += 1
        parts.append("the old log-probs 1")
    if ck.opd_teacher_load:
        train += 1
        parts.append("the teacher's log-probs 1 (at the actor's size)")
    if a.advantage_estimator == "ppo":
        train += (4.0 if recompute else 3.0) + 1
        parts.append(f"the critic {'5' if recompute else '4'} (values, then training; at the actor's size)")
    return train, ", ".join(parts)


def estimate_lines(cfg: Config) -> list[str]:
    """The section ``--dry-run`` prints: the sync's stages and the step's split, with every assumption; one line
    saying why not when the model or the engines are not known here."""
    if not (cfg.has_training and cfg.has_rollout_engine):
        return []
    try:
        arch, source = actor_arch(cfg)
    except (OSError, ValueError, KeyError, PlanError) as exc:  # an unreadable config.json: the model line reports it
        return [f"weight sync estimate: not estimated ({type(exc).__name__}: {exc})"]
    if arch is None:
        return [f"weight sync estimate: not estimated ({source})"]
    p, r, s = cfg.parallel, cfg.rollout, cfg.sync
    world, gpn = cfg.actor_world_size, cfg.placement.actor_num_gpus_per_node
    fsdp = cfg.precision.train_backend == "fsdp"
    lay = (MegatronLayout(world=world, tp=world) if fsdp else
           MegatronLayout(world=world, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                          etp=p.expert_tensor_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                          last_stage_layers=p.decoder_last_pipeline_num_layers))
    g = r.rollout_num_gpus_per_engine
    embedded = r.rollout_backend == "embedded"
    if embedded:
        engines, engine_gpus, colocated, remote = 1, world, True, False
    elif r.rollout_engine_urls:
        # servers of their own: their size is not known here; one node's GPUs each, as the shipped scripts start them
        engines, engine_gpus, colocated, remote = len(r.rollout_engine_urls), gpn, False, True
    else:
        colocated = cfg.memory.colocate
        total = r.rollout_num_gpus or world
        engines, engine_gpus, remote = max(1, total // g), g, False
    flags = training_flags(cfg)
    payload = cfg.lora.lora_sync if flags.lora_rank else "merged"
    plan = SyncPlan(s.update_weight_transport, engines, engine_gpus, colocated, remote, gpn, s.update_weight_buffer_size,
                    embedded=embedded, payload=payload, fsdp=fsdp)
    try:
        links = links_for_config(cfg)
        sync = estimate_sync(arch, lay, flags, plan, links, bucket_latency_ms=cfg.estimate.sync_bucket_latency_ms)
        passes, what = _passes(cfg)
        engine_total = world if colocated else engines * engine_gpus
        step = estimate_step(arch, _topk(cfg), StepPlan(cfg.batching.rollout_batch_size, cfg.batching.n_samples_per_prompt,
                                                        r.rollout_max_prompt_len, r.rollout_max_response_len, world,
                                                        engine_total, passes, what, r.async_mode != "off"),
                             links, sync.seconds, train_mfu=cfg.estimate.estimate_train_mfu,
                             decode_mfu=cfg.estimate.estimate_decode_mfu)
    except (OSError, ValueError, KeyError, PlanError) as exc:
        return [f"weight sync estimate: not estimated ({exc})"]
    if r.rollout_engine_urls:
        sync.assumptions.append(f"the {engines} --rollout-engine-urls server(s) run on other nodes, one node's "
                                f"{gpn} GPUs each (--actor-num-gpus-per-node; their own size is not known here)")
    return format_estimate(sync, step, s.update_weight_transport)

