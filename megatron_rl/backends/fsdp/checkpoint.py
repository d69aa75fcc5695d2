"""DCP checkpoints of an FSDPBackend, in the megatron backend's checkpoint root layout.

One ``iter_NNNNNNN`` dir (the runner names it, prunes and points ``resume_state.json`` at
it, as for megatron) holds:

* the ``torch.distributed.checkpoint`` files (``.metadata`` + ``__R_0.distcp`` ...) of
  ``{"model", "optimizer"}`` from ``get_state_dict`` (sharded DTensors: every rank writes
  its own shards) plus ``scheduler`` and ``optimizer_steps``;
* with ``--advantage-estimator ppo`` the critic's (``critic.py``) model, optimizer, scheduler, step count (and
  loss scaler) under the same names prefixed ``critic_``; ``COMPLETE.json`` records ``"critic": true`` and a
  resume into a run with / without a critic that the checkpoint lacks / holds is refused by name;
* ``rng/rank_NNNNN.pt``: each rank's python / numpy / torch (/ CUDA) RNG states;
* ``extra_state.json`` (the caller's JSON dict: rollout id, data iterator) and
  ``hf_config/`` (config + tokenizer of ``--hf-checkpoint``);
* ``COMPLETE.json`` with format ``FORMAT``, the DP layout, the model fingerprint and every
  file's size and CRC-32, written last by ``infra.publish.publish_collectively``: a reader
  sees a complete checkpoint or none (a killed save leaves only a temp dir, skipped).

Why a format of its own: a megatron torch_dist checkpoint and an FSDP DCP one hold the
same model under different names and layouts; each backend's loader refuses the other's
by its marker (a clear error, not a load that half-works), and so does each direction of
``tools/convert_ckpt.py``: ``fsdp-to-hf`` (``convert/fsdp_to_hf.py``) exports these to HF
without this backend, which is why the format name, the ``"model"`` key and the fingerprint
live in ``models/hf_module.py``.

Killed saves: everything is written into the hidden temp dir and renamed into place last
(``publish_collectively``); a SIGKILL at any point before the rename leaves only that temp
dir, which auto-resume never lists (tests/dist/test_fsdp_checkpoint_kill.py kills a save
whose temp dir already holds every file and its marker).

Resharding: DCP loads the model and optimizer at any DP size (tested 2 -> 1 and 2 -> 2).
RNG states are per rank and restored only at the same world size.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from megatron_rl.backends.checkpoint_common import (ANOTHER, lora_record, refuse_non_finite, refuse_other_lora,
                                                    refuse_other_model)
from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_json
from megatron_rl.infra.checkpoint_root import (CorruptCheckpoint, is_temp_dir, newest_checkpoint_bytes,
                                             read_complete_marker)
from megatron_rl.infra.dist import barrier, rank, rank0_do, world
from megatron_rl.infra.publish import publish_collectively
from megatron_rl.infra.rng import host_rng_state, restore_host_rng_state
from megatron_rl.models.hf_module import DCP_FORMAT, DCP_MODEL_KEY, fingerprint
from megatron_rl.models.model_dir import HF_CONFIG_SUBDIR, copy_aux_files

log = logging.getLogger(__name__)

FORMAT = DCP_FORMAT  # models.hf_module: the converter (convert/fsdp_to_hf.py) reads it too
EXTRA_STATE_NAME = "extra_state.json"
RNG_SUBDIR = "rng"
_ANOTHER = ANOTHER


def model_fingerprint(backend) -> dict:
    return fingerprint(backend.model.config)


def layout_record(backend) -> dict:
    return {"backend": "fsdp", "dp": int(backend.dp_size), "world_size": world()}


def _rng_path(root: str, r: int) -> str:
    return os.path.join(root, RNG_SUBDIR, f"rank_{r:05d}.pt")


collect_rng_state, restore_rng_state = host_rng_state, restore_host_rng_state  # FSDP has no TP RNG tracker


GRAD_SCALER_KEY = "grad_scaler"  # --fp16 runs: the loss scaler's state (scale, growth and hysteresis trackers)
#: ppo's critic (critic.py): its keys beside the actor's. None starts with ``DCP_MODEL_KEY + "."``, so the
#: converter (convert/fsdp_to_hf.py) reads the actor's model only.
CRITIC_PREFIX = "critic_"


def _has_critic(backend) -> bool:
    return getattr(backend, "critic", None) is not None


def _trained(backend) -> list[tuple[str, Any]]:
    """(key prefix, owner of ``model`` / ``optimizer`` / ``scheduler`` / ``optimizer_steps`` / ``loss_scaler``):
    the actor (the backend itself) and ppo's critic."""
    return [("", backend)] + ([(CRITIC_PREFIX, backend.critic)] if _has_critic(backend) else [])


