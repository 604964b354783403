"""The host core: every service of one host, built from one Settings object, started in order
and stopped in reverse. Free of HTTP: `app.py` puts the REST API on top, `serving.py` the server.

Building touches no file and starts nothing; `Host.start()` does.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from solar_host.events import EventBus
from solar_host.platform.logging_setup import add_secrets
from solar_host.platform.statelock import StateLock, StateLocked
from solar_host.resources.probes import BackgroundReading, LiveProbe, SystemProbe, disk_info
from solar_host.settings import Settings

if TYPE_CHECKING:
    from solar_host.backends.registry import BackendRegistry
    from solar_host.control.client import ControlLink
    from solar_host.estimates.sampler import MemorySampler
    from solar_host.instances.manager import InstanceManager
    from solar_host.jobs.service import JobService
    from solar_host.metrics.service import HostMetrics
    from solar_host.model_store.service import ModelStore
    from solar_host.resources.service import ResourceService

log = logging.getLogger("solar_host")

# How old the disk figures of GET /health may be (control polls it on every host refresh).
MODELS_DISK_TTL_S = 2.0


class StartupError(RuntimeError):
    """The host cannot start; the message says what to fix."""


def resolve_api_key(settings: Settings) -> tuple[str, bool]:
    """The host key: API_KEY, else the stored generated key, else a new one (stored 0600).

    A key file that is there but empty or unreadable stops the start (a new key would lock
    every client out); only a missing file means "generate one". Returns (key, generated_now).
    """
    if settings.api_key:
        return settings.api_key, False
    from solar_host.platform.statefiles import StateFileError, read_api_key, store_api_key

    path = settings.api_key_file
    try:
        key = read_api_key(path)
    except StateFileError as err:
        raise StartupError(str(err)) from None
    if key is not None:
        return key, False
    key = "sh-" + secrets.token_urlsafe(32)
    try:
        store_api_key(path, key)
    except OSError as err:
        raise StartupError(f"cannot store the generated API key at {path}: {err}") from None
    return key, True


class Lifecycle(Protocol):
    """What the host starts (in order) and stops (in reverse)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# Reads a service's state files before anything starts; raises StateFileError when damaged.
StateLoader = Callable[[], Awaitable[None]]


@dataclass
class Hooks:
    """Lifecycle for services whose start/stop names are taken by their domain (instances)."""

    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


