"""Which rollout engine x weight-sync transport x placement combinations this version runs.

Kept apart from ``validate.py`` (the flag-by-flag and cross-flag checks) because these rules
change with each engine or transport built, and because one of them starts a subprocess:
``_engine_python_problem`` asks the interpreter that will run ``sglang.launch_server`` whether
it has SGLang (a ``find_spec``, not an import: importing sglang takes ~25 s). A refusal that
means "valid, but this version does not build that" is a ``NotBuilt`` message: ``--dry-run``
still prints such a script's plan, then names them and exits 2 (``runner/dry_run.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Optional
from urllib.parse import urlsplit

from megatron_rl.errors import ConfigError
from megatron_rl.plan.engines import plan_engine_placement
from megatron_rl.plan.sglang_weights import layout_problem, read_hf_config

from .paths import dir_problem
from .schema import Config


class NotBuilt(str):
    """A refusal that says "this version does not build that", not that the input is wrong.

    A ``str`` (the validation rules collect messages) whose type carries the distinction, so
    callers test ``isinstance(e, NotBuilt)`` instead of matching words of the message."""


_NOT_YET = "not built in this version"


_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})/?$")


def refuse_unimplemented_rollout_and_sync(cfg: Config) -> list[str]:
    """The engine x transport combinations this version cannot run, refused before any worker starts.

    Without this they passed validation (and ``--dry-run``) and failed only after the model
    was built, or, for ``--update-weight-disk-dir``, were silently dropped. Engines: embedded, and
    sglang: engines this run launches (``rollout/sglang/launcher.py``) or servers the user runs
    (``--rollout-engine-urls``). Transports: tensor (the embedded engine in process; SGLang engines
    launched colocated), disk (both engines), distributed (SGLang servers only).
    Kept apart from ``_check_sync_and_rollout`` so ``collect_errors`` still runs the planner on
    such a config: a launch script's layout is checked even while its engine is refused.
    """
    r, s = cfg.rollout, cfg.sync
    errors = []
    if r.use_fault_tolerance and not (r.rollout_backend == "sglang" and not r.rollout_engine_urls
                                      and cfg.has_rollout_engine):
        what = ("servers of --rollout-engine-urls are yours to restart" if r.rollout_engine_urls else
                f"--rollout-backend {r.rollout_backend} " + ("runs inside the driver rank" if cfg.has_rollout_engine
                                                              else "with no engine in a train-only run"))
        errors.append(f"--use-fault-tolerance restarts SGLang engines this run launches, and {what}: drop it")
    if r.rollout_backend == "sglang" and not cfg.has_rollout_engine:
        sized = " and the flags that size or configure SGLang engines" if r.names_sglang_engines else ""
        errors.append("--rollout-backend sglang: a train-only run (--debug-train-only / --load-debug-rollout-data) "
                      f"generates nothing, so no SGLang engine starts or is used: drop it{sized}")
    elif r.rollout_backend == "sglang" and not r.rollout_engine_urls:
        errors.extend(_launched_sglang_errors(cfg))
    elif r.rollout_backend == "sglang":
        errors.extend(_external_sglang_errors(cfg))
    elif r.rollout_engine_urls:
        errors.append(f"--rollout-engine-urls {' '.join(r.rollout_engine_urls)} names SGLang servers, but "
                      f"--rollout-backend is {r.rollout_backend}, which starts its own engine in the driver rank: "
                      "add --rollout-backend sglang, or drop --rollout-engine-urls")
    if s.update_weight_transport == "distributed" and r.rollout_backend != "sglang":
        errors.append(f"--update-weight-transport distributed broadcasts into SGLang server processes over a "
                      f"process group, but --rollout-backend {r.rollout_backend} runs its engine inside the driver "
                      "rank: there is no server process to join the group; use --update-weight-transport tensor "
                      "(the in-process hand-over) or disk")
    if s.update_weight_transport == "disk":
        if not s.update_weight_disk_dir:
            errors.append("--update-weight-transport disk needs --update-weight-disk-dir DIR (where each sync "
                          "publishes v<version>/; SGLang servers must be able to read it)")
        else:
            why = dir_problem(s.update_weight_disk_dir)
            if why:
                errors.append(f"--update-weight-disk-dir {s.update_weight_disk_dir} {why}; give a directory this "
                              "user can create and write to (and the SGLang servers can read)")
    elif s.update_weight_disk_dir is not None:
        errors.append(f"--update-weight-disk-dir {s.update_weight_disk_dir} is only used by "
                      f"--update-weight-transport disk, not {s.update_weight_transport}: add "
                      "--update-weight-transport disk or drop --update-weight-disk-dir")
    errors.extend(_weight_update_mode_errors(cfg))
    errors.extend(_async_errors(cfg))
    if r.embedded_engine_ranks != "auto" and r.rollout_backend != "embedded":
        errors.append(f"--embedded-engine-ranks {r.embedded_engine_ranks} places the embedded engine, but "
                      f"--rollout-backend is {r.rollout_backend} (SGLang engines are placed by --colocate and "
                      "--rollout-num-gpus(-per-engine)): drop it")
    elif r.embedded_engine_ranks == "process" and not cfg.has_rollout_engine:
        errors.append("--embedded-engine-ranks process starts an engine process, but this run generates nothing "
                      "(--debug-train-only / --load-debug-rollout-data): drop it")
    elif r.embedded_engine_ranks == "all" and not (cfg.has_training and cfg.has_rollout_engine):
        why = ("generates nothing (--debug-train-only / --load-debug-rollout-data)" if not cfg.has_rollout_engine
               else "has no trainer ranks besides the driver (--debug-rollout-only: the others exit at start)")
        errors.append(f"--embedded-engine-ranks all puts an engine replica on every trainer rank, but this run {why}: "
                      "drop it")
    if cfg.embedded_placement == "process":
        errors.extend(_embedded_process_errors(cfg))
    if r.rollout_backend == "embedded":
        # SGLang-only knobs: the embedded engine is one in-process engine on the driver rank's
        # devices, so a GPU count or a server argument would be accepted and do nothing.
        errors.extend(_sglang_launch_knob_errors(
            cfg, "the embedded engine runs inside the driver rank on the trainer's devices (--rollout-backend "
            "sglang launches SGLang engines)", "the embedded engine starts none"))
    return errors


def _weight_update_mode_errors(cfg: Config) -> list[str]:
    """--update-weight-mode delta and --update-weight-verify checksum need an engine in this process (one that
    patches its weights in place and reports checksums); the delta-only flags need delta."""
    s, r = cfg.sync, cfg.rollout
    errors = []
    where = ("SGLang servers" if r.rollout_backend == "sglang"
             else "the embedded engine in a process of its own (--embedded-engine-ranks process)")
    if s.update_weight_mode == "delta":
        if not cfg.has_rollout_engine:
            errors.append("--update-weight-mode delta: this run generates nothing (--debug-train-only / "
                          "--load-debug-rollout-data), so no weights are synced: drop it")
        elif r.rollout_backend == "sglang":
            errors.extend(_sglang_delta_errors(cfg))
        elif not cfg.in_process_engine:
            errors.append(f"--update-weight-mode delta patches the engine's weights in place, which {where} cannot "
                          "do (its process loads whole versions only): use --update-weight-mode full, the embedded "
                          "engine on the driver (--embedded-engine-ranks driver or all), or SGLang servers on this "
                          "host")
        if cfg.memory.colocate and cfg.in_process_engine:
            errors.append("--update-weight-mode delta with --colocate: the embedded engine gives its weights back "
                          "during training (no host copy is kept), so every sync would have to send every tensor "
                          "anyway (as slime, which refuses the same): drop one of them")
        if cfg.lora.lora_sync == "adapter":
            errors.append("--update-weight-mode delta with --lora-sync adapter: the adapter sync already sends only "
                          "the adapters; use one of them")
    elif s.update_weight_delta_encoding != "xor":
        errors.append(f"--update-weight-delta-encoding {s.update_weight_delta_encoding} is only used by "
                      "--update-weight-mode delta: add --update-weight-mode delta or drop it")
    if s.update_weight_verify == "checksum" and cfg.has_rollout_engine and r.rollout_backend == "sglang":
        errors.extend(_sglang_verify_errors(cfg))
    if s.update_weight_verify == "checksum" and cfg.lora.lora_sync == "adapter":
        errors.append("--update-weight-verify checksum with --lora-sync adapter: the engine merges the adapter into "
                      "its weights itself (in float32), so its bytes are not the trainer's to compare; use "
                      "--check-weight-update-equal (compared within a tolerance), or --lora-sync merged")
    if (s.update_weight_delta_checksum != "xxh3-128" and s.update_weight_mode == "full"
            and cfg.weight_update_verify == "off"):
        errors.append(f"--update-weight-delta-checksum {s.update_weight_delta_checksum} is used by "
                      "--update-weight-mode delta and --update-weight-verify, both off in this run: drop it")
    return errors


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _sglang_delta_errors(cfg: Config) -> list[str]:
    """--update-weight-mode delta with SGLang (rollout/sglang/host_checkpoint.py): the trainer's driver patches a
    checkpoint on the servers' host and has them reload the changed tensors from it, so the servers must be on the
    driver's host and the delta must arrive as files (the disk transport). What is not built is refused by name."""
    s, r = cfg.sync, cfg.rollout
    errors = []
    if s.update_weight_transport != "disk":
        errors.append(f"--update-weight-mode delta with SGLang goes through --update-weight-transport disk (the "
                      f"delta is patched into a checkpoint on the servers' host, which they reload), not "
                      f"{s.update_weight_transport}: add --update-weight-transport disk --update-weight-disk-dir DIR, "
                      "or use --update-weight-mode full")
    remote = [u for u in r.rollout_engine_urls if (urlsplit(str(u)).hostname or "") not in _LOOPBACK]
    if remote:
        errors.append(f"--update-weight-mode delta with SGLang servers on other hosts ({', '.join(map(str, remote))}): "
                      "the patch is applied by the trainer's driver to a checkpoint on the servers' host, and a "
                      "patching process beside a remote server is not built; use servers on this host (loopback "
                      "--rollout-engine-urls, or the engines this run launches on one node), or --update-weight-mode "
                      "full")
    elif not r.rollout_engine_urls and cfg.placement.actor_num_nodes > 1:
        errors.append(f"--update-weight-mode delta with SGLang engines launched on {cfg.placement.actor_num_nodes} "
                      "nodes (--actor-num-nodes): the patch is applied by the driver to a checkpoint on its own host, "
                      "and a patching process beside the other nodes' engines is not built; use one node or "
                      "--update-weight-mode full")
    if cfg.memory.colocate and str(r.sglang_args.get("device", "")).lower() != "cpu":
        errors.append("--update-weight-mode delta with --colocate and SGLang on GPUs: the servers release their "
                      "weights while the trainer trains, so every sync would send every tensor (as slime, which "
                      "refuses the same): drop one of them (SGLang on CPU keeps its weights: allowed there)")
    return errors


