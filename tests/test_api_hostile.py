"""A hostile client of the REST API, against a real host process.

Each test runs against `solar-host serve`'s own path (tests/fixtures/hostproc.py: a host
subprocess on a loopback port with the scripted backend) and fails on the code before the fix.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.fixtures.hostproc import HostProc
from tests.fixtures.waiting import closed_within

# The host's HTTP_HEADER_TIMEOUT_S here, and how long the test waits for it to close a
# connection that never finishes its request headers.
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3  # HTTP_BODY_TIMEOUT_S
HEADER_BOUND_S = 30.0


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProc]:
    tmp = tmp_path_factory.mktemp("review_api")
    (tmp / "models").mkdir()
    (tmp / "models" / "m.gguf").write_bytes(b"not a real gguf")
    env = {
        "LOG_LEVEL": "INFO",
        "HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
    }
    with HostProc(tmp, env=env) as h:
        h.start()
        yield h


def fresh(host: HostProc) -> httpx.Client:
    """A client that never reuses a connection (a 500 may leave one half-closed)."""
    return httpx.Client(
        base_url=host.url,
        headers={"X-API-Key": host.api_key, "content-type": "application/json"},
        timeout=30,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


def config(**extra: Any) -> dict[str, Any]:
    return {"backend_type": "llamacpp", "model": "m.gguf", "alias": "review", **extra}


# --- 1. connections that never finish their headers ---------------------------------------------


def test_connections_that_never_send_headers_are_closed(host: HostProc) -> None:
    """Anyone who can connect (no key needed) held a descriptor for ever by sending nothing,
    or half a request line: enough of them and the host can accept nothing more."""
    silent = socket.create_connection(("127.0.0.1", host.port), timeout=5)
    half = socket.create_connection(("127.0.0.1", host.port), timeout=5)
    try:
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        deadline = time.monotonic() + HEADER_BOUND_S
        assert closed_within(silent, deadline), "a silent connection was kept open"
        assert closed_within(half, deadline), "a half-sent request was kept open"
        with fresh(host) as c:
            assert c.get("/health").status_code == 200
    finally:
        silent.close()
        half.close()


# --- 2. lone surrogates: 500s and a poisoned config.json ---------------------------------------

SURROGATE = "@lone-surrogate@"


def with_surrogate(doc: Any) -> str:
    """`doc` as JSON text, each SURROGATE string replaced by "\\ud800": a lone UTF-16
    surrogate, which JSON allows and json.loads turns into a str that UTF-8 cannot encode."""
    return json.dumps(doc).replace(f'"{SURROGATE}"', '"\\ud800"')


SURROGATE_BODIES = [
    ("POST", "/instances", with_surrogate({"config": SURROGATE}), "config"),
    ("POST", "/instances", with_surrogate({"config": config(), "priority": SURROGATE}), "priority"),
    (
        "POST",
        "/instances",
        with_surrogate({"config": config(), "intent_id": SURROGATE}),
        "intent_id",
    ),
    (
        "POST",
        "/instances/estimate",
        with_surrogate({"config": config(tensor_split=SURROGATE)}),
        "tensor_split",
    ),
    ("POST", "/resources/reservations", with_surrogate({"job_id": SURROGATE}), "job_id"),
    (
        "POST",
        "/models/pull",
        with_surrogate({"source": "huggingface", "source_uri": SURROGATE}),
        "source_uri",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), SURROGATE_BODIES)
def test_lone_surrogates_are_a_4xx_naming_the_field(
    host: HostProc, method: str, path: str, body: str, field: str
) -> None:
    """FastAPI's 422 echoes the bad input; a lone surrogate cannot be encoded and the answer
    became a 500 (and the pull and estimate routes failed the same way on their own)."""
    with fresh(host) as c:
        r = c.request(method, path, content=body.encode())
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert field in r.text


@pytest.fixture
def own_host(tmp_path: Path) -> Iterator[HostProc]:
    """A host of its own: on the code before the fix, the test leaves it unable to save."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"not a real gguf")
    with HostProc(tmp_path) as h:
        h.start()
        yield h


@pytest.mark.parametrize(
    "field", ["extra_args", "api_key", "extra_env", "chat_template", "model_source", "host"]
)
def test_a_lone_surrogate_in_a_config_cannot_poison_the_store(
    own_host: HostProc, field: str
) -> None:
    """The config was accepted, the instance kept in memory, and config.json could not be
    written any more: that create and every later create, update, start and delete of any
    instance answered 500 (and nothing was persisted) until the bad instance was deleted."""
    value = {"extra_args": [SURROGATE], "extra_env": {"A": SURROGATE}}.get(field, SURROGATE)
    body = with_surrogate({"config": config(**{field: value})})
    host = own_host
    with fresh(host) as c:
        r = c.post("/instances", content=body.encode())
        # Whatever this answered, every later write must still work:
        ok = c.post("/instances", json={"config": config(alias=f"after-{field}")})
        assert ok.status_code == 200, (ok.status_code, ok.text[:300])
        new_id = ok.json()["instance"]["id"]
        stored = json.loads((host.tmp / "config.json").read_text())
        assert new_id in {e["instance"]["id"] for e in stored["instances"]}
        assert c.delete(f"/instances/{new_id}").status_code == 200
        # ... and the bad config was a 422 naming the field, kept nowhere.
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert field in json.dumps(r.json()["detail"])
        assert len(c.get("/instances").json()) == 0


NAN_BODIES = [
    ("/instances", json.dumps({"config": config(alias="nan", foo=1)}).replace(
        '"foo": 1', '"foo": NaN'), 422, "foo"),
    ("/models/pull", '{"source": "huggingface", "source_uri": "a/b", "metadata": {"x": NaN}}',
     422, "metadata.x"),
    ("/jobs", '{"name": "j", "image": "busybox", "training_config": {"x": Infinity}}',
     400, "training_config.x"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "field"), NAN_BODIES)
def test_nan_and_infinity_are_refused_wherever_they_would_be_kept(
    host: HostProc, path: str, body: str, status: int, field: str
) -> None:
    """Python's json reads NaN and Infinity; strict JSON cannot hold them. Kept in a free-form
    field they became null in config.json (an unknown config key: "kept unchanged" it was not)
    or a literal NaN in a pull's manifest.json, which is then not JSON at all."""
    with fresh(host) as c:
        r = c.post(path, content=body.encode())
        assert r.status_code == status, (r.status_code, r.text[:300])
        assert field in r.text and "finite" in r.text
        assert c.get("/instances").json() == []
        # Nothing was pulled (files placed by hand, the fixture's GGUF, are listed as local).
        assert [m for m in c.get("/models").json() if m["source"] != "local"] == []


# --- 3. forged lines in the host's log ---------------------------------------------------------


def test_config_field_names_cannot_forge_host_log_lines(host: HostProc) -> None:
    """An unknown config key is logged as given: a newline in it started a line of the
    caller's choosing in the host's log, and escape sequences reached the operator's terminal."""
    forged = "2099-01-01T00:00:00.000Z ERROR   solar_host: FORGED-BY-REVIEW"
    key = f"x\n{forged} \x1b[31mred\x1b[0m"
    with fresh(host) as c:
        r = c.post("/instances", json={"config": {**config(alias="forge"), key: 1}})
        assert r.status_code == 200, r.text[:300]
        c.delete(f"/instances/{r.json()['instance']['id']}")
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = host.log_path.read_text("utf-8", "replace")
        if "FORGED-BY-REVIEW" in text:
            break
        time.sleep(0.1)
    assert "FORGED-BY-REVIEW" in text, "the warning was not logged at all"
    assert not any(line.startswith(forged) for line in text.splitlines()), "a forged line"
    assert "\x1b" not in text, "a raw escape sequence in the host log"


# --- 4. logs of an id that is not there ---------------------------------------------------------


def test_logs_of_an_unknown_id_are_not_another_instances(host: HostProc) -> None:
    """GET /instances/{id}/logs of an unknown id fell back to `*_{id}_*.log`, which matches
    the file of another instance whose alias holds `_{id}_`: its log was answered as this id's."""
    with fresh(host) as c:
        r = c.post("/instances", json={"config": config(alias="team_b_chat")})
        assert r.status_code == 200, r.text[:300]
        iid = r.json()["instance"]["id"]
        try:
            assert c.post(f"/instances/{iid}/start").status_code == 200
            assert c.post(f"/instances/{iid}/stop").status_code == 200
            assert c.get(f"/instances/{iid}/logs").json(), "the instance logged nothing"
            for other in ("b", "chat"):
                r = c.get(f"/instances/{other}/logs")
                assert r.status_code == 404, (other, r.status_code, r.text[:200])
        finally:
            c.delete(f"/instances/{iid}")


