"""Foundation: settings, the API key, config validation and migration, config.json durability."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.instances.schemas import ConfigError, parse_config
from solar_host.instances.store import InstanceStore
from solar_host.platform.statefiles import StateFileError
from solar_host.settings import Settings, SettingsError, load_settings
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend

ROOT = Path(__file__).resolve().parents[1]


def reg() -> BackendRegistry:
    return BackendRegistry([ScriptBackend()])


# --- settings -------------------------------------------------------------------------------------


def test_invalid_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("START_PORT", "not-a-port")
    with pytest.raises(SettingsError) as err:
        load_settings(env_file=None)
    assert "START_PORT" in str(err.value)
    assert "\n" not in str(err.value)


def test_placeholder_key_is_refused() -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(env_file=None, api_key="change-me-please")
    assert "API_KEY" in str(err.value)


def test_env_file_is_read_only_when_asked(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("START_PORT=4100\nHOST_NAME=gpu-7\n")
    s = load_settings(env_file=env)
    assert s.start_port == 4100 and s.effective_host_name == "gpu-7"
    assert load_settings(env_file=None, environ={}).start_port == 3500


def test_settings_precedence_is_overrides_then_environment_then_env_file(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text(
        "# comment\nexport START_PORT=4100\nhost_name='from file'\nMAX_RETRIES=7\n"
        "HF_CACHE_DIR=\nNOT_A_SETTING=x\n"
    )
    s = load_settings(
        env_file=env, environ={"MAX_RETRIES": "3", "Port": "9001", "PATH": "/bin"}, port=9002
    )
    # Names match in any case; the file's quotes and `export` are dotenv syntax.
    assert (s.start_port, s.host_name, s.max_retries, s.port) == (4100, "from file", 3, 9002)
    # An empty value for a setting whose default is None leaves it unset.
    assert s.hf_cache_dir is None


def test_settings_built_directly_read_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("START_PORT", "4200")
    assert Settings().start_port == 3500
    assert load_settings(env_file=None).start_port == 4200


def test_bad_value_in_env_file_names_the_variable(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("BOOT_START_CONCURRENCY=zero\n")
    with pytest.raises(SettingsError) as err:
        load_settings(env_file=env, environ={})
    assert "BOOT_START_CONCURRENCY" in str(err.value) and "\n" not in str(err.value)


def run_serve(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`solar-host serve` in tmp_path with `env` added, for runs that end on their own."""
    return subprocess.run(
        [sys.executable, "-m", "solar_host", "--env-file", os.devnull],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_cli_serve_exits_2_with_one_line_on_bad_settings(tmp_path: Path) -> None:
    p = run_serve(tmp_path, MAX_RETRIES="-3")
    assert p.returncode == 2
    assert "MAX_RETRIES" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_serve_that_cannot_start_says_why_in_one_line_and_exits_1(tmp_path: Path) -> None:
    # CONFIG_FILE's directory is a file: neither config.json nor the key can be kept there.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    p = run_serve(
        tmp_path,
        API_KEY="",
        CONFIG_FILE=str(blocker / "config.json"),
        HOST="127.0.0.1",
        PORT=str(free_port()),
    )
    assert p.returncode == 1, p.stderr
    # The first thing start-up needs there is the state directory's lock.
    assert "cannot lock" in p.stderr and "not-a-dir" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


# --- API key -------------------------------------------------------------------------------------


async def test_generated_key_is_stored_0600_and_reused(tmp_path: Path) -> None:
    s = host_settings(tmp_path, api_key="")
    async with running_host(s, backends=reg()) as h:
        key = h.host.api_key
        assert len(key) >= 32
        path = tmp_path / "api_key"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() == key
        r = await h.client.get("/instances", headers={"X-API-Key": key})
        assert r.status_code == 200
    async with running_host(s, backends=reg()) as h:
        assert h.host.api_key == key


