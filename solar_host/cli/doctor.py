"""`solar-host doctor`: what this machine can run, and what to fix before it joins a fleet.

It reads the same settings the host would (.env, the environment), changes nothing (no
directory created, no key generated) and prints one line per check with the fix under each
failing one. Optional parts this configuration does not use (Docker, which only jobs need; a
solar-control URL, without which the host runs standalone) are skipped, with why. Exit 0 when
every check that this configuration needs passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from solar_host.settings import PLACEHOLDER_API_KEYS, Settings, unexpanded_paths

MIN_KEY_LENGTH = 16


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    # Passed, but with something to fix (shown as [warn]; the exit status stays 0).
    warning: bool = False
    # Not checked: an optional part this configuration does not use (`detail` says why).
    skipped: bool = False


# --- the checks (each pure apart from the probe it names) ------------------------------


def check_backends(settings: Settings, probe: Any) -> tuple[Check, dict[str, Any]]:
    """The availability table (as GET / shows it) and whether any backend can run."""
    import importlib.util

    from solar_host.backends.base import HostFacts
    from solar_host.backends.registry import BackendRegistry

    facts = HostFacts(
        gpu_type=probe.gpu_type(),
        llama_server_bin=settings.llama_server_bin,
        sglang_venv_path=settings.sglang_venv_path,
        hf_available=all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    )
    table = BackendRegistry.default().availability(facts)
    usable = [bt for bt, a in table.items() if a.available]
    check = Check(
        "backends",
        bool(usable),
        f"can run: {', '.join(usable)}" if usable else "no backend can run on this host",
        ""
        if usable
        else "pip install '.[llamacpp]' in the solar-host checkout (or see the reasons above)",
    )
    return check, {bt: a.as_dict() for bt, a in table.items()}


def _key(settings: Settings) -> tuple[str, str]:
    """(the host key, where it comes from) as the host would resolve it, without creating one."""
    if settings.api_key:
        return settings.api_key, "API_KEY"
    try:
        return settings.api_key_file.read_text(encoding="utf-8").strip(), str(settings.api_key_file)
    except OSError:
        return "", ""


def _env_file_exposes_key(env_file: str | Path | None) -> str | None:
    """`env_file` when it holds an API_KEY and group or others may read it; else None."""
    from solar_host.platform.envfile import EnvFileError, read_env_file

    if env_file is None:
        return None
    try:
        mode = os.stat(env_file).st_mode
        values = read_env_file(env_file, required=True)
    except (OSError, EnvFileError):
        return None
    holds_key = any(k.upper() == "API_KEY" and v.strip() for k, v in values.items())
    if not holds_key or not mode & 0o044:
        return None
    return f"{Path(env_file).absolute()} (mode {mode & 0o777:04o})"


def check_api_key(settings: Settings, env_file: str | Path | None = None) -> Check:
    key, where = _key(settings)
    if not key:
        # Nothing to fix: a host without a key makes one at its first start.
        return Check(
            "api key",
            True,
            f"none yet: the host generates one into {settings.api_key_file.absolute()} at its "
            "first start (or set API_KEY in .env)",
        )
    if key.lower() in PLACEHOLDER_API_KEYS:
        return Check("api key", False, f"{where} is a documentation placeholder", "set a secret")
    if len(key) < MIN_KEY_LENGTH:
        return Check(
            "api key",
            False,
            f"{where} has {len(key)} characters",
            f"use at least {MIN_KEY_LENGTH} random characters, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))'",
        )
    detail = f"set ({where}, {len(key)} characters)"
    exposed = _env_file_exposes_key(env_file)
    if exposed is not None:
        return Check(
            "api key",
            True,
            f"{detail}, but the env file holding it is readable by other users: {exposed}",
            f"chmod 600 {Path(env_file).absolute()}" if env_file is not None else "",
            warning=True,
        )
    return Check("api key", True, detail)


def check_port(settings: Settings, key: str, timeout: float = 3.0) -> Check:
    """PORT is free for the host, or a solar-host already serves there and accepts the key."""
    import socket

    import httpx

    addr = "127.0.0.1" if settings.host in ("0.0.0.0", "", "::") else settings.host
    try:
        with socket.create_connection((addr, settings.port), timeout=timeout):
            pass
    except OSError:
        return Check("port", True, f"{settings.port} is free for the REST API")
    # An IPv6 address goes in brackets in a URL (HOST=::1).
    url = f"http://{f'[{addr}]' if ':' in addr else addr}:{settings.port}"
    try:
        root = httpx.get(url + "/", timeout=timeout).json()
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, RecursionError):
        root = None
    if not isinstance(root, dict) or root.get("service") != "solar-host":
        return Check(
            "port",
            False,
            f"{settings.port} is taken by another program",
            "stop it, or set PORT to a free port",
        )
    try:
        status = httpx.get(url + "/instances", headers={"X-API-Key": key}, timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
        return Check("port", False, f"the solar-host on {settings.port} does not answer: {err}")
    if status.status_code == 401:
        return Check(
            "port",
            False,
            f"a solar-host serves on {settings.port} but refuses this API key",
            "use the key it was started with (API_KEY, or the key file beside its CONFIG_FILE)",
        )
    return Check("port", True, f"a solar-host {root.get('version')} serves on {settings.port}")


# Ports above START_PORT that a host's instances usually take (one each).
INSTANCE_PORTS_SPAN = 100


def check_backend_ports(settings: Settings, ephemeral: tuple[int, int] | None = None) -> Check:
    """START_PORT and the ports above it stay clear of the kernel's range for outgoing
    connections: there, a client socket may take an instance's port while its backend
    restarts, and the instance comes back on another port (a saved URL then misses it)."""
    from solar_host.instances.ports import ephemeral_port_range

    low, high = ephemeral if ephemeral is not None else ephemeral_port_range()
    first, last = settings.start_port, settings.start_port + INSTANCE_PORTS_SPAN - 1
    if last < low or first > high:
        return Check("backend ports", True, f"from {first}, outside {low}-{high} (outgoing)")
    return Check(
        "backend ports",
        True,
        f"START_PORT {first} is within {INSTANCE_PORTS_SPAN} of the kernel's ports for outgoing "
        f"connections ({low}-{high}): an instance may lose its port to one while it restarts",
        f"set START_PORT below {max(low - INSTANCE_PORTS_SPAN, 1)} (the default is 3500)",
        warning=True,
    )


def _writable(path: Path) -> tuple[bool, str]:
    """Whether `path` is (or can be created as) a writable directory; what was found."""
    p = path.absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        return False, f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return False, f"{probe} is not writable by uid {os.getuid()}"
    return True, str(p) if probe == p else f"{p} (will be created in {probe})"


def check_directories(settings: Settings) -> list[Check]:
    unexpanded = dict(unexpanded_paths(settings))
    out = []
    for setting, path in (
        ("CONFIG_FILE", settings.config_file.absolute().parent),
        ("LOG_DIR", settings.log_dir),
        ("MODELS_DIR", settings.models_dir),
        ("JOBS_DIR", settings.jobs_dir),
    ):
        label = "config dir" if setting == "CONFIG_FILE" else setting.lower()
        if setting in unexpanded:
            # MODELS_DIR=~/models: a directory named `~` in the working directory.
            out.append(
                Check(
                    f"{label} writable",
                    False,
                    f"{setting}={unexpanded[setting]} is taken as written (the env file does "
                    f"no ~ or $ expansion): it means {path.absolute()}",
                    f"write the full path, e.g. {setting}={Path.home() / 'models'}"
                    if setting == "MODELS_DIR"
                    else f"write {setting} as a full path (/srv/solar-host/...)",
                )
            )
            continue
        ok, detail = _writable(path)
        fix = "" if ok else f"make it writable (chown/chmod) or point {setting} elsewhere"
        out.append(Check(f"{label} writable", ok, detail, fix))
    return out


def check_disk(settings: Settings, probe: Any) -> Check:
    usage = probe.disk(settings.models_dir)
    if usage is None:
        return Check("disk", False, f"cannot stat {settings.models_dir}", "check MODELS_DIR")
    free_gib = usage.available_bytes / 1024**3
    need = settings.min_free_disk_gb
    detail = f"{free_gib:.1f} GiB free for MODELS_DIR (floor MIN_FREE_DISK_GB={need:g})"
    if free_gib < need:
        return Check("disk", False, detail, "free space, or move MODELS_DIR to a larger disk")
    return Check("disk", True, detail)


def check_gpu(probe: Any) -> Check:
    try:
        kind = probe.gpu_type()
        gpus = probe.gpus()
    except Exception as err:  # a broken driver must show here, not crash the doctor
        return Check("gpu", False, f"probe failed: {err}", "check the NVIDIA driver (nvidia-smi)")
    if gpus:
        names = ", ".join(f"{g.index}: {g.name} {g.total_bytes / 1024**3:.0f} GiB" for g in gpus)
        return Check("gpu", True, f"{kind}: {names}")
    if kind == "cpu" and Path("/dev/nvidiactl").exists():
        return Check(
            "gpu",
            False,
            "an NVIDIA device is present but NVML sees none",
            "pip install '.[nvidia]' in the solar-host checkout and check the driver (nvidia-smi)",
        )
    return Check("gpu", True, f"{kind} (no GPU: llama.cpp runs on the CPU)")


def state_backends_may_write(settings: Settings) -> list[tuple[str, str]]:
    """(directory, writable tree) for each of the host's state, log and job directories that
    lies in a tree confined backends may still write (a CONFIG_FILE under /tmp, say)."""
    from solar_host.instances import confinement

    policy = confinement.access_policy(
        roots=[], argv=[], env=os.environ, extra_writes=settings.backend_extra_write_dirs
    )
    trees = [(os.path.realpath(tree), tree) for tree in policy.writable]
    found = []
    for path in (settings.config_file.parent, settings.log_dir, settings.jobs_dir):
        real = os.path.realpath(path)
        tree = next((given for top, given in trees if confinement.inside(real, top)), None)
        if tree is not None:
            found.append((real, tree))
    return found


def hard_linked_code() -> tuple[str, int] | None:
    """A file of solar-host's own package with more than one name, and its count of names;
    None when there is none. uv installs packages as hard links to its cache (~/.cache/uv) by
    default: writing the cache copy, which confined backends may, changes the host's code."""
    import solar_host

    package = Path(solar_host.__file__).parent
    for name in ("__init__.py", "main.py", "settings/schema.py", "instances/confinement.py"):
        path = package / name
        try:
            names = path.stat().st_nlink
        except OSError:
            continue
        if names > 1:
            return str(path), names
    return None


