"""What the host itself opens for a config (estimates, the start's preflight) is what the roots
check judged, where the backend would open it (review of the host key's reach):

- a path through `..` is refused whatever lies before it: realpath folds `x/..` away, the
  kernel walks through x, and the answers told a file from a directory from nothing;
- a relative path means MODELS_DIR/<path>, never the host's working directory (estimates
  read a model directory beside the host and quoted its header bytes and config values);
- the estimate of a stored instance judges its paths again (a link re-pointed out since);
- SGLang's `--flag=VALUE` is judged with VALUE whole (JSON with commas slipped through).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.instances.schemas import parse_config
from solar_host.model_store import roots
from solar_host.model_store.roots import OutsideRoots, check_config, confine
from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.safetensors_files import write_safetensors

SECRET = b"SECRET!!"


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """models/ with a GGUF and an HF directory; the host's working directory holds bait: a
    model directory whose safetensors header length is a secret, and a config.json value."""
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_gguf(models / "m.gguf")
    write_safetensors(models / "hf", {"w": ("F32", [4, 4])}, hidden_size=4)
    cwd = tmp_path / "host-cwd"
    (cwd / "outside" / "secretmodel").mkdir(parents=True)
    (cwd / "outside" / "secretmodel" / "w.safetensors").write_bytes(SECRET + b"\0" * 16)
    (cwd / "outside" / "withcfg").mkdir()
    (cwd / "outside" / "withcfg" / "config.json").write_text(
        json.dumps({"hidden_size": "TOPSECRET-value"})
    )
    (cwd / "outside" / "withcfg" / "w.safetensors").write_bytes(b"\0" * 24)
    (cwd / "outside" / "template.jinja").write_text("{{ secret }}")
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(cwd)
    return {"root": tmp_path, "models": models, "cwd": cwd}


def test_dotdot_is_refused_alike_whatever_lies_before_it(tree: dict[str, Path]) -> None:
    models = tree["models"]
    climb = "/".join([".."] * (len(models.parts) + 2))
    answers = set()
    for probe in ("/etc", "/etc/nothing-here", str(tree["root"] / "afile"), str(models)):
        value = f"{probe}/{climb}{models}/m.gguf"
        cfg = {"backend_type": "llamacpp", "alias": "a", "model": value}
        with pytest.raises(ValueError) as err:
            parse_config(cfg, models_dir=models, roots=[models])
        answers.add(str(err.value).replace(value, "V"))
    assert len(answers) == 1, answers  # one answer: nothing told about the probed path
    assert "'..'" in answers.pop()


def test_a_path_the_host_may_not_resolve_is_outside(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """realpath raising (a /proc/<pid>/root the host may not enter) is a refusal naming the
    field, not a 500."""

    def denied(path: Any) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(roots.os.path, "realpath", denied)
    with pytest.raises(OutsideRoots) as err:
        confine("/proc/1/root/etc/shadow", [tree["models"]], "model")
    assert err.value.field == "model"


@pytest.mark.parametrize(
    "arg",
    [
        '--lora-paths={{"lora_name":"x","lora_path":"{out}"}}',
        '--model-loader-extra-config={{"a":1,"dir":"{out}"}}',
        'x={{"lora_name":"x","lora_path":"{out}"}}',
    ],
)
def test_a_joined_json_value_is_judged_whole(tree: dict[str, Path], arg: str) -> None:
    models = tree["models"]
    cfg = {
        "backend_type": "sglang",
        "alias": "a",
        "model_path": str(models / "hf"),
        "extra_args": [arg.format(out=tree["cwd"] / "outside")],
    }
    with pytest.raises(ValueError, match="extra_args"):
        parse_config(cfg, models_dir=models, roots=[models])
    stored = parse_config(cfg, models_dir=models, roots=[models], strict=False)
    with pytest.raises(OutsideRoots):
        check_config(stored, [models])


async def test_estimates_open_relative_paths_under_models_dir(tree: dict[str, Path]) -> None:
    settings = host_settings(tree["root"])
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        for model_id in ("outside/secretmodel", "./outside/withcfg", "outside/nothing"):
            cfg = {"backend_type": "huggingface_causal", "alias": "a", "model_id": model_id}
            r = await c.post("/instances/estimate", json={"config": cfg})
            assert r.status_code == 422, r.text
            assert "local model directory" in r.text, r.text
            assert "TOPSECRET" not in r.text
            assert str(struct.unpack("<Q", SECRET)[0]) not in r.text
        # Inside MODELS_DIR, relative, it is estimated.
        cfg = {"backend_type": "huggingface_causal", "alias": "a", "model_id": "hf"}
        r = await c.post("/instances/estimate", json={"config": cfg})
        assert r.status_code == 200, r.text


async def test_a_stored_instances_estimate_judges_its_paths_again(tree: dict[str, Path]) -> None:
    models = tree["models"]
    settings = host_settings(tree["root"])
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        cfg = {"backend_type": "huggingface_causal", "alias": "a", "model_id": str(models / "hf")}
        r = await c.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        assert (await c.get(f"/instances/{iid}/estimate")).status_code == 200
        weights = models / "hf" / "model.safetensors"
        weights.unlink()
        weights.symlink_to(tree["cwd"] / "outside" / "secretmodel" / "w.safetensors")
        r = await c.get(f"/instances/{iid}/estimate")
        assert r.status_code == 422, r.text
        assert "resolves outside" in r.text
        assert str(struct.unpack("<Q", SECRET)[0]) not in r.text


async def test_the_preflight_opens_a_relative_template_under_models_dir(
    tree: dict[str, Path],
) -> None:
    """chat_template_file "outside/template.jinja" is MODELS_DIR/outside/template.jinja to
    the roots check and the backend; the preflight tested the host's working directory, and
    told a file there from a missing one."""
    settings = host_settings(tree["root"], max_retries=0)
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        answers = []
        for template in ("outside/template.jinja", "outside/nothing.jinja"):
            cfg = {
                "backend_type": "llamacpp",
                "alias": "a",
                "model": "m.gguf",
                "chat_template_file": template,
            }
            r = await c.post("/instances", json={"config": cfg})
            assert r.status_code == 200, r.text
            iid = r.json()["instance"]["id"]
            r = await c.post(f"/instances/{iid}/start")
            assert r.status_code >= 400, r.text
            assert str(tree["models"] / template) in r.text, r.text
            answers.append(r.json()["detail"].replace(template, "T"))
        assert answers[0] == answers[1]
