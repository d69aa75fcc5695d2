"""The flags as the static-memory estimator's inputs (``plan/memory.py``): which role models a run builds on its
training ranks, at which layouts, from which ``config.json``, and how they train (stdlib only: ``--dry-run``).

Roles as the backends build them (``backends/roles.py``): the actor; ppo's critic (``--critic-hf-checkpoint``'s or
``--critic-load``'s recorded config, else the actor's architecture, at ``--critic-tensor/pipeline-model-parallel-
size``, no CP, no VPP, the actor's expert layout); a reference (``--ref-load``, or the initial policy when a KL term
is on) and an on-policy-distillation teacher (``--opd-teacher-load``), each a weight tag of the actor's parameters
when its config.json has the actor's shapes, else a frozen model of its own at the actor's TP / PP.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_rl.errors import PlanError
from megatron_rl.plan.activations import ActivationFlags
from megatron_rl.plan.engine_memory import EngineSpec
from megatron_rl.plan.fit import FitReport, Knobs, attach_activations, candidate_fixes, ranked_fixes
from megatron_rl.plan.memory import (MegatronLayout, MemoryReport, ModelArch, RoleModelSpec, TrainingFlags,
                                     estimate_fsdp, estimate_megatron)

from .architecture import read_hf_config
from .role_models import config_dir, own_model_dir
from .schema import Config


def training_flags(cfg: Config) -> TrainingFlags:
    opt = cfg.optimizer
    return TrainingFlags(params_dtype=cfg.precision.params_dtype,
                         distributed_optimizer=opt.effective_distributed_optimizer,
                         cpu_offload=opt.optimizer_cpu_offload, offload_fraction=opt.optimizer_offload_fraction,
                         precision_aware=opt.use_precision_aware_optimizer, optimizer=opt.optimizer,
                         lora_rank=cfg.lora.lora_rank, lora_targets=tuple(cfg.lora.lora_target_modules))


def arch_from_flags(cfg: Config) -> Optional[ModelArch]:
    """The model from the architecture flags (a slime script's ``MODEL_ARGS``) where config.json is not on this
    machine; None when they do not state enough (layers, hidden size, heads, vocab, FFN size)."""
    a = cfg.architecture
    if None in (a.num_layers, a.hidden_size, a.num_attention_heads, a.vocab_size, a.ffn_hidden_size):
        return None
    hf: dict = {"model_type": "", "num_hidden_layers": a.num_layers, "hidden_size": a.hidden_size,
                "num_attention_heads": a.num_attention_heads, "vocab_size": a.vocab_size,
                "intermediate_size": a.ffn_hidden_size, "head_dim": a.kv_channels,
                "num_key_value_heads": (a.num_query_groups or 1) if a.group_query_attention else None,
                "tie_word_embeddings": not a.untie_embeddings_and_output_weights}
    arch = ModelArch.from_hf_config(hf)
    freq = a.moe_layer_freq
    experts = a.num_experts or 0
    layers = int(a.num_layers or 0)
    moe = tuple(freq) if isinstance(freq, list) else tuple(
        int(i % (freq if isinstance(freq, int) and freq > 0 else 1) == 0) for i in range(layers))
    mla = None
    if a.multi_latent_attention and None not in (a.kv_lora_rank, a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim):
        mla = (a.q_lora_rank, int(a.kv_lora_rank or 0), int(a.qk_head_dim or 0), int(a.qk_pos_emb_head_dim or 0),
               int(a.v_head_dim or 0))
    return dataclasses.replace(arch, experts=experts, moe_ffn=a.moe_ffn_hidden_size or 0,
                               topk=(a.moe_router_topk or 1) if experts else 0,
                               moe_layers=moe if experts else (), qkv_bias=a.add_qkv_bias, qk_norm=a.qk_layernorm,
                               shared_expert=a.moe_shared_expert_intermediate_size or 0,
                               shared_expert_gate=a.moe_shared_expert_gate,
                               expert_bias_buffer=a.moe_router_enable_expert_bias, mla=mla,
                               gated_attention=a.attention_output_gate, model_type="(the architecture flags)")


def _arch_of(path: Optional[str]) -> Optional[ModelArch]:
    d = config_dir(path)
    return ModelArch.from_hf_config(read_hf_config(d)) if d else None


def actor_arch(cfg: Config) -> tuple[Optional[ModelArch], str]:
    """The actor's model and where it came from; None with the reason when neither config.json nor the
    architecture flags state it."""
    path = cfg.model.hf_checkpoint
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return ModelArch.from_hf_config(read_hf_config(path)), os.path.join(path, "config.json")
    arch = arch_from_flags(cfg)
    if arch is not None:
        return arch, "the architecture flags"
    return None, ("no --hf-checkpoint config.json on this machine and the architecture flags do not state the "
                  "model (--num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads, --vocab-size)")


def memory_report(cfg: Config, *, gpu_type: Optional[str] = None,
                  gpu_memory: Optional[float] = None) -> tuple[Optional[MemoryReport], str]:
    """``(report, source)``: the static memory per training rank, or ``(None, why not)``."""
    arch, source = actor_arch(cfg)
    if arch is None:
        return None, source
    flags = training_flags(cfg)
    p, ck, alg = cfg.parallel, cfg.checkpoint, cfg.algorithm
    ppo = alg.advantage_estimator == "ppo"
    critic_arch = (_arch_of(ck.critic_hf_checkpoint or ck.critic_load) or arch) if ppo else None
    if cfg.precision.train_backend == "fsdp":
        if flags.lora_rank:
            return None, "--train-backend fsdp with --lora-rank: not estimated yet (PEFT's adapter shapes)"
        report = estimate_fsdp(arch, flags, cfg.actor_world_size, critic=critic_arch, gpu_type=gpu_type,
                               gpu_memory=gpu_memory)
        report.ranks_per_node = cfg.placement.actor_num_gpus_per_node
        return report, source
    world = cfg.actor_world_size
    actor_layout = MegatronLayout(world=world, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                                  cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                                  etp=p.expert_tensor_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                                  last_stage_layers=p.decoder_last_pipeline_num_layers,
                                  first_stage_layers=p.decoder_first_pipeline_num_layers)
    second = MegatronLayout(world=world, tp=p.critic_tensor_model_parallel_size or actor_layout.tp,
                            pp=p.critic_pipeline_model_parallel_size or actor_layout.pp, ep=actor_layout.ep,
                            etp=p.expert_tensor_parallel_size)
    mtp = cfg.megatron.mtp_num_layers or 0
    actor = RoleModelSpec("actor", arch, actor_layout, mtp_layers=mtp, mtp_trained=cfg.megatron.enable_mtp_training,
                          source=source)
    critic = None
    if critic_arch is not None:
        critic = RoleModelSpec("critic", critic_arch, second, head="value",
                               source=str(ck.critic_hf_checkpoint or ck.critic_load or "the actor's architecture"))
    frozen, tags = [], []
    wanted = ([("ref", ck.ref_load)] if ck.ref_load or alg.use_kl_loss or alg.kl_coef > 0 else []) + (
        [("teacher", ck.opd_teacher_load)] if ck.opd_teacher_load else [])
    for name, path in wanted:
        own = own_model_dir(cfg.model.hf_checkpoint, path)
        if own:
            frozen.append(RoleModelSpec(name, ModelArch.from_hf_config(read_hf_config(own)),
                                        MegatronLayout(world=world, tp=actor_layout.tp, pp=actor_layout.pp,
                                                       ep=actor_layout.ep, etp=p.expert_tensor_parallel_size),
                                        trainable=False, source=str(path)))
        else:
            tags.append(name)
    try:
        report = estimate_megatron(actor, flags, critic=critic, frozen_models=tuple(frozen), tags=tuple(tags),
                                   tag_location=cfg.memory.ref_weights_location,
                                   offload_train=cfg.memory.effective_offload_train, gpu_type=gpu_type,
                                   gpu_memory=gpu_memory)
    except PlanError as exc:
        return None, str(exc)
    report.ranks_per_node = cfg.placement.actor_num_gpus_per_node
    problem = arch.lora_problem(flags.lora_targets) if flags.lora_rank else None
    if problem:
        report.notes.append(problem)
    if cfg.precision.fp8_param_gather:
        report.notes.append("--fp8-param-gather keeps GEMM weights in fp8: parameters are counted at "
                            f"{cfg.precision.params_dtype} here (an over-estimate)")
    return report, source


# ---------------------------------------------------------------------------------------------------- the fit


def knobs_of(cfg: Config) -> Knobs:
    p, b = cfg.parallel, cfg.batching
    tokens = (b.max_tokens_per_gpu if b.use_dynamic_batch_size and b.max_tokens_per_gpu
              else b.micro_batch_size * cfg.seq_length)
    return Knobs(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                 tokens=int(tokens), recompute=cfg.memory.recompute_granularity,
                 cpu_offload=cfg.optimizer.optimizer_cpu_offload,
                 distributed_optimizer=cfg.optimizer.effective_distributed_optimizer,
                 sequence_parallel=p.sequence_parallel)


def with_knobs(cfg: Config, k: Knobs) -> Config:
    """``cfg`` with a fix's flags applied (what its re-estimate reads)."""
    m = cfg.memory
    memory = dataclasses.replace(m, recompute_granularity=k.recompute)
    if k.recompute == "full" and m.recompute_granularity != "full":
        memory = dataclasses.replace(memory, recompute_method="uniform", recompute_num_layers=1)
    b = cfg.batching
    batching = b
    if k.tokens != knobs_of(cfg).tokens:
        batching = dataclasses.replace(b, use_dynamic_batch_size=True, max_tokens_per_gpu=k.tokens)
    rollout = cfg.rollout
    if k.engine_tp:
        args = dict(rollout.sglang_args)
        if k.engine_ep > 1:
            args["ep_size"] = str(k.engine_ep)
        if k.mem_fraction is not None:
            args["mem_fraction_static"] = str(k.mem_fraction)
        rollout = dataclasses.replace(rollout, rollout_num_gpus_per_engine=k.engine_tp, sglang_args=args)
    return dataclasses.replace(
        cfg, rollout=rollout, parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=k.tp,
                                          pipeline_model_parallel_size=k.pp, expert_model_parallel_size=k.ep,
                                          sequence_parallel=k.sequence_parallel),
        optimizer=dataclasses.replace(cfg.optimizer, optimizer_cpu_offload=k.cpu_offload,
                                      use_distributed_optimizer=k.distributed_optimizer,
                                      use_precision_aware_optimizer=cfg.optimizer.use_precision_aware_optimizer
                                      or k.cpu_offload),
        memory=memory, batching=batching)


