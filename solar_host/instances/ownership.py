"""Is this process our backend? The one place that answers it, from what procfs reads.

The questions, each with one function:

- **Same process?** `is_same(identity)`. Identity is what the kernel guarantees: the boot id,
  the pid and the process start time in clock ticks. The command line is not part of it: an
  exec wrapper (`sh -c 'exec ...'`, `env`, `stdbuf`, `numactl`, a shebang script, a Python
  launcher calling os.execv) keeps the pid and start time but changes the command line.
- **Ours?** `marker_of(pid)`, `carriers(marker)`. Every backend is spawned with
  `SOLAR_HOST_MARKER=<host id>:<instance id>` in its environment; exec and fork both keep it,
  and it is read back from the environment the process was exec'd with. The host id belongs to
  the state directory (a file beside CONFIG_FILE), so two hosts never mistake each other's
  backends for their own, whatever LOG_DIR they share.
- **Owns this port?** `owns_port(identity, port, marker)`. The socket listening on the port (its
  inode, from the kernel's sock_diag or the TCP table) is a descriptor of the backend, of a
  process in its session, or of a process carrying its marker. A 200 from someone else on the
  port proves nothing.
- **What of ours runs here?** `ours_running(host_id)`: every live process carrying this host's
  marker, by instance id; `strays(...)`: those no instance owns, for the boot sweep to stop.
- **Which processes are this backend's?** `backend_processes(...)`: its marker's carriers, its
  session, their descendants, and the holders of the sockets proved its own (`own_sockets`):
  what a stop or a crash clean-up ends besides the backend's process group.
- **Is a pid the previous release recorded still its backend?** `judge_unmarked(...)`: no
  identity, no marker, so its program and its port must both say so.

Signals go through signals.py, which asks `is_same` with a pidfd held.

Everything here reads the process table synchronously: callers on the event loop use
asyncio.to_thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import threading
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from solar_host.instances import procfs, sockdiag
from solar_host.platform.statefiles import StateFileError, read_regular

MARKER_VAR = "SOLAR_HOST_MARKER"
# The API port the host gave the backend, beside the marker: a backend whose spawn the host did
# not live to record, and that does not listen yet (still loading), is adopted on this port.
PORT_VAR = "SOLAR_HOST_BACKEND_PORT"
# The fingerprint of the API key it was given (key_fingerprint; never the key, which the backend
# gets in its own variable): one adopted without its record is restarted after API_KEY changed.
KEY_VAR = "SOLAR_HOST_KEY_HASH"
# A nonce of this spawn, kept in its process record too. A marker carrier whose nonce differs
# from the record's is a later spawn the host did not live to record (adopted on PORT_VAR even
# while it loads); one with the record's own nonce descends from the recorded backend (a worker
# outliving it), which is adopted only if it listens.
SPAWN_VAR = "SOLAR_HOST_SPAWN_ID"
log = logging.getLogger(__name__)
_HEX = b"0123456789abcdef"  # key_fingerprint's alphabet
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Identity:
    """A process as the kernel knows it: unique on this machine for as long as it booted."""

    boot_id: str
    pid: int
    start_ticks: int


# --- same process ----------------------------------------------------------------------------


def boot_id() -> str:
    """This boot's id: an Identity taken on another boot is never a live process."""
    return procfs.boot_id()


def identity_of(pid: int) -> Identity | None:
    """The identity of the live (not zombie) process `pid`, or None."""
    st = procfs.stat(pid)
    if st is None or st.exited:
        return None
    return Identity(procfs.boot_id(), pid, st.start_ticks)


def is_same(identity: Identity) -> bool:
    """True while `identity` is still the very process it was taken from (not a reused pid)."""
    return identity_of(identity.pid) == identity


# --- ours --------------------------------------------------------------------------------------


def host_id_path(config_file: Path) -> Path:
    return config_file.with_name(config_file.name + ".host-id")


_HOST_ID = re.compile(r"[0-9a-f]{32}")


