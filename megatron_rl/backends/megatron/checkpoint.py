"""torch_dist checkpoints of a MegatronBackend: exact resume, resharding, atomic publication.

What one ``iter_NNNNNNN`` dir holds (megatron-core ``dist_checkpointing``, torch_dist):

* ``model`` (or ``model0``, ``model1`` ... with virtual pipeline stages, as
  megatron names them): every chunk's ``sharded_state_dict()``;
* ``optimizer``: ``sharded_state_dict(..., metadata={"distrib_optim_sharding_type":
  "fully_reshardable"})``. Why that type: megatron-core 0.16's default for the
  distributed optimizer fails on our models ("ShardedTensor.flattened_range is not
  supported"), and fully_reshardable stores model-shaped optimizer tensors, so a
  checkpoint reloads at any TP/PP/DP;
* ``opt_param_scheduler``, ``optimizer_steps``, ``iteration`` (common state, rank 0);
* ``rng_state``: one ``ShardedObject`` per global rank (python, numpy, torch, CUDA
  and megatron's model-parallel RNG tracker states);
* ``extra_state.json``: the caller's small JSON dict (rollout id, data iterator);
* ``hf_config/``: the HF ``config.json``, tokenizer and generation files of
  ``--hf-checkpoint``, so ``tools/convert_ckpt.py dist-to-hf`` exports the
  checkpoint without being told the model;
* ``COMPLETE.json``: format, layout, model fingerprint, megatron-core version and
  every file with its size and CRC-32. Written last, inside the temp dir.

Atomicity: all ranks write ``.iter_NNNNNNN.tmp`` (a collective save), barrier,
then rank 0 writes ``extra_state.json`` + ``COMPLETE.json``, fsyncs the tree and
renames it into place; barrier (:func:`~megatron_rl.infra.publish.publish_collectively`,
the same sequence the converters publish with).
A reader therefore sees a complete checkpoint or none; a crash leaves only a temp
dir, which :func:`load_checkpoint` and ``find_latest_complete`` refuse/skip. The torch_dist
write itself runs megatron's steps one by one (:func:`save_torch_dist`) so a failed rank-0 write
(``common.pt``, ``.metadata``, ``metadata.json``: a full disk) fails every rank at the same point
instead of leaving the others in the next collective; a full disk is then a named error on every
rank and its temp dir is removed (``publish_collectively``).

Checksums: after the collective write the files are read back once for their CRC-32,
file i by rank i % world (:func:`_spread_checksums`). Integrity on load: rank 0 checks
the marker and every listed file's size and broadcasts its verdict, then the CRC-32s
are checked spread over the ranks the same way (same-size damage is refused naming the
file); after the read every rank checks its model tensors for inf/NaN before anything
is applied.
Failures of the files raise :class:`~megatron_rl.infra.checkpoint_root.CorruptCheckpoint`
with the model untouched, so auto-resume can fall back to the previous checkpoint.

Exact resume (measured: losses, grad norms, parameters and optimizer state
bitwise equal to an uninterrupted run) needs one fix on top of megatron-core,
:func:`untie_optimizer_step_tensors`; see its docstring.

Resharding: model and optimizer load at any layout. RNG states are per rank and
restored only when the layout (tp/pp/vpp/cp/ep/etp, dp, world size) is identical;
otherwise a log line says they were left as seeded.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.backends.checkpoint_common import (ANOTHER, lora_base_record, lora_record, refuse_non_finite,
                                                    refuse_other_base, refuse_other_lora, refuse_other_model)
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_json
from megatron_rl.infra.checkpoint_root import (CHECKSUM_KEY, CorruptCheckpoint, crc32_of_files, is_temp_dir,
                                             listed_file_problems, newest_checkpoint_bytes, read_complete_marker)
from megatron_rl.infra.dist import all_ranks_ok, barrier, gather_problems, rank, rank0_do, world
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.infra.rng import host_rng_state, restore_host_rng_state
from megatron_rl.models.dist_io import (describe_read_error, dist_checkpointing, mcore_version,
                                        model_sharded_state_dict)
from megatron_rl.models.model_dir import HF_CONFIG_SUBDIR, TRAINING_FORMAT, copy_aux_files

log = logging.getLogger(__name__)

FORMAT = TRAINING_FORMAT
EXTRA_STATE_NAME = "extra_state.json"
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_ANOTHER = ANOTHER


# ---- what a checkpoint records ---------------------------------------------------------------------


def model_fingerprint(backend) -> dict:
    """The model-shape facts a checkpoint must agree on, whatever the parallel layout."""
    c = backend.model_config
    return {"hidden_size": c.hidden_size, "num_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_query_groups": c.num_query_groups or c.num_attention_heads,
            "ffn_hidden_size": c.ffn_hidden_size, "vocab_size": int(backend.vocab_size)}


def layout_record(backend) -> dict:
    """Everything that decides which rank holds which shard (RNG is restored only if this matches); a critic of
    its own layout adds it (``critic_layout``)."""
    record = {**backend.layout.describe(), "dp": int(backend.ps.get_data_parallel_world_size()),
              "world_size": world(),
              "use_distributed_optimizer": bool(backend.cfg.optimizer.effective_distributed_optimizer)}
    critic = getattr(backend, "critic", None)
    if critic is not None and critic.share is not None:
        record["critic_layout"] = {**critic.scope.layout.describe(), "dp": critic.share.dp_size}
    return record


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# ---- RNG ------------------------------------------------------------------------------------------------


def collect_rng_state() -> dict:
    """This rank's RNG states, as plain ints/lists/tensors (loadable with ``weights_only``): the host's
    (``infra/rng.py``) and megatron's tensor-parallel RNG tracker."""
    from megatron.core import tensor_parallel

    return {**host_rng_state(),
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}


