"""The live phases of `solar-host start` / `restart`: spawned, loading (with progress), ready.

While the POST that starts the instance waits (it answers once the backend is ready, which can
take minutes), two WebSocket streams say what is happening: WS /instances/{id}/state sends an
`instance_status` message at every lifecycle step (starting, spawned with pid and port, a
failed attempt, ready), and WS /instances/{id}/logs the backend's lines, from which the
loading progress is read where the backend prints one ("Loading checkpoint shards: 50%").
A host whose state stream cannot be opened is polled (GET /instances/{id}) instead.

On a terminal the phases are printed as they happen under a live spinner line showing the
latest log line; elsewhere each phase is one plain line (and loading one line per 10%).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TextIO

from solar_host.cli.client import ClientError, HostClient, next_seq
from solar_host.cli.format import visible
from solar_host.platform.threads import in_daemon_thread

# Progress bars a backend prints while it loads weights: transformers' and tqdm's
# "Loading weights:  50%|#####     | 1/2", SGLang's "Loading safetensors checkpoint shards:
# 50% Completed | 1/2". A bar redrawn with \r arrives as one line: the last state counts.
_LOAD_PERCENT = re.compile(
    r"(?i)\bload\w*\b[^%\r]*?(\d{1,3}(?:\.\d+)?)\s?%\s*(?:\||completed|\d+/\d+)"
)
POLL_S = 0.25
WS_CONNECT_WAIT_S = 5.0


def load_percent(line: str) -> float | None:
    """The loading percentage in a backend log line, if it reports one."""
    matches = list(_LOAD_PERCENT.finditer(line))
    if not matches:
        return None
    m = matches[-1]
    value = float(m.group(1))
    return value if 0 <= value <= 100 else None


def describe_status(data: dict[str, Any]) -> str | None:
    """The phase line for one `instance_status` message (None: nothing worth a line)."""
    reason, status = data.get("reason"), data.get("status")
    if reason == "starting":
        attempt = int(data.get("retry_count") or 0)
        return "starting" if attempt == 0 else f"retrying (attempt {attempt + 1})"
    if reason == "spawned":
        return f"spawned pid {data.get('pid')} on port {data.get('port')}"
    if reason == "ready":
        return "ready"
    if reason == "start_failed":
        return f"attempt failed: {data.get('error_message')}"
    if reason in ("stopping", "stopped"):
        return reason
    if status:
        return f"{status} ({reason})" if reason else str(status)
    return None


@dataclass
class Phase:
    at_s: float
    text: str

    def as_dict(self) -> dict[str, Any]:
        return {"at_s": round(self.at_s, 3), "phase": self.text}


@dataclass
class PhaseLog:
    """The phases seen so far, and how they are shown (a terminal, plain lines, or not at all)."""

    stream: TextIO | None
    live: bool = False
    t0: float = field(default_factory=time.monotonic)
    phases: list[Phase] = field(default_factory=list)
    loading_decile: int = -1
    spawned: bool = False
    # Lines that overtook the `spawned` message (two streams, two sockets): shown after it.
    early_lines: list[str] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _status: Any = None
    _console: Any = None

    def __post_init__(self) -> None:
        if self.stream is not None and self.live:
            from rich.console import Console

            self._console = Console(file=self.stream)
            self._status = self._console.status("waiting for the host")
            self._status.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def add(self, text: str) -> None:
        phase = Phase(self.elapsed(), text)
        self.phases.append(phase)
        if text == "ready":
            self.ready.set()
        line = f"{phase.at_s:6.1f} s  {visible(text)}"
        if self._console is not None:
            self._console.print(line, highlight=False, markup=False)
            self._show(f"{visible(text)}  ({phase.at_s:.0f} s)")
        elif self.stream is not None:
            print(line, file=self.stream, flush=True)
        if text.startswith("spawned"):
            self.spawned = True
            early, self.early_lines = self.early_lines, []
            for early_line in early:
                self.log_line(early_line)
        elif text in ("starting", "stopped") or text.startswith("retrying"):
            # A new process comes next: what was seen so far belonged to the previous one.
            self.early_lines.clear()
            self.spawned = False
            self.loading_decile = -1

    def status(self, data: dict[str, Any]) -> None:
        text = describe_status(data)
        if text is not None:
            self.add(text)

    def log_line(self, line: str) -> None:
        """A backend line while it starts: the live line shows it; progress gets phases."""
        if self.ready.is_set():
            return
        if not self.spawned:
            self.early_lines.append(line)
            del self.early_lines[:-200]
            return
        pct = load_percent(line)
        if pct is not None and int(pct // 10) > self.loading_decile:
            self.loading_decile = int(pct // 10)
            self.add(f"loading {pct:.0f}%")
        elif self.loading_decile < 0 and self.phases[-1].text.startswith("spawned"):
            self.add("loading")
        if self._status is not None:
            short = line.strip()
            short = short if len(short) <= 100 else short[:97] + "..."
            self._show(f"loading ({self.elapsed():.0f} s)  {visible(short)}")

    def _show(self, text: str) -> None:
        """The live line: plain text (a log line's "[/models/m.gguf]" is not rich markup)."""
        from rich.text import Text

        self._status.update(Text(text))

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


async def _follow_status(c: HostClient, iid: str, log: PhaseLog, connected: asyncio.Event) -> None:
    try:
        async for msg in c.follow_state(iid):
            connected.set()  # the first message is the snapshot: subscribed from here on
            if msg.get("type") == "instance_status":
                log.status(msg.get("data") or {})
    except ClientError:
        if connected.is_set():
            return  # the stream ended after it worked: the call's answer tells the rest
        connected.set()
        await _poll_status(c, iid, log)


async def _poll_status(c: HostClient, iid: str, log: PhaseLog) -> None:
    """For a host without the state stream: GET /instances/{id} and report the changes."""
    poller = HostClient(c.url, c.api_key, timeout=c.timeout)
    last: tuple[Any, ...] | None = None
    try:
        while True:
            with contextlib.suppress(ClientError):
                inst = await asyncio.to_thread(poller.instance, iid)
                key = (inst.get("status"), inst.get("pid"), inst.get("retry_count"))
                if key != last:
                    last = key
                    status = inst.get("status")
                    reason = {
                        "starting": "spawned" if inst.get("pid") else "starting",
                        "running": "ready",
                        "failed": "start_failed",
                    }.get(status, status)
                    log.status({**inst, "reason": reason})
            await asyncio.sleep(POLL_S)
    finally:
        poller.close()


async def _follow_logs(c: HostClient, iid: str, since: int | None, log: PhaseLog) -> None:
    with contextlib.suppress(ClientError):
        async for msg in c.follow_logs(iid, since_seq=since):
            if isinstance(msg.get("line"), str):
                log.log_line(msg["line"])


async def _reporting(
    what: str, work: Awaitable[None], connected: asyncio.Event | None = None
) -> None:
    """Run a watcher; an error it did not expect is said on stderr (the start goes on without
    what it would have shown) instead of dying unseen with its task."""
    try:
        await work
    except Exception as err:
        if connected is not None:
            connected.set()  # the call need not wait for a stream that will not come
        print(
            f"solar-host: warning: {what} stopped showing: {type(err).__name__}: {visible(err)}",
            file=sys.stderr,
            flush=True,
        )


async def run_with_phases(c: HostClient, iid: str, action: str, log: PhaseLog) -> dict[str, Any]:
    """Run `action` ("start" or "restart": blocking calls) while its phases go to `log`."""
    existing = await asyncio.to_thread(c.logs, iid)  # also: the instance exists, the key works
    since = next_seq(existing)
    connected = asyncio.Event()
    watchers = [
        asyncio.create_task(
            _reporting("the phases", _follow_status(c, iid, log, connected), connected)
        ),
        asyncio.create_task(_reporting("the loading progress", _follow_logs(c, iid, since, log))),
    ]
    try:
        # Subscribed before the call, so no phase is missed; a slow stream does not block it.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(connected.wait(), WS_CONNECT_WAIT_S)
        caller = HostClient(c.url, c.api_key, timeout=c.timeout)
        try:
            body = await in_daemon_thread(getattr(caller, action), iid)
        finally:
            caller.close()
        if log.spawned and not log.ready.is_set():
            # The answer can overtake the stream's last message by a few milliseconds.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.ready.wait(), 1.0)
        return body
    finally:
        for w in watchers:
            w.cancel()
        for w in watchers:
            with contextlib.suppress(BaseException):
                await w
        log.close()
