"""Security: authentication of every route, constant-time key checks, secrets kept out of
command lines, logs, error bodies and listings, and extra_args/extra_env guards."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.routing import APIRoute, APIWebSocketRoute
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from solar_host.api import auth
from solar_host.app import create_app
from solar_host.backends.base import LaunchContext
from solar_host.backends.registry import BackendRegistry
from solar_host.instances.schemas import parse_config
from tests.fixtures.fake_sglang import make_fake_sglang_venv
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.probes import FakeProbe
from tests.fixtures.script_backend import ScriptBackend

HF_TOKEN = "hf_SECRETtokenVALUE0123456789"
HARBOR_PASSWORD = "harborSECRETpassword0123"
PUBLIC = {"/", "/health", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}
PUBLIC_PREFIX = "/docs/static/"
BAD_KEYS: list[str | None] = [
    None,
    "",
    "wrong",
    API_KEY[:-1],
    API_KEY + "x",
    API_KEY.upper(),
    API_KEY[::-1],
    "Bearer " + API_KEY,
]


def fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def app_routes() -> tuple[set[tuple[str, str]], set[str]]:
    """(method, path) of every HTTP route and the path of every WebSocket route."""
    app = create_app(host_settings(Path("/nonexistent")))
    http, ws = set(), set()

    def walk(routes: list[Any], prefix: str = "") -> None:
        for r in routes:
            if isinstance(r, APIRoute):
                http.update((m, prefix + r.path) for m in r.methods)
            elif isinstance(r, APIWebSocketRoute):
                ws.add(prefix + r.path)
            elif hasattr(r, "original_router"):  # FastAPI >= 0.16x wraps included routers
                ctx = getattr(r, "include_context", None)
                walk(r.original_router.routes, prefix + (getattr(ctx, "prefix", "") or ""))

    walk(app.routes)
    doc = app.openapi()
    for path, ops in doc["paths"].items():
        http |= {(m.upper(), path) for m in ops if m in ("get", "post", "put", "delete", "patch")}
    return http, ws


async def test_every_private_route_refuses_missing_or_wrong_keys(tmp_path: Path) -> None:
    http, ws = app_routes()
    public = {p for _, p in http if p in PUBLIC or p.startswith(PUBLIC_PREFIX)}
    assert public <= PUBLIC | {"/docs/static/{name}"}, f"unexpected public routes: {public}"
    # The peer routes take PEER_TOKEN, never the API key (ruling 26): test_pull_peers.py.
    private = sorted((m, p) for m, p in http if p not in public and not p.startswith("/peer/"))
    assert len(private) >= 20 and ws, (private, ws)
    async with running_host(
        host_settings(tmp_path), backends=BackendRegistry([ScriptBackend()])
    ) as h:
        async with httpx.AsyncClient(base_url=h.url, timeout=30) as anon:
            for method, path in private:
                for key in BAD_KEYS:
                    headers = {} if key is None else {"X-API-Key": key}
                    r = await anon.request(method, fill(path), headers=headers, json={})
                    assert r.status_code == 401, (method, path, key, r.status_code)
                    assert r.json() == {"detail": "Invalid or missing API key"}
                # The WebSocket query parameter is not an HTTP credential.
                r = await anon.request(method, fill(path) + f"?api_key={API_KEY}")
                assert r.status_code == 401, (method, path, "query")
            # The public routes answer without a key.
            for path in ("/", "/health", "/openapi.json", "/docs"):
                assert (await anon.get(path)).status_code == 200, path
        ws_url = h.url.replace("http://", "ws://")
        for path in sorted(ws):
            for key in BAD_KEYS:
                headers = {} if key is None else {"X-API-Key": key}
                async with ws_connect(ws_url + fill(path), additional_headers=headers) as sock:
                    with pytest.raises(ConnectionClosed) as closed:
                        await asyncio.wait_for(sock.recv(), 10)
                    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
                    assert "API key" in closed.value.rcvd.reason
            # The right key (header or query) is let through to the route (unknown instance).
            for url, headers in (
                (ws_url + fill(path), {"X-API-Key": API_KEY}),
                (ws_url + fill(path) + f"?api_key={API_KEY}", {}),
            ):
                async with ws_connect(url, additional_headers=headers) as sock:
                    assert "not found" in await asyncio.wait_for(sock.recv(), 10)


async def test_keys_are_compared_in_constant_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every check goes through hmac.compare_digest (time independent of where keys differ)."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    async with running_host(
        host_settings(tmp_path), backends=BackendRegistry([ScriptBackend()])
    ) as h:
        async with httpx.AsyncClient(base_url=h.url) as anon:
            for key in ("a", API_KEY[:5] + "x" * (len(API_KEY) - 5), API_KEY):
                await anon.get("/instances", headers={"X-API-Key": key})
    assert len(calls) == 3 and calls[-1][0] == calls[-1][1] == API_KEY.encode()
    # A missing key is refused without a comparison; the source has no `==` on keys.
    source = Path(auth.__file__).read_text()  # noqa: ASYNC240
    assert not re.search(r"given\s*[!=]=|[!=]=\s*expected", source)


def launch_ctx(tmp_path: Path, **kw: Any) -> LaunchContext:
    base: dict[str, Any] = dict(
        instance_id="inst-1",
        port=8080,
        host_api_key=API_KEY,
        models_dir=tmp_path / "models",
        llama_server_bin="llama-server",
        sglang_venv_path=str(make_fake_sglang_venv(tmp_path)),
        gpu_type="nvidia_cuda",
        private_dir=tmp_path / "backend-keys",
    )
    base.update(kw)
    return LaunchContext(**base)


def test_no_backend_takes_a_secret_on_argv(tmp_path: Path) -> None:
    models = tmp_path / "models"
    (models / "hf").mkdir(parents=True)
    model = write_tiny_gguf(models / "m.gguf")
    registry = BackendRegistry.default()
    ctx = launch_ctx(tmp_path)
    configs = {
        "llamacpp": {"model": str(model), "api_key": "instance-own-key-1234"},
        "huggingface_causal": {"model_id": str(models / "hf"), "api_key": "instance-own-key-1234"},
        "huggingface_embedding": {"model_id": str(models / "hf")},
        "sglang": {"model_path": str(models / "hf")},
    }
    for bt, extra in configs.items():
        config = parse_config({"backend_type": bt, "alias": "a", **extra}, models_dir=models)
        spec = registry.for_type(bt).launch(config, ctx)
        argv = " ".join(spec.argv)
        assert HF_TOKEN not in argv and HARBOR_PASSWORD not in argv
        if bt == "sglang":
            # SGLang reads its key from no variable: a private file named by --config.
            assert API_KEY not in argv and "--api-key" not in spec.argv
            key_file = spec.argv[spec.argv.index("--config") + 1]
            assert API_KEY in spec.private_files[key_file]
        else:
            assert API_KEY not in argv, bt
            assert "instance-own-key-1234" not in argv, bt
            assert any(API_KEY in v for v in spec.env.values()), bt  # the key goes by env


SECRET_SETTINGS = dict(
    hf_token=HF_TOKEN,
    harbor_url="http://127.0.0.1:9",
    harbor_username="robot",
    harbor_password=HARBOR_PASSWORD,
    hf_endpoint="http://127.0.0.1:9",
)


def assert_no_secret(text: str, where: str, *, host_key_ok: bool = False) -> None:
    assert HF_TOKEN not in text, where
    assert HARBOR_PASSWORD not in text, where
    if not host_key_ok:
        assert API_KEY not in text, where


async def test_secrets_stay_out_of_cmdlines_logs_bodies_and_listings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    (tmp_path / "models" / "hfdir").mkdir()
    settings = host_settings(tmp_path, llama_server_bin=llama_server_binary(), **SECRET_SETTINGS)
    settings.sglang_venv_path = str(make_fake_sglang_venv(tmp_path))
    probe = FakeProbe(gpus=[(24, 0)], gpu_type="nvidia_cuda")
    bodies: list[str] = []
    async with running_host(settings, probe=probe) as h:
        c = h.client
        llama = {
            "backend_type": "llamacpp",
            "alias": "tiny",
            "model": str(model),
            "ctx_size": 256,
            "api_key": "instance-own-key-1234",
        }
        sgl = {
            "backend_type": "sglang",
            "alias": "sg",
            "model_path": str(tmp_path / "models/hfdir"),
        }
        ids = []
        for cfg in (llama, sgl):
            r = await c.post("/instances", json={"config": cfg})
            assert r.status_code == 200, r.text
            ids.append(r.json()["instance"]["id"])
        pids = {}
        for iid in ids:
            r = await c.post(f"/instances/{iid}/start")
            assert r.status_code == 200, r.text
            pids[iid] = r.json()["instance"]["pid"]
        for iid, pid in pids.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()  # noqa: ASYNC240
            kids = psutil.Process(pid).children(recursive=True)
            cmdline += " ".join(" ".join(k.cmdline()) for k in kids)
            assert_no_secret(cmdline, f"cmdline of {iid}")
            assert "instance-own-key-1234" not in cmdline
        # Error paths that touch the secrets' owners: pulls against unreachable sources.
        for body in (
            {"source": "huggingface", "source_uri": "huggingface://org/m", "model_id": "org/m"},
            {"source": "harbor", "source_uri": "repo://m:1", "harbor_ref": "m:1"},
            {"source": "huggingface", "source_uri": "huggingface://org/m", "model_id": "o/x"},
        ):
            r = await c.post("/models/pull", json=body)
            assert 400 <= r.status_code < 600
            bodies.append(r.text)
        bodies.append((await c.post("/jobs", json={"job_id": "j", "steps": []})).text)
        bodies.append((await c.post("/instances", json={"config": {"api_key": 5}})).text)
        bodies.append((await c.get("/resources")).text)
        bodies.append((await c.get("/")).text)
        for iid in ids:
            bodies.append((await c.get(f"/instances/{iid}/logs")).text)
            bodies.append((await c.get(f"/instances/{iid}/state")).text)
        listing = (await c.get("/instances")).json()
        for inst in listing:
            # ruling 2: config.api_key may carry the host key (control's HTTP-poll path) and
            # the instance's own key; nothing else in the record may.
            rest = {k: v for k, v in inst.items() if k != "config"}
            cfg = {k: v for k, v in inst["config"].items() if k != "api_key"}
            assert_no_secret(str(rest) + str(cfg), "GET /instances")
            assert_no_secret(str(inst["config"].get("api_key")), "config.api_key", host_key_ok=True)
        for iid in ids:
            assert (await c.post(f"/instances/{iid}/stop")).status_code == 200
    for i, body in enumerate(bodies):
        assert_no_secret(body, f"response body {i}: {body[:200]}")
    host_log = "\n".join(r.getMessage() for r in caplog.records)
    assert_no_secret(host_log, "host log")
    for f in (tmp_path / "logs").glob("*.log"):
        text = f.read_text("utf-8", "replace")
        assert_no_secret(text, f"backend log {f.name}")


@pytest.mark.parametrize(
    "extra",
    [
        {"extra_args": ["--port", "1"]},
        {"extra_args": ["--port=1"]},
        {"extra_args": ["--api-key", "mine"]},
        {"extra_args": ["--api-k=mine"]},
        {"extra_args": ["--host", "0.0.0.0"]},
        {"extra_args": ["--model", "/elsewhere"]},
        {"extra_args": ["--served-model-name", "x"]},
        {"extra_env": {"LD_PRELOAD": "/tmp/evil.so"}},
        {"extra_env": {"ld_preload": "/tmp/evil.so"}},
        {"extra_env": {"PYTHONPATH": "/tmp"}},
        {"extra_env": {"PYTHONSTARTUP": "/tmp/x.py"}},
        {"extra_env": {"PYTHONUNBUFFERED": "0"}},
        {"extra_env": {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/"}},
        {"extra_env": {"BAD=NAME": "x"}},
    ],
)
async def test_extra_args_and_env_cannot_reach_managed_flags(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    async with running_host(host_settings(tmp_path), backends=BackendRegistry.default()) as h:
        cfg = {"backend_type": "sglang", "alias": "s", "model_path": "/models/x", **extra}
        r = await h.client.post("/instances", json={"config": cfg})
        assert r.status_code == 422, r.text
        assert next(iter(extra)) in r.text
        assert (await h.client.get("/instances")).json() == []


def test_llamacpp_ignores_unknown_extra_args(tmp_path: Path) -> None:
    """llama.cpp has no extra_args: an unknown key is echoed but never reaches argv or env."""
    model = write_tiny_gguf(tmp_path / "models" / "m.gguf")
    raw = {
        "backend_type": "llamacpp",
        "alias": "a",
        "model": str(model),
        "extra_args": ["--api-key", "evil", "--port", "1"],
        "extra_env": {"LD_PRELOAD": "x"},
    }
    config = parse_config(raw, models_dir=tmp_path / "models")
    spec = BackendRegistry.default().for_type("llamacpp").launch(config, launch_ctx(tmp_path))
    assert "evil" not in spec.argv and "LD_PRELOAD" not in spec.env
    assert spec.argv[spec.argv.index("--port") + 1] == "8080"