def check_confinement(settings: Settings, abi: int | None = None) -> Check:
    """Whether backends will be confined to reading the model roots (Landlock)."""
    from solar_host.instances import confinement

    mode = settings.backend_read_confinement
    if mode == "off":
        return Check("read confinement", True, "off (BACKEND_READ_CONFINEMENT=off)")
    version = confinement.abi_version() if abi is None else abi
    if version >= 2 or (version == 1 and mode == "required"):
        writes = (
            "write only their caches, TMPDIR and the devices they use"
            if settings.backend_write_confinement
            else "write anywhere (BACKEND_WRITE_CONFINEMENT=false)"
        )
        linked = hard_linked_code() if settings.backend_write_confinement else None
        if linked is not None:
            return Check(
                "write confinement",
                False,
                f"solar-host's code is hard-linked ({linked[0]} has {linked[1]} names): a copy "
                "in a package cache backends may write (uv's, in ~/.cache) is the same file",
                "reinstall with copies: UV_LINK_MODE=copy (uv), or pip",
            )
        exposed = state_backends_may_write(settings) if settings.backend_write_confinement else []
        if exposed:
            # A warning: the host runs (a checkout tried out under /tmp, say), only the
            # confinement does not cover its own files.
            what = "; ".join(f"{path} lies in {tree}" for path, tree in exposed)
            return Check(
                "write confinement",
                True,
                f"backends may write the host's own files: {what}",
                "keep CONFIG_FILE, LOG_DIR and JOBS_DIR out of TMPDIR (else /tmp) and the "
                "caches backends write, or point TMPDIR elsewhere",
                warning=True,
            )
        return Check(
            "read confinement",
            True,
            f"Landlock ABI {version}: backends read only the model roots, caches and runtime, "
            f"and {writes}",
        )
    detail = "this kernel has no Landlock" if version < 1 else "Landlock ABI 1 only"
    fix = "Linux 5.19+ with landlock in its LSM list (lsm= boot parameter)"
    if mode == "required":
        return Check("read confinement", False, f"{detail}; backends will not start", fix)
    return Check("read confinement", True, f"{detail}; backends start unconfined ({fix})")


