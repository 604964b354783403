"""Files stay inside the model roots (ruling 12, issue 17): every path-like field of every
backend type, given as an absolute path, a `..` path or a symlink out of MODELS_DIR, is a 422
naming the field and the roots, at create and update; a symlink re-pointed after create fails
the start before anything is spawned; MODEL_ROOTS directories are accepted. Untyped values
(SGLang's extra_args and extra_env) are judged in every form a backend may read a path from,
and backends run in MODELS_DIR, so a name the check let through as a Hub id opens nothing
beside the host."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from solar_host.backends.base import LaunchContext
from solar_host.backends.registry import BackendRegistry
from solar_host.instances.schemas import parse_config
from solar_host.model_store.roots import check_config, confine
from tests.fixtures.gguf import llama_server_binary, write_tiny_gguf
from tests.fixtures.hf_models import TinyHFModels, tiny_hf_models  # noqa: F401
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

BACKENDS = (
    "llamacpp",
    "huggingface_causal",
    "huggingface_classification",
    "huggingface_embedding",
    "huggingface_vision",
    "sglang",
)


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """models/ (with a good model and links out), a second root disk2/, and outside/ bait."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.gguf").write_bytes(b"GGUF secret outside")
    (outside / "shadow").write_text("root:$6$hash:19000:0:99999:7:::\n")
    (outside / "hfdir").mkdir()
    (outside / "hfdir" / "config.json").write_text('{"model_type": "llama"}')
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    write_tiny_gguf(models / "m" / "model.gguf")
    (models / "m" / "template.jinja").write_text("{{ messages }}")
    (models / "hf").mkdir()
    (models / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (models / "out.gguf").symlink_to(outside / "secret.gguf")
    (models / "out.jinja").symlink_to(outside / "shadow")
    (models / "outdir").symlink_to(outside / "hfdir", target_is_directory=True)
    disk2 = tmp_path / "disk2"
    disk2.mkdir()
    write_tiny_gguf(disk2 / "other.gguf")
    (disk2 / "hf2").mkdir()
    (disk2 / "hf2" / "config.json").write_text('{"model_type": "llama"}')
    return {"root": tmp_path, "models": models, "outside": outside, "disk2": disk2}


def bad_paths(t: dict[str, Path], kind: str) -> list[str]:
    """Ways to name `outside` bait of `kind` (file|dir): absolute, `..`, symlinks, /etc."""
    if kind == "file":
        return [
            str(t["outside"] / "secret.gguf"),
            "../outside/secret.gguf",
            "m/../../outside/secret.gguf",
            "out.gguf",
            str(t["models"] / "out.gguf"),
            str(t["models"] / "m" / ".." / ".." / "outside" / "shadow"),
            "/etc/passwd",
            "/etc/shadow",
        ]
    return [
        str(t["outside"] / "hfdir"),
        "../outside/hfdir",
        "hf/../../outside/hfdir",
        "outdir",
        str(t["models"] / "outdir"),
        "/etc",
    ]


def base_config(t: dict[str, Path], bt: str) -> dict[str, Any]:
    if bt == "llamacpp":
        return {"backend_type": bt, "alias": "a", "model": str(t["models"] / "m" / "model.gguf")}
    if bt == "sglang":
        return {"backend_type": bt, "alias": "a", "model_path": str(t["models"] / "hf")}
    return {"backend_type": bt, "alias": "a", "model_id": str(t["models"] / "hf")}


def cases(t: dict[str, Path]) -> list[tuple[str, str, dict[str, Any]]]:
    """(backend_type, field named in the error, config) for every path-like field."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for bad in bad_paths(t, "file"):
        base = base_config(t, "llamacpp")
        out.append(("llamacpp", "model", {**base, "model": bad}))
        out.append(("llamacpp", "mmproj", {**base, "mmproj": bad}))
        out.append(("llamacpp", "chat_template_file", {**base, "chat_template_file": bad}))
        dspark = {"spec_type": "draft-dspark", "spec_draft_model": bad}
        out.append(("llamacpp", "spec_draft_model", {**base, **dspark}))
        if not bad.startswith("/"):
            out.append(
                (
                    "llamacpp",
                    "model_source",
                    {**base, "model": None, "model_source": f"local://{bad}"},
                )
            )
        else:
            out.append(("llamacpp", "model_file", {**base, "model_file": bad}))
            out.append(
                (
                    "llamacpp",
                    "model_source",
                    {"backend_type": "llamacpp", "alias": "a", "model_source": f"local://{bad}"},
                )
            )
    for bad in bad_paths(t, "dir"):
        for bt in BACKENDS[1:]:
            field = "model_path" if bt == "sglang" else "model_id"
            base = base_config(t, bt)
            out.append((bt, field, {**base, field: bad}))
            source = f"local://{bad}"
            out.append(
                (bt, "model_source", {"backend_type": bt, "alias": "a", "model_source": source})
            )
        sg = base_config(t, "sglang")
        # Bare words too ("outdir"): backends run in MODELS_DIR, where that is a link out.
        out.append(("sglang", "extra_args", {**sg, "extra_args": ["--tokenizer-path", bad]}))
        out.append(("sglang", "extra_args", {**sg, "extra_args": [f"--chat-template={bad}"]}))
        out.append(("sglang", "extra_env", {**sg, "extra_env": {"SOME_DIR": bad}}))
    return out  # fmt: skip


def test_every_path_field_of_every_backend_is_confined(tree: dict[str, Path]) -> None:
    roots = [tree["models"], tree["disk2"]]
    seen: set[tuple[str, str]] = set()
    for bt, field, cfg in cases(tree):
        with pytest.raises(ValueError) as err:
            parse_config(cfg, models_dir=tree["models"], roots=roots)
        text = str(err.value)
        assert field in text, (bt, field, cfg, text)
        # Outside the roots, or through `..` (refused wherever it is: test_host_reads_confined).
        assert any(m in text for m in (str(tree["disk2"]), "outside of MODELS_DIR", "'..'")), text
        assert "root:$6$" not in text and "GGUF secret" not in text
        seen.add((bt, field))
    fields = {f for _, f in seen}
    assert {
        "model",
        "model_file",
        "mmproj",
        "spec_draft_model",
        "chat_template_file",
        "model_source",
        "model_id",
        "model_path",
        "extra_args",
        "extra_env",
    } <= fields
    assert {bt for bt, _ in seen} == set(BACKENDS)  # fmt: skip


def test_inside_and_other_roots_are_accepted(tree: dict[str, Path]) -> None:
    models, disk2 = tree["models"], tree["disk2"]
    roots = [models, disk2]
    (models / "to-disk2.gguf").symlink_to(disk2 / "other.gguf")
    good = [
        {"backend_type": "llamacpp", "alias": "a", "model": "m/model.gguf",
         "chat_template_file": "m/template.jinja"},
        {"backend_type": "llamacpp", "alias": "a", "model": str(disk2 / "other.gguf")},
        {"backend_type": "llamacpp", "alias": "a", "model": "to-disk2.gguf"},
        {"backend_type": "llamacpp", "alias": "a", "model_source": f"local://{disk2}/other.gguf"},
        {"backend_type": "huggingface_causal", "alias": "a", "model_id": "org/some-model"},
        {"backend_type": "huggingface_causal", "alias": "a", "model_id": str(disk2 / "hf2")},
        {"backend_type": "sglang", "alias": "a", "model_path": "hf",
         "extra_args": ["--tp", "2", f"--tokenizer-path={models / 'hf'}"]},
    ]  # fmt: skip
    for cfg in good:
        config = parse_config(cfg, models_dir=models, roots=roots)
        check_config(config, roots)
    # A relative chat template is kept as sent, and the backend opens the checked file.
    config = parse_config(good[0], models_dir=models, roots=roots)
    assert config.chat_template_file == "m/template.jinja"
    ctx = LaunchContext(instance_id="i", port=1, host_api_key="k", models_dir=models)
    argv = BackendRegistry.default().for_type("llamacpp").launch(config, ctx).argv
    assert argv[argv.index("--chat-template-file") + 1] == str(models / "m" / "template.jinja")
    # Without MODEL_ROOTS the second disk is outside.
    with pytest.raises(ValueError, match="model"):
        parse_config(good[1], models_dir=models, roots=[models])


def test_confine_resolves_symlinked_roots(tmp_path: Path) -> None:
    """A root that is itself a symlink still contains what is under it."""
    real = tmp_path / "real"
    (real / "x").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    assert confine(str(link / "x"), [link], "model") == (real / "x").resolve()
    assert confine("x", [link], "model") == (real / "x").resolve()
    with pytest.raises(ValueError, match="model_path"):
        confine(str(link / ".." / "elsewhere"), [link], "model_path")


async def test_create_and_update_refuse_paths_outside_the_roots(tree: dict[str, Path]) -> None:
    settings = host_settings(tree["root"], model_roots=str(tree["disk2"]))
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        attack = {**base_config(tree, "llamacpp"), "chat_template_file": "/etc/shadow"}
        r = await c.post("/instances", json={"config": attack})
        assert r.status_code == 422, r.text
        assert "chat_template_file" in r.text and str(tree["disk2"]) in r.text
        r = await c.post(
            "/instances",
            json={"config": {**attack, "model": "/etc/passwd", "chat_template_file": None}},
        )
        assert r.status_code == 422 and "model" in r.text, r.text
        r = await c.post("/instances", json={"config": base_config(tree, "llamacpp")})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        for field, bad in (
            ("mmproj", "../outside/secret.gguf"),
            ("model", "out.gguf"),
            ("chat_template_file", str(tree["outside"] / "shadow")),
        ):
            cfg = {**base_config(tree, "llamacpp"), field: bad}
            r = await c.put(f"/instances/{iid}", json={"config": cfg})
            assert r.status_code == 422, (field, r.text)
            assert field in r.text
        # Nothing changed, and a model on the second root is fine.
        r = await c.put(
            f"/instances/{iid}",
            json={
                "config": {
                    **base_config(tree, "llamacpp"),
                    "model": str(tree["disk2"] / "other.gguf"),
                }
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["instance"]["config"]["model"] == str(tree["disk2"] / "other.gguf")
        listing = (await c.get("/instances")).json()
        assert len(listing) == 1
        assert listing[0]["config"].get("chat_template_file") is None


async def test_start_checks_again_and_spawns_nothing(tree: dict[str, Path]) -> None:
    """A symlink inside MODELS_DIR that is re-pointed out after create fails the start."""
    models = tree["models"]
    link = models / "current.gguf"
    link.symlink_to(models / "m" / "model.gguf")
    settings = host_settings(tree["root"], llama_server_bin=llama_server_binary())
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        cfg = {"backend_type": "llamacpp", "alias": "t", "model": str(link), "ctx_size": 256}
        r = await c.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        link.unlink()
        link.symlink_to(tree["outside"] / "secret.gguf")
        r = await c.post(f"/instances/{iid}/start")
        assert r.status_code >= 400, r.text
        assert "outside of MODELS_DIR" in r.text and "model" in r.text
        assert "GGUF secret" not in r.text
        inst = (await c.get(f"/instances/{iid}")).json()
        assert inst["status"] == "failed" and inst["pid"] is None
        assert "outside of MODELS_DIR" in inst["error_message"]
        # Nothing was spawned: its log holds only the host's word of why (issue 40).
        logged = [
            line
            for f in (tree["root"] / "logs").glob(f"*{iid}*")
            for line in f.read_text().splitlines()
        ]
        assert logged and all(line.startswith("solar-host: ") for line in logged), logged


async def test_a_non_gguf_model_never_echoes_its_bytes(tree: dict[str, Path]) -> None:
    """model: a text file (inside the roots): the start error says what is wrong, quoting
    nothing of the file (llama-server would print its first bytes)."""
    models = tree["models"]
    (models / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    settings = host_settings(tree["root"], llama_server_bin=llama_server_binary())
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        cfg = {"backend_type": "llamacpp", "alias": "t", "model": "passwd", "ctx_size": 256}
        r = await c.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = await c.post(f"/instances/{iid}/start")
        assert r.status_code >= 400
        assert "not a GGUF file" in r.text, r.text
        assert "root:" not in r.text and "'root'" not in r.text
        logs = (await c.get(f"/instances/{iid}/logs")).text
        assert "root:" not in logs


def test_symlink_loop_is_refused_not_hung(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    os.symlink("loop2", models / "loop1")
    os.symlink("loop1", models / "loop2")
    cfg = {"backend_type": "sglang", "alias": "a", "model_path": str(models / "loop1")}
    # Either refused or resolved inside: never a path outside, never a hang.
    try:
        config = parse_config(cfg, models_dir=models, roots=[models])
    except ValueError:
        return
    assert str(config.model_path).startswith(str(models.resolve()))


def _sglang(t: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {**base_config(t, "sglang"), **extra}


@pytest.mark.parametrize(
    "extra",
    [
        # --lora-paths takes NAME=PATH, a JSON object, and comma lists of either.
        {"extra_args": ["--enable-lora", "--lora-paths", "x={outside}"]},
        {"extra_args": ["--lora-paths=x={outside}"]},
        {"extra_args": ["--lora-paths", "a=hf,b={outside}"]},
        {"extra_args": ["--lora-paths", '{{"lora_name": "x", "lora_path": "{outside}"}}']},
        {"extra_args": ["--model-loader-extra-config", '{{"dirs": ["hf", "{outside}"]}}']},
        {"extra_args": ["--tokenizer-path", "~/.cache/huggingface"]},
        # huggingface_hub expands ~ and $VARS in HF_HOME and its other directories.
        {"extra_env": {"HF_HOME": "~/.cache/huggingface"}},
        {"extra_env": {"HF_HOME": "~root"}},
        {"extra_env": {"HF_HOME": "$HOME/.cache/huggingface"}},
        {"extra_env": {"HF_HOME": "${{HOME}}"}},
        {"extra_env": {"HF_HUB_CACHE": "$BAIT", "BAIT": "{outside}"}},
    ],
)
def test_untyped_values_are_judged_in_every_form(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any]
) -> None:
    """Paths tucked inside SGLang's untyped values (issue 17 review): refused at create and
    again at start, with the value as written in the message, not what it expands to."""
    monkeypatch.setenv("HOME", str(tree["outside"]))
    outside = str(tree["outside"] / "hfdir")
    filled = {
        k: [a.format(outside=outside) for a in v]
        if isinstance(v, list)
        else {n: x.format(outside=outside) for n, x in v.items()}
        for k, v in extra.items()
    }
    cfg = _sglang(tree, **filled)
    with pytest.raises(ValueError) as err:
        parse_config(cfg, models_dir=tree["models"], roots=[tree["models"]])
    field = next(iter(extra))
    assert field in str(err.value), str(err.value)
    if field == "extra_env" and "$" in str(extra):
        assert str(tree["outside"]) not in str(err.value)  # no variable's value echoed
    stored = parse_config(cfg, models_dir=tree["models"], roots=[tree["models"]], strict=False)
    with pytest.raises(ValueError, match="outside of MODELS_DIR"):
        check_config(stored, [tree["models"]])


def test_untyped_values_inside_the_roots_are_accepted(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tree["models"]))
    hf = str(tree["models"] / "hf")
    for extra in (
        {"extra_args": ["--lora-paths", f"x={hf}", '{"lora_name": "y", "lora_path": "hf"}']},
        {"extra_args": ["--tp", "2", "--mem-fraction-static=0.8", "--dtype", "bfloat16"]},
        {"extra_env": {"HF_HOME": "~/hf", "HF_HUB_CACHE": "$HOME/hf", "CACHE": "hf"}},
        {"extra_env": {"SOME_DIR": "hf", "HF_HUB_CACHE": "$SOME_DIR"}},
        {"extra_env": {"HF_TOKEN": "hf_abc$def", "NOTE": "a=b,c"}},
    ):
        config = parse_config(
            _sglang(tree, **extra), models_dir=tree["models"], roots=[tree["models"]]
        )
        check_config(config, [tree["models"]])


@pytest.mark.parametrize("field", ["model", "chat_template_file", "mmproj"])
@pytest.mark.parametrize("bad", ["a/" * 3000 + "x.gguf", "x" * 300 + ".gguf", "\ud800.gguf"])
def test_a_path_no_file_can_have_is_a_422_naming_the_field(
    tree: dict[str, Path], field: str, bad: str
) -> None:
    cfg = {**base_config(tree, "llamacpp"), field: bad}
    with pytest.raises(ValueError) as err:
        parse_config(cfg, models_dir=tree["models"], roots=[tree["models"]])
    assert field in str(err.value)


async def test_backends_run_in_models_dir(tree: dict[str, Path]) -> None:
    """A backend's working directory is MODELS_DIR, whatever the host's own is: a relative
    name it opens is one the roots check judged there."""
    settings = host_settings(tree["root"])
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        c = h.client
        r = await c.post("/instances", json={"config": script_config(tree["root"])})
        assert r.status_code == 200, r.text
        iid = r.json()["instance"]["id"]
        r = await c.post(f"/instances/{iid}/start")
        assert r.status_code == 200, r.text
        pid = (await c.get(f"/instances/{iid}")).json()["pid"]
        try:
            assert Path(os.readlink(f"/proc/{pid}/cwd")) == tree["models"].resolve()
        finally:
            await c.post(f"/instances/{iid}/stop")


async def test_a_hub_shaped_model_id_never_loads_a_directory_beside_the_host(
    tree: dict[str, Path],
    tiny_hf_models: TinyHFModels,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """model_id "private-model" names nothing under MODELS_DIR, so it is a Hub id; a model of
    that name in the host's working directory must not be what the backend loads."""
    cwd = tree["root"] / "host-cwd"
    cwd.mkdir()
    shutil.copytree(tiny_hf_models.causal, cwd / "private-model")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no Hub here: the start must fail
    settings = host_settings(tree["root"], max_retries=0)
    async with running_host(settings, backends=BackendRegistry.default()) as h:
        c = h.client
        cfg = {"backend_type": "huggingface_causal", "alias": "p", "model_id": "private-model"}
        r = await c.post("/instances", json={"config": cfg})
        assert r.status_code == 200, r.text  # a Hub id: accepted, as documented
        iid = r.json()["instance"]["id"]
        r = await c.post(f"/instances/{iid}/start", timeout=120)
        assert r.status_code >= 400, r.text  # not served from host-cwd/private-model
        inst = (await c.get(f"/instances/{iid}")).json()
        assert inst["status"] == "failed", inst


def test_links_inside_a_model_directory_stay_inside_the_roots(tree: dict[str, Path]) -> None:
    """The backend opens the files of the directory a config names: a link among them that
    leads out of the roots is refused like the config naming the file itself."""
    models, roots = tree["models"], [tree["models"], tree["disk2"]]
    hf = models / "hf"
    # An HF-cache layout: snapshot files are links into blobs/, inside the root: accepted.
    blobs = models / "cache" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc123").write_text('{"model_type": "llama"}')
    snap = models / "cache" / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to(blobs / "abc123")
    (snap / "weights").symlink_to(tree["disk2"] / "hf2", target_is_directory=True)  # a root
    for bt, field in (("huggingface_causal", "model_id"), ("sglang", "model_path")):
        ok = {"backend_type": bt, "alias": "a", field: str(snap)}
        check_config(parse_config(ok, models_dir=models, roots=roots), roots)
    bad_links = {
        "tokenizer.json": tree["outside"] / "shadow",  # a file out
        "extra": tree["outside"] / "hfdir",  # a directory out
    }
    for name, target in bad_links.items():
        (hf / name).symlink_to(target)
        for bt, field in (("huggingface_causal", "model_id"), ("sglang", "model_path")):
            cfg = {"backend_type": bt, "alias": "a", field: "hf"}
            with pytest.raises(ValueError) as err:
                parse_config(cfg, models_dir=models, roots=roots)
            assert field in str(err.value) and f"'{name}'" in str(err.value), str(err.value)
            assert "root:$6$" not in str(err.value)
        (hf / name).unlink()
    # Nested: a link into the root leads to a directory holding a link out.
    (models / "inner").mkdir()
    (models / "inner" / "vocab.txt").symlink_to(tree["outside"] / "shadow")
    (hf / "sub").symlink_to(models / "inner", target_is_directory=True)
    with pytest.raises(ValueError, match=r"vocab\.txt"):
        parse_config(
            {"backend_type": "huggingface_causal", "alias": "a", "model_id": "hf"},
            models_dir=models,
            roots=roots,
        )
    # A link loop inside the root leads nowhere else: the walk ends (the kernel stops it at
    # its link depth, the check at MAX_DIR_ENTRIES) and the directory is accepted.
    (hf / "sub").unlink()
    (hf / "loop").symlink_to(hf, target_is_directory=True)
    started = time.monotonic()
    parse_config(
        {"backend_type": "huggingface_causal", "alias": "a", "model_id": "hf"},
        models_dir=models,
        roots=roots,
    )
    assert time.monotonic() - started < 10


def test_a_directory_too_big_to_be_a_model_is_refused_not_walked_for_ever(tmp_path: Path) -> None:
    from solar_host.model_store.roots import MAX_DIR_ENTRIES

    models = tmp_path / "models"
    big = models / "big"
    big.mkdir(parents=True)
    for i in range(MAX_DIR_ENTRIES + 1):
        (big / f"f{i}").touch()
    cfg = {"backend_type": "sglang", "alias": "a", "model_path": "big"}
    with pytest.raises(ValueError, match="not a model directory"):
        parse_config(cfg, models_dir=models, roots=[models])


@pytest.mark.parametrize("cache_var", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_is_judged_by_its_cached_copy(
    tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch, cache_var: str
) -> None:
    """A Hub id is not a path, but the backend loads it from the HF cache, which preparation
    jobs mount read-write: a link planted in its cached copy that leads out of the roots and
    the cache is refused, at create and again at start (the same check)."""
    models, roots = tree["models"], [tree["models"]]
    home = tree["outside"].parent / "hf-home"
    cache = home / "hub" if cache_var == "HF_HOME" else home
    monkeypatch.setenv(cache_var, str(home))
    for other in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        if other != cache_var:
            monkeypatch.delenv(other, raising=False)
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text('{"model_type": "llama"}')
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to(repo / "blobs" / "abc")  # the cache's own layout
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    cfg = {"backend_type": "huggingface_causal", "alias": "a", "model_id": "org/tiny"}
    parse_config(cfg, models_dir=models, roots=roots)  # accepted
    for planted, target in (
        (snap / "tokenizer.json", tree["outside"] / "shadow"),
        (repo / "refs" / "dev", tree["outside"] / "shadow"),
    ):
        planted.symlink_to(target)
        with pytest.raises(ValueError) as err:
            parse_config(cfg, models_dir=models, roots=roots)
        message = str(err.value)
        assert "model_id" in message and os.path.relpath(planted, repo) in message, message
        assert "root:$6$" not in message
        planted.unlink()
    # The cached repository itself a link out of the cache.
    shutil.rmtree(repo)
    repo.symlink_to(tree["outside"] / "hfdir", target_is_directory=True)
    with pytest.raises(ValueError, match="model_id"):
        parse_config(cfg, models_dir=models, roots=roots)
    # A Hub id with nothing cached is left to the backend (it fetches or fails offline).
    repo.unlink()
    parse_config(cfg, models_dir=models, roots=roots)
