"""GET /health and GET /instances answered by the connection itself (serving.py passes
api/hotpaths.InstantAnswers to platform/uvicorn_adapter's ConnectionGuard): the same answer the
edge layers give, and every request those layers would not pass untouched still goes to them.

Raw HTTP/1.1 over real sockets to a real host process, so that the answers are the bytes the
server writes (an ASGI client would never reach the connection's code).
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import pytest

from tests.fixtures.hostproc import HostProc

BOUND_S = 20.0


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProc]:
    with HostProc(tmp_path_factory.mktemp("instant")) as h:
        h.start()
        with h.client() as c:
            model = h.tmp / "models" / "m.gguf"
            model.parent.mkdir(parents=True, exist_ok=True)
            model.write_bytes(b"GGUF")
            cfg = {"backend_type": "llamacpp", "alias": "a", "model": str(model), "ctx_size": 512}
            c.post("/instances", json={"config": cfg}).raise_for_status()
        yield h


def exchange(port: int, data: bytes, answers: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data` on one connection and read `answers` answers (status, headers, body)."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    buf = b""
    deadline = time.monotonic() + BOUND_S
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as s:
        s.sendall(data)
        while len(out) < answers and time.monotonic() < deadline:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                lines = buf[:end].decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    assert name.lower() not in headers, f"{name} twice: {lines}"
                    headers[name.lower()] = value.strip()
                length = int(headers["content-length"])
                if len(buf) >= end + 4 + length:
                    out.append((int(lines[0].split()[1]), headers, buf[end + 4 : end + 4 + length]))
                    buf = buf[end + 4 + length :]
                    continue
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    assert len(out) == answers, f"{len(out)} of {answers} answers; left {buf[:300]!r}"
    return out


def get(path: str, *headers: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers)).encode()


def test_health_carries_what_the_edge_gives_it(host: HostProc) -> None:
    [(status, headers, body)] = exchange(
        host.port, get("/health", "X-Request-ID: ctl-7") + b"\r\n", 1
    )
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert headers["x-request-id"] == "ctl-7"
    assert {"date", "server"} <= headers.keys()
    assert json.loads(body)["status"] == "healthy"
    # An unusable id is replaced by a new one, as RequestIdMiddleware does.
    [(_, headers, _)] = exchange(host.port, get("/health", "X-Request-ID: a b") + b"\r\n", 1)
    assert re.fullmatch(r"[0-9a-f]{16}", headers["x-request-id"])


def test_instances_needs_the_key_and_is_the_routers_list(host: HostProc) -> None:
    key = host.api_key
    answers = exchange(
        host.port,
        get("/instances", f"X-API-Key: {key}")
        + b"\r\n"
        + get("/instances", f"Authorization: Bearer {key}")
        + b"\r\n"
        # A query string is the router's (FastAPI's own GET /instances).
        + get("/instances?x=1", f"X-API-Key: {key}")
        + b"\r\n",
        3,
    )
    assert [a[0] for a in answers] == [200, 200, 200]
    assert answers[0][2] == answers[1][2]
    assert json.loads(answers[0][2]) == json.loads(answers[2][2])
    assert [i["config"]["alias"] for i in json.loads(answers[0][2])] == ["a"]


def test_a_wrong_or_missing_key_is_refused_as_before(host: HostProc) -> None:
    answers = exchange(
        host.port,
        get("/instances", "X-API-Key: wrong")
        + b"\r\n"
        + get("/instances")
        + b"\r\n"
        + get("/instances", "Authorization: Basic eDp5")
        + b"\r\n"
        # The first X-API-Key decides, as in APIKeyMiddleware, whatever follows it.
        + get("/instances", "X-API-Key: wrong", f"X-API-Key: {host.api_key}")
        + b"\r\n",
        4,
    )
    assert [a[0] for a in answers] == [401, 401, 401, 401]
    assert all(a[1]["www-authenticate"] == "APIKey" for a in answers)
    assert all(re.fullmatch(r"[0-9a-f]{16}", a[1]["x-request-id"]) for a in answers)


def test_what_the_connection_does_not_answer_reaches_the_edge(host: HostProc) -> None:
    """A body, a request pipelined behind one the router answers, HTTP/1.0: each answered by
    the edge layers, in order with the answers around it on the same connection."""
    key = host.api_key
    answers = exchange(
        host.port,
        get("/health", "Content-Length: 2")
        + b"\r\n{}"
        + get("/resources", f"X-API-Key: {key}")  # the router's, pipelined ahead of /health
        + b"\r\n"
        + get("/health")
        + b"\r\n"
        + get("/health", "Content-Length: 99999999")
        + b"\r\n",
        4,
    )
    assert [a[0] for a in answers] == [200, 200, 200, 413]
    assert "reservations" in json.loads(answers[1][2])
    assert json.loads(answers[2][2])["status"] == "healthy"
    [(status, headers, _)] = exchange(host.port, b"GET /health HTTP/1.0\r\n\r\n", 1)
    assert status == 200 and headers["connection"] == "close"


def test_connection_close_is_honoured(host: HostProc) -> None:
    data = get("/health", "Connection: close") + b"\r\n" + get("/health") + b"\r\n"
    [(status, headers, _)] = exchange(host.port, data, 1)
    assert status == 200 and headers["connection"] == "close"