def load_host_id(config_file: Path, recorded: Collection[str] = ()) -> str:
    """This state directory's host id, created (mode 0600) the first time it is asked for.

    `recorded`: the host ids in the markers of config.json's process records. They are what
    the running backends carry, so they win over a file that is missing or damaged (the id is
    written back from them); a valid file that names another id is refused (StateFileError):
    under a new id every recorded backend would be a stranger, left running beside a second
    copy of itself.

    Created under a temp name and hard-linked into place, so two hosts racing on a fresh
    directory agree on one id and a crash never leaves an empty file.
    """
    path = host_id_path(config_file)
    try:
        text = read_regular(path).decode("ascii", "replace").strip()
    except FileNotFoundError:
        text = None
    except OSError as err:
        raise StateFileError(path, f"cannot be read ({err.strerror or err})") from None
    ids = set(recorded)
    if text is not None and _HOST_ID.fullmatch(text):
        if ids and text not in ids:
            raise StateFileError(
                path,
                f"holds host id {text}, but config.json's backends were spawned under "
                f"{', '.join(sorted(ids))}: put that id back in the file",
            )
        return text
    if len(ids) > 1:
        raise StateFileError(
            path,
            f"is {'missing' if text is None else 'damaged'} and config.json's backends carry "
            f"several host ids ({', '.join(sorted(ids))}): write the right one to the file",
        )
    if text is not None:
        log.warning(
            "%s is damaged (%r); %s",
            path,
            text[:40],
            "its id is taken back from config.json"
            if ids
            else "no backend is recorded under it: a new id is made",
        )
        with contextlib.suppress(OSError):
            path.unlink()
    elif ids:
        log.warning("%s is missing; its id is taken back from config.json", path)
    return _create_host_id(path, next(iter(ids)) if ids else uuid.uuid4().hex)


def check_missing_config(config_file: Path) -> None:
    """Refuse a start without config.json (StateFileError) while backends spawned under this
    state directory's host id still run.

    A host writes config.json at its first start, right after creating the host id, and only
    ever replaces it: a missing file beside an existing id was removed from outside, or lies on
    a disk that is not mounted (CONFIG_FILE a link to it). Starting empty would stop every one
    of those backends as unmanaged, and write a fresh config.json where the link points.
    Without running backends there is nothing to lose, and the start goes on (a first start,
    an operator who cleared the state on purpose)."""
    path = host_id_path(config_file)
    try:
        text = read_regular(path).decode("ascii", "replace").strip()
    except (OSError, StateFileError):
        return  # no id (a first start), or one load_host_id judges
    if not _HOST_ID.fullmatch(text):
        return
    running = ours_running(text)
    if not running:
        return
    pids = sorted(i.pid for idents in running.values() for i in idents)
    shown = ", ".join(map(str, pids[:8])) + (", ..." if len(pids) > 8 else "")
    where = ""
    if os.path.islink(config_file):
        target = os.readlink(config_file)
        where = f" (a link to {target}, which does not exist: a disk not mounted?)"
    raise StateFileError(
        config_file,
        f"the file is missing{where} but {len(running)} backend(s) spawned under its host id "
        f"{text} still run (pids {shown}); starting empty would stop them: put config.json "
        f"back, or stop those backends to start with no instances",
    )


