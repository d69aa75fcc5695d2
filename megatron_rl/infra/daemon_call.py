"""``DaemonCall``: ``fn()`` on a daemon thread, waited for with a deadline.

Why: a request to a hung SGLang server (or a collective with one) must never hold up the caller
past its timeout, nor the process's exit; a daemon thread gives up neither. Used by the SGLang
engine's parallel requests and the distributed transport's calls to every server.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

__all__ = ["DaemonCall"]


class DaemonCall:
    """Starts ``fn()`` at once on a daemon thread named ``name``; ``value`` / ``error`` once ``done()``."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name=name).start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s``; True when ``fn`` finished (returned or raised)."""
        return self._done.wait(timeout_s)
