"""Backends read only the model roots, their runtime and the system (Landlock): a link
re-pointed out of the roots after the start's check is not followed, nor is anything else of
the machine's read (the host's state, /etc/shadow); `required` refuses to start unconfined."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.backends.registry import BackendRegistry
from solar_host.instances import confinement, relays
from tests.fixtures.host import host_settings, running_host
from tests.fixtures.script_backend import ScriptBackend, script_config

needs_landlock = pytest.mark.skipif(
    confinement.abi_version() < 1, reason="this kernel has no Landlock"
)


def _registry() -> BackendRegistry:
    return BackendRegistry([ScriptBackend()])


@pytest.fixture
def bait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A secret outside every tree a backend may read. Backends get the host's TMPDIR, which
    they may read and write; it is moved off /tmp, where pytest keeps the secret."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("the machine's secret\n")
    return {"outside": outside, "secret": outside / "secret", "scratch": scratch}


async def _started(client: httpx.AsyncClient, cfg: dict[str, Any]) -> tuple[str, int]:
    """Create and start an instance of `cfg`: its id and port."""
    iid = (await client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
    r = await client.post(f"/instances/{iid}/start")
    assert r.status_code == 200, r.text
    return iid, r.json()["instance"]["port"]


async def _confined(tmp_path: Path, argv: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run `argv` as the supervisor runs a backend (the policy it builds, `required`), in
    `cwd`, until it exits: its output. The log lives in a directory it may not write."""
    from solar_host.instances import process as procs

    policy = confinement.access_policy(roots=[tmp_path / "models"], argv=argv, env=env)
    log = tmp_path / "logs" / "backend.log"
    proc = procs.spawn(argv, env, log, cwd, policy, "required")
    assert await procs.wait_exit(proc, timeout=30)
    assert proc.relay is not None
    await relays.drained(proc.relay)  # its log relay has written all it said
    return log.read_text()


async def _reads(port: int, *paths: Path) -> list[str]:
    async with httpx.AsyncClient(timeout=10) as c:
        out = []
        for path in paths:
            r = await c.get(f"http://127.0.0.1:{port}/read", params={"path": str(path)})
            out.append(r.json()["read"])
        return out


@needs_landlock
@pytest.mark.parametrize("mode", ["auto", "off"])
async def test_a_link_repointed_after_the_check_is_not_followed(
    tmp_path: Path, bait: dict[str, Path], mode: str
) -> None:
    cfg: dict[str, Any] = script_config(tmp_path)
    models = tmp_path / "models"
    (models / "notes.txt").write_text("inside\n")
    link = models / "data"
    link.symlink_to(models / "notes.txt")  # inside the roots when the start checks
    s = host_settings(tmp_path, backend_read_confinement=mode)
    async with running_host(s, backends=_registry()) as h:
        iid, port = await _started(h.client, cfg)
        link.unlink()
        link.symlink_to(bait["secret"])  # re-pointed once the backend runs
        scratch_file = bait["scratch"] / "own"
        scratch_file.write_text("x")
        inside, flipped, secret, state, shadow, scratch = await _reads(
            port,
            models / "notes.txt",
            link,
            bait["secret"],
            tmp_path / "config.json",
            Path("/etc/shadow"),
            scratch_file,
        )
        assert (inside, scratch) == ("ok", "ok")
        if mode == "auto":
            assert (flipped, secret, state, shadow) == ("EACCES",) * 4
        else:  # unconfined, as before: the test above is not passing by accident
            assert (flipped, secret, state) == ("ok",) * 3
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200


