"""A small HTTP client of one host's REST API, for the command line.

Every failure is one of four exceptions, each of which the command line maps to its own exit
code: the host cannot be reached (or what answered is not a solar-host: not JSON, or JSON of
another shape), it refused the key, it refused the operation, or the client was given a bad URL,
key or timeout. Nothing here prints; error messages meant for a terminal have the host's text
clipped and its control characters made visible (cli_format.visible).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from solar_host.cli.format import clip, visible
from solar_host.platform.envfile import api_key_problem

# Longest --timeout: beyond a day is a typo (and past ~1e9 s the socket layer refuses it).
MAX_TIMEOUT_S = 86400.0


class ClientError(Exception):
    """Base of the client's errors; `str()` is one line for the terminal."""


class ConfigError(ClientError):
    """The URL or key given to the client cannot work (no request was made)."""


class HostUnreachable(ClientError):
    pass


class UnexpectedAnswer(HostUnreachable):
    """Something answered, but not as a solar-host does: a proxy's or captive portal's page,
    another service on that port, JSON of another shape, a stream message cut short. The host
    itself was not reached, so it counts as unreachable."""


class AuthFailed(ClientError):
    pass


class NoSuchInstance(ClientError):
    """No instance has this alias, id or id prefix (nothing was asked of the host)."""

    def __init__(self, ref: str):
        self.ref = ref
        super().__init__(
            f"no instance matches {ref!r} (by alias, id or id prefix); "
            "`solar-host instances` lists them"
        )


class AmbiguousInstance(ClientError):
    """Several instances match a reference; `matches` are their instance records."""

    def __init__(self, ref: str, matches: list[dict[str, Any]]):
        self.ref = ref
        self.matches = matches
        lines = [f"{ref!r} matches {len(matches)} instances; name one by its id:"]
        for inst in matches:
            alias = (inst.get("config") or {}).get("alias")
            lines.append(
                f"  {visible(inst.get('id'))}  {visible(alias)}  {visible(inst.get('status'))}"
            )
        super().__init__("\n".join(lines))


def resolve_instance(instances: list[dict[str, Any]], ref: str) -> dict[str, Any]:
    """The one instance `ref` names: its exact id, else its alias, else a unique id prefix.

    An exact id always wins (an alias can look like an id prefix); an alias shared by several
    instances, or a prefix of several ids, is ambiguous rather than a guess.
    """
    ref = ref.strip()
    if not ref:
        raise NoSuchInstance(ref)
    for inst in instances:
        if inst.get("id") == ref:
            return inst
    for pick in (
        lambda i: (i.get("config") or {}).get("alias") == ref,
        lambda i: str(i.get("id", "")).startswith(ref),
    ):
        found = [i for i in instances if pick(i)]
        if len(found) == 1:
            return found[0]
        if found:
            raise AmbiguousInstance(ref, found)
    raise NoSuchInstance(ref)


def next_seq(entries: list[dict[str, Any]]) -> int | None:
    """The seq after the last log entry; None (from the oldest line kept) when there is none
    (or the host gave none)."""
    last = entries[-1].get("seq") if entries else None
    return last + 1 if isinstance(last, int) and not isinstance(last, bool) else None


class OperationFailed(ClientError):
    """The host answered with an error; `body` is its JSON body (or {"detail": text})."""

    def __init__(self, status: int, body: dict[str, Any]):
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {describe(body)}")


def describe(body: Any) -> str:
    """The human part of an error body: `detail` (str, or FastAPI's list of field errors),
    clipped to MAX_DETAIL_CHARS and with control characters made visible (one line)."""
    return visible(clip(_detail_text(body)))


def _detail_text(body: Any) -> str:
    if not isinstance(body, dict):
        return str(body)
    detail = body.get("detail", body.get("error", body))
    if isinstance(detail, list):
        parts = []
        for e in detail:
            if isinstance(e, dict):
                loc = ".".join(str(x) for x in e.get("loc", ()) or ())
                parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
            else:
                parts.append(str(e))
        return "; ".join(parts)
    return str(detail)


def _body(resp: httpx.Response) -> dict[str, Any]:
    """An error answer's JSON body; its text as {"detail": ...} when it is not JSON (a proxy's
    page) or too deeply nested to parse."""
    try:
        data = resp.json()
    except (ValueError, RecursionError):
        return {"detail": resp.text.strip() or resp.reason_phrase}
    return data if isinstance(data, dict) else {"detail": data}


def _content_type(resp: httpx.Response) -> str:
    return resp.headers.get("content-type", "").split(";")[0].strip() or "no content type"


def _kind(data: Any) -> str:
    """What a JSON value is, in words, for an error message."""
    if isinstance(data, dict):
        return "an object"
    if isinstance(data, list):
        return "a list holding other things than objects"
    if data is None:
        return "null"
    return "a string" if isinstance(data, str) else f"a {type(data).__name__}"


