"""hf_server's requests as its log tells them: each request's id, its [REQUEST] line when it
begins and one [COMPLETE] or [ERROR] line when it ends (their format: log_lines), the counts of
requests in flight, completed and failed, and the ids of responses."""

from __future__ import annotations

import asyncio
import itertools
import random
import secrets
import sys
import time

from solar_host.servers.log_lines import complete_line, error_line, request_line


class MarkerLog:
    """Marker lines on stdout, written once per event-loop turn instead of once per line.

    A batch of 32 embeddings completes 32 requests in one turn; a write and flush per marker
    line cost ~0.35 ms each on the event loop. Lines keep their order and reach the file before
    the loop does anything else (no timer), so the host's parser sees them just as promptly.
    Outside a running loop (start-up, shutdown) a line is written at once.
    """

    def __init__(self) -> None:
        self._pending: list[str] = []
        self._scheduled = False

    def line(self, text: str) -> None:
        """Queue a line, written at the end of this loop turn (see `written` for the lines a
        client may act on as soon as its response ends)."""
        self._pending.append(text)
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._scheduled = True
        loop.call_soon(self.flush)

    async def written(self) -> None:
        """Return once every line queued so far is in the file. The write scheduled for this
        turn runs before this coroutine resumes (the loop runs callbacks in order), so eight
        generations that finish in one decode step cost one write, not eight: each write lets
        go of the GIL, and the loop then waits for the decode thread to hand it back."""
        if self._pending:
            await asyncio.sleep(0)
            self.flush()  # only if a line came after the scheduled write: normally a no-op

    def flush(self) -> None:
        self._scheduled = False
        if self._pending:
            text = "\n".join(self._pending) + "\n"
            self._pending.clear()
            # Never raises for what a line holds: a line that cannot be encoded (a client's
            # lone surrogate) failed the write of every other request's line with it.
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except OSError as err:  # the host's log file: nothing else to tell
                print(f"marker log write failed: {err}", file=sys.stderr)


class RequestLog:
    """Requests begun and ended, counted and logged once each. Event loop only."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)
        # Response ids: unique, not secret. secrets.token_hex reads os.urandom, a system call
        # that lets go of the GIL, and the event loop then waits for the decode thread to hand it
        # back (see prompt_encoder): once per request, on the loop every request queues behind.
        self._rand = random.Random(secrets.randbits(128))
        self.in_flight = 0
        self._open: set[str] = set()  # ids of the requests begun and not yet ended
        self.completed = 0
        self.errors = 0
        self.log = MarkerLog()

    def response_id(self) -> str:
        """24 hex digits, as secrets.token_hex(12) gives, without a system call."""
        return f"{self._rand.getrandbits(96):024x}"

    def begin(self, endpoint: str) -> tuple[str, float]:
        rid = f"{self._prefix}-{next(self._ids)}"
        self._open.add(rid)
        self.in_flight += 1
        self.log.line(request_line(rid, endpoint))
        return rid, time.perf_counter()

    def complete(self, rid: str, endpoint: str, t0: float, prompt: int, completion: int) -> None:
        """The [COMPLETE] marker. A generation's carries its own start and end times, and its
        caller awaits `log.written()` before the response's last event goes out: the host's
        last-generation record is then this request's as soon as its client has read the
        response, however late the host reads the log."""
        if not self._end(rid):
            return
        self.completed += 1
        elapsed = time.perf_counter() - t0
        self.log.line(complete_line(rid, endpoint, prompt, completion, elapsed))

    def _end(self, rid: str) -> bool:
        """Count a request's end once: an error after its [COMPLETE] (while its answer is
        built or sent) is not a second end."""
        if rid not in self._open:
            return False
        self._open.discard(rid)
        self.in_flight -= 1
        return True

    def fail(self, rid: str, endpoint: str, status: int, message: str) -> None:
        if not self._end(rid):
            return
        self.errors += 1
        self.log.line(error_line(rid, endpoint, status, message))
