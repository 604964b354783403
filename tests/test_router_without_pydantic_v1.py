"""The staged server builds the router with `pydantic.v1` unimportable (serving.without_pydantic_v1:
FastAPI imports it only to ask whether a parameter is a v1 model). In a process of its own, so
that the block touches no other test: a FastAPI that comes to need pydantic.v1 fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
from fastapi.testclient import TestClient
from solar_host.serving import staged_app
from solar_host.settings import load_settings

app = staged_app(load_settings(None))
api = app._build_api()
assert sys.modules["pydantic.v1"] is None, "pydantic.v1 was imported before the build"
with TestClient(api) as client:
    headers = {"X-API-Key": "k-0123456789abcdef0123"}
    assert client.get("/resources", headers=headers).status_code == 200
    r = client.post("/instances", headers=headers, json={"config": {"alias": 1}})
    assert r.status_code == 422 and "alias" in r.text, r.text
    assert client.get("/openapi.json").status_code == 200
print("built")
"""


def test_the_router_builds_and_validates_without_pydantic_v1(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "API_KEY": "k-0123456789abcdef0123",
        "CONFIG_FILE": str(tmp_path / "config.json"),
        "LOG_DIR": str(tmp_path / "logs"),
        "MODELS_DIR": str(tmp_path / "models"),
        "JOBS_DIR": str(tmp_path / "jobs"),
        "SOLAR_CONTROL_URL": "",
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-3000:]
