"""Name -> implementation tables behind the flags that pick one (``--train-backend``, ``--rollout-backend``,
``--update-weight-transport``).

A row is one of:

* ``"package.module:Attr"``: imported on first lookup, so a heavy module
  (transformers, a server client) is loaded only when its row is chosen;
* the object itself (a class or factory);
* ``Refused(reason)``: a name the flag accepts for compatibility that this
  version cannot build; looking it up raises ``ConfigError(reason)``.

Every lookup goes through ``Registry.get``: no name is special-cased, and an
unknown name raises ``ConfigError`` naming the flag and the choices.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Generic, Mapping, TypeVar, Union

from megatron_rl.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Refused:
    """A row for a name that is known but not built by this version; ``reason`` is the whole error message."""

    reason: str


class Registry(Generic[T]):
    """The table for one flag; ``get(name)`` returns the row's object (importing it if the row is a path)."""

    def __init__(self, flag: str, what: str, rows: Mapping[str, Union[str, T, Refused]]):
        self.flag = flag  # e.g. "--rollout-backend", named in every error
        self.what = what  # e.g. "rollout engine"
        self._rows: dict[str, Union[str, T, Refused]] = dict(rows)

    def register(self, name: str, row: Union[str, T, Refused]) -> None:
        """Add or replace the row ``name``."""
        self._rows[name] = row

    def rows(self) -> dict[str, Union[str, T, Refused]]:
        return dict(self._rows)

    def available(self) -> list[str]:
        """Names that ``get`` builds (not refused), sorted."""
        return sorted(n for n, row in self._rows.items() if not isinstance(row, Refused))

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def get(self, name: str) -> T:
        if name not in self._rows:
            refused = sorted(set(self._rows) - set(self.available()))
            later = f"; not available yet: {', '.join(refused)}" if refused else ""
            raise ConfigError(f"{self.flag}={name!r} is not a known {self.what}; choose one of "
                              f"{', '.join(self.available())}{later}")
        row = self._rows[name]
        if isinstance(row, Refused):
            raise ConfigError(row.reason)
        if isinstance(row, str):
            module, _, attr = row.partition(":")
            return getattr(importlib.import_module(module), attr)
        return row
