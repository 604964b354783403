"""The host core: every service of one host, built from one Settings object, started in order
and stopped in reverse. Free of HTTP: `app.py` puts the REST API on top, `serving.py` the server.

Building touches no file and starts nothing; `Host.start()` does.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
from dataclasses import dataclass, field
from typing import Any

from solar_host.events import EventBus
from solar_host.resources.probes import LiveProbe, SystemProbe
from solar_host.settings import Settings

log = logging.getLogger("solar_host")


class StartupError(RuntimeError):
    """The host cannot start; the message says what to fix."""


def resolve_api_key(settings: Settings) -> tuple[str, bool]:
    """The host key: API_KEY, else the stored generated key, else a new one (stored 0600).

    Returns (key, generated_now).
    """
    if settings.api_key:
        return settings.api_key, False
    path = settings.api_key_file
    try:
        key = path.read_text(encoding="utf-8").strip()
        if key:
            return key, False
    except FileNotFoundError:
        pass
    except OSError as err:
        raise StartupError(f"cannot read the stored API key at {path}: {err}") from None
    key = "sh-" + secrets.token_urlsafe(32)
    from solar_host.instances.store import atomic_write_bytes

    try:
        atomic_write_bytes(path, (key + "\n").encode(), mode=0o600)
    except OSError as err:
        raise StartupError(f"cannot store the generated API key at {path}: {err}") from None
    return key, True


@dataclass
class _Lifecycle:
    """Adapter for services whose start/stop names are taken by their domain (instances)."""

    start: Any
    stop: Any


@dataclass
class Host:
    """Every service of one host, built from one Settings object."""

    settings: Settings
    bus: EventBus = field(default_factory=EventBus)
    probe: SystemProbe = field(default_factory=LiveProbe)
    api_key: str = ""
    started: bool = False
    services: dict[str, Any] = field(default_factory=dict)
    # Objects with async start()/stop(), started in this order and stopped in reverse.
    lifecycle: list[Any] = field(default_factory=list)

    def key(self) -> str:
        return self.api_key

    def __getattr__(self, name: str) -> Any:
        services = self.__dict__.get("services")
        if services is not None and name in services:
            return services[name]
        raise AttributeError(name)

    def add(self, name: str, service: Any, *, lifecycle: bool = True) -> Any:
        self.services[name] = service
        if lifecycle and hasattr(service, "startup"):
            self.lifecycle.append(_Lifecycle(service.startup, service.shutdown))
        elif lifecycle and hasattr(service, "start"):
            self.lifecycle.append(service)
        return service

    async def start(self) -> None:
        key, generated = resolve_api_key(self.settings)
        self.api_key = key
        if generated:
            # Printed once, on the terminal that started the host, and never logged.
            print(
                f"solar-host: generated API key (stored in {self.settings.api_key_file}):\n  {key}",
                file=sys.stderr,
                flush=True,
            )
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

    async def stop(self) -> None:
        for service in reversed(self.lifecycle):
            try:
                await service.stop()
            except Exception:
                log.exception("error stopping %s", type(service).__name__)
        self.started = False


def build_host(settings: Settings, *, probe: SystemProbe | None = None, **overrides: Any) -> Host:
    """Construct every service (no I/O). `overrides` replace services by name (tests)."""
    host = Host(settings=settings, probe=probe or LiveProbe())
    from solar_host.backends.registry import BackendRegistry
    from solar_host.instances.manager import InstanceManager

    backends = overrides.pop("backends", None) or BackendRegistry.default()
    host.add("backends", backends, lifecycle=False)

    # --- resources (ledger, usage) ----------------------------------------------------------
    from solar_host.resources.service import ResourceService

    resources = host.add("resources", ResourceService(settings, bus=host.bus, probe=host.probe))
    # --- model store ------------------------------------------------------------------------
    from solar_host.model_store.service import ModelStore

    store = overrides.pop("models", None) or ModelStore(settings, bus=host.bus, probe=host.probe)
    host.add("models", store)
    # --- jobs ----------------------------------------------------------------------------------
    from solar_host.jobs.service import JobService

    jobs = overrides.pop("jobs", None) or JobService(settings, bus=host.bus, probe=host.probe)
    host.add("jobs", jobs)

    manager = overrides.pop("instances", None) or InstanceManager(
        settings=settings,
        bus=host.bus,
        backends=backends,
        probe=host.probe,
        api_key=host.key,
    )
    host.add("instances", manager)

    # --- estimates: the fit check and GPU placement of every start ---------------------------
    from solar_host.estimates.capacity import CapacityGate

    manager.capacity = CapacityGate(
        host.probe, enabled=lambda: settings.fit_check, reserved=resources.reserved_bytes
    )
    resources.loading = manager.capacity.holds
    # The store answers "which files are in use" and "where did a pull put this source".
    store.in_use = manager.models_in_use
    manager.manifest_lookup = store.lookup_dir
    resources.jobs = host.services.get("jobs")
    # --- metrics ----------------------------------------------------------------------------------
    from solar_host.metrics import HostMetrics

    host.add("metrics", overrides.pop("metrics", None) or HostMetrics(host))
    # --- control link (last: it reads every other service) ----------------------------------
    if settings.control_urls:
        from solar_host.control.client import ControlLink

        host.add("control", ControlLink(host))

    for name, service in overrides.items():
        host.services[name] = service
    return host
