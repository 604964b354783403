"""The documentation matches the code.

* docs/configuration.md is exactly what `solar_host.cli.docs_gen` produces, and every setting and
  config field in it has a description;
* the README's ```bash blocks marked `# example: <title> [expect <codes>]` run, in order and in
  one shell as an operator would paste them, against a live host (scripted backend, so starting
  works without llama-server); each exits 0 and its curl calls get exactly the claimed statuses;
* every bench script is in the README's performance table and every script it names exists.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.cli import docs_gen
from tests.fixtures.host import API_KEY, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"^# example: (?P<title>.+?) \[expect(?P<codes>(?: \d{3})*)\]\s*$")


@dataclass
class Example:
    title: str
    codes: list[int]
    body: str


def readme_examples(text: str) -> list[Example]:
    out = []
    for lang, body in FENCE.findall(text):
        first = body.splitlines()[0] if body.strip() else ""
        if not first.startswith("# example:"):
            continue
        assert lang == "bash", f"example block is not ```bash: {first}"
        m = MARKER.match(first)
        assert m, f"example marker must read '# example: <title> [expect 200 ...]': {first}"
        out.append(Example(m["title"], [int(c) for c in m["codes"].split()], body))
    return out


def test_configuration_reference_is_generated_from_the_code() -> None:
    current = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert current == docs_gen.render(), (
        "docs/configuration.md is out of date: run `python -m solar_host.cli.docs_gen`"
    )


def test_every_setting_and_config_field_is_described() -> None:
    assert docs_gen.missing_descriptions() == []
    text = docs_gen.render()
    from solar_host.settings import Settings

    for name in Settings.model_fields:
        assert f"| `{name.upper()}` |" in text


def test_docs_gen_check_mode(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert docs_gen.main(["--check", "--output", str(out)]) == 1
    assert docs_gen.main(["--output", str(out)]) == 0
    assert docs_gen.main(["--check", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == docs_gen.render()


def test_readme_links_the_reference_and_names_only_existing_benches() -> None:
    text = README.read_text(encoding="utf-8")
    assert "(docs/configuration.md)" in text
    named = set(re.findall(r"bench/(\w+\.py)", text))
    present = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert named <= present, f"README names missing bench scripts: {sorted(named - present)}"
    assert present <= named, f"bench scripts missing from README: {sorted(present - named)}"


def test_readme_python_snippets_compile() -> None:
    text = README.read_text(encoding="utf-8")
    snippets = [body for lang, body in FENCE.findall(text) if lang == "python"]
    assert snippets
    for body in snippets:
        ast.parse(body)


def _script(examples: list[Example]) -> str:
    # Each curl also reports its status on stderr; stdout stays what the reader sees (pipes
    # into jq keep working).
    lines = [
        "set -euo pipefail",
        "curl() { command curl -w '%{stderr}@@HTTP %{http_code}\\n' \"$@\"; }",
    ]
    for i, ex in enumerate(examples):
        lines += [f"echo '@@BLOCK {i}' >&2", ex.body.rstrip("\n"), f"echo '@@DONE {i}' >&2"]
    return "\n".join(lines) + "\n"


def _codes_by_block(stderr: str) -> tuple[dict[int, list[int]], set[int]]:
    codes: dict[int, list[int]] = {}
    done: set[int] = set()
    block = -1
    for line in stderr.splitlines():
        if line.startswith("@@BLOCK "):
            block = int(line.split()[1])
            codes[block] = []
        elif line.startswith("@@DONE "):
            done.add(int(line.split()[1]))
        elif line.startswith("@@HTTP "):
            codes.setdefault(block, []).append(int(line.split()[1]))
    return codes, done


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
async def test_readme_examples_run_against_a_live_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"{tool} is needed (.ci/apt-packages.txt)"
    examples = readme_examples(README.read_text(encoding="utf-8"))
    assert len(examples) >= 8
    model = tmp_path / "models" / "tiny.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    # "Docker missing" is one of the examples: make sure no daemon is reachable for this host.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    settings = host_settings(tmp_path, max_retries=0)
    async with running_host(settings, backends=BackendRegistry([ScriptBackend()])) as h:
        env = {
            **os.environ,
            "SOLAR_HOST_URL": h.url,
            "API_KEY": API_KEY,
            "MODEL": str(model),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            _script(examples),
            cwd=tmp_path,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        instances = (await h.client.get("/instances")).json()
    stdout, stderr = out.decode(), err.decode()
    codes, done = _codes_by_block(stderr)
    report = f"\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    for i, ex in enumerate(examples):
        assert i in done, f"example '{ex.title}' did not finish{report}"
        assert codes.get(i) == ex.codes, (
            f"example '{ex.title}': got {codes.get(i)}, README claims {ex.codes}{report}"
        )
    assert proc.returncode == 0, report
    # The examples clean up after themselves: what they created they deleted.
    assert instances == []
