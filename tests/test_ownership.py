"""Ownership of backends across host restarts (issue 15), with real processes and real sockets.

A backend is the same process when boot id, pid and start ticks match (exec wrappers change
the command line, not those); it is ours when it carries this state directory's marker; it is
ready when the socket on its port is its own. Hosts are subprocesses (tests/fixtures/hostproc),
killed with SIGKILL where the point is a crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.instances import ownership
from solar_host.instances.ports import PortAllocator
from solar_host.instances.store import ProcessRecord
from tests.fixtures.hostproc import HostProc
from tests.fixtures.script_backend import script_config
from tests.fixtures.waiting import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def ours(h: HostProc) -> dict[str, list[int]]:
    """Live processes carrying this host directory's marker, by instance id."""
    host_id = ownership.load_host_id(h.tmp / "config.json")
    return {
        iid: sorted(i.pid for i in idents)
        for iid, idents in ownership.ours_running(host_id).items()
    }


def create(c: httpx.Client, h: HostProc, alias: str, *fake: str, **extra: Any) -> str:
    r = c.post("/instances", json={"config": script_config(h.tmp, *fake, alias=alias, **extra)})
    assert r.status_code == 200, r.text
    return r.json()["instance"]["id"]


def start(c: httpx.Client, iid: str) -> dict[str, Any]:
    r = c.post(f"/instances/{iid}/start")
    assert r.status_code == 200, r.text
    return r.json()["instance"]


def get(c: httpx.Client, iid: str) -> dict[str, Any]:
    return c.get(f"/instances/{iid}").json()


def on_disk_status(h: HostProc, iid: str) -> str | None:
    """The status config.json holds for `iid` (what a host killed now leaves to the next)."""
    import json

    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((h.tmp / "config.json").read_text())
        for entry in doc.get("instances", []):
            if entry["instance"]["id"] == iid:
                return entry["instance"]["status"]
    return None


def in_background(fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(httpx.HTTPError):
            fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def alive(pid: int) -> bool:
    return ownership.identity_of(pid) is not None


# --- identity: exec wrappers ---------------------------------------------------------------

LAUNCHER = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"


def _wrappers(tmp: Path) -> dict[str, list[str] | None]:
    script = tmp / "wrap.sh"
    script.write_text('#!/bin/sh\nexport LD_LIBRARY_PATH=/nonexistent\nexec "$@"\n')
    script.chmod(0o755)
    numactl = shutil.which("numactl")
    return {
        "bare": [],
        "sh-c-exec": ["/bin/sh", "-c", 'exec "$@"', "sh"],
        "env": ["env", "WRAPPED=1"],
        "stdbuf": ["stdbuf", "-oL"],
        "numactl": [numactl, "--localalloc"] if numactl else None,
        "shebang-script": [str(script)],
        "python-launcher": [sys.executable, "-c", LAUNCHER],
    }


@pytest.mark.parametrize(
    "wrapper",
    ["bare", "sh-c-exec", "env", "stdbuf", "numactl", "shebang-script", "python-launcher"],
)
def test_exec_wrapper_readopts_like_the_bare_binary(tmp_path: Path, wrapper: str) -> None:
    prefix = _wrappers(tmp_path)[wrapper]
    if prefix is None:
        pytest.skip(f"{wrapper} is not installed")
    with HostProc(tmp_path / "h") as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "w", fake_wrapper=prefix)
            inst = start(c, iid)
        pid = inst["pid"]
        # The exec happened: the command line the kernel shows now is the real program's.
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"fake_backend.py" in b" ".join(cmdline)
        h.restart()
        with h.client() as c:
            again = get(c, iid)
            assert again["status"] == "running" and again["pid"] == pid, again
            assert ours(h) == {iid: [pid]}
            assert c.post(f"/instances/{iid}/stop").status_code == 200
        assert wait_for(lambda: not alive(pid), 10, "the backend to stop")


