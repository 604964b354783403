"""Blocking calls awaited from an event loop, each in a daemon thread of its own.

Not asyncio.to_thread: its shared executor has a few workers, and a call that blocks for
minutes (a Docker stop waiting out its grace, a model pull, a start) held one of them, so every
other to_thread caller waited behind it; and the executor's threads are joined at exit, so
Ctrl-C waited for the call to end. A daemon thread holds neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_daemon_thread(
    fn: Callable[..., T], *args: Any, name: str = "blocking-call"
) -> asyncio.Future[T]:
    """`fn(*args)` in a new daemon thread named `name`; the future holds its result or error.
    Cancelling the future does not stop the call, it only stops the waiting."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as err:
            result, exc = None, err
        with contextlib.suppress(RuntimeError):  # loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut
