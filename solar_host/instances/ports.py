"""Port allocation for backends: from START_PORT upward, never a port another instance holds
or another process is bound to."""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from solar_host.instances import ownership

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_EPHEMERAL_RANGE = (32768, 60999)  # the kernel's default


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (ip_local_port_range). A backend's port
    inside it can be taken, while the backend restarts, by any client socket on the machine
    (one in TIME_WAIT holds it for a minute), and the instance then moves to another port."""
    try:
        low, high = (int(v) for v in path.read_text().split()[:2])
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_RANGE
    return low, high


def port_is_free(
    port: int, hosts: Iterable[str] = ("0.0.0.0",), listening: set[int] | None = None
) -> bool:
    """True when nobody listens on `port` (any address, IPv4 or IPv6) and a listener could
    bind it on every one of `hosts` right now. `listening`: the listening ports, when the
    caller read them already."""
    if listening is None:
        listening = set(ownership.listeners())
    if port in listening:
        return False  # e.g. someone on [::1] only, which an IPv4 bind test does not see
    for host in hosts:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR like the backends themselves: TIME_WAIT leftovers do not count.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            if err.errno == errno.EADDRNOTAVAIL:
                continue  # the address is not on this machine; the backend will say so itself
            return False
        finally:
            s.close()
    return True


class PortAllocator:
    """Hands out ports; `held()` lists those other instances hold (starting/running/stopping).

    Two locks: allocate/holder read /proc and bind test sockets (a second with no free port
    left), so callers run them in worker threads, one at a time so two never hand out the
    same port; release and claim_adopted, called on the event loop, take only the short lock
    of the claimed set, never waiting on a scan."""

    def __init__(self, start_port: int, held: Callable[[], set[int]], end_port: int = 65535):
        self.start_port = start_port
        self.end_port = end_port
        self.held = held
        self._claimed: set[int] = set()  # handed out but not yet visible through held()
        self._scan_lock = threading.Lock()
        self._claims_lock = threading.Lock()

    def _bind_hosts(self, host: str) -> tuple[str, ...]:
        return ("0.0.0.0",) if host in ("0.0.0.0", "", "::") else ("0.0.0.0", host)

    def _taken(self) -> set[int]:
        with self._claims_lock:
            return self.held() | self._claimed

    def _claim_if_unclaimed(self, port: int) -> bool:
        with self._claims_lock:
            if port in self._claimed:
                return False
            self._claimed.add(port)
            return True

    def allocate(self, host: str, avoid: set[int] | None = None) -> int:
        with self._scan_lock:
            return self._allocate(host, avoid)

    def _allocate(self, host: str, avoid: set[int] | None) -> int:
        """The lowest free port of the range; PortsExhausted (503) naming it when none is."""
        taken = self._taken() | (avoid or set())
        listening = set(ownership.listeners())
        bound = 0
        for port in range(self.start_port, self.end_port + 1):
            if port in taken:
                continue
            if port_is_free(port, self._bind_hosts(host), listening):
                if self._claim_if_unclaimed(port):  # an adoption may have claimed it since
                    return port
                continue
            bound += 1
        from solar_host.instances.errors import PortsExhausted

        size = self.end_port - self.start_port + 1
        ours = size - bound
        raise PortsExhausted(
            f"No free port for a backend in {self.start_port}-{self.end_port} ({size} ports): "
            f"{ours} held by instances of this host, {bound} bound by other processes. "
            "Stop an instance, free a port, or lower START_PORT."
        )

    def reclaim(self, port: int, host: str) -> bool:
        """Claim the port an instance last served on, when no instance holds it and it is
        free; False otherwise (the caller allocates another)."""
        with self._scan_lock:
            if port in self._taken() or not self.start_port <= port <= self.end_port:
                return False
            return port_is_free(port, self._bind_hosts(host)) and self._claim_if_unclaimed(port)

    def claim(self, port: int, host: str) -> bool:
        """Claim an explicit port; False when another instance or process has it."""
        return self.holder(port, host) is None

    def holder(self, port: int, host: str) -> str | None:
        """Claim an explicit port, or say who has it: None when claimed, else a description
        for the 409 (another instance, or the pid listening on it where it can be read)."""
        with self._scan_lock:
            if port in self._taken():
                return "another instance"
            free = port_is_free(port, self._bind_hosts(host))
            if free and self._claim_if_unclaimed(port):
                return None
        if free:
            return "another instance"
        # Who listens there: a scan of every process's descriptors, outside both locks.
        pids = ownership.port_holders(port)
        if pids:
            return "pid " + ", ".join(ownership.describe(p) for p in pids)
        return "another process"

    def claim_adopted(self, port: int) -> None:
        """A re-adopted backend already holds its port: record it without a bind test."""
        with self._claims_lock:
            self._claimed.add(port)

    def release(self, port: int | None) -> None:
        if port is not None:
            with self._claims_lock:
                self._claimed.discard(port)