@dataclass
class Host:
    """Every service of one host, built from one Settings object."""

    settings: Settings
    bus: EventBus = field(default_factory=EventBus)
    probe: SystemProbe = field(default_factory=LiveProbe)
    api_key: str = ""
    started: bool = False
    # The services: build_host makes them all (the control link only when CONTROL_URLS names
    # one); a test may set only those it needs. None: this host has no such service.
    backends: BackendRegistry | None = None
    resources: ResourceService | None = None
    models: ModelStore | None = None
    jobs: JobService | None = None
    instances: InstanceManager | None = None
    memory: MemorySampler | None = None
    metrics: HostMetrics | None = None
    control: ControlLink | None = None
    # Started in this order and stopped in reverse.
    lifecycle: list[Lifecycle] = field(default_factory=list)
    # Run in this order before anything starts.
    state_loaders: list[StateLoader] = field(default_factory=list)
    state_lock: StateLock | None = None
    _models_disk: BackgroundReading | None = field(default=None, repr=False)

    def key(self) -> str:
        return self.api_key

    def models_disk(self) -> dict[str, float] | None:
        """Disk usage of MODELS_DIR for GET /health, at most MODELS_DISK_TTL_S old, read in a
        thread: a statvfs on a hung network mount never holds the event loop."""
        if self._models_disk is None:
            self._models_disk = BackgroundReading(
                lambda: disk_info(self.probe, self.settings.models_dir), MODELS_DISK_TTL_S
            )
        return self._models_disk.get()

    def run(self, lifecycle: Lifecycle, load_state: StateLoader | None = None) -> None:
        """Start `lifecycle` with the host (after those before it) and stop it in reverse;
        `load_state` reads its state files before anything starts."""
        if load_state is not None:
            self.state_loaders.append(load_state)
        self.lifecycle.append(lifecycle)

    def prepare(self) -> None:
        """Claim this host's directories before anything else happens (idempotent).

        Runs before any file is read or written and before any process is looked at: a second
        host on the same CONFIG_FILE (or a link to it), LOG_DIR or JOBS_DIR directory stops
        here, touching nothing.
        `serve()` calls it before the server starts, so that refusal is one line on stderr.
        """
        if self.state_lock is None:
            self.state_lock = StateLock.for_host(self.settings)
        try:
            self.state_lock.acquire()
        except StateLocked as err:
            raise StartupError(str(err)) from None
        except OSError as err:
            raise StartupError(f"cannot lock {self.settings.config_file.parent}: {err}") from None

    def hand_over_backends(self) -> None:
        """Make the coming stop leave every backend serving, for the next host to adopt."""
        if self.instances is not None:
            self.instances.hand_over = True

    def release(self) -> None:
        if self.state_lock is not None:
            self.state_lock.release()

    async def start(self) -> None:
        self.prepare()
        try:
            await self._start()
        except BaseException:
            self.release()
            raise

    async def _start(self) -> None:
        await self._load_state()
        key, generated = resolve_api_key(self.settings)
        self.api_key = key
        add_secrets(key)  # never in a log line, whoever prints it
        if generated:
            stored = self.settings.api_key_file.absolute()
            if sys.stderr.isatty():
                # Printed once, on the terminal that started the host, and never logged.
                print(
                    f"solar-host: generated API key (stored in {stored}):\n  {key}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                # stderr is a journal or a log file: kept, and read by more than the operator.
                log.warning(
                    "generated API key stored in %s (not shown; read it from that file)", stored
                )
        for warning in self.settings.load_warnings:
            log.warning("%s", warning)
        if self.settings.solar_control_api_key:
            log.warning(
                "SOLAR_CONTROL_API_KEY is ignored: the control link authenticates with API_KEY"
            )
        started = []
        try:
            for service in self.lifecycle:
                await service.start()
                started.append(service)
        except BaseException:
            for service in reversed(started):
                with contextlib.suppress(Exception):
                    await service.stop()
            raise
        self.started = True

    async def _load_state(self) -> None:
        """Every service reads its state files before any starts: a damaged one stops the host
        here, before anything is written or any process touched (statefiles.py)."""
        from solar_host.platform.statefiles import StateFileError

        for load in self.state_loaders:
            try:
                await load()
            except StateFileError as err:
                raise StartupError(str(err)) from None

    async def stop(self) -> None:
        for service in reversed(self.lifecycle):
            try:
                await service.stop()
            except Exception:
                log.exception("error stopping %s", type(service).__name__)
        self.started = False
        self.release()


def build_host(settings: Settings, *, probe: SystemProbe | None = None, **overrides: Any) -> Host:
    """Construct every service (no I/O). `overrides` replace services by name (tests)."""
    host = Host(settings=settings, probe=probe or LiveProbe())
    from solar_host.backends.registry import BackendRegistry
    from solar_host.instances.manager import InstanceManager

    backends = overrides.pop("backends", None) or BackendRegistry.default()
    host.backends = backends

    # --- resources (ledger, usage) ----------------------------------------------------------
    from solar_host.resources.service import ResourceService

    resources = ResourceService(settings, bus=host.bus, probe=host.probe)
    host.resources = resources
    host.run(resources, resources.load_state)
    # --- model store ------------------------------------------------------------------------
    from solar_host.model_store.service import ModelStore

    store = overrides.pop("models", None) or ModelStore(settings, bus=host.bus, probe=host.probe)
    host.models = store
    host.run(store)
    # --- jobs ----------------------------------------------------------------------------------
    from solar_host.jobs.service import JobService

    jobs = overrides.pop("jobs", None) or JobService(settings, bus=host.bus, probe=host.probe)
    host.jobs = jobs
    host.run(jobs, jobs.load_state)

    manager = overrides.pop("instances", None) or InstanceManager(
        settings=settings,
        bus=host.bus,
        backends=backends,
        probe=host.probe,
        api_key=host.key,
    )
    host.instances = manager
    host.run(Hooks(manager.startup, manager.shutdown), manager.load_state)

    # --- estimates: the fit check and GPU placement of every start ---------------------------
    from solar_host.estimates.capacity import CapacityGate
    from solar_host.estimates.measured import MeasurementStore, backend_version
    from solar_host.estimates.sampler import MemorySampler

    measurements = MeasurementStore(
        settings.memory_measurements_file, lambda: settings.memory_measurements_max
    )
    manager.capacity = CapacityGate(
        host.probe,
        enabled=lambda: settings.fit_check,
        reserved=resources.reserved_bytes,
        roots=lambda: settings.model_root_dirs,
        gpu_host=resources.gpu_host,
        instances=manager.list,
        measurements=measurements,
        margin=lambda: settings.measured_memory_margin,
        version=lambda bt: backend_version(bt, settings.llama_server_bin),
    )
    sampler = MemorySampler(
        manager=manager,
        probe=host.probe,
        store=measurements,
        bus=host.bus,
        interval_s=lambda: settings.memory_sample_interval_s,
        drift_share=lambda: settings.memory_drift_share,
    )
    host.memory = sampler
    host.run(sampler, sampler.load_state)
    resources.loading = manager.capacity.holds
    # A flight record's peak memory: what the sampler saw of the backend's tree.
    manager.ctx.peak_memory = lambda iid: (sampler.view(iid) or {}).get("peak_bytes")
    # The store answers "which files are in use" and "where did a pull put this source".
    store.in_use = manager.models_in_use
    manager.manifest_lookup = store.lookup_dir
    resources.jobs = jobs
    # --- metrics ----------------------------------------------------------------------------------
    from solar_host.metrics.service import HostMetrics

    metrics = overrides.pop("metrics", None) or HostMetrics(host)
    host.metrics = metrics
    host.run(metrics)
    # --- control link (last: it reads every other service) ----------------------------------
    if settings.control_urls:
        from solar_host.control.client import ControlLink

        link = ControlLink(host)
        host.control = link
        host.run(link)
    if overrides:
        raise TypeError(f"build_host: no service named {', '.join(sorted(overrides))}")
    return host
