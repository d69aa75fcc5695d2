"""How an SGLang engine holds an HF checkpoint's tensors: its names, which HF tensors it fuses, and the slice of
each that every tensor-parallel rank keeps (SGLang 0.5.23, read from its ``srt/layers/linear.py``,
``vocab_parallel_embedding.py`` and the model classes' ``load_weights``).

Why: ``--update-weight-verify checksum`` with SGLang compares the checksums SGLang's ``/weights_checker``
reports per rank, over ITS tensors, with the trainer's checksum of the same bytes. The trainer must therefore
build, from the HF tensors it exports, exactly the tensor every engine rank holds:

* **fused**: ``q_proj`` / ``k_proj`` / ``v_proj`` (weight and bias) are one ``qkv_proj`` (rank ``r``'s q rows, then
  its k rows, then its v rows, along dim 0); ``gate_proj`` / ``up_proj`` one ``gate_up_proj`` (gate rows, up rows);
* **column parallel** (dim 0): q by heads (``num_heads / tp`` per rank); k and v by kv heads, or, with fewer kv
  heads than ranks, one kv head per rank replicated ``tp / num_kv_heads`` times (rank ``r`` holds head
  ``r // replicas``); gate and up in ``tp`` equal row blocks;
* **row parallel** (dim 1): ``o_proj.weight``, ``down_proj.weight``;
* **vocab parallel** (``embed_tokens``, ``lm_head``): the vocabulary padded to a multiple of 64 (of ``64 * tp``
  when that is not divisible by ``tp``), ``padded / tp`` rows per rank, the rows past the real vocabulary zero
  (SGLang's ``weight_loader`` fills them with 0); with tied embeddings ``lm_head`` is ``embed_tokens`` itself
  (one tensor, reported once);
* **replicated**: everything else (norms, ``q_norm`` / ``k_norm``).

Standard library only (validation asks :func:`layout_problem` before any worker starts); the torch side that
cuts and hashes is ``rollout.sglang.checksums``. Only the model families in :data:`FAMILIES` have this layout;
another family (MoE experts fused per layer, MLA, ...) is refused by name rather than compared wrongly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

# config.json model_type -> SGLang's model class with this layout (its load_weights' stacked_params_mapping is
# q/k/v -> qkv_proj, gate/up -> gate_up_proj; nothing else fused). qwen2 is checked against a real SGLang 0.5.23
# server by scripts/test_sglang_real.sh (step verify_checksums); the others share the layer classes.
FAMILIES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
}

# HF module suffix -> (SGLang fused module suffix, part)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
PARTS = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}  # in the fused tensor's order
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Piece:
    """What rank ``rank`` keeps of one HF tensor: ``length`` entries from ``start`` along ``dim`` (``dim`` None: the
    whole tensor), followed by ``pad`` zero rows (vocab padding) to make the rank's tensor."""

    dim: Optional[int] = None
    start: int = 0
    length: int = 0
    pad: int = 0


