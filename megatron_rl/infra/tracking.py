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
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Literal, Optional, TextIO, cast

from megatron_rl.errors import ConfigError


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
        self._jsonl: Optional[TextIO] = None
        self._tb = None
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
            self._tb = SummaryWriter(tensorboard_dir)
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

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = dict(_scalar_items(metrics))
        record = {"step": step, "time": time.time(), **scalars}
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


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
