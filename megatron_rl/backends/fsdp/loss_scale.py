"""fp16 loss scaling for the FSDP backend, with megatron-core's semantics.

Why: fp16 has 5 exponent bits, so small gradients underflow to zero; the loss is multiplied
by a large scale before the backward and the gradients divided by it before the step. A
step whose gradients overflowed (inf/NaN anywhere, on any rank) is skipped and the scale
backs off. ``--fp16`` must mean the same under both backends, so this is megatron-core's
``ConstantGradScaler`` / ``DynamicGradScaler`` (``megatron/core/optimizer/grad_scaler.py``)
with the same flags and defaults (``--loss-scale``, ``--initial-loss-scale`` 2**32,
``--min-loss-scale`` 1, ``--loss-scale-window`` 1000, ``--hysteresis`` 2, growth x2,
back-off x0.5), written on plain floats so it runs without megatron-core and without
CUDA. ``tests/backends/test_fsdp_loss_scale.py`` replays overflow patterns through both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

GROWTH_FACTOR = 2.0  # megatron-core get_megatron_optimizer's DynamicGradScaler arguments
BACKOFF_FACTOR = 0.5


@dataclass
class LossScaler:
    """``constant`` (``--loss-scale``) or dynamic; ``update(found_inf)`` after every step."""

    scale: float
    dynamic: bool = True
    min_scale: float = 1.0
    growth_interval: int = 1000
    hysteresis: int = 2
    growth_tracker: int = 0
    hysteresis_tracker: int = 2

    @classmethod
    def from_precision(cls, pr) -> "LossScaler":
        if pr.loss_scale:
            return cls(scale=float(pr.loss_scale), dynamic=False)
        return cls(scale=float(pr.initial_loss_scale), min_scale=float(pr.min_loss_scale),
                   growth_interval=int(pr.loss_scale_window), hysteresis=int(pr.hysteresis),
                   hysteresis_tracker=int(pr.hysteresis))

    def update(self, found_inf: bool) -> None:
        """megatron-core ``DynamicGradScaler.update``: an overflow resets the growth count and
        spends one unit of hysteresis; out of hysteresis, every further overflow halves the
        scale (not below the minimum). ``growth_interval`` clean steps in a row double it and
        refill the hysteresis."""
        if not self.dynamic:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * BACKOFF_FACTOR, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * GROWTH_FACTOR

    def unscale_and_check(self, grads: Iterable[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> bool:
        """Divide the gradients by the scale in place; True when any element, on any rank of
        ``group``, is inf or NaN (then the step must be skipped on every rank).

        ``grads`` are this rank's local tensors (an FSDP shard's ``to_local()``). The flag is
        reduced with MAX on the gradients' own device (with --optimizer-cpu-offload the CPU:
        the process group then needs a gloo backend for CPU tensors)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            if g.numel():
                by_device.setdefault(g.device, []).append(g)
        found = torch.zeros(1, dtype=torch.float32)
        for device, tensors in by_device.items():
            flag = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv)
            found += flag.cpu()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            device = next(iter(by_device), torch.device("cpu"))
            found = found.to(device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
