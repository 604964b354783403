"""How `solar-host serve` runs: the host core first, the REST router beside it.

Importing FastAPI and building the routes (their pydantic models) is about 0.6 s of CPU: more
than everything else start-up does together. None of it is needed to re-adopt backends, reap
orphans, start the control link, or answer the two routes every poller hits (GET /health and
GET /instances, served from cached bytes by api/hotpaths.py). So the server starts the core,
puts the edge layers (request id, body limit, API key, hot paths) in front, binds its port, and
builds the router in a worker thread. A request for any other route that arrives before the
router is ready waits for it (at most API_WAIT_S) instead of being refused; if the router could
not be built, it gets a 503 that says so.

A build that fails for want of descriptors or memory (EMFILE while a flood of connections held
every descriptor at start-up) is tried again, backing off, for up to API_BUILD_DEADLINE_S; it was
tried once and its error kept, and the REST API answered 503 for good while /health said healthy
and the watchdog was fed. While a build has failed, /health is a 503 with the reason and other
routes a 503 at once. A build that fails otherwise, or still fails at the deadline, stops the
host (serve(): backends handed over, exit 1) so that the service manager starts it again.

The cyclic garbage collector is off until the router is built: start-up creates a few hundred
thousand long-lived objects (modules, classes, schemas) that every generation-2 pass would rescan,
about 15-20% of start-up. One collection then runs and what survives it is frozen out of later
passes (gc.freeze), which also keeps those pages shared rather than rewritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from solar_host.api.asgi_json import detail, send_json
from solar_host.api.edge import wrap_in_edge
from solar_host.api.hotpaths import InstantAnswers, hot_routes
from solar_host.host import Host, StartupError, build_host
from solar_host.platform.handover import HAND_OVER_SIGNALS
from solar_host.platform.sdnotify import Notifier
from solar_host.platform.sdnotify import cancel as cancel_task
from solar_host.platform.uvicorn_adapter import (
    guarded_protocol,
    notifying_server,
    uvicorn_config_class,
    websockets_on_first_upgrade,
)
from solar_host.settings import Settings

log = logging.getLogger("solar_host")
# How long a stop or a hand-over waits for requests in flight before it closes their
# connections (uvicorn_adapter.notifying_server).
SHUTDOWN_GRACE_S = 2.0

# A request that arrives before the router is built waits this long for it (it is built in
# well under a second; the bound only matters on a machine that is thrashing).
API_WAIT_S = 60.0
GC_SETTLE_DELAY_S = 0.5
# A router build failing for a cause that passes (TRANSIENT_ERRNOS, MemoryError) is tried again
# after API_BUILD_RETRY_S, doubling up to API_BUILD_RETRY_MAX_S, until API_BUILD_DEADLINE_S.
API_BUILD_DEADLINE_S = 60.0
API_BUILD_RETRY_S = 0.1
API_BUILD_RETRY_MAX_S = 5.0
TRANSIENT_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN}
)


def transient(err: BaseException) -> bool:
    """Whether `err` (or what caused it: an import can wrap the OSError) may pass by itself."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError):
            return True
        if isinstance(cur, OSError) and cur.errno in TRANSIENT_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class StagedApp:
    """ASGI app: the host's lifespan and edge layers at once, the router when it is built."""

    def __init__(
        self,
        host: Host,
        build_api: Callable[[], ASGIApp],
        *,
        on_api_settled: Callable[[], None] | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.host = host
        self.notifier = notifier or Notifier()
        # READY=1 and the router's build once the lifespan has run; serve() has them once the
        # server listens instead (serving()).
        self.ready_on_lifespan = True
        # How a hand-over ends this process: serve() asks uvicorn to exit; served by another
        # runner, SIGTERM (the runner's own graceful stop) does it.
        self.request_exit: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)
        self._watchdog: asyncio.Task[None] | None = None
        self.startup_refused = False
        self._hand_over_installed = False
        self.api: ASGIApp | None = None
        # Why the last build failed (kept while the build is tried again); None once built.
        self.api_error: str | None = None
        # Called with the reason when the router could not be built for good (serve(): stop).
        self.on_api_failed: Callable[[str], None] | None = None
        self._build_api = build_api
        self.on_api_settled = on_api_settled
        self._api_settled: asyncio.Event | None = None
        self._edge = wrap_in_edge(self._route, host)
        # (backends running when the stop began, whether the stop leaves them serving).
        self.backends_at_stop: tuple[int, bool] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.api is None and self.api_error is not None and scope.get("path") == "/health":
            # Not healthy: the hot path would say so, from the core alone.
            await _unavailable(scope, send, self.api_error)
        else:
            await self._edge(scope, receive, send)

    def instant_answers(self) -> InstantAnswers:
        """GET /health and GET /instances as the connection answers them (serve()); while a
        router build has failed, the edge answers (/health is then a 503)."""
        return InstantAnswers(
            hot_routes(self.host), self.host.key, lambda: self.api_error is not None
        )

    # --- the router ---------------------------------------------------------------------------

    def start_building(self) -> None:
        """Build the router in a worker thread (once); call from the event loop."""
        if self._api_settled is not None:
            return
        loop = asyncio.get_running_loop()
        self._api_settled = asyncio.Event()

        def build() -> None:
            deadline = time.monotonic() + API_BUILD_DEADLINE_S
            delay = API_BUILD_RETRY_S
            while True:
                try:
                    api = self._build_api()
                except BaseException as err:
                    why = f"{type(err).__name__}: {err}"
                    if transient(err) and time.monotonic() + delay < deadline:
                        log.warning(
                            "the REST API could not be built (%s); again in %gs", why, delay
                        )
                        try:
                            loop.call_soon_threadsafe(self._note_failure, why)
                        except RuntimeError:
                            return  # the host stopped: nothing waits
                        time.sleep(delay)
                        delay = min(delay * 2, API_BUILD_RETRY_MAX_S)
                        continue
                    if not transient(err):
                        log.exception("the REST API could not be built")
                    elif self.on_api_failed is None:  # else it says so, in one line
                        log.error("the REST API could not be built (%s)", why)
                    result: tuple[ASGIApp | None, str | None] = (None, why)
                else:
                    result = (api, None)
                break
            # The loop is closed when the host stopped before the build ended: nothing waits.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settle, *result)

        threading.Thread(target=build, name="solar-host-api-build", daemon=True).start()

    def _note_failure(self, why: str) -> None:
        if self.api is None:
            self.api_error = why

    def _settle(self, api: ASGIApp | None, error: str | None) -> None:
        self.api, self.api_error = api, error
        assert self._api_settled is not None
        self._api_settled.set()
        if self.on_api_settled is not None:
            self.on_api_settled()
        if api is None and self.on_api_failed is not None:
            self.on_api_failed(error or "not built")

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = self.api
        if api is None and self.api_error is not None:
            # A build failed (it may be tried again): waiting would hold the connection.
            await _unavailable(scope, send, self.api_error)
            return
        if api is None:
            self.start_building()  # served without a lifespan (lifespan="off")
            assert self._api_settled is not None
            try:
                await asyncio.wait_for(self._api_settled.wait(), API_WAIT_S)
            except TimeoutError:
                await _unavailable(scope, send, f"not built within {API_WAIT_S:.0f} s")
                return
            api = self.api
            if api is None:
                await _unavailable(scope, send, self.api_error or "not built")
                return
        await api(scope, receive, send)

    # --- lifespan ------------------------------------------------------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "lifespan.startup":
            return
        try:
            await self.host.start()
        except StartupError as err:
            # The message is the whole story (one line naming what to fix): uvicorn's own
            # "Application startup failed" line after it says nothing more.
            self.startup_refused = True
            await send({"type": "lifespan.startup.failed", "message": f"solar-host: {err}"})
            return
        except Exception as err:
            log.exception("the host could not start")
            await send({"type": "lifespan.startup.failed", "message": f"solar-host: {err!r}"})
            return
        self._install_hand_over()
        if self.notifier.watchdog_s > 0:
            self._watchdog = asyncio.create_task(self.notifier.watchdog(), name="sd-watchdog")
        if self.ready_on_lifespan:
            self.start_building()
            self.notify_ready()
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        self.backends_at_stop = (self._running_backends(), self._keeping_backends())
        self.notifier.stopping("stopping")
        self._remove_hand_over()
        await cancel_task(self._watchdog)
        try:
            await self.host.stop()
        except Exception as err:
            log.exception("the host did not stop cleanly")
            await send({"type": "lifespan.shutdown.failed", "message": f"solar-host: {err!r}"})
            return
        await send({"type": "lifespan.shutdown.complete"})

    # --- systemd and the hand-over restart ------------------------------------------------------

    def serving(self) -> None:
        """The server listens (serve(): uvicorn's startup is done): build the router now. Not
        earlier: its thread would take the interpreter from the server's own start-up, which
        is all that stands between the lifespan and the first /health."""
        self.start_building()
        self.notify_ready()

    def notify_ready(self) -> None:
        self.notifier.ready(f"serving; {len(self.host.instances.supervisors)} instances")

    def _running_backends(self) -> int:
        sups = self.host.instances.supervisors.values()
        return sum(1 for s in sups if str(s.status) not in ("stopped", "failed"))

    def _keeping_backends(self) -> bool:
        """Whether the coming stop leaves the backends serving."""
        return bool(self.host.settings.keep_backends_on_shutdown or self.host.instances.hand_over)

    def hand_over(self) -> None:
        """Exit now, leaving every backend serving for the next host process."""
        log.warning(
            "hand-over restart requested: exiting and leaving %d backend(s) serving for the "
            "next host on this state directory",
            self._running_backends(),
        )
        self.host.hand_over_backends()
        self.notifier.send("STOPPING=1", "STATUS=handing backends over to the next host")
        self.request_exit()

    def _install_hand_over(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread (tests run hosts in threads)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            for sig in HAND_OVER_SIGNALS:
                asyncio.get_running_loop().add_signal_handler(sig, self.hand_over)
            self._hand_over_installed = True

    def _remove_hand_over(self) -> None:
        if self._hand_over_installed:
            for sig in HAND_OVER_SIGNALS:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_signal_handler(sig)
            self._hand_over_installed = False


async def _unavailable(scope: Scope, send: Send, why: str) -> None:
    if scope["type"] == "websocket":
        # Before accept: the server answers the handshake with 403.
        await send({"type": "websocket.close", "code": 1011, "reason": "REST API unavailable"})
        return
    body = detail(f"the REST API is unavailable: {why}")
    await send_json(send, 503, body, [(b"retry-after", b"1")])


def _settle_startup_garbage() -> None:
    gc.collect()
    gc.freeze()
    gc.enable()


def staged_app(settings: Settings, **overrides: Any) -> StagedApp:
    """The host of `settings` as a StagedApp whose router builds once the lifespan has run."""
    with pydantic_builds_deferred():
        # The models of jobs, pulls, resources, backends' configs: built when first used.
        host = build_host(settings, **overrides)

    def build_api() -> ASGIApp:
        build_deferred_models("solar_host.")
        without_pydantic_v1()
        import_fastapi_deferring_openapi_models()
        from solar_host.app import create_api

        return create_api(host)

    return StagedApp(host, build_api, notifier=Notifier.from_environment())


def without_pydantic_v1() -> None:
    """Make `pydantic.v1` unimportable in this process unless something already imported it.

    FastAPI imports it for every route's parameters, only to ask whether they are pydantic v1
    models, and takes an ImportError as "no" (fastapi._compat). The host has no v1 model;
    the import was about a fifth of the router's build and 1.8 MiB of idle RSS (60.9 -> 59.1
    MiB). tests/test_router_without_pydantic_v1.py builds and calls the router this way in a
    process of its own, so a FastAPI that comes to need pydantic.v1 fails there."""
    sys.modules.setdefault("pydantic.v1", None)  # type: ignore[arg-type]


def import_fastapi_deferring_openapi_models() -> None:
    """Import FastAPI with pydantic's `defer_build` on (pydantic_builds_deferred), unless
    something already imported it.

    fastapi.openapi.models (imported by fastapi.params, so by any FastAPI) declares about 40
    pydantic models of the OpenAPI document and built every one at import: about 30 ms of CPU,
    a quarter of the router's build, for a schema only /openapi.json and /docs ever validate.
    tests/test_router_without_pydantic_v1.py checks, in a process of its own, that the
    OpenAPI document served this way is the one an eager build serves."""
    if "fastapi" in sys.modules:
        return
    with pydantic_builds_deferred():
        import fastapi  # noqa: F401


def build_deferred_models(prefix: str) -> None:
    """Build the pydantic models of the modules whose names start with `prefix` that were
    deferred (pydantic_builds_deferred) and that nothing has used yet; one that cannot be
    built yet stays deferred. Run before the router: FastAPI, given a model not built yet,
    generated its schema again inside the schema of every route that names it, where a built
    model's is reused (6.4 MiB more idle RSS on a host with no instance on record)."""
    from pydantic import BaseModel

    seen: set[type] = set()
    todo: list[type] = [BaseModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            todo.append(sub)
            if sub.__module__.startswith(prefix) and not sub.__pydantic_complete__:
                sub.model_rebuild(raise_errors=False)


@contextlib.contextmanager
def pydantic_builds_deferred() -> Iterator[None]:
    """pydantic's `defer_build` on for the models declared meanwhile (the imports inside).

    Deferred, a model is built the first time it validates or serializes anything, and behaves
    the same from then on; one that nothing uses before a request is then built off the path to
    the first answer. pydantic has no switch for one module: its default for every model is
    turned on for the block and off after it. A model another thread declares meanwhile is only
    built later. A pydantic that moved its defaults builds them at once, as before."""
    try:
        from pydantic._internal._config import config_defaults
    except ImportError:
        yield
        return
    if config_defaults.get("defer_build") is not False:
        yield
        return
    config_defaults["defer_build"] = True
    try:
        yield
    finally:
        config_defaults["defer_build"] = False


def serve(settings: Settings, **overrides: Any) -> int:
    """Run the host on settings.host:settings.port until SIGINT/SIGTERM (or a hand-over).

    Returns 0 after a clean stop, 1 when it never started. `overrides` replace services by name
    (build_host), for test hosts with their own backends.
    """
    gc.disable()
    app: StagedApp | None = None
    try:
        uvicorn_config = uvicorn_config_class()
        app = staged_app(settings, **overrides)

        def settle_later() -> None:
            asyncio.get_running_loop().call_later(GC_SETTLE_DELAY_S, _settle_startup_garbage)

        app.on_api_settled = settle_later
        try:
            # Before the server exists: a host that is not alone on its directories says so
            # in one line and touches nothing.
            app.host.prepare()
        except StartupError as err:
            print(f"solar-host: {err}", file=sys.stderr, flush=True)
            return 1
        config = uvicorn_config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            access_log=False,
            http=guarded_protocol(settings.http_header_timeout_s, instant=app.instant_answers()),
            ws=websockets_on_first_upgrade,
        )
        server = notifying_server(config, on_started=app.serving, shutdown_grace_s=SHUTDOWN_GRACE_S)
        logging.getLogger("uvicorn.error").addFilter(_OneLineRefusal(app))
        logging.getLogger("uvicorn.error").addFilter(_CutRequests(server))
        app.ready_on_lifespan = False
        app.request_exit = lambda: setattr(server, "should_exit", True)
        api_failed: list[str] = []

        def stop_without_api(why: str) -> None:
            api_failed.append(why)
            log.error(
                "solar-host: the REST API could not be built (%s): stopping, backends left "
                "serving for the next host",
                why,
            )
            app.host.hand_over_backends()
            app.notifier.send("STOPPING=1", "STATUS=the REST API could not be built")
            server.should_exit = True

        app.on_api_failed = stop_without_api
        try:
            # Listening before the lifespan runs: uvicorn binds after it, and a port it then
            # cannot bind ran the lifespan's shutdown, which stopped every backend the start
            # had just re-adopted. Now such a start ends before anything is adopted.
            sock = listen(settings.host, settings.port, config.backlog)
        except OSError as err:
            print(
                f"solar-host: cannot listen on {settings.host}:{settings.port}: "
                f"{err.strerror or err}; no backend was adopted or stopped",
                file=sys.stderr,
                flush=True,
            )
            return 1
        try:
            server.run(sockets=[sock])
        except SystemExit as exit_:
            # uvicorn exits 3 when the lifespan fails; our 3 means "host unreachable".
            if exit_.code != 3:
                raise
            return 1
        if server.stopped_by and app.backends_at_stop is not None:
            line = stop_line(server.stopped_by, *app.backends_at_stop)
            if settings.log_format == "json":
                # Every line on stderr is a JSON record under LOG_FORMAT=json (the journal
                # and log shippers parse them): the last one too.
                log.warning("%s", line.removeprefix("solar-host: "))
            else:
                print(line, file=sys.stderr, flush=True)
        return 0 if server.started and not api_failed else 1
    finally:
        if app is not None:
            app.host.release()
        gc.enable()


def stop_line(signals: tuple[int, ...], running: int, kept: bool) -> str:
    """The one line a stop by signal ends with: what became of the backends, and how to get
    the other outcome."""
    by = " then ".join(signal.Signals(s).name for s in dict.fromkeys(signals))
    if kept:
        return (
            f"solar-host: stopped by {by}; {running} backend(s) left serving, for the next host "
            "on this state directory to adopt"
        )
    if running == 0:
        return f"solar-host: stopped by {by}; no backend was running"
    return (
        f"solar-host: stopped by {by}; its {running} backend(s) were stopped (to leave them "
        "serving across a restart: `solar-host handover`, or KEEP_BACKENDS_ON_SHUTDOWN=true)"
    )


class _OneLineRefusal(logging.Filter):
    """Drops uvicorn's generic line after a start-up the host refused with its own reason."""

    def __init__(self, app: StagedApp) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            self.app.startup_refused and record.getMessage().startswith("Application startup")
        )


class _CutRequests(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for the requests the
    shutdown cut after its grace (cancelled on purpose, said in one warning line)."""

    def __init__(self, server: Any) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (self.server.cut_requests and isinstance(exc, asyncio.CancelledError))


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """The API's listening socket, bound as uvicorn binds one (IPv6 for an address with ':')
    and listening, so a port another process holds fails here, whoever bound it first."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock  # not inheritable (Python's default): backends never hold the API's port
