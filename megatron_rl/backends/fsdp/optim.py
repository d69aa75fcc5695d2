"""Optimizer, LR schedule and gradient clipping for the FSDP backend, with megatron's semantics.

The flags (``--optimizer --lr --min-lr --lr-decay-style --lr-warmup-iters
--lr-decay-iters --weight-decay --adam-beta1/2 --adam-eps --grad-clip``) must mean
the same thing under both backends, so a run can switch backend and keep its
hyper-parameters. Megatron-core's ``OptimizerParamScheduler`` drives a megatron
optimizer and would pull megatron-core into an HF-native backend; ``MegatronLRSchedule``
is the same formula on a plain ``torch.optim`` optimizer (tests compare the numbers).

What megatron-core does, and this copies:
* parameter groups: no weight decay on biases and 1-D parameters (norm weights);
* ``adam`` is decoupled-weight-decay Adam (megatron's CPU fallback is ``torch.optim.AdamW``),
  ``sgd`` is SGD with momentum 0.9 (``OptimizerConfig.sgd_momentum``'s default);
* the scheduler sets each group's LR before every step from the number of steps taken
  (warm-up from 0 when ``--lr-warmup-iters`` > 0, then the decay style down to ``--min-lr``);
* clipping: ``coef = max_norm / (norm + 1e-6)``, applied only when below 1, on the L2 norm of
  all gradients (``--grad-clip 0`` only measures the norm).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from megatron_rl.backends.fsdp.loss_scale import LossScaler

log = logging.getLogger(__name__)

SGD_MOMENTUM = 0.9  # megatron-core OptimizerConfig.sgd_momentum default


def param_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    """Megatron's default groups: weight decay on matrices, none on biases and 1-D parameters."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]


def build_optimizer(opt_cfg, groups: list[dict]) -> torch.optim.Optimizer:
    """``torch.optim`` optimizer for ``--optimizer`` (LR and weight decay are set by the schedule)."""
    if opt_cfg.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
                                 eps=opt_cfg.adam_eps, weight_decay=opt_cfg.weight_decay)
    if opt_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=SGD_MOMENTUM, weight_decay=opt_cfg.weight_decay)
    raise ValueError(f"--optimizer {opt_cfg.optimizer!r} is not supported by the fsdp backend")