async def test_required_refuses_a_backend_it_cannot_confine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(confinement, "abi_version", lambda: 0)  # a kernel without Landlock
    cfg = script_config(tmp_path)
    s = host_settings(tmp_path, backend_read_confinement="required")
    async with running_host(s, backends=_registry()) as h:
        iid = (await h.client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
        r = await h.client.post(f"/instances/{iid}/start")
        assert r.status_code >= 400 and "BACKEND_READ_CONFINEMENT" in r.text, r.text
        view = (await h.client.get(f"/instances/{iid}")).json()
        assert view["status"] == "failed" and view["pid"] is None, view
        assert view["retry_count"] == 1  # not retried: it cannot pass a second time
    # `auto` on that kernel starts it unconfined (and says so in the log).
    async with running_host(
        host_settings(tmp_path / "b", backend_read_confinement="auto"), backends=_registry()
    ) as h:
        cfg = script_config(tmp_path / "b")
        iid = (await h.client.post("/instances", json={"config": cfg})).json()["instance"]["id"]
        assert (await h.client.post(f"/instances/{iid}/start")).status_code == 200
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200


def test_the_read_policy_never_widens_to_the_whole_machine(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    program = home / "bin" / "llama-server"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    build = tmp_path / "llama.cpp" / "build"
    (build / "bin").mkdir(parents=True)
    (build / "bin" / "llama-server").write_text("")
    env = {"HOME": str(home), "PATH": "/usr/bin", "PYTHONPATH": os.pathsep + "/"}
    key = tmp_path / "keys" / "sglang.key"
    policy = confinement.access_policy(
        roots=[tmp_path / "models"], argv=[str(program)], env=env, private_files=[str(key)]
    )
    assert "/" not in policy.trees and "/etc" not in policy.trees
    assert str(home) not in policy.trees  # a program in ~/bin allows ~/bin, not the home
    assert str(home / "bin") in policy.trees
    # Caches and temporary files are written (and read); nothing else of the home is.
    assert str(home / ".cache") in policy.writable and "/tmp" in policy.writable
    models = str(tmp_path / "models")
    assert not any(w == str(home) or w.startswith(models) for w in policy.writable)
    assert str(tmp_path / "models") in policy.trees and policy.files == (str(key),)
    built = confinement.access_policy(roots=[], argv=[str(build / "bin" / "llama-server")], env=env)
    assert str(build) in built.trees  # its shared libraries live beside bin/


@needs_landlock
async def test_a_confined_backend_can_move_files_into_place(tmp_path: Path) -> None:
    """Caches write a file in a temporary directory and rename it into place (triton does): a
    ruleset that does not handle Landlock's REFER right made every such move EXDEV. Moving a
    file out of a tree the backend may not read, into one it may, stays refused."""
    scratch, outside = tmp_path / "scratch", tmp_path / "outside"
    (scratch / "tmp").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("s")
    code = (
        "import os\n"
        "open('tmp/f', 'w').write('x')\n"
        "os.replace('tmp/f', 'f')\n"
        "print('moved', open('f').read())\n"
        "try:\n"
        f"    os.link({str(outside / 'secret')!r}, 'stolen')\n"
        "    print('linked')\n"
        "except OSError as err:\n"
        "    print('link refused', err.errno)\n"
    )
    env = {**os.environ, "TMPDIR": str(scratch)}
    argv = [sys.executable, "-c", code]
    out = await _confined(tmp_path, argv, env, scratch)
    assert "moved x" in out and "link refused" in out, out
    assert not (scratch / "stolen").exists()


@needs_landlock
@pytest.mark.parametrize("lc_ctype", [None, "en_US.UTF-8"])
async def test_a_confined_backend_keeps_the_locale_it_was_given(
    tmp_path: Path, lc_ctype: str | None
) -> None:
    """The launcher is a Python started in the backend's environment: in the C locale it set
    LC_CTYPE=C.UTF-8 there (PEP 538) and handed that on to the backend, which then ran in
    another locale than it would unconfined."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("LC_ALL", "LC_CTYPE", "LANG", "LANGUAGE")
    }
    env["TMPDIR"] = str(scratch)
    if lc_ctype is not None:
        env["LC_CTYPE"] = lc_ctype
    argv = ["/bin/sh", "-c", 'echo "LC_CTYPE=[${LC_CTYPE-unset}]"']
    out = await _confined(tmp_path, argv, env, scratch)
    assert f"LC_CTYPE=[{lc_ctype or 'unset'}]" in out


@needs_landlock
@pytest.mark.parametrize("writes", [True, False])
async def test_a_confined_backend_writes_only_its_caches(
    tmp_path: Path, bait: dict[str, Path], monkeypatch: pytest.MonkeyPatch, writes: bool
) -> None:
    """Until BACKEND_WRITE_CONFINEMENT a backend could write anywhere the host user can: a
    backend taken over through a crafted model file could rewrite the host's config.json, a
    model another instance serves, or the user's shell profile. Now it writes its caches,
    TMPDIR and devices only."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# the user's\n")
    if not writes:  # unconfined, the backend makes these itself (confined, the host does)
        (home / ".cache").mkdir()
        (home / ".triton").mkdir()
    monkeypatch.setenv("HOME", str(home))
    cfg: dict[str, Any] = script_config(tmp_path)
    models = tmp_path / "models"
    (models / "weights.bin").write_bytes(b"w")
    s = host_settings(tmp_path, backend_write_confinement=writes)
    async with running_host(s, backends=_registry()) as h:
        iid, port = await _started(h.client, cfg)
        allowed = [
            bait["scratch"] / "tmpfile",  # TMPDIR
            home / ".cache" / "kernels.bin",
            home / ".triton" / "cache.json",  # made by the host: the backend could not
            Path("/dev/null"),
        ]
        refused = [
            tmp_path / "config.json",  # the host's state
            models / "weights.bin",  # a model
            models / "planted.gguf",
            home / ".bashrc",
            bait["secret"],
            Path(f"{models}/newdir/"),
        ]
        async with httpx.AsyncClient(timeout=10) as c:
            out = []
            for path in allowed + refused:
                resp = await c.get(f"http://127.0.0.1:{port}/write", params={"path": str(path)})
                out.append(resp.json()["wrote"])
        assert (await h.client.post(f"/instances/{iid}/stop")).status_code == 200
    assert out[: len(allowed)] == ["ok"] * len(allowed)
    if writes:
        assert out[len(allowed) :] == ["EACCES"] * len(refused)
        assert (home / ".bashrc").read_text() == "# the user's\n"
        assert (models / "weights.bin").read_bytes() == b"w"
    else:  # as before: the assertions above are not passing by accident
        assert out[len(allowed) :] == ["ok"] * len(refused)


@needs_landlock
def test_a_cache_link_that_leads_out_of_the_writable_trees_is_not_allowed(tmp_path: Path) -> None:
    """A backend may write ~/.cache, where the HF hub cache (an allowed tree of its own) lives:
    it could replace ~/.cache/huggingface with a link to ~/.ssh, and every backend started
    after it (under this host or the next: backends outlive the host) would have been allowed
    ~/.ssh. An operator whose cache is a link to another disk names that disk in
    BACKEND_WRITE_PATHS (the policy's anchors)."""
    disk, ssh = tmp_path / "disk" / "hf", tmp_path / "ssh"
    disk.mkdir(parents=True)
    ssh.mkdir()
    cache = tmp_path / "home" / ".cache"
    cache.mkdir(parents=True)
    link = cache / "huggingface"
    link.symlink_to(ssh)
    planted = confinement.AccessPolicy((), (), (str(cache), str(link)), True)
    built = confinement.Ruleset.build(planted)
    built.close()
    assert built.skipped == [str(link)]  # refused the first time this host looks
    # Nor does the host make the caches that do not exist yet through such a link.
    hub = confinement.AccessPolicy((), (), (str(cache), str(link / "hub")), True)
    confinement.prepare_writable(hub)
    assert not (ssh / "hub").exists()
    link.unlink()
    link.symlink_to(disk)
    listed = confinement.AccessPolicy((), (), (str(cache), str(link)), True, anchors=(str(disk),))
    built = confinement.Ruleset.build(listed)
    built.close()
    assert built.skipped == []  # the operator's own, listed
    link.unlink()
    (cache / "huggingface").mkdir()  # a plain directory in the cache leads nowhere else
    built = confinement.Ruleset.build(planted)
    built.close()
    assert built.skipped == []
    # A link in no writable tree only the operator can re-point (a model root moved to a new
    # disk): it is followed wherever it leads.
    moved = tmp_path / "models"
    moved.symlink_to(ssh)
    roots = confinement.AccessPolicy((str(moved),), (), (str(cache),), True)
    built = confinement.Ruleset.build(roots)
    built.close()
    assert built.skipped == []


def test_no_cache_variable_makes_a_model_root_writable(tmp_path: Path) -> None:
    """An instance config's extra_env may name paths inside the model roots (the roots check
    allows that): TORCH_HOME=<MODELS_DIR> made every model writable by that backend."""
    models = tmp_path / "models"
    (models / "cache").mkdir(parents=True)
    env = {
        "HOME": str(tmp_path / "home"),
        "TMPDIR": str(tmp_path / "scratch"),
        "TORCH_HOME": str(models),
        "TRITON_CACHE_DIR": str(models / "cache"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }
    policy = confinement.access_policy(roots=[models], argv=[], env=env)
    assert str(tmp_path / "xdg") in policy.writable
    assert not any(w.startswith(str(models)) for w in policy.writable), policy.writable
    assert str(models) in policy.trees  # still read


def test_relative_paths_in_a_backends_environment_grant_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRITON_CACHE_DIR="." (an SGLang config's extra_env) was opened by the host against its
    own working directory, the state directory under systemd: the backend could read the
    host's keys and config.json and write beside them."""
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.chdir(state)
    env = {
        "HOME": "home",
        "TMPDIR": ".",
        "TRITON_CACHE_DIR": ".",
        "HF_HOME": "hf",
        "PYTHONPATH": ".:lib",
    }
    policy = confinement.access_policy(roots=[tmp_path / "models"], argv=[], env=env)
    granted = set(policy.trees) | set(policy.writable)
    assert not any(p == str(state) or p.startswith(str(state) + os.sep) for p in granted)


def test_hub_caches_named_with_tilde_or_a_variable_are_writable_where_the_hub_opens_them(
    tmp_path: Path,
) -> None:
    """`HF_HOME=~/hf` and `$HOME/hf` are documented forms, and huggingface_hub expands them:
    the backend writes there, so that is what is granted. Variables their programs read
    literally (Triton's) are judged literally: "~/tc" is no path under HOME to them."""
    home = tmp_path / "home"
    env = {
        "HOME": str(home),
        "HF_HOME": "~/hf",
        "HF_HUB_CACHE": "$HOME/hub-cache",
        "HUGGINGFACE_HUB_CACHE": "${HOME}/legacy",
        "TRITON_CACHE_DIR": "~/tc",
    }
    policy = confinement.access_policy(roots=[tmp_path / "models"], argv=[], env=env)
    for granted in ("hf", "hub-cache", "legacy"):
        assert str(home / granted) in policy.writable, granted
    assert str(home / "tc") not in policy.writable
    assert "~/tc" not in policy.writable


def test_only_the_devices_runtimes_use_are_allowed(tmp_path: Path) -> None:
    """All of /dev was readable and writable: a backend of a host run as root could read and
    write every disk raw (/dev/sda), and so every file. Now: shared memory, the null and random
    devices, terminals, GPUs and RDMA."""
    policy = confinement.access_policy(roots=[], argv=[], env={"HOME": str(tmp_path)})
    allowed = set(policy.trees) | set(policy.writable)
    assert "/dev" not in allowed
    assert {"/dev/shm", "/dev/null", "/dev/urandom", "/dev/dri"} <= set(policy.writable)
    assert not any(p.startswith(("/dev/sd", "/dev/nvme", "/dev/loop", "/dev/vd")) for p in allowed)


@needs_landlock
async def test_a_confined_backend_writes_its_log_by_path_and_makes_no_device(
    tmp_path: Path,
) -> None:
    """`echo x > /dev/stderr` reopens the backend's output through /proc/self/fd: its pipe to
    its log relay (the log file itself it may not write, so nothing passes the relay's
    bound). Device nodes are never
    made, even by root in TMPDIR (a node for a disk would be raw access to every file)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    script = (
        "echo to-stderr >> /dev/stderr && echo stderr-ok; "
        f"mknod {scratch}/disk b 7 0 2>/dev/null && echo made-a-device || echo no-device; "
        f"mkfifo {scratch}/fifo && echo fifo-ok"
    )
    argv = ["/bin/sh", "-c", script]
    out = await _confined(tmp_path, argv, env, scratch)
    assert "to-stderr" in out and "stderr-ok" in out, out
    assert "no-device" in out and "fifo-ok" in out, out


@needs_landlock
@pytest.mark.skipif(os.geteuid() != 0, reason="as any other user the kernel refuses anyway")
async def test_a_root_backend_cannot_read_the_hosts_environment(tmp_path: Path) -> None:
    """Run as root, a confined backend read /proc/<host pid>/environ (HF_TOKEN, API_KEY, the
    control key: what the host keeps from backends): CAP_SYS_PTRACE took it past Landlock's
    ptrace check. The launcher drops that and the other capabilities that step around the
    ruleset."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    code = (
        "import os\n"
        "try:\n"
        f"    open('/proc/{os.getpid()}/environ', 'rb').read()\n"
        "    print('read the host environment')\n"
        "except OSError as err:\n"
        "    print('refused', err.errno)\n"
        "print('CapBnd', [l for l in open('/proc/self/status') if l.startswith('CapBnd')])\n"
    )
    argv = [sys.executable, "-c", code]
    out = await _confined(tmp_path, argv, env, scratch)
    assert "refused" in out and "read the host" not in out, out


@needs_landlock
async def test_a_checkout_that_is_the_state_directory_gives_backends_its_code_only(
    tmp_path: Path,
) -> None:
    """Installed from a checkout (pip install -e .) and run in it, the host's state directory
    is a tree on its import path: backends read the code in it, never its .env, config.json,
    API key, logs, jobs or backend keys (an HF backend with trust_remote_code read them all)."""
    checkout = tmp_path / "checkout"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "__init__.py").write_text("VALUE = 'code'\n")
    (checkout / "tool.py").write_text("X = 1\n")
    (checkout / "config_helpers.py").write_text("Y = 2\n")  # named like the state, but code
    secrets = {
        ".env": "API_KEY=the-host-key\n",
        "config.json": '{"instances": []}\n',
        "config.json.prev": "{}\n",
        "config.json.host-id": "h\n",
        ".config.json.x1y2.tmp": "{}\n",
        "api_key": "the-host-key\n",
        "reservations.json": "{}\n",
        "memory-measurements.json": "{}\n",
        "logs/host.log": "a prompt\n",
        "jobs/store.json": "{}\n",
        "backend-keys/other": "k\n",
    }
    for name, text in secrets.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    state = confinement.HostState(
        checkout / "config.json", checkout / "logs", checkout / "jobs", checkout / ".env"
    )
    probe = (
        "import pathlib, pkg, tool, config_helpers\n"
        "print('import', pkg.VALUE, tool.X, config_helpers.Y)\n"
        f"for name in {sorted(secrets)!r}:\n"
        f"    p = pathlib.Path({str(checkout)!r}) / name\n"
        "    try:\n"
        "        p.read_text(); print('READ', name)\n"
        "    except PermissionError:\n"
        "        print('denied', name)\n"
    )
    argv = [sys.executable, "-c", probe]
    (tmp_path / "scratch").mkdir()
    # TMPDIR off /tmp, where the checkout is: backends may write (and read) their TMPDIR.
    env = {**os.environ, "PYTHONPATH": str(checkout), "TMPDIR": str(tmp_path / "scratch")}
    (tmp_path / "models").mkdir()
    policy = confinement.access_policy(
        roots=[tmp_path / "models"], argv=argv, env=env, host_state=state
    )
    assert str(checkout) in policy.listable and str(checkout) not in policy.trees
    from solar_host.instances import process as procs

    log = tmp_path / "out" / "backend.log"
    proc = procs.spawn(argv, env, log, tmp_path, policy, "required")
    assert await procs.wait_exit(proc, timeout=30)
    assert proc.relay is not None
    await relays.drained(proc.relay)
    out = log.read_text()
    assert "import code 1 2" in out, out
    assert "READ" not in out, out
    assert out.count("denied") == len(secrets), out