def _create_host_id(path: Path, host_id: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (host_id + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another host won the race: use its id
    finally:
        os.unlink(tmp)
    return path.read_text().strip()


def recorded_host_ids(markers: Iterable[str | None]) -> set[str]:
    """The host ids in recorded markers (`<host id>:<instance id>`)."""
    out = set()
    for m in markers:
        if m and ":" in m:
            head = m.split(":", 1)[0]
            if _HOST_ID.fullmatch(head):
                out.add(head)
    return out


def marker(host_id: str, instance_id: str) -> str:
    """The value of MARKER_VAR for a backend of `instance_id` spawned by host `host_id`."""
    return f"{host_id}:{instance_id}"


def marker_of(pid: int) -> str | None:
    """MARKER_VAR as `pid` was exec'd with (None when absent or unreadable)."""
    key = MARKER_VAR.encode() + b"="
    for item in procfs.environ(pid) or []:
        if item.startswith(key):
            return item[len(key) :].decode("utf-8", "replace")
    return None


@dataclass(frozen=True, slots=True)
class SpawnFacts:
    """What the host handed a backend in its environment besides the marker (None where a
    backend of an older host, or an unreadable environment, does not say)."""

    port: int | None
    key_hash: str | None
    spawn_id: str | None = None


def new_spawn_id() -> str:
    return secrets.token_hex(16)


def spawn_facts(pid: int) -> SpawnFacts:
    """PORT_VAR, KEY_VAR and SPAWN_VAR as `pid` was exec'd with, from one read of its
    environment."""
    port: int | None = None
    key_hash: str | None = None
    spawn_id: str | None = None
    for item in procfs.environ(pid) or []:
        name, _, value = item.partition(b"=")
        if name == PORT_VAR.encode() and value.isdigit() and 0 < int(value) < 65536:
            port = int(value)
        elif len(value) == 32 and not value.strip(_HEX):
            if name == KEY_VAR.encode():
                key_hash = value.decode()
            elif name == SPAWN_VAR.encode():
                spawn_id = value.decode()
    return SpawnFacts(port, key_hash, spawn_id)


def key_fingerprint(host_id: str, key: str) -> str:
    """What a record keeps of the API key a backend was given: a salted hash, never the key."""
    return hashlib.sha256(f"{host_id}\0{key}".encode()).hexdigest()[:32]


# --- what of ours runs here ------------------------------------------------------------------


class SharedScan:
    """One blocking scan shared by the threads that ask for it at the same time.

    A caller gets the result of a scan that started after it asked, so the answer is as fresh
    as a scan of its own would be; callers that arrive while a scan runs share the next one.
    200 concurrent stops then scan the process table a handful of times instead of 200 times over.
    """

    def __init__(self, scan: Callable[[], T]) -> None:
        self._scan = scan
        self._cond = threading.Condition()
        self._started = 0  # scans begun
        self._finished = 0  # the number of the scan whose outcome is kept
        self._running = False
        self._outcome: tuple[T | None, BaseException | None] = (None, None)
        self.scans = 0  # how many ran (for tests and benches)

    def __call__(self) -> T:
        with self._cond:
            wanted = self._started + 1  # the first scan to begin from now on
            while self._finished < wanted:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._started += 1
                number = self._started
                self._cond.release()
                try:
                    outcome: tuple[T | None, BaseException | None] = (self._scan(), None)
                except Exception as err:  # handed to every caller of this scan
                    outcome = (None, err)
                finally:
                    self._cond.acquire()
                    self._running = False
                self.scans += 1
                self._outcome, self._finished = outcome, number
                self._cond.notify_all()
            value, err = self._outcome
            if err is not None:
                raise err
            return value  # type: ignore[return-value]


def _scan_markers() -> dict[str, list[Identity]]:
    """Every live process that carries a marker, by marker: one pass over procfs."""
    # The environment first and the stat fields of carriers only: most processes carry no
    # marker, and reading every one's stat fields too (procfs.table) made a scan 2.5x slower.
    found: dict[str, list[Identity]] = {}
    for pid in procfs.pids():
        m = marker_of(pid)
        if m is None:
            continue
        ident = identity_of(pid)
        if ident is not None:
            found.setdefault(m, []).append(ident)
    return found


marked_processes = SharedScan(_scan_markers)


def carriers(expected_marker: str) -> list[Identity]:
    """Live processes carrying exactly `expected_marker` (a backend and all its workers)."""
    return list(marked_processes().get(expected_marker, ()))


def ours_running(host_id: str) -> dict[str, list[Identity]]:
    """Every live process carrying this host's marker, by instance id."""
    prefix = host_id + ":"
    return {
        m[len(prefix) :]: list(idents)
        for m, idents in marked_processes().items()
        if m.startswith(prefix)
    }


def session_members(sid: int) -> list[int]:
    """Live processes in session `sid` (a backend runs in a session of its own)."""
    return [pid for pid, st in procfs.table().items() if st.sid == sid and st.state != b"Z"]


# --- owns this port ------------------------------------------------------------------------------


def listeners() -> dict[int, set[int]]:
    """Listening TCP sockets (IPv4 and IPv6, any address): port -> socket inodes.

    From the kernel's sock_diag (only listening sockets, in binary); from the TCP table in
    procfs where netlink is not allowed, which lists every socket, TIME_WAIT ones included."""
    found = sockdiag.tcp_listeners()
    if found is not None:
        return found
    return procfs.tcp_listeners()


def listener_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port`, on any address."""
    return listeners().get(port, set()) - {0}


def owns_port(
    identity: Identity,
    port: int,
    expected_marker: str | None,
    listening: dict[int, set[int]] | None = None,
) -> bool:
    """True when the socket listening on `port` belongs to the backend's process tree.
    `listening`: a listeners() snapshot, when the caller checks many backends at once."""
    inodes = (listening.get(port, set()) - {0}) if listening is not None else listener_inodes(port)
    if not inodes or not is_same(identity):
        return False
    pid = identity.pid
    if procfs.holds_socket(pid, inodes):
        return True  # the usual case: the backend itself listens
    with contextlib.suppress(OSError):
        for member in session_members(os.getsid(pid)):
            if member != pid and procfs.holds_socket(member, inodes):
                return True
    if expected_marker is not None:
        for ident in carriers(expected_marker):
            if ident.pid != pid and procfs.holds_socket(ident.pid, inodes):
                return True
    return False


def backend_root(carrying: list[Identity]) -> Identity | None:
    """The backend among the live processes carrying one instance's marker, or None.

    A backend is spawned as the leader of a session of its own; its workers live in that
    session, or lead sessions they made later (so they are younger). The oldest session leader
    carrying the marker is therefore the backend."""
    leaders = []
    for ident in carrying:
        with contextlib.suppress(OSError):
            if os.getsid(ident.pid) == ident.pid:
                leaders.append(ident)
    return min(leaders, key=lambda i: i.start_ticks, default=None)


def listening_ports(identity: Identity, listening: dict[int, set[int]] | None = None) -> list[int]:
    """Ports on which a socket of the process, or of a process in its session, listens."""
    table = listening if listening is not None else listeners()
    pid = identity.pid
    with contextlib.suppress(OSError):
        members = [pid, *(m for m in session_members(os.getsid(pid)) if m != pid)]
        return sorted(
            port
            for port, inodes in table.items()
            if inodes - {0} and any(procfs.holds_socket(m, inodes - {0}) for m in members)
        )
    return []


# --- the backend's processes ---------------------------------------------------------------------


def backend_processes(
    root: Identity, marker: str | None, port: int | None, sockets: frozenset[int]
) -> list[Identity]:
    """Every process of the backend `root` other than itself: what a signal to its group may
    miss (workers that called setsid(), the group's members once its leader is gone) and what
    its marker cannot find (a process that overwrote its exec'd environment, as setproctitle
    does for a long title, or that exec'd with an empty one). Blocking.

    Each is the backend's beyond doubt: it carries `marker`, or lives in the backend's session
    (a session id is never reused while a member lives), or descends from one of those by its
    parent chain, or holds one of `sockets`, listening on `port` and proved the backend's own
    (own_sockets)."""
    found: dict[int, Identity] = {}
    if marker is not None:
        # Members of the backend's group (one whose leader died keeps its id) that carry the
        # marker are among the carriers too: one scan finds them all.
        found.update((i.pid, i) for i in carriers(marker))
    found.update((i.pid, i) for i in _kin(root, set(found), port, sockets))
    found.pop(root.pid, None)
    return list(found.values())


def _kin(
    root: Identity, known: set[int], port: int | None, sockets: frozenset[int]
) -> list[Identity]:
    """The backend's session, the descendants of it and of `known` (marker carriers), and the
    holders of its proved listening sockets, from one read of the process table. Blocking."""
    root_alive = is_same(root)
    # A live process with the backend's pid that is not the backend: the pid was reused, so
    # the session of that id (and that process's children) are someone else's.
    reused = not root_alive and identity_of(root.pid) is not None
    table = {pid: st for pid, st in procfs.table().items() if not st.exited}
    members: set[int] = set()
    if not reused:
        members = {
            pid
            for pid, st in table.items()
            if st.sid == root.pid and st.start_ticks >= root.start_ticks
        }
    # Descendants by their parent chain: a child never starts before its parent.
    children: dict[int, list[int]] = {}
    for pid, st in table.items():
        children.setdefault(st.ppid, []).append(pid)
    todo = [*members, *(p for p in known if p in table)]
    if root_alive:
        todo.append(root.pid)
    seen = set(todo)
    while todo:
        parent = todo.pop()
        if parent == root.pid:
            parent_ticks = root.start_ticks
        else:
            parent_ticks = table[parent].start_ticks if parent in table else 0
        for child in children.get(parent, ()):
            if child not in seen and table[child].start_ticks >= parent_ticks:
                seen.add(child)
                todo.append(child)
    if port is not None and sockets:
        live = listeners().get(port, set()) & sockets
        if live:
            seen.update(p for p in table if p not in seen and procfs.holds_socket(p, live))
    seen.discard(root.pid)
    seen.discard(os.getpid())
    return [Identity(root.boot_id, pid, table[pid].start_ticks) for pid in seen if pid in table]


def own_sockets(identity: Identity, port: int) -> frozenset[int] | None:
    """The sockets listening on `port` that are the backend's own: held by it or by a process
    of its session. Whoever holds one later got it from the backend (backend_processes).
    None when nothing listens there (nothing proved, nothing disproved)."""
    inodes = listener_inodes(port)
    if not inodes:
        return None
    held = frozenset(i for i in inodes if procfs.holds_socket(identity.pid, {i}))
    if held == inodes:
        # The usual case: the backend holds them all. Its session's members are only looked
        # for (a scan of all of /proc, 1.7 ms of every start here) when it does not.
        return held
    holders = [identity.pid]
    with contextlib.suppress(OSError):
        holders += [m for m in session_members(os.getsid(identity.pid)) if m != identity.pid]
    return frozenset(i for i in inodes if any(procfs.holds_socket(p, {i}) for p in holders))


def strays(
    ours: Mapping[str, Collection[Identity]],
    owners: Mapping[str, Identity],
    starting: Collection[str] = (),
    protected_ids: Collection[str] = (),
    protected_pids: Collection[int] = (),
) -> list[Identity]:
    """The processes of `ours` (ours_running: this host's marker carriers, by instance id)
    that no instance owns, for the boot sweep to stop.

    `owners`: instance id -> the backend its supervisor holds; that backend and the workers
    it started since are its own (a carrier older than it is a leftover of an earlier backend
    of the same instance). `starting`: instances whose start is in flight and adopted nothing:
    what carries their marker is that start's own. `protected_ids`, `protected_pids`:
    quarantined config.json entries keep their backends (and those backends' workers), known
    by the entry's id in their marker, or by its recorded pid."""
    found: list[Identity] = []
    for iid, idents in ours.items():
        if iid in protected_ids or iid in starting:
            continue
        if any(ident.pid in protected_pids for ident in idents):
            continue
        owner = owners.get(iid)
        found.extend(i for i in idents if owner is None or i.start_ticks < owner.start_ticks)
    return found


# --- a backend the previous release recorded ----------------------------------------------------


Verdict = Literal["gone", "other", "backend", "unsure"]


def programs_of(argv: list[str]) -> set[str]:
    """What a command line runs: its executable's name and, behind an interpreter's options,
    the module (`-m X`) or script it was given."""
    if not argv:
        return set()
    found = {os.path.basename(argv[0])}
    rest = argv[1:]
    for i, arg in enumerate(rest):
        if arg == "-m":
            if i + 1 < len(rest):
                found.add(rest[i + 1])
            break
        if arg.startswith("-"):
            continue  # an interpreter's flag (python -u)
        found.add(os.path.basename(arg))
        break
    return found


def runs_one_of(argv: list[str], names: Collection[str]) -> bool:
    """Whether the command line runs one of these programs (or a `name-...` variant of one)."""
    return any(p == n or p.startswith(n + "-") for p in programs_of(argv) for n in names)


def judge_unmarked(
    pid: int, port: int | None, programs: Collection[str], kind: str
) -> tuple[Verdict, Identity | None, str]:
    """Whether `pid`, recorded as a `kind` backend listening on `port` by a host that kept no
    identity and gave no marker (the previous release), is still that backend: "backend" when
    it runs one of `programs` and listens there, "other" when it does neither, "gone" when it
    exited, "unsure" for half the evidence; with its identity and why."""
    ident = identity_of(pid)
    if ident is None:
        return "gone", None, "it exited"
    try:
        argv = cmdline_of(pid)
    except PermissionError:
        return "unsure", ident, "its command line cannot be read"
    except OSError:
        return "gone", None, "it exited"
    runs_kind = runs_one_of(argv, programs)
    # Program names only: the previous release put the host key on backends' command lines.
    runs = " ".join(sorted(programs_of(argv))) or "nothing (no command line)"
    # owns_port reads the process's descriptors: unreadable ones read as "not listening",
    # which with a matching program is "unsure", never "backend".
    listens = port is not None and owns_port(ident, port, None)
    if runs_kind and listens:
        return "backend", ident, f"it runs {runs} and listens on port {port}"
    if not runs_kind and not listens:
        return "other", ident, "its pid now runs another program, not listening on that port"
    if runs_kind:
        return "unsure", ident, f"it runs {runs} but does not listen on port {port}"
    why = f"it listens on port {port} but runs {runs}, not a {kind} backend"
    return "unsure", ident, why


def start_time(identity: Identity) -> float:
    """When the process started, in seconds since the epoch (boot time + its start ticks)."""
    return procfs.boot_time() + identity.start_ticks / procfs.clock_ticks()


def cmdline_of(pid: int) -> list[str]:
    """The process's command line, for display (raises OSError once it is gone)."""
    return procfs.cmdline(pid)


def stdout_path(pid: int) -> Path | None:
    """The file the process writes its standard output to, when it is a regular file."""
    target = procfs.fd_target(pid, 1)
    if target is None:
        return None
    path = Path(target)
    return path if path.is_absolute() and path.is_file() else None


def port_holders(port: int) -> list[int]:
    """Pids holding a socket that listens on `port` (those whose descriptors we can read)."""
    inodes = listener_inodes(port)
    if not inodes:
        return []
    return [pid for pid in procfs.pids(include_self=True) if procfs.holds_socket(pid, inodes)]


def describe(pid: int) -> str:
    """`pid (name)` for messages; the command line is for people, never for identity."""
    name = procfs.comm(pid)
    return str(pid) if name is None else f"{pid} ({name})"