# --- 5. a bad WebSocket query parameter ---------------------------------------------------------


def test_ws_bad_since_seq_is_refused_with_a_reason_naming_it(host: HostProc) -> None:
    """`since_seq=abc` refused the handshake with a bare HTTP 403: the same thing a client
    sees for a refused key, and nothing says which parameter was wrong."""

    async def go() -> Any:
        url = host.url.replace("http://", "ws://") + "/instances/x/logs?since_seq=abc"
        try:
            async with ws_connect(url, additional_headers={"X-API-Key": host.api_key}) as sock:
                await asyncio.wait_for(sock.recv(), 10)
        except ConnectionClosed as closed:
            return closed.rcvd
        except InvalidStatus as refused:
            return refused.response.status_code
        return None

    rcvd = asyncio.run(go())
    assert rcvd is not None and not isinstance(rcvd, int), f"handshake refused: {rcvd}"
    assert rcvd.code == 1008 and "since_seq" in rcvd.reason, rcvd


# --- 6. a second review: JSON no file can keep, NaN in an echo, racing deletes -----------------


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_json_nested_too_deep_to_store_is_a_4xx_and_keeps_the_host_writable(
    own_host: HostProc,
) -> None:
    """A config value nested 300 deep parsed (the parser takes about 990) but could not be
    encoded (pydantic stops at about 255): a 500 with the record kept in memory, and from then
    on every list, create and delete answered 500 and config.json was never written again.
    Now anything past 64 levels is refused, naming the field, wherever a request's JSON is
    kept (an instance's config, a pull's metadata, a job's training_config)."""
    host = own_host
    with fresh(host) as c:
        r = c.post("/instances", json={"config": {**config(alias="deep"), "x": deep(300)}})
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert "x" in json.dumps(r.json()["detail"]) and "deeper than 64" in r.text
        assert c.get("/instances").json() == []
        ok = c.post("/instances", json={"config": config(alias="shallow", x=deep(10))})
        assert ok.status_code == 200, ok.text[:300]
        iid = ok.json()["instance"]["id"]
        r = c.put(f"/instances/{iid}", json={"config": {**config(alias="deep"), "x": deep(300)}})
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert c.get(f"/instances/{iid}").json()["config"]["alias"] == "shallow"
        pull = {
            "source": "huggingface",
            "source_uri": "huggingface://acme/tiny",
            "model_id": "acme/tiny",
            "metadata": {"m": deep(300)},
        }
        r = c.post("/models/pull", json=pull)
        assert r.status_code == 422 and "metadata.m" in r.text, (r.status_code, r.text[:300])
        assert c.delete(f"/instances/{iid}").status_code == 200
        assert c.get("/instances").json() == []
    stored = json.loads((host.tmp / "config.json").read_text())
    assert stored["instances"] == []


NON_FINITE = [
    ("POST", "/resources/reservations", '{"job_id":"j","vram_gb":0,"ram_gb":NaN}', "ram_gb"),
    ("POST", "/resources/reservations", '{"job_id":"j","vram_gb":1e400,"ram_gb":0}', "vram_gb"),
    (
        "POST",
        "/resources/reservations",
        '{"job_id":"j","vram_gb":0,"ram_gb":0,"ttl_seconds":-Infinity}',
        "ttl_seconds",
    ),
    ("POST", "/instances", '{"config":NaN}', "config"),
    ("POST", "/instances/estimate", '{"config":Infinity}', "config"),
    ("PUT", "/instances/x", '{"intent_id":NaN}', "intent_id"),
    (
        "POST",
        "/resources/reservations",
        '{"job_id":"j","vram_gb":0,"ram_gb":0,"expires_at":"9999-12-31T23:59:59-05:00"}',
        "expires_at",
    ),
    (
        "POST",
        "/resources/reservations",
        '{"job_id":"j","vram_gb":0,"ram_gb":0,"expires_at":"0001-01-01T00:00:00+05:00"}',
        "expires_at",
    ),
    (
        "POST",
        "/resources/reservations",
        '{"job_id":"j","vram_gb":0,"ram_gb":0,"expires_at":"9999-12-31T23:59:59Z"}',
        "expires_at",
    ),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), NON_FINITE)
