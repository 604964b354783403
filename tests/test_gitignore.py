"""A host run from a checkout leaves `git status` clean: .gitignore covers everything it writes
in its working directory (state files and their companions, the lock, logs, models, jobs,
the README's host.log)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.fixtures.gguf import write_tiny_gguf
from tests.fixtures.hostproc import HostProc

ROOT = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


@pytest.mark.llama
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_host_run_in_a_checkout_leaves_git_status_clean(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    git(checkout, "init", "-q")
    shutil.copy(ROOT / ".gitignore", checkout / ".gitignore")
    git(checkout, "add", ".gitignore")
    git(checkout, "commit", "-q", "-m", "the project's .gitignore")
    write_tiny_gguf(checkout / "models" / "tiny.gguf")  # the README's local-file route

    # No API_KEY: the host generates one (api_key); run twice, so that the state files get
    # their .prev copies, the second run re-adopting or restarting what the first left.
    host = HostProc(checkout, backend="llamacpp", api_key="")
    try:
        for run in range(2):
            host.start(timeout=60)
            key = (checkout / "api_key").read_text().strip()
            with httpx.Client(base_url=host.url, headers={"X-API-Key": key}, timeout=60) as c:
                if run == 0:
                    config = {"backend_type": "llamacpp", "alias": "t", "model": "tiny.gguf"}
                    r = c.post("/instances", json={"config": {**config, "ctx_size": 512}})
                    assert r.status_code == 200, r.text
                    iid = r.json()["instance"]["id"]
                    assert c.post(f"/instances/{iid}/start").status_code == 200
                    claim = {"job_id": "j", "vram_gb": 0, "ram_gb": 0.1}
                    r = c.post("/resources/reservations", json=claim)
                    assert r.status_code in (200, 201), r.text
                else:
                    assert c.post(f"/instances/{iid}/stop").status_code == 200
            host.stop()
    finally:
        host.reap()
    written = {p.name for p in checkout.iterdir()} - {".git", ".gitignore"}
    assert {"config.json", "api_key", "host.log", "logs", "models"} <= written, written
    assert git(checkout, "status", "--porcelain", "--untracked-files=all") == "", written
