"""The listening-socket table from sock_diag: the same answer as /proc/net/tcp, without the
connected and TIME_WAIT sockets that make /proc slow to read under load."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest

from solar_host.instances import ownership, procfs, sockdiag

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux netlink")


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


@pytest.fixture
def sockets():
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


def test_listening_sockets_of_both_families_and_nothing_else(sockets) -> None:
    if sockdiag.tcp_listeners() is None:
        pytest.skip("netlink sock_diag is not allowed here")
    v4 = socket.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    sockets.append(v4)
    port4 = v4.getsockname()[1]
    port6 = None
    with contextlib.suppress(OSError):
        v6 = socket.socket(socket.AF_INET6)
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.bind(("::1", 0))
        v6.listen()
        sockets.append(v6)
        port6 = v6.getsockname()[1]
    # A connected pair and a closed connection (TIME_WAIT on the side that closed first):
    # neither listens.
    client = socket.create_connection(("127.0.0.1", port4))
    sockets.append(client)
    served, _ = v4.accept()
    sockets.append(served)
    bound_only = socket.socket()
    bound_only.bind(("127.0.0.1", 0))
    sockets.append(bound_only)

    table = sockdiag.tcp_listeners()
    assert table is not None
    assert inode(v4) in table[port4]
    if port6 is not None:
        assert inode(sockets[1]) in table[port6]
    assert inode(client) not in set().union(*table.values())
    assert inode(served) not in set().union(*table.values())
    assert bound_only.getsockname()[1] not in table
    # The kernel interface and /proc agree on what listens (ports opened by the test at least).
    proc = procfs.tcp_listeners()
    mine = {port4} | ({port6} if port6 else set())
    assert {p: table[p] for p in mine} == {p: proc[p] for p in mine}


def test_without_netlink_the_proc_table_answers(sockets, monkeypatch) -> None:
    v4 = socket.socket()
    v4.bind(("127.0.0.1", 0))
    v4.listen()
    sockets.append(v4)

    def refused(*args, **kwargs):
        raise PermissionError("netlink refused")

    monkeypatch.setattr(sockdiag.socket, "socket", refused)
    assert sockdiag.tcp_listeners() is None
    assert inode(v4) in ownership.listeners()[v4.getsockname()[1]]