def test_nan_infinity_and_dates_out_of_range_are_a_422_naming_the_field(
    host: HostProc, method: str, path: str, body: str, field: str
) -> None:
    """The 422 echoes the bad input, and strict JSON has no NaN or Infinity: the answer was a
    500. A date the UTC conversion overflows was a 500 too, and year 9999 in UTC was accepted,
    past the ten years a reservation may last."""
    with fresh(host) as c:
        r = c.request(method, path, content=body.encode())
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert field in r.text
        assert c.get("/resources").json()["reservations"] == []


def test_an_update_or_delete_queued_behind_a_delete_is_a_404(host: HostProc) -> None:
    """A stop holds the instance while its backend ignores SIGTERM; a DELETE and a PUT queue
    behind it. Both answered 200, the PUT "updating" an instance the DELETE had removed (and
    announcing it to control); two DELETEs both answered 200."""

    async def go(second: str) -> tuple[int, int, int]:
        async with httpx.AsyncClient(
            base_url=host.url, headers={"X-API-Key": host.api_key}, timeout=60
        ) as c:
            cfg = config(alias="race", fake_args=["--ignore-sigterm"])
            iid = (await c.post("/instances", json={"config": cfg})).json()["instance"]["id"]
            assert (await c.post(f"/instances/{iid}/start")).status_code == 200

            async def later(method: str, **kw: Any) -> httpx.Response:
                await asyncio.sleep(0.2)  # the stop holds the instance by then
                return await c.request(method, f"/instances/{iid}", **kw)

            again = (
                later("PUT", json={"config": {**cfg, "alias": "after"}})
                if second == "PUT"
                else later("DELETE")
            )
            _stop, deleted, other = await asyncio.gather(
                c.post(f"/instances/{iid}/stop"), later("DELETE"), again
            )
            after = await c.get(f"/instances/{iid}")
            return deleted.status_code, other.status_code, after.status_code

    for second in ("PUT", "DELETE"):
        assert asyncio.run(go(second)) == (200, 404, 404), second


def test_a_body_of_millions_of_tiny_values_is_refused_before_it_is_parsed(
    host: HostProc,
) -> None:
    """8 MiB (the byte limit) of `{},` is 2.8 million objects: parsed whole, it took 220 MB
    and held the event loop 1.3 s per request (5 s for POST /instances, whose 422 echoed it
    all back). Such a body is now a 413 counted as it arrives; a body of a realistic size,
    commas in its text included, is still taken."""
    rss = psutil.Process(host.pid).memory_info().rss
    n = (8 * 1024 * 1024 - 100) // 3
    body = b'{"config":[' + b"{}," * (n - 1) + b"{}]}"
    with fresh(host) as c:
        for path in ("/instances", "/jobs", "/models/pull"):
            r = c.post(path, content=body)
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            assert "JSON values" in r.json()["detail"], r.text
        assert psutil.Process(host.pid).memory_info().rss - rss < 60e6
        prompt = "a, b, c, " * 4000  # 12,000 commas in a text field
        r = c.post("/instances", json={"config": config(chat_template=prompt)})
        assert r.status_code == 200, r.text
        assert c.delete(f"/instances/{r.json()['instance']['id']}").status_code == 200


def test_a_body_that_stops_coming_is_answered_408(host: HostProc) -> None:
    """A body announced and never all sent held its request (and whatever its handler held)
    for as long as the client kept the connection open."""
    port = int(host.url.rsplit(":", 1)[1])
    body = json.dumps({"config": config()}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=HEADER_BOUND_S) as sock:
        t0 = time.monotonic()
        sock.sendall(
            b"POST /instances HTTP/1.1\r\nHost: x\r\nX-API-Key: "
            + host.api_key.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body[:-5]
        )
        answer = sock.recv(4096)
        took = time.monotonic() - t0
        while not answer.endswith(b"}") and (more := sock.recv(4096)):
            answer += more
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"did not arrive within 3 s" in answer, answer
    assert BODY_TIMEOUT_S - 0.5 < took < HEADER_BOUND_S, took
    with fresh(host) as c:  # nothing was created; the host takes the next request
        assert all(i["config"]["alias"] != "review" for i in c.get("/instances").json())


def test_host_is_still_healthy(host: HostProc) -> None:
    with fresh(host) as c:
        assert c.get("/health").status_code == 200
    assert host.proc is not None and host.proc.poll() is None