def _sglang_verify_errors(cfg: Config) -> list[str]:
    """--update-weight-verify checksum with SGLang servers (weight_sync/sglang_verify.py): the driver must see every
    exported tensor (not the distributed transport's one sender per pipeline stage), and the trainer must know how
    the model's SGLang class holds its tensors (plan/sglang_weights.py, read from config.json)."""
    s = cfg.sync
    errors = []
    if s.update_weight_transport == "distributed" and cfg.parallel.pipeline_model_parallel_size > 1:
        errors.append("--update-weight-verify checksum with --update-weight-transport distributed and "
                      f"--pipeline-model-parallel-size {cfg.parallel.pipeline_model_parallel_size}: each pipeline stage "
                      "sends its own tensors to SGLang, which the driver does not see to hash (not built): use "
                      "--update-weight-transport disk, or --update-weight-verify off")
    hf = cfg.model.hf_checkpoint
    hf_config = read_hf_config(str(hf)) if hf else {}
    if hf_config:  # no config.json to read here: the first sync names the problem instead
        problem = layout_problem(hf_config)
        if problem:
            errors.append(f"--update-weight-verify checksum with SGLang compares SGLang's checksums of its own tensors "
                          f"(fused, per TP rank) with the trainer's of the same bytes: {problem} "
                          f"(--hf-checkpoint {hf}): use --update-weight-verify off")
    return errors


