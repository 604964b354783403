"""Backends the previous release left serving, found in its config.json entries.

The previous release recorded a running backend as `status`, `pid` and `port` on the instance
(no boot id, no marker: nothing this host could re-adopt), did not stop backends on shutdown,
and at boot SIGTERMed the recorded pid before starting the instance again (reference-behavior
6.9). Starting again without ending it leaves the old backend serving, unmanaged, holding its
GPU memory beside the new one.

So an upgrade does what the previous release did, but only to a process that is plausibly
that backend: alive, listening on the recorded port (ownership.owns_port) and running the
backend kind's program. It is ended (SIGTERM, a bounded wait, SIGKILL, its identity checked
again before each signal) before the instance starts again. A pid that is gone, or that now
runs another program that does not listen there, is never signalled and the instance starts
as usual. One that cannot be judged (half the evidence, its process entry unreadable, or it survives
SIGKILL) is left alone, loudly, and its instance is not started: a duplicate on top of a live
backend is what this avoids.

Blocking (procfs reads, waits): runs where config.json is loaded, in a worker thread, before
any backend starts.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from solar_host.instances import ownership, procfs, signals
from solar_host.instances.ownership import Identity
from solar_host.instances.states import InstanceStatus as S

if TYPE_CHECKING:
    from solar_host.instances.store import StoredInstance

log = logging.getLogger(__name__)

# The previous release's stop: terminate, wait 10 s, kill.
TERM_GRACE_S = 10.0
KILL_WAIT_S = 5.0
# Workers of the ended backend (SGLang's schedulers) still alive this long after it: killed.
WORKER_GRACE_S = 2.0

# The program each backend kind ran in the previous release (reference-behavior 5.3-5.5):
# the executable's name, or the module/script an interpreter ran.
_PROGRAMS = {
    "llamacpp": ("llama-server", "llama_server", "llama_cpp.server"),
    "sglang": ("sglang", "sglang.launch_server"),
    "huggingface": ("solar_host.servers.hf_server", "hf_server", "hf_server.py"),
}


def _kind(backend_type: str) -> str:
    if backend_type.startswith("huggingface"):
        return "huggingface"
    # The previous release ran anything else with its llama.cpp runner.
    return "sglang" if backend_type == "sglang" else "llamacpp"


def runs_kind(argv: list[str], backend_type: str) -> bool:
    return ownership.runs_one_of(argv, _PROGRAMS[_kind(backend_type)])


def _wait_gone(idents: Iterable[Identity], timeout: float) -> list[Identity]:
    deadline = time.monotonic() + timeout
    while True:
        left = [i for i in idents if ownership.is_same(i)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _descendants(pid: int) -> list[Identity]:
    """Its children, theirs, and so on: a backend's workers, found before it is signalled
    (once it exits they are reparented and no longer known as its)."""
    table = procfs.table(include_self=True)
    children: dict[int, list[int]] = {}
    for child, st in table.items():
        children.setdefault(st.ppid, []).append(child)
    found: list[Identity] = []
    boot = procfs.boot_id()
    todo = list(children.get(pid, []))
    seen = set(todo)  # a table read while pids are reused must not send the walk round a loop
    while todo:
        child = todo.pop()
        st = table[child]
        if not st.exited:
            found.append(Identity(boot, child, st.start_ticks))
        for grandchild in children.get(child, []):
            if grandchild not in seen:
                seen.add(grandchild)
                todo.append(grandchild)
    return found


def end_backends(idents: list[Identity]) -> list[Identity]:
    """SIGTERM, TERM_GRACE_S, SIGKILL, then the workers that outlive their backend; all of
    them at once, so that the wait is one grace, not one per backend. Returns the backends
    still alive after all that."""
    workers = [w for ident in idents for w in _descendants(ident.pid)]
    left = list(idents)
    for sig, wait in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        left = [ident for ident in left if signals.send(ident, sig)]
        left = _wait_gone(left, wait)
        if not left:
            break
    for worker in _wait_gone(workers, WORKER_GRACE_S):
        signals.send(worker, signal.SIGKILL)
    return left


def settle(records: list[StoredInstance]) -> None:
    """For each record loaded from the previous release's format with a backend pid: end
    that backend if it still serves, before this host starts the instance again; leave the
    instance stopped, saying why, when what runs under that pid cannot be judged."""
    to_end: list[tuple[StoredInstance, Identity]] = []
    for stored in records:
        inst = stored.instance
        pid = inst.pid
        if pid is None or pid <= 0 or inst.status not in (S.RUNNING, S.STARTING, S.STOPPING):
            continue
        alias = inst.config.alias
        kind = _kind(inst.config.backend_type)
        verdict, ident, why = ownership.judge_unmarked(pid, inst.port, _PROGRAMS[kind], kind)
        if verdict == "gone":
            log.info("backend pid %s of %s (%s), previous release: %s", pid, inst.id, alias, why)
        elif verdict == "other":
            log.info(
                "pid %s, recorded by the previous release for %s (%s), is left alone: %s",
                pid,
                inst.id,
                alias,
                why,
            )
        elif verdict == "backend" and ident is not None:
            log.warning(
                "ending backend pid %s of %s (%s) on port %s, left serving by the previous "
                "release (%s)%s",
                pid,
                inst.id,
                alias,
                inst.port,
                why,
                "; the instance is started again under this host" if stored.want_running else "",
            )
            to_end.append((stored, ident))
        else:
            _leave_stopped(stored, why)
    if not to_end:
        return
    survivors = set(end_backends([ident for _, ident in to_end]))
    for stored, ident in to_end:
        if ident in survivors:
            _leave_stopped(stored, "it survived SIGTERM and SIGKILL")


def _leave_stopped(stored: StoredInstance, why: str) -> None:
    """Not started beside a process that may be its backend: the operator decides."""
    inst = stored.instance
    message = (
        f"not started: pid {inst.pid}, recorded by the previous release as this instance's "
        f"backend on port {inst.port}, still runs and cannot be judged ({why}); starting "
        "would run a second copy beside it. End that process if it is this backend, then "
        "start the instance."
    )
    log.error("%s (%s): %s", inst.id, inst.config.alias, message)
    inst.status = S.STOPPED
    inst.pid = None
    inst.port = None
    inst.error_message = message
    stored.want_running = False
