"""`solar-host handover`: restart or upgrade the host without reloading a single model.

The running host is found through the lock it holds on its state directory (statelock.py: the
lock file names its pid), told to hand over (SIGUSR2), and awaited until it has exited, leaving
its backends serving. Whoever starts the next host (systemd's `Restart=always`, a deploy script,
or the operator) gets them re-adopted, not restarted.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from solar_host.platform.statelock import holder_pid, is_locked

# The signal that asks a running host to exit and leave its backends to the next one.
HAND_OVER_SIGNAL = signal.SIGUSR2
# Every signal that does: SIGHUP too. Its default action ended the host on the spot (a closed
# terminal, a `kill -HUP` meant as "reload"): nothing saved or said; a hand-over is the same
# outcome done properly, and the "reload" a supervisor that restarts the host expects.
HAND_OVER_SIGNALS = (signal.SIGUSR2, signal.SIGHUP)


class HandOverError(Exception):
    """No host to hand over, or it did not exit in time; the message says which."""


def running_host_pid(state_dir: Path) -> int:
    """The pid of the host that holds `state_dir` now.

    The lock decides, not the pid in the file alone: a pid left by a host that died may belong
    to another process by now, but a held lock has a live holder, who wrote its pid into it.
    """
    if not is_locked(state_dir):
        raise HandOverError(f"no solar-host is running on {state_dir} (its lock is free)")
    pid = holder_pid(state_dir)
    if pid is None:
        raise HandOverError(f"the lock of {state_dir} names no pid")
    return pid


def hand_over(state_dir: Path, *, timeout: float = 120.0) -> int:
    """Ask the host of `state_dir` to exit leaving its backends; returns its pid once gone."""
    pid = running_host_pid(state_dir)
    try:
        proc = psutil.Process(pid)
        os.kill(pid, HAND_OVER_SIGNAL)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return pid  # it exited between the lock probe and the signal: gone is what was asked
    except (PermissionError, psutil.AccessDenied) as err:
        raise HandOverError(f"cannot signal the host (pid {pid}): {err}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return pid
        except psutil.NoSuchProcess:
            return pid
        time.sleep(0.05)
    raise HandOverError(f"the host (pid {pid}) did not exit within {timeout:.0f} s")
