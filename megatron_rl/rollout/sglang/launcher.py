"""Start the run's SGLang engines (``python -m sglang.launch_server``), wait until they serve, stop them.

Who starts what: the placement (``placement.plan_engine_placement``) is computed from the flags
on every rank; local rank 0 of each node starts that node's engines, each in its own process
group with its own log file (``<--output-dir>/engines/engine_<i>.log``), on free ports it
picks; every rank then learns every engine's URL (one ``all_gather_object``). Each node's
launcher waits for its own engines: ``GET /health`` answering 200 while the process lives, an
overall ``--rollout-engine-startup-timeout``; an engine whose process exits, or that is not up in
time, is an ``EngineError`` naming the engine, its command's exit code and its log file with the
last lines, raised on every rank (an agreement collective, so no rank waits for one that gave up).

Stopping: ``EngineFleet.stop()`` (the loop's ``finally``) sends SIGTERM to each engine's process
group and SIGKILL after a grace period; an ``atexit`` hook does the same if the process exits
another way, and on Linux each engine gets ``PR_SET_PDEATHSIG`` so it dies with its launching
process even under SIGKILL (SGLang's own children watch their parent).

The command line: ``--model-path`` (``--hf-checkpoint``), ``--host``/``--port`` (loopback on one
node, all interfaces when the run spans nodes), ``--tp-size`` (``--rollout-num-gpus-per-engine``),
``--nccl-port`` (a second free port: two engines starting on one node must not pick the same
one), ``--base-gpu-id 0`` with ``CUDA_VISIBLE_DEVICES`` narrowed to the engine's GPUs,
``--enable-memory-saver`` when colocated on GPUs (release/resume need it; SGLang then needs
torch_memory_saver), then every ``--sglang-KEY VALUE`` verbatim. The environment is this process's minus torchrun's variables (SGLang reads ``RANK``/
``WORLD_SIZE`` itself).

An engine bigger than a node (``EngineSlot.span``): each of its nodes' local rank 0 starts one
process, ``--nnodes K --node-rank j --dist-init-addr HEAD:PORT`` (the head node picks the port
and its address, shared with one all_gather before anything starts; SGLang's schedulers meet
there through torch's TCP store) in place of ``--nccl-port``. The head (node rank 0) serves HTTP
and is the engine's URL; the other parts serve only ``/health`` on their own port (what the
launcher waits on), and SGLang ignores their SIGTERM (the head's shutdown stops them; the grace
period's SIGKILL is the backstop). Restarting such an engine alone is not built
(``--use-fault-tolerance`` is refused with it).

The router (``--rollout-router on``; validation checks the engines' Python has ``sglang_router``):
once every engine serves, the driver's launcher starts ``python -m sglang_router.launch_router``
over all engine URLs (its default cache-aware policy, a free port and Prometheus port, log
``<--output-dir>/engines/router.log``), waits until its ``GET /workers`` lists every engine
healthy, and every rank learns its URL (``EnginePlacement.router_url``): generation goes
through it, everything else to the engines. It stops first, with the engines.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Generic, Optional, Protocol, TypeVar

import httpx

from megatron_rl.config.rollout_rules import SGLANG_LAUNCHER_OWNED_ARGS  # noqa: F401 - the args set here
from megatron_rl.errors import EngineError
from megatron_rl.infra.ports import address_in_use, free_port
from megatron_rl.plan.engines import EnginePlacement, EngineSlot, plan_engine_placement

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config

__all__ = ["EngineFleet", "EngineProcess", "engine_command", "launch_engines", "placement_for_config",
           "SGLANG_LAUNCHER_OWNED_ARGS"]

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 3  # starts of the engines (or the router) when another process took a port first

# torchrun's variables: an engine is not a rank of the training job
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _node_address() -> str:
    """This node's address as the other nodes reach it: the interface that routes to MASTER_ADDR."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # UDP: sends nothing
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _pass_through_args(sglang_args: dict) -> list[str]:
    """``{KEY: VALUE}`` of the ``--sglang-KEY`` flags as SGLang's command line: True -> a bare flag,
    a list -> several values, False/None -> left out (YAML configs can say false)."""
    out: list[str] = []
    for key, value in sglang_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out.extend([flag, *map(str, value)])
        else:
            out.extend([flag, str(value)])
    return out


