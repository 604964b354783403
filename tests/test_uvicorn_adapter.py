"""What platform/uvicorn_adapter.py relies on of uvicorn's private API is still there, by name.

uvicorn is pinned below its next minor (pyproject.toml); raising the pin runs these first. Each
name in PRIVATE_API is a test of its own (`HttpToolsProtocol.on_header`, ...), checked on a
real instance, so a rename or a removal fails naming the class and the attribute.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import re
import subprocess
import sys
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from solar_host.platform.uvicorn_adapter import PRIVATE_API, HeadWithBody, guarded_protocol


async def _app(scope: Any, receive: Any, send: Any) -> None:
    pass


def _instances() -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    config = uvicorn.Config(_app, log_config=None, lifespan="off")
    state = ServerState()
    protocol = HttpToolsProtocol(config, state, {}, _loop=loop)
    cycle = RequestResponseCycle(
        scope={"type": "http", "method": "GET"},  # type: ignore[typeddict-item]
        transport=None,  # type: ignore[arg-type]
        flow=None,  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test"),
        access_log=False,
        default_headers=[],
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=True,
        on_response=lambda: None,
    )
    loop.close()
    return {
        "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol": protocol,
        "uvicorn.protocols.http.httptools_impl.RequestResponseCycle": cycle,
        "uvicorn.server.Server": uvicorn.Server(config),
        "uvicorn.server.ServerState": state,
    }


NAMES = [(cls, name) for cls, names in PRIVATE_API.items() for name in names]


@pytest.fixture(scope="module")
def instances() -> dict[str, Any]:
    return _instances()


@pytest.mark.parametrize(
    ("cls", "name"), NAMES, ids=[f"{c.rsplit('.', 1)[1]}.{n}" for c, n in NAMES]
)
def test_uvicorn_still_has(instances: dict[str, Any], cls: str, name: str) -> None:
    module, _, qualname = cls.rpartition(".")
    assert getattr(importlib.import_module(module), qualname) is type(instances[cls])
    assert hasattr(instances[cls], name), f"uvicorn {uvicorn.__version__}: {cls} has no {name}"


def test_a_cycle_uses_no_more_of_its_transport_than_head_with_body_gives() -> None:
    """HeadWithBody stands in for the transport in each answer's cycle."""
    used = set(re.findall(r"self\.transport\.(\w+)", inspect.getsource(RequestResponseCycle)))
    given = {n for n in dir(HeadWithBody) if not n.startswith("_")}
    assert used <= given, f"RequestResponseCycle now calls transport.{sorted(used - given)}"


def test_the_guard_adds_no_name_uvicorn_uses(instances: dict[str, Any]) -> None:
    """The guard's own state must not shadow an attribute of uvicorn's protocol."""
    guarded = guarded_protocol(5.0)
    protocol = instances["uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"]
    guard = [c for c in guarded.__mro__ if not issubclass(HttpToolsProtocol, c)]
    added = {n for c in guard for n in vars(c) if not (n.startswith("__") and n.endswith("__"))}
    ours = added - set(vars(HttpToolsProtocol))
    assert not {n for n in ours if hasattr(protocol, n)}


def test_the_server_reraises_what_capture_signals_caught() -> None:
    """notifying_server empties _captured_signals so that nothing is raised again after a
    stop: that only works while capture_signals re-raises from that list."""
    source = inspect.getsource(uvicorn.Server.capture_signals)
    assert "self._captured_signals" in source and "raise_signal" in source


def test_the_host_imports_uvicorn_without_its_command_line() -> None:
    """uvicorn_config_class leaves uvicorn.main (click, the reloaders) unimported, and gives
    uvicorn's own modules the names they import from the package."""
    code = (
        "import sys\n"
        "from solar_host.platform.uvicorn_adapter import uvicorn_config_class\n"
        "Config = uvicorn_config_class()\n"
        "import uvicorn, uvicorn.config, uvicorn.server\n"
        "from uvicorn.lifespan.on import LifespanOn\n"
        "assert Config is uvicorn.config.Config is uvicorn.Config\n"
        "assert uvicorn.Server is uvicorn.server.Server\n"
        "assert uvicorn.__version__\n"
        "print(sorted(m for m in ('uvicorn.main', 'click') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