@dataclass(frozen=True)
class SGLangWeightLayout:
    """One SGLang engine's layout of a model: the HF config's shape and the engine's TP size."""

    model_type: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    tp_size: int = 1

    @classmethod
    def from_hf_config(cls, config: dict, tp_size: int = 1) -> "SGLangWeightLayout":
        c = dict(config.get("text_config") or config)
        c.setdefault("model_type", config.get("model_type"))
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        return cls(model_type=str(c.get("model_type")), num_heads=heads,
                   num_kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or hidden // heads), intermediate_size=int(c["intermediate_size"]),
                   hidden_size=hidden, vocab_size=int(c["vocab_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
                   tp_size=int(tp_size))

    # ------------------------------------------------------------------ names
    def engine_name(self, hf_name: str) -> tuple[Optional[str], Optional[str]]:
        """``(engine tensor name, part)`` of an HF tensor; part None: not fused; name None: the engine holds no
        tensor of its own for it (``lm_head.weight`` with tied embeddings)."""
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            return None, None
        module, _, leaf = hf_name.rpartition(".")
        for suffix, (fused, part) in FUSED.items():
            if module == suffix or module.endswith("." + suffix):
                return f"{module[:len(module) - len(suffix)]}{fused}.{leaf}", part
        return hf_name, None

    @staticmethod
    def parts(engine_name: str) -> tuple[str, ...]:
        """The parts a fused engine tensor is made of, in order (``()`` for a tensor that is not fused)."""
        module = engine_name.rpartition(".")[0]
        for fused, parts in PARTS.items():
            if module == fused or module.endswith("." + fused):
                return parts
        return ()

    # ----------------------------------------------------------------- slices
    def _kv(self, rank: int) -> tuple[int, int]:
        """(kv heads per rank, which kv-head block rank ``rank`` holds)."""
        if self.tp_size >= self.num_kv_heads:
            replicas = self.tp_size // self.num_kv_heads
            return 1, rank // replicas
        return self.num_kv_heads // self.tp_size, rank

    def vocab_rows(self) -> int:
        """Rows of the embedding / LM head per rank (the padded vocabulary over the TP ranks)."""
        padding = VOCAB_PADDING
        if _round_up(self.vocab_size, padding) % self.tp_size:
            padding *= self.tp_size
        return _round_up(self.vocab_size, padding) // self.tp_size

    def piece(self, engine_name: str, part: Optional[str], shape: tuple[int, ...], rank: int) -> Piece:
        """What rank ``rank`` keeps of the HF tensor of ``shape`` that is ``part`` of ``engine_name``."""
        tp = self.tp_size
        if part in ("q", "k", "v"):
            if part == "q":
                size = self.num_heads // tp * self.head_dim
                return Piece(0, rank * size, size)
            per, block = self._kv(rank)
            return Piece(0, block * per * self.head_dim, per * self.head_dim)
        if part in ("gate", "up"):
            size = shape[0] // tp
            return Piece(0, rank * size, size)
        if engine_name in VOCAB_PARALLEL:
            rows = self.vocab_rows()
            start = min(rank * rows, self.vocab_size)
            length = min(start + rows, self.vocab_size) - start
            return Piece(0, start, length, rows - length)
        if tp > 1 and any(engine_name == s or engine_name.endswith("." + s) for s in ROW_PARALLEL):
            size = shape[1] // tp
            return Piece(1, rank * size, size)
        return Piece()

    def shape_problem(self, engine_name: str, part: Optional[str], shape: tuple[int, ...]) -> Optional[str]:
        """Why this layout cannot cut an HF tensor of ``shape`` for ``tp_size`` ranks (None: it can)."""
        tp = self.tp_size
        if part is not None and self.num_heads % tp:
            return f"{self.num_heads} attention heads do not split over tp_size {tp}"
        if part in ("k", "v") and self.tp_size < self.num_kv_heads and self.num_kv_heads % tp:
            return f"{self.num_kv_heads} kv heads do not split over tp_size {tp}"
        if part in ("k", "v") and self.tp_size >= self.num_kv_heads and tp % self.num_kv_heads:
            return f"tp_size {tp} is not a multiple of the {self.num_kv_heads} kv heads"
        if part in ("gate", "up") and shape[0] % tp:
            return f"{shape[0]} rows do not split over tp_size {tp}"
        if engine_name in VOCAB_PARALLEL and shape[0] != self.vocab_size:
            return f"{shape[0]} rows, but config.json's vocab_size is {self.vocab_size}"
        if tp > 1 and any(engine_name == s or engine_name.endswith("." + s) for s in ROW_PARALLEL) \
                and (len(shape) < 2 or shape[1] % tp):
            return f"shape {list(shape)} does not split over tp_size {tp} along dim 1"
        return None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def read_hf_config(hf_checkpoint: str) -> dict:
    """``<hf_checkpoint>/config.json`` ({} when there is none or it does not parse)."""
    try:
        with open(os.path.join(hf_checkpoint, "config.json")) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def layout_problem(config: dict) -> Optional[str]:
    """Why the trainer cannot build SGLang's tensors for this HF config (None: it can): a model family whose
    SGLang class fuses other tensors than :data:`FAMILIES`' do, or a config without the shape fields."""
    model_type = (config.get("text_config") or config).get("model_type") or config.get("model_type")
    if model_type not in FAMILIES:
        return (f"config.json's model_type {model_type!r} is not one whose SGLang layout (fused tensors, TP slices) "
                f"the trainer builds; it builds {', '.join(sorted(FAMILIES))}")
    try:
        SGLangWeightLayout.from_hf_config(config)
    except (KeyError, TypeError, ValueError) as e:
        return f"config.json lacks a field the layout needs ({e})"
    return None
