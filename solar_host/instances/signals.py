"""Signal exactly the process meant: the one way the host signals a backend or a worker (and
waits on its end).

A pid alone is not a process: once the process exits and is reaped, the kernel gives its pid
to the next process started. Checking the identity and then calling kill(pid) leaves a window
in which the pid can be reused, and the signal reaches a stranger. A pidfd closes it: it
refers to the process it was opened on, and pidfd_send_signal reaches that process or, once
it exited, nothing (even if its pid was reused since). So the pidfd is opened first and the
identity checked after: a pidfd opened on a pid already reused fails the check, and one that
passes can only reach the process the identity names.

Blocking (procfs reads): callers on the event loop use asyncio.to_thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import Iterator

from solar_host.instances import ownership
from solar_host.instances.ownership import Identity

PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2  # linux/pidfd.h (Linux 6.9); Python 3.11 does not name it
# Set once the kernel refused that flag (older than 6.9): killpg from then on.
_group_flag_refused = False


async def ended(pidfd: int, timeout: float | None = None) -> bool:
    """Wait until the process of `pidfd` exits (its pidfd turns readable, and stays so), at
    most `timeout` seconds (None: for as long as it runs). True if it did. The caller opened
    the pidfd, checked it is the process meant, and closes it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        async with asyncio.timeout(timeout):
            await done
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
    return True


@contextlib.contextmanager
def _pinned(ident: Identity) -> Iterator[int | None]:
    """A pidfd on the process `ident` names, checked to be it after opening; -1 where the
    kernel has no pidfds (then the check right before the signal is all there is); None when
    that process is gone."""
    try:
        fd = os.pidfd_open(ident.pid)
    except ProcessLookupError:
        yield None
        return
    except OSError:
        fd = -1  # no pidfd (an old kernel)
    try:
        yield fd if ownership.is_same(ident) else None
    finally:
        if fd >= 0:
            os.close(fd)


def send(ident: Identity, sig: int) -> bool:
    """Signal the process `ident`, if it is still that process. False when it is gone (or its
    pid now belongs to another process, which is not signalled) or may not be signalled."""
    with _pinned(ident) as fd:
        if fd is None:
            return False
        try:
            if fd >= 0:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(ident.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True


def send_group(leader: Identity, sig: int) -> bool:
    """Signal the process group that `leader` leads (a backend spawned in a session of its
    own), if `leader` is still that process. False when it is gone or may not be signalled.

    Through its pidfd where the kernel can (Linux 6.9, PIDFD_SIGNAL_PROCESS_GROUP): the group
    is then the one the pidfd's process leads, even if that exits and its pid is reused right
    after the check. Elsewhere killpg of the leader's pid: a group id is not given to another
    process while a member of the group lives, and the leader was one at the check."""
    global _group_flag_refused
    with _pinned(leader) as fd:
        if fd is None:
            return False
        try:
            if fd >= 0 and not _group_flag_refused:
                try:
                    signal.pidfd_send_signal(fd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
                    return True
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    _group_flag_refused = True
            os.killpg(leader.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True
