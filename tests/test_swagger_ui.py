"""The Swagger UI at /docs works in a real browser, offline: Authorize with the key, then
"Try it out" / "Execute" on GET /instances shows 200 and the list.

Headless Debian `chromium` (.ci/apt-packages.txt) driven over the DevTools protocol with the
`websockets` package. Every name but 127.0.0.1 resolves to nothing in the browser, and every
request it makes is recorded, so a CDN asset would fail the test twice over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError("chromium is not installed (apt-get install chromium; .ci/apt-packages)")


class DevTools:
    """A minimal DevTools-protocol session on one page: commands and recorded events."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            fut = self.pending.pop(msg.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif "method" in msg:
                self.events.append(msg)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        await self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, 30)
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def js(self, expression: str) -> Any:
        """Evaluate `expression` (awaiting a promise) in the page; return its JSON value."""
        result = await self.send(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise AssertionError(f"page script failed: {text}")
        return result["result"].get("value")

    async def wait_for(self, selector: str, timeout_ms: int = 15000) -> None:
        """Wait until `selector` matches a visible element (Swagger UI renders with React)."""
        await self.js(
            f"""new Promise((resolve, reject) => {{
                const t0 = Date.now();
                const tick = () => {{
                    const el = document.querySelector({json.dumps(selector)});
                    if (el && el.offsetParent !== null) return resolve(true);
                    if (Date.now() - t0 > {timeout_ms}) {{
                        const err = document.querySelector('.errors-wrapper, .info .title');
                        return reject(new Error('no ' + {json.dumps(selector)} + ' after '
                            + {timeout_ms} + ' ms; page says: '
                            + (err ? err.innerText : document.body.innerText.slice(0, 400))));
                    }}
                    setTimeout(tick, 50);
                }};
                tick();
            }})"""
        )

    async def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the centre of the element."""
        await self.wait_for(selector)
        box = await self.js(
            f"""(() => {{
                const el = document.querySelector({json.dumps(selector)});
                el.scrollIntoView({{block: 'center'}});
                const r = el.getBoundingClientRect();
                return {{x: r.left + r.width / 2, y: r.top + r.height / 2}};
            }})()"""
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self.send(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box["x"],
                y=box["y"],
                button="left",
                clickCount=1,
            )

    async def type_into(self, selector: str, text: str) -> None:
        await self.click(selector)
        await self.send("Input.insertText", text=text)


@contextlib.asynccontextmanager
async def browser(tmp_path: Path) -> AsyncIterator[DevTools]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    proc = await asyncio.create_subprocess_exec(
        *[
            chromium_binary(),
            "--headless=new",
            "--no-sandbox",  # the tests may run as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--metrics-recording-only",
            # Offline by construction: only loopback resolves.
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1280,2000",
            "about:blank",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            if proc.returncode is not None:
                raise AssertionError(f"chromium exited with {proc.returncode}")
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("chromium did not open its DevTools port within 15 s")
        port = int(port_file.read_text().splitlines()[0])
        async with httpx.AsyncClient(timeout=10) as client:
            targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
        page = next(t for t in targets if t.get("type") == "page")
        async with websockets.connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            tools = DevTools(ws)
            try:
                yield tools
            finally:
                tools.reader.cancel()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 5)


async def test_swagger_ui_authorize_and_execute_list_instances(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    settings = host_settings(tmp_path)
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        created = await h.client.post(
            "/instances",
            json={"config": {"backend_type": "llamacpp", "alias": "ui:test", "model": str(model)}},
        )
        assert created.status_code == 200, created.text
        instance_id = created.json()["instance"]["id"]

        async with browser(tmp_path) as page:
            await page.send("Network.enable")
            await page.send("Page.enable")
            await page.send("Page.navigate", url=f"{h.url}/docs")
            op = "#operations-instances-list_instances_instances_get"
            await page.wait_for(op)
            title = await page.js("document.querySelector('.info .title').innerText")
            assert "solar-host" in title

            # Authorize: the dialog, the key, its own Authorize button, Close.
            await page.click("button.btn.authorize")
            await page.type_into(".modal-ux .auth-container input", API_KEY)
            await page.click(".modal-ux .auth-btn-wrapper button.authorize")
            await page.wait_for(".modal-ux .auth-container h6")
            shown = await page.js("document.querySelector('.modal-ux .auth-container').innerText")
            assert "Authorized" in shown and API_KEY not in shown  # the key is masked
            await page.click(".modal-ux .auth-btn-wrapper button.btn-done")
            await page.wait_for(
                f'{op} .authorization__btn[aria-label="authorization button locked"]'
            )

            # GET /instances: expand, Try it out, Execute.
            await page.click(f"{op} .opblock-summary-control")
            await page.click(f"{op} button.try-out__btn")
            await page.click(f"{op} button.execute")
            await page.wait_for(f"{op} .live-responses-table tbody .response-col_status")
            status = await page.js(
                f"document.querySelector('{op} .live-responses-table tbody "
                ".response-col_status').innerText.trim()"
            )
            body = await page.js(
                f"document.querySelector('{op} .live-responses-table tbody "
                ".response-col_description pre').innerText"
            )
            curl = await page.js(f"document.querySelector('{op} .curl-command').innerText")

    assert status == "200", (status, body)
    listed = json.loads(body)
    assert [i["id"] for i in listed] == [instance_id]
    assert listed[0]["config"]["alias"] == "ui:test"
    assert f"X-API-Key: {API_KEY}" in curl  # the key came from the Authorize dialog

    urls = [
        e["params"]["request"]["url"]
        for e in page.events
        if e["method"] == "Network.requestWillBeSent"
    ]
    assert any(u.endswith("/docs/static/swagger-ui-bundle.js") for u in urls), urls
    assert any(u.endswith("/openapi.json") for u in urls), urls
    outside = [u for u in urls if not u.startswith((h.url, "data:"))]
    assert not outside, f"the docs page fetched from outside the host: {outside}"
