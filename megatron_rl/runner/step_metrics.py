"""One rollout's training metrics from its optimizer steps' own metrics.

A rollout trains in several optimizer steps (``samples / --global-batch-size`` x
``--num-steps-per-rollout-updates``); the backend reports each step's metrics and
the loop logs one record per rollout, so the steps must be combined, not the last
one kept. The rule per metric (docs/metrics.md says the same):

* per-token means (``train/pg_loss``, ``train/kl``, ``train/entropy``, ``train/clip_frac``,
  every other metric the loss reports over loss tokens): mean over all the rollout's
  loss tokens, i.e. each step's mean weighted by its ``train/loss_tokens``, so the
  value equals one mean over every token trained on, however the steps split them;
* ``train/grad_norm``, ``train/lr``: plain mean over the optimizer steps (one value per
  step, no token count behind it);
* counts and durations (``train/loss_tokens``, ``train/micro_batches``,
  ``train/update_skipped``, ``train/step_time_s``): sum over the steps;
* maxima (names ending in ``_max``, e.g. ``train/tis_ratio_max``): the largest over the steps;
* ``train/num_optimizer_steps``: how many steps were combined (absent when the actor did not train:
  ``--num-critic-only-steps``, where only ``critic/*`` is reported).

The critic's (``critic/*``, ``--advantage-estimator ppo``) follow the same rules: its loss metrics are
means over the same loss tokens, ``critic/grad_norm`` and ``critic/lr`` step means.
"""

from __future__ import annotations

import math

TOKEN_WEIGHT = "train/loss_tokens"
SUMMED = frozenset({TOKEN_WEIGHT, "train/micro_batches", "train/update_skipped", "train/step_time_s",
                    "critic/update_skipped", "critic/step_time_s"})
STEP_MEAN = frozenset({"train/grad_norm", "train/lr", "critic/grad_norm", "critic/lr"})
NUM_STEPS = "train/num_optimizer_steps"


def aggregate_step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-step metric dicts by the rules above (every step must report the same names)."""
    if not steps:
        return {}
    names = list(steps[0])
    for i, step in enumerate(steps[1:], 1):
        if set(step) != set(names):
            raise ValueError(f"optimizer step {i} reported metrics {sorted(set(step) ^ set(names))} that step 0 "
                             "did not (or the reverse); a backend must report the same names every step")
    weights = [float(s.get(TOKEN_WEIGHT, 0.0)) for s in steps]
    total = math.fsum(weights)
    out: dict[str, float] = {}
    for name in names:
        values = [float(s[name]) for s in steps]
        if name in SUMMED:
            out[name] = math.fsum(values)
        elif name.endswith("_max"):
            out[name] = max(values)
        elif name in STEP_MEAN or total <= 0:
            out[name] = math.fsum(values) / len(values)
        else:
            out[name] = math.fsum(v * w for v, w in zip(values, weights)) / total
    if any(name.startswith("train/") for name in names):
        out[NUM_STEPS] = float(len(steps))
    return out