def restore_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    restore_host_rng_state(state)
    tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# ---- the sharded state dict -------------------------------------------------------------------------


CRITIC_PREFIX = "critic."  # the critic's tensor keys in a checkpoint (the actor's have none)


def _has_critic(backend) -> bool:
    return getattr(backend, "critic", None) is not None


def _load_critic(backend, loaded: dict, path: str) -> None:
    """The critic's model (keys without ``CRITIC_PREFIX``), optimizer (with the step fix), schedule and step count.
    No ``parallel_state`` needed: the tensors are local, and its optimizer reshards over its own groups."""
    critic = backend.critic
    state = {k[len(CRITIC_PREFIX):] if k.startswith(CRITIC_PREFIX) else k: v
             for k, v in loaded["critic_model"].items()}
    refuse_non_finite(path, ((f"critic.{k}", t) for k, t in state.items()))
    critic.chunks[0].load_state_dict(state, strict=True)
    _load_optimizer_state(critic.optimizer, loaded["critic_optimizer"])
    load_scheduler_state(critic.scheduler, loaded["critic_opt_param_scheduler"], path)
    critic.optimizer_steps = int(loaded["critic_optimizer_steps"])


def _trained_only(model_sd: dict, trained: set[int]) -> dict:
    """A LoRA run's model state in its checkpoints: what trains (the adapters, ``lora.`` keys, and the base
    parameters of ``--lora-modules-to-save``) and the non-tensor entries. The frozen base is what
    ``--hf-checkpoint`` gives every start; the checkpoint records its digest (``lora_base``). Chosen by the
    parameter (``trained``: ids of the parameters with gradients), not by key: the distributed optimizer's sharded
    state maps each of its parameters to the model entry holding that very tensor, and an entry dropped here for
    a trained parameter fails the save ("Param id ... does not match any model sharded param")."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return {k: v for k, v in model_sd.items()
            if not isinstance(v, (ShardedTensor, ShardedTensorFactory)) or v.key.startswith("lora.")
            or id(v.data) in trained}


def _build_sharded_state_dict(backend, is_loading: bool, with_rng: bool, adapters_only: bool = False) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd: dict[str, Any] = model_sharded_state_dict(backend.chunks)  # model / model{i}, as megatron writes them
    if adapters_only:
        trained = {id(p) for chunk in backend.chunks for p in chunk.parameters() if p.requires_grad}
        sd = {key: _trained_only(model_sd, trained) for key, model_sd in sd.items()}
    sd["optimizer"] = backend.optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                           metadata=dict(SHARDING_METADATA))
    sd["opt_param_scheduler"] = backend.scheduler.state_dict()
    sd["optimizer_steps"] = int(backend.optimizer_steps)
    sd["iteration"] = int(backend.optimizer_steps)
    sd["checkpoint_format"] = FORMAT
    critic = getattr(backend, "critic", None)
    if critic is not None:  # ppo's value model (critic.py): its own keys, optimizer and schedule, same checkpoint
        assert len(critic.chunks) == 1, "one model chunk per rank: the critic has no virtual pipeline stages"
        # its shards' offsets and replicas are those of its own layout: the modules' TP groups, its collection's
        # DP-CP group, and parallel_state of its layout for what megatron-core 0.16.1 still reads there:
        # MegatronModule.sharded_state_dict takes the global TP group for a module without its own,
        # LanguageModule.tie_embeddings_and_output_weights_state_dict the global DP-CP rank, and our gated-delta
        # layers (models/gated_delta.py) the global TP group
        with critic.scope:
            model_sd = critic.chunks[0].sharded_state_dict(prefix=CRITIC_PREFIX,
                                                           metadata={"dp_cp_group": critic.role.pg.dp_cp})
        sd["critic_optimizer"] = critic.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                     metadata=dict(SHARDING_METADATA))
        sd["critic_model"] = model_sd
        sd["critic_opt_param_scheduler"] = critic.scheduler.state_dict()
        sd["critic_optimizer_steps"] = int(critic.optimizer_steps)
    if with_rng:
        sd["rng_state"] = ShardedObject("megatron_rl.rng_state", collect_rng_state() if not is_loading else None,
                                        (world(),), (rank(),), replica_id=0)
    return sd


# ---- the step fix -----------------------------------------------------------------------------------


def untie_optimizer_step_tensors(optimizer) -> int:
    """Give every parameter its own AdamW ``step`` tensor; returns how many were re-allocated.

    Why: without transformer-engine/apex fused optimizers, megatron-core 0.16's
    ``DistributedOptimizer.load_state_dict`` (which also runs inside
    ``sharded_state_dict(is_loading=True)``) sets ``state[p]["step"] = step`` with
    ONE tensor for all parameters. torch's AdamW increments ``step`` *in place* once
    per parameter, so after a resume the shared counter jumps by the number of
    parameters per optimizer step (measured 3 -> 29 -> 55) and bias correction is
    wrong: the run silently diverges from the uninterrupted one. A private copy per
    parameter makes resume bitwise exact. Idempotent; harmless when steps are
    already distinct.
    """
    fixed = 0
    for opt in _chained(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                    fixed += 1
                seen.add(id(state["step"]))
    return fixed


def _pop_steps(inner) -> dict:
    return {p: st.pop("step") for p, st in inner.state.items() if isinstance(st, dict) and "step" in st}


def _load_optimizer_state(optimizer, state) -> None:
    """``optimizer.load_state_dict`` that survives torch AdamW's ``step`` key.

    Why not just ``load_state_dict``: for the distributed optimizer megatron-core
    copies ``{"param", **optimizer.state[p]}`` from the checkpoint's fully
    reshardable tensors, and with torch AdamW ``state[p]`` holds ``step``, which the
    checkpoint does not (it stores step in the param groups) -> KeyError. We load
    the param-group part (which sets ``step``), set the steps aside while the
    parameter state is copied (so only keys the checkpoint has are copied), then
    put them back, one private tensor per parameter.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = _chained(optimizer)
    states = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    if len(states) != len(chained):
        raise CheckpointError(f"checkpoint holds {len(states)} optimizer(s), the model has {len(chained)}; "
                              "resume with the same optimizer flags it was saved with")
    for opt, st in zip(chained, states):
        if isinstance(opt, DistributedOptimizer) and isinstance(st, dict) and "param_state" in st:
            param_state = st.pop("param_state")
            kind = st.pop("param_state_sharding_type")
            if kind != "fully_reshardable":
                raise CheckpointError(f"optimizer state saved as {kind!r}; this loader reads 'fully_reshardable'")
            opt.load_state_dict(st)
            steps = _pop_steps(opt.optimizer)
            try:
                opt.load_parameter_state_from_fully_reshardable(param_state)
            finally:
                for p, s in steps.items():
                    opt.optimizer.state[p]["step"] = s
        else:
            opt.load_state_dict(st)
    if len(chained) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()
    untie_optimizer_step_tensors(optimizer)


