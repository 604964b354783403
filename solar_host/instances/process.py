"""Backend processes: spawn them detached from the host, signal and end their whole tree.

A backend runs in its own session and process group; its output goes through a pipe to its log
relay (relays.py), which appends it to its log file within the file's bound, so it never waits
on the host and keeps serving, its log written, when the host dies. Whether a process is (still)
our backend is ownership.py's question; this module only acts on the answer.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from solar_host.instances import confinement, ownership, procfs, relays, signals
from solar_host.instances.ownership import Identity

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BackendProcess:
    """A backend process the host owns, spawned now (`popen` set) or re-adopted."""

    identity: Identity
    # MARKER_VAR's value in its environment (None: adopted from a record older than markers).
    marker: str | None
    create_time: float = 0.0
    cmdline: list[str] = field(default_factory=list)  # for display, never for identity
    popen: subprocess.Popen[bytes] | None = None
    # Its API port, and the inodes of the sockets listening there that were proved its own
    # (note_listener): a process holding one of them got it from the backend, whatever it
    # did to its environment, session or parent since.
    port: int | None = None
    sockets: frozenset[int] = frozenset()
    # What a stop or crash clean-up could not end, in words (for the instance's message).
    left_behind: list[str] = field(default_factory=list)
    # Set by terminate when the backend ignored SIGTERM for the whole grace: what a stop says.
    killed_after_s: float | None = None
    # The relay writing its output to its log file (None: a backend of an older host, which
    # writes its file itself, or one whose relay could not be found).
    relay: relays.Relay | None = None

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def start_ticks(self) -> int:
        return self.identity.start_ticks

    @property
    def is_child(self) -> bool:
        return self.popen is not None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return ownership.is_same(self.identity)

    def exit_code(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        return None


def spawn(
    argv: list[str],
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
    policy: confinement.AccessPolicy | None = None,
    confine: str = "off",
    *,
    log_bound: int | None = None,
) -> BackendProcess:
    """Start `argv` in a new session with stdout+stderr going through a log relay to
    `log_path` (never past `log_bound` bytes; None: no bound), in the working directory
    `cwd` (created if missing; None: the host's own), able to read and write only what
    `policy` allows when `confine` (BACKEND_READ_CONFINEMENT) says so.

    Blocking (fork/exec, procfs reads): call it through asyncio.to_thread. Raises
    confinement.ConfinementUnavailable when `confine` is "required" and cannot be met.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    # Its output is a pipe to its log relay: it is never given its log file (nor, with writes
    # confined, the right to open it), so nothing it does passes the relay's bound.
    read_end, fd = relays.pipe()
    relay_starter = _RelayStarter(read_end, log_path, log_bound)
    ruleset = None
    try:
        ruleset = confinement.ruleset_for(confine, policy) if policy is not None else None

        def start(program: str | None = None) -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                list(argv),
                executable=program,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
                cwd=cwd,
                # SIGPIPE stays ignored (as in the host): should its relay die, a write to
                # the pipe fails with EPIPE, which the backend survives, not SIGPIPE.
                restore_signals=False,
            )

        if ruleset is None:
            popen = start()
        else:
            popen = confinement.confined_popen(argv, env, ruleset, start)
    except BaseException:
        relay_starter.cancel()
        raise
    finally:
        os.close(fd)
        if ruleset is not None:
            ruleset.close()
    # Its relay after it, so that the relay's fork and exec are not on the way to the
    # backend's first instruction: what it writes meanwhile waits in the pipe.
    try:
        relay = relay_starter.finish()
    except BaseException:
        popen.kill()  # its output would have nowhere to go
        popen.wait()
        raise
    # Popen returns after exec; the start time never changes after that, whatever the backend
    # execs next, so the identity taken now is the one re-adoption will find.
    st = procfs.stat(popen.pid)
    identity = Identity(procfs.boot_id(), popen.pid, st.start_ticks if st is not None else -1)
    entered = procfs.entry_time(popen.pid)
    create_time = entered if entered is not None else time.time()
    return BackendProcess(
        identity=identity,
        marker=env.get(ownership.MARKER_VAR),
        create_time=create_time,
        cmdline=list(argv),
        popen=popen,
        relay=relay,
    )


class _RelayStarter:
    """Starts a backend's log relay on the pipe's `read_end` (closed then) in a thread made
    before the backend's spawn, when told to (`finish`) or not at all (`cancel`).

    A confined spawn may restrict the very thread that spawns (landlock_exec), and what a
    restricted thread makes, threads and processes, is restricted too: the relay, which writes
    in LOG_DIR, must come from a thread made before that. Made with _thread: threading's
    start() would wait for the kernel to run it, on the way to the backend's spawn."""

    def __init__(self, read_end: int, log_path: Path, bound: int | None) -> None:
        self._go = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        self._go.acquire()
        self._done.acquire()
        self._wanted = False
        self._outcome: relays.Relay | BaseException | None = None
        limit = bound if bound is not None else relays.NO_BOUND
        _thread.start_new_thread(self._run, (read_end, log_path, limit))

    def _run(self, read_end: int, log_path: Path, bound: int) -> None:
        self._go.acquire()
        try:
            if self._wanted:
                self._outcome = relays.start(read_end, log_path, bound)
        except BaseException as err:  # handed to finish()
            self._outcome = err
        finally:
            os.close(read_end)
            self._done.release()

    def finish(self) -> relays.Relay:
        self._wanted = True
        self._go.release()
        self._done.acquire()
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

    def cancel(self) -> None:
        self._go.release()  # the thread closes the read end and ends


