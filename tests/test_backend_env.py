"""Backends get an environment built for them, not the host's (issue 17): a real host spawns
llama-server, our HF server and (fake) SGLang with the host's environment full of credentials;
each backend's /proc/<pid>/environ and cmdline hold none of them, the allowlisted and the
operator-listed variables arrive, and the keys travel only by each backend's own channel."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import psutil
import pytest

from solar_host.backends.base import LaunchSpec
from solar_host.instances.backend_env import backend_environment, is_secret_name
from tests.fixtures.fake_sglang import make_fake_sglang_venv
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401 (fixture)
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.probes import FakeProbe

HOST_SECRETS = {
    "API_KEY": API_KEY,
    "SOLAR_CONTROL_API_KEY": "control-key-SECRET-0001",
    "HF_TOKEN": "hf_SECRETtokenVALUE0123456789",
    "HARBOR_PASSWORD": "harborSECRETpassword0123",
    "HARBOR_USERNAME": "robot-SECRET-user",
    "AWS_SECRET_ACCESS_KEY": "aws-SECRET-0002",
    "GITHUB_TOKEN": "ghp_SECRET0003",
    "DB_PASSWORD": "db-SECRET-0004",
    "OPENAI_API_KEY": "sk-SECRET-0005",
    "MY_SECRET": "my-SECRET-0006",
}
ALLOWED = {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
NOT_ALLOWED = {"RANDOM_HOST_VAR": "random-0007"}
OPERATOR_LISTED = {"OPERATOR_LICENSE_TOKEN": "listed-token-0008", "SITE_FLAG": "site-0009"}
INSTANCE_KEY = "instance-own-key-0010"


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode("utf-8", "replace").split("\0") if "=" in e)


def cmdline_of(pid: int) -> str:
    text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    for kid in psutil.Process(pid).children(recursive=True):
        text += " " + " ".join(kid.cmdline())
    return text


def test_allowlist_unit() -> None:
    host = {
        **HOST_SECRETS,
        **ALLOWED,
        **NOT_ALLOWED,
        **OPERATOR_LISTED,
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_SECRET": "x",
        "HIP_VISIBLE_DEVICES": "1",
        "VK_ICD_FILENAMES": "/x",
        "http_proxy": "http://p:3128",
        "PYTHONPATH": "/src",
    }
    spec = LaunchSpec(
        argv=["x"], env={"LLAMA_API_KEY": "k", "HF_TOKEN": "own"}, env_remove=("PATH",)
    )
    env = backend_environment(spec, passthrough=("OPERATOR_LICENSE_TOKEN", "SITE_*"),
                              host_env=host)  # fmt: skip
    assert env["LLAMA_API_KEY"] == "k" and env["HF_TOKEN"] == "own"  # the backend's own
    assert "PATH" not in env  # env_remove wins over the allowlist
    for name in (
        *ALLOWED,
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "VK_ICD_FILENAMES",
        "http_proxy",
        "PYTHONPATH",
        *OPERATOR_LISTED,
    ):
        assert env[name] == host[name], name
    for name in (*HOST_SECRETS, *NOT_ALLOWED, "CUDA_SECRET"):
        assert name not in env or name == "HF_TOKEN", name
    assert env["PYTHONUNBUFFERED"] == "1"
    # A pattern never lets a credential through; only its exact name does.
    env = backend_environment(LaunchSpec(argv=["x"]), passthrough=("*",), host_env=host)
    assert not any(is_secret_name(k) for k in env), sorted(env)
    assert all(is_secret_name(k) for k in HOST_SECRETS)  # fmt: skip


async def test_each_backend_type_gets_a_built_environment(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_hf_models: TinyHFModels,  # noqa: F811
) -> None:
    for name, value in {**HOST_SECRETS, **ALLOWED, **NOT_ALLOWED, **OPERATOR_LISTED}.items():
        monkeypatch.setenv(name, value)
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    (tmp_path / "models" / "sg").mkdir()
    settings = host_settings(
        tmp_path,
        llama_server_bin=llama_server_binary(),
        model_roots=str(tiny_hf_models.causal.parent),
        backend_env_passthrough="OPERATOR_LICENSE_TOKEN,SITE_*",
        max_retries=1,
        start_port=free_port(),
        instance_ready_timeout_s=120.0,
    )
    settings.sglang_venv_path = str(make_fake_sglang_venv(tmp_path))
    configs = {
        "llamacpp": {"model": str(model), "ctx_size": 256, "api_key": INSTANCE_KEY},
        "huggingface_embedding": {"model_id": str(tiny_hf_models.encoder),
                                  "api_key": INSTANCE_KEY},
        "sglang": {"model_path": "sg"},
    }  # fmt: skip
    probe = FakeProbe(gpus=[(24, 0)], gpu_type="nvidia_cuda")
    async with running_host(settings, probe=probe) as h:
        started = {}
        for bt, extra in configs.items():
            cfg = {"backend_type": bt, "alias": bt, "host": "127.0.0.1", **extra}
            r = await h.client.post("/instances", json={"config": cfg})
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
            r = await h.client.post(f"/instances/{iid}/start", timeout=180)
            assert r.status_code == 200, r.text
            started[bt] = r.json()["instance"]
        for bt, inst in started.items():
            env, cmdline = environ_of(inst["pid"]), cmdline_of(inst["pid"])
            for name, value in {**HOST_SECRETS, **NOT_ALLOWED}.items():
                assert name not in env, (bt, name)
                assert value not in "\n".join(env.values()) or (
                    name == "API_KEY" and bt != "sglang"
                ), (bt, name)
                assert value not in cmdline, (bt, name)
            assert INSTANCE_KEY not in cmdline, bt
            for name, value in {**ALLOWED, **OPERATOR_LISTED}.items():
                assert env.get(name) == value, (bt, name)
            # Each key reaches its backend by the backend's own channel, and it works.
            if bt == "llamacpp":
                assert env["LLAMA_API_KEY"].split(",") == [API_KEY, INSTANCE_KEY]
            elif bt == "huggingface_embedding":
                assert env["SOLAR_HF_API_KEYS"].split(",") == [API_KEY, INSTANCE_KEY]
            else:
                assert API_KEY not in "\n".join(env.values())
                key_file = Path(cmdline.split("--config ", 1)[1].split(" ", 1)[0])
                st, dir_st = key_file.stat(), key_file.parent.stat()  # noqa: ASYNC240
                assert (
                    stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == psutil.Process().uids().real
                )
                assert stat.S_IMODE(dir_st.st_mode) == 0o700
                assert API_KEY in key_file.read_text()  # noqa: ASYNC240
            async with httpx.AsyncClient(timeout=60) as c:
                path = "/props" if bt == "llamacpp" else "/v1/models"  # llama's /v1/models is open
                url = f"http://127.0.0.1:{inst['port']}{path}"
                assert (await c.get(url)).status_code == 401, bt
                ok = await c.get(url, headers={"Authorization": f"Bearer {API_KEY}"})
                assert ok.status_code == 200, (bt, ok.text)
        for inst in started.values():
            assert (await h.client.post(f"/instances/{inst['id']}/stop")).status_code == 200
