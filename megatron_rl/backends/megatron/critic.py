"""PPO's critic (value model) on megatron-core, colocated with the actor (``--advantage-estimator ppo``).

The critic is a role (``backends/roles.py``): a second ``GPTModel`` built on the actor's ranks by
``role_model.RoleModel``, as the actor is, whose output layer is a ``[hidden -> 1]`` value head
(``role_model.ValueHead``, slime's ``LinearForLastLayer``); it has its own DDP (grad buffers), its own
megatron optimizer (distributed when the actor's is) and its own LR schedule (``--critic-lr``,
``--critic-lr-warmup-iters``). It starts from the actor's initial weights, or from
``--critic-hf-checkpoint`` / ``--critic-load`` (a model-only torch_dist dir), with a fresh head (normal,
std ``init_method_std``, zero bias, from ``--seed``, so every rank draws the same head). Its bridge is
its own: ``--critic-hf-checkpoint`` (or ``--critic-load``'s ``hf_config/``) may be a model of another
size or family than the policy (same tokenizer: it reads the policy's samples).

LoRA (``--lora-rank``): the critic gets adapters of its own (the actor's targets, rank and alpha; fresh, B = 0)
on its frozen trunk, and its value head trains in full, as verl's critic with ``lora_rank``. Its checkpoint
entries are whole (the frozen trunk too: a resume needs nothing else), unlike the actor's adapters-only ones.

Layout: the actor's by default. Its own (``--critic-tensor-model-parallel-size``,
``--critic-pipeline-model-parallel-size``, slime's critic role in ``--megatron-config-path``;
never virtual pipeline stages or context parallelism, so an actor with them has a critic without
them) is a :class:`~megatron_rl.models.parallel.LayoutScope` over the same ranks: the critic's own
process-group collection, which its model, DDP, optimizer and schedule are given, and megatron's parallel
state of its layout, swapped in around the calls that still read it (``role_model.py``). Its DP size
is then what its layout leaves of the ranks, and it plans, packs and gathers its own share of the
batch (``CriticShare``); PPO holds the whole batch on every rank, so nothing else moves.

Token alignment: the value of response token ``t`` is the head's output at the position whose
hidden state predicts ``t`` (``PackedBatch.response_positions``), the state before the token
is generated: the alignment of the log-probs (slime's ``get_values``, verl's ``values[:, -R-1:-1]``).
Values are 0.0 at tokens without loss (every consumer masks them).

Gradient algebra: without sequence parallelism the hidden states are replicated over TP, so
every TP rank computes the same values and loss and the head's and the trunk's gradients are
already whole on each rank (no TP reduction: that would count them TP times). With sequence
parallelism each rank runs the head on its slice of the tokens, the values are all-gathered
(backward: the split, ``tensor_parallel_output_grad=False``) and the head's parameters are
marked ``sequence_parallel`` so ``finalize_model_grads`` sums their partial gradients over TP,
as megatron does for layer norms. Losses are globally normalised SUMs as the actor's
(``calculate_per_token_loss``, DDP sums over DP): see ``backend.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.backends.base import TrainBatch, critic_step_metrics
from megatron_rl.backends.megatron.role_model import (Optimization, RoleAttributes, RoleModel, RoleShare, ValueHead,
                                                     load_model_dir, lora_spec, role_layout)
from megatron_rl.infra.checkpoint_root import is_model_dir
from megatron_rl.config.role_models import config_dir
from megatron_rl.data.packing import LossDenominators, PackedBatch
from megatron_rl.errors import BackendError, CheckpointError
from megatron_rl.models import get_bridge
from megatron_rl.models.parallel import LayoutScope, ParallelLayout

log = logging.getLogger(__name__)

__all__ = ["MegatronCritic", "ValueHead", "critic_layout"]


def critic_layout(cfg, actor: ParallelLayout) -> ParallelLayout:
    """The critic's layout: ``--critic-tensor/pipeline-model-parallel-size`` where given (``role_layout``)."""
    p = cfg.parallel
    return role_layout(cfg, actor, p.critic_tensor_model_parallel_size, p.critic_pipeline_model_parallel_size)


