"""``--dry-run``: every check has passed; show the placement and exit without starting work."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from megatron_rl.config import Config
from megatron_rl.config.architecture import dry_run_without_checkpoint
from megatron_rl.config.megatron_flags import requirements
from megatron_rl.config.role_models import own_model_dir
from megatron_rl.config.placement import is_external_sglang, model_shape_for_config, plan_for_config
from megatron_rl.config.static_memory import fit_with_fixes
from megatron_rl.config.step_estimate import estimate_lines
from megatron_rl.config.validate import real_run_refusals
from megatron_rl.config.verl_keys import translation_lines
from megatron_rl.plan import format_table, validate_plan
from megatron_rl.plan.fit import format_fit
from megatron_rl.plan.memory import format_memory
from megatron_rl.rollout.sglang.launcher import engine_command, placement_for_config


def print_plan(cfg: Config) -> int:
    for line in translation_lines(cfg.mode.verl_overrides, cfg.mode.verl_config):
        print(line)
    plan = plan_for_config(cfg)
    report = validate_plan(plan)
    external = is_external_sglang(cfg)
    if external and cfg.has_training:
        # the plan holds only the actor (the servers are not ours to place): its "no rollout engine"
        # notes describe a train-only run, which this is not
        report = dataclasses.replace(report, info=tuple(
            i for i in report.info if "no rollout engine" not in i and "is unused" not in i))
    print(format_table(plan, report))
    if external:
        print(f"rollout: external SGLang servers, not started or placed by this run: "
              f"{' '.join(cfg.rollout.rollout_engine_urls)}; weights reach them {weight_route(cfg)}")
    if cfg.rollout.rollout_backend == "sglang" and not external and cfg.has_rollout_engine:
        for line in engine_lines(cfg):
            print(line)
    print(_model_line(cfg))
    c = cfg.checkpoint
    if cfg.algorithm.advantage_estimator == "ppo":
        start = (f"--critic-hf-checkpoint {c.critic_hf_checkpoint}" if c.critic_hf_checkpoint else
                 f"--critic-load {c.critic_load}" if c.critic_load else "the actor's initial weights")
        p = cfg.parallel
        tp = p.critic_tensor_model_parallel_size or p.tensor_model_parallel_size
        pp = p.critic_pipeline_model_parallel_size or p.pipeline_model_parallel_size
        own = (tp, pp, 1, None) != (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                    p.context_parallel_size, p.virtual_pipeline_model_parallel_size)
        layout = (f"its own layout TP {tp} x PP {pp} x DP {cfg.actor_world_size // (tp * pp)}" if own
                  else "the actor's layout")
        own_dir = own_model_dir(cfg.model.hf_checkpoint, c.critic_hf_checkpoint or c.critic_load)
        arch = f"of its own architecture ({own_dir}/config.json)" if own_dir else "of this architecture"
        print(f"critic: a second model {arch} with a value head, on the actor's ranks with {layout} "
              f"(its weights, gradients and optimizer state beside the actor's on every rank), from {start}")
    for flag, path in (("--opd-teacher-load", c.opd_teacher_load), ("--ref-load", c.ref_load)):
        if path:
            own_dir = own_model_dir(cfg.model.hf_checkpoint, path)
            print(f"{'teacher' if flag == '--opd-teacher-load' else 'reference'}: "
                  + (f"a frozen model of its own shapes ({own_dir}/config.json) on the actor's ranks, parameters only, "
                     f"from {flag} {path}" if own_dir else
                     f"a weight tag (a copy of the actor's parameter shards, --ref-weights-location) from {flag} {path}"))
    if cfg.data.reward_model_path:
        print(f"reward model: a one-label sequence classifier, a whole copy on each trainer rank, scoring every "
              f"batch before training, from --reward-model-path {cfg.data.reward_model_path}")
    lines, over = memory_lines(cfg)
    for line in lines + estimate_lines(cfg):
        print(line)
    for shown, words, missing in requirements(cfg):
        where = f"missing here: {' and '.join(missing)}" if missing else "present here"
        print(f"needs: {shown} takes effect only with {' and '.join(words)} ({where}; a real run refuses "
              f"it where missing)")
    refused = real_run_refusals(cfg)
    if over and not cfg.memory.allow_over_memory:
        print(f"error: {over}", file=sys.stderr)
        print("dry run: the plan does not fit the GPU's memory (above: the component, rank, shortfall and the fixes); "
              "--allow-over-memory goes on anyway; nothing was started")
        return 2
    if over:
        print(f"warning: {over}; going on: --allow-over-memory")
    if refused:  # the plan is worth seeing, but the verdict (and the exit code) is the real run's
        for why in refused:
            print(f"error: a real run refuses: {why}", file=sys.stderr)
        print(f"dry run: the plan above holds (training world {cfg.actor_world_size} rank(s), data-parallel "
              f"{cfg.data_parallel_size}), but a real run refuses this configuration: it asks for what this version "
              "does not build yet (the errors say which flags); nothing was started")
        return 2
    print(f"dry run: configuration valid; training world {cfg.actor_world_size} rank(s), "
          f"data-parallel {cfg.data_parallel_size}; nothing was started")
    return 0


def memory_lines(cfg: Config, gpu_memory: Optional[float] = None) -> tuple[list[str], str]:
    """``(lines, over)``: the memory per training rank (plan/memory.py, plan/activations.py), the engines' GPUs and
    the verdict against --gpu-type / --gpu-memory-gib (``gpu_memory``: the card a real run found), with the ranked
    fixes when it does not fit; ``over`` names the shortfalls ("" when it fits or is not estimated)."""
    if not cfg.has_training:
        return [], ""
    try:
        fit, source, fixes = fit_with_fixes(cfg, gpu_memory=gpu_memory)
    except (OSError, ValueError, KeyError) as exc:  # an unreadable config.json: the model line reports it
        return [f"static memory: not estimated ({type(exc).__name__}: {exc})"], ""
    if fit is None:
        return [f"static memory: not estimated ({source})"], ""
    short = fit.shortfalls()
    over = "; ".join(s.describe() for s in short)
    if over:
        over = f"the plan does not fit the GPU's memory: {over}" + (f"; fix: {fixes[0][0]}" if fixes else "")
    return format_memory(fit.memory, fit=True) + ["  " + line for line in format_fit(fit, fixes)], over


def weight_route(cfg: Config) -> str:
    """How the trained weights reach SGLang servers, by the resolved ``--update-weight-transport``. Was: always
    "through --update-weight-disk-dir DIR", which read "... None" with the distributed transport."""
    sync = cfg.sync
    if sync.update_weight_transport == "disk":
        return (f"as HF safetensors published under --update-weight-disk-dir {sync.update_weight_disk_dir} "
                "(--update-weight-transport disk: every server must read that path)")
    if sync.update_weight_transport == "distributed":
        return ("by broadcast from the driver rank into every server's TP ranks (--update-weight-transport "
                "distributed: NCCL on GPUs, gloo on CPU; each server must reach the driver's host)")
    return f"through --update-weight-transport {sync.update_weight_transport}"


def engine_lines(cfg: Config) -> list[str]:
    """The SGLang engines a real run launches, node by node, with the command line each gets (ports are
    picked at launch). GPU ids are node-local; separate engines take the GPUs beyond the trainer's, as
    many as the node shows at launch (a CPU-only plan shows processes)."""
    placement = placement_for_config(cfg, devices_per_node=None)
    g = cfg.rollout.rollout_num_gpus_per_engine
    mode = "colocated on the trainer's devices" if placement.colocated else "on their own devices"
    lines = [f"rollout: {len(placement.engines)} SGLang engine(s) of {g} GPU(s), {mode}, launched by each node's "
             f"local rank 0 (python -m sglang.launch_server, logs under {cfg.runtime.output_dir}/engines/)"]
    for node in sorted({n for e in placement.engines for n in e.nodes}):
        for e, part in placement.parts_on_node(node):
            devices = (f"trainer ranks {e.trainer_ranks[0]}-{e.trainer_ranks[-1]}'s devices" if e.trainer_ranks
                       else f"{g} device(s) beyond the trainer's {cfg.placement.actor_num_gpus_per_node}")
            if e.span:
                devices += (f", spanning nodes {','.join(map(str, e.span))}: its node-rank {part} part"
                            + (" (serves HTTP)" if part == 0 else " (health only)"))
            cmd = engine_command(cfg, e, python="python", host="HOST", port=0, nccl_port=0, part=part,
                                 dist_init_addr=f"NODE{e.node_rank}:PORT")
            args = " ".join(cmd[3:]).replace("--port 0 --nccl-port 0", "--port PORT --nccl-port PORT").replace(
                "--port 0 ", "--port PORT ")
            lines.append(f"  node {node} engine {e.index}: {devices}: sglang.launch_server {args}")
    return lines


def _model_line(cfg: Config) -> str:
    """Where the model shape the plan was checked against came from."""
    shape = model_shape_for_config(cfg)
    if shape is None:
        return "model: not checked (no --hf-checkpoint config.json and no architecture flags)"
    facts = (f"{shape.num_layers} layers, {shape.num_attention_heads} heads, {shape.num_query_groups} KV groups, "
             f"vocab {shape.vocab_size}" + (f", {shape.num_experts} experts" if shape.is_moe else ""))
    if dry_run_without_checkpoint(cfg):
        return (f"model: {facts}, from the architecture flags: --hf-checkpoint {cfg.model.hf_checkpoint} is not on "
                "this machine, so they were not checked against its config.json (a real run does)")
    return f"model: {facts}, from {shape.source or 'the architecture flags'}"
