"""Listening TCP sockets from the kernel's sock_diag netlink interface.

The kernel's TCP table (procfs.tcp_listeners) lists every TCP socket of the namespace,
TIME_WAIT leftovers included: a host probing 200 loading backends leaves thousands of them, and
parsing those lines in Python costs milliseconds per read, all of it holding the GIL (the event
loop waits behind it). sock_diag filters by state in the kernel and answers with only the
listening sockets, in binary, in a fraction of a millisecond.

`tcp_listeners()` returns None where netlink is not allowed (some sandboxes): the caller falls
back to that table.
"""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
TCP_LISTEN = 10

_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid (48 bytes, zero).
_REQUEST = struct.Struct("=BBBBI48x")
# In inet_diag_msg: the source port (network order) follows family/state/timer/retrans; the
# inode follows the sockid (48 bytes) and expires/rqueue/wqueue/uid.
_SPORT_AT = 4
_INODE_AT = 4 + 48 + 16
_MSG_MIN = _INODE_AT + 4
_RECV_BYTES = 1 << 16
# A dump answers in a few datagrams; a kernel that never says DONE must not hold us forever.
_MAX_DATAGRAMS = 4096
_TIMEOUT_S = 2.0


def tcp_listeners() -> dict[int, set[int]] | None:
    """Listening TCP sockets (IPv4 and IPv6) as port -> socket inodes; None when the kernel
    interface is unavailable."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
            sock.settimeout(_TIMEOUT_S)
            found: dict[int, set[int]] = {}
            for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
                _dump(sock, family, seq, found)
            return found
    except (OSError, ValueError):
        return None


def _dump(sock: socket.socket, family: int, seq: int, found: dict[int, set[int]]) -> None:
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
    header = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0
    )
    sock.send(header + body)
    for _ in range(_MAX_DATAGRAMS):
        data = sock.recv(_RECV_BYTES)
        offset = 0
        while offset + _NLMSG_HEADER.size <= len(data):
            length, kind, _flags, _seq, _pid = _NLMSG_HEADER.unpack_from(data, offset)
            if length < _NLMSG_HEADER.size:
                raise ValueError("malformed netlink message")
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                raise OSError("sock_diag refused the dump")
            at = offset + _NLMSG_HEADER.size
            if length - _NLMSG_HEADER.size >= _MSG_MIN:
                (port,) = struct.unpack_from("!H", data, at + _SPORT_AT)
                (inode,) = struct.unpack_from("=I", data, at + _INODE_AT)
                found.setdefault(port, set()).add(inode)
            offset += (length + 3) & ~3
        if not data:
            break
    raise ValueError("sock_diag dump did not end")
