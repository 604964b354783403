"""Step logs: Docker output -> lines -> durable file, bounded buffer, StepLog events.

Two halves, one per thread:
* `pump_container_output` runs in a worker thread: it reads Docker's blocking stream, splits
  each stream into LINES (a partial trailing line waits for its newline or the end), writes
  them to `logs/<step>.log` (the authoritative record) and hands every batch of lines to the
  event loop with `call_soon_threadsafe`.
* `StepLogBuffer` lives on the event-loop thread: it numbers lines per step (seq from 0), keeps
  the last N per step and publishes `events.StepLog`. Because batches and the completion marker
  both go through the loop's FIFO, the marker is always the step's last entry.

The buffers outlive the job (GET /jobs/{id} shows recent_logs of a finished job), cut to a
small tail when the step ends; they are dropped when the job is forgotten (cancel, retention).
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from solar_host.events import EventBus, StepLog, iso_now
from solar_host.platform.log_limits import RotatingWriter, cut_marker

log = logging.getLogger(__name__)

RECENT_LOGS = 100
# What a finished step keeps in memory for its job's whole retention (the file has the rest):
# its last RECENT_LOGS lines, at most this many characters of them. Lines are up to 16 KiB, and
# jobs x steps is not bounded, so keeping the running step's 1000-line ring cost hundreds of MB.
FINISHED_STEP_LOG_CHARS = 32 * 1024
# Default cut of one line (LOG_LINE_MAX_BYTES), so one endless line cannot exhaust memory.
MAX_LINE_CHARS = 16 * 1024
# Injected secrets (ruling 14) printed by a step are replaced by this in every copy of its log.
REDACTED = "***"
MIN_REDACT_CHARS = 4


class LineSplitter:
    """Decode a byte stream incrementally and return the complete lines of each chunk.

    A line longer than `max_chars` is cut there and ends with the cut marker; the rest of it,
    up to its newline, is dropped.
    """

    def __init__(self, max_chars: int = MAX_LINE_CHARS) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self.max_chars = max_chars
        self._marker = cut_marker(max_chars)
        self._skipping = False

    def _cut(self, line: str) -> str:
        if line.endswith("\r"):
            line = line[:-1]
        return line[: self.max_chars] + self._marker if len(line) > self.max_chars else line

    def feed(self, data: bytes) -> list[str]:
        text = self._decoder.decode(data)
        if self._skipping:
            nl = text.find("\n")
            if nl < 0:
                return []
            self._skipping = False
            text = text[nl + 1 :]
        text = self._partial + text
        parts = text.split("\n")
        self._partial = parts.pop()
        lines = [self._cut(p) for p in parts]
        if len(self._partial) > self.max_chars:
            lines.append(self._cut(self._partial))
            self._partial = ""
            self._skipping = True
        return lines

    def flush(self) -> list[str]:
        """The held partial line at end of stream (if any)."""
        rest = self._partial + self._decoder.decode(b"", final=True)
        self._partial = ""
        if self._skipping:
            self._skipping = False
            return []
        return [self._cut(rest)] if rest else []


class StepLogBuffer:
    """Per-step bounded history and seq counters. Use from the event-loop thread only."""

    def __init__(self, bus: EventBus, maxlen: int) -> None:
        self.bus = bus
        self.maxlen = maxlen
        self._entries: dict[tuple[str, str], deque[dict[str, Any]]] = {}
        self._seq: dict[tuple[str, str], int] = {}

    def _next_seq(self, key: tuple[str, str]) -> int:
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return seq

    def _deque(self, key: tuple[str, str]) -> deque[dict[str, Any]]:
        d = self._entries.get(key)
        if d is None:
            d = self._entries[key] = deque(maxlen=self.maxlen)
        return d

    def add_lines(
        self, job_id: str, step_name: str, step_index: int, stream: str, lines: Iterable[str]
    ) -> None:
        key = (job_id, step_name)
        buf = self._deque(key)
        timestamp = iso_now()
        for line in lines:
            entry = {
                "job_id": job_id,
                "step_name": step_name,
                "step_index": step_index,
                "stream": stream,
                "seq": self._next_seq(key),
                "timestamp": timestamp,
                "line": line,
            }
            buf.append(entry)
            self.bus.publish(StepLog(entry))

    def mark_completed(
        self, job_id: str, step_name: str, step_index: int, exit_code: int | None
    ) -> None:
        key = (job_id, step_name)
        entry = {
            "job_id": job_id,
            "step_name": step_name,
            "step_index": step_index,
            "stream": "stdout",
            "seq": self._next_seq(key),
            "timestamp": iso_now(),
            "line": "",
            "completed": True,
            "exit_code": exit_code,
        }
        buf = self._deque(key)
        buf.append(entry)
        self._entries[key] = finished_tail(buf)
        self.bus.publish(StepLog(entry))

    def recent(self, job_id: str, step_name: str, limit: int = RECENT_LOGS) -> list[dict[str, Any]]:
        d = self._entries.get((job_id, step_name))
        if not d:
            return []
        return list(d)[-limit:]

    def remove(self, job_id: str) -> None:
        for key in [k for k in self._entries if k[0] == job_id]:
            self._entries.pop(key, None)
            self._seq.pop(key, None)


def finished_tail(buf: deque[dict[str, Any]]) -> deque[dict[str, Any]]:
    """The entries a finished step keeps: the newest RECENT_LOGS, within
    FINISHED_STEP_LOG_CHARS (the completion marker, last, is always kept)."""
    kept: list[dict[str, Any]] = []
    chars = 0
    for entry in reversed(buf):
        chars += len(entry["line"])
        if kept and (len(kept) >= RECENT_LOGS or chars > FINISHED_STEP_LOG_CHARS):
            break
        kept.append(entry)
    kept.reverse()
    # A fresh deque: the old one's storage is freed, not just emptied.
    return deque(kept, maxlen=buf.maxlen)


def pump_container_output(
    stream: Iterable[tuple[bytes | None, bytes | None]],
    log_path: Path,
    deliver: Callable[[str, list[str]], None],
    *,
    max_line_chars: int = MAX_LINE_CHARS,
    max_file_bytes: int = 100 * 1024 * 1024,
    generations: int = 3,
    redact: Iterable[str] = (),
) -> None:
    """Read a demuxed Docker stream to its end (blocking; run in a worker thread).

    `deliver(stream_name, lines)` is called from this thread: it must hop to the loop itself.
    Errors of the stream end the pump quietly (the container's exit code tells the outcome).
    The file is rotated at `max_file_bytes` (log_limits), lines are cut at `max_line_chars`.
    """
    splitters = {"stdout": LineSplitter(max_line_chars), "stderr": LineSplitter(max_line_chars)}
    try:
        log_file: RotatingWriter | None = RotatingWriter(log_path, max_file_bytes, generations)
    except OSError as err:
        log.warning("cannot open step log %s: %s", log_path, err)
        log_file = None

    secrets = sorted({s for s in redact if s and len(s) >= MIN_REDACT_CHARS}, key=len, reverse=True)

    def emit(name: str, lines: list[str]) -> None:
        if not lines:
            return
        if secrets:
            lines = [_redact(line, secrets) for line in lines]
        if log_file is not None:
            try:
                log_file.write(("\n".join(lines) + "\n").encode("utf-8", "replace"))
            except OSError as err:
                log.warning("cannot write step log %s: %s", log_path, err)
        deliver(name, lines)

    try:
        for out, err in stream:
            if out:
                emit("stdout", splitters["stdout"].feed(out))
            if err:
                emit("stderr", splitters["stderr"].feed(err))
    except Exception as exc:  # the connection closed under us (cancel, daemon restart)
        log.debug("step log stream ended: %s", exc)
    finally:
        for name, splitter in splitters.items():
            emit(name, splitter.flush())
        if log_file is not None:
            try:
                log_file.close()
            except OSError as exc:  # a full disk: what it kept is lost, the step is not
                log.warning("step log %s could not be completed: %s", log_path, exc)


def _redact(line: str, secrets: list[str]) -> str:
    for secret in secrets:
        if secret in line:
            line = line.replace(secret, REDACTED)
    return line


def loop_deliverer(
    loop: asyncio.AbstractEventLoop,
    buffer: StepLogBuffer,
    job_id: str,
    step_name: str,
    step_index: int,
) -> Callable[[str, list[str]], None]:
    """A `deliver` callback that hands lines to `buffer` on the loop's thread."""

    def deliver(stream_name: str, lines: list[str]) -> None:
        try:
            loop.call_soon_threadsafe(
                buffer.add_lines, job_id, step_name, step_index, stream_name, lines
            )
        except RuntimeError:  # the loop is closed (host shutting down): the file has them
            pass

    return deliver
