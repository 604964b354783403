"""The log relay: the one writer of a backend's log file, which keeps it within its bound.

A backend's stdout and stderr are a pipe; this program reads the pipe (its standard input)
and appends what it reads to the log file (its standard output, opened O_APPEND by the host),
as podman's conmon does for a container. Before each write it looks at the file's size: a
write that would take the file past its bound (LOG_FILE_MAX_BYTES plus one read chunk of the
host's follower) is dropped and counted, and once the host's rotation has made room again one
line says how many bytes went. So the file never outgrows its bound, however fast the backend
writes and however long the host is descheduled; and a backend that writes faster than this
reads waits on the pipe (backpressure) for as long as one read and one write take.

It runs as `python -I -S log_relay.py BOUND`, in a session of its own, with an empty
environment (no instance marker: ownership.py never takes it for a backend or one of its
workers), and imports nothing but os, sys, select and time (built in, or a 0.2 ms load): it
starts in ~10 ms, holds a few MB, and never depends on the host's installation once started.

What it cannot write it drops oldest first: the newest READ_BYTES wait in memory for room,
looked at again every RETRY_S, so the last lines of a flood (often its error) reach the file
once the host has rotated it (at end of file, for up to EOF_WAIT_S more).

It outlives the host (a SIGKILL, an upgrade with `handover`), so the backend's log goes on
being written while no host runs (up to the bound: only the host rotates), and exits at end
of file, when the backend and every process it passed the pipe to have closed it.
"""

import os
import select
import sys
import time

# One read of the pipe, and the newest bytes kept while the file is full.
READ_BYTES = 64 * 1024
RETRY_S = 0.05
EOF_WAIT_S = 5.0
DROPPED_LINE = "solar-host: {n} bytes dropped: the backend wrote faster than its log is read\n"


class Writer:
    """Appends to the log file within its bound, telling what it had to drop."""

    def __init__(self, fd: int, bound: int) -> None:
        self.fd, self.bound = fd, bound
        self.held = b""  # the newest bytes read, not written yet
        self.dropped = 0  # bytes dropped (before `held`) not yet told in the file
        self.line_open = False  # what we wrote last ends inside a line

    def add(self, data: bytes) -> None:
        held = self.held + data
        if len(held) > READ_BYTES:
            self.dropped += len(held) - READ_BYTES
            held = held[-READ_BYTES:]
        self.held = held

    def flush(self) -> bool:
        """Write what is held if the file has room for it; True when nothing is left."""
        if not self.held:
            return True
        data = self.held
        if self.dropped:
            note = DROPPED_LINE.format(n=self.dropped).encode()
            data = (b"\n" + note if self.line_open else note) + data
        try:
            if os.fstat(self.fd).st_size + len(data) > self.bound:
                return False
            _write_all(self.fd, data)
        except OSError:  # a full disk: dropped, the backend must never wait on its log
            self.dropped += len(self.held)
            self.held = b""
            return True
        self.held, self.dropped = b"", 0
        self.line_open = not data.endswith(b"\n")
        return True


def relay(src: int, dst: int, bound: int) -> int:
    """Copy `src` to `dst` until end of file, `dst` never past `bound` bytes; returns the
    bytes dropped and never written."""
    out = Writer(dst, bound)
    while True:
        if out.held and not select.select([src], [], [], RETRY_S)[0]:
            out.flush()  # the pipe is quiet: room may have been made meanwhile
            continue
        data = os.read(src, READ_BYTES)
        if not data:
            break
        out.add(data)
        out.flush()
    deadline = time.monotonic() + EOF_WAIT_S
    while not out.flush() and time.monotonic() < deadline:
        time.sleep(RETRY_S)
    return out.dropped + len(out.held)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        os.write(2, b"usage: log_relay.py BOUND (stdin: the pipe, stdout: the log file)\n")
        return 2
    relay(0, 1, int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