async def test_auth_on_http_and_websocket(tmp_path: Path) -> None:
    import websockets

    async with running_host(host_settings(tmp_path), backends=reg()) as h:
        async with httpx.AsyncClient(base_url=h.url) as anon:
            assert (await anon.get("/health")).status_code == 200
            assert (await anon.get("/")).status_code == 200
            assert (await anon.get("/openapi.json")).status_code == 200
            r = await anon.get("/instances")
            assert r.status_code == 401 and r.json() == {"detail": "Invalid or missing API key"}
            r = await anon.get("/instances", headers={"X-API-Key": API_KEY + "x"})
            assert r.status_code == 401
        ws_url = h.url.replace("http", "ws") + "/instances/x/logs"
        async with websockets.connect(ws_url) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1008
        async with websockets.connect(ws_url + f"?api_key={API_KEY}") as ws:
            assert json.loads(await ws.recv()) == {"error": "Instance not found"}
        async with websockets.connect(ws_url, additional_headers={"X-API-Key": API_KEY}) as ws:
            assert json.loads(await ws.recv()) == {"error": "Instance not found"}


async def test_openapi_declares_api_key_scheme(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=reg()) as h:
        doc = (await h.client.get("/openapi.json")).json()
        assert doc["components"]["securitySchemes"]["APIKeyHeader"] == {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
        }
        assert doc["paths"]["/instances"]["get"]["security"] == [{"APIKeyHeader": []}]
        assert "security" not in doc["paths"]["/health"]["get"]


async def test_two_hosts_in_one_process_are_independent(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    async with running_host(host_settings(a, api_key="key-a-0123456789"), backends=reg()) as ha:
        async with running_host(host_settings(b, api_key="key-b-0123456789"), backends=reg()) as hb:
            model = a / "models" / "m.gguf"
            model.parent.mkdir(parents=True, exist_ok=True)
            model.write_bytes(b"x")
            r = await ha.client.post(
                "/instances", json={"config": {"alias": "a", "model": str(model)}}
            )
            assert r.status_code == 200
            assert len((await ha.client.get("/instances")).json()) == 1
            assert (await hb.client.get("/instances")).json() == []
            r = await hb.client.get("/instances", headers={"X-API-Key": "key-a-0123456789"})
            assert r.status_code == 401


# --- config validation ---------------------------------------------------------------------------


def test_config_rules(tmp_path: Path) -> None:
    md = tmp_path / "models"
    md.mkdir()
    gguf = md / "m.gguf"
    gguf.write_bytes(b"x")

    def bad(cfg: dict, field: str, text: str) -> None:
        with pytest.raises(ConfigError) as err:
            parse_config(cfg, models_dir=md)
        locs = [".".join(map(str, e["loc"])) for e in err.value.errors]
        assert any(field == loc or loc.startswith(field) for loc in locs), (locs, err.value)
        assert text in str(err.value)

    base = {"backend_type": "llamacpp", "alias": "a", "model": str(gguf)}
    bad({**base, "threads": 0}, "threads", "greater than or equal to 1")
    bad({**base, "split_mode": "diagonal"}, "split_mode", "")
    bad({**base, "tensor_split": "3,half"}, "tensor_split", "comma-separated numbers")
    bad({**base, "tensor_split": "3,-1"}, "tensor_split", "must not be negative")
    bad({**base, "chat_template_kwargs": "{nope"}, "chat_template_kwargs", "not valid JSON")
    bad({**base, "spec_type": "draft-dspark"}, "", "requires 'spec_draft_model'")
    bad({**base, "spec_draft_conf_min": 0.5}, "", "only supported with spec_type")
    bad({**base, "alias": "  "}, "alias", "blank")
    bad({"backend_type": "llamacpp", "alias": "a"}, "", "Either 'model' or 'model_source'")
    bad({"backend_type": "sglang", "alias": "a"}, "", "Either 'model_path'")
    bad({"backend_type": "huggingface_causal", "alias": "a"}, "", "Either 'model_id'")
    bad({"backend_type": "nope", "alias": "a"}, "backend_type", "Unknown backend_type")
    bad({**base, "model_source": "repo://m:1", "model": None}, "model_source", "POST /models/pull")
    bad({**base, "model": "../outside.gguf"}, "model", "outside of MODELS_DIR")
    bad({**base, "model": None, "model_source": "local://../x.gguf"}, "model_source", "'..'")
    bad(
        {"backend_type": "sglang", "alias": "a", "model_path": "/m", "extra_args": ["--por", "1"]},
        "extra_args",
        "--port",
    )

    ok = parse_config(
        {
            **base,
            "devices": " CUDA0 , CUDA1 ",
            "chat_template_kwargs": {"enable_thinking": "False"},
            "future_key": {"x": 1},
        },
        models_dir=md,
    )
    assert ok.devices == "CUDA0,CUDA1"
    assert ok.chat_template_kwargs == '{"enable_thinking":false}'
    assert ok.model_dump()["future_key"] == {"x": 1}  # unknown keys kept and echoed
    rel = parse_config(
        {"alias": "a", "model": "m.gguf", "model_source": "local://m.gguf"}, models_dir=md
    )
    assert rel.model == str(gguf.resolve()) and rel.model_source == "local://m.gguf"


def test_migration_of_configs_without_backend_type(tmp_path: Path) -> None:
    md = tmp_path
    assert (
        parse_config({"alias": "a", "model": str(md / "x.gguf")}, models_dir=md).backend_type
        == "llamacpp"
    )
    c = parse_config({"alias": "a", "model_id": "org/m", "labels": ["n", "p"]}, models_dir=md)
    assert c.backend_type == "huggingface_classification"
    c = parse_config({"alias": "a", "model_id": "org/m"}, models_dir=md)
    assert c.backend_type == "huggingface_causal" and c.model_id == "org/m"


async def test_create_answers_422_with_field_path(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=reg()) as h:
        r = await h.client.post(
            "/instances", json={"config": {"alias": "a", "model": "/m", "threads": "many"}}
        )
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "config", "threads"]
        r = await h.client.post(
            "/instances", json={"config": {"alias": "a", "model": "/m"}, "priority": "urgent"}
        )
        assert r.status_code == 422
        r = await h.client.post("/instances", json={"nope": 1})
        assert r.status_code == 422
        assert (await h.client.get("/instances")).json() == []


