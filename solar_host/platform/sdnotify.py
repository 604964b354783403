"""systemd's notification protocol: READY=1, STOPPING=1, STATUS= and the watchdog.

A `Type=notify` unit learns that the host serves (after the API is bound, not when the process
starts), that it is stopping, and, with `WatchdogSec=`, that its event loop still turns: the
watchdog ping is sent from a task on the loop, so a loop blocked for longer than the watchdog
interval gets the host restarted (its backends survive that, see the systemd unit).

The protocol is one datagram per message on the AF_UNIX socket named by NOTIFY_SOCKET (a path,
or an abstract name written with a leading '@'). Without NOTIFY_SOCKET every call is a no-op.
The variables are taken out of the environment when read, so backends the host spawns cannot
speak for the host (sd_notify's unset_environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import MutableMapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass
class Notifier:
    """Where to send notifications, and how often the watchdog wants a ping (0: never)."""

    address: str = ""
    watchdog_s: float = 0.0

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read (and remove) systemd's variables from `environ` (default: os.environ)."""
        env = os.environ if environ is None else environ
        values = {name: env.pop(name, "") for name in _VARIABLES}
        address = values["NOTIFY_SOCKET"]
        watchdog_s = 0.0
        usec, pid = values["WATCHDOG_USEC"], values["WATCHDOG_PID"]
        # WATCHDOG_PID names the process the watchdog is meant for (absent: this one).
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog_s = int(usec) / 1e6
        if address and not (address.startswith("/") or address.startswith("@")):
            log.warning("NOTIFY_SOCKET %r is neither a path nor an abstract name: ignored", address)
            address = ""
        return cls(address=address, watchdog_s=watchdog_s)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *fields: str) -> bool:
        """Send one message (fields joined by newlines). False when not sent."""
        if not self.address:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(target)
                s.sendall(message)
        except OSError as err:
            log.warning("sd_notify to %s failed: %s", self.address, err)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        fields = ["READY=1", f"MAINPID={os.getpid()}"]
        if status:
            fields.append(f"STATUS={status}")
        return self.send(*fields)

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    async def watchdog(self) -> None:
        """Ping at half the watchdog interval until cancelled (systemd's advice)."""
        if not self.address or self.watchdog_s <= 0:
            return
        interval = max(self.watchdog_s / 2, 0.05)
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)


async def cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