def _async_errors(cfg: Config) -> list[str]:
    """``--async-mode``: generation overlaps training only on engines that do not share the trainer's devices.

    A colocated engine would generate on the GPUs the trainer is training on (and is released while it
    trains); the embedded engine runs inside the driver rank, on the trainer's devices."""
    r, m = cfg.rollout, cfg.memory
    errors = []
    if r.async_mode != "full":
        given = [f for f, on in (("--max-staleness", r.max_staleness is not None),
                                 ("--partial-rollout", r.partial_rollout)) if on]
        if given:
            what = "trains every rollout at staleness 1" if r.async_mode == "one-step" else "generates, then trains"
            errors.append(f"{' and '.join(given)} pace and continue the rollouts of --async-mode full; --async-mode "
                          f"{r.async_mode} {what}: add --async-mode full or drop {' and '.join(given)}")
    if r.pause_generation_mode != "abort" and not (r.async_mode == "full" and r.partial_rollout):
        errors.append(f"--pause-generation-mode {r.pause_generation_mode} keeps the rows in flight across a weight "
                      "sync, which only --async-mode full --partial-rollout has (in the other modes no row spans a "
                      "sync): add --async-mode full --partial-rollout or drop --pause-generation-mode")
    elif r.pause_generation_mode != "abort" and r.use_fault_tolerance:
        errors.append(NotBuilt(f"--pause-generation-mode {r.pause_generation_mode} with --use-fault-tolerance is "
                               f"{_NOT_YET}: an engine restart relies on the abort before each sync to find a dead "
                               "engine with no row left on it; use --pause-generation-mode abort with "
                               "--use-fault-tolerance"))
    elif r.pause_generation_mode == "in_place" and cfg.sync.update_weight_transport != "disk":
        errors.append(NotBuilt(f"--pause-generation-mode in_place with --update-weight-transport "
                               f"{cfg.sync.update_weight_transport} is {_NOT_YET}: that route flushes SGLang's cache "
                               "with its last bucket, which SGLang refuses while in_place keeps the rows running; "
                               "use --update-weight-transport disk, or --pause-generation-mode retract"))
    if r.async_mode == "off":
        if r.async_wait_timeout != 3600.0:
            errors.append(f"--async-wait-timeout {r.async_wait_timeout:g} bounds the wait for a batch generated "
                          "while training, which only --async-mode one-step and full do: add --async-mode or drop it")
        return errors
    if r.max_staleness is not None and r.max_staleness < 1:
        errors.append(f"--max-staleness {r.max_staleness}: generation overlapping training is at least one update "
                      "behind; use >= 1, or --async-mode off for on-policy batches")
    if not (cfg.has_training and cfg.has_rollout_engine):
        why = ("generates nothing (--debug-train-only / --load-debug-rollout-data)" if not cfg.has_rollout_engine
               else "trains nothing (--debug-rollout-only)")
        errors.append(f"--async-mode {r.async_mode} overlaps generation with training, but this run {why}: "
                      "drop --async-mode")
    elif m.colocate or m.effective_offload_rollout or m.effective_offload_train:
        which = "--colocate" if m.colocate else "--offload-rollout" if m.offload_rollout else "--offload-train"
        errors.append(f"--async-mode {r.async_mode} generates while the trainer trains, but {which} hands the "
                      "same devices back and forth between engine and trainer, so they cannot run at once: "
                      "give the engines devices of their own (--rollout-num-gpus without --colocate, or "
                      "--rollout-engine-urls), or use --async-mode off")
    elif r.rollout_backend == "embedded" and cfg.embedded_placement != "process":
        errors.append(f"--async-mode {r.async_mode} generates while the trainer trains, but --embedded-engine-ranks "
                      f"{r.embedded_engine_ranks} runs the embedded engine inside the trainer ranks, which train: "
                      "use --embedded-engine-ranks process (its own process; the default with --async-mode)")
    return errors


