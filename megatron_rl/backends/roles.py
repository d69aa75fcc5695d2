"""Models by role: which models a run trains or consults, each a model with a job.

A run holds up to five roles on the trainer's ranks (``role_specs``):

========  ==========================  =========  ==========================================
role      job (head)                  trains     source
========  ==========================  =========  ==========================================
actor     log-probs of the policy     yes        --hf-checkpoint / --load
critic    values (ppo)                yes        --critic-hf-checkpoint / --critic-load / the actor's
ref       log-probs (KL reference)    no         --ref-load, or the initial policy
teacher   log-probs (on-policy dist.) no         --opd-teacher-load
========  ==========================  =========  ==========================================

A frozen role whose shapes equal the actor's is a *weight tag* (``base.WeightManager``): a copy of
the actor's parameter shards swapped in place, no second model (the cheap path, every layout for
free). A frozen role of other shapes (a larger teacher, the usual distillation case) is a model of
its own, built by the backend's one build function from its own config, frozen, with no optimizer;
``needs_own_model`` decides which, from the two ``config.json`` files alone.

A role's model is built once per backend by one function (``backends/megatron/role_model.py``,
``backends/fsdp``'s ``load_hf_model`` + ``shard``): actor and critic differ only in their head
(log-probs or a ``[hidden -> 1]`` value head), their source and their optimizer's learning rate.
The critic's job is the small typed interface :class:`Critic` (verl's two-method shape), which both
backends implement.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

# SHAPE_FIELDS and shape_differences are this module's names too: the backends read them from here
from megatron_rl.config.role_shapes import SHAPE_FIELDS, other_shapes, shape_differences  # noqa: F401
from megatron_rl.data.packing import LossDenominators, PackedBatch
from megatron_rl.models.model_dir import HF_CONFIG_SUBDIR


@dataclass(frozen=True)
class RoleSpec:
    """One role of the run: what it computes, whether it trains, where its weights come from."""

    name: str  # "actor", "critic", "ref", "teacher"
    head: str  # "logprob" or "value"
    trainable: bool
    source: Optional[str]  # a dir (HF or torch_dist); None: the actor's initial weights (ref: the initial policy)
    flag: str  # the flag that names the source, for messages


def role_specs(cfg) -> dict[str, RoleSpec]:
    """The run's roles, by name, from the flags (every one the step will consult)."""
    ck, alg = cfg.checkpoint, cfg.algorithm
    roles = {"actor": RoleSpec("actor", "logprob", True, cfg.model.hf_checkpoint, "--hf-checkpoint")}
    if alg.advantage_estimator == "ppo":
        roles["critic"] = RoleSpec("critic", "value", True, ck.critic_hf_checkpoint or ck.critic_load,
                                   "--critic-hf-checkpoint" if ck.critic_hf_checkpoint else "--critic-load")
    if ck.ref_load or alg.use_kl_loss or alg.kl_coef > 0:
        roles["ref"] = RoleSpec("ref", "logprob", False, ck.ref_load, "--ref-load")
    if ck.opd_teacher_load:
        roles["teacher"] = RoleSpec("teacher", "logprob", False, ck.opd_teacher_load, "--opd-teacher-load")
    return roles


def config_dir(path: str) -> Optional[str]:
    """The dir holding the ``config.json`` of the model at ``path``: an HF dir itself, a torch_dist model dir's
    ``hf_config/``; None when neither has one (a training checkpoint root: the actor's shapes by definition)."""
    for d in (path, os.path.join(path, HF_CONFIG_SUBDIR)):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    return None


def needs_own_model(policy_dir: Optional[str], path: str, flag: str) -> bool:
    """True when the frozen weights at ``path`` are of other shapes than the policy's (``--hf-checkpoint``), so
    they need a model of their own; False when a weight tag holds them. Refuses, by flag, a model of another
    vocabulary (its log-probs would be over other tokens: distillation needs the student's tokenizer). The
    rule itself is ``config.role_shapes``' (validation applies it too)."""
    other = config_dir(path)
    if other is None or policy_dir is None:
        return False
    return other_shapes(policy_dir, other, path, flag)


@runtime_checkable
class Critic(Protocol):
    """PPO's value model as a backend holds it: values of packed micro-batches, and one optimizer step.

    ``share`` is None when the critic runs over the actor's micro-batches (its layout is the actor's), else the
    critic's own ``DataParallelShare`` (its own plan, packing and gather of the batch)."""

    share: Optional[object]
    optimizer_steps: int

    def values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        """No-grad float32 response-aligned values of this rank's micro-batches, by sample index."""

    def train_step(self, micro_batches: list[PackedBatch], denoms: LossDenominators, spec) -> dict[str, float]:
        """One optimizer step of the value loss over this rank's micro-batches; ``critic/*`` metrics."""


@runtime_checkable
class FrozenRole(Protocol):
    """A frozen model of its own (a teacher or reference of other shapes): log-probs of a batch, no training."""

    def log_probs(self, samples: Sequence, plan, owned_only: bool) -> list[Optional[torch.Tensor]]:
        """``TrainBackend.forward``'s contract under this role's model."""
