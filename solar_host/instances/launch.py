"""Launching one backend: reserve its port, prepare what it needs, spawn it confined.

Each step is a function the supervisor calls in order from a start attempt; none of them
changes an instance's state (the supervisor alone does). What a step claims (a port, a
process) is given back by the step itself when it fails or is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from solar_host.backends.base import (
    Backend,
    BackendConfigBase,
    HostFacts,
    LaunchContext,
    LaunchError,
    LaunchSpec,
)
from solar_host.instances import confinement, landlock_exec, ownership, preflight
from solar_host.instances import process as procs
from solar_host.instances.backend_env import (
    backend_environment,
    parse_passthrough,
    write_private_files,
)
from solar_host.instances.errors import InstanceConflict
from solar_host.instances.health import AttemptFailed
from solar_host.instances.logs import relay_bound
from solar_host.instances.ports import PortAllocator
from solar_host.instances.store import ProcessRecord
from solar_host.model_store.roots import anchor_relative
from solar_host.model_store.roots import check_config as check_model_roots
from solar_host.settings import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")
# Spawning threads at work at once (as many as asyncio.to_thread's default executor has): 200
# starts at once do not become 200 threads computing policies against the event loop for the
# GIL; the others wait, blocked, without it.
_SPAWNING = threading.BoundedSemaphore(min(32, (os.cpu_count() or 1) + 4))


def _disposable_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn()` in a thread of its own that ends with it (landlock_exec.in_disposable_thread: a
    confined spawn there restricts that thread, with no second hand-over), in a copy of the
    caller's context as asyncio.to_thread would run it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(outcome: Any) -> None:
        if fut.done():
            return
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def done(outcome: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    def work() -> T:
        with _SPAWNING:
            return context.run(fn)

    landlock_exec.in_disposable_thread(work, done)
    return fut


# A claim's bind check takes microseconds; a refused start waits this long at most for it.
CLAIM_END_WAIT_S = 5.0


async def off_loop(
    fn: Callable[..., T], *args: Any, undo: Callable[[T], Any], disposable: bool = False
) -> T:
    """`fn(*args)` in a worker thread (`disposable`: in a thread of its own that ends with it).
    A cancelled caller cannot stop the thread, so what it did (spawned a process, claimed a
    port) is undone by `undo(result)` once it finishes."""
    if disposable:
        fut = _disposable_thread(functools.partial(fn, *args))
    else:
        fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            result = await fut
            undone = undo(result)
            if asyncio.iscoroutine(undone):
                await undone
        raise


async def _kill_unrecorded(proc: procs.BackendProcess) -> None:
    """A backend spawned for a start that was cancelled meanwhile: nobody will manage it."""
    await procs.terminate(proc, 1.0)


async def reserve_port(
    ports: PortAllocator,
    config: BackendConfigBase,
    last_port: int | None = None,
    kept_by_others: set[int] | None = None,
) -> int:
    """The port the backend will listen on: an explicit one is honoured when free (else a
    clear conflict, not retried); otherwise the one it last served on when that is free
    (ruling 24: a saved backend URL keeps reaching the same model across restarts), else one
    the allocator hands out, never a port another instance last served on
    (`kept_by_others`)."""
    if config.port:
        port = config.port
        holder = await off_loop(
            ports.holder, port, config.host, undo=lambda h: h is None and ports.release(port)
        )
        if holder is not None:
            raise InstanceConflict(f"Port {port} is already in use by {holder}")
        return port
    if last_port is not None and last_port not in (kept_by_others or ()):
        mine = last_port
        if await off_loop(
            ports.reclaim, mine, config.host, undo=lambda ok: ok and ports.release(mine)
        ):
            return mine
    return await off_loop(ports.allocate, config.host, kept_by_others, undo=ports.release)


async def drop_claim(claim: asyncio.Task[int], ports: PortAllocator) -> None:
    """A port claimed (reserve_port, in a task) for a start that goes no further: given back
    before the start's refusal is answered. One still being claimed is cancelled, and gives
    it back itself once its thread's bind check ends (off_loop), which is awaited, bounded."""
    if not claim.done():
        claim.cancel()
        await asyncio.wait({claim}, timeout=CLAIM_END_WAIT_S)
        if not claim.done():  # a bind check stuck in the kernel: it gives the port back later
            return
    if not claim.cancelled() and claim.exception() is None:
        ports.release(claim.result())


def launch_context(
    settings: Settings, instance_id: str, port: int, api_key: str, facts: HostFacts
) -> LaunchContext:
    return LaunchContext(
        instance_id=instance_id,
        port=port,
        host_api_key=api_key,
        models_dir=settings.models_dir,
        llama_server_bin=settings.llama_server_bin,
        sglang_venv_path=settings.sglang_venv_path,
        sglang_prompt_cache_dir=settings.sglang_prompt_cache_dir,
        gpu_type=facts.gpu_type,
        private_dir=settings.config_file.parent / "backend-keys",
    )