def _embedded_process_errors(cfg: Config) -> list[str]:
    """``--embedded-engine-ranks process``: the engine is a server process the driver starts (synced from disk)."""
    s, m = cfg.sync, cfg.memory
    errors = []
    if s.update_weight_transport != "disk":
        errors.append(f"--embedded-engine-ranks process runs the engine in a process of its own, which loads each "
                      f"weight version from disk; --update-weight-transport {s.update_weight_transport} "
                      f"{'hands tensors to an engine in this process' if s.update_weight_transport == 'tensor' else 'needs SGLang servers'}"
                      ": use --update-weight-transport disk (the default there)")
    for flag, on in (("--colocate", m.colocate), ("--offload-rollout", m.offload_rollout)):
        if on:
            errors.append(f"{flag} releases the engine's memory while the trainer trains, but the embedded engine "
                          "process keeps its memory (it has no release/resume): drop "
                          f"{flag}, or use --embedded-engine-ranks all or driver")
    return errors


def _sglang_launch_knob_errors(cfg: Config, why: str, starts: str, *, sizes: bool = True) -> list[str]:
    """Flags that size, place or configure SGLang engines we launch: with no launch they would do nothing."""
    r = cfg.rollout
    errors = []
    one = " (one engine, no tensor parallelism)" if r.rollout_backend == "embedded" else ""
    if sizes and r.rollout_num_gpus is not None:
        errors.append(f"--rollout-num-gpus {r.rollout_num_gpus} places SGLang engines on their own GPUs; "
                      f"{why}: drop --rollout-num-gpus")
    if sizes and r.rollout_num_gpus_per_engine != 1:
        errors.append(f"--rollout-num-gpus-per-engine {r.rollout_num_gpus_per_engine} sizes SGLang engines; "
                      f"{why}{one}: drop it")
    if r.rollout_router != "off":
        errors.append(f"--rollout-router {r.rollout_router} puts an sglang-router in front of the SGLang engines this "
                      f"run launches; {starts}: drop it" + (" (a router of yours is found by its URL: give its "
                                                             "address as --rollout-engine-urls)"
                                                             if r.rollout_engine_urls else ""))
    passed = sorted(set(r.sglang_args) - set(SLIME_ROUTER_ARGS))  # the router's own: _router_flag_errors
    if passed:
        keys = " ".join(f"--sglang-{k.replace('_', '-')}" for k in passed)
        errors.append(f"{keys}: pass-through arguments of SGLang servers; {starts}: drop them"
                      + (" (or use --rollout-backend sglang, which launches SGLang engines)"
                         if r.rollout_backend == "embedded" else ""))
    return errors


