"""Read the model of a torch.distributed.checkpoint (DCP) dir offline: full tensors, a few at a time.

An fsdp training checkpoint (``backends/fsdp/checkpoint.py``) is one DCP save of
``{"model": module state dict, "optimizer": ..., "scheduler": ..., "optimizer_steps": ...}``
in which every rank wrote its shards of each DTensor. DCP's ``.metadata`` holds each
tensor's global shape, dtype and where each chunk lives, so a single process with no
process group (``dcp.load(..., no_dist=True)``) can fill preallocated *full* tensors:
the default load planner maps every saved chunk (whatever DP size wrote it) onto the
full tensor. :func:`read_tensors` asks for a chosen set of keys only, so a converter
holds one bucket of parameters at a time; ``FileSystemReader`` reads just the byte
ranges of those chunks, and the optimizer state is never touched.
"""

from __future__ import annotations

import os
import warnings

import torch

from megatron_rl.infra.checkpoint_root import CorruptCheckpoint
from megatron_rl.models.hf_module import DCP_MODEL_KEY

TensorSpec = tuple[tuple[int, ...], torch.dtype]


def model_tensor_specs(path: str) -> dict[str, TensorSpec]:
    """Global shape and dtype of every tensor under ``"model"`` (module names, no prefix)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - a torn .metadata raises pickle/EOF/OS errors alike
        raise CorruptCheckpoint(f"{os.path.join(path, '.metadata')} is not a readable torch.distributed.checkpoint "
                                f"metadata file ({type(e).__name__}: {str(e)[:200]}); the checkpoint is damaged: "
                                "convert another iter_NNNNNNN dir") from e
    prefix = DCP_MODEL_KEY + "."
    return {key[len(prefix):]: (tuple(m.size), m.properties.dtype)
            for key, m in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def read_tensors(path: str, specs: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The full tensors ``specs`` names (module names), read from the DCP dir ``path`` in this
    process (no collectives, whether or not ``torch.distributed`` is initialised)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {DCP_MODEL_KEY: {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}}
    try:
        with warnings.catch_warnings():  # it warns that no_dist means one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        names = sorted(specs)
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise CorruptCheckpoint(f"reading {len(names)} tensor(s) ({shown}) from the DCP checkpoint {path} failed "
                                f"({type(e).__name__}: {str(e)[:300]}); its files are damaged: convert another "
                                "iter_NNNNNNN dir") from e
    return state[DCP_MODEL_KEY]

