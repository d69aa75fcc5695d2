"""The coefficient of the KL penalty folded into the rewards (``--kl-coef``): fixed, or adaptive.

Adaptive (``--kl-ctrl-type adaptive --kl-target T --kl-horizon H``) is the controller of Ziegler et al.
2019 ("Fine-Tuning Language Models from Human Preferences", sec. 2.2) as verl's ``AdaptiveKLController``
runs it: after each rollout, with ``kl`` the batch mean of each response's mean per-token KL (the
``--kl-loss-type`` estimator of old vs reference over loss tokens) and ``n`` the responses in the batch,

    e = clip(kl / T - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / H)

so beta grows while the policy drifts further than ``T`` from the reference and shrinks while it stays
closer. The step uses beta as it was before the update (verl's order). Why it is state: beta after step
``k`` depends on every earlier batch, so it travels in the checkpoint (``Spec.state_dict``) and a resumed
run continues from the same value bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

KL_CTRL_TYPES = ("fixed", "adaptive")
_ERROR_CLIP = 0.2  # verl's and the paper's bound on the proportional error


@dataclass
class KLController:
    value: float  # beta, the current coefficient (--kl-coef at the start)
    target: Optional[float] = None  # --kl-target: None for the fixed controller
    horizon: Optional[float] = None  # --kl-horizon

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, current_kl: float, n_steps: int) -> None:
        """verl's ``update(current_kl, n_steps)``: a no-op for the fixed controller."""
        if self.target is None or self.horizon is None:
            return
        error = min(max(current_kl / self.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value} if self.adaptive else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive and "value" in state:
            self.value = float(state["value"])


def mean_sequence_kl(kl: torch.Tensor, mask: torch.Tensor, lengths: Sequence[int]) -> float:
    """verl's ``current_kl``: each response's mean KL over its loss tokens, then the mean over responses
    (a response without loss tokens counts 0, as verl's masked mean of an empty row gives)."""
    if not len(lengths):
        return 0.0
    per_seq = []
    for k, m in zip(torch.split(kl.double() * mask.double(), list(lengths)), torch.split(mask.double(),
                                                                                       list(lengths))):
        tokens = float(m.sum())
        per_seq.append(float(k.sum()) / tokens if tokens else 0.0)
    return sum(per_seq) / len(per_seq)