async def test_update_null_clears_markers_and_running_is_409(tmp_path: Path) -> None:
    async with running_host(host_settings(tmp_path), backends=reg()) as h:
        model = tmp_path / "models" / "m.gguf"  # inside MODELS_DIR (ruling 12)
        model.parent.mkdir(parents=True, exist_ok=True)
        model.write_bytes(b"x")
        r = await h.client.post(
            "/instances",
            json={
                "config": {"alias": "a", "model": str(model)},
                "managed_by": "intent",
                "intent_id": "i1",
            },
        )
        iid = r.json()["instance"]["id"]
        r = await h.client.put(
            f"/instances/{iid}", json={"config": {"alias": "b", "model": str(model)}}
        )
        inst = r.json()["instance"]
        assert inst["config"]["alias"] == "b" and inst["managed_by"] == "intent"
        r = await h.client.put(f"/instances/{iid}", json={"managed_by": None, "intent_id": None})
        inst = r.json()["instance"]
        assert inst["managed_by"] is None and inst["intent_id"] is None
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        assert (
            await h.client.put(f"/instances/{iid}", json={"managed_by": None})
        ).status_code == 409
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 409
        await h.client.post(f"/instances/{iid}/stop")
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
        assert (await h.client.get(f"/instances/{iid}")).status_code == 404


# --- config.json ---------------------------------------------------------------------------------


def test_old_config_file_loads_and_bad_entries_are_kept_aside(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "instances": [
                    {
                        "id": "old-1",
                        "config": {"alias": "x", "model": "/m.gguf", "api_key": "legacy"},
                        "status": "running",
                        "created_at": "2025-01-01T00:00:00Z",
                        "busy": True,
                    },
                    {
                        "id": "bad-1",
                        "config": {"alias": "y", "backend_type": "llamacpp"},
                        "status": "stopped",
                    },
                ]
            }
        )
    )
    store = InstanceStore(cfg, tmp_path / "models")
    result = store.load()
    assert [r.instance.id for r in result.records] == ["old-1"]
    assert result.records[0].want_running is True
    assert result.records[0].instance.config.backend_type == "llamacpp"
    [bad] = result.quarantined
    assert bad.id == "bad-1" and bad.index == 1
    assert "Either 'model'" in bad.reason
    # Saved back verbatim, at its place.
    store.save_sync(result.records, ["inference"])
    entries = json.loads(cfg.read_text())["instances"]
    assert entries[1] == {
        "id": "bad-1",
        "config": {"alias": "y", "backend_type": "llamacpp"},
        "status": "stopped",
    }


