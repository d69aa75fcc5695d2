"""A LoRA adapter as HF PEFT saves it: what ``--lora-sync adapter`` sends the rollout engine instead of the model.

Both backends hand it over (``TrainBackend.export_adapters``): every adapted HF module's full ``lora_A``
``[r, in]`` and ``lora_B`` ``[out, r]`` (gathered over tensor / data parallelism) under PEFT's saved keys,
``base_model.model.<hf module>.lora_{A,B}.weight`` (what ``adapter_model.safetensors`` holds), with ``r`` and
``lora_alpha``; with ``--lora-modules-to-save`` also the full tensors of the modules trained beside the adapters,
under PEFT's saved keys for them (``base_model.model.<hf weight name>``, e.g. ``base_model.model.model.embed_tokens
.weight``), which an engine sets as they are (:meth:`AdapterExport.saved`). On disk it is a PEFT dir (``adapter_model.safetensors`` + ``adapter_config.json``), which
``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read.

:func:`merged_weight` is the one merge an engine applies: ``W_base + alpha / r * B @ A`` in float32, then the
engine's dtype. It is the trainers' merge on a float32 run (the megatron backend's ``LoraAdapters.merged``,
the FSDP backend's ``merge_unit``), so the engine's weights equal the trainer's merged export bit for bit there;
in bf16 the megatron backend merges in bf16 and the two differ by the rounding of one bf16 add
(``--check-weight-update-equal`` allows :data:`HALF_RTOL` relative there).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_rl.models.hf_checkpoint import check_finite

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
SAVED_PREFIX = "base_model.model."  # how PEFT's save_pretrained prefixes the adapter keys
HALF_RTOL = 2.0 ** -7  # two bf16 ulps: an engine's float32 merge vs a trainer that merged in bf16


def peft_key(hf_module: str, which: str) -> str:
    """The key of a PEFT ``adapter_model.safetensors`` tensor (``which``: ``A`` or ``B``)."""
    return f"{SAVED_PREFIX}{hf_module}.lora_{which}.weight"


@dataclass(frozen=True)
class AdapterExport:
    """Full adapter tensors under PEFT's saved keys, and the adapter's ``r`` and ``lora_alpha``; with
    ``modules_to_save`` (PEFT's names) the full tensors of those modules too, under their saved keys.
    ``tie_word_embeddings``: the model's output layer is its embedding (PEFT's ``ensure_weight_tying``: a saved
    ``embed_tokens`` is the output layer as well)."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    modules_to_save: tuple[str, ...] = ()
    tie_word_embeddings: bool = False

    @property
    def scaling(self) -> float:
        """PEFT's ``lora_alpha / r`` (plain LoRA: no rsLoRA)."""
        return self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def modules(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """HF module name (``model.layers.0.self_attn.q_proj``) -> its ``(A, B)``; a key without its pair is
        refused by name."""
        out = {}
        for key, a in self.tensors.items():
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight") and not self._is_saved_key(key):
                    raise ValueError(f"LoRA adapter tensor {key!r}: not a PEFT lora_A/lora_B key, nor a weight of "
                                     f"the modules to save ({', '.join(self.modules_to_save) or 'none'})")
                continue
            module = key[len(SAVED_PREFIX): -len(".lora_A.weight")]
            b = self.tensors.get(peft_key(module, "B"))
            if b is None:
                raise ValueError(f"LoRA adapter has {key!r} but no {peft_key(module, 'B')!r}")
            out[module] = (a, b)
        if 2 * len(out) != len(self.tensors) - len(self.saved()):
            raise ValueError("LoRA adapter has lora_B tensors without their lora_A")
        return out

    def _is_saved_key(self, key: str) -> bool:
        if not key.startswith(SAVED_PREFIX) or ".lora_" in key:
            return False
        module = key[len(SAVED_PREFIX):].rsplit(".", 1)[0]
        tied_head = self.tie_word_embeddings and module.endswith("lm_head")  # PEFT saves the tied copy too
        return tied_head or any(module.endswith(t) for t in self.modules_to_save)

    def saved(self) -> dict[str, torch.Tensor]:
        """HF weight name (``model.embed_tokens.weight``) -> full tensor of every weight of the modules to save."""
        return {k[len(SAVED_PREFIX):]: t for k, t in self.tensors.items() if self._is_saved_key(k)}

    def unsent_modules_to_save(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` (the run's ``--lora-modules-to-save``) no tensor here belongs to: an engine given
        this adapter would keep its old weights of them, silently apart from the trainer's."""
        modules = [n.rsplit(".", 1)[0] for n in self.saved()]
        return [t for t in names if t not in self.modules_to_save or not any(m.endswith(t) for m in modules)]

    def config(self, base_model: str = "") -> dict:
        """PEFT's ``adapter_config.json`` (plain LoRA: no rsLoRA, DoRA or bias; target modules as the leaf names
        of the adapted modules, as PEFT writes them)."""
        targets = sorted({k[len(SAVED_PREFIX):].split(".lora_")[0].rsplit(".", 1)[-1] for k in self.tensors
                          if ".lora_" in k})
        saved = list(self.modules_to_save) or None
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": saved,
                "ensure_weight_tying": bool(saved) and self.tie_word_embeddings,
                "base_model_name_or_path": base_model, "inference_mode": True}

    def save(self, directory: str, base_model: str = "") -> None:
        """``adapter_model.safetensors`` + ``adapter_config.json`` into ``directory`` (the caller publishes it
        atomically)."""
        from safetensors.torch import save_file  # lazy: only the disk route writes files

        tensors = with_tied_head(self.tensors, self.tie_word_embeddings)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
            json.dump(self.config(base_model), f, indent=1)

    @classmethod
    def load(cls, directory: str) -> "AdapterExport":
        """A PEFT dir as written by :meth:`save` (or PEFT's ``save_pretrained`` of plain LoRA)."""
        with open(os.path.join(directory, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
        if str(cfg.get("peft_type", "LORA")).upper() != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
            raise ValueError(f"{directory}/{ADAPTER_CONFIG}: only plain LoRA adapters are applied (no DoRA, rsLoRA)")
        return cls(read_adapter_tensors(directory), int(cfg["r"]), float(cfg["lora_alpha"]),
                   tuple(cfg.get("modules_to_save") or ()), bool(cfg.get("ensure_weight_tying", False)))


EMBED_KEY, HEAD_KEY = SAVED_PREFIX + "model.embed_tokens.weight", SAVED_PREFIX + "lm_head.weight"


def with_tied_head(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """``tensors`` as PEFT saves them: with a saved embedding of a model whose output layer is that embedding, the
    output layer's key too (the same tensor), which ``PeftModel.from_pretrained`` looks up under
    ``ensure_weight_tying``."""
    if tied and EMBED_KEY in tensors and HEAD_KEY not in tensors:
        return {**tensors, HEAD_KEY: tensors[EMBED_KEY].clone()}  # safetensors refuses shared storage
    return tensors


ADAPTER_NON_FINITE_FIX = ("the adapter was saved from a run whose weights diverged, or the file is corrupt: use "
                          "another adapter dir (e.g. an earlier checkpoint's dist-to-peft / fsdp-to-peft export)")


def read_adapter_tensors(directory: str, what: str = "adapter dir") -> dict[str, torch.Tensor]:
    """Every tensor of the PEFT dir ``directory``'s ``adapter_model.safetensors``; one holding inf/NaN is refused
    (:class:`NonFiniteWeights` naming the tensor, the file and ``what`` read it, e.g. ``--lora-load``). Every
    reader of an adapter dir goes through here (both backends' --lora-load, the engines' adapter updates):
    was, a NaN adapter was blamed on the bridge or surfaced as "NaN logits"."""
    from safetensors.torch import load_file  # lazy: only the disk route reads files

    path = os.path.join(directory, ADAPTER_WEIGHTS)
    tensors = load_file(path)
    for name, tensor in tensors.items():
        check_finite(name, tensor, f"{what} {path}", fix=ADAPTER_NON_FINITE_FIX)
    return tensors


def is_adapter_dir(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, ADAPTER_CONFIG))


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``base + scaling * B @ A`` in float32, then ``dtype`` (default: the base's)."""
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scaling
    return (base.to(torch.float32) + delta).to(dtype or base.dtype)