def _check_url(url: str) -> None:
    """Raise ConfigError for a URL no request can be sent to (bad port, unclosed IPv6
    bracket, no host name, a space)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parses the port: ValueError for "80a" or 99999
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as err:
        raise ConfigError(f"invalid host URL {url!r}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"host URL must be http(s)://HOST:PORT, not {url!r}")
    if not parts.hostname or any(c.isspace() for c in url):
        raise ConfigError(f"invalid host URL {url!r}: no valid host name")


def _check_timeout(timeout: float) -> None:
    ok = isinstance(timeout, int | float) and math.isfinite(timeout)
    if not ok or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ConfigError(
            f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}, "
            f"not {timeout!r}"
        )


def _check_key(api_key: str) -> None:
    # The key goes into a header: a character a header cannot hold would fail inside httpx.
    problem = api_key_problem(api_key) if api_key else None
    if problem is not None:
        raise ConfigError(f"the API key {problem} (it travels in an HTTP header)")


class HostClient:
    """Synchronous calls to one host. `timeout` bounds connecting and short calls."""

    def __init__(self, url: str, api_key: str, *, timeout: float = 10.0):
        _check_url(url)
        _check_timeout(timeout)
        _check_key(api_key)
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        headers = {"X-API-Key": api_key} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HostClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport --------------------------------------------------------------------------

    def request(
        self, method: str, path: str, *, json_body: Any = None, read_timeout: float | None = -1.0
    ) -> httpx.Response:
        """Send one request; raise a ClientError for anything but a 2xx answer.

        `read_timeout` None waits as long as the operation takes (starts, pulls); -1 uses the
        client's timeout.
        """
        timeout = httpx.Timeout(
            self.timeout, read=self.timeout if read_timeout == -1.0 else read_timeout
        )
        try:
            resp = self._http.request(method, path, json=json_body, timeout=timeout)
        except httpx.TimeoutException:
            raise HostUnreachable(f"{self.url} did not answer within {self.timeout:g} s") from None
        except httpx.TransportError as err:
            raise HostUnreachable(f"cannot reach {self.url}: {err}") from None
        except httpx.DecodingError as err:  # a body that says gzip and is not
            raise UnexpectedAnswer(f"the answer of {self.url} cannot be decoded: {err}") from None
        except httpx.InvalidURL as err:
            raise ConfigError(f"invalid host URL {self.url!r}: {err}") from None
        if resp.status_code == 401:
            raise AuthFailed(f"{self.url} refused the API key: {describe(_body(resp))}")
        if resp.status_code >= 400:
            raise OperationFailed(resp.status_code, _body(resp))
        return resp

    def get_json(self, path: str) -> Any:
        return self.json_of(self.request("GET", path))

    def get_object(self, path: str) -> dict[str, Any]:
        return self.object_of(self.request("GET", path))

    def get_list(self, path: str) -> list[dict[str, Any]]:
        return self.list_of(self.request("GET", path))

    # --- answers: JSON of the expected shape, else UnexpectedAnswer ---------------------------

    def json_of(self, resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
            raise UnexpectedAnswer(
                f"the host at {self.url} answered {resp.status_code} but not JSON: "
                f"{visible(_content_type(resp))}"
            ) from None

    def object_of(self, resp: httpx.Response) -> dict[str, Any]:
        data = self.json_of(resp)
        if not isinstance(data, dict):
            raise self._wrong_shape(resp, data, "an object")
        return data

    def list_of(self, resp: httpx.Response) -> list[dict[str, Any]]:
        data = self.json_of(resp)
        if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
            raise self._wrong_shape(resp, data, "a list of objects")
        return data

    def _wrong_shape(self, resp: httpx.Response, data: Any, expected: str) -> UnexpectedAnswer:
        what = f"{resp.request.method} {resp.request.url.path}"
        return UnexpectedAnswer(
            f"the host at {self.url} answered {what} with {_kind(data)} where {expected} "
            "was expected (is it a solar-host?)"
        )

    # --- operations -------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self.get_object("/health")

    def info(self) -> dict[str, Any]:
        return self.get_object("/")

    def instances(self) -> list[dict[str, Any]]:
        return self.get_list("/instances")

    def instance(self, instance_id: str) -> dict[str, Any]:
        return self.get_object(f"/instances/{quote(instance_id, safe='')}")

    def find_instance(self, ref: str) -> dict[str, Any]:
        """The instance named by alias, id or unique id prefix (see resolve_instance)."""
        return resolve_instance(self.instances(), ref)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.object_of(self.request("POST", "/instances", json_body=body))

    def delete(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}"
        return self.object_of(self.request("DELETE", path, read_timeout=None))

    def start(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/start"
        return self.object_of(self.request("POST", path, read_timeout=None))

    def stop(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/stop"
        return self.object_of(self.request("POST", path, read_timeout=None))

    def restart(self, instance_id: str) -> dict[str, Any]:
        path = f"/instances/{quote(instance_id, safe='')}/restart"
        return self.object_of(self.request("POST", path, read_timeout=None))

    def jobs(self) -> list[dict[str, Any]]:
        return self.get_list("/jobs")

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get_object(f"/jobs/{quote(job_id, safe='')}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        path = f"/jobs/{quote(job_id, safe='')}"
        return self.object_of(self.request("DELETE", path, read_timeout=None))

    def logs(self, instance_id: str) -> list[dict[str, Any]]:
        return self.get_list(f"/instances/{quote(instance_id, safe='')}/logs")

    def models(self) -> list[dict[str, Any]]:
        return self.get_list("/models")

    def pull(self, body: dict[str, Any]) -> dict[str, Any]:
        resp = self.request("POST", "/models/pull", json_body=body, read_timeout=None)
        return self.object_of(resp)

    def verify(self, slug: str) -> dict[str, Any]:
        path = f"/models/{quote(slug, safe='')}/verify"
        return self.object_of(self.request("POST", path, read_timeout=None))

    def metrics_text(self) -> str:
        return self.request("GET", "/metrics").text

    # --- WebSocket log stream -----------------------------------------------------------------

    def ws_url(self, path: str) -> str:
        parts = urlsplit(self.url)
        scheme = "wss" if parts.scheme == "https" else "ws"
        return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, "", ""))

    async def follow_logs(
        self, instance_id: str, since_seq: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Messages of WS /instances/{id}/logs: {seq, timestamp, line} or {gap: {...}}.

        Ends when the host closes the stream (the instance was deleted).
        """
        query = f"?since_seq={since_seq}" if since_seq is not None else ""
        async for msg in self._follow(f"/instances/{quote(instance_id, safe='')}/logs", query):
            if isinstance(msg, dict) and "error" in msg and "seq" not in msg:
                raise OperationFailed(404, {"detail": msg["error"]})
            yield msg

    async def follow_state(self, instance_id: str) -> AsyncIterator[dict[str, Any]]:
        """Messages of WS /instances/{id}/state: `instance_state` (runtime) and
        `instance_status` (lifecycle: starting, spawned, ready, failed, ...)."""
        async for msg in self._follow(f"/instances/{quote(instance_id, safe='')}/state", ""):
            if isinstance(msg, dict) and "error" in msg and "type" not in msg:
                raise OperationFailed(404, {"detail": msg["error"]})
            yield msg

    async def _follow(self, path: str, query: str) -> AsyncIterator[Any]:
        """JSON messages of one WebSocket stream until the host closes it.

        The key goes in the X-API-Key header, never in the URL (URLs end up in logs).
        """
        url = self.ws_url(path) + query
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        try:
            ws_cm = _ws_connect(url, headers, self.timeout)
            async with ws_cm as ws:
                while True:
                    try:
                        raw = await ws.recv()
                    except Exception as err:
                        _raise_for_close(err, self.url)
                        return
                    yield self._message(raw)
        except (OSError, TimeoutError) as err:
            raise HostUnreachable(f"cannot reach {self.url}: {err}") from None
        except ClientError:
            raise
        except Exception as err:  # websockets' handshake errors: the host answered, but not a WS
            if not type(err).__module__.startswith("websockets"):
                raise
            status = getattr(getattr(err, "response", None), "status_code", None)
            if status == 401:
                raise AuthFailed(f"{self.url} refused the API key") from None
            if status is not None:
                raise OperationFailed(status, {"detail": f"stream refused: {err}"}) from None
            raise HostUnreachable(f"stream from {self.url} failed: {err}") from None

    def _message(self, raw: str | bytes) -> dict[str, Any]:
        """One stream message: a JSON object, else UnexpectedAnswer (a proxy's banner, a
        message cut short)."""
        try:
            msg = json.loads(raw)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict):
            raise UnexpectedAnswer(
                f"the host at {self.url} sent a stream message that is not a JSON object"
            )
        return msg


def _ws_connect(url: str, headers: dict[str, str], timeout: float) -> Any:
    # websockets >= 13 has the new asyncio client (additional_headers); older ones the legacy.
    try:
        from websockets.asyncio.client import connect
    except ImportError:  # pragma: no cover - old websockets
        import websockets

        return websockets.connect(url, extra_headers=headers, open_timeout=timeout)
    return connect(url, additional_headers=headers, open_timeout=timeout, max_size=None)


def _raise_for_close(err: Exception, url: str) -> None:
    """A normal close ends the stream; 1008 after accept is the host refusing the key."""
    rcvd = getattr(err, "rcvd", None)
    code = getattr(rcvd, "code", None)
    if code == 1008:
        reason = getattr(rcvd, "reason", "") or "policy violation"
        if "key" in reason.lower():
            raise AuthFailed(f"{url} refused the API key: {reason}") from None
        raise OperationFailed(404, {"detail": reason}) from None
    if code in (1000, 1001, None) and type(err).__name__.startswith("ConnectionClosed"):
        return
    if type(err).__name__.startswith("ConnectionClosed"):
        raise HostUnreachable(f"stream from {url} closed: {err}") from None
    raise err