def _state(backend, with_scaler: bool = True) -> dict[str, Any]:
    """The DCP state dict: sharded model + optimizer (FQN-keyed), scheduler, step count and,
    with --fp16, the loss scaler (megatron saves its grad scaler with the optimizer too); ppo's critic's
    the same under ``CRITIC_PREFIX`` keys (``critic_model``, ``critic_optimizer``, ...)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state: dict[str, Any] = {}
    for prefix, owner in _trained(backend):
        model_sd, optim_sd = get_state_dict(owner.model, owner.optimizer)
        state.update({prefix + DCP_MODEL_KEY: model_sd, prefix + "optimizer": optim_sd,
                      prefix + "scheduler": owner.scheduler.state_dict(),
                      prefix + "optimizer_steps": int(owner.optimizer_steps)})
        if with_scaler and getattr(owner, "loss_scaler", None) is not None:
            state[prefix + GRAD_SCALER_KEY] = owner.loss_scaler.state_dict()
    return state


def _has_scaler_state(path: str) -> bool:
    """Whether the DCP files at ``path`` hold a loss scaler (a --fp16 run saved them)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return any(k == GRAD_SCALER_KEY or k.startswith(GRAD_SCALER_KEY + ".") for k in keys)


def refuse_other_critic(path: str, meta: dict, backend) -> None:
    """A checkpoint with a critic into a run without one, or the reverse: half the trained state would be missing
    or left behind (the megatron backend refuses alike)."""
    if bool(meta.get("critic", False)) == _has_critic(backend):
        return
    holds = "holds a critic (--advantage-estimator ppo)" if meta.get("critic") else "holds no critic"
    raise CheckpointError(f"checkpoint {path} {holds} but this run {'trains one' if _has_critic(backend) else 'does not'}"
                          ": resume with the --advantage-estimator it was saved with")


