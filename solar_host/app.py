"""The composition root: `create_app(settings)` builds every service and mounts the routers.

Building touches no file and starts nothing; the lifespan starts services in order and stops
them in reverse. A test builds a whole host in a temp dir with `create_app(settings)`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI

from solar_host import __version__
from solar_host.api.auth import APIKeyMiddleware
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


def create_app(settings: Settings, *, host: Host | None = None, **overrides: Any) -> FastAPI:
    """The ASGI app of one host. Touches no file until the lifespan starts."""
    host = host or build_host(settings, **overrides)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await host.start()
        try:
            yield
        finally:
            await host.stop()

    app = FastAPI(
        title="solar-host",
        version=__version__,
        description="Host agent: launches and supervises model inference servers.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.host = host

    from solar_host.api import docs, instances, streams, system

    for module in (system, instances, streams, docs):
        app.include_router(module.router)
    # --- feature routers (models, jobs, resources, metrics) -----------------------------------
    from solar_host.api import jobs as jobs_api

    app.include_router(jobs_api.router)
    from solar_host.api import resources as resources_api

    app.include_router(resources_api.router)
    from solar_host.api import models as models_api

    app.include_router(models_api.router)

    install_openapi_security(app)
    from solar_host.api.hotpaths import HotPathMiddleware
    from solar_host.api.system import health_body

    app.add_middleware(
        HotPathMiddleware,
        routes={
            "/instances": lambda: host.instances.list_json(),
            "/health": lambda: health_body(host),
        },
    )
    app.add_middleware(APIKeyMiddleware, get_key=host.key, is_public=host_public_paths(host))
    from solar_host.api.limits import BodyLimitMiddleware

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    from solar_host.api import metrics as metrics_api
    from solar_host.api.request_id import RequestIdMiddleware

    app.include_router(metrics_api.router)
    # Outermost, so that refused (401/413) requests carry an id too.
    app.add_middleware(RequestIdMiddleware)
    return app


def host_public_paths(host: Host) -> Any:
    def is_public(path: str) -> bool:
        return path == "/metrics" and host.settings.metrics_public

    return is_public


PUBLIC_OPENAPI_PATHS = {"/", "/health"}


def install_openapi_security(app: FastAPI) -> None:
    """Declare the X-API-Key scheme so Swagger's Authorize button works."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["APIKeyHeader"] = {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
        }
        for path, ops in schema.get("paths", {}).items():
            if path in PUBLIC_OPENAPI_PATHS:
                continue
            for op in ops.values():
                if isinstance(op, dict):
                    op["security"] = [{"APIKeyHeader": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
