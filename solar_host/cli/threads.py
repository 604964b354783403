"""Blocking client calls awaited from the command line's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread: unlike asyncio.to_thread, Ctrl-C does not wait for a
    blocking call (a start or pull of minutes) to end before the command can exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as err:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, None, err)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, daemon=True, name=getattr(fn, "__name__", "call")).start()
    return await fut
