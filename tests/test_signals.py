"""signals: the host's one way to signal a process reaches the process it recorded, or nothing.

A recorded Identity whose process exited is never signalled, not even when its pid now belongs
to another process: real processes, and real pid reuse in a pid namespace of the test's own
(skipped where unprivileged user namespaces are not allowed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from solar_host.instances import ownership, signals

# A process that writes each SIGUSR1/SIGTERM it receives to a file, and says when it is ready.
_LISTENER = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[-1]
    def got(sig, _frame):
        with open(out, "a") as f:
            f.write(f"{os.getpid()} {sig}\\n")
    signal.signal(signal.SIGUSR1, got)
    signal.signal(signal.SIGTERM, got)
    with open(out + ".ready", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _listener(out: Path, *, new_session: bool = False) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", _LISTENER, str(out)], start_new_session=new_session)
    _wait_for(lambda: (out.parent / (out.name + ".ready")).exists(), 20, "the listener")
    return p


def _received(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


def _stop(p: subprocess.Popen[bytes]) -> None:
    p.kill()
    p.wait(10)


def test_a_live_process_gets_the_signal(tmp_path: Path) -> None:
    out = tmp_path / "got"
    p = _listener(out)
    try:
        ident = ownership.identity_of(p.pid)
        assert ident is not None
        assert signals.send(ident, signal.SIGUSR1)
        _wait_for(lambda: _received(out), 10, "the signal")
        assert _received(out) == [f"{p.pid} {int(signal.SIGUSR1)}"]
    finally:
        _stop(p)


def test_an_exited_process_is_never_signalled(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ident = ownership.identity_of(p.pid)
    assert ident is not None
    _stop(p)  # exited and reaped: its pid is free for the next process
    assert not signals.send(ident, signal.SIGTERM)
    assert not signals.send_group(ident, signal.SIGTERM)


def test_a_pid_owned_by_another_process_is_not_signalled(tmp_path: Path) -> None:
    """The recorded identity names the pid a stranger now has (another start time): what a
    recorded backend looks like once its pid was reused."""
    out = tmp_path / "got"
    stranger = _listener(out, new_session=True)
    try:
        now = ownership.identity_of(stranger.pid)
        assert now is not None
        before = ownership.Identity(now.boot_id, now.pid, now.start_ticks - 1)
        assert not signals.send(before, signal.SIGUSR1)
        assert not signals.send_group(before, signal.SIGUSR1)
        time.sleep(0.3)
        assert _received(out) == []
        # The same process under its own identity is reached: the listener works.
        assert signals.send(now, signal.SIGUSR1)
        _wait_for(lambda: _received(out), 10, "the signal")
    finally:
        _stop(stranger)


def test_the_group_signal_reaches_every_member_while_the_leader_lives(tmp_path: Path) -> None:
    out = tmp_path / "got"
    # A leader in a session of its own and a member of its group (its child): both listen.
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
            "sys.argv[2] + '.member']); exec(sys.argv[1])",
            _LISTENER,
            str(out),
        ],
        start_new_session=True,
    )
    member_ready = tmp_path / "got.member.ready"
    try:
        _wait_for(lambda: member_ready.exists() and (tmp_path / "got.ready").exists(), 20, "both")
        member = int(member_ready.read_text())
        assert os.getpgid(member) == leader.pid
        ident = ownership.identity_of(leader.pid)
        assert ident is not None
        assert signals.send_group(ident, signal.SIGUSR1)
        member_out = tmp_path / "got.member"
        _wait_for(lambda: _received(out) and _received(member_out), 10, "both signals")
        assert _received(out) == [f"{leader.pid} {int(signal.SIGUSR1)}"]
        assert _received(member_out) == [f"{member} {int(signal.SIGUSR1)}"]
        # Once the leader exited, its group is not signalled: nothing proves the id is ours.
        _stop(leader)
        assert not signals.send_group(ident, signal.SIGUSR1)
        time.sleep(0.3)
        assert len(_received(member_out)) == 1
    finally:
        if leader.poll() is None:
            _stop(leader)
        if _group_alive(leader.pid):
            os.killpg(leader.pid, signal.SIGKILL)  # the member: a group this test started


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# Runs as pid 1 of a pid namespace of its own, with /proc mounted for it: there the next pid
# can be chosen (ns_last_pid), so the test makes the kernel reuse a recorded pid for real.
_REUSE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from solar_host.instances import ownership, procfs, signals
    listener, out = sys.argv[1], sys.argv[2]

    def next_pid_is(pid):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))

    def start_listener(name):
        p = subprocess.Popen([sys.executable, "-c", listener, name])
        deadline = time.monotonic() + 20
        while not os.path.exists(name + ".ready") and time.monotonic() < deadline:
            time.sleep(0.02)
        return p

    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    recorded = ownership.identity_of(old.pid)
    pidfd = os.pidfd_open(old.pid)  # opened while the recorded process lived
    # An identity tells processes apart by their start time in clock ticks: the next one must
    # not start in the tick the recorded one did (outside a namespace whose next pid is set by
    # hand, the pid space is not cycled through within one tick).
    deadline = time.monotonic() + 10
    while procfs.uptime_s() * procfs.clock_ticks() < recorded.start_ticks + 2:
        if time.monotonic() > deadline:
            raise SystemExit("the boot clock did not move")
        time.sleep(0.01)
    old.kill()
    old.wait()
    next_pid_is(old.pid)
    new = start_listener(out)
    result = {"same_pid": new.pid == old.pid}
    result["later_tick"] = ownership.identity_of(new.pid).start_ticks > recorded.start_ticks
    result["send"] = signals.send(recorded, signal.SIGUSR1)
    result["send_group"] = signals.send_group(recorded, signal.SIGUSR1)
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGUSR1)
        result["old_pidfd"] = "sent"
    except ProcessLookupError:
        result["old_pidfd"] = "gone"
    time.sleep(0.3)
    result["received_by_new"] = open(out).read() if os.path.exists(out) else ""
    result["control"] = signals.send(ownership.identity_of(new.pid), signal.SIGUSR1)
    new.kill()
    new.wait()
    print(json.dumps(result))
    """
)


def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run(
        [unshare, "-Urpf", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"no user+pid namespace here: {probe.stderr.decode().strip()}")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run(
        [
            unshare,
            "-Urpf",
            "--mount-proc",
            sys.executable,
            "-c",
            _REUSE,
            _LISTENER,
            str(tmp_path / "got"),
        ],
        capture_output=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 0, run.stderr.decode()
    result = json.loads(run.stdout.decode().strip().splitlines()[-1])
    assert result["same_pid"], "the kernel did not reuse the pid"
    assert result == {
        "same_pid": True,
        "later_tick": True,
        "send": False,
        "send_group": False,
        "old_pidfd": "gone",  # a pidfd reaches its own process, never the pid's next owner
        "received_by_new": "",
        "control": True,
    }
