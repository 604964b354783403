"""ownership's rules, asked directly: which marker carriers the boot sweep stops (strays), what
a pid the previous release recorded is now (judge_unmarked), and which processes are a
backend's (backend_processes, own_sockets), on real processes and sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from solar_host.instances import ownership, signals
from solar_host.instances.ownership import Identity


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _ident(pid: int, ticks: int) -> Identity:
    return Identity("boot", pid, ticks)


def test_strays_are_the_carriers_no_instance_owns() -> None:
    old, backend, worker = _ident(10, 100), _ident(11, 200), _ident(12, 300)
    ours = {
        "adopted": [old, backend, worker],
        "unknown": [_ident(20, 50)],
        "starting": [_ident(30, 50)],
        "quarantined": [_ident(40, 50)],
        "holds-protected-pid": [_ident(50, 50), _ident(51, 60)],
    }
    found = ownership.strays(
        ours,
        owners={"adopted": backend},
        starting={"starting"},
        protected_ids={"quarantined"},
        protected_pids={51},
    )
    # The owner and the workers it started since are its own; an older carrier is a leftover.
    assert found == [old, _ident(20, 50)]
    assert ownership.strays({}, {}) == []


def test_a_recorded_pid_is_judged_by_its_program_and_its_port() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    child = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(lambda: ownership.port_holders(port) == [child.pid], 20, "the listener")
        verdict, ident, why = ownership.judge_unmarked(child.pid, port, ("http.server",), "web")
        assert (verdict, ident) == ("backend", ownership.identity_of(child.pid))
        # The program names, never the arguments (the previous release put keys there).
        runs = " ".join(sorted({os.path.basename(sys.executable), "http.server"}))
        assert why == f"it runs {runs} and listens on port {port}"
        verdict, _, why = ownership.judge_unmarked(child.pid, port + 1, ("http.server",), "web")
        assert verdict == "unsure" and "does not listen" in why
        verdict, _, why = ownership.judge_unmarked(child.pid, port, ("llama-server",), "web")
        assert verdict == "unsure" and why.endswith("not a web backend")
        verdict, _, _ = ownership.judge_unmarked(child.pid, port + 1, ("llama-server",), "web")
        assert verdict == "other"
    finally:
        child.kill()
        child.wait(10)
    assert ownership.judge_unmarked(child.pid, port, ("http.server",), "web")[:2] == (
        "gone",
        None,
    )


def test_a_backends_processes_and_its_own_sockets() -> None:
    """A backend in a session of its own with a worker that left it (setsid) but holds the
    backend's listening socket: once the backend is gone, only that socket tells."""
    code = (
        "import os, socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    backend = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    ident = ownership.identity_of(backend.pid)
    worker_ident: Identity | None = None
    try:
        assert backend.stdout is not None
        port = int(backend.stdout.readline())
        assert ident is not None
        sockets = ownership.own_sockets(ident, port)
        assert sockets is not None and sockets == ownership.listener_inodes(port)
        _wait_for(lambda: len(ownership.port_holders(port)) == 2, 10, "the worker")
        [worker] = [p for p in ownership.port_holders(port) if p != backend.pid]
        worker_ident = ownership.identity_of(worker)
        _wait_for(lambda: os.getsid(worker) == worker, 10, "the worker's setsid")
        found = ownership.backend_processes(ident, None, port, sockets)
        assert [i.pid for i in found] == [worker]
        # Without the proved sockets, the worker (its own session, the backend's child) is
        # found by descent while the backend lives.
        assert [i.pid for i in ownership.backend_processes(ident, None, None, frozenset())] == [
            worker
        ]
        # Once the backend is gone the worker is init's: only the proved socket tells.
        assert signals.send(ident, signal.SIGKILL)
        backend.wait(10)
        assert ownership.backend_processes(ident, None, port, frozenset()) == []
        assert [i.pid for i in ownership.backend_processes(ident, None, port, sockets)] == [worker]
        # Nobody else's socket is the backend's own.
        other = socket.socket()
        other.bind(("127.0.0.1", 0))
        other.listen()
        other_port = other.getsockname()[1]
        try:
            assert ownership.own_sockets(ident, other_port) == frozenset()
        finally:
            other.close()
        assert ownership.own_sockets(ident, other_port) is None  # nothing listens there
    finally:
        if ident is not None:
            signals.send_group(ident, signal.SIGKILL)
        backend.kill()
        backend.wait(10)
        if worker_ident is not None:  # it left the group
            signals.send(worker_ident, signal.SIGKILL)
