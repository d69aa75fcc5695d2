"""Where the SGLang engines a run launches go: one ``EngineSlot`` per engine, decided from the flags alone.

In ``plan`` (standard library only) so validation checks a placement before any worker starts;
``rollout.sglang.launcher`` starts the engines it places.

Why a plan before any process starts: every rank must agree on it (the node's local rank 0
launches that node's engines, the tensor transport sends each engine's weights from the
trainer ranks on its devices, ``--dry-run`` prints it), so it is a pure function of the
config and the world, computed the same way everywhere; only the URLs (free ports) are
filled in by the launching rank and shared.

The rules (a torchrun job only owns the nodes its ranks run on):

* **colocated** (``--colocate``): ``--rollout-num-gpus`` (default: the actor's world) devices
  of the trainer, split into engines of ``--rollout-num-gpus-per-engine``; engine ``i``
  takes global devices ``[i*g, (i+1)*g)``, i.e. the devices of trainer ranks
  ``i*g .. (i+1)*g - 1`` (rank ``r`` uses its node's device ``r % gpus_per_node``).
* **separate**: engines on the devices the trainer leaves free on its own nodes, node by
  node: node ``n`` offers devices ``[gpus_per_node, devices_per_node)``. On a CPU-only
  machine there are no devices to count: engines are plain processes, spread over the
  nodes round robin.
* **an engine bigger than a node** (``g`` above what a node offers: its trainer devices when
  colocated, its free devices when separate) takes whole nodes, consecutive ones: ``g`` must
  be a multiple of what one node offers. SGLang runs it as one process per node (``--nnodes``,
  ``--node-rank``, ``--dist-init-addr`` of the first node's); the first node's serves HTTP and
  is the engine's URL, the others only a health endpoint (SGLang 0.5.23's
  ``launch_dummy_health_check_server``). ``EngineSlot.span`` lists its nodes, head first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from megatron_rl.errors import ConfigError

__all__ = ["EngineSlot", "EnginePlacement", "plan_engine_placement"]


@dataclass(frozen=True)
class EngineSlot:
    """One SGLang engine: where it runs and how to reach it."""

    index: int                      # engine 0..N-1
    url: str                        # http://host:port ("" until the launching rank picked a port)
    node_rank: int
    gpu_ids: tuple[int, ...]        # node-local device ids; () on a CPU-only machine
    trainer_ranks: tuple[int, ...]  # colocated: global trainer ranks sharing its devices, in engine-TP-rank order
    log_path: str = ""
    span: tuple[int, ...] = ()      # an engine bigger than a node: its nodes, head (node_rank) first; () for one

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node ranks this engine runs on, head first (``gpu_ids`` are each one's local devices)."""
        return self.span or (self.node_rank,)

    def describe(self) -> str:
        """What an error about this engine says, so the reader can find its process and log."""
        where = f"GPUs {','.join(map(str, self.gpu_ids))}" if self.gpu_ids else "CPU"
        if self.span:
            where = f"{where} on each" if self.gpu_ids else where
        log = f", log {self.log_path}" if self.log_path else ""
        node = f"nodes {','.join(map(str, self.span))}" if self.span else f"node {self.node_rank}"
        return f"SGLang engine {self.index} ({self.url or 'not started'}, {node}, {where}{log})"


@dataclass(frozen=True)
class EnginePlacement:
    """Every engine of the run, in engine order."""

    engines: tuple[EngineSlot, ...]
    colocated: bool
    router_url: Optional[str] = None  # the sglang-router this run launched in front of the engines, if any

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def on_node(self, node_rank: int) -> list[EngineSlot]:
        """The engines headed on ``node_rank`` (their URL is there)."""
        return [e for e in self.engines if e.node_rank == node_rank]

    def parts_on_node(self, node_rank: int) -> list[tuple[EngineSlot, int]]:
        """``(engine, part)`` for every engine process ``node_rank`` runs: part ``j`` is the engine's
        ``--node-rank j`` (0: the head, serving HTTP)."""
        return [(e, e.nodes.index(node_rank)) for e in self.engines if node_rank in e.nodes]

    @property
    def spans_nodes(self) -> bool:
        return any(e.span for e in self.engines)

    def engine_of_rank(self, rank: int) -> Optional[EngineSlot]:
        """The engine sharing trainer ``rank``'s device (colocated), else None."""
        return next((e for e in self.engines if rank in e.trainer_ranks), None)

    def with_urls(self, urls: Sequence[str], log_paths: Sequence[str]) -> "EnginePlacement":
        return replace(self, engines=tuple(replace(e, url=u, log_path=p)
                                           for e, u, p in zip(self.engines, urls, log_paths)))

    def with_router(self, url: Optional[str]) -> "EnginePlacement":
        return replace(self, router_url=url)

    def notes(self) -> dict[str, str]:
        """url -> ``describe()``: what the engine's client adds to an error naming a server."""
        return {e.url: e.describe() for e in self.engines}