class MegatronCritic(RoleAttributes):
    """The value model beside a ``MegatronBackend``'s actor (module docstring); ``roles.Critic``."""

    def __init__(self, backend, cfg) -> None:
        self.backend = backend
        self.cfg = cfg
        self.scope = LayoutScope(critic_layout(cfg, backend.layout), backend.layout)
        # its own share of each batch when its layout is not the actor's; else the actor's micro-batches serve
        self.share: Optional[RoleShare] = None if self.scope.same else RoleShare(cfg, self.scope,
                                                                               backend.pad_token_id)
        hf_dir, dist_dir = cfg.checkpoint.critic_hf_checkpoint, cfg.checkpoint.critic_load
        # the critic's own architecture: its HF dir's, or the model dir's recorded source config, else the actor's
        self.config_dir = hf_dir or (dist_dir and config_dir(dist_dir)) or cfg.model.hf_checkpoint
        self.bridge = backend.bridge if self.config_dir == cfg.model.hf_checkpoint else get_bridge(self.config_dir)
        source = hf_dir or dist_dir or "the actor's initial weights"
        opt = cfg.optimizer
        lr = opt.critic_lr if opt.critic_lr is not None else opt.lr
        self.role = RoleModel("critic", cfg, self.bridge, self.scope, params_dtype=backend.params_dtype, head="value",
                              load=self._load, optimization=Optimization(lr, opt.critic_lr_warmup_iters),
                              lora=lora_spec(cfg))
        if dist.get_rank() == 0:
            log.info("%s", self.role.describe(source, self.share.dp_size if self.share is not None else None))

    def _load(self, chunks: list) -> None:
        """The trunk's initial weights, loaded while the output layer is still the policy's (``RoleModel``)."""
        from megatron_rl.models import model_dir  # lazy: checksums of the HF dir

        backend, cfg = self.backend, self.cfg
        hf_dir, dist_dir = cfg.checkpoint.critic_hf_checkpoint, cfg.checkpoint.critic_load
        if hf_dir:
            model_dir.check_hf_marker_once(hf_dir, f"checking --critic-hf-checkpoint {hf_dir}")
            self.bridge.load_hf_weights(chunks, hf_dir)
        elif dist_dir:
            self._load_dist_trunk(chunks, dist_dir, self.config_dir)
        elif self.share is not None or backend.lora:  # the actor's initial weights from their source (another
            # layout's shards, or an actor whose linears carry adapters): into the critic's own
            load = cfg.checkpoint.load
            if load is not None and model_dir.is_model_dir(load):
                self._load_dist_trunk(chunks, load, cfg.model.hf_checkpoint, flag="--load")
            else:
                model_dir.check_hf_marker_once(cfg.model.hf_checkpoint,
                                               f"checking --hf-checkpoint {cfg.model.hf_checkpoint}")
                self.bridge.load_hf_weights(chunks, cfg.model.hf_checkpoint)
        else:  # the actor's initial weights (HF or a --load model dir): the same layout, the same names
            with torch.no_grad():
                for actor, critic in zip(backend.chunks, chunks):
                    theirs = dict(actor.named_parameters())
                    for name, p in critic.named_parameters():
                        p.copy_(theirs[name])

    def _load_dist_trunk(self, chunks: list, path: str, hf_dir: str, flag: str = "--critic-load") -> None:
        """``--critic-load`` (or the actor's ``--load`` model dir, for a critic of its own layout): a model-only
        torch_dist dir, checked as ``--load``'s (marker, checksums, the model's fingerprint and every tensor's
        shape) and loaded while the output layer is still the policy's."""
        if not is_model_dir(path):
            raise CheckpointError(f"{flag} {path} is not a model-only torch_dist dir (a training checkpoint "
                                  "holds a critic beside the actor and resumes from --load/--save); give what "
                                  "convert_ckpt.py hf-to-dist writes, or use --critic-hf-checkpoint")
        load_model_dir(chunks, path, self.bridge, hf_dir)

    # ---- passes ---------------------------------------------------------------

    def train_on(self, batch: TrainBatch, micro_batches: list[PackedBatch], denoms: LossDenominators,
                 spec) -> dict[str, float]:
        """One critic step over ``batch``: over the actor's micro-batches and denominators, or with a layout of
        its own over its own plan of the same samples (its DP ranks' shares and theirs of the denominators)."""
        if self.share is not None:
            if batch.old_values is None or batch.returns is None:
                raise BackendError("a critic step needs the batch's old values and returns")
            plan = self.share.plan_micro_batches(batch.samples)
            _, micro_batches, own = self.share.preprocess_rollout_data(batch.samples, batch, plan=plan)
            assert own is not None, "a training batch has loss denominators"
            denoms = own
        return self.train_step(micro_batches, denoms, spec)

    def values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        """No-grad values of this rank's micro-batches, by sample index (float32, response-aligned)."""
        return self.role.forward_only((), micro_batches, spec=None)

    def train_step(self, micro_batches: list[PackedBatch], denoms: LossDenominators, spec) -> dict[str, float]:
        """One critic optimizer step over this rank's micro-batches; ``critic/*`` metrics (docs/metrics.md)."""
        t0 = time.perf_counter()

        def loss_fn(mb, values, output):
            assert mb.old_values is not None and mb.returns is not None, "packed with the critic's fields"
            return spec.compute_value_loss(values, mb.old_values, mb.returns, mb.loss_mask, mb.response_lengths,
                                           denoms)

        step = self.role.train_pass((), micro_batches, loss_fn)
        return critic_step_metrics(step.metrics, grad_norm=step.grad_norm, lr=self.optimizer.param_groups[0]["lr"],
                                   update_ok=step.update_ok, started=t0)

    # ---- memory ---------------------------------------------------------------

    def sleep(self) -> None:
        self.role.sleep()

    def wake(self) -> None:
        self.role.wake()

    def named_local_params(self) -> Sequence[tuple[str, torch.Tensor]]:
        return list(self.role.named_local_params())