def save_checkpoint(backend, path: str, extra_state: dict) -> None:
    """Collective: write ``path`` (an ``iter_NNNNNNN`` dir) atomically; every rank must call it."""
    import torch.distributed.checkpoint as dcp

    path = os.path.abspath(path)
    if is_temp_dir(path):
        raise CheckpointError(f"{path} is a temp-dir name; pass the final iter_NNNNNNN dir")
    try:
        extra_json = json.loads(json.dumps(extra_state if extra_state is not None else {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state for {path} must be a JSON-serialisable dict: {e}") from e

    def write(tmp: str) -> None:
        dcp.save(_state(backend), checkpoint_id=tmp)
        os.makedirs(os.path.join(tmp, RNG_SUBDIR), exist_ok=True)
        torch.save(collect_rng_state(), _rng_path(tmp, rank()))

    def seal(tmp: str) -> dict:
        atomic_write_json(os.path.join(tmp, EXTRA_STATE_NAME), extra_json)
        copy_aux_files(backend.cfg.model.hf_checkpoint, os.path.join(tmp, HF_CONFIG_SUBDIR))
        return {"format": FORMAT, "torch": torch.__version__, "optimizer_steps": int(backend.optimizer_steps),
                "layout": layout_record(backend), "model": model_fingerprint(backend), "lora": lora_record(backend),
                "critic": _has_critic(backend)}

    # dcp.save agrees on every rank's write (its coordinator gathers the results and broadcasts the outcome);
    # the RNG file is each rank's own, agreed by publish_collectively
    publish_collectively(path, write, seal, needed_bytes=lambda: newest_checkpoint_bytes(os.path.dirname(path)))
    if rank() == 0:
        log.info("saved checkpoint %s (optimizer step %d)", path, backend.optimizer_steps)


def read_checkpoint_metadata(path: str) -> dict:
    """Validate ``path`` as a complete FSDP checkpoint (marker, format, every file's size and CRC-32)."""
    return read_complete_marker(os.path.abspath(path), (FORMAT,), "checkpoint", fixes={
        "missing": "; check --load, or start without it",
        "temp": "it is never loaded. Load a complete iter_NNNNNNN dir and delete this one",
        "root": "pass one of its iter_NNNNNNN dirs",
        "unmarked": "Resume from an older complete checkpoint (auto-resume skips this one) or delete it",
        "json": _ANOTHER,
        "format": f"--train-backend fsdp reads {FORMAT!r} checkpoints (a megatron torch_dist checkpoint needs "
                  "--train-backend megatron)",
        "files": f"Restore the files, or {_ANOTHER}"})


def load_checkpoint(backend, path: str) -> dict:
    """Collective: restore model, optimizer, scheduler, step count and (same world size) RNG;
    return ``extra_state``. The files are validated on rank 0 before any collective read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = os.path.abspath(path)
    meta = rank0_do(lambda: read_checkpoint_metadata(path), f"reading checkpoint {path}",
                    unexpected=CorruptCheckpoint)
    refuse_other_model(path, meta.get("model", {}), model_fingerprint(backend))
    refuse_other_lora(path, meta, backend)
    refuse_other_critic(path, meta, backend)
    same_layout = meta.get("layout") == layout_record(backend)
    if not same_layout and rank() == 0:
        log.warning("checkpoint %s was saved at %s, loading at %s: model and optimizer are resharded; RNG states "
                    "are NOT restored (they are per rank)", path, meta.get("layout"), layout_record(backend))
    scaler = getattr(backend, "loss_scaler", None)
    with_scaler = scaler is not None and _has_scaler_state(path)
    if scaler is not None and not with_scaler and rank() == 0:
        log.warning("checkpoint %s was not saved by a --fp16 run: the loss scale starts afresh at %g", path,
                    scaler.scale)
    state = _state(backend, with_scaler)
    try:
        dcp.load(state, checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CorruptCheckpoint(f"loading checkpoint {path} failed ({type(e).__name__}: {str(e)[:300]}); the "
                                f"files are corrupt or were written for another model/optimizer; {_ANOTHER}") from e
    # before anything is applied: a fallback finds the models as they were
    refuse_non_finite(path, ((f"{prefix}{name}", t) for prefix, _ in _trained(backend)
                             for name, t in state[prefix + DCP_MODEL_KEY].items()))
    for prefix, owner in _trained(backend):
        set_state_dict(owner.model, owner.optimizer, model_state_dict=state[prefix + DCP_MODEL_KEY],
                       optim_state_dict=state[prefix + "optimizer"])
        owner.scheduler.load_state_dict(state[prefix + "scheduler"])
        owner.optimizer_steps = int(state[prefix + "optimizer_steps"])
        if with_scaler:
            assert owner.loss_scaler is not None, "with_scaler is set only for a backend that has a loss scaler"
            owner.loss_scaler.load_state_dict(state[prefix + GRAD_SCALER_KEY])
    if same_layout:
        restore_rng_state(torch.load(_rng_path(path, rank()), weights_only=False))
    with open(os.path.join(path, EXTRA_STATE_NAME)) as f:
        extra = json.load(f)
    barrier()
    if rank() == 0:
        log.info("loaded checkpoint %s (optimizer step %d)", path, backend.optimizer_steps)
    return extra
