"""CPU/gloo compatibility layer for real megatron-core (0.16.x).

The training backend runs megatron-core itself, never a re-implementation. On a
CPU-only host megatron-core assumes CUDA in many places; this package closes that
gap with labelled patches (:mod:`megatron_rl.compat.patches`) and, where a config
flag suffices, with :func:`cpu_config_overrides`.

Seams (used by ``models/parallel.py`` and the rest of ``models/``):

* :func:`apply_cpu_compat` - idempotent; call before building megatron modules.
  A no-op on a CUDA host (also the no-TE gaps are handled via
  :func:`apply_no_te_compat`, which it calls). Returns ``{patch_name: outcome}``.
* :func:`cpu_config_overrides` - ``TransformerConfig`` fields that must be set on
  CPU (fusions off, CPU init, ``batch_p2p_comm=False`` because interleaved PP
  under gloo gives wrong numbers with batched p2p). Empty dict on a CUDA host.
* :func:`have_transformer_engine` - whether the TE layer spec can be used.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.compat import megatron_import as _megatron_import
from megatron_rl.compat import patches as _patches

_megatron_import.install()  # the first `import megatron.core` skips wandb and, on CPU, dynamo

_APPLIED: dict[str, str] = {}


def is_cpu_host() -> bool:
    """True when megatron must run on CPU (no usable CUDA device)."""
    return not torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def have_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising at import
        return False
    return True


def apply_no_te_compat() -> dict[str, str]:
    """Patch 0.16.1 gaps that hit any host (``ANY_HOST_PATCHES``) and hosts without transformer-engine."""
    _patches.run_patches(_patches.ANY_HOST_PATCHES, _APPLIED)
    if have_transformer_engine():
        return dict(_APPLIED)
    _patches.run_patches(_patches.NO_TE_PATCHES, _APPLIED)
    return dict(_APPLIED)


def apply_cpu_compat() -> dict[str, str]:
    """Make megatron-core runnable on this host; safe to call any number of times.

    On a CUDA host this changes nothing except the correctness gaps of
    ``ANY_HOST_PATCHES`` and the no-TE gaps (when TE is missing). On CPU it also
    applies the speed-only ``patches.CPU_SPEED_PATCHES``, imports the megatron
    modules we execute and applies every patch in ``patches.CPU_PATCHES``;
    calling again after importing further megatron modules extends the
    module-level patches to them.
    """
    apply_no_te_compat()
    if not is_cpu_host():
        return dict(_APPLIED)
    _patches.run_patches(_patches.CPU_SPEED_PATCHES, _APPLIED)
    _patches.import_megatron_modules()
    _patches.run_patches(_patches.CPU_PATCHES, _APPLIED)
    return dict(_APPLIED)


def applied_patches() -> dict[str, str]:
    """Outcome of every patch run so far in this process."""
    return dict(_APPLIED)


def cpu_config_overrides() -> dict:
    """``TransformerConfig`` / ``ModelParallelConfig`` values required on CPU.

    Configuration instead of patches: each flag turns off a CUDA-only fused path.
    ``batch_p2p_comm=False``: with gloo, batched isend/irecv in interleaved PP
    mis-orders messages (wrong numbers, no error).
    """
    if not is_cpu_host():
        return {}
    return dict(
        use_cpu_initialization=True,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_grouped_gemm=False,
        batch_p2p_comm=False,
        overlap_p2p_comm=False,
        deallocate_pipeline_outputs=False,
    )


__all__ = ["apply_cpu_compat", "apply_no_te_compat", "applied_patches", "cpu_config_overrides",
           "have_transformer_engine", "is_cpu_host"]