def plan_engine_placement(*, num_gpus: int, gpus_per_engine: int, colocate: bool, num_nodes: int,
                          gpus_per_node: int, devices_per_node: Optional[int]) -> EnginePlacement:
    """The placement rule of the module docstring. ``devices_per_node`` is None on a CPU-only
    machine (engines are processes, not devices). Raises ``ConfigError`` naming the flag to change."""
    g = gpus_per_engine
    if num_gpus <= 0 or g <= 0 or num_gpus % g:
        raise ConfigError(f"--rollout-num-gpus {num_gpus} must be a positive multiple of "
                          f"--rollout-num-gpus-per-engine {g}")
    count = num_gpus // g
    world = num_nodes * gpus_per_node
    if colocate:
        if num_gpus > world:
            raise ConfigError(f"--colocate with --rollout-num-gpus {num_gpus}: colocated engines use the trainer's "
                              f"devices, and the trainer has {world} ({num_nodes} node(s) x {gpus_per_node}); "
                              f"give at most {world}")
        if (g < gpus_per_node and gpus_per_node % g) or (g > gpus_per_node and g % gpus_per_node):
            raise ConfigError(f"--rollout-num-gpus-per-engine {g} with {gpus_per_node} trainer device(s) per node: "
                              "a node's devices must split into whole engines, or an engine take whole nodes; use a "
                              f"divisor or a multiple of {gpus_per_node}")
        slots = []
        for i in range(count):
            ranks = tuple(range(i * g, (i + 1) * g))
            nodes = tuple(sorted({r // gpus_per_node for r in ranks}))
            gpus = tuple(sorted({r % gpus_per_node for r in ranks})) if devices_per_node is not None else ()
            slots.append(EngineSlot(i, "", nodes[0], gpus, ranks, span=nodes if len(nodes) > 1 else ()))
        return EnginePlacement(tuple(slots), colocated=True)
    if devices_per_node is None:  # CPU-only: engines are processes; spread them over the nodes
        return EnginePlacement(tuple(EngineSlot(i, "", i % num_nodes, (), ()) for i in range(count)),
                               colocated=False)
    free = devices_per_node - gpus_per_node
    if free > 0 and g > free:
        return _separate_spanning(count, g, free, num_nodes, gpus_per_node, devices_per_node)
    per_node = max(free, 0) // g
    if per_node * num_nodes < count:
        raise ConfigError(
            f"--rollout-num-gpus {num_gpus} (engines of {g}) needs {count} engine(s) on the GPUs the trainer leaves "
            f"free, but its {num_nodes} node(s) have {max(free, 0)} free GPU(s) each ({devices_per_node} visible, "
            f"--actor-num-gpus-per-node {gpus_per_node}), room for {per_node * num_nodes}: this run can only launch "
            "engines on its own nodes. Use --colocate, fewer --rollout-num-gpus, or start SGLang yourself on other "
            "nodes and give --rollout-engine-urls")
    slots = []
    for i in range(count):
        node, k = divmod(i, per_node)
        slots.append(EngineSlot(i, "", node, tuple(range(gpus_per_node + k * g, gpus_per_node + (k + 1) * g)), ()))
    return EnginePlacement(tuple(slots), colocated=False)


def _separate_spanning(count: int, g: int, free: int, num_nodes: int, gpus_per_node: int,
                       devices_per_node: int) -> EnginePlacement:
    """Separate engines bigger than a node's free devices: each takes the free devices of ``g / free``
    consecutive nodes."""
    if g % free:
        raise ConfigError(f"--rollout-num-gpus-per-engine {g} is more than the {free} GPU(s) each node leaves free "
                          f"({devices_per_node} visible, --actor-num-gpus-per-node {gpus_per_node}), so an engine "
                          f"takes whole nodes' free GPUs: use a multiple of {free}")
    per_engine = g // free
    if count * per_engine > num_nodes:
        raise ConfigError(f"--rollout-num-gpus {count * g} (engines of {g}) needs {count * per_engine} node(s) of "
                          f"{free} free GPU(s), and this run has {num_nodes}: this run can only launch engines on its "
                          "own nodes. Use fewer --rollout-num-gpus, or start SGLang yourself and give "
                          "--rollout-engine-urls")
    gpus = tuple(range(gpus_per_node, devices_per_node))
    return EnginePlacement(tuple(EngineSlot(i, "", i * per_engine, gpus, (),
                                            span=tuple(range(i * per_engine, (i + 1) * per_engine)))
                                 for i in range(count)), colocated=False)
