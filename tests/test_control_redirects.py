"""The host key goes to the configured control address and nowhere else.

Real sockets on loopback: an aiohttp server at SOLAR_CONTROL_URL answers the Socket.IO
handshake with a 302 to a second, real Socket.IO server that knows the host key and would
register it and send it commands. aiohttp followed such redirects (to any origin, https to
plain http included) and the CONNECT carried the key. Also here: commands before control's
acknowledgement, and SOLAR_CONTROL_URL values refused at start-up naming the setting.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from solar_host.host import Host
from solar_host.metrics.service import HostMetrics
from solar_host.settings import SettingsError, load_settings
from tests.fixtures.control_server import ControlServer, free_port
from tests.fixtures.registry import make_cert
from tests.test_control_link import KEY, make_host, started_link, wait_for
from tests.test_operator_walkthrough import run_cli


class Target:
    """A control the redirect points at: it knows the host key, so a host that reached it
    would be registered, and counts Engine.IO connections, not only Socket.IO CONNECTs."""

    def __init__(self) -> None:
        self.server = ControlServer(known_keys={KEY: "stolen-host"})
        self.engine_connects = 0

    async def start(self) -> None:
        await self.server.start()
        assert self.server.sio is not None
        handlers = self.server.sio.eio.handlers
        plain = handlers["connect"]

        async def counted(*args: Any) -> Any:
            self.engine_connects += 1
            return await plain(*args)

        handlers["connect"] = counted


async def _redirector(target_url: str, ssl_context: ssl.SSLContext | None = None) -> Any:
    """A server that answers every request with a 302 to the same path at `target_url`."""
    hits: list[str] = []

    async def redirect(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        raise web.HTTPFound(f"{target_url}{request.rel_url}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    return runner, port, hits


def _refused(host: Host, reason: str) -> float | None:
    """solar_host_control_refused_total{reason} as GET /metrics renders it."""
    text = HostMetrics(host).render().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "solar_host_control_refused_total":
                if sample.labels.get("reason") == reason:
                    return sample.value
    return None


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    t = Target()
    await t.start()
    try:
        yield t
    finally:
        await t.server.stop()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_redirect_from_the_control_address_is_not_followed(
    tmp_path: Path, target: Target, caplog: pytest.LogCaptureFixture, scheme: str
) -> None:
    ssl_context = None
    if scheme == "https":  # https -> plain http: the key would go out in clear text
        cert, key = make_cert(tmp_path)
        ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ssl_context.load_cert_chain(cert, key)
    runner, port, hits = await _redirector(target.server.url, ssl_context)
    # insecure: the self-signed certificate is accepted, so only the redirect is under test.
    host = make_host(tmp_path, f"{scheme}://127.0.0.1:{port}", insecure=scheme == "https")
    caplog.set_level(logging.INFO, logger="solar_host.control.client")
    link = await started_link(host)
    try:
        # Several attempts, each answered 302: the link keeps failing, with its backoff.
        await wait_for(lambda: target.engine_connects or link.connect_failures >= 3, within_s=10)
        assert target.engine_connects == 0, "the redirect target was connected to"
        assert target.server.connects == [] and target.server.received == []
        assert len(hits) >= 3 and hits[0] == "/socket.io/"
        assert not link.connected and not link.registered and link.host_id is None
        assert link.metrics().get("refused_redirects", 0) >= 3
        assert _refused(host, "redirects") >= 3
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors, "no error line for the redirect"
        assert f"solar-control at {scheme}://127.0.0.1:{port} answered a redirect to" in errors[0]
        assert f"{target.server.url}/socket.io/: not followed" in errors[0]
        assert "set SOLAR_CONTROL_URL to the final address" in errors[0]
    finally:
        await link.stop()
        await runner.cleanup()
    assert target.engine_connects == 0 and target.server.connects == []


async def test_the_link_to_the_final_address_still_works(tmp_path: Path, target: Target) -> None:
    """The HTTP session the link now brings works for a control that does not redirect, and
    is closed with the link."""
    host = make_host(tmp_path, target.server.url)
    link = await started_link(host)
    try:
        await wait_for(lambda: link.registered, within_s=10)
        session = link._session
        assert session is not None and session.http is not None and not session.http.closed
        assert target.engine_connects == 1
    finally:
        await link.stop()
    assert session.http.closed


# --- commands before registration_ack -----------------------------------------------------------


async def test_commands_before_the_ack_are_answered_and_not_run(tmp_path: Path) -> None:
    """A control that keeps the host pending (or never acknowledges it) cannot drive it; once
    it acknowledges the host, commands run."""
    async with ControlServer() as server:  # the key is unknown: pending
        host = make_host(tmp_path, server.url)
        link = await started_link(host)
        try:
            pending_id = await server.wait_until(
                lambda: server.pending_ids() and server.pending_ids()[0]
            )
            await wait_for(lambda: link.pending_id == pending_id)
            body = {
                "config": {"backend_type": "llamacpp", "alias": "planted:1b", "model": "/m.gguf"}
            }
            answer = await server.call("create_instance", body)
            assert answer["ok"] is False and answer["error"]["code"] == "not_registered", answer
            assert host.instances.list() == []
            assert link.metrics()["commands_refused"]["not_registered"] == 1
            assert _refused(host, "command_not_registered") == 1

            await server.approve(pending_id)
            await wait_for(lambda: link.registered)
            answer = await server.call("create_instance", body)
            assert answer["ok"] is True, answer
            assert [i.config.alias for i in host.instances.list()] == ["planted:1b"]
        finally:
            await link.stop()


# --- SOLAR_CONTROL_URL --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://127.0.0.1:9", "unsupported scheme 'ftp'"),
        ("http://", "no host"),
        ("http://:8000", "no host"),
        ("127.0.0.1:99999", "not a number from 1 to 65535"),
        ("http://control:abc", "not a number from 1 to 65535"),
        ("http://ok:8000,https://c:0", "not a number from 1 to 65535"),
    ],
)
def test_a_malformed_control_url_is_refused_naming_the_setting(url: str, problem: str) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(None, {"SOLAR_CONTROL_URL": url})
    message = str(err.value)
    assert message.startswith("Invalid setting SOLAR_CONTROL_URL: ") and problem in message
    assert "\n" not in message


def test_the_host_refuses_a_malformed_control_url_in_one_line(tmp_path: Path) -> None:
    """Was a 36-line traceback and exit 1 (ftp://), or a link failing for ever (port 99999)."""
    p = run_cli("serve", "--env-file", os.devnull, cwd=tmp_path, SOLAR_CONTROL_URL="ftp://c:9")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "solar-host: Invalid setting SOLAR_CONTROL_URL: Value error, unsupported scheme 'ftp' "
        "in 'ftp://c:9' (use http, https, ws or wss)"
    ]
    assert not (tmp_path / "config.json").exists()


def test_a_password_in_a_refused_control_url_is_not_quoted() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(None, {"SOLAR_CONTROL_URL": "ftp://robot:s3cret-pw@control:21"})
    assert "s3cret-pw" not in str(err.value) and "ftp://***@control:21" in str(err.value)


@pytest.mark.parametrize(
    ("url", "urls"),
    [
        ("http://127.0.0.1:8000", ["http://127.0.0.1:8000"]),
        ("https://control.example", ["https://control.example"]),
        ("ws://127.0.0.1:8000/ws/host-channel", ["http://127.0.0.1:8000"]),
        ("wss://control.example:443/x", ["https://control.example:443"]),
        ("control:8000, http://[::1]:8001", ["http://control:8000", "http://[::1]:8001"]),
        ("", []),
    ],
)
def test_an_accepted_control_url_still_works(tmp_path: Path, url: str, urls: list[str]) -> None:
    from solar_host.control.client import ControlLink

    settings = load_settings(None, {"SOLAR_CONTROL_URL": url})
    assert settings.solar_control_url == url.strip()
    if urls:
        link = ControlLink(make_host(tmp_path, url))
        assert link.urls == urls
