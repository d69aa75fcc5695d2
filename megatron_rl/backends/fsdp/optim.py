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

import math
from typing import Iterable

import torch

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
        total = max(1, cfg.rollout.num_rollout * cfg.batching.optimizer_steps_per_rollout
                    * cfg.algorithm.num_steps_per_rollout_updates)
        return cls(optimizer, max_lr=opt.lr, min_lr=opt.min_lr, warmup_steps=opt.lr_warmup_iters,
                   decay_steps=opt.lr_decay_iters or total, decay_style=opt.lr_decay_style,
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
