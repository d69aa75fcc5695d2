"""One event loop, on a daemon thread, that every slime coroutine of the process runs on.

Why not ``asyncio.run`` per call: slime functions keep asyncio objects at module level (``SEMAPHORE =
asyncio.Semaphore(...)`` in its search-r1 example) and ``GenerateState`` is a process singleton holding one;
those bind to the first loop that uses them, so every call must run on the same loop, as slime's own
``async_utils.run`` does. The caller blocks on the result (its deadline is ``call_user_function``'s)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Optional

_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOCK = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="slime-functions", daemon=True).start()
            _LOOP = loop
        return _LOOP


def run(awaitable: Awaitable[Any]) -> Any:
    """The awaitable's result, run on the shared loop (the calling thread waits for it)."""

    async def wrapped() -> Any:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrapped(), _loop()).result()


__all__ = ["run"]
