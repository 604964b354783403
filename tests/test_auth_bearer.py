"""`Authorization: Bearer <key>` wherever `X-API-Key` is taken, and every refused request in the
host's log (address, route, why; never the key), rate-limited per address."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from solar_host.api.refusals import OTHERS, RefusalLog
from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend
from tests.test_security import PUBLIC, PUBLIC_PREFIX, app_routes, fill

AUTH_LOGGER = "solar_host.api.auth"


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == AUTH_LOGGER]


async def test_bearer_is_taken_on_every_private_route(tmp_path: Path) -> None:
    http, ws = app_routes()
    # The peer routes take PEER_TOKEN, never the API key (ruling 26): test_pull_peers.py.
    private = sorted(
        (m, p)
        for m, p in http
        if p not in PUBLIC and not p.startswith(PUBLIC_PREFIX) and not p.startswith("/peer/")
    )
    async with running_host(
        host_settings(tmp_path), backends=BackendRegistry([ScriptBackend()])
    ) as h:
        async with httpx.AsyncClient(base_url=h.url, timeout=30) as anon:
            for method, path in private:
                bearer = {"Authorization": f"Bearer {API_KEY}"}
                r = await anon.request(method, fill(path), headers=bearer, json={})
                assert r.status_code != 401, (method, path, r.status_code, r.text)
                for refused in ("Bearer wrong-key-0123456789", f"Basic {API_KEY}", "Bearer"):
                    r = await anon.request(
                        method, fill(path), headers={"Authorization": refused}, json={}
                    )
                    assert r.status_code == 401, (method, path, refused)
            # the scheme's name in any case, as RFC 9110 says
            r = await anon.get("/instances", headers={"Authorization": f"bearer {API_KEY}"})
            assert r.status_code == 200
        ws_url = h.url.replace("http://", "ws://")
        for path in sorted(ws):
            bearer = {"Authorization": f"Bearer {API_KEY}"}
            async with ws_connect(ws_url + fill(path), additional_headers=bearer) as sock:
                assert "not found" in await asyncio.wait_for(sock.recv(), 10)  # the route's own
            wrong = {"Authorization": "Bearer wrong-key-0123456789"}
            async with ws_connect(ws_url + fill(path), additional_headers=wrong) as sock:
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(sock.recv(), 10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_refused_requests_are_logged_once_per_address_and_never_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    wrong = "wrong-key-abcdef0123456789"
    async with running_host(host_settings(tmp_path)) as h:
        async with httpx.AsyncClient(base_url=h.url, timeout=30) as anon:
            r = await anon.get("/instances", headers={"X-API-Key": wrong})
            assert r.status_code == 401
            (line,) = refusal_lines(caplog)
            assert line == "refused GET /instances from 127.0.0.1: wrong API key", line
            # a client retrying in a loop: no more lines within the interval
            for _ in range(50):
                await anon.post("/instances", headers={"X-API-Key": wrong}, json={})
            assert len(refusal_lines(caplog)) == 1
            refusals = next(
                layer
                for layer in _layers(h.app)
                if isinstance(getattr(layer, "refusals", None), RefusalLog)
            ).refusals
            assert (refusals.refused, refusals.unlogged) == (51, 50)
        texts = [r.getMessage() for r in caplog.records] + [caplog.text]
        assert not any(wrong in t or API_KEY in t for t in texts)


def _layers(app: object) -> list[object]:
    """The ASGI layers in front of the app (starlette builds the stack at its first request)."""
    out = []
    layer = getattr(app, "middleware_stack", None)
    for _ in range(32):
        if layer is None:
            break
        out.append(layer)
        layer = getattr(layer, "app", None)
    return out


async def test_each_reason_and_websocket_refusals_are_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    async with running_host(host_settings(tmp_path)) as h:
        refusals = next(
            layer.refusals
            for layer in _layers(h.app)
            if isinstance(getattr(layer, "refusals", None), RefusalLog)
        )
        refusals.every_s = 0.0  # every refusal its own line here: the reasons are the subject
        async with httpx.AsyncClient(base_url=h.url, timeout=30) as anon:
            await anon.get("/instances")
            await anon.get("/resources", headers={"Authorization": f"Basic {API_KEY}"})
            await anon.delete("/instances/x%1b[31m", headers={"Authorization": "Bearer nope"})
        ws_url = h.url.replace("http://", "ws://")
        async with ws_connect(ws_url + "/instances/x/logs?api_key=nope") as sock:
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(sock.recv(), 10)
    lines = refusal_lines(caplog)
    assert lines == [
        "refused GET /instances from 127.0.0.1: no API key (X-API-Key or Authorization: Bearer)",
        "refused GET /resources from 127.0.0.1: Authorization is not 'Bearer <key>'",
        "refused DELETE /instances/x\\x1b[31m from 127.0.0.1: wrong API key",
        "refused WebSocket /instances/x/logs from 127.0.0.1: wrong API key",
    ], lines
    assert not any(API_KEY in ln or "nope" in ln for ln in lines)


def test_the_rate_limit_says_how_many_went_unlogged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=AUTH_LOGGER)
    now = [100.0]
    refusals = RefusalLog(10.0, max_addresses=2, clock=lambda: now[0])
    for _ in range(5):
        refusals.refuse("10.0.0.1", "GET /instances", "wrong API key")
    refusals.refuse("10.0.0.2", "GET /instances", "wrong API key")
    assert len(refusal_lines(caplog)) == 2
    now[0] += 10.0
    refusals.refuse("10.0.0.1", "GET /x", "wrong API key")
    assert refusal_lines(caplog)[-1] == (
        "refused GET /x from 10.0.0.1: wrong API key "
        "(4 more refused from 10.0.0.1 since its last line, not logged)"
    )
    # The table is bounded: past it, new addresses share one budget
    now[0] += 1.0
    refusals.refuse("10.0.0.3", "GET /", "wrong API key")  # 10.0.0.2's interval is over
    refusals.refuse("10.0.0.4", "GET /", "wrong API key")  # the table is full: the shared one
    refusals.refuse("10.0.0.5", "GET /", "wrong API key")  # that budget is spent
    lines = refusal_lines(caplog)
    assert lines[-2:] == [
        "refused GET / from 10.0.0.3: wrong API key",
        "refused GET / from 10.0.0.4: wrong API key",
    ], lines
    assert set(refusals._seen) == {"10.0.0.1", "10.0.0.3", OTHERS}
    # entries past their interval are dropped when the table is full, their counts said first
    now[0] += 30.0
    refusals.refuse("10.0.0.6", "GET /", "wrong API key")
    assert refusal_lines(caplog)[-2:] == [
        f"1 more refused requests not logged one by one, from {OTHERS}",
        "refused GET / from 10.0.0.6: wrong API key",
    ]
    assert (refusals.refused, refusals.unlogged) == (11, 5)
