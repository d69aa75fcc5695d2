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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, runtime_checkable

import torch

from megatron_rl.config.role_models import config_dir, shape_differences, shape_facts, vocab_problem
from megatron_rl.data.packing import LossDenominators, PackedBatch
from megatron_rl.errors import ConfigError

if TYPE_CHECKING:
    from megatron_rl.backends.base import DataParallelShare, TrainBatch

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


def needs_own_model(policy_dir: Optional[str], path: str, flag: str) -> bool:
    """True when the frozen weights at ``path`` are of other shapes than the policy's (``--hf-checkpoint``), so
    they need a model of their own; False when a weight tag holds them. Refuses, by flag, a model whose vocabulary
    lacks some of the policy's token ids (``config.role_models.vocab_problem``)."""
    other = config_dir(path)
    if other is None or policy_dir is None or not shape_differences(policy_dir, other):
        return False
    problem = vocab_problem(flag, path, shape_facts(other)["vocab_size"], shape_facts(policy_dir)["vocab_size"],
                            policy_dir)
    if problem:
        raise ConfigError(problem)
    return True


@runtime_checkable
class Critic(Protocol):
    """PPO's value model as a backend holds it (verl's two-method shape): values of packed micro-batches, and one
    optimizer step over a training batch. ``TrainBackend.compute_values`` and ``critic_step`` drive it.

    ``share`` is None when the critic runs over the actor's micro-batches (its layout is the actor's), else the
    critic's own ``DataParallelShare`` (its own plan, packing and gather of the batch)."""

    @property
    def share(self) -> Optional["DataParallelShare"]: ...

    def values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        """No-grad float32 response-aligned values of this rank's micro-batches, by sample index."""

    def train_on(self, batch: "TrainBatch", micro_batches: list[PackedBatch], denoms: LossDenominators,
                 spec) -> dict[str, float]:
        """One optimizer step of the value loss over ``batch`` (this rank's packed ``micro_batches`` of the actor's
        plan and their denominators, or its own share's); ``critic/*`` metrics."""


@runtime_checkable
class FrozenRole(Protocol):
    """A frozen model of its own (a teacher or reference of other shapes): log-probs of a batch, no training."""

    def log_probs(self, samples: Sequence, plan, owned_only: bool) -> list[Optional[torch.Tensor]]:
        """``TrainBackend.forward``'s contract under this role's model."""

    def sleep(self) -> None:
        """Release its device memory while a colocated engine generates (a no-op on CPU)."""

    def wake(self) -> None:
        """Undo ``sleep`` before the next pass."""