#: slime's flags for an sglang-router it did not start (slime launches one otherwise)
SLIME_ROUTER_ARGS = ("router_ip", "router_port")


def _router_flag_errors(cfg: Config) -> list[str]:
    """slime's ``--sglang-router-ip/--sglang-router-port`` would reach SGLang's launcher verbatim (which
    has no such flags): say where a running router goes here instead."""
    r = cfg.rollout
    given = [k for k in SLIME_ROUTER_ARGS if k in r.sglang_args]
    if not given:
        return []
    ip, port = r.sglang_args.get("router_ip", "IP"), r.sglang_args.get("router_port", "PORT")
    keys = " ".join(f"--sglang-{k.replace('_', '-')}" for k in given)
    return [f"{keys} (slime's running sglang-router): give the router as --rollout-engine-urls http://{ip}:{port} "
            "instead (generation goes through it, weights to the workers it lists; docs/sglang.md); this run "
            "launches no router of its own"]


#: SGLang arguments the launcher sets from the plan (rollout/sglang/launcher.py): a --sglang-KEY for one of
#: them would fight the placement, so it is refused naming what sets it.
SGLANG_LAUNCHER_OWNED_ARGS = {
    "model_path": "--hf-checkpoint", "host": "the launcher (loopback, or all interfaces across nodes)",
    "port": "the launcher (a free port per engine)", "nccl_port": "the launcher (a free port per engine)",
    "tp_size": "--rollout-num-gpus-per-engine", "base_gpu_id": "the placement (CUDA_VISIBLE_DEVICES per engine)",
    "nnodes": "the placement (an engine launched here runs on one node)",
    "node_rank": "the placement (an engine launched here runs on one node)",
}