def _strays(proc: BackendProcess) -> list[Identity]:
    """Every other process of the backend (ownership.backend_processes). Blocking."""
    return ownership.backend_processes(proc.identity, proc.marker, proc.port, proc.sockets)


def note_listener(proc: BackendProcess, port: int) -> None:
    """Remember `port` as the backend's API port and the sockets listening there that are its
    own (ownership.own_sockets): whoever holds one later is found by them. Blocking."""
    proc.port = port
    own = ownership.own_sockets(proc.identity, port)
    if own is not None:
        proc.sockets = own


def _still_held(proc: BackendProcess) -> list[str]:
    """Who listens on the backend's port after everything of it was ended (`pid (name)`).
    Blocking."""
    if proc.port is None:
        return []
    return [ownership.describe(p) for p in ownership.port_holders(proc.port)]


def signal_tree(proc: BackendProcess, sig: int) -> list[Identity]:
    """Signal the backend's process group and every other process of it (_strays); returns
    those others. Blocking."""
    if proc.alive():
        # The leader is alive, so its group id (its pid, from start_new_session) is ours.
        signals.send_group(proc.identity, sig)
    strays = _strays(proc)
    for ident in strays:
        signals.send(ident, sig)
    return strays


def cpu_seconds(proc: BackendProcess) -> float:
    """CPU time (user + system, every thread) the backend and the other processes of it have
    used so far: what tells a backend that works but does not answer from one that is stuck.
    Blocking (procfs)."""
    total = 0.0
    pids = {proc.pid, *(i.pid for i in _strays(proc))}
    for pid in pids:
        st = procfs.stat(pid)
        if st is not None:
            total += st.cpu_ticks / procfs.clock_ticks()
    return total


def end_identities(idents: list[Identity]) -> None:
    """SIGKILL exactly these processes (each checked to still be itself). Blocking."""
    for ident in idents:
        signals.send(ident, signal.SIGKILL)


async def wait_exit(proc: BackendProcess, timeout: float | None = None) -> bool:
    """Wait until the process exits (reaping our own children). True if it exited."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        fd = -1
    try:
        if fd < 0:
            # No pidfd (gone already, or an old kernel): poll.
            try:
                async with asyncio.timeout(timeout):
                    while proc.alive():
                        await asyncio.sleep(0.05)
            except TimeoutError:
                return False
        elif proc.popen is None and not proc.alive():
            pass  # the pid was reused already: ours is gone
        elif proc.popen is None or proc.popen.poll() is None:
            if not await signals.ended(fd, timeout):
                return False
    finally:
        if fd >= 0:
            os.close(fd)
    if proc.popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(timeout=1)
    return True


async def _wait_gone(idents: list[Identity], timeout: float) -> list[Identity]:
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in idents if ownership.is_same(i)]
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.05)


async def terminate(proc: BackendProcess, grace_s: float) -> int | None:
    """End the backend's whole tree: SIGTERM, `grace_s` for the backend to exit, then SIGKILL
    for the backend and every process of its group or carrying its marker. Returns the exit
    code when known."""
    # Found while the backend lives: a worker that left its session is then still its child
    # (once the backend is gone it is init's, and only its sockets could tell).
    strays = await asyncio.to_thread(signal_tree, proc, signal.SIGTERM)
    if not await wait_exit(proc, grace_s):
        log.warning("backend pid %s ignored SIGTERM for %.1fs; killing it", proc.pid, grace_s)
        proc.killed_after_s = grace_s
        strays += await asyncio.to_thread(signal_tree, proc, signal.SIGKILL)
        await wait_exit(proc, 10.0)
    await end_tree_leftovers(proc, strays)
    return proc.exit_code()


async def end_tree_leftovers(proc: BackendProcess, known: Sequence[Identity] = ()) -> None:
    """After the backend itself exited (stopped or crashed): no worker of it may survive.
    What could not be ended, and a port someone still listens on, are logged and kept in
    `proc.left_behind`: the next start is never placed on a port still held, and the operator
    is told which process holds it."""
    strays = list({i.pid: i for i in [*known, *await asyncio.to_thread(_strays, proc)]}.values())
    if proc.alive():
        signals.send_group(proc.identity, signal.SIGKILL)
    await asyncio.to_thread(end_identities, strays)
    left = await _wait_gone(strays, 5.0)
    if left:
        log.warning(
            "workers %s of backend pid %s survived SIGKILL", [i.pid for i in left], proc.pid
        )
        proc.left_behind.append(
            "workers " + ", ".join(str(i.pid) for i in left) + " survived SIGKILL"
        )
    held = await asyncio.to_thread(_still_held, proc)
    if held:
        log.warning(
            "port %s of backend pid %s is still listened on by %s after it ended: not a "
            "process the host can prove its own, so it was not signalled",
            proc.port,
            proc.pid,
            ", ".join(held),
        )
        proc.left_behind.append(
            f"port {proc.port} is still held by {', '.join(held)}, which the host could not "
            "prove its own and did not stop"
        )


async def end_processes(idents: list[Identity], grace_s: float) -> None:
    """Stop stray processes of ours (the boot sweep): SIGTERM, `grace_s`, SIGKILL."""
    for ident in idents:
        signals.send(ident, signal.SIGTERM)
    left = await _wait_gone(idents, grace_s)
    if left:
        await asyncio.to_thread(end_identities, left)
        await _wait_gone(left, 5.0)
