"""Metrics: one dict per step to the console, JSONL, TensorBoard and W&B.

Only the driver rank (global rank 0) constructs real sinks; other ranks get a
tracker whose ``log`` does nothing, so call sites never branch on rank. W&B and
TensorBoard are optional: asked for (``--wandb-project``, ``--tensorboard-dir``) but
not installed, installed but raising on import, or ``wandb.init`` failing, is a
ConfigError at start-up naming the package and the flag, not a crash or a traceback.
``offline`` mode needs no network. slime's ``--wandb-team`` (entity), ``--wandb-host`` (a
self-hosted server) and ``--wandb-key`` (``wandb.login``, skipped offline as slime does; the key
is redacted from the logged config) are passed through.
The W&B run id is returned so ``resume_state.json`` can continue the same run.

Attempts (docs/metrics.md, "Resumed runs"): each launch on one output dir is an attempt, numbered in
``metrics.jsonl`` (``attempt`` in every record). An attempt begins at a step (:meth:`Tracker.begin_attempt`:
0, or the step of the checkpoint it resumed); the records of earlier attempts that it rolls back (a greater
step, or its own start step's start record) are rewritten with ``"superseded": true`` (atomically: a reader
sees the old file or the new one), so the run's curve is the records without it (:func:`final_lineage`).
TensorBoard's events beyond the start step are purged (``SummaryWriter(purge_step=...)``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Literal, Optional, TextIO, cast

from megatron_rl.errors import ConfigError
from megatron_rl.infra.atomic import atomic_write_text

log = logging.getLogger("megatron_rl")

#: bookkeeping keys of a metrics record beside ``step`` and ``time`` (docs/metrics.md)
ATTEMPT, ATTEMPT_START, SUPERSEDED = "attempt", "attempt_start", "superseded"


def _scalar_items(metrics: dict[str, Any]):
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield key, value


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def format_metrics(step: int, metrics: dict[str, Any], keys: Optional[list[str]] = None) -> str:
    items = dict(_scalar_items(metrics))
    shown = [k for k in (keys or []) if k in items] or sorted(items)  # nothing selected: show all
    parts = [f"{k}={items[k]:.4g}" for k in shown]
    return f"step {step}: " + " ".join(parts)


#: ``wandb.init(mode=...)``; ``--wandb-mode``'s choices keep the flag's string to these.
WandbMode = Literal["online", "offline", "disabled"]


class Tracker:
    def __init__(self, run_dir: str, *, enabled: bool = True, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_group: Optional[str] = None,
                 wandb_mode: str = "online", wandb_resume_id: Optional[str] = None,
                 config: Optional[dict] = None, console_keys: Optional[list[str]] = None,
                 wandb_entity: Optional[str] = None, wandb_host: Optional[str] = None,
                 wandb_key: Optional[str] = None):
        self.enabled = enabled
        self.console_keys = console_keys
        self.wandb_run_id: Optional[str] = wandb_resume_id
        self.attempt: Optional[int] = None  # set by begin_attempt
        self._jsonl: Optional[TextIO] = None
        self._tb = None
        self._tb_dir = tensorboard_dir
        self._summary_writer: Any = None  # the class, imported (and checked) at start-up; made by begin_attempt
        self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(f"--tensorboard-dir needs the tensorboard package ({exc}); "
                                  "pip install tensorboard") from None
            except Exception as exc:  # noqa: BLE001 - installed but broken: asked for, so an error
                raise ConfigError(f"--tensorboard-dir {tensorboard_dir} needs the tensorboard package, which is "
                                  f"installed but fails to import ({_one_line(exc)}); repair it (pip install -U "
                                  "tensorboard) or drop --tensorboard-dir") from None
            self._summary_writer = SummaryWriter
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ConfigError("--wandb-project needs the wandb package: pip install 'megatron_rl[wandb]'") from None
            except Exception as exc:  # noqa: BLE001
                raise ConfigError(f"--wandb-project {wandb_project} needs the wandb package, which is installed but "
                                  f"fails to import ({_one_line(exc)}); repair it (pip install -U wandb) or drop "
                                  "--wandb-project") from None
            try:
                if wandb_key and wandb_mode == "online":  # no login offline (as slime) or disabled
                    wandb.login(key=wandb_key, host=wandb_host)
                settings = wandb.Settings(base_url=wandb_host) if wandb_host else None
                run = wandb.init(project=wandb_project, group=wandb_group, entity=wandb_entity,
                                 mode=cast(WandbMode, wandb_mode), dir=run_dir, id=wandb_resume_id,
                                 resume="allow" if wandb_resume_id else None, config=redact_secrets(config or {}), settings=settings)
            except Exception as exc:  # noqa: BLE001 - login, network, bad id: a start-up error, not a traceback
                raise ConfigError(f"--wandb-project {wandb_project}: wandb.init failed ({_one_line(exc)}); fix the "
                                  "W&B setup, use --wandb-mode offline, or drop --wandb-project") from None
            self._wandb = run
            self.wandb_run_id = run.id

    def begin_attempt(self, start_step: int) -> None:
        """This launch continues the run from ``start_step`` (0: from the start; else the step of the checkpoint
        it resumed): it becomes the next attempt, and the earlier attempts' records it rolls back are marked
        superseded (see :func:`supersede`); TensorBoard hides their events. Once, before the first :meth:`log`
        (a tracker that logs without it begins at step 0)."""
        if self.attempt is not None:
            raise RuntimeError(f"attempt {self.attempt} already begun")
        if not self.enabled:
            self.attempt = 0
            return
        assert self._jsonl is not None, "__init__ opens it whenever the tracker is enabled"
        self._jsonl.close()
        with open(self.jsonl_path) as fh:
            text = fh.read()
        self.attempt, lines, rolled_back = supersede(text.splitlines(keepends=True), start_step)
        if "".join(lines) != text:
            atomic_write_text(self.jsonl_path, "".join(lines))
        if rolled_back:
            log.info("%s: attempt %d resumes at step %d; %d record(s) of the earlier attempts' steps %s marked "
                     "\"superseded\": true (the run's curve: the records without it)", self.jsonl_path,
                     self.attempt, start_step, len(rolled_back), _ranges(sorted(set(rolled_back))))
        self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if self._summary_writer is not None:
            # events at steps the earlier attempts logged beyond this start are hidden (step 0 is only ever a
            # start record: a fresh start hides them all); the first attempt purges nothing
            purge = None if self.attempt == 1 else start_step + 1 if start_step else 0
            self._tb = self._summary_writer(self._tb_dir, purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any], *, attempt_start: bool = False) -> None:
        """One record; ``attempt_start``: the record an attempt logs at its start step (its first weight sync
        and start-up times), superseded by the next attempt that starts at the same step."""
        if not self.enabled:
            return
        if self.attempt is None:
            self.begin_attempt(0)
        scalars = dict(_scalar_items(metrics))
        record = {"step": step, "time": time.time(), ATTEMPT: self.attempt, **scalars}
        if attempt_start:
            record[ATTEMPT_START] = True
        assert self._jsonl is not None, "__init__ opens it whenever the tracker is enabled"
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        print(format_metrics(step, scalars, self.console_keys), flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


SECRET_KEYS = ("wandb_key",)


def redact_secrets(config: dict) -> dict:
    """A copy of ``config`` (nested dicts too) with API keys replaced, for what W&B stores and shows."""
    return {k: ("<redacted>" if k in SECRET_KEYS and v else redact_secrets(v) if isinstance(v, dict) else v)
            for k, v in config.items()}


def supersede(lines: list[str], start_step: int) -> tuple[int, list[str], list[int]]:
    """A new attempt beginning at ``start_step`` over the lines of ``metrics.jsonl``: (its attempt number, the
    lines with the rolled-back records marked ``"superseded": true``, the steps of the records marked).

    Rolled back: a live record of a step after ``start_step`` (the checkpoint it resumes predates it), and the
    start record (``attempt_start``) of an earlier attempt that began at ``start_step`` too. The record that
    trained ``start_step`` stays: the checkpoint holds its result. A last line cut short by a kill mid-write
    is dropped (with a warning); other lines that are not a JSON object stay as they are."""
    out: list[str] = []
    attempts: list[int] = []
    rolled_back: list[int] = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                log.warning("metrics.jsonl: dropped a last line cut short (a kill mid-write): %r", line[:120])
                continue
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            out.append(line if line.endswith("\n") else line + "\n")
            continue
        attempts.append(record.get(ATTEMPT, 1) if isinstance(record.get(ATTEMPT), int) else 1)
        if not record.get(SUPERSEDED) and (record["step"] > start_step or
                                           (record["step"] == start_step and record.get(ATTEMPT_START))):
            record[SUPERSEDED] = True
            rolled_back.append(record["step"])
            line = json.dumps(record) + "\n"
        out.append(line if line.endswith("\n") else line + "\n")
    return (max(attempts) + 1 if attempts else 1), out, rolled_back


def final_lineage(records: list[dict]) -> list[dict]:
    """The records of the run's curve: those no later attempt rolled back (see :func:`supersede`)."""
    return [r for r in records if not r.get(SUPERSEDED)]


def _ranges(steps: list[int]) -> str:
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(parts)


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSONL file; a last line cut short (a kill mid-write) is left out with a warning."""
    with open(path) as fh:
        lines = fh.read().splitlines(keepends=True)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                log.warning("%s: left out a last line cut short (a kill mid-write): %r", path, line[:120])
                continue
            raise ValueError(f"{path}, line {i + 1}: not JSON ({line[:120]!r})") from None
    return records
