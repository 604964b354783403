"""The staged server builds the router with `pydantic.v1` unimportable (serving.without_pydantic_v1:
FastAPI imports it only to ask whether a parameter is a v1 model). In a process of its own, so
that the block touches no other test: a FastAPI that comes to need pydantic.v1 fails here.

It also imports FastAPI with the OpenAPI document's models deferred
(serving.import_fastapi_deferring_openapi_models): the document it serves must be the one an
eager build serves, and models declared after the import are built as before."""

from __future__ import annotations

import json
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


# argv[1]: "eager" imports FastAPI before the staged build (as any test process does).
OPENAPI_SCRIPT = r"""
import json, sys
if sys.argv[1] == "eager":
    import fastapi
from solar_host.serving import staged_app
from solar_host.settings import load_settings

app = staged_app(load_settings(None))
api = app._build_api()
import fastapi.openapi.models as models
from pydantic import BaseModel
from pydantic._internal._config import config_defaults

assert config_defaults["defer_build"] is False, "pydantic's default was not put back"
class Later(BaseModel):
    n: int
assert Later.__pydantic_complete__, "a model declared after the import was deferred"
deferred = not models.OpenAPI.__pydantic_complete__
assert deferred == (sys.argv[1] == "deferred"), deferred
from fastapi.testclient import TestClient
with TestClient(api) as client:
    docs = client.get("/docs")
    assert docs.status_code == 200, docs.text
    r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
print(json.dumps(r.json(), sort_keys=True))
"""


def env_for(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "API_KEY": "k-0123456789abcdef0123",
        "CONFIG_FILE": str(tmp_path / "config.json"),
        "LOG_DIR": str(tmp_path / "logs"),
        "MODELS_DIR": str(tmp_path / "models"),
        "JOBS_DIR": str(tmp_path / "jobs"),
        "SOLAR_CONTROL_URL": "",
    }


def run_script(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", *argv],
        cwd=tmp_path,
        env=env_for(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_router_builds_and_validates_without_pydantic_v1(tmp_path: Path) -> None:
    out = run_script(tmp_path, SCRIPT)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-3000:]


def test_the_openapi_document_with_its_models_deferred_is_the_eager_one(tmp_path: Path) -> None:
    deferred = run_script(tmp_path, OPENAPI_SCRIPT, "deferred")
    assert deferred.returncode == 0, deferred.stderr[-3000:]
    eager = run_script(tmp_path, OPENAPI_SCRIPT, "eager")
    assert eager.returncode == 0, eager.stderr[-3000:]
    document = json.loads(deferred.stdout.strip().splitlines()[-1])
    assert document["paths"]["/instances"], "no routes in the document"
    assert document == json.loads(eager.stdout.strip().splitlines()[-1])