def load_scheduler_state(scheduler, state: dict, path: str = "") -> None:
    """The checkpoint's step count with the resumed run's own schedule (its flags win).

    Why not plain ``load_state_dict``: megatron-core's default
    (``use_checkpoint_opt_param_scheduler=True``) takes max/min LR, warm-up, decay
    steps and decay style from the checkpoint. The decay length defaults to all
    optimizer steps of the run (``--num-rollout``), so a run extended by relaunching
    with a larger ``--num-rollout`` kept the old length and, with cosine/linear
    decay, resumed at ``--min-lr`` (measured: 2 -> 4 rollouts, cosine: LR 0 on every
    resumed step). Here the scheduler keeps the values built from the current flags
    (megatron's ``override_opt_param_scheduler``) and is advanced to the saved step;
    an unchanged command line resumes bitwise as before. Changed values are logged.
    """
    current = scheduler.state_dict()
    changed = {k: (state.get(k), v) for k, v in current.items() if k != "num_steps" and state.get(k) != v}
    if changed and rank() == 0:
        log.info("checkpoint %s: LR schedule from the current flags, not the checkpoint (%s)", path,
                 "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))
    previous = scheduler.override_opt_param_scheduler
    scheduler.override_opt_param_scheduler = True
    try:
        scheduler.load_state_dict(state)
    finally:
        scheduler.override_opt_param_scheduler = previous


# ---- save -------------------------------------------------------------------------------------------------


def save_checkpoint(backend, path: str, extra_state: dict) -> None:
    """Collective: write ``path`` (an ``iter_NNNNNNN`` dir) atomically; every rank must call it.

    ``extra_state`` must be JSON-serialisable (checked before any collective, so a bad
    value fails on every rank alike). An existing ``path`` is replaced atomically.
    """
    path = os.path.abspath(path)
    if is_temp_dir(path):
        raise CheckpointError(f"{path} is a temp-dir name; pass the final iter_NNNNNNN dir")
    try:
        extra_json = json.loads(json.dumps(extra_state if extra_state is not None else {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state for {path} must be a JSON-serialisable dict: {e}") from e
    dc = dist_checkpointing()

    base = lora_base_record(backend)  # a LoRA run: the adapters and their optimizer state, not the frozen base

    def write(tmp: str) -> dict[str, str]:
        sd = _build_sharded_state_dict(backend, is_loading=False, with_rng=True, adapters_only=base is not None)
        save_torch_dist(dc, sd, tmp, content_metadata={"megatron_rl_format": FORMAT})
        return _spread_checksums(tmp)  # after save_torch_dist's last agreement: every rank's shards are on disk

    def seal(tmp: str) -> dict:
        atomic_write_json(os.path.join(tmp, EXTRA_STATE_NAME), extra_json)
        hf_dir = getattr(getattr(getattr(backend, "cfg", None), "model", None), "hf_checkpoint", None)
        if hf_dir:  # config + tokenizer beside the weights: dist-to-hf then needs no --hf-config
            copy_aux_files(hf_dir, os.path.join(tmp, HF_CONFIG_SUBDIR))
        return {"format": FORMAT, "megatron_core": mcore_version(), "torch": torch.__version__,
                "optimizer_steps": int(backend.optimizer_steps), "layout": layout_record(backend),
                "model": model_fingerprint(backend), "lora": lora_record(backend),
                "optimizer_sharding": SHARDING_METADATA["distrib_optim_sharding_type"],
                "critic": _has_critic(backend), **({"lora_base": base} if base is not None else {})}

    publish_collectively(path, write, seal, needed_bytes=lambda: newest_checkpoint_bytes(os.path.dirname(path)))
    if rank() == 0:
        log.info("saved checkpoint %s (optimizer step %d)", path, backend.optimizer_steps)


def save_torch_dist(dc, sd: dict, directory: str, content_metadata: dict) -> None:
    """Collective: megatron-core's ``dist_checkpointing.save`` step by step, every rank-local write
    followed by an agreement, so a write that fails on one rank fails every rank at the same point.

    Why not ``dc.save``: rank 0 writes ``common.pt`` before the sharded write's collectives,
    ``.metadata`` inside them (the coordinator writes it, then broadcasts whether the shards
    failed) and ``metadata.json`` before their closing barrier, and a failure of any of these
    (a full disk) raised on rank 0 alone while the others waited in the next collective: the run
    hung with one rank in an all-gather and the other in the checkpoint's gather. Here each of the
    three is caught and agreed (:func:`~megatron_rl.infra.dist.all_ranks_ok`); the shard writes
    themselves are agreed by torch DCP (every rank's result is gathered and the outcome broadcast).
    The files are the ones ``dc.save`` writes (same strategies, same order).
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import (_CONTENT_METADATA_KEY,
                                                                get_default_save_common_strategy)
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class DeferredFinishStrategy(TorchDistSaveShardedStrategy):
        """torch_dist's sharded save whose coordinator keeps a failure of its ``.metadata`` write
        (``finish_error``) instead of raising it before the broadcast the other ranks wait in."""

        finish_error: Optional[BaseException] = None

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            finish = writer.finish

            def finish_or_keep_error(*args, **kwargs):
                try:
                    return finish(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 - raised after the broadcast, on every rank
                    self.finish_error = e

            writer.finish = finish_or_keep_error
            return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)

    if not hasattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"):
        raise CheckpointError("megatron-core's TorchDistSaveShardedStrategy has no _get_save_and_finalize_callbacks "
                              f"(megatron-core {mcore_version()}): save_torch_dist needs a new hook for its "
                              ".metadata write")

    def on_rank0(step: Callable[[], None]) -> None:
        error = None
        if rank() == 0:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - agreed below, not raised here alone
                error = e
        all_ranks_ok(error, reraise_own=True)

    sd[_CONTENT_METADATA_KEY] = content_metadata
    sharded_sd, common_sd = save_preprocess(sd, validate_access_integrity=True)
    on_rank0(lambda: get_default_save_common_strategy().save_common(common_sd, directory))
    strategy = DeferredFinishStrategy("torch_dist", 1)
    strategy.save(sharded_sd, directory)
    all_ranks_ok(strategy.finish_error, reraise_own=True)
    on_rank0(lambda: save_config(CheckpointingConfig(strategy.backend, strategy.version), directory))


# ---- load -------------------------------------------------------------------------------------------------


def _spread_checksums(root: str) -> dict[str, str]:
    """Collective: CRC-32 of every file now under ``root``, file i hashed by rank i % world.

    Why spread: the torch_dist writer gives no hook on its bytes, so the files are read back;
    rank 0 alone would read the whole checkpoint (every rank's shards) once more. Rank 0 lists
    the files (every rank sees the same shared directory, as torch_dist loading requires)."""
    box = [sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)
           if rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    listed = box[0]
    assert listed is not None, "rank 0 lists the files and the broadcast hands its list to every rank"
    mine = listed[rank()::world()]
    try:
        part: Any = dict(zip(mine, crc32_of_files([os.path.join(root, r) for r in mine])))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait in the gather
        part = f"rank {rank()}: {type(e).__name__}: {e}"
    parts = [part]
    if dist.is_initialized() and world() > 1:
        parts = [None] * world()
        dist.all_gather_object(parts, part)
    errors = [p for p in parts if isinstance(p, str)]
    if errors:
        raise CheckpointError(f"hashing the files of {root} failed ({'; '.join(errors)})")
    return {k: v for p in parts for k, v in p.items()}


def read_checkpoint_metadata(path: str, checksums: bool = True) -> dict:
    """Validate ``path`` as a complete checkpoint and return its ``COMPLETE.json``.

    Refuses (CheckpointError naming the path and the fix): a missing dir, a temp dir,
    a checkpoint root instead of an iteration dir, a dir without the marker, a file
    listed in the marker that is missing, has a different size or (``checksums``) another CRC-32.
    """
    return read_complete_marker(os.path.abspath(path), (FORMAT,), "checkpoint", checksums=checksums, fixes={
        "missing": "; check --load, or start without it",
        "temp": "it is never loaded. Load a complete iter_NNNNNNN dir (find_latest_complete) and delete this one",
        "root": "pass iter_dir(root, find_latest_complete(root))",
        "unmarked": "Resume from an older complete checkpoint (find_latest_complete skips this one) or delete it",
        "json": _ANOTHER,
        "format": f"this loader reads {FORMAT!r}",
        "files": f"Restore the files, or {_ANOTHER}"})


def _validated_metadata(path: str) -> dict:
    """Collective :func:`read_checkpoint_metadata`: rank 0 checks the marker and the sizes and
    broadcasts its verdict, then the CRC-32 of file i is checked by rank i % world and the
    problems are gathered (each rank reads 1/world of the checkpoint, not rank 0 all of it);
    every rank raises the same error."""
    # an unexpected error (e.g. permission denied) counts as corrupt: auto-resume tries the previous one
    meta = rank0_do(lambda: read_checkpoint_metadata(path, checksums=False), f"reading checkpoint {path}",
                    unexpected=CorruptCheckpoint)
    mine = [e for e in meta.get("files", []) if CHECKSUM_KEY in e][rank()::world()]
    try:
        bad: list = listed_file_problems(path, {"files": mine})
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, not wait in the gather
        bad = [f"reading its files failed on rank {rank()} ({type(e).__name__}: {e})"]
    bad = gather_problems(bad)
    if bad:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt: {'; '.join(sorted(bad)[:10])}. Restore the files, "
                                f"or {_ANOTHER}")
    return meta


def check_model_matches(path: str, meta: dict, backend) -> None:
    """Refuse a checkpoint of a differently shaped model (names each differing field)."""
    refuse_other_model(path, meta.get("model", {}), model_fingerprint(backend))


def load_checkpoint(backend, path: str) -> dict:
    """Collective: restore model, optimizer, scheduler, step count and (same layout) RNG; return extra_state.

    Validation happens before any collective and is deterministic from the files,
    so a refused checkpoint fails on every rank alike.
    """
    path = os.path.abspath(path)
    meta = _validated_metadata(path)
    check_model_matches(path, meta, backend)
    refuse_other_lora(path, meta, backend)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    saved_dist = (meta.get("layout") or {}).get("use_distributed_optimizer")
    now_dist = bool(backend.cfg.optimizer.effective_distributed_optimizer)
    if saved_dist is not None and saved_dist != now_dist:
        flag = "with" if saved_dist else "without"
        raise CheckpointError(f"checkpoint {path} was saved {flag} --use-distributed-optimizer; megatron-core "
                              f"0.16 cannot convert optimizer state between the two. Resume {flag} the flag")
    if bool(meta.get("critic", False)) != _has_critic(backend):
        holds = "holds a critic (--advantage-estimator ppo)" if meta.get("critic") else "holds no critic"
        raise CheckpointError(f"checkpoint {path} {holds} but this run "
                              f"{'trains one' if _has_critic(backend) else 'does not'}: resume with the "
                              "--advantage-estimator it was saved with")
    same_layout = meta.get("layout") == layout_record(backend)
    if not same_layout and rank() == 0:
        log.warning("checkpoint %s was saved at layout %s, loading at %s: model and optimizer are resharded; "
                    "RNG states are NOT restored (they are per rank); runs continue from the seeded RNG",
                    path, meta.get("layout"), layout_record(backend))

    # The distributed optimizer's loading state dict needs allocated state (see megatron's trainer).
    for opt in _chained(backend.optimizer) + (_chained(backend.critic.optimizer) if _has_critic(backend) else []):
        if isinstance(opt, DistributedOptimizer):
            opt._init_optimizer_states_with_dummy_values()
    dc = dist_checkpointing()
    adapters_only = "lora_base" in meta  # older LoRA checkpoints hold the base too: loaded whole, as written
    if adapters_only:
        refuse_other_base(path, meta["lora_base"], backend)
    sd = _build_sharded_state_dict(backend, is_loading=True, with_rng=same_layout, adapters_only=adapters_only)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = dc.load(sd, path)
    except (Exception, CheckpointException) as e:  # a torn .distcp raises DCP's CheckpointException: a BaseException
        raise CorruptCheckpoint(f"loading checkpoint {path} failed ({describe_read_error(e)}); the files are "
                                f"corrupt or were written for another model/optimizer; {_ANOTHER}") from e
    model_keys = ["model"] if len(backend.chunks) == 1 else [f"model{i}" for i in range(len(backend.chunks))]
    refuse_non_finite(path, ((f"{key}.{name}" if len(model_keys) > 1 else name, t)
                             for key in model_keys for name, t in loaded[key].items()))

    try:
        for key, chunk in zip(model_keys, backend.chunks):
            if not adapters_only:
                chunk.load_state_dict(loaded[key], strict=True)
                continue
            result = chunk.load_state_dict(loaded[key], strict=False)  # the frozen base stays as --hf-checkpoint gave
            trained = {n for n, prm in chunk.named_parameters() if prm.requires_grad}
            lacking = sorted(n for n in result.missing_keys if n in trained)
            if lacking or result.unexpected_keys:
                raise CheckpointError(f"checkpoint {path} does not hold this run's adapters: missing {lacking[:5]}, "
                                      f"unexpected {list(result.unexpected_keys)[:5]}")
        _load_optimizer_state(backend.optimizer, loaded["optimizer"])
        if _has_critic(backend):
            _load_critic(backend, loaded, path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"applying checkpoint {path} failed ({type(e).__name__}: {e})") from e
    load_scheduler_state(backend.scheduler, loaded["opt_param_scheduler"], path)
    backend.optimizer_steps = int(loaded["optimizer_steps"])
    if same_layout:
        restore_rng_state(loaded["rng_state"])
    with open(os.path.join(path, EXTRA_STATE_NAME)) as f:
        extra = json.load(f)
    barrier()
    if rank() == 0:
        log.info("loaded checkpoint %s (optimizer step %d)", path, backend.optimizer_steps)
    return extra