def prepare(
    backend: Backend,
    config: BackendConfigBase,
    launch: LaunchContext,
    settings: Settings,
    facts: HostFacts,
) -> LaunchSpec:
    """Check what would fail every attempt and build the command line. Raises LaunchError,
    ValueError, OSError or RuntimeError (the caller fails the attempt for good: nothing was
    spawned, and a retry would fail the same way)."""
    # Again at start: a symlink inside a root may have been re-pointed since create.
    check_model_roots(config, settings.model_root_dirs)
    # The files as the backend will open them (relative: under MODELS_DIR, where the
    # roots check judged them), never the host's working directory.
    opened = config.model_copy()
    anchor_relative(opened, settings.models_dir)
    preflight.check(backend, opened, facts)  # not retried, nothing spawned
    for w in backend.before_start(config, launch):
        log.warning("%s: %s", config.alias, w)
    return backend.launch(config, launch)


def environment(
    spec: LaunchSpec, settings: Settings, *, marker: str, port: int, key_hash: str, spawn_id: str
) -> dict[str, str]:
    """The backend's environment, with what proves it ours: exec and fork keep the marker,
    and ownership.py reads it (and the port, key fingerprint and spawn id) back from /proc."""
    env = backend_environment(spec, passthrough=parse_passthrough(settings.backend_env_passthrough))
    env[ownership.MARKER_VAR] = marker
    env[ownership.PORT_VAR] = str(port)
    env[ownership.KEY_VAR] = key_hash
    env[ownership.SPAWN_VAR] = spawn_id
    return env


def access_policy(
    spec: LaunchSpec, env: dict[str, str], settings: Settings
) -> confinement.AccessPolicy:
    """What the backend may read and write (PATH lookups, links: blocking)."""
    return confinement.access_policy(
        roots=settings.model_root_dirs,
        argv=spec.argv,
        env=env,
        private_files=spec.private_files,
        extra_reads=settings.backend_extra_read_dirs,
        extra_writes=[*settings.backend_extra_write_dirs, *spec.write_dirs],
        confine_writes=settings.backend_write_confinement,
        host_state=confinement.HostState(
            settings.config_file,
            settings.log_dir,
            settings.jobs_dir,
            settings.env_file,
        ),
    )


class Unprepared(AttemptFailed):
    """What `prepare` refused: nothing was spawned, and every attempt would fail the same way."""

    def __init__(self, reason: str):
        super().__init__(reason, None, retryable=False)


async def spawn(
    backend: Backend,
    config: BackendConfigBase,
    launch: LaunchContext,
    settings: Settings,
    facts: HostFacts,
    log_path: Path,
    marks: dict[str, Any],
    *,
    adjust: Callable[[LaunchSpec], None],
) -> procs.BackendProcess:
    """Check and build the launch (`prepare`, then `adjust`: Unprepared when they refuse), its
    environment (with `marks`, see `environment`), the backend's private files, and spawn it,
    confined as the settings say: one trip off the loop for all of it. AttemptFailed when it
    cannot run (confinement required but unavailable: not retried)."""

    # Off the loop: the checks read the model's files, fork/exec of a large host takes
    # milliseconds (200 starts: seconds). In a thread that ends with the spawn: a confined
    # spawn restricts that thread itself.
    # In MODELS_DIR: what a backend opens by a relative name (a Hub-id-shaped model_id
    # transformers tries as a directory first, an SGLang path) is then the file the roots
    # check judged, never one beside wherever the host was started (ruling 12).
    def run() -> procs.BackendProcess:
        try:
            spec = prepare(backend, config, launch, settings, facts)
            adjust(spec)
        except (LaunchError, ValueError, OSError, RuntimeError) as err:
            raise Unprepared(str(err)) from None
        for w in spec.warnings:
            log.warning("%s: %s", config.alias, w)
        env = environment(spec, settings, **marks)
        try:
            if spec.private_files:  # each written with an fsync
                write_private_files(spec.private_files)
            return procs.spawn(
                spec.argv,
                env,
                log_path,
                settings.models_dir,
                access_policy(spec, env, settings),
                settings.backend_read_confinement,
                log_bound=relay_bound(settings.log_file_max_bytes),
            )
        except confinement.ConfinementUnavailable as err:
            raise AttemptFailed(str(err), None, retryable=False) from None
        except OSError as err:
            raise AttemptFailed(f"Cannot run {spec.argv[0]}: {err.strerror or err}", None) from None

    return await off_loop(run, undo=_kill_unrecorded, disposable=True)


def process_record(
    proc: procs.BackendProcess,
    *,
    port: int,
    key_hash: str,
    spawn_id: str,
    log_path: Path,
    seq_base: int,
) -> ProcessRecord:
    """What config.json keeps of a spawned backend, for the next host process to find it."""
    return ProcessRecord(
        pid=proc.pid,
        create_time=proc.create_time,
        start_ticks=proc.start_ticks,
        boot_id=proc.identity.boot_id,
        marker=proc.marker,
        cmdline=proc.cmdline,
        port=port,
        key_hash=key_hash,
        spawn_id=spawn_id,
        log_file=str(log_path),
        spawned_at=datetime.now(UTC).isoformat(),
        seq_base=seq_base,
    )
