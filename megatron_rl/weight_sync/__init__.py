"""Trainer -> rollout-engine weight synchronisation, one module per transport.

``in_process`` (tensor: the embedded engine in the driver's process), ``sglang_tensor`` (tensor:
flattened buckets handed by CUDA IPC / shared memory to SGLang engines the run launched on the
trainer's devices), ``disk`` (versioned safetensors dirs any engine loads), ``distributed`` (a
gloo/NCCL process group with SGLang servers, ``update_group`` holding the trainer's end of it).
``make_synchronizer_from_config`` picks by ``--update-weight-transport`` and ``--rollout-backend``
(``base.TRANSPORTS``, overridden per engine by ``base.ENGINE_TRANSPORTS``).

Invariants every transport keeps (see ``base.WeightSynchronizer``):
* A sync is collective over the training world (every rank iterates the
  backend's export) and the engine adopts the new ``weight_version`` only after
  every tensor of the update arrived (the engine's own invariant).
* A bucket (and a disk shard) never splits tensors the engine loads together (q/k/v, gate/up, MLA's
  down-projections: ``models.fused_loads``, applied by ``backends.base.bucketed``), whatever
  ``--update-weight-buffer-size``; the export sends parameters and persistent buffers alike.
* Versions only move forward; ``weight_version`` on each sample says which
  weights produced it.
* ``check_equal`` (``--check-weight-update-equal``): with the embedded engine,
  every engine tensor is compared with the trainer's exported tensor bit for bit
  after every sync (``base.check_engine_equals``), and a ``SyncError`` names the
  ones that differ. With SGLang engines the servers compare, once: the update to
  version 0 against their own load of the checkpoint (``/weights_checker``
  snapshot/compare, a GPU-only compare in SGLang 0.5.23); later updates are not
  compared.
* ``--update-weight-mode delta`` / ``--update-weight-verify checksum`` (``delta.EngineUpdates``, the
  embedded engine in the trainer's processes, transports ``tensor`` and ``disk``): only the changed bits,
  against the version the engine holds (a full sync otherwise), and every tensor's checksum compared
  after the update.
"""

from megatron_rl.weight_sync.base import (
    ENGINE_TRANSPORTS,
    TRANSPORTS,
    WeightSynchronizer,
    make_synchronizer,
    make_synchronizer_from_config,
    register_transport,
    transport_class,
)

__all__ = ["ENGINE_TRANSPORTS", "TRANSPORTS", "WeightSynchronizer", "make_synchronizer",
           "make_synchronizer_from_config", "register_transport", "transport_class"]
