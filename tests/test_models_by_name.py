"""Models by name: a pulled model_source resolves to what the pull stored; a llama.cpp `model`
that is a directory holding one GGUF uses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from solar_host.backends import llamacpp_exec
from solar_host.backends.files import PatternError, gguf_of_dir
from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.registry import Registry


@pytest.fixture(scope="module")
def reg(tmp_path_factory: pytest.TempPathFactory):
    r = Registry(tmp_path_factory.mktemp("reg")).start()  # open: no login
    art = tmp_path_factory.mktemp("art")
    write_tiny_gguf(art / "tiny-f16.gguf")
    r.push("proj/tiny:v1", [Path("tiny-f16.gguf")], art)
    yield r
    r.stop()


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "model-00001-of-00003.gguf").write_bytes(b"GGUF")
    (d / "sub" / "model-00002-of-00003.gguf").write_bytes(b"GGUF")
    (d / "sub" / "model-00003-of-00003.gguf").write_bytes(b"GGUF")
    (d / "mmproj-f16.gguf").write_bytes(b"GGUF")  # a projector is never the model
    (d / "README.md").write_text("x")
    assert gguf_of_dir(d) == d / "sub" / "model-00001-of-00003.gguf"
    (d / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(PatternError) as err:
        gguf_of_dir(d)
    assert err.value.field == "model"
    assert "other.gguf" in str(err.value) and "sub/model-00001-of-00003.gguf" in str(err.value)
    assert "model_file" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PatternError, match=r"no \.gguf"):
        gguf_of_dir(tmp_path / "empty")


async def test_llama_model_directory_in_a_config(tmp_path: Path) -> None:
    models = tmp_path / "models"
    one = models / "one"
    one.mkdir(parents=True)
    write_tiny_gguf(one / "tiny.gguf")
    several = models / "several"
    several.mkdir()
    (several / "a-Q4_K_M.gguf").write_bytes(b"GGUF")
    (several / "b-Q8_0.gguf").write_bytes(b"GGUF")
    async with running_host(host_settings(tmp_path)) as h:
        base = {"backend_type": "llamacpp", "alias": "m"}
        r = await h.client.post("/instances", json={"config": {**base, "model": str(one)}})
        assert r.status_code == 200, r.text
        assert r.json()["instance"]["config"]["model"] == str(one / "tiny.gguf")
        r = await h.client.post("/instances", json={"config": {**base, "model": "several"}})
        assert r.status_code == 422
        err = r.json()["detail"][0]
        assert err["loc"][-1] == "model"
        assert "a-Q4_K_M.gguf" in err["msg"] and "b-Q8_0.gguf" in err["msg"]
        assert "model_file" in err["msg"]
        r = await h.client.post(
            "/instances",
            json={"config": {**base, "model": "several", "model_file": "*Q8_0*.gguf"}},
        )
        assert r.status_code == 200
        assert r.json()["instance"]["config"]["model"] == str(several / "b-Q8_0.gguf")


async def test_pulled_source_resolves_by_name(tmp_path: Path, reg: Registry) -> None:
    s = host_settings(tmp_path, harbor_url=reg.url, min_free_disk_gb=0)  # no credentials
    async with running_host(s) as h:
        cfg = {"backend_type": "llamacpp", "alias": "tiny", "model_source": "repo://tiny:v1"}
        # never pulled: a 422 saying which pull to run
        r = await h.client.post("/instances", json={"config": cfg})
        assert r.status_code == 422
        err = r.json()["detail"][0]
        assert err["loc"][-1] == "model_source"
        assert "never pulled" in err["msg"] and "POST /models/pull" in err["msg"]
        assert "solar-host pull repo://tiny:v1" in err["msg"]
        # an anonymous pull from the open registry
        r = await h.client.post(
            "/models/pull",
            json={"source": "harbor", "source_uri": "repo://tiny:v1", "harbor_ref": "proj/tiny:v1"},
        )
        assert r.status_code == 200, r.text
        pulled_dir = Path(r.json()["path"])
        # now by name, as docs/configuration.md says
        r = await h.client.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        model = Path(r.json()["instance"]["config"]["model"])
        assert model.name == "tiny-f16.gguf" and pulled_dir in (model, *model.parents)
        assert r.json()["instance"]["config"]["model_source"] == "repo://tiny:v1"
        # with a subpath, and a subpath the artifact does not have
        r = await h.client.post(
            "/instances", json={"config": {**cfg, "model_source": "repo://tiny:v1/tiny-f16.gguf"}}
        )
        assert r.status_code == 200 and Path(r.json()["instance"]["config"]["model"]) == model
        r = await h.client.post(
            "/instances", json={"config": {**cfg, "model_source": "repo://tiny:v1/nope.gguf"}}
        )
        assert r.status_code == 422 and "nope.gguf" in r.json()["detail"][0]["msg"]
        if not llamacpp_exec.resolve(s.llama_server_bin).available:
            return  # nothing to start it with on this machine
        iid = (await h.client.post("/instances", json={"config": {**cfg, "ctx_size": 256}})).json()[
            "instance"
        ]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200


def test_every_backend_family_resolves_a_pulled_source(tmp_path: Path) -> None:
    from solar_host.instances.schemas import ConfigError, parse_config

    pulled = tmp_path / "models" / "hf--acme--tiny"
    pulled.mkdir(parents=True)
    (pulled / "config.json").write_text("{}")
    stored = {"huggingface://acme/tiny": pulled}
    lookup = stored.get
    for bt, field in (("huggingface_causal", "model_id"), ("sglang", "model_path")):
        raw = {"backend_type": bt, "alias": "t", "model_source": "huggingface://acme/tiny"}
        config = parse_config(raw, models_dir=tmp_path / "models", manifest_lookup=lookup)
        assert getattr(config, field) == str(pulled), bt
        with pytest.raises(ConfigError) as err:
            parse_config(
                {**raw, "model_source": "huggingface://acme/other"},
                models_dir=tmp_path / "models",
                manifest_lookup=lookup,
            )
        assert err.value.errors[0]["loc"] == ("model_source",)
        assert '"model_id": "acme/other"' in err.value.errors[0]["msg"]