def sglang_speculative_args(rollout: Any) -> list[str]:
    """SGLang's command-line arguments for the ``--speculative-*`` flags (empty without them): SGLang's own names,
    so a launched server drafts with the checkpoint's MTP / NEXTN head."""
    if rollout.speculative_algorithm is None:
        return []
    steps = rollout.speculative_num_steps
    draft_tokens = rollout.speculative_num_draft_tokens or steps + 1
    return ["--speculative-algorithm", rollout.speculative_algorithm, "--speculative-num-steps", str(steps),
            "--speculative-eagle-topk", str(rollout.speculative_eagle_topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]


def engine_command(cfg: "Config", slot: EngineSlot, *, python: str, host: str, port: int,
                   nccl_port: int, part: int = 0, dist_init_addr: Optional[str] = None) -> list[str]:
    """The ``sglang.launch_server`` command line of ``slot`` (see the module docstring); for an engine
    spanning nodes, of its ``part`` (its ``--node-rank``), meeting the others at ``dist_init_addr``."""
    r = cfg.rollout
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(cfg.model.hf_checkpoint),
           "--host", host, "--port", str(port)]
    if slot.span:
        cmd += ["--nnodes", str(len(slot.span)), "--node-rank", str(part), "--dist-init-addr", str(dist_init_addr)]
    else:
        cmd += ["--nccl-port", str(nccl_port)]
    cmd += ["--tp-size", str(r.rollout_num_gpus_per_engine)]
    if slot.gpu_ids:
        cmd += ["--base-gpu-id", "0"]  # CUDA_VISIBLE_DEVICES holds exactly this engine's GPUs
    on_cpu = str(r.sglang_args.get("device", "")).lower() == "cpu"  # SGLang on CPU cannot release memory
    if cfg.memory.colocate and not on_cpu and "enable_memory_saver" not in r.sglang_args:
        cmd.append("--enable-memory-saver")  # colocated engines release/resume their memory around training
    if cfg.megatron.use_rollout_routing_replay and "enable_return_routed_experts" not in r.sglang_args:
        cmd.append("--enable-return-routed-experts")  # R3: requests then ask for each token's experts
    if cfg.data.multimodal_keys is not None and "mm_preprocess_cache_size_mb" not in r.sglang_args:
        # prompts with images: SGLang's Qwen-VL processor then expands the image-pad tokens of the ids as sent;
        # without its preprocess cache it decodes the ids and looks for the image slot's text (docs/vlm.md)
        cmd += ["--mm-preprocess-cache-size-mb", str(MM_PREPROCESS_CACHE_MB)]
    return cmd + lora_server_args(cfg) + sglang_speculative_args(r) + _pass_through_args(r.sglang_args)


#: what a launched engine serving prompts with images gets for --mm-preprocess-cache-size-mb (processed images kept
#: for a group's repeated rows)
MM_PREPROCESS_CACHE_MB = 256


def lora_server_args(cfg: "Config") -> list[str]:
    """``--lora-sync adapter``: the server serves the run's adapters (``/load_lora_adapter``; requests name one):
    ``--enable-lora``, the run's rank and target modules (``all-linear`` is SGLang's ``all``), unless
    ``--sglang-*`` pass-through flags set them."""
    lo, given = cfg.lora, cfg.rollout.sglang_args
    if not (lo.lora_rank and lo.lora_sync == "adapter"):
        return []
    out = [] if "enable_lora" in given else ["--enable-lora"]
    if "max_lora_rank" not in given:
        out += ["--max-lora-rank", str(lo.lora_rank)]
    if "lora_target_modules" not in given:
        targets = sorted({t.rsplit(".", 1)[-1] for t in lo.lora_target_modules})
        out += ["--lora-target-modules", *(["all"] if "all-linear" in targets else targets)]
    return out


