"""What both backends' checkpoints check alike, with the same messages (``megatron/checkpoint.py``,
``fsdp/checkpoint.py``): the model a checkpoint was saved from, inf/NaN weights, and where to go
when one is refused. Each backend keeps its own file format; the refusals a user reads are one."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.checkpoint_root import CorruptCheckpoint
from megatron_rl.models.finite import non_finite_names

#: the way on after a refused checkpoint (auto-resume falls back on CorruptCheckpoint by itself)
ANOTHER = ("auto-resume skips it to the previous complete checkpoint; to pick one yourself pass "
           "--load ROOT/iter_NNNNNNN of another complete iteration")


def refuse_non_finite(path: str, named: Iterable[tuple[str, object]]) -> None:
    """Collective: raise ``CorruptCheckpoint`` on every rank when any rank's loaded model tensors hold
    inf/NaN, naming them; called before anything is applied, so the model is untouched for a fallback."""
    bad = non_finite_names(named)
    if bad:
        raise CorruptCheckpoint(f"checkpoint {path} holds non-finite (inf/NaN) weights in {len(bad)} tensor(s): "
                                f"{', '.join(bad[:5])}; it was damaged or saved from a diverged run. {ANOTHER}")


def refuse_other_model(path: str, saved: Mapping, current: Mapping) -> None:
    """A checkpoint of a differently shaped model, refused naming each field that differs."""
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs model {v!r}" for k, v in current.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {path} is of a different model ({'; '.join(diff)}); pass the "
                              "--hf-checkpoint it was trained from, or a --load of this model")


def lora_record(backend) -> Optional[dict]:
    """The LoRA adapters a checkpoint holds (``--lora-*``; None: full fine-tuning): a resume needs the same ones."""
    cfg = getattr(backend, "cfg", None)
    lo = getattr(cfg, "lora", None)
    if lo is None or not lo.lora_rank:
        return None
    saved = list(getattr(lo, "lora_modules_to_save", []))  # recorded when given: older records stay equal
    return {"rank": int(lo.lora_rank), "alpha": float(lo.lora_alpha), "target_modules": list(lo.lora_target_modules),
            **({"modules_to_save": saved} if saved else {})}


def refuse_other_lora(path: str, meta: Mapping, backend) -> None:
    """The adapters are model state: a checkpoint with none, or other ones, would load half a model."""
    saved, now = meta.get("lora"), lora_record(backend)
    if saved == now:
        return

    def said(r):
        return ("no LoRA adapters (full fine-tuning)" if r is None else
                f"LoRA adapters --lora-rank {r['rank']} --lora-alpha {r['alpha']:g} --lora-target-modules "
                f"{' '.join(r['target_modules'])}"
                + (f" --lora-modules-to-save {' '.join(r['modules_to_save'])}" if r.get("modules_to_save") else ""))
    raise CheckpointError(f"checkpoint {path} holds {said(saved)}; this run has {said(now)}: resume with the "
                          "checkpoint's --lora-* flags")


def lora_base_record(backend) -> Optional[dict]:
    """A LoRA run's frozen base, which its checkpoints do not hold (adapters and their optimizer state only):
    ``--hf-checkpoint``'s path and weights digest (``models.hf_checkpoint.weights_digest``), computed once per
    run; None for full fine-tuning."""
    if lora_record(backend) is None:
        return None
    cached = getattr(backend, "_lora_base_record", None)
    if cached is None:
        import os

        from megatron_rl.models.hf_checkpoint import weights_digest  # lazy: safetensors headers, LoRA runs only

        hf_dir = os.path.abspath(backend.cfg.model.hf_checkpoint)
        cached = {"hf_checkpoint": hf_dir, "weights_digest": weights_digest(hf_dir)}
        backend._lora_base_record = cached
    return cached


def refuse_other_base(path: str, saved: Mapping, backend) -> None:
    """An adapter-only checkpoint resumed on other base weights would train its adapters on a model they were
    not trained with: refused, naming both checkpoints (every rank alike: the digest is deterministic)."""
    now = lora_base_record(backend)
    if now is None or saved.get("weights_digest") == now["weights_digest"]:
        return
    raise CheckpointError(f"checkpoint {path} holds LoRA adapters trained on the base {saved.get('hf_checkpoint')} "
                          f"(weights digest {str(saved.get('weights_digest'))[:12]}...), and this run's --hf-checkpoint "
                          f"{now['hf_checkpoint']} has other weights (digest {now['weights_digest'][:12]}...): resume "
                          "with --hf-checkpoint set to that base (a copy of its files works)")
