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
    return {"rank": int(lo.lora_rank), "alpha": float(lo.lora_alpha), "target_modules": list(lo.lora_target_modules)}


def refuse_other_lora(path: str, meta: Mapping, backend) -> None:
    """The adapters are model state: a checkpoint with none, or other ones, would load half a model."""
    saved, now = meta.get("lora"), lora_record(backend)
    if saved == now:
        return

    def said(r):
        return ("no LoRA adapters (full fine-tuning)" if r is None else
                f"LoRA adapters --lora-rank {r['rank']} --lora-alpha {r['alpha']:g} --lora-target-modules "
                f"{' '.join(r['target_modules'])}")
    raise CheckpointError(f"checkpoint {path} holds {said(saved)}; this run has {said(now)}: resume with the "
                          "checkpoint's --lora-* flags")
