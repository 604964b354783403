"""The whole OpenAPI surface fuzzed with schemathesis against a host subprocess (real HTTP).

Property: no 500 (an unhandled error) on any input, every 5xx that remains is one the operation
documents (502/503/507: an unreachable source, no Docker daemon, a full disk) with a JSON body,
and the host process is alive and healthy at the end. Oversized bodies and absurd numbers get a
4xx. Examples per operation: 300 with SOLAR_LONG_TESTS=1 (15 by default).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.hostproc import HostProc

EXAMPLES = 300 if os.environ.get("SOLAR_LONG_TESTS") else 15
HARBOR_ENV = {
    "HARBOR_URL": "http://127.0.0.1:9",
    "HARBOR_USERNAME": "u",
    "HARBOR_PASSWORD": "p",
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "DOCKER_HOST": "unix:///nonexistent/docker.sock",
    "MAX_REQUEST_BODY_BYTES": str(256 * 1024),
}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "models").mkdir()
    with HostProc(tmp, env=HARBOR_ENV) as h:
        h.start()
        yield h


def documented_5xx(op: Any, status: int) -> bool:
    responses = op.definition.raw.get("responses", {})
    return status != 500 and str(status) in responses


def test_openapi_surface_has_no_server_errors(host: HostProc) -> None:
    schema = schemathesis.openapi.from_url(host.url + "/openapi.json")
    headers = {"X-API-Key": host.api_key}
    failures: list[str] = []
    seen = 0

    def fuzz(op: Any) -> None:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        @given(case=op.as_strategy())
        def run(case: Any) -> None:
            nonlocal seen
            seen += 1
            resp = case.call(base_url=host.url, headers=headers, timeout=30)
            status = resp.status_code
            if status >= 500 and not documented_5xx(op, status):
                failures.append(
                    f"{op.label} -> {status}: {resp.text[:300]} (case {case.path_parameters} "
                    f"{case.query} {str(case.body)[:200]})"
                )
            elif status >= 500:
                json.loads(resp.text)  # documented server-side errors are JSON too

        run()

    for result in schema.get_all_operations():
        fuzz(result.ok())
    assert seen >= 30
    with httpx.Client(timeout=5) as c:
        assert c.get(host.url + "/health").status_code == 200
    assert host.proc is not None and host.proc.poll() is None, "host crashed"
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/instances",
            {
                "config": {
                    "backend_type": "llamacpp",
                    "alias": "a",
                    "model": "/m",
                    "ctx_size": 10**30,
                }
            },
        ),
        (
            "/instances",
            {"config": {"backend_type": "llamacpp", "alias": "a", "model": "/m", "threads": -1}},
        ),
        (
            "/instances",
            {"config": {"backend_type": "llamacpp", "alias": "a", "model": "/m", "port": 70000}},
        ),
        (
            "/instances",
            {"config": {"backend_type": "llamacpp", "alias": "a" * 100_000, "model": "/m"}},
        ),
        (
            "/instances",
            {"config": {"backend_type": "llamacpp", "alias": "a", "model": "/m", "temp": 1e308}},
        ),
        ("/resources/reservations", {"instance_id": "x", "gpu_memory_gb": 1e300}),
        ("/resources/reservations", {"instance_id": "x", "ttl_seconds": -5}),
        (
            "/models/pull",
            {
                "source": "huggingface",
                "source_uri": "huggingface://a/b",
                "model_id": "a/b",
                "size_bytes": 10**40,
            },
        ),
        (
            "/jobs",
            {"job_id": "j1", "steps": [{"name": "s", "image": "i", "command": "true"}] * 5000},
        ),
        (
            "/jobs",
            {
                "job_id": "j2",
                "steps": [{"name": "s", "image": "i", "command": "true", "gpu": 10**20}],
            },
        ),
        (
            "/jobs",
            {
                "job_id": "j3",
                "retention_hours": -1,
                "steps": [{"name": "s", "image": "i", "command": "true"}],
            },
        ),
    ],
)
def test_absurd_numbers_and_sizes_are_4xx(host: HostProc, path: str, body: dict[str, Any]) -> None:
    with host.client() as c:
        r = c.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    if body.get("size_bytes"):
        # A size no disk holds is the documented 507 insufficient_storage (checked first).
        assert r.status_code == 507 and r.json()["error"] == "insufficient_storage", r.text
        return
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:300])


def test_oversized_and_malformed_bodies_are_refused(host: HostProc) -> None:
    big = b'{"config": {"alias": "' + b"a" * (300 * 1024) + b'"}}'
    with host.client() as c:
        # Declared length over the limit: refused before the body is read.
        r = c.post("/instances", content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.status_code

        # Chunked (no Content-Length): refused while streaming.
        def chunks() -> Any:
            for i in range(0, len(big), 16384):
                yield big[i : i + 16384]

        r = c.post("/instances", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.status_code
        for raw in (b"{", b"[]", b"null", b'{"config": 5}', b"\xff\xfe", b'{"a": ' * 5000):
            for path in ("/instances", "/models/pull", "/jobs", "/resources/reservations"):
                r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
                assert 400 <= r.status_code < 500, (path, raw[:20], r.status_code, r.text[:200])
        assert c.get("/health").status_code == 200


@settings(
    max_examples=EXAMPLES * 2,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    config=st.dictionaries(
        st.sampled_from(
            [
                "backend_type",
                "alias",
                "model",
                "model_source",
                "model_file",
                "port",
                "ctx_size",
                "threads",
                "host",
                "api_key",
                "mmproj",
                "model_id",
                "model_path",
                "extra_args",
                "extra_env",
                "devices",
                "tensor_split",
            ]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=True),
            st.text(max_size=40),
            st.sampled_from(["llamacpp", "sglang", "huggingface_causal", "../x", "local://../x"]),
            st.lists(st.text(max_size=10), max_size=4),
            st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        ),
        max_size=8,
    )
)
def test_instance_configs_never_500(config: dict[str, Any]) -> None:
    """Random configs (the free-form part of the contract) are 200 or 422, never 500."""
    h = _HOST["h"]
    # Encoded here: httpx refuses NaN and infinities, and a client may well send them (Python's
    # json module writes NaN / Infinity by default).
    body = json.dumps({"config": config}).encode()
    with h.client() as c:
        r = c.post("/instances", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code in (200, 422), (config, r.status_code, r.text[:300])
        if r.status_code == 200:
            iid = r.json()["instance"]["id"]
            assert c.delete(f"/instances/{iid}").status_code == 200


_HOST: dict[str, HostProc] = {}


@pytest.fixture(autouse=True)
def _expose_host(request: pytest.FixtureRequest) -> None:
    if request.function.__name__ == "test_instance_configs_never_500":
        _HOST["h"] = request.getfixturevalue("host")


def test_models_dir_untouched_by_fuzzing(host: HostProc) -> None:
    """Runs last in this module: fuzzing left nothing in MODELS_DIR but the manifest."""
    left = sorted(p.name for p in Path(host.tmp / "models").iterdir())
    assert set(left) <= {"manifest.json", ".tmp", ".partial"}, left