def check_docker(
    connect: Callable[[], Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    default_socket: str | None = None,
) -> Check:
    """Jobs run in Docker: the daemon must answer a ping where Docker is configured
    (DOCKER_HOST) or installed (its socket is there); elsewhere jobs are simply not offered."""
    from solar_host.jobs.docker import DEFAULT_SOCKET

    configured = bool((os.environ if environ is None else environ).get("DOCKER_HOST"))
    sock = DEFAULT_SOCKET if default_socket is None else default_socket
    if not configured and not os.path.exists(sock):
        return Check(
            "docker",
            True,
            f"no Docker (DOCKER_HOST is unset and {sock} is missing); only jobs need it",
            skipped=True,
        )
    try:
        if connect is None:
            from solar_host.jobs.docker import DockerJobs

            connect = DockerJobs.connect
        client = connect()
        try:
            client.ping()
        finally:
            close = getattr(client, "close", None)
            if close:
                close()
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        # DOCKER_HOST says jobs are meant to run: a failure. A socket nobody pointed the host
        # at (Docker installed for something else) is a warning.
        return Check(
            "docker",
            not configured,
            f"daemon not reachable: {reason}" + ("" if configured else "; only jobs need it"),
            "start dockerd (systemctl start docker), set DOCKER_HOST, or add this user to the "
            "docker group; only jobs need it",
            warning=not configured,
        )
    return Check("docker", True, "daemon answers")


def check_control(settings: Settings, timeout: float = 5.0) -> Check:
    urls = settings.control_urls
    if not urls:
        return Check(
            "control url",
            True,
            "SOLAR_CONTROL_URL is not set, so the host runs standalone (set it to "
            "solar-control's URL to join a fleet)",
            skipped=True,
        )
    import httpx

    bad = []
    for url in urls:
        try:
            # The Engine.IO handshake path answers any client: reachability, not auth.
            r = httpx.get(
                url.rstrip("/") + "/socket.io/?EIO=4&transport=polling",
                timeout=timeout,
                verify=not settings.insecure,
            )
            if r.status_code >= 500:
                bad.append(f"{url} answered {r.status_code}")
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as err:
            # InvalidURL (a bad port, an unclosed IPv6 bracket) is not an HTTPError.
            bad.append(f"{url}: {type(err).__name__}: {err}")
    if bad:
        return Check(
            "control url",
            False,
            "; ".join(bad),
            "check SOLAR_CONTROL_URL, the network path and TLS (INSECURE=true for a "
            "self-signed test setup)",
        )
    return Check("control url", True, ", ".join(urls) + " reachable")


# --- running them ----------------------------------------------------------------------


def diagnose(
    settings: Settings,
    *,
    probe: Any = None,
    docker_connect: Callable[[], Any] | None = None,
    env_file: str | Path | None = None,
) -> tuple[dict[str, Any], list[Check]]:
    """(backend availability table, checks) for `settings` (read from `env_file`, if any)."""
    if probe is None:
        from solar_host.resources.probes import LiveProbe

        probe = LiveProbe()
    backends_check, table = check_backends(settings, probe)
    checks = [
        backends_check,
        check_api_key(settings, env_file),
        check_port(settings, _key(settings)[0]),
        check_backend_ports(settings),
        *check_directories(settings),
        check_disk(settings, probe),
        check_gpu(probe),
        check_confinement(settings),
        check_docker(docker_connect),
        check_control(settings),
    ]
    return table, checks


def render(table: dict[str, Any], checks: list[Check], out: TextIO) -> None:
    out.write("Backends:\n")
    width = max(len(bt) for bt in table) if table else 0
    for bt, a in table.items():
        if a["available"]:
            out.write(f"  {bt:<{width}}  available   {a['uses']}\n")
        else:
            out.write(f"  {bt:<{width}}  unavailable {a['reason']}\n")
    out.write("\nChecks:\n")
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "FAIL" if not c.ok else "skip" if c.skipped else "warn" if c.warning else "ok"
        out.write(f"  [{mark:>4}] {c.name:<{width}}  {c.detail}\n")
        if (not c.ok or c.warning) and c.fix:
            out.write(f"         {'':<{width}}  fix: {c.fix}\n")
    failed = [c.name for c in checks if not c.ok]
    warned = [c.name for c in checks if c.ok and c.warning]
    skipped = [c.name for c in checks if c.skipped]
    ran = len(checks) - len(skipped)
    out.write(
        f"\n{ran - len(failed)}/{ran} checks passed"
        + (f"; failing: {', '.join(failed)}" if failed else "")
        + (f"; warnings: {', '.join(warned)}" if warned else "")
        + (f"; skipped (optional, not configured): {', '.join(skipped)}" if skipped else "")
        + "\n"
    )


def run(
    settings: Settings,
    *,
    as_json: bool = False,
    out: TextIO | None = None,
    probe: Any = None,
    docker_connect: Callable[[], Any] | None = None,
    env_file: str | Path | None = None,
) -> int:
    """Print the report; 0 when every check passed (warnings and skipped ones included), 1
    otherwise."""
    out = out or sys.stdout
    table, checks = diagnose(
        settings, probe=probe, docker_connect=docker_connect, env_file=env_file
    )
    if as_json:
        json.dump({"backends": table, "checks": [asdict(c) for c in checks]}, out, indent=2)
        out.write("\n")
    else:
        render(table, checks, out)
    return 0 if all(c.ok for c in checks) else 1


# --- the subcommand --------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add `doctor` to the CLI's subparsers; the parsed args carry their handler (`run_cli`)."""
    p = sub.add_parser("doctor", help="check this machine before it serves or joins a fleet")
    p.add_argument("--env-file", default=argparse.SUPPRESS, help="settings file (default: ./.env)")
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    p.set_defaults(handler=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from solar_host.cli.connection import env_file_choice
    from solar_host.settings import SettingsError, load_settings

    env_file, required = env_file_choice(args)
    try:
        settings = load_settings(env_file, env_file_required=required)
    except SettingsError as err:
        print(f"solar-host doctor: {err}", file=sys.stderr)
        return 2
    for warning in settings.load_warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return run(
        settings,
        as_json=bool(getattr(args, "json", False)),
        env_file=env_file if os.path.isfile(env_file) else None,
    )
