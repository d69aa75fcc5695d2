"""A megatron-core model <-> torch_dist files: build, sharded state dict, checks, load, compare.

Shared by training (checkpoint save/load, a model-only ``--load``, ``--ref-load``) and the
converters (``tools/convert_ckpt.py``).

Why build a real ``GPTModel`` instead of writing ShardedTensors by hand from the
name maps: the torch_dist keys, global shapes, offsets, replica ids and the
``ShardedTensorFactory`` that splits a gated ``linear_fc1`` are whatever
``GPTModel.sharded_state_dict()`` of this megatron-core says they are. Reusing
it is the only way a converted checkpoint is guaranteed to ``--load`` in
training, and a training checkpoint's model part to export here. The one-process
converters build it on the ``meta`` device and stream the values
(``streaming_save`` / ``streaming_load``), so they do not hold the model.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Iterable, Iterator, Optional

import torch

from megatron_rl.compat import apply_cpu_compat
from megatron_rl.errors import CheckpointError, MegatronRLError
from megatron_rl.infra.dist import rank
from megatron_rl.models.parallel import initialize_parallel
from megatron_rl.models.finite import non_finite_names

MODEL_KEY_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.", "vision.")
_shimmed_at = -1  # len(sys.modules) when dist_checkpointing() last extended the CPU shim to every loaded module


def setup(layout) -> None:
    """``initialize_parallel(layout)`` (gloo on CPU; one process needs no torchrun)."""
    initialize_parallel(layout)


def dist_checkpointing():
    """``megatron.core.dist_checkpointing`` with the CPU shim extended to its lazily imported strategies.

    Why: the CPU compat layer rebinds ``torch`` only in megatron modules already
    imported; the torch_dist writer (``filesystem_async``: ``torch.cuda.synchronize``)
    is imported on first save, after the shim was applied. Re-applying after
    importing them is a no-op on a CUDA host. When no module was imported since the
    last call nothing new can need it (a conversion calls this several times; each
    application scans every loaded module, ~5 ms).
    """
    global _shimmed_at
    from megatron.core import dist_checkpointing as dc

    if _shimmed_at == len(sys.modules):
        return dc
    import importlib
    import pkgutil

    from megatron.core.dist_checkpointing import strategies

    for info in pkgutil.iter_modules(strategies.__path__):
        try:
            importlib.import_module(f"{strategies.__name__}.{info.name}")
        except ImportError:  # optional backends (zarr, msc) absent here
            pass
    apply_cpu_compat()
    _in_process_write_results_queue()
    _shimmed_at = len(sys.modules)
    return dc


def _in_process_write_results_queue() -> None:
    """Give megatron's torch_dist writer a results queue without a server process.

    Why: ``filesystem_async._get_write_results_queue`` starts a ``multiprocessing``
    Manager (a spawned server process, kept for the life of the worker) at the
    first save. It sits in the worker's process group, so a SIGTERM to that group
    (torchrun forwards signals with ``os.killpg``; ``kill -TERM -PGID``) killed it
    and the stop save that followed failed with BrokenPipeError, leaving a temp dir
    and no run_status.json. Our saves are synchronous: the queue is filled and read
    in this process (``execute_sync`` runs the writer function here; only its
    forked writers, which inherit the loop's flag-only signal handler, are other
    processes), so a plain thread-safe ``queue.Queue`` does the same job.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def mcore_version() -> str:
    """The installed megatron-core version (recorded in every marker)."""
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001
        import megatron.core

        return getattr(megatron.core, "__version__", "unknown")


