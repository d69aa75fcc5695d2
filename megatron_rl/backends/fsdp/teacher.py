"""A frozen role of its own model on the FSDP backend: the teacher (or reference) whose shapes are not the actor's.

On-policy distillation's usual teacher is larger than the student (other hidden size, depth, heads; the same
vocabulary: ``roles.needs_own_model`` refuses another), so its weights cannot be a weight tag of the actor's
shards. It is an ``AutoModelForCausalLM`` of its own, loaded by the backend's ``load_hf_model`` (no LoRA: a
separate model is independent of the student's adapters) and sharded by its ``shard`` (the actor's mesh,
mixed precision and offload policy), with every parameter frozen, in eval mode and with no optimizer.

Its log-probs go through the actor's own path (``FSDPBackend.log_probs_of``): the same plan, packing, padding
fallback, loss rows and ``Spec.extract_model_output``, then the same per-sample gather, so the teacher's
log-probs of a sample are aligned and owned exactly like the actor's (``TrainBackend.forward``'s contract),
and one forward-only pass costs what the actor's costs at the teacher's size. No weights swap in or out.

Invariants: the model never trains (``requires_grad`` False everywhere, so FSDP2 reduces no gradient of it);
its parameters move with the actor's when the trainer sleeps (``FSDPBackend._move_state``); it is not part of
a checkpoint: ``--opd-teacher-load`` loads it again at resume (``runner/resume.py``), before the checkpoint.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.data.packing import MicroBatchPlan
from megatron_rl.data.types import AnySample

if TYPE_CHECKING:
    from megatron_rl.backends.fsdp.backend import FSDPBackend

log = logging.getLogger(__name__)


class FSDPFrozenModel:
    """One frozen role's own sharded HF model beside an ``FSDPBackend``'s actor (``roles.FrozenRole``)."""

    def __init__(self, backend: "FSDPBackend", role: str, hf_dir: str) -> None:
        self.backend = backend
        self.role = role
        self.source = hf_dir
        model = backend.load_hf_model(hf_dir, lora=False)
        model.requires_grad_(False)
        self.model = backend.shard(model)
        self.model.eval()
        if dist.get_rank() == 0:
            cfg = self.model.config
            log.info("%s: a model of its own from %s (%d parameters, hidden %d, %d layers), frozen", role, hf_dir,
                     sum(p.numel() for p in self.model.parameters()), cfg.hidden_size, cfg.num_hidden_layers)

    def log_probs(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan],
                  owned_only: bool) -> list[Optional[torch.Tensor]]:
        """No-grad response-aligned log-probs of every sample under this model (``TrainBackend.forward``'s
        contract: every sample's on every rank, or with ``owned_only`` this DP rank's, None elsewhere)."""
        return self.backend.log_probs_of(self.model, samples, plan, owned_only)

    def sleep(self) -> None:
        """Nothing of its own: its parameters move with the actor's (``FSDPBackend._move_state``)."""

    def wake(self) -> None:
        """Nothing of its own: its parameters come back with the actor's."""
