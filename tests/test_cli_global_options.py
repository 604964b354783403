"""The client options (--url, --api-key, --env-file, --json, --timeout) anywhere on the line:
`solar-host --url X status` as well as `solar-host status --url X`, as a subprocess against a
whole host on a real socket."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from solar_host.backends.registry import BackendRegistry
from tests.fixtures.host import API_KEY, free_port, host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend
from tests.test_cli import cli, model_cfg


async def test_client_options_before_or_after_the_command(tmp_path: Path) -> None:
    reg = BackendRegistry([ScriptBackend()])
    async with running_host(host_settings(tmp_path), backends=reg) as h:
        r = await h.client.post("/instances", json={"config": model_cfg(tmp_path)})
        iid = r.json()["instance"]["id"]
        env_file = tmp_path / "client.env"
        env_file.write_text(f"SOLAR_HOST_URL={h.url}\nAPI_KEY={API_KEY}\n")
        conn = ("--url", h.url, "--api-key", API_KEY)
        before, after, split, from_file, from_file_after = await asyncio.gather(
            cli(*conn, "--json", "--timeout", "20", "status", cwd=tmp_path),
            cli("status", *conn, "--json", "--timeout", "20", cwd=tmp_path),
            cli("--url", h.url, "--json", "instances", "--api-key", API_KEY, cwd=tmp_path),
            cli("--env-file", str(env_file), "--json", "instances", cwd=tmp_path),
            cli("instances", "--env-file", str(env_file), "--json", cwd=tmp_path),
        )
        for rc, out, err in (before, after):
            assert rc == 0, err
            doc = json.loads(out)
            assert doc["status"] == "healthy" and doc["url"] == h.url
        for rc, out, err in (split, from_file, from_file_after):
            assert rc == 0, err
            assert [i["id"] for i in json.loads(out)] == [iid]
        # a command with an argument of its own: the options around it
        rc, out, err = await cli(*conn, "--json", "stop", iid, cwd=tmp_path)
        assert rc == 0 and json.loads(out)["instance"]["status"] == "stopped", err

        # given twice, the later one wins (as with any option)
        dead = f"http://127.0.0.1:{free_port()}"
        rc, _, err = await cli("--url", dead, "status", "--url", h.url, "--api-key", API_KEY,
                               cwd=tmp_path)  # fmt: skip
        assert rc == 0, err
        rc, _, err = await cli("--url", h.url, "status", "--url", dead, "--api-key", API_KEY,
                               cwd=tmp_path)  # fmt: skip
        assert rc == 3 and "cannot reach" in err

        # --timeout before the command is the same timeout: a host that never answers
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        try:
            rc, _, err = await cli(
                "--timeout", "0.5", "--url", f"http://127.0.0.1:{port}", "--api-key", API_KEY,
                "status", cwd=tmp_path, timeout=30,
            )  # fmt: skip
        finally:
            silent.close()
        assert rc == 3, err
        # the default is 10 s: well under it, the 0.5 s given was used (start-up included)
        assert time.monotonic() - t0 < 8, time.monotonic() - t0


async def test_an_option_before_a_command_that_does_not_take_it_is_refused(
    tmp_path: Path,
) -> None:
    """`solar-host --url X` would serve and drop --url without a word: refused in one line."""
    for args, named in (
        (("--url", "http://127.0.0.1:1"), "--url is not an option of serve"),
        (("--json", "serve"), "--json is not an option of serve"),
        (("--api-key", "k" * 20, "doctor"), "--api-key is not an option of doctor"),
        (("--url", "u", "--timeout", "1", "restore-state"), "--url and --timeout are not"),
    ):
        rc, out, err = await cli(*args, cwd=tmp_path)
        assert rc == 2 and named in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "config.json").exists()
    # the options a local command does take, before it: doctor --json, handover --timeout
    rc, out, err = await cli("--json", "doctor", "--env-file", "/dev/null", cwd=tmp_path)
    assert rc in (0, 1) and "checks" in json.loads(out), err
    rc, out, err = await cli("--timeout", "1", "handover", cwd=tmp_path)
    assert rc == 1 and "not an option" not in err, err  # no host here to hand over