class MegatronLRSchedule:
    """megatron-core ``OptimizerParamScheduler.get_lr`` for constant / linear / cosine /
    inverse-square-root decay, constant weight decay; ``step()`` after each optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_lr: float, min_lr: float, warmup_steps: int,
                 decay_steps: int, decay_style: str, weight_decay: float):
        if decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"--lr-decay-style {decay_style!r} is not supported")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.init_lr = 0.0 if warmup_steps else max_lr
        self.warmup_steps = warmup_steps
        self.decay_steps = max(decay_steps, warmup_steps + 1)  # as the megatron backend passes it
        self.decay_style = decay_style
        self.weight_decay = weight_decay
        self.num_steps = 0
        self._apply()

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, cfg) -> "MegatronLRSchedule":
        """The same arguments ``MegatronBackend.initialize`` gives megatron's scheduler."""
        opt = cfg.optimizer
        return cls(optimizer, max_lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.lr_warmup_iters,
                   decay_steps=opt.lr_decay_iters or _total_steps(cfg), decay_style=opt.lr_decay_style,
                   weight_decay=opt.weight_decay)

    @classmethod
    def for_critic(cls, optimizer: torch.optim.Optimizer, cfg) -> "MegatronLRSchedule":
        """PPO's critic: the arguments ``MegatronCritic`` gives megatron's scheduler (``--critic-lr``, default
        ``--lr``; ``--critic-lr-warmup-iters``; ``--min-lr`` capped at that peak; the actor's decay)."""
        opt = cfg.optimizer
        lr = opt.critic_lr if opt.critic_lr is not None else opt.lr
        return cls(optimizer, max_lr=lr, min_lr=min(opt.min_lr, lr), warmup_steps=opt.critic_lr_warmup_iters,
                   decay_steps=opt.lr_decay_iters or _total_steps(cfg), decay_style=opt.lr_decay_style,
                   weight_decay=opt.weight_decay)

    def lr(self, num_steps: int) -> float:
        if self.warmup_steps > 0 and num_steps <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * float(num_steps) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if num_steps > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * warmup ** 0.5 / (max(num_steps, 1) ** 0.5))
        ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self) -> None:
        lr = self.lr(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


def _total_steps(cfg) -> int:
    """The run's optimizer steps (the decay length when ``--lr-decay-iters`` is unset), as the megatron backend
    counts them."""
    return max(1, cfg.rollout.num_rollout * cfg.batching.optimizer_steps_per_rollout
               * cfg.algorithm.num_steps_per_rollout_updates)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """L2 norm of all gradients (sharded DTensors reduced over their mesh); scale them by
    ``max_norm / (norm + 1e-6)`` when that is below 1 (megatron's rule). Returns the norm
    before clipping; a non-finite norm is returned without touching the gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):  # a DTensor (partial over the data-parallel mesh)
        norm = norm.full_tensor()
    total = float(norm)
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1.0e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
    return total


@dataclass(frozen=True)
class StepOutcome:
    """What one ``optimizer_step`` did: ``loss_scale`` is the scale this step's loss was multiplied by (--fp16)."""

    update_ok: bool
    grad_norm: float
    loss_scale: Optional[float]


def optimizer_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler: MegatronLRSchedule,
                   loss_scaler: Optional[LossScaler], grad_clip: float, model_name: str) -> StepOutcome:
    """The step after the backward, in megatron's order: unscale + overflow check (--fp16), scale update, clip,
    then the optimizer and schedule step unless the gradients overflowed or their norm is not finite (skipped on
    every rank alike: the flag and the norm are reduced). Gradients are zeroed after. The actor and PPO's critic
    step alike, each with its own optimizer, schedule and scaler; ``model_name`` names it in the warnings."""
    overflow = False
    loss_scale = None
    if loss_scaler is not None:
        loss_scale = loss_scaler.scale
        overflow = loss_scaler.unscale_and_check(
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None))
        loss_scaler.update(overflow)
    grad_norm = math.nan if overflow else clip_grad_norm(params, grad_clip)
    update_ok = not overflow and math.isfinite(grad_norm)
    if update_ok:
        optimizer.step()
        scheduler.step()
    elif overflow:
        assert loss_scaler is not None, "only the loss scaler reports an overflow"
        log.warning("%s: fp16 gradients overflowed at loss scale %g: optimizer step skipped, scale now %g",
                    model_name, loss_scale, loss_scaler.scale)
    else:
        log.warning("%s: non-finite gradient norm (%s): optimizer step skipped", model_name, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(update_ok, grad_norm, loss_scale)


def train_on_micro_batches(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: MegatronLRSchedule,
                           loss_scaler: Optional[LossScaler], grad_clip: float, model_name: str,
                           micro_batches: Sequence, loss_of: Callable) -> tuple[StepOutcome, list]:
    """One optimizer step of ``model`` (the actor or PPO's critic) over this rank's micro-batches: each
    ``loss_of(mb) -> (loss, metrics)`` is scaled (--fp16) and backpropagated into ``.grad`` (the losses are
    globally normalised sums, so gradients accumulate by summing), then :func:`optimizer_step`. Returns its
    outcome and each micro-batch's metrics."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    parts = []
    for mb in micro_batches:
        loss, metrics = loss_of(mb)
        if loss_scaler is not None:
            loss = loss * loss_scaler.scale
        loss.backward()
        parts.append(metrics)
    params = [p for p in model.parameters() if p.requires_grad]
    return optimizer_step(params, optimizer, scheduler, loss_scaler, grad_clip, model_name), parts