def _engine_env(slot: EngineSlot, python: str, images: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    if images:
        # SGLang 0.5.23 keeps each image's vision-tower output by the image's hash (SGLANG_VLM_CACHE_SIZE_MB, 100 by
        # default) and no weight update or /flush_cache clears it: after a sync of the tower, an image seen before
        # would keep the old tower's features (measured: tools/sglang_cpu/check_vlm_real.py). 0 caches nothing.
        env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    if os.path.realpath(python) != os.path.realpath(sys.executable):
        env.pop("VIRTUAL_ENV", None)  # another venv's interpreter: do not claim ours
    if slot.gpu_ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x.strip() for x in visible.split(",")] if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[g] if ids else str(g) for g in slot.gpu_ids)
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes  # lazy: Linux-only, in the forked child

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Slot(Protocol):
    """What ``EngineProcess`` needs of where a process serves: an engine's slot, the router's, or any other."""

    @property
    def url(self) -> str: ...

    def describe(self) -> str: ...


_SlotT = TypeVar("_SlotT", bound=Slot)  # an engine's slot, the router's, or another server's (embedded_process)


class EngineProcess(Generic[_SlotT]):
    """One ``sglang.launch_server`` process (and its children, in its own process group)."""

    def __init__(self, slot: _SlotT, cmd: list[str], env: dict[str, str], log_path: str, *, part: int = 0,
                 health_url: str = ""):
        self.slot, self.cmd, self.env, self.log_path = slot, cmd, env, log_path
        self.part = part  # an engine spanning nodes: this process's --node-rank (0: the head, serving HTTP)
        self._health_url = health_url
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self._log_from = 0  # where this start's lines begin in the (appended) log

    @property
    def url(self) -> str:
        """The engine's URL (its head's, for an engine spanning nodes)."""
        return self.slot.url

    @property
    def health_url(self) -> str:
        """Where this process answers ``/health``: the engine's URL, or a non-head part's own port."""
        return self._health_url if self.part else self.slot.url

    def describe(self) -> str:
        span = getattr(self.slot, "span", ())
        if not span:  # an engine within a node, or the router (RouterSlot)
            return self.slot.describe()
        return f"{self.slot.describe()}: its node-rank {self.part} part on node {span[self.part]}"

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        with open(self.log_path, "ab") as fh:
            self._log_from = fh.tell()
            fh.write(("$ " + " ".join(self.cmd) + "\n").encode())
            fh.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.info("started %s: pid %d", self.describe(), self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` of the log written since the latest start (an earlier start's words, such
        as a port it found taken, are not this one's)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(self._log_from, fh.tell() - 64 * 1024))
                text = fh.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def death_message(self, when: str, lines: int = 20) -> str:
        code = self.returncode
        how = f"exited with code {code}" if code is not None and code >= 0 else f"was killed by signal {-code}" \
            if code is not None else "is not running"
        return (f"{self.describe()} {how} {when}. Last lines of {self.log_path}:\n"
                + self.log_tail(lines))

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s`` (SGLang's scheduler and
        detokenizer children too)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            if pgid is not None:
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=wait_s)
                if sig == signal.SIGTERM and pgid is not None:
                    continue  # the launcher exited; SIGKILL whatever of its group outlived it
                break
            except subprocess.TimeoutExpired:
                continue


def _ready(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url + "/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


class RouterSlot:
    """What the router's process says about itself (an ``EngineProcess`` runs it)."""

    def __init__(self, url: str, log_path: str):
        self.url, self.log_path = url, log_path

    def describe(self) -> str:
        return f"sglang-router ({self.url}, log {self.log_path})"


def router_command(python: str, *, host: str, port: int, prometheus_port: int, worker_urls: list[str]) -> list[str]:
    return [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port), "--worker-urls", *worker_urls,
            "--log-level", "warn"]


def _router_ready(client: httpx.Client, url: str, workers: list[str]) -> bool:
    try:
        listed = client.get(url + "/workers", timeout=5.0).json().get("workers", [])
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    healthy = {w.get("url") for w in listed if isinstance(w, dict) and w.get("is_healthy")}
    return set(workers) <= healthy


class EngineFleet:
    """The run's engines: the placement every rank knows, and the processes this node started
    (and on the driver's node the router, when there is one)."""

    def __init__(self, placement: EnginePlacement, local: list[EngineProcess], startup_timeout_s: float):
        self.placement = placement
        self.local = local
        self.startup_timeout_s = startup_timeout_s
        self.router: Optional[EngineProcess[RouterSlot]] = None
        self._stopped = False
        atexit.register(self.stop)

    def start_router(self, python: str, *, bind: str, reach: str, log_dir: str) -> str:
        """Start an sglang-router over every engine of the placement and wait until it lists them all
        healthy (``startup_timeout_s``); its URL. Its exit or the timeout is an ``EngineError`` naming its log."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port, prom = free_port(bind), free_port(bind)
            slot = RouterSlot(f"http://{reach}:{port}", os.path.join(log_dir, "router.log"))
            proc = EngineProcess(slot, router_command(python, host=bind, port=port, prometheus_port=prom,
                                                      worker_urls=self.placement.urls),
                                 {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}, slot.log_path)
            self.router = proc
            proc.start()
            try:
                self._wait_router(proc, "while starting")
                break
            except EngineError as exc:
                proc.stop(grace_s=5.0)
                if attempt == PORT_ATTEMPTS or not address_in_use(str(exc)):
                    raise
                log.warning("the sglang-router's port %d or %d was taken before it bound it (attempt %d of %d); "
                            "starting it on other ports", port, prom, attempt, PORT_ATTEMPTS)
        log.info("%s routes generation over %d engine(s)", slot.describe(), len(self.placement.urls))
        return slot.url

    def _wait_router(self, proc: EngineProcess, when: str) -> None:
        """Until the router lists every engine healthy (``startup_timeout_s``); its exit or the timeout is
        an ``EngineError`` naming its log."""
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client() as client:
            while not _router_ready(client, proc.url, self.placement.urls):
                if not proc.alive():
                    raise EngineError(proc.death_message(when))
                if time.monotonic() > deadline:
                    raise EngineError(f"{proc.slot.describe()} did not list the engines {self.placement.urls} as "
                                      f"healthy within --rollout-engine-startup-timeout {self.startup_timeout_s:g} s "
                                      f"{when}; last lines:\n{proc.log_tail(8)}")
                time.sleep(0.2)

    @property
    def urls(self) -> list[str]:
        return self.placement.urls

    def process_of(self, url: str) -> Optional[EngineProcess]:
        """This node's process serving ``url`` (an engine's head)."""
        return next((p for p in self.local if p.url == url and p.part == 0), None)

    def dead(self) -> list[EngineProcess]:
        """This node's engines (and router) whose process has exited."""
        return [p for p in self.local + ([self.router] if self.router else []) if not p.alive()]

    def wait_ready(self, engines: Optional[list[EngineProcess]] = None, *, when: str = "while starting") -> None:
        """Until each of ``engines`` (default: this node's) answers ``/health``; an exit or the timeout
        raises ``EngineError`` naming the engine and its log. Logs progress every 15 s."""
        pending = list(self.local if engines is None else engines)
        start = last_note = time.monotonic()
        deadline = start + self.startup_timeout_s
        with httpx.Client() as client:
            while pending:
                for p in list(pending):
                    if not p.alive():
                        raise EngineError(p.death_message(when))
                    if _ready(client, p.health_url):
                        log.info("%s is up after %.0f s", p.describe(), time.monotonic() - start)
                        pending.remove(p)
                now = time.monotonic()
                if pending and now > deadline:
                    names = "; ".join(f"{p.describe()}, last lines:\n{p.log_tail(8)}" for p in pending)
                    raise EngineError(f"{len(pending)} SGLang engine(s) did not answer /health within "
                                      f"--rollout-engine-startup-timeout {self.startup_timeout_s:g} s: {names}")
                if pending and now - last_note >= 15:
                    log.info("waiting for %d SGLang engine(s) to start (%.0f s): %s", len(pending), now - start,
                             ", ".join(p.health_url for p in pending))
                    last_note = now
                if pending:
                    time.sleep(0.5)

    def restart(self, process: EngineProcess) -> None:
        """Stop ``process`` (if anything is left of it), start it again with the same command, port and
        log file, and wait until it serves (``--use-fault-tolerance``)."""
        if getattr(process.slot, "span", ()):  # refused in validation; a programming error if reached
            raise EngineError(f"{process.describe()}: restarting an engine that spans nodes is not built")
        process.stop(grace_s=5.0)
        process.restarts += 1
        log.warning("restarting %s (restart %d)", process.slot.describe(), process.restarts)
        process.start()
        if process is self.router:  # same port: every rank already routes through its URL
            self._wait_router(process, "while restarting")
        else:
            self.wait_ready([process], when="while restarting")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.router is not None:
            self.router.stop(grace_s=5.0)
        for p in self.local:
            p.stop()


def _devices_per_node() -> Optional[int]:
    try:
        import torch  # lazy: the count of visible GPUs; placement planning itself needs no torch

        return torch.cuda.device_count() if torch.cuda.is_available() else None
    except ImportError:
        return None


def placement_for_config(cfg: "Config", devices_per_node: Any = "detect") -> EnginePlacement:
    """The engines this config launches (URLs still empty). ``devices_per_node``: GPUs per node, None
    for a CPU-only machine, "detect" to ask torch."""
    p, r = cfg.placement, cfg.rollout
    devices = _devices_per_node() if devices_per_node == "detect" else devices_per_node
    num = r.rollout_num_gpus if r.rollout_num_gpus is not None else cfg.actor_world_size
    return plan_engine_placement(num_gpus=num, gpus_per_engine=r.rollout_num_gpus_per_engine,
                                 colocate=cfg.memory.colocate, num_nodes=p.actor_num_nodes,
                                 gpus_per_node=p.actor_num_gpus_per_node, devices_per_node=devices)


def all_gather(obj: Any) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` with no process group or one rank)."""
    import torch.distributed as dist  # lazy: one process (tests, rollout-only) runs without it

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def launch_engines(cfg: "Config") -> EngineFleet:
    """Collective over the training world: start this node's engines (local rank 0), share every URL,
    wait until this node's engines serve, and agree that all did. Returns the fleet on every rank;
    on any failure every rank raises the same ``EngineError`` and every started engine is stopped.

    An engine that died because another process took its port between our choice and its bind is
    started again on other ports, all engines together (``PORT_ATTEMPTS`` in all): every rank sees the
    same gathered errors, so all take the same branch. The router, started once they all serve,
    retries its own ports (``EngineFleet.start_router``)."""
    rank = int(os.environ.get("RANK", "0"))
    for attempt in range(1, PORT_ATTEMPTS + 1):
        fleet, errors = _start_fleet(cfg)
        if not errors:
            break
        fleet.stop()
        if attempt == PORT_ATTEMPTS or not all(address_in_use(e) for e in errors):
            raise EngineError(errors[0])
        if rank == 0:
            log.warning("an engine's port was taken before it bound it (attempt %d of %d); starting "
                        "the engines again on other ports: %s", attempt, PORT_ATTEMPTS, errors[0].splitlines()[0])
    router_url = error = None
    if rank == 0 and cfg.rollout.rollout_router == "on":
        bind, reach = _addresses(cfg)
        try:
            router_url = fleet.start_router(cfg.rollout.rollout_engine_python or sys.executable, bind=bind,
                                            reach=reach, log_dir=os.path.join(cfg.runtime.output_dir, "engines"))
        except (EngineError, OSError) as exc:
            error = f"could not start the sglang-router (--rollout-router {cfg.rollout.rollout_router}): {exc}"
    gathered = all_gather((router_url, error))
    errors = [e for _, e in gathered if e]
    if errors:
        fleet.stop()
        raise EngineError(errors[0])
    fleet.placement = fleet.placement.with_router(gathered[0][0])
    if rank == 0:
        log.info("SGLang engines ready: %s", "; ".join(e.describe() for e in fleet.placement.engines))
    return fleet


def _addresses(cfg: "Config") -> tuple[str, str]:
    """Where this node's servers listen, and the address the other nodes reach them at."""
    if cfg.placement.actor_num_nodes > 1:
        return "0.0.0.0", _node_address()
    return "127.0.0.1", "127.0.0.1"