def engine_spec(cfg: Config, arch: ModelArch) -> Optional[EngineSpec]:
    """The SGLang engines this run launches (none: external servers, no engine, another rollout backend)."""
    r = cfg.rollout
    if not cfg.has_rollout_engine or r.rollout_backend != "sglang" or r.rollout_engine_urls:
        return None
    frac = r.sglang_args.get("mem_fraction_static")
    gpus = r.rollout_num_gpus or cfg.actor_world_size
    return EngineSpec(arch, tp=r.rollout_num_gpus_per_engine, count=max(gpus // r.rollout_num_gpus_per_engine, 1),
                      mem_fraction=float(frac) if frac is not None else None,
                      ep=int(r.sglang_args.get("ep_size") or 1) if arch.experts else 1,
                      dtype_bytes=2, sequence_tokens=r.rollout_max_prompt_len + r.rollout_max_response_len)


def fit_report(cfg: Config, *, gpu_memory: Optional[float] = None,
               kernels: str = "te") -> tuple[Optional[FitReport], str]:
    """``(fit, source)``: the static report with the activations (megatron backend) and the engines attached, or
    ``(None, why not)``. ``gpu_memory``: GiB, over --gpu-memory-gib / --gpu-type (a real run's measured card)."""
    report, source = memory_report(cfg, gpu_type=cfg.memory.gpu_type,
                                   gpu_memory=gpu_memory if gpu_memory is not None else cfg.memory.gpu_memory_gib)
    if report is None:
        return None, source
    arch, _ = actor_arch(cfg)
    assert arch is not None, "memory_report gave a report, so the model is known"
    k = knobs_of(cfg)
    fit = FitReport(report, k, colocated=cfg.memory.colocate, bucket_bytes=float(cfg.sync.update_weight_buffer_size),
                    response_share=min(1.0, cfg.rollout.rollout_max_response_len / max(cfg.seq_length, 1)))
    if cfg.precision.train_backend == "megatron":
        p, m = cfg.parallel, cfg.memory
        fl = ActivationFlags(tokens=k.tokens * p.context_parallel_size, dtype_bytes=training_flags(cfg).param_bytes,
                             sequence_parallel=p.sequence_parallel, recompute_granularity=m.recompute_granularity,
                             recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers,
                             kernels=kernels, mtp_trained=cfg.megatron.enable_mtp_training,
                             response_share=fit.response_share,
                             logprob_chunk_rows=cfg.batching.log_probs_chunk_size)
        world = cfg.actor_world_size
        lay = MegatronLayout(world=world, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                             cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                             etp=p.expert_tensor_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
                             last_stage_layers=p.decoder_last_pipeline_num_layers)
        attach_activations(fit, RoleModelSpec("actor", arch, lay, mtp_layers=cfg.megatron.mtp_num_layers or 0), fl)
        if cfg.algorithm.advantage_estimator == "ppo":  # the critic trains after the actor: its own peak, not summed
            ck = cfg.checkpoint
            critic = _arch_of(ck.critic_hf_checkpoint or ck.critic_load) or arch
            clay = MegatronLayout(world=world, tp=p.critic_tensor_model_parallel_size or lay.tp,
                                  pp=p.critic_pipeline_model_parallel_size or lay.pp, ep=lay.ep,
                                  etp=p.expert_tensor_parallel_size)
            attach_activations(fit, RoleModelSpec("critic", critic, clay, head="value"),
                               dataclasses.replace(fl, tokens=k.tokens, mtp_trained=False))
    else:
        report.notes.append("activations of --train-backend fsdp: not estimated (the megatron backend's only)")
    fit.engine = engine_spec(cfg, arch)
    if fit.engine:
        fit.knobs = dataclasses.replace(k, engine_tp=fit.engine.tp, engine_ep=fit.engine.ep,
                                        mem_fraction=fit.engine.mem_fraction)
    return fit, source


def fit_with_fixes(cfg: Config, **kw) -> tuple[Optional[FitReport], str, list]:
    """The fit, and when it does not fit the ranked fixes (``plan.fit.ranked_fixes``) re-estimated from ``cfg``."""
    fit, source = fit_report(cfg, **kw)
    if fit is None or not fit.shortfalls():
        return fit, source, []
    arch, _ = actor_arch(cfg)
    assert arch is not None
    cands = candidate_fixes(fit.knobs, layers=arch.layers, heads=arch.heads, groups=arch.groups,
                            experts=arch.experts, world=cfg.actor_world_size,
                            gpus_per_node=cfg.placement.actor_num_gpus_per_node)
    if cfg.precision.train_backend == "fsdp":
        cands = [c for c in cands if c[0].startswith(("--optimizer-cpu-offload", "--max-tokens-per-gpu"))]
    from .validate import collect_errors  # lazy: the validator imports this module's neighbours

    def estimate(k: Knobs) -> Optional[FitReport]:
        changed = with_knobs(cfg, k)
        return None if collect_errors(changed) else fit_report(changed, **kw)[0]  # a fix validation refuses is none

    return fit, source, ranked_fixes(fit, estimate, cands)