def test_corrupt_config_file_is_refused_and_kept(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text("{not json")
    with pytest.raises(StateFileError, match="not valid JSON"):
        InstanceStore(cfg, tmp_path).load()
    assert cfg.read_text() == "{not json"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_write_killed_midway_leaves_old_file_intact(tmp_path: Path) -> None:
    """A writer SIGKILLed while writing (repeatedly) never leaves a torn config.json."""
    cfg = tmp_path / "config.json"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from solar_host.instances.store import atomic_write_bytes
        big = b'{{"roles": ["inference"], "instances": [' + b','.join(
            b'{{"pad": "' + b'x' * 2000 + b'"}}' for _ in range(3000)) + b']}}'
        print("ready", flush=True)
        while True:
            atomic_write_bytes(Path({str(cfg)!r}), big)
    """)
    cfg.write_text('{"roles": ["inference"], "instances": []}')
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.readline()
        import time

        time.sleep(0.15)
        p.send_signal(signal.SIGKILL)
        p.wait()
        doc = json.loads(cfg.read_text())  # never torn
        assert doc["roles"] == ["inference"]
    InstanceStore(cfg, tmp_path).load()  # loading sweeps the temp files of killed writes
    assert not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 256 KiB tmpfs (the test host is root, as in CI)."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield small
    subprocess.run(["umount", "-l", str(small)])


async def test_disk_full_refuses_changes_cleanly_and_keeps_serving(
    tmp_path: Path, small_fs: Path
) -> None:
    """config.json on a full filesystem: create/update/delete answer 507 and change nothing,
    and so do a stop (the next boot would start the instance again) and a start (the next boot
    would forget it); reads, health and the running backend keep working."""
    small = small_fs
    s = host_settings(tmp_path, config_file=small / "config.json")
    async with running_host(s, backends=reg()) as h:
        model = tmp_path / "models" / "m.gguf"  # inside MODELS_DIR (ruling 12)
        model.parent.mkdir(parents=True, exist_ok=True)
        model.write_bytes(b"x")
        cfg = {"alias": "a", "model": str(model)}
        iid = (await h.client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
        idle_cfg = {**cfg, "alias": "idle"}
        idle = (await h.client.post("/instances", json={"config": idle_cfg})).json()
        idle_id = idle["instance"]["id"]
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill the filesystem to the last block
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass
        finally:
            os.close(fd)
        r = await h.client.post("/instances", json={"config": {**cfg, "alias": "b"}})
        assert r.status_code == 507 and "No space left" in r.json()["detail"]
        r = await h.client.put(f"/instances/{idle_id}", json={"config": {**cfg, "alias": "c"}})
        assert r.status_code == 507
        r = await h.client.delete(f"/instances/{idle_id}")
        assert r.status_code == 507
        insts = (await h.client.get("/instances")).json()
        assert sorted(i["config"]["alias"] for i in insts) == ["a", "idle"]
        assert (await h.client.get("/health")).status_code == 200
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200  # running
        # A start the next boot would forget is refused, and nothing is spawned.
        r = await h.client.post(f"/instances/{idle_id}/start")
        assert r.status_code == 507 and "No space left" in r.json()["detail"], r.text
        view = (await h.client.get(f"/instances/{idle_id}")).json()
        assert view["status"] == "stopped" and view.get("pid") is None, view
        # A stop the next boot would undo is refused, and the backend keeps serving.
        r = await h.client.post(f"/instances/{iid}/stop")
        assert r.status_code == 507 and "No space left" in r.json()["detail"], r.text
        assert (await h.client.get(f"/instances/{iid}")).json()["status"] == "running"
        (small / "filler").unlink()
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
        assert (await h.client.delete(f"/instances/{iid}")).status_code == 200
        assert (await h.client.post(f"/instances/{idle_id}/start")).status_code == 200
        assert (await h.client.post(f"/instances/{idle_id}/stop")).status_code == 200
        assert (await h.client.delete(f"/instances/{idle_id}")).status_code == 200
    assert json.loads((small / "config.json").read_text())["instances"] == []