def _start_fleet(cfg: "Config") -> tuple[EngineFleet, list[str]]:
    """One try of ``launch_engines``'s engines: the fleet and the errors every rank agreed on (none: all serve)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpn = cfg.placement.actor_num_gpus_per_node
    node = rank // gpn
    placement = placement_for_config(cfg)
    python = cfg.rollout.rollout_engine_python or sys.executable
    bind, reach = _addresses(cfg)
    log_dir = os.path.join(cfg.runtime.output_dir, "engines")
    local: list[EngineProcess[EngineSlot]] = []
    error: Optional[str] = None
    # ports first (an engine spanning nodes needs its head's rendezvous address before any part starts)
    ports: dict[tuple[int, int], tuple[int, int]] = {}  # (engine, part) -> (HTTP or health port, second port)
    if local_rank == 0:
        for slot, part in placement.parts_on_node(node):
            # the second: --nccl-port, or a head's --dist-init-addr port
            ports[slot.index, part] = (free_port(bind), free_port(bind))
    heads = {index: f"{reach}:{second}" for (index, part), (_, second) in ports.items() if part == 0}
    rendezvous: dict[int, str] = {}
    if placement.spans_nodes:
        for part_heads in all_gather(heads):
            rendezvous.update(part_heads)
    if local_rank == 0:
        try:
            for slot, part in placement.parts_on_node(node):
                port, second = ports[slot.index, part]
                name = f"engine_{slot.index}" + (f"_node{part}" if part else "")
                slot = EngineSlot(slot.index, f"http://{reach}:{port}" if part == 0 else "", slot.node_rank,
                                  slot.gpu_ids, slot.trainer_ranks, os.path.join(log_dir, f"engine_{slot.index}.log"),
                                  span=slot.span)
                cmd = engine_command(cfg, slot, python=python, host=bind, port=port, nccl_port=second, part=part,
                                     dist_init_addr=rendezvous.get(slot.index))
                proc = EngineProcess(slot, cmd, _engine_env(slot, python, cfg.data.multimodal_keys is not None),
                                     os.path.join(log_dir, f"{name}.log"),
                                     part=part, health_url=f"http://{reach}:{port}")
                local.append(proc)
                proc.start()
        except OSError as exc:
            error = f"could not start SGLang engines on node {node} with {python}: {exc}"
    started = {p.slot.index: (p.slot.url, p.log_path) for p in local if p.part == 0}
    gathered = all_gather((started, error))
    fleet = EngineFleet(placement, local, cfg.rollout.rollout_engine_startup_timeout)
    errors = [e for _, e in gathered if e]
    if not errors:
        urls, logs = {}, {}
        for part, _ in gathered:
            for index, (url, path) in part.items():
                urls[index], logs[index] = url, path
        fleet.placement = placement.with_urls([urls[e.index] for e in placement.engines],
                                              [logs[e.index] for e in placement.engines])
        by_index = {slot.index: slot for slot in fleet.placement.engines}
        for p in local:
            p.slot = by_index[p.slot.index]
        try:
            fleet.wait_ready()
        except EngineError as exc:
            error = str(exc)
        errors = [e for _, e in all_gather(((), error)) if e]
    return fleet, errors