def _launched_sglang_errors(cfg: Config) -> list[str]:
    """``--rollout-backend sglang`` without URLs: this run launches the engines (rollout/sglang/launcher.py)."""
    r, s = cfg.rollout, cfg.sync
    errors = []
    if not cfg.model.hf_checkpoint:
        errors.append("--rollout-backend sglang launches SGLang engines on --hf-checkpoint's HF model: give "
                      "--hf-checkpoint DIR (or --rollout-engine-urls of servers you started)")
    errors.extend(_router_flag_errors(cfg))
    for key in sorted(set(r.sglang_args) & set(SGLANG_LAUNCHER_OWNED_ARGS)):
        errors.append(f"--sglang-{key.replace('_', '-')}: set by {SGLANG_LAUNCHER_OWNED_ARGS[key]} for each engine "
                      "this run launches; drop it")
    try:
        placement = plan_engine_placement(
            num_gpus=r.rollout_num_gpus if r.rollout_num_gpus is not None else cfg.actor_world_size,
            gpus_per_engine=r.rollout_num_gpus_per_engine, colocate=cfg.memory.colocate,
            num_nodes=cfg.placement.actor_num_nodes, gpus_per_node=cfg.placement.actor_num_gpus_per_node,
            devices_per_node=None)
        if placement.spans_nodes and r.use_fault_tolerance:
            errors.append(f"--use-fault-tolerance with engines of --rollout-num-gpus-per-engine "
                          f"{r.rollout_num_gpus_per_engine}, more than a node's {cfg.placement.actor_num_gpus_per_node}: "
                          "restarting an engine that spans nodes needs every node's part restarted together, which "
                          "this version does not build; drop --use-fault-tolerance (a dead engine then stops the run "
                          "naming it) or use engines within a node")
    except ConfigError as exc:
        errors.append(str(exc))
    on_cpu = str(r.sglang_args.get("device", "")).lower() == "cpu"
    if s.check_weight_update_equal and on_cpu:
        errors.append("--check-weight-update-equal with --sglang-device cpu: SGLang compares the first update inside "
                      "the server (/weights_checker), and its compare moves tensors to CUDA (SGLang 0.5.23), so on "
                      "CPU engines nothing could be compared: drop the flag")
    if s.update_weight_transport == "distributed" and cfg.memory.colocate and not on_cpu:
        errors.append("--update-weight-transport distributed with --colocate: NCCL cannot join two processes on the "
                      "same GPU (the trainer rank and its colocated engine), so the broadcast would fail or hang; "
                      "use --update-weight-transport tensor (the colocated route) or disk")
    if not errors and not cfg.mode.dry_run:
        python = r.rollout_engine_python or sys.executable
        why = _engine_python_problem(python)
        flag = "--rollout-engine-python" if r.rollout_engine_python else "this interpreter"
        if why:
            errors.append(f"--rollout-backend sglang launches python -m sglang.launch_server with {flag}, but {why}: "
                          "install SGLang there, or point --rollout-engine-python at an interpreter that has it")
        router = _engine_python_problem(python, package="sglang_router") if r.rollout_router == "on" else None
        if router:
            errors.append(f"--rollout-router on launches python -m sglang_router.launch_router with {flag}, but "
                          f"{router}: pip install sglang-router there, or drop --rollout-router on")
    return errors


def _engine_python_problem(python: str, timeout_s: float = 30.0, package: str = "sglang") -> Optional[str]:
    """None if ``python`` finds ``package`` (not imported: sglang takes ~25 s), else why not."""
    try:
        proc = subprocess.run([python, "-c", "import importlib.util, sys; "
                               f"sys.exit(0 if importlib.util.find_spec({package!r}) else 3)"],
                              capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run ({exc})"
    if proc.returncode == 3:
        return f"{python} has no {package} package"
    if proc.returncode:
        return f"{python} failed: {proc.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _external_sglang_errors(cfg: Config) -> list[str]:
    """``--rollout-backend sglang --rollout-engine-urls ...``: servers the user started; we only talk HTTP."""
    r, s, m = cfg.rollout, cfg.sync, cfg.memory
    errors = []
    bad = [u for u in r.rollout_engine_urls
           if not (url_match := _URL.match(u)) or not 0 < int(url_match.group(2)) < 65536]
    for url in bad:
        errors.append(f"--rollout-engine-urls {url}: not a server address; write http://host:port, "
                      "https://host:port or host:port (e.g. 10.0.0.5:30000), one per server")
    dup = sorted({u for u in r.rollout_engine_urls if r.rollout_engine_urls.count(u) > 1})
    if dup:
        errors.append(f"--rollout-engine-urls lists {', '.join(dup)} more than once; list each server once")
    if s.update_weight_transport == "tensor":
        errors.append(NotBuilt(f"--update-weight-transport tensor with --rollout-engine-urls: the tensor transport "
                               f"into SGLang servers this run did not start is {_NOT_YET}; use "
                               "--update-weight-transport disk --update-weight-disk-dir DIR"))
    external = "the servers of --rollout-engine-urls run where you started them; this run does not place them"
    for flag, on in (("--colocate", m.colocate), ("--offload-train", m.offload_train),
                     ("--offload-rollout", m.offload_rollout)):
        if on:
            errors.append(NotBuilt(f"{flag} with --rollout-engine-urls: {external}, so there are no shared GPUs "
                                   f"to hand over (releasing external servers' memory is {_NOT_YET}): "
                                   f"drop {flag}"))
    allocation = cfg.placement.allocation
    placed = bool(allocation and "sglang" in allocation)
    if placed:  # the allocation set --rollout-num-gpus(-per-engine): name it, not the flags it set
        errors.append(f"--allocation {cfg.placement.allocation} places SGLang engines on GPUs; with "
                      f"--rollout-engine-urls {external}: state only the trainer (e.g. megatron:d2)")
    errors.extend(_router_flag_errors(cfg))
    errors.extend(_sglang_launch_knob_errors(cfg, external, "this run starts none", sizes=not placed))
    return errors