def progress(total: Optional[int], desc: str, enabled: bool, unit: str = "tensor"):
    """A tqdm bar shown on rank 0 only (and only when ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled or rank() != 0, dynamic_ncols=True,
                leave=False)


def build_meta_model(bridge, layout, dtype: torch.dtype) -> list:
    """This rank's model chunks on the ``meta`` device: every shape, TP/EP attribute and
    ``sharded_state_dict()`` entry of the real model, no storage (the streaming converters).

    ``perform_initialization`` stays on: megatron sets the TP attributes (``partition_dim``)
    of CPU-initialised weights in its init path; on meta it allocates and computes nothing.
    Buffers are moved to meta as well: the streaming writer produces every state-dict tensor
    from the HF checkpoint and must never write a buffer's initial value instead.
    """
    with torch.device("meta"), _attributes_only_init():
        chunks = bridge.build_model(layout, params_dtype=dtype, use_cpu_initialization=True)
    for chunk in chunks:  # buffers megatron allocates on an explicit device (router expert_bias) go to meta too
        for module in chunk.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and not buf.is_meta:
                    module._buffers[name] = torch.empty_like(buf, device="meta")
    return chunks


# the modules that call megatron's CPU weight init by name (``from ..layers import _initialize_affine_weight_cpu``)
_AFFINE_INIT_USERS = ("megatron.core.tensor_parallel.layers", "megatron.core.transformer.moe.experts",
                      "megatron.core.extensions.transformer_engine")


@contextlib.contextmanager
def _attributes_only_init() -> Iterator[None]:
    """Within: megatron's ``_initialize_affine_weight_cpu`` sets the weight's TP attributes (``partition_dim``,
    ``partition_stride``) and nothing else.

    Why: on the ``meta`` device its other work (a master weight, ``normal_``, split, ``cat``, ``copy_``)
    produces no values, yet runs through torch's Python meta decompositions: about half of building a meta
    model (~0.1 s for 8 llama layers on the 2-core VM, growing with the layer count). The attributes are
    what the meta model is built for, so they are set exactly as megatron sets them."""
    import sys

    from megatron.core.tensor_parallel import layers

    original = layers._initialize_affine_weight_cpu

    def attributes_only(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                        stride=1, return_master_weight=False, *, skip_set_tensor_parallel_attributes=False,
                        **_):
        if not weight.is_meta:  # a real tensor needs its values: megatron's own init
            return original(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                            stride, return_master_weight,
                            skip_set_tensor_parallel_attributes=skip_set_tensor_parallel_attributes, **_)
        if not skip_set_tensor_parallel_attributes:
            layers.set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim,
                                                        stride=stride)
        return None

    patched = [m for m in (sys.modules.get(n) for n in _AFFINE_INIT_USERS)
               if m is not None and getattr(m, "_initialize_affine_weight_cpu", None) is original]
    for module in patched:
        setattr(module, "_initialize_affine_weight_cpu", attributes_only)
    try:
        yield
    finally:
        for module in patched:
            setattr(module, "_initialize_affine_weight_cpu", original)


def model_sharded_state_dict(chunks) -> dict:
    """``model`` / ``model{i}`` exactly as megatron's trainer (and our training checkpoints) write them."""
    from megatron.core import parallel_state as ps

    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    out, previous = {}, ps.get_virtual_pipeline_model_parallel_rank()
    try:
        for i, chunk in enumerate(chunks):
            ps.set_virtual_pipeline_model_parallel_rank(i)
            out[f"model{i}"] = chunk.sharded_state_dict()
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(previous)
    return out


def _tensor_shapes(sd) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    values = [sd] if isinstance(sd, (ShardedTensor, ShardedTensorFactory)) else nested_values(sd)
    for v in values:
        if isinstance(v, ShardedTensorFactory):
            out.update(_tensor_shapes(v.build()))
        elif isinstance(v, ShardedTensor):
            out[v.key] = (tuple(v.global_shape), v.dtype)
    return out


