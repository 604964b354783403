"""The documentation matches the code.

* docs/configuration.md is exactly what `solar_host.cli.docs_gen` produces, and every setting and
  config field in it has a description;
* the ```bash blocks marked `# example: <title> [expect <codes>]` in README.md and docs/*.md run,
  file by file (README first, then docs/ by name) and in order, in one shell as an operator
  would paste them, against a live host (scripted backend, so starting works without
  llama-server); each exits 0 and its curl calls get exactly the claimed statuses;
* every bench script is in the performance table of docs/performance.md and every script it
  names exists;
* every ```bash block of README.md and docs/*.md is run (an example here, or a step of the
  five-minute path in tests/test_five_minutes.py);
* the README stays short (the rest is in docs/), and every relative link of README.md and
  docs/*.md leads to a file that exists and, with `#anchor`, to a heading in it.
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
PERFORMANCE = ROOT / "docs" / "performance.md"
README_MAX_LINES = 250
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"^# example: (?P<title>.+?) \[expect(?P<codes>(?: \d{3})*)\]\s*$")


@dataclass
class Example:
    title: str
    codes: list[int]
    body: str


def doc_files() -> list[Path]:
    """README.md, then docs/*.md by name: the order their examples run in."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def doc_examples() -> list[Example]:
    return [ex for path in doc_files() for ex in readme_examples(path.read_text(encoding="utf-8"))]


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


def test_readme_links_the_reference_and_performance_names_only_existing_benches() -> None:
    assert "(docs/configuration.md)" in README.read_text(encoding="utf-8")
    text = PERFORMANCE.read_text(encoding="utf-8")
    named = set(re.findall(r"bench/(\w+\.py)", text))
    present = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert named <= present, (
        f"docs/performance.md names missing bench scripts: {sorted(named - present)}"
    )
    assert present <= named, (
        f"bench scripts missing from the table of docs/performance.md: {sorted(present - named)}"
    )


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): put details in docs/"
    )


def _anchors(text: str) -> set[str]:
    """GitHub's ids of a Markdown file's headings, and explicit `<a id=...>` anchors."""
    out: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    body = FENCE.sub("", text)
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", body, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_lead_to_files_and_headings() -> None:
    broken = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                if anchor not in _anchors(dest.read_text(encoding="utf-8")):
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_every_bash_block_is_run_by_a_test() -> None:
    """A ```bash block is a command an operator will paste: each one is an example this file
    runs, or a step of the README's five-minute path, which tests/test_five_minutes.py runs.
    Text that is not run (a settings file, a synopsis) goes in a plain ``` block."""
    unrun = [
        f"{path.relative_to(ROOT)}: {body.splitlines()[0] if body.strip() else '(empty)'}"
        for path in doc_files()
        for lang, body in FENCE.findall(path.read_text(encoding="utf-8"))
        if lang == "bash"
        and not body.startswith("# example:")
        and not (path == README and body.startswith("# five-minutes:"))
    ]
    assert unrun == []


def test_python_snippets_compile() -> None:
    snippets = [
        body
        for path in doc_files()
        for lang, body in FENCE.findall(path.read_text(encoding="utf-8"))
        if lang == "python"
    ]
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
async def test_doc_examples_run_against_a_live_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"{tool} is needed (.ci/apt-packages.txt)"
    examples = doc_examples()
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
            f"example '{ex.title}': got {codes.get(i)}, the docs claim {ex.codes}{report}"
        )
    assert proc.returncode == 0, report
    # The examples clean up after themselves: what they created they deleted.
    assert instances == []