def test_real_llama_server_behind_an_exec_wrapper_is_readopted(tmp_path: Path) -> None:
    """The case of the issue: LLAMA_SERVER_BIN a script that sets a library path and execs."""
    from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf

    try:
        real = llama_server_binary()
    except RuntimeError as err:
        pytest.skip(str(err))
    wrapper = tmp_path / "llama-server-wrapper"
    wrapper.write_text(f'#!/bin/sh\nexport LD_LIBRARY_PATH="$LD_LIBRARY_PATH"\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    model = write_tiny_gguf(tmp_path / "h" / "models" / "tiny.gguf")
    config = {"backend_type": "llamacpp", "alias": "tiny:1", "model": str(model), "ctx_size": 512}
    with HostProc(tmp_path / "h", backend="real", env={"LLAMA_SERVER_BIN": str(wrapper)}) as h:
        h.start(timeout=60)
        with h.client(timeout=120) as c:
            iid = c.post("/instances", json={"config": config}).json()["instance"]["id"]
            pid = start(c, iid)["pid"]
        for _ in range(2):
            h.restart(timeout=60)
            with h.client() as c:
                inst = get(c, iid)
                assert inst["status"] == "running" and inst["pid"] == pid, inst
        with h.client() as c:
            assert c.post(f"/instances/{iid}/stop").status_code == 200


# --- ours, provably ------------------------------------------------------------------------


def test_two_hosts_sharing_a_log_dir_never_touch_each_others_backends(tmp_path: Path) -> None:
    """Two state directories, one LOG_DIR: the LOG_DIR lock lets only one host live at a time,
    and each one's boot sweep spares the other's backends (they carry another host's marker),
    whatever directory their logs are in."""
    logs = tmp_path / "shared-logs"
    with (
        HostProc(tmp_path / "a", env={"LOG_DIR": str(logs)}) as a,
        HostProc(tmp_path / "b", env={"LOG_DIR": str(logs)}) as b,
    ):
        a.start()
        with a.client() as c:
            ia = create(c, a, "a")
            pid_a = start(c, ia)["pid"]
        b.start(wait=False)
        assert b.proc is not None and b.proc.wait(timeout=60) == 1  # LOG_DIR is a's
        assert "in use by another solar-host" in b.log()
        a.kill()
        b.start()
        with b.client() as c:
            ib = create(c, b, "b")
            pid_b = start(c, ib)["pid"]
        for _ in range(2):
            for up, down in ((a, b), (b, a)):
                down.kill()
                up.start()
                time.sleep(0.5)  # the boot sweep runs in the background
                assert alive(pid_a) and alive(pid_b)
        a.kill()
        b.kill()
        for h, iid, pid in ((a, ia, pid_a), (b, ib, pid_b)):
            h.start()
            with h.client() as c:
                inst = get(c, iid)
            assert inst["status"] == "running" and inst["pid"] == pid, inst
            h.kill()
        assert ours(a) == {ia: [pid_a]} and ours(b) == {ib: [pid_b]}
        assert ownership.host_id_path(a.tmp / "config.json").stat().st_mode & 0o777 == 0o600


def test_unrecorded_backend_of_ours_is_swept_after_the_host_serves(tmp_path: Path) -> None:
    """A host killed between spawn and record leaves a backend nobody manages: the next boot
    stops it (it carries the marker), but the host answers /health before that stop ends.

    The stray ignores SIGTERM, so a boot that waited for its stop would have waited out the
    whole grace and killed it: the stray still alive once the host serves shows the boot did
    not wait (a comparison of boot times showed nothing more, and failed under load)."""
    with HostProc(tmp_path / "h", env={"STOP_GRACE_S": "8"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "x", "--ignore-sigterm")
            pid = start(c, iid)["pid"]
        h.kill()
        # Forget the record, as if the host had died before writing it.
        config = h.tmp / "config.json"
        config.write_text('{"roles": ["inference"], "instances": []}')
        h.start()
        assert alive(pid), "boot waited for the stray's stop before serving"
        wait_for(lambda: "stopping unmanaged backend pid" in h.log(), 30, "the sweep to begin")
        wait_for(lambda: not alive(pid), 60, "the stray to be swept")
        assert "stopping unmanaged backend pid" in h.log()


# --- re-adoption -----------------------------------------------------------------------------


def test_backend_still_loading_is_adopted_as_starting_never_reloaded(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h") as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "slow", "--ready-after", "4")
            t = in_background(lambda: h.client().post(f"/instances/{iid}/start"))
            inst = wait_for(lambda: (i := get(c, iid))["pid"] and i, 10, "the spawn")
        pid = inst["pid"]
        h.kill()
        t.join(10)
        took = h.start()
        with h.client() as c:
            inst = get(c, iid)
            assert inst["status"] == "starting" and inst["pid"] == pid, inst
            inst = wait_for(
                lambda: (i := get(c, iid))["status"] != "starting" and i, 20, "readiness"
            )
            assert inst["status"] == "running" and inst["pid"] == pid, inst
        assert ours(h) == {iid: [pid]}
        assert took < 10


def test_busy_backend_without_health_path_is_readopted_whatever_its_log(tmp_path: Path) -> None:
    """Ready line far above the last 2,000 log lines: still adopted, by identity and socket."""
    with HostProc(tmp_path / "h", env={"SCRIPT_BACKEND_HEALTH": "0"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "busy", "--flood-after-ready", "20000")
            pid = start(c, iid)["pid"]
            wait_for(
                lambda: any(
                    "FLOOD_DONE" in e["line"] for e in c.get(f"/instances/{iid}/logs").json()
                ),
                20,
                "the flood",
            )
        h.restart()
        with h.client() as c:
            inst = get(c, iid)
            assert inst["status"] == "running" and inst["pid"] == pid, inst


# --- the listener is ours ---------------------------------------------------------------------


class _Answer200(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *a: object) -> None:
        pass


@contextlib.contextmanager
def impostor(port: int) -> Any:
    """Another program on `port`, answering 200 to everything (a second host's backend)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _Answer200)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_someone_elses_200_on_the_port_is_not_readiness(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h", env={"MAX_RETRIES": "2"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "late", "--ready-after", "2")
            t = in_background(lambda: h.client().post(f"/instances/{iid}/start"))
            first = wait_for(lambda: (i := get(c, iid))["pid"] and i, 10, "the spawn")
            seen: list[tuple[str, int]] = []
            with impostor(first["port"]):
                # Ours binds after 2 s and finds the port taken: never `running` there.
                for _ in range(30):
                    i = get(c, iid)
                    seen.append((i["status"], i["port"]))
                    time.sleep(0.05)
                t.join(30)
                final = get(c, iid)
            assert ("running", first["port"]) not in seen, seen
            assert final["status"] == "running" and final["port"] != first["port"], final
            assert ownership.owns_port(ownership.identity_of(final["pid"]), final["port"], None)


def test_explicit_port_held_by_another_process_is_a_409_naming_it(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with HostProc(tmp_path / "h") as h:
            h.start()
            with h.client() as c:
                iid = create(c, h, "p", port=port)
                r = c.post(f"/instances/{iid}/start")
                assert r.status_code == 409, r.text
                assert f"pid {os.getpid()}" in r.text, r.text
            assert ours(h) == {}


def test_allocation_skips_ports_someone_listens_on_any_family(tmp_path: Path) -> None:
    listeners = []
    try:
        v4 = socket.socket()
        v4.bind(("127.0.0.1", 0))
        v4.listen()
        listeners.append(v4)
        base = v4.getsockname()[1]
        with contextlib.suppress(OSError):
            v6 = socket.socket(socket.AF_INET6)
            v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            v6.bind(("::1", base + 1))  # invisible to an IPv4 bind test
            v6.listen()
            listeners.append(v6)
        alloc = PortAllocator(base, held=set, end_port=base + 50)
        port = alloc.allocate("127.0.0.1")
        assert port not in {sock.getsockname()[1] for sock in listeners}
        assert alloc.holder(base, "127.0.0.1") == f"pid {ownership.describe(os.getpid())}"
    finally:
        for sock in listeners:
            sock.close()


def test_a_port_holder_lookup_does_not_hold_up_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Naming who holds an explicit port scans every process's descriptors (hundreds of ms on
    a busy machine); it held the allocator's lock, which release() and claim_adopted() take on
    the event loop at every stop, crash and adoption. The scan is made slow here (a real one
    needs thousands of processes); the loop's calls must not wait for it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    scanning, real = threading.Event(), ownership.port_holders

    def slow_scan(p: int) -> list[int]:
        scanning.set()
        time.sleep(1.5)
        return real(p)

    monkeypatch.setattr(ownership, "port_holders", slow_scan)
    alloc = PortAllocator(port + 1, held=set, end_port=port + 20)
    answer: list[str | None] = []
    lookup = threading.Thread(target=lambda: answer.append(alloc.holder(port, "127.0.0.1")))
    try:
        lookup.start()
        assert scanning.wait(10)
        t0 = time.perf_counter()
        alloc.claim_adopted(port + 5)
        alloc.release(port + 5)
        assert time.perf_counter() - t0 < 0.2
        lookup.join(10)
        assert answer == [f"pid {ownership.describe(os.getpid())}"]
    finally:
        listener.close()


# --- durable intent ---------------------------------------------------------------------------


def test_stop_lost_in_a_host_crash_is_finished_and_never_restarted(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h", env={"STOP_GRACE_S": "6"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "s", "--ignore-sigterm")
            pid = start(c, iid)["pid"]
            t = in_background(lambda: h.client().post(f"/instances/{iid}/stop"))
            wait_for(lambda: on_disk_status(h, iid) == "stopping", 10, "the stop on disk")
        time.sleep(0.5)
        h.kill()
        t.join(10)
        assert alive(pid)  # it ignores SIGTERM: the stop was not done
        h.start()
        # The stop is finished in the background: the host served before it ended.
        assert alive(pid), "boot waited for the unfinished stop before serving"
        with h.client() as c:
            inst = wait_for(lambda: (i := get(c, iid))["status"] == "stopped" and i, 20, "stop")
            assert inst["pid"] is None
            time.sleep(1.0)
            assert get(c, iid)["status"] == "stopped"
        assert not alive(pid) and ours(h) == {}


def test_restart_lost_in_a_host_crash_ends_running_once(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h", env={"STOP_GRACE_S": "3"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "r", "--ignore-sigterm")
            pid = start(c, iid)["pid"]
            t = in_background(lambda: h.client().post(f"/instances/{iid}/restart"))
            # Killed once the restart is on disk (before that, the backend is simply adopted).
            wait_for(lambda: on_disk_status(h, iid) == "stopping", 10, "the restart on disk")
        h.kill()
        t.join(10)
        h.start()
        with h.client() as c:
            inst = wait_for(
                lambda: (i := get(c, iid))["status"] == "running" and i["pid"] != pid and i,
                30,
                "the restart to finish",
            )
        assert not alive(pid)
        assert ours(h) == {iid: [inst["pid"]]}


# --- whole trees ------------------------------------------------------------------------------


def _tree(h: HostProc, iid: str) -> list[int]:
    pids = ours(h).get(iid, [])
    assert len(pids) == 3, pids  # the backend and its two workers
    return pids


@pytest.mark.parametrize("how", ["stop", "crash", "host-crash", "delete"])
def test_no_worker_survives(tmp_path: Path, how: str) -> None:
    with HostProc(tmp_path / "h", env={"STOP_GRACE_S": "2"}) as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "t", "--workers")
            pid = start(c, iid)["pid"]
            tree = wait_for(lambda: len(ours(h).get(iid, [])) == 3 and ours(h)[iid], 10, "workers")
            assert pid in tree
            if how == "stop":
                assert c.post(f"/instances/{iid}/stop").status_code == 200
            elif how == "delete":
                assert c.post(f"/instances/{iid}/stop").status_code == 200
                assert c.delete(f"/instances/{iid}").status_code == 200
            elif how == "crash":
                os.kill(pid, signal.SIGKILL)
                # restarted with backoff: a fresh tree of three, none of the old
                new = wait_for(
                    lambda: (i := get(c, iid))["status"] == "running" and i["pid"] != pid and i,
                    20,
                    "the crash restart",
                )
                wait_for(lambda: len(ours(h).get(iid, [])) == 3, 10, "new workers")
                assert not set(tree) & set(ours(h)[iid]), (tree, ours(h))
                assert new["pid"] in ours(h)[iid]
                assert c.post(f"/instances/{iid}/stop").status_code == 200
        if how == "host-crash":
            h.kill()
            os.kill(pid, signal.SIGKILL)  # the backend dies while no host watches
            h.start()
        wait_for(lambda: not any(alive(p) for p in tree), 15, f"no worker left after {how}")
        if how != "host-crash":
            assert ours(h) == {}


# --- keys -------------------------------------------------------------------------------------


def test_backend_with_an_outdated_key_is_restarted_after_readoption(tmp_path: Path) -> None:
    with HostProc(tmp_path / "h", api_key="old-key-0123456789abcdef") as h:
        h.start()
        with h.client() as c:
            iid = create(c, h, "k")
            inst = start(c, iid)
            same = create(c, h, "k2")
        h.kill()
        h.api_key = "new-key-fedcba9876543210"
        h.start()
        with h.client() as c:
            new = wait_for(
                lambda: (i := get(c, iid))["status"] == "running" and i["pid"] != inst["pid"] and i,
                30,
                "the key restart",
            )
            assert get(c, same)["status"] == "stopped"
        url = f"http://127.0.0.1:{new['port']}/v1/models"
        assert httpx.get(url, headers={"Authorization": f"Bearer {h.api_key}"}).status_code == 200
        assert "no longer the host's" in h.log()
        # The record keeps a hash of the key, never the key.
        text = (h.tmp / "config.json").read_text()
        assert h.api_key not in text and "key_hash" in text


# --- records ----------------------------------------------------------------------------------


def test_old_process_records_still_load() -> None:
    old = {
        "pid": 123,
        "create_time": 1.5,
        "start_ticks": 99,
        "cmdline": ["llama-server", "--port", "3500"],
        "port": 3500,
        "log_file": None,
        "spawned_at": None,
        "seq_base": 0,
    }
    rec = ProcessRecord.model_validate(old)
    assert rec.boot_id is None and rec.marker is None and rec.key_hash is None
    me = ownership.identity_of(os.getpid())
    assert me is not None and ownership.is_same(me)
    assert not ownership.is_same(ownership.Identity(me.boot_id, me.pid, me.start_ticks + 1))
    assert not ownership.is_same(ownership.Identity("another-boot", me.pid, me.start_ticks))


# --- the loop never blocks on a spawn --------------------------------------------------------


async def test_200_concurrent_starts_do_not_stall_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spawning (fork/exec, /proc reads) and port allocation (a read of every listening
    socket) run off the event loop: every one of 200 starts at once does them in a worker
    thread, the loop never stalls for long and /health answers."""
    import asyncio

    from solar_host.backends.registry import BackendRegistry
    from solar_host.instances import process as procs
    from tests.fixtures.host import host_settings, running_host
    from tests.fixtures.script_backend import ScriptBackend

    n = 200
    # A backend that never gets ready and costs nothing: the point is the spawn itself.
    idle = ["/bin/sh", "-c", "exec sleep 300", "sh"]
    settings = host_settings(
        tmp_path, instance_ready_timeout_s=300.0, max_retries=0, stop_grace_s=1.0
    )
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        m = h.instances
        ids = [
            (await m.create(script_config(tmp_path, alias=f"s{i}", fake_wrapper=idle))).id
            for i in range(n)
        ]
        # Which thread each spawn and each port allocation ran in.
        on_loop = threading.get_ident()
        ran_in: dict[str, list[int]] = {"spawn": [], "allocate": []}

        def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                ran_in[name].append(threading.get_ident())
                return fn(*args, **kwargs)

            return call

        monkeypatch.setattr(procs, "spawn", recorded("spawn", procs.spawn))
        monkeypatch.setattr(m.ports, "allocate", recorded("allocate", m.ports.allocate))
        lag = 0.0
        health: list[float] = []

        async def watch(done: asyncio.Event) -> None:
            nonlocal lag
            async with httpx.AsyncClient(base_url=h.url, timeout=30) as probe:
                while not done.is_set():
                    t0 = time.monotonic()
                    await asyncio.sleep(0.01)
                    lag = max(lag, time.monotonic() - t0 - 0.01)
                    t0 = time.monotonic()
                    assert (await probe.get("/health")).status_code == 200
                    health.append(time.monotonic() - t0)

        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        t0 = time.monotonic()
        starts = [asyncio.create_task(m.start(iid)) for iid in ids]
        while sum(1 for i in m.list() if i.pid) < n and time.monotonic() - t0 < 120:
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        done.set()
        await watcher
        assert len(ownership.ours_running(m.host_id)) == n
        assert len(ran_in["spawn"]) == n and on_loop not in ran_in["spawn"]
        assert len(ran_in["allocate"]) == n and on_loop not in ran_in["allocate"]
        # Done on the loop, the spawns stalled it for about the whole of `took`: every start
        # reaches its spawn in the same loop pass. Off it, a pass takes 0.01-0.1 s here; the
        # bound leaves room for a very loaded machine, where 200 processes starting at once
        # and two CPU hogs have kept the host's thread off the CPU for 1.5 s.
        assert lag < 5, f"the loop stalled {lag:.3f}s while {n} starts spawned ({took:.1f}s)"
        assert health and max(health) < 5, max(health)
        await asyncio.gather(*(m.stop(iid) for iid in ids))
        await asyncio.gather(*starts, return_exceptions=True)
        assert all(i.status == "stopped" for i in m.list())
        assert ownership.ours_running(m.host_id) == {}
