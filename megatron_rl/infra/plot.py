"""Metric curves as PNG (matplotlib, headless). Used by the loop at the end of a run and by tools/plot_run.py."""

from __future__ import annotations

import os

#: what the loop's curves.png shows; a key the run never logged is skipped, so the multi-turn ones
#: (docs/agentic.md) appear only in runs with a custom generate function or the tool loop
DEFAULT_KEYS = ["rollout/reward_mean", "eval/reward_mean", "train/kl", "train/entropy",
                "rollout/response_len_mean", "train/pg_loss", "train/grad_norm", "perf/step_time_s",
                "rollout/tool_calls_mean", "rollout/turns_mean", "rollout/tool_error_frac"]


def plot_metrics(records: list[dict], keys: list[str], out: str, title: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [k for k in keys if any(k in r for r in records)]
    if not present:
        raise ValueError(f"none of the keys {keys} are in the run; available: "
                         f"{sorted({k for r in records for k in r} - {'step', 'time', 'attempt', 'attempt_start', 'superseded'})}")
    cols = 2
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        by_step = {r["step"]: r[key] for r in records if key in r}  # one point a step: the last record's
        pts = sorted(by_step.items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return present