def model_tensor_shapes(chunks) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Collective: global shape and dtype of every torch_dist key the whole model (all ranks:
    every pipeline stage) reads/writes at this layout. Why gathered: a PP rank's chunks
    hold only its stage's keys, but a checkpoint must match the union."""
    local = _tensor_shapes(model_sharded_state_dict(chunks))
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return local
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def checkpoint_model_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Model tensors stored in a torch_dist dir (optimizer / RNG entries of training checkpoints skipped)."""
    dc = dist_checkpointing()
    try:
        md = dc.load_tensors_metadata(path)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read torch_dist metadata of {path} ({type(e).__name__}: {e}); is it a "
                              "megatron-core torch_dist checkpoint?") from e
    return {k: (tuple(v.global_shape), v.dtype) for k, v in md.items() if k.startswith(MODEL_KEY_ROOTS)}


def checkpoint_adapter_tensors(path: str) -> list[str]:
    """The LoRA adapter tensors a torch_dist dir holds (``lora.`` keys of a ``--lora-rank`` run's checkpoint)."""
    dc = dist_checkpointing()
    try:
        md = dc.load_tensors_metadata(path)
    except Exception:  # noqa: BLE001 - checkpoint_model_tensors names an unreadable dir
        return []
    return sorted(k for k in md if k.startswith("lora."))


def check_checkpoint_matches_model(path: str, stored: dict, expected: dict, config_dir: str) -> None:
    """Refuse, naming tensors: model keys the checkpoint lacks, stored keys the model has no
    parameter for, and global-shape mismatches (e.g. another vocab padding)."""
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    bad = [f"{k}: checkpoint {stored[k][0]} vs model {expected[k][0]}" for k in sorted(set(expected) & set(stored))
           if stored[k][0] != expected[k][0]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are not in the checkpoint: {missing}")
    if extra:
        problems.append(f"{len(extra)} checkpoint tensor(s) map to no parameter of this model: {extra}")
    if bad:
        problems.append(f"shape mismatch: {bad}")
    if problems:
        raise CheckpointError(f"torch_dist checkpoint {path} does not match the model of {config_dir}/config.json: "
                              + "; ".join(problems) + ". Pass the --hf-config it was written from; for a padded-"
                              "vocab mismatch convert at the --tensor-model-parallel-size it was saved with.")


def load_dist_into(chunks, path: str) -> None:
    """Collective: fill ``chunks`` from the torch_dist dir ``path`` (model part only, strict)."""
    dc = dist_checkpointing()
    sd = model_sharded_state_dict(chunks)
    try:
        loaded = dc.load(sd, path)
    except _read_errors() as e:
        raise CheckpointError(f"loading the model from torch_dist checkpoint {path} failed ({describe_read_error(e)}); "
                              "the files are torn, corrupt or of another model") from e
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    bad = non_finite_names((f"{key}.{name}" if len(keys) > 1 else name, t)
                           for key in keys for name, t in loaded[key].items())
    if bad:  # before anything is applied
        raise CheckpointError(f"torch_dist checkpoint {path} holds non-finite (inf/NaN) weights in {len(bad)} "
                              f"tensor(s): {', '.join(bad[:5])}; it was damaged or saved from a diverged run: "
                              "load another checkpoint")
    for chunk, key in zip(chunks, keys):
        chunk.load_state_dict(loaded[key], strict=True)


def _read_errors() -> tuple:
    """What a torch_dist read raises on a damaged file: torch DCP's CheckpointException is a
    BaseException (not an Exception) that wraps each rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe_read_error(e: BaseException) -> str:
    """One line: the underlying error of a read (unwrapping DCP's per-rank CheckpointException)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: " + describe_read_error(inner)
    detail = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {detail}"


def read_guard(stream: Iterable, path: str) -> Iterator:
    """Iterate ``stream`` (tensors read from the torch_dist dir ``path``); a failure to read (a torn
    ``.distcp`` zip, a pickle error) becomes a CheckpointError naming the dir, not a traceback."""
    it = iter(stream)
    while True:
        try:
            item = None  # the previous item is not held while the next one is read
            item = next(it)
        except StopIteration:
            return
        except MegatronRLError:
            raise
        except _read_errors() as e:  # torch/megatron raise RuntimeError, UnpicklingError, CheckpointException...
            raise CheckpointError(f"reading torch_dist checkpoint {path} failed ({describe_read_error(e)}); a "
                                  "file there is torn or corrupt: re-run the conversion or save that wrote it, or "
                                  "restore the dir from a copy") from e
        yield item


def free(chunks: Optional[list]) -> None:
    if chunks is not None:
        chunks.clear()
    gc.collect()


def compare_stream(exported: Iterable[tuple[str, torch.Tensor]], reference, expected_names: Iterable[str],
                   cast: Optional[torch.dtype], what: str, show_progress: bool, compare: bool) -> Optional[str]:
    """Drain the (collective) export; if ``compare``, check each tensor is bit-equal to
    ``reference.read(name)`` (cast to ``cast`` first, when given) and that exactly
    ``expected_names`` came out. Returns a message naming every difference, or None.
    """
    expected = set(expected_names)
    seen, diffs = set(), []
    bar = progress(len(expected), f"verify {what}", show_progress and compare)
    for name, tensor in exported:
        if not compare:
            continue
        seen.add(name)
        bar.update(1)
        if name not in reference.names():
            diffs.append(f"{name}: not in the {what} side")
            continue
        ref = reference.read(name)
        if cast is not None:
            ref = ref.to(cast)
        if ref.dtype != tensor.dtype or tuple(ref.shape) != tuple(tensor.shape):
            diffs.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype} vs {tuple(ref.shape)} {ref.dtype}")
        elif not torch.equal(ref.view(torch.uint8) if ref.dtype.is_floating_point and ref.numel() else ref,
                             tensor.contiguous().view(torch.uint8) if tensor.numel() else tensor):
            diffs.append(f"{name}: values differ (max abs {float((ref.float() - tensor.float()).abs().max()):.3g})")
    bar.close()
    if not compare:
        return None
    missing = sorted(expected - seen)
    extra = sorted(seen - expected)
    if missing:
        diffs.append(f"not exported: {missing}")
    if extra:
        diffs.append(f"exported but not expected: {extra}")
    return "; ".join(diffs) if diffs else None
